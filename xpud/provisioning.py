"""Pre-provisioning from the demand forecast: sliced cards ready before a forecast peak, whole after it.

Every ``[forecast] interval_s`` (APScheduler, ``xpud.jobs``) the daemon fits ``xpud.forecast`` to the
ledger's lease history, takes the forecast for the hour ``lead_s`` ahead, and turns it into cards: each
size's forecast slices times its memory share, summed and rounded up (a remainder under ``SLACK`` of a card
is not worth a card). With fewer sliced cards than that, idle whole cards are switched to sliced now
(``Engine.to_sliced``: MIG on, or the MPS control daemon started), so that the requests of the peak are
served without a reconfiguration; the capacity window in force still keeps its share whole. With more,
the cards this provisioner switched go back to whole once idle and past ``[bursts] hold_s``. Cards sliced
by demand are left to the engine and the windows. Every switch is a ``mode`` event with its reason.

``[forecast] warm_command`` runs once on each card switched here (``CUDA_VISIBLE_DEVICES`` = the card,
``XPU_WARM_CARD``, ``XPU_WARM_SIZES``), e.g. to load model weights into host memory before the peak; its
outcome is an event. The forecast, the actual demand and the error per hour are published as
``forecast.json`` in the runtime directory for ``xpu forecast``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from datetime import datetime

import numpy as np

from xpud import forecast
from xpud.model import CardMode
from xpud.runfiles import publish_json

log = logging.getLogger("xpud.provisioning")

SLACK = 0.2  # a forecast remainder below this share of a card does not get a card of its own
FILE_NAME = "forecast.json"
SHOW_HOURS = 24


class Provisioner:
    def __init__(self, engine, clock=time.time):
        self.engine = engine
        self.clock = clock
        self.provisioned: set[int] = set()  # cards this provisioner switched to sliced
        self._warming: set[asyncio.Task] = set()

    @property
    def cfg(self):
        return self.engine.cfg.forecast  # read at each use: a reload (SIGHUP) may change it

    def fits(self, now: float) -> dict[str, forecast.Fit]:
        e = self.engine
        days = self.cfg.history_days
        intervals = e.ledger.lease_intervals(now - days * 86400.0)
        t0, series = forecast.demand_by_size(intervals, list(e.cfg.slices), now, days)
        return {size: forecast.fit(y, t0, self.cfg.alpha) for size, y in series.items()}

    def cards_needed(self, demand: dict[str, float]) -> int:
        slices = self.engine.cfg.slices
        total = sum(n * slices[s].memory_fraction for s, n in demand.items())
        return max(0, math.ceil(total - SLACK))

    async def run(self, now: float | None = None) -> dict:
        """One decision at ``now``: switch cards, publish the forecast; returns what was published."""
        e = self.engine
        now = self.clock() if now is None else now
        fits = self.fits(now)
        target = now + self.cfg.lead_s
        demand = {s: f.forecast(target) for s, f in fits.items()}
        need = self.cards_needed(demand)
        usable = [c for c in e.cards.values() if c.usable]
        sliced = [c for c in usable if c.mode is CardMode.SLICED]
        what = ", ".join(f"{v:.1f} {s}" for s, v in demand.items() if v >= 0.05) or "no slices"
        at = datetime.fromtimestamp(target).strftime("%a %H:%M")
        switched: list[int] = []
        if not self.cfg.enabled:
            pass  # forecast only (for `xpu forecast`)
        elif need > len(sliced):
            idle = sorted(
                (c for c in usable if c.mode is CardMode.WHOLE and c.idle and not c.pinned),
                key=lambda c: -c.info.index,
            )
            for c in idle[: need - len(sliced)]:
                why = f"forecast pre-provisioning: {what} expected at {at} ({need} sliced card(s) wanted)"
                if await e.to_sliced(c.info.index, why):
                    e.stats.conversions[("sliced", "forecast")] += 1
                    self.provisioned.add(c.info.index)
                    switched.append(c.info.index)
                    self._warm(c.info.index, c.info.uuid, [s for s, v in demand.items() if v >= 0.05])
        elif need < len(sliced):
            excess = len(sliced) - need
            hold = e.cfg.bursts.hold_s
            for i in sorted(self.provisioned):
                c = e.cards[i]
                if excess <= 0:
                    break
                if c.mode is not CardMode.SLICED:
                    self.provisioned.discard(i)
                    continue
                if not c.idle or (c.switched_at and e.clock() - c.switched_at < hold):
                    continue
                why = f"forecast falls: {what} expected at {at} ({need} sliced card(s) wanted)"
                if await e.to_whole(i, why):
                    e.stats.conversions[("whole", "forecast")] += 1
                    self.provisioned.discard(i)
                    switched.append(i)
                    excess -= 1
        report = self.report(fits, now, demand, need, switched)
        try:
            await asyncio.to_thread(publish_json, report, e.cfg.runtime_dir, FILE_NAME)
        except OSError as err:
            log.warning("publishing the forecast: %s", err)
        return report

    def report(self, fits, now: float, demand: dict[str, float], need: int, switched: list[int]) -> dict:
        hour = math.floor(now / forecast.HOUR_S) * forecast.HOUR_S
        sizes = {}
        for size, f in fits.items():
            n = len(f.actual)
            past = slice(max(0, n - SHOW_HOURS), n)
            apes = forecast.ape(f.actual[past], f.predicted[past])
            week = slice(max(0, n - forecast.WEEK_H), n)
            sizes[size] = {
                "mape_last_week": forecast.mape(f.actual[week], f.predicted[week]),
                "past": [
                    {
                        "hour": _iso(f.t0 + (past.start + k) * forecast.HOUR_S),
                        "actual": round(float(a), 3),
                        "forecast": None if np.isnan(p) else round(float(p), 3),
                        "ape": None if np.isnan(x) else round(float(x), 4),
                    }
                    for k, (a, p, x) in enumerate(zip(f.actual[past], f.predicted[past], apes, strict=True))
                ],
                "next": [
                    {
                        "hour": _iso(hour + k * forecast.HOUR_S),
                        "forecast": round(f.forecast(hour + k * 3600), 3),
                    }
                    for k in range(SHOW_HOURS)
                ],
            }
        return {
            "generated": _iso(now),
            "enabled": self.cfg.enabled,
            "lead_s": self.cfg.lead_s,
            "demand_at_lead": {s: round(v, 3) for s, v in demand.items()},
            "sliced_cards_wanted": need,
            "provisioned_cards": sorted(self.provisioned),
            "switched_now": switched,
            "sizes": sizes,
        }

    def _warm(self, index: int, uuid: str, sizes: list[str]) -> None:
        cmd = self.cfg.warm_command
        if not cmd:
            return
        env = {
            **os.environ,
            "CUDA_VISIBLE_DEVICES": uuid,
            "XPU_WARM_CARD": str(index),
            "XPU_WARM_SIZES": ",".join(sizes),
        }

        async def warm() -> None:
            e = self.engine
            try:
                proc = await asyncio.create_subprocess_shell(
                    cmd, env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE
                )
                try:
                    _, err = await asyncio.wait_for(proc.communicate(), self.cfg.warm_timeout_s)
                except TimeoutError:
                    proc.kill()
                    await proc.wait()
                    e.event(
                        "forecast",
                        f"card {index}: warm_command killed after {self.cfg.warm_timeout_s:g} s",
                        card=index,
                    )
                    return
                tail = err.decode(errors="replace").strip().splitlines()[-1:] if err else []
                e.event(
                    "forecast",
                    f"card {index}: warm_command exited {proc.returncode}"
                    + (f": {tail[0][:200]}" if tail and proc.returncode else ""),
                    card=index,
                )
            except OSError as err:
                e.event("forecast", f"card {index}: warm_command could not start: {err}", card=index)

        task = asyncio.ensure_future(warm())
        self._warming.add(task)
        task.add_done_callback(self._warming.discard)


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t).astimezone().isoformat(timespec="minutes")
