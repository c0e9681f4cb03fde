"""The [health] section: list-valued keys, the fragmentation slice, and the ledger's health migration."""

from __future__ import annotations

import sqlite3

import pytest

from xpud import config
from xpud.errors import ConfigError
from xpud.ledger.ledger import MIGRATIONS, SCHEMA_VERSION, HealthChangeRecord, Ledger, _statements


def test_health_keys_parse_with_lists_and_refuse_bad_values():
    cfg = config.parse("[health]\nxid_fail = [79, 48]\nclear_s = 5\n")
    assert cfg.health.xid_fail == (79, 48) and cfg.health.clear_s == 5.0
    assert hash(cfg.health)  # immutable: lists are kept as tuples
    again = config.parse(config.dumps(cfg))
    assert again.health == cfg.health
    with pytest.raises(ConfigError, match=r"x.toml:3: \[health\] xid_warn: expected a list of ints"):
        config.parse("[health]\n\nxid_warn = [1, 'two']\n", "x.toml")
    with pytest.raises(ConfigError, match=r"\[health\] fragmentation_slice: 'vxpu-tiny' is not a slice size"):
        config.parse("[health]\nfragmentation_slice = 'vxpu-tiny'\n", "x.toml")
    cfg = config.parse(
        "[health]\nfragmentation_slice = 'vxpu-eighth'\n[slices.vxpu-eighth]\n"
        "memory_fraction = 0.125\ncompute_pct = 8\n"
    )
    assert cfg.health.fragmentation_slice == "vxpu-eighth"
    with pytest.raises(ConfigError, match="xid_unlisted"):
        config.parse("[health]\nxid_unlisted = 'panic'\n")


def test_a_version_1_ledger_upgrades_and_keeps_its_leases(tmp_path):
    path = tmp_path / "l.sqlite"
    db = sqlite3.connect(path)
    for stmt in _statements(MIGRATIONS[0]):
        db.execute(stmt)
    db.execute(
        "INSERT INTO leases (id, token_hash, mode, owner_uid, cards, card_uuids, slices, env, priority,"
        " restartable, command, created, state) VALUES"
        " ('a1', 'h', 'xpu', 1, '[0]', '[\"GPU-0\"]', '[]', '{}', 0, 1, 'x', 1.0, 'active')"
    )
    db.execute("PRAGMA user_version=1")
    db.commit()
    db.close()
    led = Ledger(path)
    assert led.schema_version == SCHEMA_VERSION == 10  # 9: the jobs (xpud.ledger.jobs); 10: the accounts
    assert led.auto_leases() == {} and led.class_readings() == {}  # 6: right-sizing's records
    assert led.standby() == []  # 7: pre-created slices
    assert [x.id for x in led.active_leases()] == ["a1"]
    for ts, to in ((10.0, "unhealthy"), (20.0, "healthy"), (30.0, "degraded")):
        frm = "healthy" if to != "healthy" else "unhealthy"
        led.add_health_change(HealthChangeRecord(ts, "GPU-0", 0, frm, to, 40, ("why",)))
    led.add_health_change(HealthChangeRecord(15.0, "GPU-1", 1, "healthy", "unhealthy", 0, ("a", "b")))
    assert [c.to_state for c in led.health_changes("GPU-0")] == ["unhealthy", "healthy", "degraded"]
    assert led.health_changes("GPU-1")[0].reasons == ("a", "b")
    led.prune(older_than_days=1, now=100.0 + 2 * 86400)  # all old: each card's latest change stays
    assert [c.ts for c in led.health_changes("GPU-0")] == [30.0]
    assert [c.ts for c in led.health_changes("GPU-1")] == [15.0]
