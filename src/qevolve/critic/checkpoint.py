"""Atomic ``torch.save`` (temp file + rename), so an interrupted job never leaves half a file."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch


def atomic_torch_save(obj: Any, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def relative_to_folder(path: str | Path, folder: str | Path) -> str | None:
    """``path`` relative to ``folder`` (``../../bc/final``) when both lie in one run directory, so a
    moved or renamed run still finds it; None when ``path`` is not a local folder or shares no
    ancestor with ``folder`` below the filesystem root."""
    target, base = Path(path).expanduser().resolve(), Path(folder).expanduser().resolve()
    if not target.exists():
        return None
    common = Path(os.path.commonpath([target, base]))
    if common == Path(common.anchor):
        return None
    return os.path.relpath(target, base)


def recorded_path(absolute: str, relative: str | None, folder: str | Path) -> str:
    """The path a checkpoint recorded: ``relative`` (to the checkpoint's folder) when it exists,
    else the absolute one it was saved with."""
    if relative is not None:
        candidate = Path(folder) / relative
        if candidate.exists():
            return str(candidate)
    return absolute
