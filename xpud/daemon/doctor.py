"""``xpud doctor``: check a host as an operator would before it goes live. Changes nothing.

Each check gives one line, ``ok``, ``warn``, ``fail`` or ``skip``, and for warn and fail the fix. The exit
status is 1 when a check fails, else 0. Checks: the driver and NVML, MIG capability and mode per card,
persistence mode, the NVSwitch fabric (trained by the Fabric Manager, where the cards have one), device
isolation, the device nodes' modes and EXCLUSIVE_PROCESS on cards serving MPS (``doctor_isolation.py``),
``/dev/nvidia-uvm`` (CUDA needs it; the unit's ProtectKernelModules=yes keeps xpud from loading it),
``nvidia-cuda-mps-control`` where MPS will serve slices, the admin group, ``setpriv``
(the user switch of warm commands and ranks), the daemon's sockets and state directory, the installed unit
(its ExecStart and its device access against the ``/dev/nvidia*`` nodes), and with ``[cluster]``: the peer
certificate, each peer reached over mutual TLS, and the clock skew against them.

With ``--simulate MACHINE`` the driver is the fake (``xpud.hw.fakenvml``), the NVIDIA tools the simulated
ones, and the device nodes those the NVIDIA driver makes for that machine.
"""

from __future__ import annotations

import fnmatch
import grp
import os
import stat
from dataclasses import asdict
from pathlib import Path

from xpud import config
from xpud.daemon.checks import FAIL, OK, SKIP, WARN, Check, DeviceNode, Host
from xpud.errors import XpudError

UNIT_DIRS = ("etc/systemd/system", "usr/lib/systemd/system", "lib/systemd/system")
# Device nodes the daemon and what it starts (MPS control daemons and servers, MIG) open: the rest of
# /dev/nvidia* (NVSwitch, modeset) only need to be allowed where something else uses them. Major 195 is
# "nvidia" (cards) and "nvidiactl" from driver 545 on, "nvidia-frontend" before (systemd/xpud.service).
NEEDED_GROUPS = ("nvidia", "nvidiactl", "nvidia-frontend", "nvidia-uvm", "nvidia-caps")


# ----------------------------------------------------------------------------------- device nodes


def real_devices(dev: Path = Path("/dev"), proc_devices: Path = Path("/proc/devices")):
    """The character nodes /dev/nvidia* and /dev/nvidia-caps/*, and /proc/devices' char groups."""
    nodes = []
    for p in sorted([*dev.glob("nvidia*"), *dev.glob("nvidia-caps/*")]):
        try:
            st = p.stat()
        except OSError:
            continue
        if stat.S_ISCHR(st.st_mode):
            nodes.append(DeviceNode(str(p), os.major(st.st_rdev), os.minor(st.st_rdev)))
    groups: dict[int, tuple[str, ...]] = {}
    try:
        text = proc_devices.read_text()
    except OSError:
        text = ""
    section = text.split("Character devices:", 1)[-1].split("Block devices:", 1)[0]
    for line in section.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0].isdigit():
            groups[int(parts[0])] = (*groups.get(int(parts[0]), ()), parts[1])
    return nodes, groups


# Majors as the NVIDIA driver registers them: 195 is fixed, the others are given out at load time.
_SIM_MAJORS = {"nvidia-frontend": 195, "nvidia-uvm": 509, "nvidia-caps": 236, "nvidia-nvswitch": 508}


