"""Configuration: the schema of xpud.toml (sections, defaults, documentation), loading, writing."""
