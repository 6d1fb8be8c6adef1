"""Where tandem keeps files it makes: converted models, compiled kernels, trained draft heads."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """tandem's disk cache: `$TANDEM_CACHE`, default `~/.cache/tandem` (converted models,
    compiled kernels, trained draft heads). A stack file can name it as `${TANDEM_CACHE}`."""
    return Path(os.environ.get("TANDEM_CACHE") or Path.home() / ".cache" / "tandem")