def simulated_devices(machine) -> tuple[list[DeviceNode], dict[int, tuple[str, ...]]]:
    """The nodes the NVIDIA driver makes for a simulated ``machine`` (``xpud.hw.machines.Machine``):
    nvidiaN per card and nvidiactl (major 195), nvidia-uvm and nvidia-uvm-tools, the MIG capabilities
    /dev/nvidia-caps/nvidia-cap1 and -cap2 where a card has MIG, and NVSwitch nodes where cards use them.
    Major 195's names follow the machine's driver version: "nvidia", "nvidiactl" and "nvidia-modeset" from
    545 on (open-gpu-kernel-modules nv.c), "nvidia-frontend" before (nv-frontend.c)."""
    m = _SIM_MAJORS
    nodes = [DeviceNode(f"/dev/nvidia{c.index}", m["nvidia-frontend"], c.index) for c in machine.cards]
    nodes += [
        DeviceNode("/dev/nvidiactl", m["nvidia-frontend"], 255),
        DeviceNode("/dev/nvidia-uvm", m["nvidia-uvm"], 0),
        DeviceNode("/dev/nvidia-uvm-tools", m["nvidia-uvm"], 1),
    ]
    if any(c.model.mig_capable for c in machine.cards):
        nodes += [DeviceNode(f"/dev/nvidia-caps/nvidia-cap{i}", m["nvidia-caps"], i) for i in (1, 2)]
    if any(c.nvlink_switch_links for c in machine.cards):
        nodes += [
            DeviceNode(f"/dev/nvidia-nvswitch{i}", m["nvidia-nvswitch"], i)
            for i in range(machine.nvswitch_count)
        ]
        nodes.append(DeviceNode("/dev/nvidia-nvswitchctl", m["nvidia-nvswitch"], 255))
    groups = {major: (name,) for name, major in m.items()}
    if _version(machine.driver_version) >= (545,):
        groups[195] = ("nvidia", "nvidiactl", "nvidia-modeset")
    return nodes, groups


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for p in text.split("."):
        if not p.isdigit():
            break
        parts.append(int(p))
    return tuple(parts)


# ----------------------------------------------------------------------------------------- checks


def run_checks(cfg: config.Config, host: Host) -> list[Check]:
    """Every check, in the order an operator reads them."""
    checks: list[Check] = []
    checks += _gpu_checks(cfg, host)
    checks.append(_uvm(host))
    from xpud.daemon.doctor_isolation import isolation_checks

    checks += isolation_checks(cfg, host)
    checks.append(_admin_group(cfg, host))
    checks.append(_user_switch(host))
    checks += _daemon_dirs(cfg)
    checks += _unit(host)
    checks += _cluster(cfg)
    if cfg.cluster.enabled:
        checks.append(accounts_hash(cfg))
    return checks


def accounts_hash(cfg: config.Config) -> Check:
    """With [cluster]: this host's [accounts] config hash against the one each peer publishes (through the
    local daemon's cluster view): fair share needs the same accounts on every host (issue #33)."""
    from xpud.api.client import Client
    from xpud.config.accounts import config_hash

    if not cfg.cluster.enabled:
        return Check("accounts config", SKIP, "no [cluster] configured: no peers to compare [accounts] with")
    mine = config_hash(cfg.accounts, cfg.named_accounts) if cfg.named_accounts else ""
    try:
        with Client(cfg.runtime_dir, timeout=3.0) as c:
            reply = c.cluster()
    except (XpudError, OSError) as e:
        return Check("accounts config", SKIP, f"the local xpud does not answer ({e}): no cluster view")
    peers = [h for h in reply.hosts if not h.self and h.state == "alive" and h.summary_valid]
    differ = [h for h in peers if h.accounts_hash != mine]
    if differ:
        what = ", ".join(f"{h.name} ({h.accounts_hash or 'no accounts'})" for h in differ[:8])
        return Check(
            "accounts config",
            FAIL,
            f"[accounts] hash {mine or 'none (no accounts)'} here differs from {what}",
            "give every host the same [accounts] and [accounts.NAME] tables in xpud.toml, then reload",
        )
    return Check(
        "accounts config", OK, f"[accounts] hash {mine or 'none'} is the same on {len(peers)} peer(s)"
    )


def _gpu_checks(cfg: config.Config, host: Host) -> list[Check]:
    from xpud.hw.nvml import Nvml, NvmlError

    nvml = Nvml(host.lib)
    try:
        nvml.open()
    except NvmlError as e:
        return [
            Check(
                "driver",
                FAIL,
                f"NVML is not reachable: {e}",
                "install or load the NVIDIA driver "
                "(nvidia-smi must list the cards), or run with --simulate MACHINE",
            ),
            Check("mig", SKIP, "no NVML"),
            Check("persistence", SKIP, "no NVML"),
            Check("fabric", SKIP, "no NVML"),
            Check("mps", SKIP, "no NVML"),
        ]
    try:
        return _with_nvml(cfg, host, nvml)
    finally:
        nvml.close()


