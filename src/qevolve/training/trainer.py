"""The training mechanics shared by behaviour cloning and the policy update (BPPO/AWR).

Both stages train the policy on packed token sequences with AdamW, a linear warm-up and a cosine
decay, ``grad_accum_steps`` micro-batches per optimizer step, periodic checkpoints and exact
resumption. What differs is only the loss of a micro-batch, so each stage keeps its own loop body
and this module owns the rest:

* :class:`TrainingConfig`, the fields every training stage has (documented once);
* :class:`Trainer`: the run folder, the resume check (a checkpoint made with a different config is
  refused, naming the first differing field), the micro-batch schedule as a pure function of
  (seed, epoch), the optimizer and schedule, clipping and stepping, and checkpoints;
* :func:`load_checkpoint_weights`, :func:`latest_checkpoint`, :func:`cosine_schedule`, and the
  TensorBoard :class:`ScalarWriter`.

A checkpoint is ``<output_dir>/checkpoints/step-N``: the weights in Hugging Face format plus
``trainer_state.pt`` (optimizer, schedule, RNG states, the config fingerprint and whatever the
stage adds), written to a temporary folder and renamed, so a crash never leaves half of one.

Under a multi-process launcher (torchrun, accelerate launch) the trainer wraps the model in DDP or
FSDP (``distributed.backend``), gives each rank every ``world_size``-th micro-batch of a step
(:meth:`Trainer.local_groups`), and lets rank 0 alone write checkpoints; see
:mod:`qevolve.distributed`. A checkpoint does not depend on the world size.
"""

from __future__ import annotations

import math
import os
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Literal

import torch
from pydantic import Field

from qevolve.atomic_io import load_state

from qevolve.config import StageConfig
from qevolve.distributed import DistContext, DistributedConfig, init_distributed, shard_round_robin
from qevolve.finite import NonFiniteError, check_finite, check_finite_parameters, non_finite_error
from qevolve.models.loading import Policy, unwrap_model
from qevolve.progress import progress_bar
from qevolve.training.batching import BatchMode, TrainSequence, plan_batches

__all__ = ["OptimConfig", "TrainingConfig", "Trainer", "ScalarWriter", "cosine_schedule", "latest_checkpoint",
           "load_checkpoint_weights", "first_difference"]


# torch's AdamW keywords for each implementation; "default" lets torch choose (for_loop on CPU, foreach on GPU)
ADAMW_IMPLEMENTATIONS: dict[str, dict[str, bool | None]] = {
    "default": {"foreach": None, "fused": None}, "for_loop": {"foreach": False, "fused": False}, "foreach": {"foreach": True, "fused": False},
    "fused": {"foreach": False, "fused": True}}


class OptimConfig(StageConfig):
    """AdamW with linear warm-up and a cosine decay."""

    lr: float = Field(2e-4, gt=0.0, description="peak learning rate (LoRA; use about 2e-5 for full fine-tuning)")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas")
    eps: float = Field(1e-8, gt=0.0, description="AdamW epsilon")
    max_grad_norm: float | None = Field(1.0, gt=0.0, description="clip the gradient norm (null: no clipping)")
    warmup_steps: int | None = Field(None, ge=0, description="linear warm-up steps (null: warmup_ratio of the run)")
    warmup_ratio: float = Field(0.05, ge=0.0, le=1.0, description="warm-up as a fraction of all steps")
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0, description="the cosine ends at this fraction of the peak")
    implementation: Literal["default", "for_loop", "foreach", "fused"] = Field(
        "default", description="AdamW kernel: default (torch's choice: for_loop on CPU, foreach on GPU), for_loop "
        "(one tensor at a time), foreach (grouped tensors) or fused (one kernel per step). They order the update's "
        "arithmetic differently, so the weights differ in the last bits")


