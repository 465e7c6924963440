"""Multi-process training: DDP or FSDP over ``torch.distributed``, started by a launcher.

A training stage (behaviour cloning, the critic, BPPO/AWR) runs as one process per device when it
is launched by ``torchrun --nproc_per_node N`` or ``accelerate launch --num_processes N``; both
set ``WORLD_SIZE``/``RANK``/``LOCAL_RANK``/``MASTER_ADDR``/``MASTER_PORT``, from which
:func:`init_distributed` joins the process group through accelerate's ``PartialState`` (gloo on
CPU, nccl on CUDA). Started without a launcher, nothing here does anything: the single-process
path is unchanged.

How a step is shared (the same in every stage): the step's micro-batches (or, for the critic, the
step's trajectories) are planned exactly as in a single process, as a pure function of (seed,
epoch); rank r takes every ``world_size``-th of them. Each rank scales its loss by its share of
the step's tokens (or turns) times ``world_size``, so the all-reduced mean gradient equals the
single-process gradient of the whole step. The trajectory of the parameters therefore does not
depend on the world size (up to float summation order), and a checkpoint made with one world
size resumes with any other. A rank with fewer micro-batches than another runs padding passes of
weight 0, so that every rank takes part in every collective.

Rank 0 alone writes checkpoints, logs, summaries and the final model; the others wait at a
barrier. All ranks must see the same file system (the run folder and the data).
"""

from __future__ import annotations

import atexit
import gc
import contextlib
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterator, Literal

import torch
from pydantic import Field

from qevolve.config import StageConfig

__all__ = ["DistributedConfig", "DistContext", "init_distributed", "launcher_world_size", "shard_round_robin"]


class DistributedConfig(StageConfig):
    """Multi-process training (see :mod:`qevolve.distributed`)."""

    backend: Literal["auto", "none", "ddp", "fsdp"] = Field(
        "auto", description="auto: ddp when a launcher (torchrun, accelerate launch) started several processes "
        "(WORLD_SIZE > 1), else one process; none: one process (refuses a multi-process launch); ddp: replicate the "
        "model on every rank; fsdp: shard parameters, gradients and optimizer state over the ranks (a policy that "
        "does not fit one device; not for the critic)")
    timeout_s: float = Field(1800.0, gt=0.0, description="seconds a collective waits for the other ranks before "
                             "the run fails")


def _launcher_number(name: str, default: int) -> int:
    """An integer a launcher announced in the environment variable ``name`` (``default`` without one)."""
    value = os.environ.get(name, str(default))
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r}: expected an integer") from None


def launcher_world_size() -> int:
    """The world size a launcher announced (``WORLD_SIZE``; 1 without a launcher)."""
    return _launcher_number("WORLD_SIZE", 1)


def launcher_rank() -> int:
    """This process's rank as a launcher announced it (``RANK``; 0 without a launcher)."""
    return _launcher_number("RANK", 0)


