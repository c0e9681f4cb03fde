"""A submitted job's supervisor as a transient unit of a real systemd (PID 1 of new namespaces,
tests/systemd_ns.py): started with ``systemd-run`` as xpud.service would start it, the supervisor and the
job run in ``xpu-submit-<id>.service`` (not in the daemon's cgroup, so stopping or restarting xpud.service
does not stop them), the job as its user in its directory, and the end is written to the status file."""

from __future__ import annotations

import asyncio
import os
import tempfile
from pathlib import Path

import pytest

from tests.conftest import wait_until
from tests.otheruser import NOBODY
from tests.systemd_ns import Systemd
from xpud.isolation import switch_user
from xpud.jobs import supervisor

pytestmark = [
    pytest.mark.timeout(90),
    pytest.mark.skipif(bool(Systemd.unavailable()), reason=f"no real systemd: {Systemd.unavailable()}"),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root"),
]


@pytest.fixture
def systemd():
    try:
        sd = Systemd().__enter__()
    except RuntimeError as e:
        pytest.skip(f"systemd does not start in new namespaces here: {e}")
    yield sd
    sd.__exit__()


def test_the_supervisor_is_a_transient_unit_and_records_the_jobs_end(systemd, tmp_path):
    wrapper = tmp_path / "systemd-run"
    wrapper.write_text(f'#!/bin/sh\nexec {" ".join(systemd.prefix)} systemd-run "$@"\n')
    wrapper.chmod(0o755)
    with tempfile.TemporaryDirectory(prefix="xpu-unit-") as work:
        os.chmod(work, 0o1777)
        state = Path(work) / "state"
        out = Path(work) / "out"
        script = "tail -1 /proc/self/cgroup; id -u; pwd; echo $GREETING; exit 9"
        doc = asyncio.run(
            supervisor.launch(
                state, "ab12cd34", ["sh", "-c", script], {"PATH": "/usr/bin:/bin", "GREETING": "hi"}, work,
                str(out), "", switch_user.argv(NOBODY, NOBODY, []), 0.0, 1.0, systemd_run=str(wrapper),
            )
        )  # fmt: skip
        assert doc["supervisor"] > 0
        end = wait_until(
            lambda: (supervisor.read_status(state, "ab12cd34") or {}).get("state") == "failed", 30
        )
        assert end
        status = supervisor.read_status(state, "ab12cd34")
        assert status["exit_code"] == 9
        lines = out.read_text().splitlines()
        assert lines == ["0::/system.slice/xpu-submit-ab12cd34.service", str(NOBODY), work, "hi"], lines
        assert out.stat().st_uid == NOBODY
        assert not (state / "ab12cd34.spec").exists()  # the environment's file is gone once read
