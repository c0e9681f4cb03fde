"""`xpu run` against a scripted lease stream: queue lines, moves of --restartable leases (stop, ack,
restart with the new environment and XPU_RESTART_COUNT), revokes, lost holds, errors before a grant.

The daemon's side of moves belongs to the health work; here the stream is scripted, so the client's
behaviour is pinned down whatever the engine does."""

from __future__ import annotations

import signal
import threading
import time

import grpc
import pytest
from xpu_cli.child import Outcome
from xpu_cli.run import run

from xpud.api.v1 import xpu_pb2 as pb
from xpud.errors import Conflict, NoCapacity


class _RpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str = ""):
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


class Call:
    """A server stream played from a generator; after it, blocks until cancelled, as a held stream does."""

    def __init__(self, script):
        self.script = script
        self.cancelled = threading.Event()

    def __iter__(self):
        yield from self.script()
        self.cancelled.wait(60)
        raise _RpcError(grpc.StatusCode.CANCELLED, "cancelled")

    def cancel(self):
        self.cancelled.set()


class ScriptedClient:
    socket = "scripted.sock"

    def __init__(self, script, moved=None, hold=None):
        self.script, self.moved, self.hold_script = script, moved, hold
        self.acks, self.released, self.requests, self.reports = [], [], [], []

    def acquire(self, **request):
        self.requests.append(request)
        return Call(self.script)

    def hold(self, lease_id, token):
        if self.hold_script is None:
            raise _RpcError(grpc.StatusCode.NOT_FOUND, f"no active lease {lease_id!r}")
        return Call(self.hold_script)

    def ack_move(self, lease_id, token):
        self.acks.append((lease_id, token))
        if self.moved is None:
            raise Conflict(f"no move is pending for lease {lease_id}")
        return self.moved

    def confine(self, lease_id, token):  # the daemon of a simulated machine: isolation is advisory
        return pb.ConfineReply(enforced=False, isolation="advisory (simulated cards)", warn=False)

    def release(self, lease_id, token="", exit_code=None, exit_signal=None, started=0.0):
        self.released.append(lease_id)
        self.reports.append((exit_code, exit_signal))

    def _metadata(self, renew=False):
        return ()


def lease(card: int, restarts: int = 0, restartable: bool = True) -> pb.Lease:
    return pb.Lease(
        id="L1",
        mode="vxpu-half",
        cards=[card],
        env={"CUDA_VISIBLE_DEVICES": f"GPU-{card}", "XPU_LEASE_ID": "L1"},
        restartable=restartable,
        restart_count=restarts,
    )


def granted(le: pb.Lease) -> pb.AcquireUpdate:
    return pb.AcquireUpdate(granted=pb.Granted(lease=le, token="tok"))


def event(kind: str, le: pb.Lease, message: str = "") -> pb.AcquireUpdate:
    return pb.AcquireUpdate(event=pb.LeaseEvent(kind=kind, lease_id=le.id, message=message, lease=le))


