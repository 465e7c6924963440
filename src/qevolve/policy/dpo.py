"""ETO-style trajectory DPO on a buffer: ``qevolve dpo`` and the ``eto`` baseline (not Q-Evolve).

ETO (Song et al., 2024, "Trial and Error: Exploration-Based Trajectory Optimization for LLM Agents")
contrasts a successful and a failed trajectory of the *same task* with the DPO loss, the log-
likelihood of a trajectory being the sum over its agent tokens (observations are conditioned on,
never scored):

    logp(tau)   = sum_{agent tokens k of tau} log pi(token_k | tokens_<k)
    margin      = beta * [ (logp_theta(tau_w) - logp_ref(tau_w)) - (logp_theta(tau_l) - logp_ref(tau_l)) ]
    L_DPO       = - E_pairs[ log sigmoid(margin) ]                                   (+ sft_coef * NLL(tau_w))

``pi_ref`` is the behaviour-cloned policy (its log-probs are computed once, before any update).
The method's settings and the shared training fields are one config, :class:`DPOConfig`.

Pairs come from one buffer only, and only from episodes of the same task: for every task, the
best-scoring episode is the chosen one and every episode of that task with a strictly lower score
(by at least ``min_score_gap``) is a rejected one (``max_pairs_per_task`` caps them). With a
Q-Evolve buffer (expert demonstrations + self rollouts on the same training tasks) that is ETO's
(expert success, own failure) contrast.

Training mechanics (optimizer, schedule, checkpoints, resume) are the shared
:class:`qevolve.training.trainer.Trainer`; its micro-batch plan runs over *pairs* (each pair's token
count is the sum of both trajectories' sequences), so a pair is never split across micro-batches.
DPO runs in one process: it refuses a multi-process launch (``WORLD_SIZE`` > 1); BC and BPPO/AWR
are the stages that train under DDP/FSDP.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from pydantic import Field, model_validator

from qevolve.buffer.store import Episode, episodes_of_sources, read_episodes, usable_episodes
from qevolve.distributed import launcher_world_size
from qevolve.models.loading import ModelConfig, acting_settings, load_policy, unwrap_model
from qevolve.policy.bc import prepare_sequences
from qevolve.prompting import PromptBuilder, PromptConfig
from qevolve.scalars import SCALARS_FILE
from qevolve.training.batching import collate
from qevolve.training.forward import sequence_logprobs, target_logprobs
from qevolve.training.trainer import (MicroBatchOutput, OptimConfig, PolicyResult, ScalarWriter, Trainer,
                                      TrainingConfig, TrainingMethod)

__all__ = ["DPOConfig", "build_preference_pairs", "dpo_loss", "run_dpo"]


# DPO was once the ``dpo`` objective of the policy stage: its settings were ``objective.dpo_*`` beside
# BPPO's, and the eto section of a run was a whole policy-stage config. Such a config (an old YAML file,
# a run's manifest, a checkpoint's fingerprint) still loads: the DPO keys map to this config's fields,
# and the BPPO/AWR keys, which DPO never read, are dropped when they hold the value every old config
# recorded by default (anything else is refused, as a setting that would silently do nothing).
_OLD_OBJECTIVE_KEYS = {"dpo_beta": "beta", "dpo_sft_coef": "sft_coef", "dpo_min_score_gap": "min_score_gap",
                       "dpo_max_pairs_per_task": "max_pairs_per_task"}
_UNUSED_OBJECTIVE_DEFAULTS = {"eps_low": 0.8, "eps_high": 0.4, "kl_coef": 0.02, "kl_estimator": "k3",
                              "awr_beta": 1.0, "awr_max_weight": 20.0}
_UNUSED_POLICY_STAGE_DEFAULTS = {"standardize_advantages": "buffer", "standardize_min_std": 1e-6,
                                 "advantage_floor": None, "target_kl": None}
_DPO_FIELDS = "beta, sft_coef, min_score_gap, max_pairs_per_task"


def _from_policy_stage_keys(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with the keys of an old policy-stage config with ``objective.name: dpo`` mapped to DPOConfig's."""
    data = dict(data)
    objective = data.pop("objective", None)
    if objective is not None:
        if not isinstance(objective, dict):
            raise ValueError(f"objective: DPO has no objective to choose; its settings are the fields {_DPO_FIELDS}")
        objective = dict(objective)
        name = objective.pop("name", "dpo")
        if name != "dpo":
            raise ValueError(f"objective.name {name!r}: this is DPO's config, which has no objective to choose; "
                             "BPPO and AWR are the policy stage's (`qevolve policy`, the policy section of "
                             "qevolve evolve)")
        for old, new in _OLD_OBJECTIVE_KEYS.items():
            if old not in objective:
                continue
            value = objective.pop(old)
            if new in data and data[new] != value:
                raise ValueError(f"objective.{old}={value!r} and {new}={data[new]!r}: both set DPO's {new}; "
                                 f"keep {new} only")
            data[new] = value
        for key, value in objective.items():
            if key not in _UNUSED_OBJECTIVE_DEFAULTS:
                raise ValueError(f"objective.{key}: not a setting of DPO (its settings: {_DPO_FIELDS})")
            if value != _UNUSED_OBJECTIVE_DEFAULTS[key]:
                raise ValueError(f"objective.{key}={value!r}: a BPPO/AWR setting that DPO never used; remove it "
                                 f"(DPO's settings: {_DPO_FIELDS})")
    for key, default in _UNUSED_POLICY_STAGE_DEFAULTS.items():
        if key in data:
            value = data.pop(key)
            if value != default:
                raise ValueError(f"{key}={value!r}: a BPPO/AWR setting that DPO never used; remove it (DPO "
                                 f"trains on trajectory pairs, not on labelled advantages)")
    return data