def shard_round_robin(items: list[Any], rank: int, world_size: int, pad: Any) -> list[tuple[Any, float]]:
    """This rank's share of ``items`` (every ``world_size``-th, from ``rank``), as (item, weight 1.0), padded
    with (``pad``, weight 0.0) to ``ceil(len(items) / world_size)`` entries so that every rank has as many."""
    mine = [(item, 1.0) for item in items[rank::world_size]]
    count = -(-len(items) // world_size)
    return mine + [(pad, 0.0)] * (count - len(mine))


@dataclass
class DistContext:
    """Where this process stands: ``kind`` none|ddp|fsdp, its rank and the world size."""

    kind: str = "none"
    world_size: int = 1
    rank: int = 0
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # -- collectives (no-ops in one process) ---------------------------------------------------

    def barrier(self) -> None:
        if self.enabled:
            torch.distributed.barrier()

    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sum over the ranks (float64); the values themselves in one process."""
        if not self.enabled:
            return values
        tensor = torch.tensor(values, dtype=torch.float64, device=self._comm_device())
        torch.distributed.all_reduce(tensor)
        return tensor.cpu().tolist()

    def gather_objects(self, obj: Any) -> list[Any]:
        """``obj`` of every rank, in rank order (``[obj]`` in one process)."""
        if not self.enabled:
            return [obj]
        out: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(out, obj)
        return out

    def _comm_device(self) -> torch.device:
        if torch.distributed.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    # -- models --------------------------------------------------------------------------------

    def wrap_ddp(self, module: torch.nn.Module, device: torch.device) -> torch.nn.Module:
        """``module`` in DistributedDataParallel (itself in one process). Buffers are not re-broadcast at
        every forward (they are constants here), so ranks may run forwards that the others do not."""
        if not self.enabled:
            return module
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [device.index if device.index is not None else torch.cuda.current_device()] \
            if device.type == "cuda" else None
        return DistributedDataParallel(module, device_ids=device_ids, broadcast_buffers=False)

    def micro_batch(self, model: torch.nn.Module, sync: bool) -> contextlib.AbstractContextManager:
        """Around a micro-batch's forward and backward: reduce the gradients only when ``sync`` (the last one)."""
        if not self.enabled or sync:
            if self.kind == "fsdp" and self.enabled:
                model.set_requires_gradient_sync(True)
            return contextlib.nullcontext()
        if self.kind == "fsdp":
            model.set_requires_gradient_sync(False)
            return contextlib.nullcontext()
        return model.no_sync()

    @staticmethod
    def full_value(value: Any) -> float:
        """A scalar that may be a DTensor (FSDP's gradient norm) as a float."""
        return float(value.full_tensor() if hasattr(value, "full_tensor") else value)

    def full_model_state(self, model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
        """FSDP: the unsharded state dict on rank 0 (None elsewhere); a collective, every rank calls it."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return state if self.is_main else None

    def optimizer_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                        parameter_names: list[str]) -> dict[str, Any] | None:
        """The optimizer's state dict as one process would save it (parameters keyed by index).

        FSDP gathers the sharded state (a collective; None on ranks other than 0)."""
        if self.kind != "fsdp" or not self.enabled:
            return optimizer.state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        full = get_optimizer_state_dict(model, optimizer,
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if not self.is_main:
            return None
        index = {name: i for i, name in enumerate(parameter_names)}  # a tied weight's other names are left out
        return {"state": {index[name]: value for name, value in full["state"].items() if name in index},
                "param_groups": [{**group, "params": [index[name] for name in group["params"] if name in index]}
                                 for group in full["param_groups"]]}

    def load_optimizer_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                             state: dict[str, Any], parameter_names: list[str]) -> None:
        """Restore a state dict saved by :meth:`optimizer_state` (by any world size and backend)."""
        if self.kind != "fsdp" or not self.enabled:
            optimizer.load_state_dict(state)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        full = {"state": {parameter_names[i]: value for i, value in state["state"].items()},
                "param_groups": [{**group, "params": [parameter_names[i] for i in group["params"]]}
                                 for group in state["param_groups"]]}
        set_optimizer_state_dict(model, optimizer, full, options=StateDictOptions(full_state_dict=True))


def _device_of(device_name: str) -> torch.device:
    if device_name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device_name)


_CONTEXT: DistContext | None = None


def init_distributed(config: DistributedConfig, device_name: str = "auto", stage: str = "training",
                     allow_fsdp: bool = True) -> DistContext:
    """Join the launcher's process group (once per process) and say where this process stands.

    Without a launcher (``WORLD_SIZE`` unset or 1) this returns a one-process context and touches
    nothing, whatever ``backend`` says."""
    global _CONTEXT
    world_size = launcher_world_size()
    kind = config.backend
    if world_size <= 1:
        return DistContext()
    if kind == "none":
        raise ValueError(f"distributed.backend=none, but a launcher started {world_size} processes "
                         f"(WORLD_SIZE={world_size}): use distributed.backend=ddp (or fsdp), or launch one process")
    if kind == "fsdp" and not allow_fsdp:
        raise ValueError(f"distributed.backend=fsdp: not supported by the {stage} stage; use ddp")
    device = _device_of(device_name)
    if device.type == "cuda" and device.index is not None:
        raise ValueError(f"device {device_name!r} names one GPU, but {world_size} processes would share it: use "
                         f"device=cuda (each rank takes the GPU of its LOCAL_RANK)")
    if _CONTEXT is None:
        from accelerate import PartialState

        state = PartialState(cpu=device.type == "cpu", timeout=timedelta(seconds=config.timeout_s))
        _CONTEXT = DistContext("ddp", state.num_processes, state.process_index, state.local_process_index)
        atexit.register(_leave_process_group)
    kind = "ddp" if kind == "auto" else kind
    return DistContext(kind, _CONTEXT.world_size, _CONTEXT.rank, _CONTEXT.local_rank)


def _leave_process_group() -> None:
    """Destroy the process group while the interpreter is still whole.

    A process that exits with its gloo group alive can abort in interpreter finalisation ("terminate
    called without an active exception", SIGABRT): gloo's worker threads still hold tensors whose
    release needs the GIL (pytorch/pytorch#190489). Destroying the group is local, not a collective.

    DDP wrappers sit in reference cycles (their hooks point back at them), so a finished stage's
    wrapper, and the reducer that holds the group, lives until a garbage collection; collect it first,
    or it is freed during finalisation, after the group, by whichever thread happens to run then."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        gc.collect()
        torch.distributed.destroy_process_group()


@contextlib.contextmanager
def main_first(context: DistContext) -> Iterator[None]:
    """Rank 0 runs the block first (e.g. to fill a cache on disk), then the others."""
    if context.enabled and not context.is_main:
        context.barrier()
    yield
    if context.enabled and context.is_main:
        context.barrier()

