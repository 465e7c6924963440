"""Behaviour-proximal policy optimisation on a labelled buffer: ``qevolve policy``.

Method section 6. The policy improves on the actions of the fixed buffer D only (expert and self
turns alike), never on new environment interaction:

    eta_t = pi_theta(a_t|s_t) / pi_old(a_t|s_t)                       per token of agent turn t
    J     = E_D[ min(eta_t A_t, clip(eta_t, 1 - eps_low, 1 + eps_high) A_t) ] - alpha KL(pi_theta || pi_ref)

* ``pi_old`` is the policy that starts the phase (``model.name_or_path``, usually the policy that
  collected D_self); its log-probs are computed once, before the first update, over every action
  token of the buffer (expert turns have no stored acting log-probs, and recomputing keeps one
  definition for all turns).
* ``pi_ref`` is the behaviour-cloned policy (``reference``); its log-probs are computed once too.
  In the first iteration pi_ref = pi_old and one pass serves both.
* A_t is the turn's process reward from ``qevolve label`` (GAE over the critic's V by default),
  applied to every token of the turn. By default the advantages are standardised once over the
  whole buffer, each turn counted once (not each token), in float64; ``step`` standardises over
  each optimiser step's turns instead; a standard deviation below ``standardize_min_std`` only
  centres them (all-equal advantages become 0 rather than noise scaled up to +-1).
* The loss is averaged over action tokens; the objective is a registered name (``bppo`` or the
  ``awr`` ablation), so swapping it is a config value.

Training mechanics (packing, schedule, checkpoints, resume, TensorBoard) are shared with behaviour
cloning in :mod:`qevolve.training.trainer`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable, Literal

import torch
from pydantic import Field, field_validator

from qevolve.buffer.store import Episode, episodes_of_sources, read_episodes, usable_episodes
from qevolve.models.loading import ModelConfig, acting_settings, load_policy, unwrap_model
from qevolve.policy.bc import prepare_sequences
from qevolve.policy.objectives import ObjectiveConfig, compute_objective
from qevolve.process_rewards.advantages import shift_and_scale
from qevolve.progress import quiet_third_party, use_bars
from qevolve.prompting import PromptBuilder, PromptConfig
from qevolve.scalars import SCALARS_FILE
from qevolve.training.batching import collate
from qevolve.training.forward import sequence_logprobs, target_logprobs
from qevolve.training.trainer import (MicroBatchOutput, OptimConfig, PolicyResult, ScalarWriter, Trainer,
                                      TrainingConfig, TrainingMethod)

__all__ = ["PolicyStageConfig", "run_policy_update"]

class PolicyStageConfig(TrainingConfig):
    """Policy improvement on a labelled buffer: ``qevolve policy --buffer B --init C [key=value ...]``.

    The optimizer, schedule, batching and checkpoint fields are those of every training stage
    (:class:`qevolve.training.trainer.TrainingConfig`)."""

    env: str = Field("alfworld", description="environment: its instruction prompt is the system message")
    buffer_path: str | None = Field(None, description="labelled trajectory store (advantages on every turn)")
    model: ModelConfig = Field(default_factory=ModelConfig, description="the policy that starts the phase "
                               "(pi_old); a LoRA checkpoint keeps training its adapter")
    reference: str | None = Field(None, description="the behaviour-cloned policy pi_ref of the KL term "
                                  "(null: the starting policy, as in the first iteration)")
    prompt: PromptConfig = Field(default_factory=PromptConfig, description="prompt building (as in BC/rollouts)")
    objective: ObjectiveConfig = Field(default_factory=ObjectiveConfig, description="bppo (default) or awr")
    standardize_advantages: Literal["buffer", "step", "buffer_scale", "none"] = Field(
        "buffer", description="standardise the turns' advantages (each turn counted once, float64): buffer = "
        "once over every turn of the buffer (default), step = over the turns of each optimiser step, "
        "buffer_scale = divided by the buffer's standard deviation but not centred (every turn keeps the sign "
        "its label gave it), none = as labelled")
    standardize_min_std: float = Field(1e-6, ge=0.0, description="below this standard deviation the advantages "
                                       "are only centred, not scaled")
    advantage_floor: float | None = Field(None, description="raise every advantage below this to it, after "
                                          "standardisation (what the loss sees): 0 = positive-only, the policy "
                                          "only moves toward turns labelled better than the buffer's average "
                                          "and never away from the others; null: off (the method)")
    only_sources: list[str] | None = Field(None, description="train only on turns of these sources "
                                           "(null: every turn of the buffer, expert and self)")
    include_failed: bool = Field(False, description="also train on episodes lost to environment failures "
                                 "(stored with failed=true); by default they are left out")
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=5e-5),
                               description="optimizer and schedule")
    output_dir: str = Field("runs/policy", description="checkpoints, TensorBoard logs and the final policy")
    target_kl: float | None = Field(None, gt=0.0, description="stop the stage before an optimizer step whose "
                                    "micro-batches' approximate KL(pi_old || pi_theta) per action token "
                                    "(approx_kl_old, the k3 estimator) exceeds this, and keep the policy of the "
                                    "step before, as PPO's target_kl does; null: never stop (the method as "
                                    "published)")

    @field_validator("standardize_advantages", mode="before")
    @classmethod
    def _renamed_batch_mode(cls, value: Any) -> Any:
        if value == "batch":
            raise ValueError("'batch' (per micro-batch, per token) was removed: it flipped the sign of lone "
                             "failures; expected buffer (default), step, buffer_scale or none")
        return value


def _turn_advantages(episodes: list[Episode], source: str) -> dict[tuple[int, int], float]:
    table: dict[tuple[int, int], float] = {}
    for e, ep in enumerate(episodes):
        for t, turn in enumerate(ep.turns):
            if turn.advantage is None:
                raise ValueError(f"{source}: episode {ep.episode_id!r} turn {t} has no advantage; "
                                 "label the buffer first (`qevolve label`)")
            table[(e, t)] = float(turn.advantage)
    return table


def _shift_and_scale(turn_advantages: torch.Tensor, min_std: float = 1e-6) -> tuple[float, float]:
    """Mean and divisor that standardise ``turn_advantages`` (one value per turn), in float64 (the rule of
    :func:`qevolve.process_rewards.advantages.shift_and_scale`)."""
    return shift_and_scale(turn_advantages.detach().to(torch.float64).cpu().numpy(), min_std)


def _standardize(turn_advantages: torch.Tensor, min_std: float = 1e-6) -> torch.Tensor:
    """(A - mean) / std over the given per-turn advantages, in float64; only centred below ``min_std``."""
    shift, scale = _shift_and_scale(turn_advantages, min_std)
    return (turn_advantages.to(torch.float64) - shift) / scale


class _PolicyUpdate(TrainingMethod):
    """The registered policy objective in the trainer's loop: each micro-batch's loss is the objective's
    mean over its action tokens, weighted by its share of the step's action tokens."""

    def __init__(self, trainer: Trainer, policy: Any, config: PolicyStageConfig, sequences: list, seq_adv: list,
                 token_adv: list, old_logp: list, ref_logp: list, log: Callable[[str], None]):
        self.trainer, self.policy, self.config, self.sequences = trainer, policy, config, sequences
        self.seq_adv, self.token_adv = seq_adv, token_adv
        self.old_logp, self.ref_logp, self.log = old_logp, ref_logp, log
        self.pad_id = policy.tokenizer.pad_token_id or 0
        self.stage = f"policy/{config.objective.name}"
        self.target_kl_stop: dict[str, float] | None = None

    def begin_step(self, step: int, groups: list[list[int]]) -> tuple[float, float, int]:
        shift, scale = 0.0, 1.0
        if self.config.standardize_advantages == "step":  # over the step's turns (every rank's), each turn once
            shift, scale = _shift_and_scale(torch.cat([self.seq_adv[i] for group in groups for i in group]),
                                            self.config.standardize_min_std)
        return shift, scale, self.trainer.targets_of(groups)  # the last: over every rank's micro-batches

    def micro_batch(self, group: list[int], weight: float, context: tuple[float, float, int],
                    step: int) -> MicroBatchOutput:
        shift, adv_scale, step_targets = context
        batch = collate(self.sequences, group, self.config.batching, self.pad_id).to(self.policy.device)
        old = torch.cat([self.old_logp[i] for i in group])
        ref = torch.cat([self.ref_logp[i] for i in group])
        adv = (torch.cat([self.token_adv[i] for i in group]) - shift) / adv_scale
        if self.config.advantage_floor is not None:
            adv = adv.clamp(min=self.config.advantage_floor)
        adv = adv.float()
        with self.policy.autocast():
            logp = target_logprobs(self.trainer.model, batch)
        device = logp.device
        out = compute_objective(self.config.objective, logp, old.to(device), ref.to(device), adv.to(device),
                                torch.ones_like(logp))
        # before the backward (under DDP/FSDP raised by every rank at the optimizer step)
        self.trainer.check_loss(out.loss, self.stage, step + 1)
        share = batch.num_targets / step_targets
        scale = self.trainer.loss_scale(weight)  # 1 in one process
        # the objective averages over this micro-batch's tokens: weight it by its share of the step
        loss = out.loss * (share * scale if scale != 1.0 else share)
        return MicroBatchOutput(loss, {key: value * share for key, value in out.stats.items()}, batch.num_tokens)

    def stop_before_update(self, stats: dict[str, float], step: int) -> bool:
        # The guard reads the KL measured on this step's batch before its update (the same on every rank),
        # so a rerun or a resume stops at the same step; the step's gradients are dropped, not applied.
        target = self.config.target_kl
        if target is None or stats["approx_kl_old"] <= target:
            return False
        self.target_kl_stop = {"step": step + 1, "approx_kl_old": stats["approx_kl_old"]}
        self.log(f"policy: stopped before step {step + 1} of {self.trainer.total_steps}: approx_kl_old "
                 f"{stats['approx_kl_old']:.4f} > target_kl {target}; the policy is that of step {step}")
        return True

    def postfix(self, stats: dict[str, float]) -> dict[str, str]:
        return {"loss": f"{stats.get('loss', 0):.4f}", "kl": f"{stats.get('kl_ref', 0):.4f}"}

    def scalars(self, stats: dict[str, float], done: int) -> dict[str, float]:
        return {f"policy/{k}": v for k, v in stats.items()}

    def checkpoint_state(self, stats: dict[str, float]) -> dict[str, Any]:
        return {"old_logprobs": self.old_logp, "ref_logprobs": self.ref_logp, "last_stats": stats}