class DPOConfig(TrainingConfig):
    """ETO-style trajectory DPO on a buffer: ``qevolve dpo --buffer B --init C [key=value ...]``, and the
    ``eto`` section of ``qevolve evolve``.

    The optimizer, schedule, batching and checkpoint fields are those of every training stage
    (:class:`qevolve.training.trainer.TrainingConfig`); the micro-batch plan runs over preference pairs."""

    env: str = Field("alfworld", description="environment: its instruction prompt is the system message")
    buffer_path: str | None = Field(None, description="trajectory store with better and worse episodes of the "
                                    "same tasks (e.g. expert demonstrations and the policy's own failures); no "
                                    "labels needed")
    model: ModelConfig = Field(default_factory=ModelConfig, description="the policy that starts the phase "
                               "(usually the behaviour-cloned one); a LoRA checkpoint keeps training its adapter")
    reference: str | None = Field(None, description="the reference policy pi_ref of the DPO log-ratios (null: the "
                                  "starting policy)")
    prompt: PromptConfig = Field(default_factory=PromptConfig, description="prompt building (as in BC/rollouts)")
    beta: float = Field(0.1, gt=0.0, description="DPO temperature beta on the trajectory log-ratios: larger keeps "
                        "the policy closer to the reference")
    sft_coef: float = Field(0.0, ge=0.0, description="weight of an added NLL term on the chosen trajectories "
                            "(0: plain DPO, as in ETO)")
    min_score_gap: float = Field(1e-6, gt=0.0, description="a pair's chosen episode must score at least this much "
                                 "more than its rejected one")
    max_pairs_per_task: int | None = Field(None, ge=1, description="at most this many pairs per task, the "
                                           "rejected episodes of lowest id first (null: every worse episode of "
                                           "the task)")
    only_sources: list[str] | None = Field(None, description="pair only episodes of these sources, e.g. [expert, "
                                           "self] (null: every episode of the buffer)")
    include_failed: bool = Field(False, description="also use episodes lost to environment failures (stored with "
                                 "failed=true); by default they are left out")
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=5e-5),
                               description="optimizer and schedule")
    output_dir: str = Field("runs/dpo", description="checkpoints, TensorBoard logs and the final policy")

    @model_validator(mode="before")
    @classmethod
    def _old_policy_stage_keys(cls, data: Any) -> Any:
        return _from_policy_stage_keys(data) if isinstance(data, dict) else data


