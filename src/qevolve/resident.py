"""This process's peak resident memory, per stage.

``ru_maxrss`` only ever grows, so it gives the peak of the whole process, not of one stage. Linux keeps
the same high-water mark as ``VmHWM`` in ``/proc/self/status`` and resets it when ``5`` is written to
``/proc/self/clear_refs`` (since Linux 4.0): a stage's own peak is the mark read at its end after a
reset at its start. Where that is unavailable (not Linux, a restricted /proc) the functions say so
with False/None and nothing is recorded. Worker processes (environment pools) are not included.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["peak_resident_bytes", "reset_peak_resident"]

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def reset_peak_resident() -> bool:
    """Start a new peak at the current resident size; False where the kernel does not allow it."""
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return True


def peak_resident_bytes() -> int | None:
    """The peak resident size since the process started or the last reset; None where unknown."""
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # reported in kB
    except (OSError, ValueError, IndexError):
        return None
    return None