def run_policy_update(config: PolicyStageConfig, log: Callable[[str], None] = print) -> PolicyResult:
    """One BPPO (or AWR) phase on the labelled buffer; resumable; returns per-step statistics."""
    started = time.perf_counter()
    if not config.buffer_path:
        raise ValueError("buffer_path: a labelled trajectory store is required")
    trainer = Trainer(config)  # seeds, and refuses a mismatched checkpoint early
    quiet_third_party(bars=use_bars(config.progress))
    dist = trainer.dist
    if not dist.is_main:
        log = lambda message: None  # noqa: E731 - rank 0 alone reports
    policy = load_policy(config.model, trainable=True)
    builder = PromptBuilder.for_environment(policy.tokenizer, config.prompt, config.env)
    episodes = usable_episodes(read_episodes(Path(config.buffer_path).expanduser()), config.include_failed)
    episodes = episodes_of_sources(episodes, config.only_sources, f"buffer_path {config.buffer_path}")
    if not episodes:
        raise ValueError(f"buffer_path {config.buffer_path}: no episodes to train on")
    advantages = _turn_advantages(episodes, config.buffer_path)
    max_length = getattr(unwrap_model(policy.model).config, "max_position_embeddings", None)
    sequences = prepare_sequences(episodes, builder, max_length, config.buffer_path)
    # one advantage per turn of each sequence, float64
    seq_adv = [torch.tensor([advantages[(s.episode, t)] for t in s.turns], dtype=torch.float64) for s in sequences]
    if config.standardize_advantages in ("buffer", "buffer_scale"):  # once, over every turn trained on
        shift, scale = _shift_and_scale(torch.cat(seq_adv), config.standardize_min_std)
        # Centring moves every turn by the buffer mean: when most advantages are small and positive (a
        # final Buy Now after V has risen), it turns them negative. buffer_scale keeps the labelled signs.
        shift = shift if config.standardize_advantages == "buffer" else 0.0
        seq_adv = [(a - shift) / scale for a in seq_adv]
    # per-token advantages in each sequence's target order (a turn's A on all its tokens)
    token_adv = [torch.repeat_interleave(a, torch.tensor([end - start for start, end in s.spans]))
                 for a, s in zip(seq_adv, sequences)]
    action_tokens = sum(s.num_targets for s in sequences)

    # pi_old and pi_ref log-probs, once, before any update (a resumed run reads them back).
    progress, silent = config.progress, not dist.is_main
    if trainer.resume_state is not None:
        old_logp, ref_logp = trainer.resume_state["old_logprobs"], trainer.resume_state["ref_logprobs"]
    else:
        old_logp = sequence_logprobs(policy, sequences, config.tokens_per_batch, config.batching, progress, "pi_old",
                                    silent)
        ref_logp = old_logp
        if config.reference and Path(config.reference).expanduser() != Path(policy.source):
            reference = load_policy(config.model.model_copy(update={"name_or_path": config.reference}), trainable=False)
            ref_logp = sequence_logprobs(reference, sequences, config.tokens_per_batch, config.batching, progress,
                                         "pi_ref", silent)
            del reference

    trainer.start(policy, sequences)
    total_steps, start_step = trainer.total_steps, trainer.start_step
    log(f"policy ({config.objective.name}): {len(episodes)} episodes -> {len(sequences)} sequences, "
        f"{action_tokens} action tokens; {total_steps} steps; model {policy.source} ({policy.precision})")
    if trainer.resume_state is not None:
        log(f"policy: resumed from {trainer.checkpoint} at step {start_step}")
    if dist.enabled:
        log(f"policy: {dist.kind} over {dist.world_size} processes (this is rank 0)")

    writer = ScalarWriter(trainer.output_dir / "tensorboard" if config.tensorboard and dist.is_main else None,
                          trainer.output_dir / SCALARS_FILE if dist.is_main else None, start_step)
    method = _PolicyUpdate(trainer, policy, config, sequences, seq_adv, token_adv, old_logp, ref_logp, log)
    stats_log = trainer.fit(f"policy/{config.objective.name}", method, writer, config.progress,
                            silent=not dist.is_main)
    target_kl_stop = method.target_kl_stop
    writer.close()
    step, interrupted = trainer.steps_done, trainer.interrupted
    output_dir = trainer.output_dir
    final_dir = trainer.save_final(f"policy/{config.objective.name}", step,
                                   {"policy_steps": step, "objective": config.objective.name,
                                    **acting_settings(config.env, config.prompt)})
    result = PolicyResult(step, total_steps, interrupted, len(sequences), action_tokens,
                          time.perf_counter() - started, final_dir, stats_log,
                          (trainer.resume_state or {}).get("last_stats", {}), target_kl_stop)
    if not interrupted and dist.is_main:
        summary = {**result.summary(), "final_dir": "final" if final_dir else None}  # relative, as in BC
        (output_dir / "policy_summary.json").write_text(json.dumps(summary, indent=1, default=str))
    return result
