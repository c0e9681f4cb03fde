"""A replayed week of synthetic diurnal slice demand, with and without forecast pre-provisioning.

    .venv/bin/python bench/forecast_replay.py --out bench/forecast_replay.json

A model of one 8-card host at one-second steps, not the daemon: in the simulated daemon a card switches
in milliseconds, so waiting for a reconfiguration would not show. Here switching a card whole -> sliced
takes ``--convert-s`` (default 10 s: an assumption for a MIG mode switch plus instance creation on real
hardware; ``--convert-s 1`` for MPS). Shared with the daemon: the forecast (``xpud.planning.forecast``,
fitted on
four earlier weeks of the same process), the cards-needed rounding (``Provisioner.cards_needed``), the
window share (``xpud.planning.windows.whole_needed``: weekdays 08-20 keep ``--day-share`` of the cards whole,
``--night-share`` otherwise), the hysteresis (``hold_s`` 300 s), and nothing running is ever evicted.

Demand: vxpu-half (2 of a card's 4 quarter units) and vxpu-quarter (1) requests, Poisson arrivals whose
rate follows the hour of the week (weekday peak 13-16, low nights, quieter weekends), durations
exponential (mean 20 min). Training jobs want whole cards by the hour (weekdays 08-12 and 17-20: 6,
12-17: 4, nights 3, weekends 2; times ``--training-scale``) and take idle whole cards, then idle sliced
ones (as the engine does for a waiting whole-card request). A slice request waits (FIFO) until a sliced
card has room; an idle whole card is switched when the window allows, its room ready ``convert_s``
later. Pre-provisioning runs every 300 s for the hour ``lead_s`` (900 s) ahead. Reported: requests, how
many waited, mean and p99 wait, and the whole-card share kept during the day window.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from datetime import datetime, timedelta

import numpy as np

from xpud.planning import forecast
from xpud.planning.windows import whole_needed

CARDS, UNITS = 8, 4  # a card holds 4 quarters or 2 halves
SIZES = {"vxpu-half": 2, "vxpu-quarter": 1}
MEAN_S = 1200.0
START = datetime(2026, 11, 2)  # a Monday, local time; four weeks of history, then the replayed week
HOLD_S, LEAD_S, TICK_S = 300.0, 900.0, 300.0
WINDOW = {"day": 0.5, "night": 0.0}  # the capacity window: weekdays 08-20 keep --day-share whole


def rate_per_hour(day: int, hour: int) -> dict[str, float]:
    """Arrivals per hour by size."""
    base = 2.0 if 1 <= hour < 7 else 6.0
    if 9 <= hour < 18:
        base = 14.0
    if 13 <= hour < 16:
        base = 26.0
    if day >= 5:
        base *= 0.4
    return {"vxpu-half": base * 0.6, "vxpu-quarter": base * 0.4}


def arrivals(rng, t0: datetime, hours: int) -> list[tuple[float, str, float]]:
    out = []
    for h in range(hours):
        start = (t0 + timedelta(hours=h)).timestamp()
        d = t0 + timedelta(hours=h)
        for size, lam in rate_per_hour(d.weekday(), d.hour).items():
            for t in np.sort(rng.uniform(0, 3600, rng.poisson(lam))):
                out.append((start + float(t), size, float(rng.exponential(MEAN_S))))
    return sorted(out)


TRAINING_SCALE = [1.0]  # --training-scale


def whole_wanted(t: float) -> int:
    """Cards training (whole-card) jobs want at ``t``: they take idle whole cards, then idle sliced ones
    (as the engine gives a waiting whole-card request an idle sliced card)."""
    d = datetime.fromtimestamp(t)
    if d.weekday() >= 5:
        n = 2
    elif 8 <= d.hour < 12 or 17 <= d.hour < 20:
        n = 6
    else:
        n = 4 if 12 <= d.hour < 17 else 3
    return round(n * TRAINING_SCALE[0])


def day_window(t: float) -> bool:
    d = datetime.fromtimestamp(t)
    return d.weekday() < 5 and 8 <= d.hour < 20


@dataclass
class Card:
    sliced: bool = False
    ready_at: float = 0.0  # a switch to sliced completes then
    used: int = 0
    switched_at: float = -1e9
    provisioned: bool = False


def replay(week, fits, convert_s: float, preprovision: bool) -> dict:
    cards = [Card() for _ in range(CARDS)]
    training = 0  # cards held whole by training jobs (idle whole cards are the others not sliced)
    running: list[tuple[float, int, int]] = []  # (end, card, units)
    queue: list[tuple[float, str, float]] = []
    waits: list[float] = []
    share_day: list[float] = []
    t0 = week[0][0] - week[0][0] % 3600
    t_end = t0 + 7 * 86400
    i = 0
    for now in np.arange(t0, t_end, 1.0):
        now = float(now)
        while running and running[0][0] <= now:
            _, c, u = running.pop(0)
            cards[c].used -= u
        while i < len(week) and week[i][0] <= now:
            queue.append(week[i])
            i += 1
        share = WINDOW["day"] if day_window(now) else WINDOW["night"]
        need_whole = whole_needed(share, CARDS)
        if int(now) % 60 == 0:  # training jobs start and end
            want = whole_wanted(now)
            if training > want:
                training = want
            while training < want:
                if sum(not c.sliced for c in cards) > training:
                    training += 1
                    continue
                idle = [c for c in cards if c.sliced and c.used == 0 and c.ready_at <= now]
                if not idle:
                    break
                idle[0].sliced, idle[0].provisioned, idle[0].switched_at = False, False, now
                training += 1
        whole = sum(not c.sliced for c in cards)
        idle_whole = whole - training
        # serve the queue in order; switch idle whole cards when the window allows
        while queue:
            arrived, size, dur = queue[0]
            u = SIZES[size]
            ready = [k for k, c in enumerate(cards) if c.sliced and c.ready_at <= now and UNITS - c.used >= u]
            if ready:
                k = max(ready, key=lambda k: cards[k].used)  # pack
                cards[k].used += u
                running.append((now + dur, k, u))
                running.sort()
                waits.append(now - arrived)
                queue.pop(0)
                continue
            pending = [c for c in cards if c.sliced and c.ready_at > now and UNITS - c.used >= u]
            if pending:
                break  # room is on its way
            idle = [c for c in cards if not c.sliced]
            if idle_whole > 0 and whole - 1 >= need_whole:
                c = idle[0]
                c.sliced, c.ready_at, c.switched_at, c.provisioned = True, now + convert_s, now, False
                whole -= 1
                idle_whole -= 1
            break
        # the window keeps its share: idle sliced cards go back after the hysteresis
        if whole < need_whole and int(now) % 30 == 0:
            for c in cards:
                if whole >= need_whole:
                    break
                if c.sliced and c.used == 0 and now - c.switched_at >= HOLD_S:
                    c.sliced, c.provisioned, c.switched_at = False, False, now
                    whole += 1
                    idle_whole += 1
        if preprovision and int(now) % int(TICK_S) == 0:
            demand = {s: f.forecast(now + LEAD_S) for s, f in fits.items()}
            total = sum(n * SIZES[s] / UNITS for s, n in demand.items())
            want = max(0, math.ceil(total - 0.2))
            sliced = sum(c.sliced for c in cards)
            for c in cards:
                if sliced >= want or whole - 1 < need_whole or idle_whole <= 0:
                    break
                if not c.sliced:
                    c.sliced, c.ready_at, c.switched_at, c.provisioned = True, now + convert_s, now, True
                    sliced += 1
                    whole -= 1
                    idle_whole -= 1
            for c in cards:
                if sliced <= want:
                    break
                if c.provisioned and c.sliced and c.used == 0 and now - c.switched_at >= HOLD_S:
                    c.sliced, c.provisioned, c.switched_at = False, False, now
                    sliced -= 1
                    whole += 1
                    idle_whole += 1
        if day_window(now) and int(now) % 60 == 0:
            share_day.append(sum(not c.sliced for c in cards) / CARDS)
    w = np.array(waits)
    return {
        "requests": len(w),
        "waited_over_1s": int((w > 1.0).sum()),
        "waited_for_a_switch_only": int(((w > 1.0) & (w <= convert_s + 1.0)).sum()),
        "mean_wait_s": round(float(w.mean()), 3),
        "p99_wait_s": round(float(np.percentile(w, 99)), 3),
        "max_wait_s": round(float(w.max()), 3),
        "whole_share_by_day": round(float(np.mean(share_day)), 3),
        "still_queued": len(queue),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--convert-s", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--day-share", type=float, default=0.5, help="whole_share of the weekday 08-20 window")
    ap.add_argument("--night-share", type=float, default=0.0, help="whole_share outside it")
    ap.add_argument("--training-scale", type=float, default=1.0, help="times the training jobs' cards")
    ap.add_argument("--out")
    args = ap.parse_args()
    TRAINING_SCALE[0] = args.training_scale
    WINDOW["day"], WINDOW["night"] = args.day_share, args.night_share
    rng = np.random.default_rng(args.seed)
    hist = arrivals(rng, START, 4 * 168)
    week = arrivals(rng, START + timedelta(weeks=4), 168)
    now = (START + timedelta(weeks=4)).timestamp()
    intervals = [(s, t, t + d) for t, s, d in hist]
    t0, series = forecast.demand_by_size(intervals, list(SIZES), now, 28)
    fits = {s: forecast.fit(y, t0, 0.3) for s, y in series.items()}
    # the forecast's own error on the replayed week (hourly occupancy)
    _, actual = forecast.demand_by_size([(s, t, t + d) for t, s, d in week], list(SIZES), now + 7 * 86400, 7)
    ahead = {s: np.array([fits[s].forecast(now + k * 3600 + 1800) for k in range(168)]) for s in SIZES}
    result = {
        "convert_s": args.convert_s,
        "seed": args.seed,
        "training_scale": args.training_scale,
        "day_share": args.day_share,
        "night_share": args.night_share,
        "forecast_mape": {s: round(forecast.mape(actual[s], ahead[s]), 3) for s in SIZES},
        "forecast_wape": {
            s: round(float(np.abs(actual[s] - ahead[s]).sum() / actual[s].sum()), 3) for s in SIZES
        },
        "without": replay(week, fits, args.convert_s, preprovision=False),
        "with": replay(week, fits, args.convert_s, preprovision=True),
    }
    text = json.dumps(result, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text, file=sys.stdout)


if __name__ == "__main__":
    main()
