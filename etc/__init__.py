"""Package data: the default xpud.toml and simulated machine descriptions (machines/*.toml)."""
