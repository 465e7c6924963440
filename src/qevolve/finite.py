"""Guards against NaN and infinity in training: stop at the first non-finite quantity, say where.

Every training stage (critic, behaviour cloning, BPPO/AWR) checks its loss and gradient norm
before an optimizer step applies them, and its parameters before a checkpoint or final model is
written. The first failure raises :class:`NonFiniteError` (a ``ValueError``, so the CLI prints it
as one line) naming the stage, the step, the quantity and the last good checkpoint, which is left
untouched; no non-finite model is ever written.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Iterable

import torch

__all__ = ["NonFiniteError", "check_finite", "check_finite_parameters", "non_finite_error"]


class NonFiniteError(ValueError):
    """A loss, gradient, parameter or prediction that is NaN or infinite."""


def non_finite_error(stage: str, step: int | None, quantity: str, value: object,
                     last_good: str | Path | None) -> NonFiniteError:
    where = f" at step {step}" if step is not None else ""
    kept = f"the last good checkpoint {last_good} is kept" if last_good else "no checkpoint was written yet"
    return NonFiniteError(f"{stage}: non-finite {quantity} ({value}){where}; stopped without applying it, "
                          f"{kept} and no final model is written")


def check_finite(value: float | torch.Tensor, stage: str, step: int | None, quantity: str,
                 last_good: str | Path | None = None) -> float:
    """``value`` as a float, or :class:`NonFiniteError` when it is NaN or infinite."""
    number = float(value.detach()) if isinstance(value, torch.Tensor) else float(value)
    if not math.isfinite(number):
        raise non_finite_error(stage, step, quantity, number, last_good)
    return number


@torch.no_grad()
def check_finite_parameters(named: Iterable[tuple[str, torch.Tensor]], stage: str, step: int | None,
                            last_good: str | Path | None = None) -> None:
    """:class:`NonFiniteError` naming the first parameter with a NaN or infinite entry."""
    for name, tensor in named:
        if not bool(torch.isfinite(tensor).all()):
            bad = int((~torch.isfinite(tensor)).sum())
            raise non_finite_error(stage, step, f"parameter {name}", f"{bad} of {tensor.numel()} entries",
                                   last_good)
