"""Where qevolve keeps installed data, converted models and caches."""

from __future__ import annotations

import os
from pathlib import Path

DATA_DIR_ENV = "QEVOLVE_DATA_DIR"


def data_dir() -> Path:
    """The data directory: ``$QEVOLVE_DATA_DIR`` or a per-user cache folder (``~/.cache/qevolve``)."""
    explicit = os.environ.get(DATA_DIR_ENV)
    if explicit:
        return Path(explicit).expanduser()
    cache_root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache_root) / "qevolve"


def shared_data_dir() -> Path | None:
    """The project's offline copy of the raw data (``../shared/data`` beside a checkout), if present."""
    here = Path(__file__).resolve()
    for parent in here.parents:
        candidate = parent.parent / "shared" / "data"
        if (parent / "pyproject.toml").is_file() and candidate.is_dir():
            return candidate
    return None


def path_safe(name: str) -> str:
    """``name`` as one safe file or folder name: an environment given as ``module:name`` (or with a
    ``/``) would otherwise put a colon in a folder name, which Windows, macOS's Finder, ``scp`` and
    ``rsync`` (``host:path``) read differently; every character but letters, digits, ``.``, ``_`` and
    ``-`` becomes ``_``."""
    import re

    return re.sub(r"[^\w.-]", "_", name)
