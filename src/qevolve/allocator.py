"""glibc heap settings that keep a process's resident memory close to what torch really holds.

glibc serves allocations above its mmap threshold with ``mmap`` (returned to the system on free),
but by default the threshold *slides*: every freed mmapped block raises it to that block's size (up
to 32 MB), so from then on activations, logits and KV-cache buffers of that size come from the heap
instead, and a freed block that is not at the top of the heap stays resident. In training, where
every step allocates and frees gigabytes in blocks of a few MB, resident memory then grows far
beyond the live tensors: one LoRA BC step on a 4,096-token packed batch of SmolLM2-135M peaked at
10.2 GB resident with the sliding threshold and 6.0 GB with a fixed 1 MB one (4.8 GB vs 1.2 GB with
gradient checkpointing; docs/memory.md). The price is a page fault for every fresh page of every
mmapped block (system time: 8.8 s -> 131 s over 4 BC steps), so it is a choice, not a default:
``model.malloc_mmap_threshold_mb`` calls :func:`use_fixed_mmap_threshold` when a model loads
(the quickstart sets it), and ``MALLOC_MMAP_THRESHOLD_`` in the environment overrides both.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

__all__ = ["DEFAULT_MMAP_THRESHOLD", "release_free_memory", "use_fixed_mmap_threshold"]

DEFAULT_MMAP_THRESHOLD = 4 << 20  # blocks of 4 MB and more are mmapped (and unmapped when freed)
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number (malloc.h)


def _libc():
    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        return ctypes.CDLL(name)
    except OSError:
        return None


def use_fixed_mmap_threshold(nbytes: int = DEFAULT_MMAP_THRESHOLD) -> bool:
    """Pin glibc's mmap threshold at ``nbytes`` (which also stops it sliding); False where not applied.

    Not applied where the user set ``MALLOC_MMAP_THRESHOLD_`` (glibc then uses that value) or where the C
    library has no ``mallopt`` (not glibc)."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    libc = _libc()
    mallopt = getattr(libc, "mallopt", None) if libc is not None else None
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, int(nbytes)))


def release_free_memory() -> bool:
    """Ask glibc to return freed heap memory to the system (``malloc_trim``); False where unavailable."""
    libc = _libc()
    trim = getattr(libc, "malloc_trim", None) if libc is not None else None
    if trim is None:
        return False
    trim(0)
    return True
