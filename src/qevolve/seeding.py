"""One seed tree per run: every random choice takes its seed from (run seed, stage path).

``derive_seed(seed, "iter_1/critic")`` is the seed of iteration 1's critic stage; a stage's own
consumers (head initialisation, batch order, sampled decoding) take it from there, and a choice
that two stages must make alike (the demonstrations behaviour cloning trains on, which are also
the buffer's D_expert) has its own named node (:data:`DEMONSTRATIONS`). A replicate of a run is
the same config with another run seed, so every node of its tree changes with it.

Nothing else reseeds: :func:`seed_everything` is called once at the start of each stage, and
:func:`preserved_rng` keeps third-party code that seeds the global generators (vLLM does when an
engine starts) from changing what the stage draws next.
"""

from __future__ import annotations

import contextlib
import hashlib
import random
from typing import Iterator

#: the node of the seed tree that picks behaviour cloning's demonstrations (D_expert)
DEMONSTRATIONS = "data/demonstrations"


def derive_seed(seed: int, *path: str) -> int:
    """A 32-bit seed for the node ``path`` of the tree rooted at ``seed`` (stable across versions,
    processes and machines: sha256, not Python's salted ``hash``)."""
    key = "/".join([str(seed), *path])
    return int(hashlib.sha256(key.encode()).hexdigest()[:8], 16)


def seed_everything(seed: int) -> None:
    """Seed Python's, numpy's and torch's global generators (CPU and every GPU)."""
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # seeds every CUDA device too


@contextlib.contextmanager
def preserved_rng() -> Iterator[None]:
    """Restore Python's, numpy's and torch's global generator states on exit."""
    import numpy as np
    import torch

    states = (random.getstate(), np.random.get_state(), torch.get_rng_state(),
              torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
        if states[3] is not None:
            torch.cuda.set_rng_state_all(states[3])
