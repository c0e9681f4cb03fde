"""xpud: a dual-mode GPU scheduler (whole cards and isolated slices) for bare-metal AI clusters."""

__version__ = "0.1.0"
