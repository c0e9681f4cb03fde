"""Slice demand forecast: an hour-of-week profile with exponential smoothing, in NumPy. Pure.

Demand of a slice size in an hour = the mean number of its slices held during that hour (time-weighted
occupancy, from the ledger's lease intervals). The model keeps one value per hour of the week (168 slots,
the host's local time): each week's observation of a slot moves it by ``alpha`` (seasonal exponential
smoothing, i.e. Holt-Winters with the level folded into the season and no trend). The forecast of an hour
is its slot's value; a slot never observed yet forecasts the mean of those that were.

``history`` also gives, for every past hour, the forecast that was made *before* that hour was observed
(one step ahead), so the error shown (APE per hour, MAPE over hours with demand) is an honest one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime

import numpy as np

HOUR_S = 3600.0
WEEK_H = 168


def hour_of_week(t: float) -> int:
    """Slot 0..167 of a UNIX time in the host's local time (0: Monday 00:00-01:00)."""
    d = datetime.fromtimestamp(t)
    return d.weekday() * 24 + d.hour


def occupancy(starts: np.ndarray, ends: np.ndarray, t0: float, n_hours: int) -> np.ndarray:
    """Mean number of the intervals ``[starts, ends)`` open in each hour from ``t0`` (seconds): the integral
    F(t) = sum(min(t, e) - s for s < t) - ... computed from sorted ends and prefix sums, O((N + H) log N)."""
    edges = t0 + HOUR_S * np.arange(n_hours + 1)
    s, e = np.sort(starts), np.sort(ends)
    cs, ce = np.concatenate(([0.0], np.cumsum(s))), np.concatenate(([0.0], np.cumsum(e)))
    ns, ne = np.searchsorted(s, edges, "left"), np.searchsorted(e, edges, "left")
    integral = (edges * ns - cs[ns]) - (edges * ne - ce[ne])  # open-time of all intervals before each edge
    return np.diff(integral) / HOUR_S


@dataclass(frozen=True)
class Fit:
    """What the model learnt: the profile after the last observed hour, and its one-step-ahead record."""

    t0: float  # start of the first observed hour
    actual: np.ndarray  # observed demand per hour from t0
    predicted: np.ndarray  # the forecast each hour had before it was observed (nan: no data yet)
    profile: np.ndarray  # 168 slots after the last hour (nan: never observed)

    def forecast(self, t: float) -> float:
        """Forecast demand for the hour containing ``t``."""
        v = self.profile[hour_of_week(t)]
        if math.isnan(v):
            seen = self.profile[~np.isnan(self.profile)]
            return float(seen.mean()) if seen.size else 0.0
        return float(v)


def fit(actual: np.ndarray, t0: float, alpha: float) -> Fit:
    """Run the smoothing over the hourly series ``actual`` starting at the hour ``t0``."""
    if not 0 < alpha <= 1:
        raise ValueError(f"alpha {alpha!r} must be in (0, 1]")
    n = len(actual)
    first = hour_of_week(t0)
    # Lay the series on whole weeks (slot 0 first), nan before t0 and after the end, then smooth a week at
    # a time: every slot of a week moves together, as arrays.
    pad = first
    weeks = math.ceil((pad + n) / WEEK_H) or 1
    grid = np.full(weeks * WEEK_H, np.nan)
    grid[pad : pad + n] = actual
    grid = grid.reshape(weeks, WEEK_H)
    profile = np.full(WEEK_H, np.nan)
    predicted = np.full_like(grid, np.nan)
    for w in range(weeks):
        row = grid[w]
        seen = profile[~np.isnan(profile)]
        fallback = seen.mean() if seen.size else np.nan
        predicted[w] = np.where(np.isnan(profile), fallback, profile)
        has = ~np.isnan(row)
        fresh = has & np.isnan(profile)
        profile = np.where(fresh, row, profile)
        upd = has & ~fresh
        profile = np.where(upd, alpha * row + (1 - alpha) * profile, profile)
    return Fit(t0, np.asarray(actual, float), predicted.ravel()[pad : pad + n], profile)


def ape(actual: np.ndarray, predicted: np.ndarray) -> np.ndarray:
    """Absolute percentage error per hour (nan where the actual is 0 or no forecast existed)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.abs(actual - predicted) / actual
    return np.where((actual > 0) & ~np.isnan(predicted), out, np.nan)


def mape(actual: np.ndarray, predicted: np.ndarray) -> float | None:
    """Mean APE over the hours with demand and a forecast; None when there are none."""
    e = ape(actual, predicted)
    e = e[~np.isnan(e)]
    return float(e.mean()) if e.size else None


def demand_by_size(
    intervals: list[tuple[str, float, float | None]], sizes: list[str], now: float, days: int
) -> tuple[float, dict[str, np.ndarray]]:
    """Hourly demand per slice size over the last ``days`` days of whole hours before ``now``:
    (t0, {size: series})."""
    end = math.floor(now / HOUR_S) * HOUR_S
    t0 = end - days * 24 * HOUR_S
    n = int((end - t0) / HOUR_S)
    out = {}
    for size in sizes:
        rows = [(c, now if e is None else e) for m, c, e in intervals if m == size]
        arr = np.array(rows, float).reshape(-1, 2)
        out[size] = occupancy(arr[:, 0], arr[:, 1], t0, n)
    return t0, out