def _with_nvml(cfg: config.Config, host: Host, nvml) -> list[Check]:
    from xpud.hw.nvml import NvmlError

    checks = []
    lost = []
    cards = []
    for i in range(nvml.card_count()):
        try:
            info = nvml.card_info(i)  # a card off the bus reads as a placeholder here ...
            nvml.mig_mode(i)  # ... and fails here
            cards.append(info)
        except NvmlError as e:
            lost.append(Check(f"card GPU{i}", FAIL, f"GPU{i}: {e}", _LOST_FIX.format(i=i)))
    where = " (simulated)" if host.simulated else ""
    driver = f"NVIDIA driver {nvml.driver_version() or '?'}, CUDA {nvml.cuda_version() or '?'}{where}"
    if not cards and not lost:
        checks.append(
            Check("driver", FAIL, f"{driver}: NVML reachable but no cards", "check `nvidia-smi -L`")
        )
    else:
        checks.append(Check("driver", OK, f"{driver}: NVML reachable, {len(cards) + len(lost)} card(s)"))
    checks += lost

    mps_cards = []
    for c in cards:
        mode = nvml.mig_mode(c.index)
        name = f"mig GPU{c.index}"
        if mode is None:
            if cfg.cards.isolation == "mig":
                checks.append(
                    Check(
                        name,
                        FAIL,
                        f'{c.name}: no MIG, but [cards] isolation = "mig"',
                        'set [cards] isolation = "auto" (MPS on cards without MIG) in the config',
                    )
                )
            else:
                checks.append(Check(name, OK, f"{c.name}: no MIG" + _slices_by(cfg, "MPS")))
            if cfg.cards.isolation in ("auto", "mps"):
                mps_cards.append(c.index)
            continue
        current, pending = mode
        state = "on" if current else "off"
        if current != pending:
            checks.append(
                Check(
                    name,
                    WARN,
                    f"{c.name}: MIG {state}, {'on' if pending else 'off'} pending (needs a GPU reset)",
                    f"to apply it: stop the processes on GPU{c.index}, then `nvidia-smi -i {c.index} "
                    f"--gpu-reset` (or reboot); to cancel it: `nvidia-smi -i {c.index} -mig {int(current)}` "
                    "(a pending mode otherwise flips at the next reset)",
                )
            )
        else:
            checks.append(Check(name, OK, f"{c.name}: MIG capable, MIG {state}" + _slices_by(cfg, "MIG")))
        if cfg.cards.isolation == "mps" or (
            cfg.cards.isolation == "auto" and cfg.cards.mig_switch == "never" and not current
        ):
            mps_cards.append(c.index)

    off = []
    unknown = []
    for c in cards:
        try:
            on = nvml.persistence_mode(c.index)
        except NvmlError:  # the card went off the bus since: its own line says so at the next run
            on = None
        (unknown if on is None else off if not on else []).append(c.index)
    if off:
        gpus = ",".join(f"GPU{i}" for i in off)
        checks.append(
            Check(
                "persistence",
                WARN,
                f"persistence mode off on {gpus}: the driver unloads when idle "
                "(slow first calls, MIG and clock settings lost)",
                "systemctl enable --now nvidia-persistenced (or nvidia-smi -pm 1)",
            )
        )
    elif unknown and len(unknown) == len(cards):
        checks.append(Check("persistence", SKIP, "the driver does not report persistence mode"))
    else:
        checks.append(Check("persistence", OK, f"persistence mode on ({len(cards) - len(unknown)} card(s))"))

    checks.append(_fabric(nvml, cards))
    from xpud.daemon.doctor_isolation import mps_compute_mode

    checks += [c for c in [mps_compute_mode(cfg, nvml, mps_cards)] if c is not None]

    if not mps_cards:
        checks.append(
            Check("mps", SKIP, f'no card will use MPS ([cards] isolation = "{cfg.cards.isolation}")')
        )
    else:
        tools = host.tools or _real_tools()
        path = tools.which("nvidia-cuda-mps-control")
        gpus = ",".join(f"GPU{i}" for i in mps_cards)
        if path:
            checks.append(Check("mps", OK, f"nvidia-cuda-mps-control at {path} (MPS slices on {gpus})"))
        else:
            checks.append(
                Check(
                    "mps",
                    FAIL,
                    f"nvidia-cuda-mps-control not found, but {gpus} will use MPS",
                    "install the NVIDIA driver's utilities (nvidia-utils / cuda-drivers), or set "
                    '[cards] isolation = "none"',
                )
            )
    return checks


