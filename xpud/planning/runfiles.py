"""Files the daemon publishes in its runtime directory for unprivileged ``xpu`` commands (the carbon
signal, the forecast): JSON, world-readable, replaced atomically so a reader never sees half a file."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

FORECAST_FILE = "forecast.json"  # the demand forecast (xpud.controllers.provisioner; `xpu forecast`)


def publish_json(data, runtime_dir: str | os.PathLike, name: str) -> Path:
    """Write ``data`` as ``runtime_dir/name`` (mode 0644) by write-and-rename. Blocking: off the loop."""
    fd, tmp = tempfile.mkstemp(dir=runtime_dir, prefix=f".{name}-")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.chmod(tmp, 0o644)
        path = Path(runtime_dir) / name
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
