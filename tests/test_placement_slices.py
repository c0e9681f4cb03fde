"""Fixed slice profiles (MIG-like) round requests up; free-size slices (MPS-like) do not."""

from __future__ import annotations

import pytest

from xpud.placement.cluster import Demand
from xpud.placement.slices import CardSlices, Rounding


def test_rounding_to_profiles():
    qh = Rounding.named("quarter-half")
    assert [qh.size(m) for m in (100, 250, 251, 500, 501, 810)] == [250, 250, 500, 500, 1000, 1000]
    q3 = Rounding.named("quarter-half-3q")
    assert q3.size(600) == 750 and q3.size(810) == 1000
    free = Rounding.named("free")
    assert free.size(333) == 333


def test_rounding_applies_to_fractional_tasks_only():
    qh = Rounding.named("quarter-half")
    assert qh.apply(Demand(1, 1, 1, 300)).gpu_milli == 500
    assert qh.waste(Demand(1, 1, 1, 300)) == 200
    assert qh.apply(Demand(1, 1, 2, 1000)) == Demand(1, 1, 2, 1000)
    assert qh.apply(Demand(1, 1)) == Demand(1, 1)
    assert Rounding.named("whole").apply(Demand(1, 1, 1, 10)).gpu_milli == 1000


def test_unknown_mode_is_an_error():
    with pytest.raises(ValueError, match="unknown slice mode"):
        Rounding.named("eighths")


def test_card_ledger_free_size_and_fixed_profiles():
    mps = CardSlices()
    assert mps.add("a", 300) == 300 and mps.add("b", 700) == 700
    assert mps.free_milli == 0 and not mps.fits(1)
    mps.remove("a")
    assert mps.fits(300) and not mps.fits(301)

    mig = CardSlices(profiles=(250, 500, 1000))
    assert mig.add("a", 300) == 500  # rounded up
    assert mig.add("b", 100) == 250
    assert not mig.fits(300)  # would need 500, 250 left
    with pytest.raises(ValueError):
        mig.add("c", 300)
    assert mig.mode == "sliced"


def test_whole_lease_excludes_slices():
    card = CardSlices()
    card.add("w", 1000)
    assert card.mode == "whole" and not card.fits(1)
    with pytest.raises(ValueError):
        CardSlices(slices={"x": 10}).add("w", 1000)