def _fabric(nvml, cards) -> Check:
    """NVSwitch systems (HGX/DGX H100, H200): CUDA fails on a card until the Fabric Manager has trained its
    fabric (nvmlDeviceGetGpuFabricInfoV: state COMPLETED, status SUCCESS)."""
    import pynvml

    from xpud.hw.nvml import NvmlError

    states = {}
    for c in cards:
        try:
            states[c.index] = nvml.fabric(c.index)
        except NvmlError:
            states[c.index] = None  # off the bus since: its own line says so
    on = {i: st for i, st in states.items() if st is not None}
    if not on:
        return Check("fabric", SKIP, "no NVSwitch fabric (the cards report none)")
    done = (pynvml.NVML_GPU_FABRIC_STATE_COMPLETED, pynvml.NVML_SUCCESS)
    bad = {i: st for i, st in on.items() if st != done}
    if not bad:
        return Check("fabric", OK, f"NVSwitch fabric trained on {len(on)} card(s)")
    words = {1: "not started", 2: "in progress", 3: "failed"}
    gpus = ", ".join(f"GPU{i} {words.get(st[0], f'state {st[0]}')}" for i, st in sorted(bad.items()))
    return Check(
        "fabric",
        FAIL,
        f"NVSwitch fabric not trained ({gpus}): CUDA fails on these cards and xpud keeps them out of service",
        "systemctl enable --now nvidia-fabricmanager (its version must match the driver's); "
        "see journalctl -u nvidia-fabricmanager",
    )


def _uvm(host: Host) -> Check:
    """CUDA needs /dev/nvidia-uvm. The unit runs `nvidia-modprobe -u -c=0` before xpud (ProtectKernelModules=
    yes keeps the daemon, and the CUDA libraries in it, from loading the module themselves)."""
    nodes, _ = (host.devices or real_devices)()
    if not nodes:
        return Check("uvm", SKIP, "no /dev/nvidia* nodes on this host")
    if any(n.path == "/dev/nvidia-uvm" for n in nodes):
        return Check("uvm", OK, "/dev/nvidia-uvm is there (nvidia-uvm loaded)")
    return Check(
        "uvm",
        FAIL,
        "/dev/nvidia-uvm is missing: nvidia-uvm is not loaded, so CUDA cannot start, and the unit's "
        "ProtectKernelModules=yes keeps xpud from loading it",
        "nvidia-modprobe -u -c=0 (the unit's ExecStartPre runs it), and load it at boot: "
        "echo nvidia-uvm > /etc/modules-load.d/nvidia-uvm.conf",
    )


_LOST_FIX = (
    "look at `nvidia-smi -q -i {i}` and the kernel log (XID); a card off the bus needs a reset "
    "(nvidia-smi -r -i {i}) or a reboot"
)


def _slices_by(cfg: config.Config, kind: str) -> str:
    return "" if cfg.cards.isolation == "none" else f" (slices use {kind})"


def _real_tools():
    from xpud.isolation.runner import CommandRunner

    return CommandRunner()


def _group_gid(host: Host, name: str) -> int | None:
    if host.group_lookup is not None:
        return host.group_lookup(name)
    if host.root.resolve() != Path("/"):
        try:
            for line in (host.root / "etc/group").read_text().splitlines():
                parts = line.split(":")
                if len(parts) >= 3 and parts[0] == name:
                    return int(parts[2])
        except (OSError, ValueError):
            pass
        return None
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        return None