class TrainingConfig(StageConfig):
    """Fields of every policy-training stage (behaviour cloning, BPPO/AWR)."""

    optim: OptimConfig = Field(default_factory=OptimConfig, description="optimizer and schedule")
    epochs: float = Field(1.0, gt=0.0, description="passes over the training sequences (may be fractional)")
    max_steps: int | None = Field(None, ge=1, description="optimizer steps (overrides epochs)")
    tokens_per_batch: int = Field(4096, ge=16, description="token budget of one micro-batch")
    grad_accum_steps: int = Field(4, ge=1, description="micro-batches per optimizer step")
    batching: BatchMode = Field("pack", description="pack (concatenate sequences, block-diagonal attention) or "
                                "bucket (padded rows of similar length)")
    output_dir: str = Field("runs/train", description="checkpoints, TensorBoard logs and the final model")
    save_every: int = Field(50, ge=1, description="checkpoint every N optimizer steps (and at the end)")
    keep_checkpoints: int = Field(2, ge=1, description="keep the newest N checkpoints")
    log_every: int = Field(1, ge=1, description="TensorBoard scalars every N steps")
    resume: bool = Field(True, description="continue from the newest checkpoint in output_dir")
    seed: int = Field(0, description="seed of the data subset, batch order and adapter initialisation")
    progress: bool = Field(True, description="show a progress bar")
    tensorboard: bool = Field(True, description="write TensorBoard logs to output_dir/tensorboard")
    save_final: bool = Field(True, description="save the final policy to output_dir/final")
    stop_after_steps: int | None = Field(None, ge=1, description="stop this invocation after N steps without a "
                                         "final save (tests the resume path; null: run to the end)")
    distributed: DistributedConfig = Field(default_factory=DistributedConfig,
                                           description="multi-process training under torchrun/accelerate launch")


# Fields that may change between a run and its resumption: they do not change the trajectory of
# the parameters.
RESUME_FREE = frozenset({"progress", "tensorboard", "stop_after_steps", "save_every", "keep_checkpoints",
                         "log_every", "eval_every", "resume", "output_dir", "save_final", "model.num_threads",
                         "distributed"})


def cosine_schedule(total_steps: int, warmup_steps: int, min_lr_ratio: float) -> Callable[[int], float]:
    """Learning-rate multiplier: linear warm-up to 1, then cosine from 1 down to ``min_lr_ratio``."""
    def multiplier(step: int) -> float:
        if warmup_steps and step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        progress = min(max(progress, 0.0), 1.0)
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return multiplier


def _checkpoint_dirs(output_dir: Path) -> list[Path]:
    folder = output_dir / "checkpoints"
    if not folder.is_dir():
        return []
    dirs = [p for p in folder.glob("step-*") if (p / "trainer_state.pt").is_file()]
    return sorted(dirs, key=lambda p: int(p.name.split("-")[1]))


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    dirs = _checkpoint_dirs(Path(output_dir))
    return dirs[-1] if dirs else None


def load_checkpoint_weights(policy: Policy, folder: Path) -> None:
    """Load the trainable weights saved by :meth:`Policy.save` back into ``policy`` (exactly)."""
    from safetensors.torch import load_file

    if policy.is_lora:
        from peft import set_peft_model_state_dict

        state = load_file(str(folder / "adapter_model.safetensors"))
        result = set_peft_model_state_dict(policy.model, state)
        unexpected = getattr(result, "unexpected_keys", [])
        if unexpected:
            raise ValueError(f"{folder}: adapter does not match the model (unexpected {unexpected[:3]})")
        return
    state: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        state.update(load_file(str(file)))
    model = unwrap_model(policy.model)
    result = model.load_state_dict(state, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or {})
    missing = [k for k in result.missing_keys if k not in tied]
    if missing or result.unexpected_keys:
        raise ValueError(f"{folder}: weights do not match the model (missing {missing[:3]}, "
                         f"unexpected {result.unexpected_keys[:3]})")
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()


def resume_fingerprint(config: StageConfig, free: frozenset[str] = RESUME_FREE) -> dict[str, Any]:
    """The config as a nested dict without the fields that may change on resumption."""
    dump = config.model_dump(mode="json")
    for dotted in free:
        *parents, last = dotted.split(".")
        node = dump
        for part in parents:
            node = node.get(part, {})
        node.pop(last, None)
    return dump


