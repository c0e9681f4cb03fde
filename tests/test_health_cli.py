"""`xpu health` as a newcomer reads it (issue 18, items 5 and 6): one line per card first (state, score,
when it is back, the top reason), details with a card; clock-event masks in NVML's words; times with
their zone; and after a fault clears, when the card will be back and why (the event window, then the
clear time), said the same way by `health`, `fault clear` and `undrain`, with numbers that agree."""

from __future__ import annotations

import json
import re
import time

import pytest

from tests.conftest import wait_until

WINDOW_S, CLEAR_S = 20.0, 1.5  # long enough for a loaded machine (load 8 on 2 cores) to look inside it
CONFIG = f"""
[leases]
grace_s = 30.0
[health]
poll_interval_s = 0.2
clear_s = {CLEAR_S}
event_window_s = {WINDOW_S}
"""


@pytest.fixture
def d(daemon_factory):
    return daemon_factory(config=CONFIG)


def health(d, card: str = "") -> list[dict]:
    return json.loads(d.xpu("health", *([card] if card else []), "--json").stdout)


def test_one_line_per_card_then_details_with_a_card(d):
    lines = d.xpu("health").stdout.splitlines()
    assert lines[0].split() == ["CARD", "STATE", "SCORE", "BACK", "AT", "REASON"]
    assert len(lines) == 8 + 2 and all(line.split()[1:4] == ["healthy", "100", "-"] for line in lines[1:9])
    assert lines[-1].startswith("BACK AT: when the card returns")
    text = d.xpu("health", "2").stdout
    assert text.startswith("card 2 (GPU-") and ": healthy, score 100 now" in text.splitlines()[0]
    clock = next(line for line in text.splitlines() if line.split()[:1] == ["clock_events"])
    assert "0x1 (GPU idle)" in clock  # an idle card's clocks, in NVML's words
    assert len(d.xpu("health", "--details").stdout.split("\ncard ")) == 8


def test_after_a_fault_clears_every_view_says_when_the_card_is_back_and_why(d):
    zone = time.strftime("%Z")
    before = time.time()
    assert d.xpu("fault", "inject", "0", "xid", "79").returncode == 0
    wait_until(lambda: health(d, "0")[0]["health_state"] == "unhealthy", timeout=10)
    injected = time.time()  # seen unhealthy: the XID came a little before
    cleared = d.xpu("fault", "clear", "0").stdout
    assert "card 0 stays out for now: unhealthy (xid 79" in cleared
    (h,) = health(d, "0")
    xid = next(s for s in h["signals"] if s["name"] == "xid")
    # the XID holds the card out for the event window, then the clear time: the numbers say so
    assert before <= xid["until"] - WINDOW_S <= injected  # the window runs from the XID
    assert h["window_ends"] == xid["until"] and h["back_at"] == pytest.approx(h["window_ends"] + CLEAR_S)
    assert h["clear_needed_s"] == CLEAR_S and h["health_score"] == h["history"][-1]["score"]
    text = d.xpu("health", "0").stdout
    ends = time.strftime("%H:%M:%S", time.localtime(h["window_ends"]))
    day = time.strftime("%Y-%m-%d", time.localtime(h["window_ends"]))  # shown when not today (midnight)
    assert re.search(rf"the event window holding it ends at (?:{day} )?{ends} {zone}", text), text
    assert f"then {CLEAR_S:g} s of clear signals: back at " in text and "(score then " in text
    summary = next(line for line in d.xpu("health").stdout.splitlines() if line.startswith("0 "))
    assert time.strftime("%H:%M:%S", time.localtime(h["back_at"])) in summary and "xid 79" in summary
    still = d.xpu("undrain", "0").stdout
    assert still.startswith("card 0: operator drain lifted; still out of service: unhealthy (xid 79")
    assert "back at " in still
    wait_until(lambda: health(d, "0")[0]["health_state"] == "healthy", timeout=WINDOW_S + CLEAR_S + 10)
    assert time.time() >= h["back_at"] - 0.5  # not before it said
    (h,) = health(d, "0")
    assert h["back_at"] is None and h["window_ends"] is None
    assert d.xpu("undrain", "0").stdout == "card 0 back in service\n"


def test_a_fault_with_no_end_in_sight_says_so(d):
    assert d.xpu("fault", "inject", "1", "overheat").returncode == 0
    wait_until(lambda: health(d, "1")[0]["health_state"] != "healthy", timeout=10)
    (h,) = health(d, "1")
    assert h["back_at"] is None
    line = next(line for line in d.xpu("health").stdout.splitlines() if line.startswith("1 "))
    assert " when fixed " in line and "temperature" in line
    assert "once they clear, 1.5 s of clear signals bring it back" in d.xpu("health", "1").stdout