def _admin_group(cfg: config.Config, host: Host) -> Check:
    name = cfg.daemon.admin_group
    gid = _group_gid(host, name)
    if gid is None:
        return Check(
            "admin group",
            FAIL,
            f"group {name!r} ([daemon] admin_group) does not exist: only root can use admin.sock",
            f"xpud install-service (systemd-sysusers makes it), or groupadd --system {name}",
        )
    return Check("admin group", OK, f"group {name!r} exists (gid {gid})")


def _user_switch(host: Host) -> Check:
    """``setpriv`` starts warm commands, and ranks outside systemd, as their users
    (xpud.isolation.switch_user)."""
    for d in ("usr/bin", "bin", "usr/sbin", "sbin"):
        p = host.root / d / "setpriv"
        if p.is_file() and os.access(p, os.X_OK):
            return Check("user switch", OK, f"setpriv at /{d}/setpriv")
    return Check(
        "user switch",
        WARN,
        "setpriv not found: warm commands, and multi-host ranks outside systemd, cannot start as their users",
        "install util-linux (it has setpriv)",
    )


def _mode(path: Path) -> int | None:
    try:
        return stat.S_IMODE(path.stat().st_mode)
    except OSError:
        return None


def _daemon_dirs(cfg: config.Config) -> list[Check]:
    checks = []
    run, state = cfg.runtime_dir, cfg.state_dir
    user, admin, cred = run / "xpud.sock", run / "admin.sock", run / "cred.sock"
    if not user.is_socket():
        checks.append(
            Check(
                "sockets",
                WARN,
                f"{user}: no socket (xpud is not running): socket permissions not checked",
                "systemctl enable --now xpud, then run xpud doctor again",
            )
        )
    else:
        problems, fixes, worst = [], [], OK
        for sock in (user, cred):
            mode = _mode(sock)
            if mode is not None and mode & 0o666 != 0o666:
                problems.append(f"{sock} is {mode:o}: users cannot connect")
                worst = FAIL
        mode = _mode(admin)
        if mode is None:
            problems.append(f"{admin} is missing")
            worst = FAIL
        elif mode & 0o007:
            problems.append(f"{admin} is {mode:o}: anyone can use the operators' socket")
            worst = FAIL
        else:
            gid = _group_gid(Host(), cfg.daemon.admin_group)
            owner = admin.stat().st_gid
            if os.geteuid() == 0 and gid is not None and owner != gid:
                problems.append(f"{admin} belongs to gid {owner}, not {cfg.daemon.admin_group!r}")
                worst = WARN if worst == OK else worst
        if problems:
            fixes.append("systemctl restart xpud (the daemon sets the modes and the group at start)")
            checks.append(Check("sockets", worst, "; ".join(problems), fixes[0]))
        else:
            checks.append(
                Check("sockets", OK, f"{run}: xpud.sock and cred.sock 666, admin.sock {_mode(admin):o}")
            )
    mode = _mode(state)
    if mode is None:
        checks.append(
            Check("state dir", SKIP, f"{state} does not exist yet (the unit's StateDirectory= makes it)")
        )
    elif mode & 0o002:
        checks.append(
            Check(
                "state dir", FAIL, f"{state} is {mode:o}: anyone can replace the ledger", f"chmod 700 {state}"
            )
        )
    elif mode & 0o077:
        checks.append(
            Check(
                "state dir",
                WARN,
                f"{state} is {mode:o}: others can read the ledger (lease commands and owners)",
                f"chmod 700 {state}",
            )
        )
    else:
        checks.append(Check("state dir", OK, f"{state} is {mode:o}"))
    return checks


# -------------------------------------------------------------------------------------- the unit


def find_unit(root: Path) -> Path | None:
    for d in UNIT_DIRS:
        p = root / d / "xpud.service"
        if p.is_file():
            return p
    return None


def unit_settings(unit: Path) -> dict[str, list[str]]:
    """[Service] settings of the unit and its drop-ins (xpud.service.d/*.conf), in order; an empty
    assignment resets a list, as systemd reads it."""
    files = [unit, *sorted((unit.parent / "xpud.service.d").glob("*.conf"))]
    out: dict[str, list[str]] = {}
    for f in files:
        section = ""
        for raw in f.read_text().splitlines():
            line = raw.strip()
            if not line or line[0] in "#;":
                continue
            if line.startswith("["):
                section = line
                continue
            if section != "[Service]" or "=" not in line:
                continue
            key, value = (s.strip() for s in line.split("=", 1))
            if value:
                out.setdefault(key, []).append(value)
            else:
                out[key] = []
    return out