def build_preference_pairs(episodes: list[Episode], min_score_gap: float = 1e-6,
                           max_pairs_per_task: int | None = None) -> list[tuple[int, int]]:
    """(chosen, rejected) indices into ``episodes``: same task, chosen scores higher by ``min_score_gap``.

    The chosen episode of a task is its best-scoring one (ties: expert before self, then episode id);
    rejected are the others of the task that score at least ``min_score_gap`` less, lowest id first."""
    by_task: dict[str, list[int]] = defaultdict(list)
    for index, episode in enumerate(episodes):
        by_task[episode.task_id].append(index)
    pairs: list[tuple[int, int]] = []
    for task_id in sorted(by_task):
        members = by_task[task_id]
        best = min(members, key=lambda i: (-episodes[i].score, episodes[i].source != "expert",
                                           episodes[i].episode_id))
        worse = sorted((i for i in members if episodes[i].score <= episodes[best].score - min_score_gap),
                       key=lambda i: episodes[i].episode_id)
        if max_pairs_per_task is not None:
            worse = worse[:max_pairs_per_task]
        pairs.extend((best, i) for i in worse)
    return pairs


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
             ref_rejected: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-pair DPO loss ``-log sigmoid(beta * (chosen log-ratio - rejected log-ratio))`` and the margins.

    Each argument is ``[pairs]``: the summed agent-token log-probs of a trajectory under the policy
    being trained or the reference."""
    margin = beta * ((policy_chosen - ref_chosen) - (policy_rejected - ref_rejected))
    return -F.logsigmoid(margin), margin


@dataclass
class _PairUnit:
    """What the trainer plans over: one pair, as long as both of its trajectories' sequences."""

    sequences: list[int]
    length: int

    def __len__(self) -> int:
        return self.length


class _PreferenceUpdate(TrainingMethod):
    """DPO in the trainer's loop: a micro-batch is a group of preference pairs (both episodes' sequences);
    its loss is its pairs' DPO loss (plus the optional SFT term) over the step's pair count."""

    def __init__(self, trainer: Trainer, policy: Any, config: DPOConfig, sequences: list, units: list, pairs: list,
                 of_episode: dict[int, list[int]], position: dict[int, int], ref_logp: list[torch.Tensor]):
        self.trainer, self.policy, self.config, self.sequences, self.units = trainer, policy, config, sequences, units
        self.pairs, self.of_episode, self.position, self.ref_logp = pairs, of_episode, position, ref_logp
        self.ref_sum = torch.tensor([float(t.sum()) for t in ref_logp], dtype=torch.float64)
        self.pad_id = policy.tokenizer.pad_token_id or 0

    def begin_step(self, step: int, groups: list[list[int]]) -> int:
        return sum(len(group) for group in groups)  # the step's pairs

    def micro_batch(self, group: list[int], weight: float, step_pairs: int, step: int) -> MicroBatchOutput:
        config, sequences = self.config, self.sequences
        seq_indices = [s for u in group for s in self.units[u].sequences]
        batch = collate(sequences, seq_indices, self.config.batching, self.pad_id).to(self.policy.device)
        with self.policy.autocast():
            logp = target_logprobs(self.trainer.model, batch).float()
        # collate emits targets sequence by sequence, in the given order
        sums = torch.split(logp, [sequences[s].num_targets for s in seq_indices])
        seq_sum = dict(zip(seq_indices, (t.sum() for t in sums)))
        chosen, rejected, ref_c, ref_r, nll_c = [], [], [], [], []
        for u in group:
            w, l = self.pairs[u]
            ws, ls = self.of_episode[self.position[w]], self.of_episode[self.position[l]]
            chosen.append(torch.stack([seq_sum[s] for s in ws]).sum())
            rejected.append(torch.stack([seq_sum[s] for s in ls]).sum())
            ref_c.append(float(self.ref_sum[ws].sum()))
            ref_r.append(float(self.ref_sum[ls].sum()))
            nll_c.append(-chosen[-1] / max(sum(sequences[s].num_targets for s in ws), 1))
        losses, margins = dpo_loss(torch.stack(chosen), torch.stack(rejected),
                                   torch.tensor(ref_c, device=logp.device),
                                   torch.tensor(ref_r, device=logp.device), config.beta)
        loss = losses.sum() / step_pairs  # the mean over the step's pairs
        if config.sft_coef > 0:
            loss = loss + config.sft_coef * torch.stack(nll_c).sum() / step_pairs
        self.trainer.check_finite(loss, "policy/dpo", step + 1, "loss")
        share = len(group) / step_pairs
        stats = {}
        for key, value in (("loss", float(loss.detach()) / share), ("dpo_loss", float(losses.mean().detach())),
                           ("reward_margin", float(margins.mean().detach())),
                           ("reward_accuracy", float((margins > 0).float().mean())),
                           ("chosen_logratio", float((torch.stack(chosen).detach().cpu()
                                                      - torch.tensor(ref_c)).mean())),
                           ("rejected_logratio", float((torch.stack(rejected).detach().cpu()
                                                        - torch.tensor(ref_r)).mean()))):
            stats[key] = value * share
        return MicroBatchOutput(loss, stats, batch.num_tokens)

    def postfix(self, stats: dict[str, float]) -> dict[str, str]:
        return {"loss": f"{stats['loss']:.4f}", "acc": f"{stats['reward_accuracy']:.2f}"}

    def scalars(self, stats: dict[str, float], done: int) -> dict[str, float]:
        return {f"policy/{k}": v for k, v in stats.items()}

    def checkpoint_state(self, stats: dict[str, float]) -> dict[str, Any]:
        return {"ref_logprobs": self.ref_logp, "last_stats": stats}


