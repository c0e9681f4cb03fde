"""`xpu run -- CMD` against `CMD`: the same exit code or death by the same signal, the same stdin, stdout,
stderr and inherited descriptors, the shell's 126/127 when the command cannot start."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from tests.conftest import BIN, xpu_env


@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
    """One simulated daemon for the module (MPS cards: every run gets a real slice environment)."""
    import shutil
    import tempfile
    from pathlib import Path

    from tests.daemons import DaemonProc

    base = Path(tempfile.mkdtemp(prefix="xpu-", dir="/tmp"))
    d = DaemonProc(base, "pcie-8x-l40s", "[leases]\ngrace_s = 30.0\n").start()
    yield d
    d.kill(signal.SIGTERM)
    shutil.rmtree(base, ignore_errors=True)


def both(runtime, argv, **kw):
    """(direct, wrapped) CompletedProcess for the same command."""
    env = xpu_env(runtime.runtime_dir)
    direct = subprocess.run(argv, env=env, capture_output=True, timeout=60, **kw)
    wrapped = subprocess.run(
        [str(BIN / "xpu"), "run", "--mode", "vxpu-quarter", "--", *argv],
        env=env,
        capture_output=True,
        timeout=60,
        **kw,
    )
    return direct, wrapped


@pytest.mark.parametrize("code", [0, 1, 3, 42, 126, 255])
def test_exit_codes(runtime, code):
    direct, wrapped = both(runtime, ["sh", "-c", f"exit {code}"])
    assert direct.returncode == wrapped.returncode == code
    assert wrapped.stdout == wrapped.stderr == b""


@pytest.mark.parametrize(
    "sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL, signal.SIGHUP, signal.SIGSEGV, signal.SIGUSR1]
)
def test_death_by_a_signal_is_passed_on_as_death_by_that_signal(runtime, sig):
    direct, wrapped = both(runtime, ["sh", "-c", f"kill -{sig.name.removeprefix('SIG')} $$"])
    assert direct.returncode == wrapped.returncode == -sig
    # and a shell sees 128 + n, as for the command itself
    sh = subprocess.run(
        [
            "sh",
            "-c",
            f'"$0" run -m vxpu-quarter -- sh -c "kill -{sig.name[3:]} \\$\\$"; echo "rc=$?"',
            BIN / "xpu",
        ],
        env=xpu_env(runtime.runtime_dir),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert sh.stdout.strip() == f"rc={128 + sig}"
    assert not list(runtime.base.glob("core*")) and not os.path.exists("core")


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGINT, signal.SIGQUIT])
def test_a_signal_the_caller_ignores_stays_ignored_in_the_command(runtime, sig):
    """`nohup xpu run -- CMD` (or a background job of a script: SIGINT and SIGQUIT) as `nohup CMD`: the
    command inherits the signal ignored, so the one sent to it does nothing."""
    name = sig.name.removeprefix("SIG")

    def ignore():
        signal.signal(sig, signal.SIG_IGN)

    direct, wrapped = both(runtime, ["sh", "-c", f"kill -{name} $$; echo survived"], preexec_fn=ignore)
    assert direct.stdout == wrapped.stdout == b"survived\n"
    assert direct.returncode == wrapped.returncode == 0


def test_stdin_to_stdout_binary_and_large(runtime):
    data = os.urandom(3 << 20)
    direct, wrapped = both(runtime, ["cat"], input=data)
    assert direct.stdout == wrapped.stdout == data and wrapped.returncode == 0
    direct, wrapped = both(runtime, ["sh", "-c", "head -c 60000000 /dev/zero | tr '\\0' x"])
    assert len(wrapped.stdout) == 60_000_000 and direct.stdout == wrapped.stdout


def test_stdout_and_stderr_are_the_command_s_own(runtime):
    direct, wrapped = both(runtime, ["sh", "-c", "echo out; echo err >&2; printf 'no newline'"])
    assert (
        (direct.stdout, direct.stderr) == (wrapped.stdout, wrapped.stderr) == (b"out\nno newline", b"err\n")
    )


def test_a_closed_pipe_ends_the_command_as_it_would_directly(runtime):
    env = xpu_env(runtime.runtime_dir)
    codes = []
    for argv in (["yes"], [str(BIN / "xpu"), "run", "-m", "vxpu-quarter", "--", "yes"]):
        producer = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE)
        head = subprocess.run(["head", "-c", "10"], stdin=producer.stdout, capture_output=True, timeout=30)
        producer.stdout.close()
        codes.append((producer.wait(30), head.stdout))
    assert codes[0] == codes[1] == (-signal.SIGPIPE, b"y\ny\ny\ny\ny\n")


def test_command_not_found_and_not_executable(runtime, tmp_path):
    direct = subprocess.run(["sh", "-c", "no-such-command-xyz"], capture_output=True, timeout=30)
    r = runtime.xpu("run", "-m", "vxpu-quarter", "--", "no-such-command-xyz")
    assert direct.returncode == r.returncode == 127
    assert r.stderr == "xpu: no-such-command-xyz: command not found\n"
    script = tmp_path / "script.sh"
    script.write_text("#!/bin/sh\necho hi\n")
    script.chmod(0o644)
    direct = subprocess.run(["sh", "-c", str(script)], capture_output=True, timeout=30)
    r = runtime.xpu("run", "-m", "vxpu-quarter", "--", str(script))
    assert direct.returncode == r.returncode == 126 and "permission denied" in r.stderr
    r = runtime.xpu("run", "-m", "vxpu-quarter", "--", str(tmp_path))
    assert r.returncode == 126
    with runtime.client() as c:
        assert list(c.leases().leases) == []  # every lease released even when nothing ran


def test_inherited_descriptors_are_passed_on(runtime, tmp_path):
    f = tmp_path / "extra"
    f.write_text("from an inherited descriptor\n")
    with open(f) as extra:
        n = extra.fileno()
        os.set_inheritable(n, True)
        cmd = ["sh", "-c", f"cat /dev/fd/{n}; ls /proc/self/fd | sort -n | tr '\\n' ' '"]
        direct, wrapped = both(runtime, cmd, pass_fds=(n,))
    assert direct.stdout.startswith(b"from an inherited descriptor\n")
    # the same descriptors: the inherited one passed on, the wrapper's own (gRPC, pipes) not leaked
    assert direct.stdout == wrapped.stdout and f" {n} ".encode() in wrapped.stdout


def test_environment_is_ours_plus_the_lease_s(runtime):
    r = runtime.xpu(
        "run",
        "-m",
        "vxpu-half",
        "--",
        "sh",
        "-c",
        'echo "$MY_VAR|$XPU_MODE|$XPU_RESTART_COUNT|$XPU_LEASE_ID"',
    )
    env_var = subprocess.run(
        [str(BIN / "xpu"), "run", "-m", "vxpu-half", "--", "sh", "-c", 'echo "$MY_VAR|$XPU_MODE"'],
        env={**xpu_env(runtime.runtime_dir), "MY_VAR": "kept"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert env_var.stdout == "kept|vxpu-half\n"
    _, mode, restarts, lease = r.stdout.strip().split("|")
    assert (mode, restarts) == ("vxpu-half", "0") and len(lease) == 8


def test_signals_ignored_by_our_parent_stay_ignored(runtime):
    # A parent (here a shell with trap '') starts us with SIGINT and SIGHUP ignored: so is the command.
    ignoring = ["sh", "-c", 'trap "" INT HUP; exec "$@"', "sh"]
    cmd = ["sh", "-c", "kill -INT $$; kill -HUP $$; echo survived"]
    env = xpu_env(runtime.runtime_dir)
    direct = subprocess.run([*ignoring, *cmd], env=env, capture_output=True, timeout=60)
    xpu = [str(BIN / "xpu"), "run", "-m", "vxpu-quarter", "--"]
    wrapped = subprocess.run([*ignoring, *xpu, *cmd], env=env, capture_output=True, timeout=60)
    assert direct.stdout == wrapped.stdout == b"survived\n"
    assert direct.returncode == wrapped.returncode == 0