def upgraded_fingerprint(config_class: type[StageConfig], recorded: dict[str, Any],
                         free: frozenset[str] = RESUME_FREE) -> dict[str, Any]:
    """A checkpoint's recorded fingerprint read through today's ``config_class``: a field added since
    counts as its default, and a setting renamed or moved since as its new name (each config class
    maps what it once called otherwise), so an old checkpoint resumes with the config it was made
    with. A fingerprint the class no longer reads is returned as it stands (the comparison names it)."""
    try:
        return resume_fingerprint(config_class.model_validate(recorded), free)
    except ValueError:  # pydantic's ValidationError included
        return recorded


def first_difference(a: Any, b: Any, prefix: str = "") -> str | None:
    """The dotted name of the first field where two nested dicts differ (None when equal)."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            diff = first_difference(a.get(key), b.get(key), f"{prefix}{key}.")
            if diff:
                return diff
        return None
    return prefix.rstrip(".") if a != b else None


class ScalarWriter:
    """TensorBoard scalars in ``folder`` (or none), and the same values in the ``jsonl`` file (or none):
    the per-step curves the run report and the run-level loggers read (:mod:`qevolve.scalars`).
    ``start_step``: the step a resumed training continues from (later lines of the file are dropped)."""

    def __init__(self, folder: Path | None, jsonl: Path | None = None, start_step: int = 0):
        from qevolve.scalars import ScalarLog

        self.writer = None
        if folder is not None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(folder))
        self.log = ScalarLog(jsonl, resume_step=start_step) if jsonl is not None else None

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if self.writer is not None:
            for name, value in values.items():
                self.writer.add_scalar(name, value, step)
        if self.log is not None:
            self.log.write(step, values)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.log is not None:
            self.log.close()


@dataclass
class MicroBatchOutput:
    """One micro-batch's part of an optimizer step, as a :class:`TrainingMethod` computes it."""

    loss: torch.Tensor  # what backward() runs on: already scaled to the micro-batch's share of the step
    stats: dict[str, float]  # added over the step's micro-batches (and ranks) into the step's statistics
    tokens: int  # tokens processed (for tokens/s)


class TrainingMethod:
    """What a training method adds to the one optimizer-step loop, :meth:`Trainer.fit`.

    Only :meth:`micro_batch` is required: the loss of one micro-batch (a group of the trainer's sequences)
    with the statistics it contributes. The loop owns the rest (micro-batch schedule, gradient
    accumulation and reduction over ranks, the optimizer step, progress, scalars, checkpoints, resume)."""

    def begin_step(self, step: int, groups: list[list[int]]) -> Any:
        """Per-step context handed to every micro-batch of step ``step`` (0-based); ``groups`` are all its
        micro-batches, every rank's (e.g. the step's token count, or statistics over its turns)."""
        return None

    def micro_batch(self, group: list[int], weight: float, context: Any, step: int) -> MicroBatchOutput:
        """The loss of micro-batch ``group`` (sequence indices); ``weight`` is 0 for a rank's padding repeat."""
        raise NotImplementedError

    def end_step(self, totals: dict[str, float], context: Any, step: int) -> dict[str, float]:
        """The step's statistics from the micro-batches' summed contributions (all ranks')."""
        return totals

    def stop_before_update(self, stats: dict[str, float], step: int) -> bool:
        """True to end the stage before this step's update (its gradients are dropped), e.g. a KL guard."""
        return False

    def scalars(self, stats: dict[str, float], done: int) -> dict[str, float]:
        """The scalars logged after ``done`` steps (every ``log_every``)."""
        return {}

    def postfix(self, stats: dict[str, float]) -> dict[str, str]:
        """What the progress bar shows after a step."""
        return {}

    def after_step(self, stats: dict[str, float], done: int) -> None:
        """Anything else after the update (e.g. a held-out evaluation every ``eval_every`` steps)."""

    def checkpoint_state(self, stats: dict[str, float]) -> dict[str, Any]:
        """What a checkpoint saves beside the weights, optimizer and schedule, for resuming."""
        return {}


