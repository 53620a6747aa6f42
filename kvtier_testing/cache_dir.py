"""Where the harness keeps what it builds (tiny models, vLLM compile caches, bench work folders):
a per-user cache directory, never next to the installed package or in a checkout, so a wheel
install works read-only and several checkouts share one model build."""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

#: Environment variable that moves the whole cache (CI runners, read-only homes).
ENV_VAR = "KVTIER_CACHE_DIR"


def cache_dir(*parts: str) -> Path:
    """``$KVTIER_CACHE_DIR`` or the platform's user cache directory for kvtier (on Linux
    ``$XDG_CACHE_HOME/kvtier``, by default ``~/.cache/kvtier``), joined with ``parts``."""
    root = os.environ.get(ENV_VAR) or platformdirs.user_cache_dir("kvtier", appauthor=False)
    return Path(root).joinpath(*parts)