def run_dpo(config: DPOConfig, log: Callable[[str], None] = print) -> PolicyResult:
    """One DPO phase on ``config.buffer_path``; resumable; returns per-step statistics."""
    started = time.perf_counter()
    if not config.buffer_path:
        raise ValueError("buffer_path: a trajectory store with successful and failed episodes is required")
    world_size = launcher_world_size()
    if world_size > 1:
        raise ValueError(f"policy/dpo: a launcher started {world_size} processes (WORLD_SIZE={world_size}), but DPO "
                         f"trains in one process only; launch it without torchrun/accelerate launch")
    trainer = Trainer(config)
    policy = load_policy(config.model, trainable=True)
    builder = PromptBuilder.for_environment(policy.tokenizer, config.prompt, config.env)
    episodes = usable_episodes(read_episodes(Path(config.buffer_path).expanduser()), config.include_failed)
    episodes = episodes_of_sources(episodes, config.only_sources, f"buffer_path {config.buffer_path}")
    pairs = build_preference_pairs(episodes, config.min_score_gap, config.max_pairs_per_task)
    if not pairs:
        raise ValueError(f"buffer_path {config.buffer_path}: no (better, worse) episode pairs of the same task; "
                         "DPO needs a task with episodes of different scores")
    used = sorted({i for pair in pairs for i in pair})
    position = {episode_index: k for k, episode_index in enumerate(used)}
    max_length = getattr(unwrap_model(policy.model).config, "max_position_embeddings", None)
    sequences = prepare_sequences([episodes[i] for i in used], builder, max_length, config.buffer_path)
    of_episode: dict[int, list[int]] = defaultdict(list)  # position in `used` -> sequence indices
    for s, sequence in enumerate(sequences):
        of_episode[sequence.episode].append(s)
    units = [_PairUnit(of_episode[position[w]] + of_episode[position[l]],
                       sum(len(sequences[s]) for s in of_episode[position[w]] + of_episode[position[l]]))
             for w, l in pairs]

    progress = config.progress
    if trainer.resume_state is not None:
        ref_logp = trainer.resume_state["ref_logprobs"]
    else:
        reference = policy
        if config.reference and Path(config.reference).expanduser() != Path(policy.source):
            reference = load_policy(config.model.model_copy(update={"name_or_path": config.reference}),
                                    trainable=False)
        ref_logp = sequence_logprobs(reference, sequences, config.tokens_per_batch, config.batching, progress,
                                     "pi_ref")
        del reference

    trainer.start(policy, units)  # type: ignore[arg-type]  (the plan only needs len())
    total_steps, start_step = trainer.total_steps, trainer.start_step
    log(f"policy (dpo, beta {config.beta}): {len(pairs)} pairs over {len(used)} episodes of "
        f"{len({episodes[w].task_id for w, _ in pairs})} tasks; {total_steps} steps; model {policy.source}")
    if trainer.resume_state is not None:
        log(f"policy: resumed from {trainer.checkpoint} at step {start_step}")

    writer = ScalarWriter(trainer.output_dir / "tensorboard" if config.tensorboard else None,
                          trainer.output_dir / SCALARS_FILE, start_step)
    method = _PreferenceUpdate(trainer, policy, config, sequences, units, pairs, of_episode, position, ref_logp)
    stats_log = trainer.fit("policy/dpo", method, writer, progress)
    writer.close()
    step, interrupted = trainer.steps_done, trainer.interrupted
    final_dir = trainer.save_final("policy/dpo", step, {"policy_steps": step, "objective": "dpo",
                                                        **acting_settings(config.env, config.prompt)})
    result = PolicyResult(step, total_steps, interrupted, len(sequences), sum(s.num_targets for s in sequences),
                          time.perf_counter() - started, final_dir, stats_log,
                          (trainer.resume_state or {}).get("last_stats", {}))
    if not interrupted:
        summary = {**result.summary(), "pairs": len(pairs), "final_dir": "final" if final_dir else None}
        (trainer.output_dir / "policy_summary.json").write_text(json.dumps(summary, indent=1, default=str))
    return result
