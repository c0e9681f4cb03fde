"""Multi-host placement (xpud.placement.multihost): locality first, then each host's own best group,
then health and fit; replicas spread across domains."""

from __future__ import annotations

import pytest

from xpud.placement.multihost import HostOffer, NoPlacement, place_gang, place_replicas


def offer(name, free=8, gbps=300.0, health=100, domain="r1", block="b1", zone="z1", **kw) -> HostOffer:
    return HostOffer(name, free, tuple([float("inf")] + [gbps] * 7), health, domain, block, zone, **kw)


def test_one_domain_beats_faster_hosts_spread_over_two():
    offers = [
        offer("a1", gbps=100, domain="r1"),
        offer("a2", gbps=100, domain="r1"),
        offer("b1", gbps=300, domain="r2"),
        offer("c1", gbps=300, domain="r3"),
    ]
    got = place_gang(offers, nodes=2, gpus_per_node=4)
    assert set(got.hosts) == {"a1", "a2"} and got.level == "domain" and got.where == "z1/b1/r1"


def test_falls_back_to_block_then_zone_then_anywhere():
    offers = [offer("a", domain="r1", block="b1"), offer("b", domain="r2", block="b1")]
    assert place_gang(offers, 2, 8).level == "block"
    offers = [offer("a", domain="r1", block="b1"), offer("b", domain="r2", block="b2")]
    assert place_gang(offers, 2, 8).level == "zone"
    offers = [offer("a", zone="z1"), offer("b", zone="z2", domain="r2")]
    got = place_gang(offers, 2, 8)
    assert got.level == "cluster" and got.where == "" and set(got.hosts) == {"a", "b"}


def test_within_a_domain_the_weakest_group_then_health_then_fit_decide():
    offers = [
        offer("slow", gbps=25),
        offer("fast1", gbps=300),
        offer("fast2", gbps=300, health=70),
        offer("fast3", gbps=300, free=4),  # fits 4 exactly: keeps the 8-card hosts whole
    ]
    assert set(place_gang(offers, 2, 4).hosts) == {"fast1", "fast3"}


def test_cards_too_few_dead_excluded_or_unhealthy_hosts_are_skipped():
    offers = [
        offer("a", free=2),
        offer("b", alive=False),
        offer("c", health=0),
        offer("d"),
        offer("e"),
    ]
    assert set(place_gang(offers, 2, 4).hosts) == {"d", "e"}
    assert set(place_gang(offers, 1, 4, exclude=["d"]).hosts) == {"e"}
    with pytest.raises(NoPlacement, match=r"3 host\(s\) with 4 free whole card\(s\) asked; 2 have them now"):
        place_gang(offers, 3, 4)
    with pytest.raises(ValueError):
        place_gang(offers, 0, 4)


def test_a_host_without_a_group_of_that_size_does_not_count():
    broken = HostOffer("x", 4, (float("inf"), 25.0, 0.0, 0.0), domain="r1", block="b1", zone="z1")
    assert place_gang([broken, offer("y")], 1, 2).hosts in (("x",), ("y",))
    assert place_gang([broken, offer("y")], 1, 4).hosts == ("y",)


def test_replicas_go_to_distinct_hosts_one_per_domain_first():
    offers = [
        offer(f"{d}{i}", domain=d, free_slices={"vxpu-half": 2}) for d in ("r1", "r2", "r3") for i in range(3)
    ] + [offer("full", domain="r4", free_slices={})]
    got = place_replicas(offers, "vxpu-half", 3)
    assert len(set(got)) == 3 and {h[:2] for h in got} == {"r1", "r2", "r3"}
    got = place_replicas(offers, "vxpu-half", 5)
    assert len(set(got)) == 5 and "full" not in got
    with pytest.raises(NoPlacement, match="10 host"):
        place_replicas(offers, "vxpu-half", 10)