def device_access(
    settings: dict[str, list[str]], nodes: list[DeviceNode], groups: dict[int, tuple[str, ...]]
):
    """(denied nodes, nodes allowed read-only) under the unit's DevicePolicy= and DeviceAllow=."""
    allows = settings.get("DeviceAllow", [])
    policy = (settings.get("DevicePolicy") or ["auto"])[-1]
    if policy == "auto" and not allows:
        return [], []
    denied, readonly = [], []
    for node in nodes:
        modes = ""
        for entry in allows:
            spec, _, access = entry.partition(" ")
            access = access.strip() or "rwm"
            if spec.startswith("char-"):
                hit = any(fnmatch.fnmatchcase(g, spec[5:]) for g in groups.get(node.major, ()))
            else:
                hit = spec == node.path
            if hit:
                modes += access
        if not modes:
            denied.append(node)
        elif not ("r" in modes and "w" in modes):
            readonly.append(node)
    return denied, readonly


def _unit(host: Host) -> list[Check]:
    unit = find_unit(host.root)
    if unit is None:
        return [
            Check(
                "unit",
                WARN,
                f"no xpud.service under {host.root} (etc/systemd/system, usr/lib/systemd/system)",
                "xpud install-service",
            ),
            Check("unit devices", SKIP, "no unit"),
        ]
    settings = unit_settings(unit)
    checks = []
    exec_start = (settings.get("ExecStart") or [""])[-1].lstrip("@-:+!")
    program = exec_start.split()[0] if exec_start else ""
    target = host.root / program.lstrip("/")
    if not program or not (target.is_file() and os.access(target, os.X_OK)):
        checks.append(
            Check(
                "unit",
                FAIL,
                f"{unit}: ExecStart runs {program or 'nothing'}, which is not an executable here",
                "xpud install-service (it points ExecStart at the installed xpud)",
            )
        )
    else:
        checks.append(Check("unit", OK, f"{unit}: ExecStart {program}"))
    nodes, groups = (host.devices or real_devices)()
    if not nodes:
        checks.append(Check("unit devices", SKIP, "no /dev/nvidia* nodes on this host"))
        return checks
    denied, readonly = device_access(settings, nodes, groups)
    needed = [n for n in denied + readonly if set(groups.get(n.major, ())) & set(NEEDED_GROUPS)]
    other = [n for n in denied if n not in needed]
    if needed:
        names = ", ".join(f"{n.path} ({'/'.join(groups.get(n.major, ())) or n.major})" for n in needed)
        checks.append(
            Check(
                "unit devices",
                FAIL,
                f"the unit does not let xpud read and write {names}",
                "add DeviceAllow=char-<group> rw lines to the unit (xpud install-service writes "
                "them), then systemctl daemon-reload && systemctl restart xpud",
            )
        )
    else:
        note = f"; not allowed (xpud does not use them): {', '.join(n.path for n in other)}" if other else ""
        checks.append(
            Check(
                "unit devices",
                OK,
                f"the unit allows {len(nodes) - len(other)} of "
                f"{len(nodes)} /dev/nvidia* node(s) read-write{note}",
            )
        )
    return checks


SKEW_WARN_S = 1.0  # clocks further apart than this (beyond the probe's uncertainty) are worth a look