class Trainer:
    """Optimizer, schedule, micro-batch plan and checkpoints of one training run.

    Use: ``trainer = Trainer(config, free_fields)`` before building the model (it reads
    the newest checkpoint and refuses a mismatched config early), then
    ``trainer.start(policy, sequences)`` once the data is tokenised, then per optimizer step
    ``trainer.step_groups(step)`` -> the micro-batches' sequence indices, the stage's forward and
    backward passes (through ``trainer.model``, on this rank's ``trainer.local_groups(groups)``,
    each inside ``trainer.micro_batch(k, n)``; a micro-batch's loss through ``trainer.check_loss``
    before its backward), ``trainer.optimizer_step(stage, step)`` (refuses a non-finite gradient
    norm), ``trainer.maybe_save(step, extra_state)``, and at the end ``trainer.save_policy(folder,
    extra, stage, step)`` (both check the parameters first). In one process ``trainer.model`` is
    ``policy.model`` and the local groups are all of them.
    """

    def __init__(self, config: TrainingConfig, free: frozenset[str] = RESUME_FREE):
        self.config = config
        self.output_dir = Path(config.output_dir).expanduser()
        self.fingerprint = resume_fingerprint(config, free)
        self.checkpoint = latest_checkpoint(self.output_dir)
        self.resume_state: dict[str, Any] | None = None
        if self.checkpoint is not None:
            if not config.resume:
                raise ValueError(f"output_dir {self.output_dir} already holds checkpoints; set resume=true to "
                                 f"continue or choose another output_dir")
            self.resume_state = load_state(self.checkpoint / "trainer_state.pt")
            diff = first_difference(upgraded_fingerprint(type(config), self.resume_state["fingerprint"], free),
                                    self.fingerprint)
            if diff:
                raise ValueError(f"output_dir {self.output_dir}: its checkpoint was made with a different "
                                 f"{diff!r}; use the same config to resume or another output_dir")
        self.start_step = self.resume_state["step"] if self.resume_state else 0
        self.steps_done = self.start_step  # advanced by finish_step
        self.interrupted = False  # set by pending_steps on a stop request
        self._pending_loss_error: NonFiniteError | None = None  # see check_loss
        model_config = getattr(config, "model", None)
        self.dist: DistContext = init_distributed(config.distributed, getattr(model_config, "device", "auto"))
        random.seed(config.seed)
        torch.manual_seed(config.seed)

    def start(self, policy: Policy, sequences: list[TrainSequence]) -> None:
        """Plan the run over ``sequences``, build the optimizer and restore a checkpoint if any."""
        config = self.config
        self.policy = policy
        self.sequences = sequences
        first_plan = self._epoch_plan(0)
        self.micro_per_epoch = len(first_plan)
        self.total_steps = config.max_steps or max(
            1, math.ceil(config.epochs * self.micro_per_epoch / config.grad_accum_steps))
        warmup = config.optim.warmup_steps if config.optim.warmup_steps is not None else \
            int(round(config.optim.warmup_ratio * self.total_steps))
        if self.resume_state is not None:
            load_checkpoint_weights(policy, self.checkpoint)
        self.model = self._wrap(policy)
        self.parameters = policy.trainable_parameters()  # after FSDP replaced them with their shards
        self._parameter_names = self._trainable_names()
        self.optimizer = torch.optim.AdamW(self.parameters, lr=config.optim.lr, betas=tuple(config.optim.betas),
                                           eps=config.optim.eps, weight_decay=config.optim.weight_decay,
                                           **ADAMW_IMPLEMENTATIONS[config.optim.implementation])
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, cosine_schedule(self.total_steps, warmup, config.optim.min_lr_ratio))
        self._plans: dict[int, list[list[int]]] = {0: first_plan}  # the current epoch's plan only
        if self.resume_state is not None:
            self.dist.load_optimizer_state(self.model, self.optimizer, self.resume_state["optimizer"],
                                           self._parameter_names)
            self.scheduler.load_state_dict(self.resume_state["scheduler"])
            torch.set_rng_state(self.resume_state["torch_rng"])
            random.setstate(self.resume_state["python_rng"])
            cuda_rng = self.resume_state.get("cuda_rng")
            # LoRA dropout on a GPU draws from the CUDA generators: without them a resumed run differs
            if cuda_rng is not None and torch.cuda.is_available() and len(cuda_rng) == torch.cuda.device_count():
                torch.cuda.set_rng_state_all(cuda_rng)
            if self.dist.is_main:
                # a run killed after writing a checkpoint but before deleting the oldest one still
                # ends with the checkpoints an uninterrupted run keeps
                self._prune_checkpoints()

    def _wrap(self, policy: Policy) -> Any:
        if not self.dist.enabled:
            return policy.model
        from qevolve.training.forward import TargetLogits

        root = TargetLogits(policy.model)
        if self.dist.kind == "fsdp":
            if policy.merged:
                raise ValueError("distributed.backend=fsdp: a policy with a merged LoRA base is not supported; "
                                 "use ddp")
            from torch.distributed.fsdp import fully_shard

            for layer in unwrap_model(policy.model).get_decoder().layers:
                fully_shard(layer)
            fully_shard(root)
            return root
        return self.dist.wrap_ddp(root, policy.device)

    def _trainable_names(self) -> list[str]:
        # the names torch.distributed.checkpoint gives the trainable parameters (FSDP checkpoints)
        if self.dist.kind != "fsdp" or not self.dist.enabled:
            return []
        return [name for name, p in self.model.named_parameters() if p.requires_grad]

    def local_groups(self, groups: list[list[int]]) -> list[tuple[list[int], float]]:
        """This rank's micro-batches of a step as (group, weight): every ``world_size``-th one, padded with
        weight-0 repeats of the first so that every rank runs as many (all of them, weight 1, in one process)."""
        if not self.dist.enabled:
            return [(group, 1.0) for group in groups]
        return shard_round_robin(groups, self.dist.rank, self.dist.world_size, groups[0])

    def loss_scale(self, weight: float) -> float:
        """Factor of a local micro-batch's loss: its weight times the world size (DDP/FSDP average the ranks'
        gradients; the step's loss is a sum over all its micro-batches)."""
        return weight * self.dist.world_size

    def micro_batch(self, index: int, count: int) -> Any:
        """Context around the forward and backward of local micro-batch ``index`` of ``count``: the
        gradients are reduced over the ranks after the last one only."""
        return self.dist.micro_batch(self.model, index == count - 1)

    def targets_of(self, groups: list[list[int]]) -> int:
        """Agent tokens of the step's micro-batches (all ranks')."""
        return sum(self.sequences[i].num_targets for group in groups for i in group)

    def _epoch_plan(self, epoch: int) -> list[list[int]]:
        # a pure function of (seed, epoch): a resumed run sees the same batches as an unbroken one
        return plan_batches(self.sequences, self.config.tokens_per_batch, self.config.batching,
                            seed=self.config.seed * 100003 + epoch)

    def step_groups(self, step: int) -> list[list[int]]:
        """Sequence indices of the ``grad_accum_steps`` micro-batches of optimizer step ``step`` (0-based)."""
        groups = []
        for k in range(step * self.config.grad_accum_steps, (step + 1) * self.config.grad_accum_steps):
            epoch, index = divmod(k, self.micro_per_epoch)
            if epoch not in self._plans:
                self._plans.clear()
                self._plans[epoch] = self._epoch_plan(epoch)
            groups.append(self._plans[epoch][index])
        return groups

    def epoch_at(self, step: int) -> float:
        return step * self.config.grad_accum_steps / self.micro_per_epoch

    def should_stop(self, step: int) -> bool:
        """True when this invocation must stop early (``stop_after_steps``: the resume path's test hook)."""
        limit = self.config.stop_after_steps
        return limit is not None and step - self.start_step >= limit

    def pending_steps(self) -> Iterator[int]:
        """The 0-based indices of the optimizer steps this invocation still runs.

        Ends early on a stop request (:meth:`should_stop`), setting ``self.interrupted``; ``self.steps_done``
        counts the steps finished so far (:meth:`finish_step`), the resumed ones included."""
        self.interrupted = False
        self.steps_done = self.start_step
        for step in range(self.start_step, self.total_steps):
            if self.should_stop(step):
                self.interrupted = True
                return
            yield step

    def fit(self, stage: str, method: TrainingMethod, writer: ScalarWriter, progress: bool = True,
            silent: bool = False) -> list[dict[str, float]]:
        """The optimizer-step loop every training stage runs, from ``start_step`` to the end (or a stop).

        Per step: the method's context (:meth:`TrainingMethod.begin_step`), this rank's micro-batches, each
        one's forward and backward (gradients reduced over the ranks after the last), the statistics summed
        over micro-batches and ranks, the method's step statistics, an optional stop before the update, the
        optimizer step, then progress, scalars, the method's after-step work and a checkpoint when due.
        Returns each finished step's statistics; ``stopped_at`` is the 0-based step a method's stop ended
        the loop before (None otherwise), ``interrupted`` and ``steps_done`` as for :meth:`pending_steps`,
        ``fit_tokens`` the tokens of the finished steps (all ranks') and ``fit_seconds`` their time from
        the start of each step to its update (without scalars, evaluations and checkpoints)."""
        self.stopped_at: int | None = None
        self.fit_tokens, self.fit_seconds = 0, 0.0
        history: list[dict[str, float]] = []
        bar = progress_bar(total=self.total_steps, initial=self.start_step, desc=stage, unit="step",
                           enabled=progress, silent=silent)
        self.model.train()
        for step in self.pending_steps():
            started = time.perf_counter()
            groups = self.step_groups(step)
            context = method.begin_step(step, groups)
            local = self.local_groups(groups)
            totals: dict[str, float] = {}
            tokens = 0
            for k, (group, weight) in enumerate(local):
                with self.micro_batch(k, len(local)):
                    out = method.micro_batch(group, weight, context, step)
                    out.loss.backward()
                if weight:
                    for key, value in out.stats.items():
                        totals[key] = totals.get(key, 0.0) + value
                    tokens += out.tokens
            if self.dist.enabled:
                keys = sorted(totals)
                *values, tokens = self.dist.sum([totals[key] for key in keys] + [tokens])
                totals = dict(zip(keys, values))
            stats = method.end_step(totals, context, step)
            if method.stop_before_update(stats, step):
                self.optimizer.zero_grad(set_to_none=True)
                self.stopped_at = step
                break
            done = self.finish_step(stage, step, stats, tokens, started)
            self.fit_seconds += time.perf_counter() - started
            self.fit_tokens += tokens
            history.append(stats)
            bar.set_postfix(**method.postfix(stats))
            bar.update(1)
            if done % self.config.log_every == 0:
                writer.scalars(done, method.scalars(stats, done))
            method.after_step(stats, done)
            self.maybe_save(done, method.checkpoint_state(stats))
        bar.close()
        return history

    def finish_step(self, stage: str, step: int, stats: dict[str, float], tokens: int, started: float) -> int:
        """The optimizer step closing step ``step`` (0-based) of every stage's loop; returns the steps done.

        Adds ``grad_norm`` (when clipping is on) and ``tokens_per_second`` (``tokens`` since ``started``, a
        ``time.perf_counter()`` reading) to ``stats``."""
        grad_norm = self.optimizer_step(stage, step + 1)
        if grad_norm is not None:
            stats["grad_norm"] = grad_norm
        stats["tokens_per_second"] = tokens / max(time.perf_counter() - started, 1e-9)
        self.steps_done = step + 1
        return self.steps_done

    def save_final(self, stage: str, step: int, extra: dict[str, Any]) -> Path | None:
        """The final policy in ``output_dir/final`` unless interrupted or ``save_final`` is off (parameters
        checked first: never a non-finite final model); its folder, or None."""
        if self.interrupted or not self.config.save_final:
            return None
        return self.save_policy(self.output_dir / "final", extra, stage, step)

    def optimizer_step(self, stage: str = "training", step: int | None = None) -> float | None:
        """Clip, step the optimizer and the schedule, clear the gradients; returns the gradient norm (None when
        ``optim.max_grad_norm`` is null).

        A NaN or infinite gradient norm (or loss, which makes one) raises
        :class:`qevolve.finite.NonFiniteError` naming ``stage`` and ``step`` before anything is applied. Under
        DDP/FSDP the norm is that of the all-reduced gradients, the same on every rank, and a non-finite loss
        one rank saw (:meth:`check_loss`) is shared, so every rank raises together."""
        max_norm = self.config.optim.max_grad_norm
        grad_norm = self.dist.full_value(torch.nn.utils.clip_grad_norm_(
            self.parameters, max_norm if max_norm is not None else math.inf))
        pending, self._pending_loss_error = self._pending_loss_error, None
        if self.dist.enabled:
            elsewhere = self.dist.sum([1.0 if pending is not None else 0.0])[0] > 0
            if elsewhere and pending is None:
                pending = non_finite_error(stage, step, "loss (on another rank)", "nan/inf",
                                           latest_checkpoint(self.output_dir))
        if pending is not None or not math.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            if pending is not None:
                raise pending
            self.check_finite(grad_norm, stage, step, "gradient norm")
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm if max_norm is not None else None

    def check_finite(self, value: Any, stage: str, step: int | None, quantity: str) -> float:
        """``value`` as a float, or NonFiniteError naming the stage, step, quantity and last good checkpoint."""
        number = float(value.detach()) if isinstance(value, torch.Tensor) else float(value)
        if math.isfinite(number):
            return number
        return check_finite(number, stage, step, quantity, latest_checkpoint(self.output_dir))  # raises

    def check_parameters(self, stage: str, step: int | None) -> None:
        """NonFiniteError if a trainable parameter holds NaN or infinity (before any save)."""
        last_good = latest_checkpoint(self.output_dir)
        # FSDP: each rank checks its own shards (DTensor.to_local); a rank's failure is shared
        named = [(n, p.to_local() if hasattr(p, "to_local") else p)
                 for n, p in self.policy.model.named_parameters() if p.requires_grad]
        error: NonFiniteError | None = None
        try:
            check_finite_parameters(named, stage, step, last_good)
        except NonFiniteError as exc:
            error = exc
        if self.dist.enabled and self.dist.sum([1.0 if error is not None else 0.0])[0] > 0 and error is None:
            error = non_finite_error(stage, step, "parameter (on another rank)", "nan/inf", last_good)
        if error is not None:
            raise error

    def check_loss(self, value: Any, stage: str, step: int | None, quantity: str = "loss") -> float:
        """A micro-batch's loss, checked before its backward: in one process as :meth:`check_finite`.

        Under DDP/FSDP a rank must not leave the collectives of a backward pass the others are in, so a
        non-finite value is held and raised by every rank at the next :meth:`optimizer_step`, before it
        applies anything."""
        number = float(value.detach()) if isinstance(value, torch.Tensor) else float(value)
        if math.isfinite(number):
            return number
        if not self.dist.enabled:
            return self.check_finite(number, stage, step, quantity)  # raises
        if self._pending_loss_error is None:
            self._pending_loss_error = non_finite_error(stage, step, quantity, number,
                                                        latest_checkpoint(self.output_dir))
        return number

    def maybe_save(self, step: int, extra_state: dict[str, Any]) -> Path | None:
        """Checkpoint after optimizer step ``step`` when it is due (every ``save_every`` and the last)."""
        if step % self.config.save_every and step != self.total_steps:
            return None
        self.check_parameters("checkpoint", step)
        optimizer_state = self.dist.optimizer_state(self.model, self.optimizer, self._parameter_names)
        model_state = self._full_model_state()
        final = self.output_dir / "checkpoints" / f"step-{step:06d}"
        if self.dist.is_main:
            state = {"step": step, "optimizer": optimizer_state, "scheduler": self.scheduler.state_dict(),
                     "torch_rng": torch.get_rng_state(), "python_rng": random.getstate(),
                     **({"cuda_rng": torch.cuda.get_rng_state_all()} if torch.cuda.is_initialized() else {}),
                     "fingerprint": self.fingerprint, **extra_state}
            self._write_checkpoint(step, state, model_state)
        self.dist.barrier()
        return final

    def _full_model_state(self) -> dict[str, torch.Tensor] | None:
        # FSDP: gather the policy's unsharded weights (every rank takes part); keyed as policy.model's
        if self.dist.kind != "fsdp" or not self.dist.enabled:
            return None
        state = self.dist.full_model_state(self.model)
        if state is None:
            return None
        inner = unwrap_model(self.policy.model)
        # tied weights (the output layer = the embeddings) are saved once, as save_pretrained does
        tied = set(getattr(inner, "_tied_weights_keys", None) or {}) \
            if getattr(inner.config, "tie_word_embeddings", False) else set()
        state = {name.removeprefix("model."): value for name, value in state.items()}
        return {name: value for name, value in state.items()
                if not any(name == key or name.endswith("." + key) for key in tied)}

    def save_policy(self, folder: Path, extra: dict[str, Any], stage: str = "final",
                    step: int | None = None) -> Path:
        """Save the policy (rank 0 writes; every rank returns the folder), after :meth:`check_parameters`
        (``stage``, ``step``): never a non-finite model."""
        self.check_parameters(stage, step)
        model_state = self._full_model_state()
        if self.dist.is_main:
            self.policy.save(folder, extra, state_dict=model_state)
        self.dist.barrier()
        return folder

    def _write_checkpoint(self, step: int, state: dict[str, Any], model_state: dict[str, torch.Tensor] | None) -> None:
        folder = self.output_dir / "checkpoints"
        folder.mkdir(parents=True, exist_ok=True)
        final = folder / f"step-{step:06d}"
        staging = folder / f".tmp-step-{step:06d}"
        shutil.rmtree(staging, ignore_errors=True)
        self.policy.save(staging, {"step": step}, state_dict=model_state)
        torch.save(state, staging / "trainer_state.pt")
        shutil.rmtree(final, ignore_errors=True)
        os.replace(staging, final)
        self._prune_checkpoints()

    def _prune_checkpoints(self) -> None:
        """Keep the newest ``keep_checkpoints`` checkpoints; drop staging folders of interrupted writes."""
        for old in _checkpoint_dirs(self.output_dir)[:-self.config.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)
        for staging in (self.output_dir / "checkpoints").glob(".tmp-step-*"):
            shutil.rmtree(staging, ignore_errors=True)


@dataclass
class PolicyResult:
    steps: int
    total_steps: int
    interrupted: bool
    sequences: int
    action_tokens: int
    seconds: float
    final_dir: Path | None
    stats: list[dict[str, float]] = field(default_factory=list)  # per optimizer step
    # the last step's statistics saved with the checkpoint this invocation resumed from (reported
    # when it had no step left to run, as after a kill between the last checkpoint and the final save)
    resumed_stats: dict[str, float] = field(default_factory=dict)
    # set when target_kl ended the stage: the optimizer step not taken (1-based) and its approx_kl_old
    target_kl_stop: dict[str, float] | None = None

    def summary(self) -> dict[str, Any]:
        last = self.stats[-1] if self.stats else self.resumed_stats
        stop = {f"target_kl_stop_{k}": v for k, v in self.target_kl_stop.items()} if self.target_kl_stop else {}
        return {"steps": self.steps, "sequences": self.sequences, "action_tokens": self.action_tokens,
                "seconds": round(self.seconds, 1), "final_dir": str(self.final_dir) if self.final_dir else None,
                **stop, **{f"last_{k}": v for k, v in last.items()}}
