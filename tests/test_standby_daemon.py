"""Pre-created (standby) MIG slices through a real daemon process: the forecast pre-creates them from the
ledger's history, /metrics shows them per card and size, they survive a restart (the simulated hardware
outlives the daemon, as the driver's does, and the ledger records them) and the next request of their
size takes one without creating a MIG instance."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time

import pytest

from tests.conftest import wait_until
from tests.test_metrics import free_port, samples, scrape, value
from xpud.hw.simstate import FILE_NAME
from xpud.ledger.ledger import Ledger
from xpud.model import Lease, LeaseState, Mode

SIZE = "vxpu-half"


def seed_history(state_dir, now: float, slices: int = 2) -> None:
    """Four weeks in which ``slices`` vxpu-half slices were held all the time: the forecast wants as many."""
    state_dir.mkdir(parents=True, exist_ok=True)
    ledger = Ledger(state_dir / "ledger.sqlite")
    for n in range(slices):
        lease = Lease(f"h{n:06d}", Mode(SIZE), 1000, (0,), ("GPU-0000",), created=now - 29 * 86400)
        ledger.insert_lease(lease, "t")
        ledger.end_lease(lease.id, LeaseState.RELEASED, "history", when=now - 5)
    ledger.close()


def mig_devices(d) -> dict[str, int]:
    """MIG device UUID -> card index, as the simulated hardware holds them (its state file)."""
    hw = json.loads((d.state_dir / FILE_NAME).read_text())
    return {
        ci["uuid"]: i
        for i, card in enumerate(hw["nvml"]["cards"])
        for gi in card["gpu_instances"]
        for ci in gi["compute_instances"]
    }


def standby_metric(found: dict) -> dict[tuple[str, str], float]:
    """(card, size) -> the xpud_card_standby_slices value, where not 0."""
    return {
        (s.labels["card"], s.labels["size"]): s.value for s in found["xpud_card_standby_slices"] if s.value
    }


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGKILL], ids=["stop", "crash"])
def test_standby_slices_survive_a_restart_and_serve_the_next_request_without_a_creation(daemon_factory, stop):
    port = free_port()
    d = daemon_factory(
        "dgx-h100",
        config="[leases]\ngrace_s = 30.0\n[cards]\nmig_idle_keep_s = 0.0\n"
        "[forecast]\nenabled = true\ninterval_s = 3600.0\n"
        f'[metrics]\nlisten = "127.0.0.1:{port}"\n',
        start=False,
    )
    seed_history(d.state_dir, time.time())
    d.start()

    def forecast() -> dict:
        r = d.xpu("forecast", "--json")
        return json.loads(r.stdout) if r.returncode == 0 else {}

    wait_until(lambda: forecast().get("slices", {}).get("standby", {}).get(SIZE) == 2, timeout=30)
    made = set(forecast()["slices"]["created"])
    on = mig_devices(d)
    assert len(made) == 2 and set(on) == made  # the only MIG instances: the two pre-created ones
    (card,) = {on[h] for h in made}
    text = scrape(port)
    found = samples(text)
    assert standby_metric(found) == {(str(card), SIZE): 2.0}
    assert value(found, "xpud_card_slices", card=str(card), size=SIZE) == 0  # in use: none yet
    if promtool := shutil.which("promtool"):  # test_metrics installs it (or says why not)
        r = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
        assert r.returncode == 0, r.stdout + r.stderr

    d.kill(stop)
    assert set(mig_devices(d)) == made  # a stop leaves them on the card, as a crash does
    d.start()
    events = [e["message"] for e in json.loads(d.xpu("events", "--json").stdout)]
    assert sum("adopted pre-created MIG 3g.40gb@" in m for m in events) == 2, events
    assert standby_metric(samples(scrape(port))) == {(str(card), SIZE): 2.0}
    with d.client() as c:
        g = c.acquire_lease(SIZE)
        assert g.lease.slices[0].handle in made and g.lease.cards == [card]
        assert mig_devices(d) == on, "the request created or destroyed a MIG instance"
        found = samples(scrape(port))
        assert standby_metric(found) == {(str(card), SIZE): 1.0}
        assert value(found, "xpud_card_slices", card=str(card), size=SIZE) == 1
        c.release(g.lease.id, g.token)