def _cluster(cfg: config.Config) -> list[Check]:
    """With [cluster]: the certificate files, each seed's (and each known member's) Peer service reached
    with them, and the clock skew against the peers that answered."""
    c = cfg.cluster
    if not c.enabled:
        return [Check("clock skew", SKIP, "no [cluster] configured: no peers to compare clocks with")]
    import socket

    from xpud.federation import certs, probe

    name = c.name or socket.gethostname()
    try:
        creds = certs.load_host(c.ca, c.cert, c.key, name, config.split_host_port(c.listen)[0])
    except certs.CertError as e:
        fix = "xpu certs issue NAME --ip IP --ca DIR --out DIR, then set [cluster] ca, cert and key"
        return [
            Check("peer certificate", FAIL, str(e), fix),
            Check("clock skew", SKIP, "no usable certificate"),
        ]
    checks = [Check("peer certificate", OK, f"{c.cert} is this site's certificate for {name}")]
    results = probe.probe_all(creds, name, c.listen, [*c.seeds, *_known_peers(cfg, name)])
    if not results:
        why = (
            f"the only seed is this host ({c.listen}) and no other member is known"
            if c.seeds
            else "no seeds and no members known"
        )
        checks.append(Check("peers", SKIP, f"{why}: a first host has nobody to reach"))
        return [*checks, Check("clock skew", SKIP, "no peers to compare clocks with")]
    down = [p for p in results if not p.ok]
    if down:
        what = "; ".join(f"{p.addr}: {p.error}" for p in down[:5])
        checks.append(
            Check(
                "peers",
                WARN,
                f"{len(results) - len(down)} of {len(results)} peer(s) answered; {what}",
                "check that those daemons run with [cluster] listen there, that the network lets TCP "
                "through, and that their certificates come from the same CA (xpu certs)",
            )
        )
    else:
        checks.append(Check("peers", OK, f"{len(results)} peer(s) answered over mutual TLS"))
    timed = [p for p in results if p.ok and not p.error]
    if not timed:
        return [*checks, Check("clock skew", SKIP, "no peer reported its clock")]
    worst = max(timed, key=lambda p: abs(p.skew_s) - p.uncertainty_s)
    text = f"largest skew {worst.skew_s:+.3f} s (+/- {worst.uncertainty_s:.3f}) against {worst.addr}"
    if abs(worst.skew_s) - worst.uncertainty_s > SKEW_WARN_S:
        fix = "run NTP (chronyd or systemd-timesyncd) on every host: logs and ages compare across hosts"
        return [*checks, Check("clock skew", WARN, text, fix)]
    return [*checks, Check("clock skew", OK, text)]


def _known_peers(cfg: config.Config, name: str) -> list[str]:
    """The alive members the local daemon knows, if it runs (best effort: empty otherwise)."""
    from xpud.api.client import Client

    try:
        with Client(cfg.runtime_dir, timeout=3.0) as c:
            reply = c.cluster()
    except (XpudError, OSError):
        return []
    return [h.addr for h in reply.hosts if h.state == "alive" and h.name != name]


# ----------------------------------------------------------------------------------------- output


def render(checks: list[Check]) -> str:
    lines = []
    for c in checks:
        lines.append(f"{c.status:<5} {c.name}: {c.message}")
        if c.fix and c.status in (WARN, FAIL):
            lines.append(f"      fix: {c.fix}")
    fails = sum(c.status == FAIL for c in checks)
    warns = sum(c.status == WARN for c in checks)
    lines.append(f"{fails} failed, {warns} warning(s), {len(checks)} check(s)")
    return "\n".join(lines)


def as_json(checks: list[Check]) -> dict:
    return {"ok": not any(c.status == FAIL for c in checks), "checks": [asdict(c) for c in checks]}


def exit_code(checks: list[Check]) -> int:
    return 1 if any(c.status == FAIL for c in checks) else 0


def host_for(cfg: config.Config, root: Path = Path("/")) -> Host:
    """The host to check: the real one, or the configured simulated machine."""
    if cfg.devices.backend != "simulated":
        return Host(root=root)
    from xpud.hw.fakenvml import FakeNvml
    from xpud.hw.machines import load_machine
    from xpud.isolation.faketools import FakeNvidiaTools

    try:
        machine = load_machine(cfg.devices.machine)
    except (XpudError, ValueError, OSError) as e:
        raise XpudError(f"simulated machine {cfg.devices.machine!r}: {e}") from None
    fake = FakeNvml(machine, seed=cfg.devices.seed)
    return Host(
        root=root,
        lib=fake,
        tools=FakeNvidiaTools(fake),
        devices=lambda: simulated_devices(machine),
        simulated=True,
    )
