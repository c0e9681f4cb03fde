"""Pre-provisioning from the demand forecast: sliced cards ready before a forecast peak, whole after it.

Every ``[forecast] interval_s`` the forecast for the hour ``lead_s`` ahead becomes cards to slice
(``Engine.to_sliced``) or give back (``Engine.to_whole``), then slices to pre-create on MIG cards
(``xpud.engine.standby``) or plan on MPS cards, each warmed once by ``[forecast] warm_command``
(``xpud.controllers.warm``). See docs/engine.md for the walkthrough.

Invariants: the capacity window in force still keeps its share whole; only cards this provisioner
switched go back to whole (idle, past ``[bursts] hold_s``); cards sliced by demand are left to the engine
and the windows; every switch is a ``mode`` event with its reason; a MIG instance is not handed out while
its warm command runs.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from datetime import datetime
from types import SimpleNamespace

import numpy as np

from xpud.controllers import warm
from xpud.ledger.ledger import LedgerUnavailable
from xpud.model import CardMode
from xpud.planning import forecast
from xpud.planning.runfiles import FORECAST_FILE, publish_json

log = logging.getLogger("xpud.controllers.provisioner")

SLACK = 0.2  # a forecast remainder below this share of a card does not get a card of its own
FILE_NAME = FORECAST_FILE
SHOW_HOURS = 24


class Provisioner:
    def __init__(self, engine, clock=time.time):
        self.engine = engine
        self.clock = clock
        self.provisioned: set[int] = set()  # cards this provisioner switched to sliced
        self.planned: Counter[tuple[int, str]] = Counter()  # (MPS card, size) -> slices planned there
        self._warming: set[asyncio.Task] = set()
        self.scopes = None  # xpud.isolation.scope.Scopes: warm commands see only their slice's nodes

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
                for s in e.standby.on(i):  # their records go first (ledger first), then the card
                    await e.standby.drop(s.handle, why)
                if await e.to_whole(i, why):
                    e.stats.conversions[("whole", "forecast")] += 1
                    self.provisioned.discard(i)
                    switched.append(i)
                    excess -= 1
        slices = await self.slices(demand if self.cfg.enabled else {}, f"{what} expected at {at}")
        report = self.report(fits, now, demand, need, switched)
        report["slices"] = slices
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
            mape = forecast.mape(f.actual[week], f.predicted[week])
            sizes[size] = {
                "mape_last_week_pct": None if mape is None else round(100 * mape, 2),
                "past": [
                    {
                        "hour": f.t0 + (past.start + k) * forecast.HOUR_S,
                        "actual": round(float(a), 3),
                        "forecast": None if np.isnan(p) else round(float(p), 3),
                        "ape_pct": None if np.isnan(x) else round(100 * float(x), 2),
                    }
                    for k, (a, p, x) in enumerate(zip(f.actual[past], f.predicted[past], apes, strict=True))
                ],
                "next": [
                    {
                        "hour": hour + k * forecast.HOUR_S,
                        "forecast": round(f.forecast(hour + k * 3600), 3),
                    }
                    for k in range(SHOW_HOURS)
                ],
            }
        return {
            "generated": round(now, 3),
            "enabled": self.cfg.enabled,
            "lead_s": self.cfg.lead_s,
            "demand_at_lead": {s: round(v, 3) for s, v in demand.items()},
            "sliced_cards_wanted": need,
            "provisioned_cards": sorted(self.provisioned),
            "switched_now": switched,
            "sizes": sizes,
        }

    def wanted(self, demand: dict[str, float]) -> dict[str, int]:
        """Slices to have ready per size: the forecast (a remainder under ``SLACK`` of a slice does not
        count) beyond the slices of that size leases hold now."""
        held = Counter(s.size for lease in self.engine.leases.values() for s in lease.slices)
        return {size: max(0, math.ceil(v - SLACK) - held[size]) for size, v in demand.items()}

    async def slices(self, demand: dict[str, float], why: str) -> dict:
        """Pre-create (MIG) or plan (MPS) the slices ``demand`` wants; destroy or unplan the excess.
        Returns {"standby": {size: n}, "planned_mps": {size: n}, "created": [...], "destroyed": [...]}."""
        e, sb = self.engine, self.engine.standby
        await sb.sync()
        created: list[str] = []
        destroyed: list[str] = []
        want = self.wanted(demand)
        room = self.cfg.standby_max - len(sb.slices)
        for size in e.cfg.slices:
            n = want.get(size, 0)
            excess = sb.count(size) - n
            for s in sorted((s for s in sb.slices.values() if s.size == size), key=lambda s: s.handle)[::-1]:
                if excess <= 0:
                    break
                if await sb.drop(s.handle, f"forecast falls: {why}"):
                    destroyed.append(s.handle)
                    excess -= 1
            mig = [
                c.info.index
                for c in sorted(
                    e.cards.values(), key=lambda c: (c.info.index not in self.provisioned, c.info.index)
                )
                if c.mode is CardMode.SLICED and c.usable and sb.supported(c.info.index)
            ]
            for i in mig:
                while sb.count(size) < n and room > 0:
                    try:
                        made = await sb.create(i, size, f"forecast pre-provisioning: {why}")
                    except LedgerUnavailable as err:
                        log.error("%s", err)
                        made = None
                    if made is None:
                        break
                    room -= 1
                    created.append(made[0].handle)
                    self._warm(made[0], made[1], made[0].handle)
            self._plan_mps(size, max(0, n - sb.count(size)))
        return {
            "standby": {size: sb.count(size) for size in e.cfg.slices},
            "planned_mps": {
                size: sum(v for (_, z), v in self.planned.items() if z == size) for size in e.cfg.slices
            },
            "created": created,
            "destroyed": destroyed,
        }

    def _plan_mps(self, size: str, n: int) -> None:
        """Plan ``n`` ``size`` slices on sliced MPS cards (within their free shares); warm the new ones."""
        e = self.engine
        cards = [
            c
            for c in sorted(
                e.cards.values(), key=lambda c: (c.info.index not in self.provisioned, c.info.index)
            )
            if c.mode is CardMode.SLICED and c.usable and e.isolation_name(c.info.index) == "mps"
        ]
        for c in cards:
            i = c.info.index
            keep = min(n, e.slice_room(i, size))
            old = self.planned.pop((i, size), 0)
            for k in range(old, keep):  # newly planned: warm them
                s, env = e.slice_limits(i, size, f"warm{k}")
                self._warm(s, env, None)
            if keep:
                self.planned[(i, size)] = keep
            n -= keep
        on = {c.info.index for c in cards}
        for key in [k for k in self.planned if k[1] == size and k[0] not in on]:
            del self.planned[key]

    def stop(self) -> None:
        """Cancel the warm commands still running (each is killed with its session)."""
        for task in list(self._warming):
            task.cancel()

    async def warmed(self) -> None:
        """Wait until every warm_command started so far has ended (tests, shutdown)."""
        while self._warming:
            await asyncio.gather(*list(self._warming), return_exceptions=True)

    def _warm(self, s, env: dict[str, str], handle: str | None) -> None:
        """Run ``warm_command`` for slice ``s`` (in the background); ``handle``: its pre-created MIG
        instance, not handed out meanwhile."""
        cmd = self.cfg.warm_command
        if not cmd:
            return
        e = self.engine
        env = {
            **env,
            "XPU_WARM_CARD": str(s.card_index),
            "XPU_WARM_SIZE": s.size,
            "XPU_WARM_SLICE": s.handle,
        }
        if handle:
            e.standby.set_warming(handle, True)

        fence = None
        scopes = self.scopes
        if scopes is not None and scopes.enforcement.enforced:  # its own scope: the slice's nodes only
            name = scopes.warm_id(s.card_index)  # xpu-lease-warm-<owner>-<card>-<hex>.scope
            holder = SimpleNamespace(id=name, cards=(s.card_index,), slices=(s,))

            async def fence(pid: int) -> None:
                await scopes.place(holder, pid)

        async def go() -> None:
            try:
                said = await warm.run(cmd, self.cfg.warm_user, env, self.cfg.warm_timeout_s, fence)
            finally:
                if fence is not None:  # what escaped the command's session ends with it
                    scopes.end_later(name, after_s=0.0)
                if handle:
                    e.standby.set_warming(handle, False)
                    e.pump()  # a request may have waited for it
            e.event("forecast", f"card {s.card_index}: {s.size} slice {s.handle}: {said}", card=s.card_index)

        task = asyncio.ensure_future(go())
        self._warming.add(task)
        task.add_done_callback(self._warming.discard)
