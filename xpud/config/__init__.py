"""Configuration: the schema of xpud.toml (``schema``: sections, defaults, documentation), reading a file
and the environment into a checked ``Config`` (``read``), writing it (``write``: TOML text, one key set in
place), and the capacity windows it names (``windows``).

Callers write ``from xpud import config`` and use the names pinned below (``config.parse``,
``config.load``, ``config.Config``, ...).
"""

from xpud.config.read import MAX_LIST, MAX_STRING, checked, load, parse, read_text, split_host_port
from xpud.config.schema import (
    DEFAULT_PATH,
    DEFAULT_SLICES,
    ENVIRONMENT,
    MAX_SEEDS,
    SECTIONS,
    SLICE_KEYS,
    AutoSection,
    BurstsSection,
    CarbonSection,
    CardsSection,
    ClusterSection,
    Config,
    DaemonSection,
    DefragSection,
    DevicesSection,
    ForecastSection,
    HealthSection,
    IsolationSection,
    KubeletSection,
    LeasesSection,
    LimitsSection,
    MetricsSection,
    SlurmSection,
    documented_keys,
    listen_address,
)
from xpud.config.windows import MAX_WINDOWS, WindowSpec
from xpud.config.write import dumps, to_dict
from xpud.errors import ConfigError

__all__ = [
    "DEFAULT_PATH",
    "DEFAULT_SLICES",
    "ENVIRONMENT",
    "MAX_LIST",
    "MAX_SEEDS",
    "MAX_STRING",
    "MAX_WINDOWS",
    "SECTIONS",
    "SLICE_KEYS",
    "AutoSection",
    "BurstsSection",
    "CarbonSection",
    "CardsSection",
    "ClusterSection",
    "Config",
    "ConfigError",
    "DaemonSection",
    "DefragSection",
    "DevicesSection",
    "ForecastSection",
    "HealthSection",
    "IsolationSection",
    "KubeletSection",
    "LeasesSection",
    "LimitsSection",
    "MetricsSection",
    "SlurmSection",
    "WindowSpec",
    "checked",
    "documented_keys",
    "dumps",
    "listen_address",
    "load",
    "parse",
    "read_text",
    "split_host_port",
    "to_dict",
]
