"""torch for the torchrun tests: required in CI (.ci/run installs the CPU build, torch==2.13.0), skipped
with the reason elsewhere."""

from __future__ import annotations

import importlib.util
import os

import pytest

HAVE_TORCH = importlib.util.find_spec("torch") is not None


def need_torch() -> None:
    if HAVE_TORCH:
        return
    if os.environ.get("CI") == "true":
        pytest.fail("torch is not installed: CI must run `pip install torch==2.13.0` (see .ci/run)")
    pytest.skip("torch is not installed (pip install torch==2.13.0, the CPU build): torchrun not checked")
