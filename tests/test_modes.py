"""Slice sizes from the config work everywhere a mode is named: requests, the engine, MIG and MPS, the
ledger, `xpu run`, `xpu ls` and `xpu leases` (real daemons, the real CLI)."""

from __future__ import annotations

import asyncio
import json
import pickle
import signal

import pytest

from tests.conftest import wait_until
from tests.syncengine import sync_engine
from tests.test_engine import Clock, cards, pcie_box
from xpud.config.read import parse
from xpud.config.schema import Config
from xpud.errors import BadRequest, Conflict
from xpud.ledger.ledger import Ledger
from xpud.model import Caller, Mode, Request

TINY = "[leases]\ngrace_s = 30.0\n[slices.vxpu-tiny]\nmemory_fraction = 0.125\ncompute_pct = 10\n"


def test_mode_is_a_validated_string_and_xpu_is_one_object():
    assert Mode("xpu") is Mode.XPU and Request("xpu").mode is Mode.XPU
    assert Mode("vxpu-tiny") == "vxpu-tiny" and Mode("vxpu-tiny").is_slice and not Mode.XPU.is_slice
    assert pickle.loads(pickle.dumps(Mode.XPU)) is Mode.XPU and json.dumps(Mode("vxpu-tiny")) == '"vxpu-tiny"'
    for bad in ("", "XPU", "vxpu-", "half", "vxpu-Half", "vxpu-" + "x" * 41, "vxpu-a b"):
        with pytest.raises(ValueError, match="not a mode"):
            Mode(bad)


@pytest.mark.parametrize(
    ("machine", "isolation"),
    [("pcie-8x-l40s", "mps"), ("dgx-h100", "mig")],
)
def test_a_configured_size_works_end_to_end(daemon_factory, machine, isolation):
    d = daemon_factory(machine, config=TINY)
    r = d.xpu("run", "--mode", "vxpu-tiny", "--", "sh", "-c", 'echo "$XPU_MODE|$CUDA_VISIBLE_DEVICES"')
    assert r.returncode == 0, r.stderr
    mode, device = r.stdout.strip().split("|")
    assert mode == "vxpu-tiny" and device.startswith("MIG-" if isolation == "mig" else "GPU-")

    with d.client() as c:
        total = c.cards().cards[0].memory_total_bytes
        g = c.acquire_lease("vxpu-tiny", command="serve")
        card = next(x for x in c.cards().cards if x.index == g.lease.cards[0])
        s = next(s for s in card.slices if s.lease_id == g.lease.id)
        assert s.size == "vxpu-tiny"
        if isolation == "mig":  # H100 80 GB: 1/8 of the memory is one memory slot, a 1g.10gb instance
            assert s.handle.startswith("MIG-") and s.memory_bytes < total / 7
        else:  # MPS: an eighth of what is left after the driver's reservation
            assert s.handle.startswith("mps:") and (total - (1 << 30)) / 8 == pytest.approx(s.memory_bytes, 1)
        sizes = "use one of xpu, vxpu-half, vxpu-quarter, vxpu-tiny"
        with pytest.raises(BadRequest, match=rf"'vxpu-huge'.*{sizes}"):
            c.acquire_lease("vxpu-huge")
    leases = json.loads(d.xpu("leases", "--json").stdout)["leases"]
    assert [(x["id"], x["mode"]) for x in leases] == [(g.lease.id, "vxpu-tiny")]
    assert f"{g.lease.id} (tiny)" in d.xpu("ls").stdout
    assert g.lease.id in d.xpu("leases").stdout
    info = d.xpu("info").stdout
    assert "vxpu-quarter (25% memory, 15% compute), vxpu-tiny (12.5% memory, 10% compute)" in info

    d.kill(signal.SIGKILL)  # the ledger brings the lease back with its size
    d.start()  # the simulated hardware outlives the daemon (hw/simstate.py): its MIG instance is adopted
    with d.client() as c:
        assert {x.id: x.mode for x in c.leases().leases} == {g.lease.id: "vxpu-tiny"}
        c.release(g.lease.id, g.token)
        wait_until(lambda: list(c.leases().leases) == [])


def test_a_restored_lease_of_a_size_since_removed_is_kept_released_and_never_moved(tmp_path):
    led = Ledger(tmp_path / "l.sqlite")
    e1 = sync_engine(cards(), pcie_box(), parse(TINY), led, clock=Clock())
    lease, token = e1.try_grant(Request("vxpu-tiny", owner_uid=1000, restartable=True))
    led.close()
    e2 = sync_engine(cards(), pcie_box(), Config(), Ledger(tmp_path / "l.sqlite"), clock=Clock())
    assert [x.mode for x in e2.restore()] == ["vxpu-tiny"]
    e2.hold_opened(lease.id)
    with pytest.raises(Conflict, match="a vxpu-tiny slice, a size the config no longer has"):
        asyncio.run(e2.engine.moves.start(lease.id, "card unhealthy"))
    with pytest.raises(BadRequest, match="no such slice size"):
        e2.try_grant(Request("vxpu-tiny", owner_uid=1000))
    assert e2.release(lease.id, Caller(1000), token).id == lease.id
