"""Behaviour cloning (Algorithm 1, line 1): supervised fine-tuning on the agent turns of a buffer.

    L_BC(theta) = - (1 / |A|) * sum_{tokens k in agent turns A} log pi_theta(token_k | tokens_<k)

The buffer (the expert set by default) is tokenised by the same prompt builder the policy acts
with (:mod:`qevolve.policy.prompts`); only agent tokens, including each turn's end-of-turn token,
carry loss. Sequences are packed (or length-bucketed) into micro-batches of ``tokens_per_batch``
tokens; ``grad_accum_steps`` micro-batches make one optimizer step and the loss is averaged over
all agent tokens of the step. The learning rate warms up linearly and then follows a cosine down
to ``min_lr_ratio`` of its peak.

The order of micro-batches is a pure function of (seed, epoch), so a run that stopped can resume
from its last checkpoint (``<output_dir>/checkpoints/step-N``: the weights in Hugging Face format
plus ``trainer_state.pt`` with the optimizer, schedule and RNG state) and ends at the same
parameters as a run that never stopped. The final policy is saved to ``<output_dir>/final``.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from pydantic import Field
from tqdm import tqdm

from qevolve.buffer.store import Episode, read_episodes
from qevolve.config import StageConfig
from qevolve.environments.turn_format import parse_turn
from qevolve.policy.batching import BatchMode, TrainSequence, collate, plan_batches, sequences_from_episodes
from qevolve.policy.forward import target_nll
from qevolve.policy.model import ModelConfig, Policy, load_policy, unwrap_model
from qevolve.policy.prompts import PromptBuilder, PromptConfig

__all__ = ["BCDataConfig", "OptimConfig", "BCConfig", "BCResult", "run_bc", "evaluate_nll", "load_buffer",
           "prepare_sequences", "latest_checkpoint", "load_checkpoint_weights", "cosine_schedule"]


class BCDataConfig(StageConfig):
    """Which trajectories to clone and which to hold out."""

    env: str = Field("alfworld", description="environment: its instruction prompt is the system message")
    train_path: str | None = Field(None, description="trajectory store to clone (null: the expert set, "
                                   "DATA_DIR/experts/ENV)")
    num_demonstrations: int | None = Field(None, ge=1, description="use only this many episodes (a seeded "
                                           "random subset; null: all)")
    only_won: bool = Field(True, description="keep only successful episodes")
    eval_path: str | None = Field(None, description="held-out trajectory store for the agent-token loss "
                                  "(e.g. unseen-task walkthroughs); null: hold out eval_holdout train episodes")
    num_eval: int | None = Field(None, ge=1, description="use only this many held-out episodes (null: all)")
    eval_holdout: int = Field(0, ge=0, description="when eval_path is null: episodes of the train store kept "
                              "out of training for evaluation")


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


# Fields that may change between a run and its resumption (they do not change the trajectory of
# the parameters).
_RESUME_FREE = {"progress", "tensorboard", "stop_after_steps", "save_every", "keep_checkpoints", "log_every",
                "eval_every", "resume", "output_dir", "save_final", "model.num_threads", "data.eval_path",
                "data.num_eval"}


class BCConfig(StageConfig):
    """Behaviour cloning: ``qevolve bc --config configs/bc.yaml [key=value ...]``."""

    model: ModelConfig = Field(default_factory=ModelConfig, description="the policy model")
    prompt: PromptConfig = Field(default_factory=PromptConfig, description="prompt building")
    data: BCDataConfig = Field(default_factory=BCDataConfig, description="training and held-out data")
    optim: OptimConfig = Field(default_factory=OptimConfig, description="optimizer and schedule")
    epochs: float = Field(1.0, gt=0.0, description="passes over the training sequences (may be fractional)")
    max_steps: int | None = Field(None, ge=1, description="optimizer steps (overrides epochs)")
    tokens_per_batch: int = Field(4096, ge=16, description="token budget of one micro-batch")
    grad_accum_steps: int = Field(4, ge=1, description="micro-batches per optimizer step")
    batching: BatchMode = Field("pack", description="pack (concatenate sequences, block-diagonal attention) or "
                                "bucket (padded rows of similar length)")
    output_dir: str = Field("runs/bc", description="checkpoints, TensorBoard logs and the final model")
    save_every: int = Field(50, ge=1, description="checkpoint every N optimizer steps (and at the end)")
    keep_checkpoints: int = Field(2, ge=1, description="keep the newest N checkpoints")
    eval_every: int = Field(0, ge=0, description="held-out evaluation every N steps (0: before and after only)")
    log_every: int = Field(1, ge=1, description="TensorBoard scalars every N steps")
    resume: bool = Field(True, description="continue from the newest checkpoint in output_dir")
    seed: int = Field(0, description="seed of the data subset, batch order and adapter initialisation")
    progress: bool = Field(True, description="show a progress bar")
    tensorboard: bool = Field(True, description="write TensorBoard logs to output_dir/tensorboard")
    save_final: bool = Field(True, description="save the final policy to output_dir/final")
    stop_after_steps: int | None = Field(None, ge=1, description="stop this invocation after N steps without a "
                                         "final save (tests the resume path; null: run to the end)")


@dataclass
class BCResult:
    steps: int  # optimizer steps completed (in total, over resumptions)
    total_steps: int
    start_step: int  # where this invocation started (0, or the resumed checkpoint's step)
    interrupted: bool
    train_sequences: int
    train_tokens: int
    train_agent_tokens: int
    eval_before: dict[str, float] | None
    eval_after: dict[str, float] | None
    tokens_per_second: float
    seconds: float
    final_dir: Path | None
    losses: list[float] = field(default_factory=list)  # training loss of each step of this invocation

    def as_dict(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        out["final_dir"] = str(self.final_dir) if self.final_dir else None
        return out


# ---------------------------------------------------------------------------------------------
# Data


def load_buffer(path: str | Path, only_won: bool = True) -> list[Episode]:
    episodes = read_episodes(Path(path).expanduser())
    if only_won:
        episodes = [ep for ep in episodes if ep.won]
    return sorted(episodes, key=lambda ep: ep.episode_id)


def _subset(episodes: list[Episode], n: int | None, seed: int) -> list[Episode]:
    if n is None or n >= len(episodes):
        return episodes
    rng = random.Random(seed)
    return sorted(rng.sample(episodes, n), key=lambda ep: ep.episode_id)


def _check_turn_format(episodes: list[Episode], turn_format: str, source: str) -> None:
    for ep in episodes:
        for t, turn in enumerate(ep.turns):
            if turn.action_ids is None and not parse_turn(turn.agent_text, turn_format).format_valid:
                raise ValueError(f"{source}: episode {ep.episode_id!r} turn {t} is not in prompt.turn_format "
                                 f"{turn_format!r} ({turn.agent_text[:60]!r}); expert demonstrations without "
                                 f"thoughts need turn_format=action")


def prepare_sequences(episodes: list[Episode], builder: PromptBuilder, max_length: int | None = None,
                      source: str = "buffer") -> list[TrainSequence]:
    """Tokenise episodes with the prompt builder and cut them into training sequences."""
    _check_turn_format(episodes, builder.config.turn_format, source)
    tokenized = [builder.tokenize(ep) for ep in episodes]
    sequences = sequences_from_episodes(tokenized)
    if max_length is not None:
        too_long = [s for s in sequences if len(s) > max_length]
        if too_long:
            raise ValueError(f"{source}: a sequence of {len(too_long[0])} tokens exceeds the model's "
                             f"{max_length} positions; lower prompt.max_prompt_tokens")
    return sequences


@dataclass
class _Data:
    train: list[TrainSequence]
    eval: list[TrainSequence]
    train_episodes: int
    eval_episodes: int


def _load_data(config: BCConfig, builder: PromptBuilder, max_length: int | None) -> _Data:
    from qevolve.paths import data_dir

    data = config.data
    train_path = Path(data.train_path).expanduser() if data.train_path else data_dir() / "experts" / data.env
    if not train_path.exists():
        raise FileNotFoundError(f"data.train_path {train_path}: not found (build the expert set with "
                                f"`qevolve data expert {data.env}`)")
    episodes = load_buffer(train_path, data.only_won)
    eval_episodes: list[Episode] = []
    if data.eval_path:
        eval_episodes = _subset(load_buffer(data.eval_path, data.only_won), data.num_eval, config.seed)
    elif data.eval_holdout:
        rng = random.Random(f"holdout/{config.seed}")
        held = set(rng.sample(range(len(episodes)), min(data.eval_holdout, max(len(episodes) - 1, 0))))
        eval_episodes = [ep for i, ep in enumerate(episodes) if i in held]
        episodes = [ep for i, ep in enumerate(episodes) if i not in held]
    episodes = _subset(episodes, data.num_demonstrations, config.seed)
    if not episodes:
        raise ValueError(f"data.train_path {train_path}: no usable episodes")
    train = prepare_sequences(episodes, builder, max_length, str(train_path))
    held_out = prepare_sequences(eval_episodes, builder, max_length, str(data.eval_path or train_path))
    return _Data(train, held_out, len(episodes), len(eval_episodes))


# ---------------------------------------------------------------------------------------------
# Schedule, evaluation, checkpoints


def cosine_schedule(total_steps: int, warmup_steps: int, min_lr_ratio: float) -> Callable[[int], float]:
    """Learning-rate multiplier: linear warm-up to 1, then cosine from 1 down to ``min_lr_ratio``."""
    def multiplier(step: int) -> float:
        if warmup_steps and step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        progress = min(max(progress, 0.0), 1.0)
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return multiplier


@torch.no_grad()
def evaluate_nll(policy: Policy, sequences: list[TrainSequence], tokens_per_batch: int,
                 mode: BatchMode = "pack") -> dict[str, float]:
    """Mean negative log-likelihood per agent token (and its accuracy) over ``sequences``."""
    if not sequences:
        return {}
    was_training = policy.model.training
    policy.model.eval()
    total_nll, total_correct, total_targets = 0.0, 0, 0
    pad_id = policy.tokenizer.pad_token_id or 0
    for group in plan_batches(sequences, tokens_per_batch, mode, seed=0, shuffle=False):
        batch = collate(sequences, group, mode, pad_id).to(policy.device)
        with policy.autocast():
            nll, correct = target_nll(policy.model, batch)
        total_nll += float(nll)
        total_correct += int(correct)
        total_targets += batch.num_targets
    if was_training:
        policy.model.train()
    return {"agent_nll": total_nll / total_targets, "agent_accuracy": total_correct / total_targets,
            "agent_tokens": float(total_targets), "sequences": float(len(sequences))}


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


def _save_checkpoint(policy: Policy, output_dir: Path, step: int, state: dict[str, Any], keep: int) -> Path:
    folder = output_dir / "checkpoints"
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / f"step-{step:06d}"
    staging = folder / f".tmp-step-{step:06d}"
    shutil.rmtree(staging, ignore_errors=True)
    policy.save(staging, {"step": step})
    torch.save(state, staging / "trainer_state.pt")
    shutil.rmtree(final, ignore_errors=True)
    os.replace(staging, final)
    for old in _checkpoint_dirs(output_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _resume_fingerprint(config: BCConfig) -> dict[str, Any]:
    dump = config.model_dump(mode="json")
    for dotted in _RESUME_FREE:
        *parents, last = dotted.split(".")
        node = dump
        for part in parents:
            node = node.get(part, {})
        node.pop(last, None)
    return dump


def _first_difference(a: Any, b: Any, prefix: str = "") -> str | None:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            diff = _first_difference(a.get(key), b.get(key), f"{prefix}{key}.")
            if diff:
                return diff
        return None
    return prefix.rstrip(".") if a != b else None


# ---------------------------------------------------------------------------------------------
# The training loop


class _Writer:
    """TensorBoard scalars, or nothing."""

    def __init__(self, folder: Path | None):
        self.writer = None
        if folder is not None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(folder))

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if self.writer is not None:
            for name, value in values.items():
                self.writer.add_scalar(name, value, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def run_bc(config: BCConfig, log: Callable[[str], None] = print) -> BCResult:
    """Train the policy by behaviour cloning; resumable; returns losses and held-out evaluations."""
    started = time.perf_counter()
    output_dir = Path(config.output_dir).expanduser()
    checkpoint = latest_checkpoint(output_dir)
    if checkpoint is not None and not config.resume:
        raise ValueError(f"output_dir {output_dir} already holds checkpoints; set resume=true to continue or "
                         f"choose another output_dir")
    resume_state: dict[str, Any] | None = None
    if checkpoint is not None:
        resume_state = torch.load(checkpoint / "trainer_state.pt", map_location="cpu", weights_only=False)
        diff = _first_difference(resume_state["fingerprint"], _resume_fingerprint(config))
        if diff:
            raise ValueError(f"output_dir {output_dir}: its checkpoint was made with a different {diff!r}; "
                             f"use the same config to resume or another output_dir")

    random.seed(config.seed)
    torch.manual_seed(config.seed)
    policy = load_policy(config.model, trainable=True)
    model = policy.model
    builder = PromptBuilder.for_environment(policy.tokenizer, config.prompt, config.data.env)
    max_length = getattr(unwrap_model(model).config, "max_position_embeddings", None)
    data = _load_data(config, builder, max_length)
    pad_id = policy.tokenizer.pad_token_id or 0
    train_tokens = sum(len(s) for s in data.train)
    train_targets = sum(s.num_targets for s in data.train)

    def epoch_plan(epoch: int) -> list[list[int]]:
        return plan_batches(data.train, config.tokens_per_batch, config.batching, seed=config.seed * 100003 + epoch)

    micro_per_epoch = len(epoch_plan(0))
    total_steps = config.max_steps or max(1, math.ceil(config.epochs * micro_per_epoch / config.grad_accum_steps))
    warmup = config.optim.warmup_steps if config.optim.warmup_steps is not None else \
        int(round(config.optim.warmup_ratio * total_steps))
    log(f"bc: {data.train_episodes} episodes -> {len(data.train)} sequences, {train_tokens} tokens "
        f"({train_targets} agent tokens); {micro_per_epoch} micro-batches per epoch; {total_steps} steps; "
        f"model {policy.source} ({policy.precision}, {'LoRA' if policy.is_lora else 'full'}), "
        f"{sum(p.numel() for p in policy.trainable_parameters()):,} trainable parameters")

    parameters = policy.trainable_parameters()
    optimizer = torch.optim.AdamW(parameters, lr=config.optim.lr, betas=tuple(config.optim.betas),
                                  eps=config.optim.eps, weight_decay=config.optim.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, cosine_schedule(total_steps, warmup, config.optim.min_lr_ratio))
    start_step = 0
    eval_before = None
    if resume_state is not None:
        load_checkpoint_weights(policy, checkpoint)
        optimizer.load_state_dict(resume_state["optimizer"])
        scheduler.load_state_dict(resume_state["scheduler"])
        torch.set_rng_state(resume_state["torch_rng"])
        random.setstate(resume_state["python_rng"])
        start_step = resume_state["step"]
        eval_before = resume_state.get("eval_before")
        log(f"bc: resumed from {checkpoint} at step {start_step}")
    elif data.eval:
        eval_before = evaluate_nll(policy, data.eval, config.tokens_per_batch, config.batching)
        log(f"bc: held-out agent-token NLL before training {eval_before['agent_nll']:.4f} "
            f"(accuracy {eval_before['agent_accuracy']:.3f}, {data.eval_episodes} episodes)")

    writer = _Writer(output_dir / "tensorboard" if config.tensorboard else None)
    if eval_before and start_step == 0:
        writer.scalars(0, {f"eval/{k}": v for k, v in eval_before.items() if k.startswith("agent")})
    plans: dict[int, list[list[int]]] = {}

    def micro_batch(k: int):
        epoch, index = divmod(k, micro_per_epoch)
        if epoch not in plans:
            plans.clear()
            plans[epoch] = epoch_plan(epoch)
        return collate(data.train, plans[epoch][index], config.batching, pad_id)

    losses: list[float] = []
    tokens_done = 0
    compute_seconds = 0.0
    interrupted = False
    step = start_step
    bar = tqdm(total=total_steps, initial=start_step, desc="bc", unit="step", disable=not config.progress)
    model.train()
    while step < total_steps:
        if config.stop_after_steps is not None and step - start_step >= config.stop_after_steps:
            interrupted = True
            break
        t0 = time.perf_counter()
        batches = [micro_batch(step * config.grad_accum_steps + i) for i in range(config.grad_accum_steps)]
        step_targets = sum(b.num_targets for b in batches)
        step_nll, step_correct, step_tokens = 0.0, 0, 0
        for batch in batches:
            batch = batch.to(policy.device)
            with policy.autocast():
                nll, correct = target_nll(model, batch)
            # the loss of the step is the mean over all its agent tokens: scale each micro-batch's sum
            (nll / step_targets).backward()
            step_nll += float(nll.detach())
            step_correct += int(correct)
            step_tokens += batch.num_tokens
        grad_norm = None
        if config.optim.max_grad_norm is not None:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(parameters, config.optim.max_grad_norm))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        seconds = time.perf_counter() - t0
        compute_seconds += seconds
        tokens_done += step_tokens
        loss = step_nll / step_targets
        losses.append(loss)
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{step_tokens / seconds:.0f}")
        if step % config.log_every == 0:
            values = {"train/loss": loss, "train/agent_accuracy": step_correct / step_targets,
                      "train/lr": scheduler.get_last_lr()[0], "train/tokens_per_second": step_tokens / seconds,
                      "train/epoch": step * config.grad_accum_steps / micro_per_epoch}
            if grad_norm is not None:
                values["train/grad_norm"] = grad_norm
            writer.scalars(step, values)
        if config.eval_every and step % config.eval_every == 0 and data.eval and step < total_steps:
            metrics = evaluate_nll(policy, data.eval, config.tokens_per_batch, config.batching)
            writer.scalars(step, {f"eval/{k}": v for k, v in metrics.items() if k.startswith("agent")})
        if step % config.save_every == 0 or step == total_steps:
            _save_checkpoint(policy, output_dir, step, {
                "step": step, "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "torch_rng": torch.get_rng_state(), "python_rng": random.getstate(),
                "fingerprint": _resume_fingerprint(config), "eval_before": eval_before,
                "config": config.model_dump(mode="json"),
            }, config.keep_checkpoints)
    bar.close()

    eval_after = None
    final_dir = None
    if not interrupted:
        if data.eval:
            eval_after = evaluate_nll(policy, data.eval, config.tokens_per_batch, config.batching)
            writer.scalars(step, {f"eval/{k}": v for k, v in eval_after.items() if k.startswith("agent")})
            log(f"bc: held-out agent-token NLL after training {eval_after['agent_nll']:.4f} "
                f"(accuracy {eval_after['agent_accuracy']:.3f})")
        if config.save_final:
            final_dir = policy.save(output_dir / "final", {"bc_steps": step})
    writer.close()
    result = BCResult(step, total_steps, start_step, interrupted, len(data.train), train_tokens, train_targets,
                      eval_before, eval_after, tokens_done / compute_seconds if compute_seconds else 0.0,
                      time.perf_counter() - started, final_dir, losses)
    if not interrupted:
        output_dir.mkdir(parents=True, exist_ok=True)
        summary = {**result.as_dict(), "config": config.model_dump(mode="json")}
        (output_dir / "bc_summary.json").write_text(json.dumps(summary, indent=1, default=str))
    return result