def lines_in(path, n: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not (path.exists() and path.read_text().count("\n") >= n):
        assert time.monotonic() < deadline, f"{path} has no {n} line(s)"
        time.sleep(0.02)


def test_a_move_restarts_the_command_with_the_new_placement(tmp_path, capsys):
    out = tmp_path / "out"
    first, second = lease(0), lease(3, restarts=1)

    def script():
        yield pb.AcquireUpdate(
            queued=pb.Queued(ticket="t", position=2, queue_length=3, deadline=time.time() + 60)
        )
        yield pb.AcquireUpdate(
            queued=pb.Queued(ticket="t", position=1, queue_length=2, deadline=time.time() + 60)
        )
        yield granted(first)
        lines_in(out, 1)
        yield event("move", first, "card 0 unhealthy")

    client = ScriptedClient(script, moved=second)
    argv = [
        "sh",
        "-c",
        f'echo "$XPU_RESTART_COUNT $CUDA_VISIBLE_DEVICES" >> {out}; '
        '[ "$XPU_RESTART_COUNT" = 1 ] && exit 7; exec sleep 60',
    ]
    t = time.monotonic()
    outcome = run(client, argv, "vxpu-half", restartable=True, kill_grace_s=5)
    assert outcome == Outcome(7) and time.monotonic() - t < 5  # the first run stopped on SIGTERM
    assert out.read_text() == "0 GPU-0\n1 GPU-3\n"
    assert client.acks == [("L1", "tok")] and client.released == ["L1"]
    assert client.reports == [(7, None)]  # how the command ended goes to the daemon at release
    assert client.requests[0]["restartable"] and client.requests[0]["command"].startswith("sh -c ")
    err = capsys.readouterr().err
    assert "xpu: queued for vxpu-half: position 2 of 3" in err  # without a terminal: one line ...
    assert "position 1 of 2" not in err  # ... and no more than one every 5 s
    assert "is moving (card 0 unhealthy)" in err and "restarting the command on card 3 (restart 1)" in err


def test_restart_count_keeps_counting_across_moves(tmp_path):
    out = tmp_path / "out"
    leases = [lease(0), lease(1, restarts=0), lease(2, restarts=0)]  # a daemon that does not count

    def script():
        yield granted(leases[0])
        for n in range(2):
            lines_in(out, n + 1)
            yield event("move", leases[n])

    class Moves(ScriptedClient):
        def ack_move(self, lease_id, token):
            self.acks.append(lease_id)
            return leases[len(self.acks)]

    argv = [
        "sh",
        "-c",
        f'echo "$XPU_RESTART_COUNT" >> {out}; [ "$XPU_RESTART_COUNT" = 2 ] && exit 0; exec sleep 60',
    ]
    assert run(Moves(script), argv, "vxpu-half", restartable=True, kill_grace_s=5) == Outcome(0)
    assert out.read_text() == "0\n1\n2\n"


def test_a_failed_move_acknowledgement_ends_with_1(tmp_path, capsys):
    out = tmp_path / "out"

    def script():
        yield granted(lease(0))
        lines_in(out, 1)
        yield event("move", lease(0))

    client = ScriptedClient(script, moved=None)
    assert run(
        client, ["sh", "-c", f"echo x > {out}; exec sleep 60"], "vxpu-half", restartable=True
    ) == Outcome(1)
    assert "the move of lease L1 failed: no move is pending" in capsys.readouterr().err
    assert client.reports == [(None, None)]  # the wrapper gave up: the command's end is not known


def test_a_move_of_a_lease_that_is_not_restartable_is_ignored_and_a_revoke_stops_the_command(
    tmp_path, capsys
):
    out = tmp_path / "out"
    le = lease(0, restartable=False)

    def script():
        yield granted(le)
        lines_in(out, 1)
        yield event("move", le)
        yield event("mark", le, "card 0 degraded")
        time.sleep(0.3)
        yield event("revoke", le, "evicted by an operator: maintenance")

    outcome = run(ScriptedClient(script), ["sh", "-c", f"echo x > {out}; exec sleep 60"], "vxpu-half")
    assert outcome == Outcome(128 + signal.SIGTERM, signal.SIGTERM)
    err = capsys.readouterr().err
    assert "not --restartable" in err and "card 0 degraded" in err and "evicted by an operator" in err


def test_a_hold_the_daemon_no_longer_knows_stops_the_command(tmp_path, capsys):
    out = tmp_path / "out"

    def script():  # the Acquire stream breaks after the grant (the daemon restarted) ...
        yield granted(lease(0))
        lines_in(out, 1)
        raise _RpcError(grpc.StatusCode.UNAVAILABLE, "Socket closed")

    client = ScriptedClient(script, hold=None)  # ... and the new daemon does not know the lease
    outcome = run(client, ["sh", "-c", f"echo x > {out}; exec sleep 60"], "vxpu-half")
    assert outcome.signal == signal.SIGTERM
    assert "no active lease 'L1'" in capsys.readouterr().err


def test_a_hold_that_comes_back_keeps_the_command_running(tmp_path):
    out = tmp_path / "out"

    def script():
        yield granted(lease(0))
        lines_in(out, 1)
        raise _RpcError(grpc.StatusCode.UNAVAILABLE, "Socket closed")

    def hold():
        yield pb.LeaseEvent(kind="held", lease_id="L1")

    client = ScriptedClient(script, hold=hold)
    outcome = run(client, ["sh", "-c", f"echo x > {out}; sleep 0.5; exit 4"], "vxpu-half")
    assert outcome == Outcome(4) and client.released == ["L1"] and client.reports == [(4, None)]


def test_an_error_before_the_grant_is_raised(tmp_path):
    def script():
        yield pb.AcquireUpdate(
            queued=pb.Queued(ticket="t", position=1, queue_length=1, deadline=time.time() + 1)
        )
        raise _RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, "waited 1 s: no card has room")

    with pytest.raises(NoCapacity, match="waited 1 s"):
        run(ScriptedClient(script), ["true"], "vxpu-half", wait_s=1)
    # and the signal handlers are ours again
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
