"""[accounts] and [accounts.NAME] (issue #33): parsed, checked with one-line errors, hashed alike on every
host, and the quota warning given the cluster's capacity."""

from __future__ import annotations

import pytest

from xpud import config
from xpud.config import accounts
from xpud.errors import ConfigError

SITE = """
[accounts]
reclaim = "quota"
reclaim_grace_s = 60
usage_half_life = "12h"
slurm_account = "hpc"

[accounts.research]
weight = 2

[accounts.vision]
members = ["alice", "@vision"]
quota = 16
limit = 32
parent = "research"

[accounts.nlp]
members = ["bob"]
quota = 8
parent = "research"

[accounts.hpc]
members = ["@slurm"]
quota = 4.5
"""


def test_a_site_with_nested_accounts_parses():
    cfg = config.parse(SITE)
    assert cfg.accounts.reclaim == "quota"
    assert cfg.accounts.half_life_s == 12 * 3600
    assert list(cfg.named_accounts) == ["research", "vision", "nlp", "hpc"]
    vision = cfg.named_accounts["vision"]
    assert (vision.members, vision.quota, vision.limit, vision.weight, vision.parent) == (
        ("alice", "@vision"),
        16.0,
        32.0,
        1.0,
        "research",
    )
    # a parent without a quota gets its children's
    assert cfg.named_accounts["research"].quota == 24.0
    assert cfg.named_accounts["hpc"].limit is None


def test_defaults_have_no_accounts_and_round_trip():
    cfg = config.parse("")
    assert cfg.named_accounts == {}
    assert cfg.accounts.reclaim == "fair-share"
    again = config.parse(config.dumps(config.parse(SITE)))
    assert again.named_accounts == config.parse(SITE).named_accounts
    assert again.accounts == config.parse(SITE).accounts


@pytest.mark.parametrize(
    ("text", "line", "words"),
    [
        ("[accounts.a]\nquota = -1\n", 2, ["[accounts.a] quota", "outside 0..1e+06"]),
        ("[accounts.a]\nquota = nan\n", 2, ["[accounts.a] quota", "finite number"]),
        ("[accounts.a]\nweight = inf\n", 2, ["[accounts.a] weight", "finite number"]),
        ("[accounts.a]\nquota = true\n", 2, ["[accounts.a] quota", "finite number"]),
        ("[accounts.a]\nquota = 8\nlimit = 4\n", 3, ["[accounts.a] limit", "below quota (8)", "raise limit"]),
        ("[accounts.a]\nparent = 'b'\n", 2, ["[accounts.a] parent", "'b' is not an account"]),
        ("[accounts.a]\nparent = 'a'\n", 2, ["own parent"]),
        (
            "[accounts.a]\n[accounts.b]\nparent = 'a'\n[accounts.c]\nparent = 'b'\n",
            5,
            ["[accounts.c] parent", "one level deep"],
        ),
        (
            "[accounts.p]\nquota = 4\n[accounts.c]\nquota = 8\nparent = 'p'\n",
            2,
            ["[accounts.p] quota", "below its children's quotas (8)"],
        ),
        (
            "[accounts.p]\nmembers = ['x']\n[accounts.c]\nparent = 'p'\n",
            2,
            ["[accounts.p] members", "is a parent"],
        ),
        ("[accounts.a]\nquotas = 1\n", 2, ["unknown key", "did you mean 'quota'"]),
        ("[accounts.Vision]\n", 1, ["[accounts.Vision]", "lowercase"]),
        ("[accounts.a]\nmembers = 'alice'\n", 2, ["members", "expected a list"]),
        ("[accounts.a]\nmembers = ['al ice']\n", 2, ["members", "not a user name"]),
        ("[accounts]\nreclaim = 'always'\n", 2, ["[accounts] reclaim", "not one of fair-share, quota, off"]),
        ("[accounts]\nusage_half_life = '7'\n", 2, ["usage_half_life", "not a duration"]),
        ("[accounts]\nusage_half_life = '3y'\n", 2, ["usage_half_life", "not a duration"]),
        ("[accounts]\nusage_half_life = '1s'\n", 2, ["usage_half_life", "outside 1m..365d"]),
        ("[accounts]\nreclaim_grace_s = -5\n", 2, ["reclaim_grace_s", "below the minimum"]),
        ("[accounts]\nslurm_account = 'hpc'\n", 2, ["[accounts] slurm_account", "'hpc' is not an account"]),
        (
            "[accounts]\nkubernetes_account = 'p'\n[accounts.p]\n[accounts.c]\nparent = 'p'\n",
            2,
            ["kubernetes_account", "a parent account"],
        ),
        ("[accounts.reclaim]\nquota = 1\n", 1, ["reclaim is a key of [accounts]"]),
    ],
)
def test_bad_accounts_are_one_line_naming_the_key(text, line, words):
    with pytest.raises(ConfigError) as e:
        config.parse(text, "/etc/xpud/xpud.toml")
    msg = str(e.value)
    assert msg.startswith(f"/etc/xpud/xpud.toml:{line}: "), msg
    for w in words:
        assert w in msg, msg
    assert "\n" not in msg


def test_too_many_accounts_are_refused():
    text = "".join(f"[accounts.a{i}]\n" for i in range(accounts.MAX_ACCOUNTS + 1))
    with pytest.raises(ConfigError, match=r"\[accounts\]: 257 accounts; at most 256"):
        config.parse(text)


def test_quotas_above_the_cluster_are_a_warning_given_the_capacity():
    named = config.parse(SITE).named_accounts  # top level: research 24 + hpc 4.5 = 28.5
    assert accounts.quota_warning(named, 32) is None
    assert accounts.quota_warning(named, 28.5) is None
    warning = accounts.quota_warning(named, 16)
    assert warning is not None and "sum to 28.5" in warning and "cluster's 16" in warning
    assert "\n" not in warning


def test_the_hash_is_the_same_for_the_same_meaning_and_differs_otherwise():
    base = config.parse(SITE)
    h = accounts.config_hash(base.accounts, base.named_accounts)
    assert len(h) == 16
    spelled = SITE.replace("quota = 16", "quota = 16.0").replace(
        '["alice", "@vision"]', '["@vision", "alice"]'
    )
    spelled = spelled.replace("quota = 16.0\nlimit = 32", "limit = 32\nquota = 16.0")
    other = config.parse(spelled)
    assert accounts.config_hash(other.accounts, other.named_accounts) == h
    for change in (("quota = 8", "quota = 9"), ('reclaim = "quota"', 'reclaim = "off"'), ("weight = 2", "")):
        cfg = config.parse(SITE.replace(*change))
        assert accounts.config_hash(cfg.accounts, cfg.named_accounts) != h, change


def test_durations():
    assert accounts.duration_s("7d") == 7 * 86400
    assert accounts.duration_s("1.5h") == 5400
    assert accounts.duration_s("2w") == 14 * 86400
    for bad in ("", "d", "-1d", "1e3s", "nan s"):
        with pytest.raises(ValueError):
            accounts.duration_s(bad)
