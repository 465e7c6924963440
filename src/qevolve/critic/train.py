"""Train the weighted-IQL critic on a buffer, resumably; load it back; predict V and Q per turn.

Output folder of a run:

- ``train_state.pt``  the resumable training state (written atomically every
  ``checkpoint_every_steps`` steps and at the end of every epoch); a rerun with the same config
  and buffer continues from it, mid-epoch included
- ``metrics.jsonl``   one line per epoch: both losses, mean V on the trajectories whose final score is
  > 0 and = 0 (``v_scored``, ``v_unscored``: the weighting's d, not whether the episode was won), explained variance of V against Monte-Carlo returns of r_env + r_aux; with
  ``heldout_fraction`` > 0 also the same measured on the held-out trajectories (``heldout_*``)
- ``critic.pt``       the trained critic (config, heads, target heads, the V average, trained backbone weights)
- ``kfold.json``      with ``diagnostics.folds`` >= 2 and a frozen backbone: the k-fold held-out fit
  (:func:`kfold_fit`), its per-epoch curve and the in-sample fit of the saved critic beside it
- ``config.yaml``     the config of the run

Under a multi-process launcher (``distributed.backend: ddp``) every rank plans the same batches;
rank r trains on every ``world_size``-th trajectory of each batch, its loss scaled by its share of
the batch's turns, so the all-reduced gradient is that of the whole batch; rank 0 alone writes
(see :mod:`qevolve.distributed`).
"""

from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from qevolve.atomic_io import (atomic_torch_save, atomic_write_text, load_state, recorded_path, relative_to_folder,
                               write_json_atomic)
from qevolve.buffer.store import Episode, usable_episodes
from qevolve.config import dump_config
from qevolve.critic.config import CriticConfig
from qevolve.critic.data import CriticSample, build_samples, buffer_fingerprint, token_budget_batches
from qevolve.critic.iql import IQLLearner, iql_losses
from qevolve.critic.model import (Critic, FeatureCache, build_critic, default_model_path, encode_batch,
                                  extract_features, model_identity, resolve_device)
from qevolve.critic.retrospective import RetrospectiveConfig
from qevolve.distributed import DistContext, init_distributed, main_first
from qevolve.finite import NonFiniteError, check_finite, check_finite_parameters
from qevolve.progress import progress_bar, quiet_third_party, use_bars
from qevolve.scalars import critic_metrics_renamed
from qevolve.seeding import derive_seed

__all__ = ["train_critic", "load_critic", "predict_values", "critic_samples", "explained_variance", "init_path_of",
           "heldout_indices", "roc_auc", "kfold_assignment", "kfold_fit", "fit_metrics", "convergence",
           "CRITIC_FILE", "STATE_FILE", "METRICS_FILE", "KFOLD_FILE"]

CRITIC_FILE = "critic.pt"
STATE_FILE = "train_state.pt"
METRICS_FILE = "metrics.jsonl"
KFOLD_FILE = "kfold.json"
FORMAT_VERSION = 1

Features = list[tuple[torch.Tensor, torch.Tensor]]


def init_path_of(config: CriticConfig) -> Path:
    return Path(config.init).expanduser() if config.init else default_model_path()


def critic_samples(episodes: list[Episode], config: CriticConfig) -> list[CriticSample]:
    """Samples of the episodes the critic learns from (failed ones only with ``include_failed``)."""
    return build_samples(usable_episodes(episodes, config.include_failed), config.retrospective,
                         config.iql.weighting, config.iql.gamma, config.max_sequence_tokens)


def explained_variance(predicted: np.ndarray, target: np.ndarray) -> float:
    """1 - Var(target - predicted) / Var(target); nan when the target is constant."""
    variance = float(np.var(target))
    return float("nan") if variance == 0 else 1.0 - float(np.var(target - predicted)) / variance


def heldout_indices(samples: list[CriticSample], fraction: float, seed: int) -> list[int]:
    """Indices into ``samples`` of the trajectories ``heldout_fraction`` leaves out of training.

    Whole trajectories, drawn separately among won and not-won episodes so that a small held-out set
    still has both outcomes: of each outcome's episode ids, sorted (the buffer's file order plays no
    part), a shuffle takes round(fraction * n), at least one when the outcome has two or more and
    never all of them (training keeps every outcome it had). The shuffle has its own RNG seeded from
    ``seed``: the same split on every run and every resume, and no training RNG stream moves.
    """
    if fraction <= 0:
        return []
    chosen: set[tuple[bool, str]] = set()
    for won in (False, True):
        ids = sorted({sample.episode_id for sample in samples if sample.won == won})
        if not ids:
            continue
        random.Random(f"qevolve critic held-out split {seed} {int(won)}").shuffle(ids)
        count = min(max(math.floor(fraction * len(ids) + 0.5), 1 if len(ids) >= 2 else 0), len(ids) - 1)
        chosen.update((won, episode_id) for episode_id in ids[:count])
    return [i for i, sample in enumerate(samples) if (sample.won, sample.episode_id) in chosen]


def roc_auc(positive: np.ndarray, negative: np.ndarray) -> float:
    """P(a positive scores above a negative), ties counting one half (Mann-Whitney); nan without both."""
    if not len(positive) or not len(negative):
        return float("nan")
    values = np.concatenate([positive, negative])
    order = np.argsort(values, kind="stable")
    _, first, counts = np.unique(values[order], return_index=True, return_counts=True)
    ranks = np.empty(len(values))
    ranks[order] = np.repeat(first + (counts + 1) / 2, counts)  # 1-based ranks, ties share their mean
    return float((ranks[: len(positive)].sum() - len(positive) * (len(positive) + 1) / 2)
                 / (len(positive) * len(negative)))


def frozen_features(critic: Critic, samples: list[CriticSample], config: CriticConfig, init_path: Path,
                    device: torch.device, progress: bool) -> Features:
    """The frozen backbone's hidden states of every sample, from the disk cache when possible."""
    cache = FeatureCache(config.feature_cache_dir) if config.feature_cache else None
    key = FeatureCache.key(model_identity(init_path), critic.compute_dtype, samples) if cache else ""
    if cache is not None:
        cached = cache.load(key)
        if cached is not None and len(cached) == len(samples):
            return cached
    features = extract_features(critic.backbone, samples, config.batch_tokens, device, critic.compute_dtype,
                                progress=progress)
    if cache is not None:
        cache.save(key, features)
    return features


def _batch_features(critic: Critic, batch: list[CriticSample], indices: list[int], features: Features | None,
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    if features is not None:
        return (torch.cat([features[i][0] for i in indices]).to(device),
                torch.cat([features[i][1] for i in indices]).to(device))
    return encode_batch(critic.backbone, batch, device, critic.compute_dtype)


def _head_outputs(critic: Critic, v_features: torch.Tensor, q_features: torch.Tensor, device: torch.device,
                  value_source: str | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """V [N] (the one labels read, :meth:`Critic.label_value`), every online Q head [heads, N] and the target
    Qbar [N] of hidden states read at V and Q positions."""
    q_features = q_features.to(device)
    return (critic.label_value(v_features.to(device), value_source), critic.heads.q_values(q_features),
            critic.target_q_min(q_features))


def _epoch_order(num_samples: int, seed: int, epoch: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(num_samples, generator=generator).tolist()


def _new_accumulator() -> dict[str, Any]:
    return {"loss_v": 0.0, "loss_q": 0.0, "batches": 0, "values": [], "returns": [], "scored": [], "seconds": 0.0}


def _epoch_metrics(epoch: int, acc: dict[str, Any], global_step: int) -> dict[str, Any]:
    values = np.concatenate(acc["values"]) if acc["values"] else np.zeros(0)
    returns = np.concatenate(acc["returns"]) if acc["returns"] else np.zeros(0)
    scored = np.concatenate(acc["scored"]) if acc["scored"] else np.zeros(0, dtype=bool)
    batches = max(acc["batches"], 1)
    return {
        "epoch": epoch + 1,
        "steps": global_step,
        "loss_v": acc["loss_v"] / batches,
        "loss_q": acc["loss_q"] / batches,
        # V as the heads saw it during the epoch's own steps (no extra pass)
        "v_scored": float(values[scored].mean()) if scored.any() else float("nan"),
        "v_unscored": float(values[~scored].mean()) if (~scored).any() else float("nan"),
        "v_mean": float(values.mean()) if values.size else float("nan"),
        "explained_variance": explained_variance(values, returns) if values.size else float("nan"),
        "seconds": acc["seconds"],
    }


HELDOUT_KEYS = ("heldout_loss_v", "heldout_loss_q", "heldout_v_scored", "heldout_v_unscored", "heldout_v_mean",
                "heldout_explained_variance", "heldout_auc_won_vs_lost")


@torch.no_grad()
def _heldout_metrics(critic: Critic, samples: list[CriticSample], features: Features | None, config: CriticConfig,
                     device: torch.device) -> dict[str, float]:
    """The in-sample metrics of :func:`_epoch_metrics` on the held-out trajectories, from one extra pass
    after the epoch (the heads as they ended it; V is the one the labels read, ``label_value``), plus the
    AUC of V at the first turn, won vs not won (``Episode.won``).

    ``features``: the frozen backbone's cached hidden states of ``samples``; None = read them from the
    (trained) backbone. No gradient, and the RNG state is restored afterwards, so training goes on
    exactly as without this pass."""
    if not samples:
        return {key: float("nan") for key in HELDOUT_KEYS}
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        if features is None:
            features = extract_features(critic.backbone, samples, config.batch_tokens, device, critic.compute_dtype,
                                        progress=False, desc="held-out hidden states")
        values, q_values, target_q = _head_outputs(critic, torch.cat([f[0] for f in features]),
                                                   torch.cat([f[1] for f in features]), device)
    iql = config.iql
    losses = iql_losses(values, q_values, target_q, samples, iql.expectile, iql.gamma, iql.truncated_bootstrap)
    values_np = values.double().cpu().numpy()
    returns = torch.cat([s.mc_returns for s in samples]).double().numpy()
    scored = np.concatenate([np.full(s.num_turns, s.scored) for s in samples])
    starts = np.cumsum([0] + [s.num_turns for s in samples[:-1]])
    first = values_np[starts]  # V(s_0) of each trajectory
    won = np.array([s.won for s in samples])
    return {
        # means over the held-out transitions (the in-sample losses average the epoch's batch means)
        "heldout_loss_v": float(losses["loss_v"]),
        "heldout_loss_q": float(losses["loss_q"]),
        "heldout_v_scored": float(values_np[scored].mean()) if scored.any() else float("nan"),
        "heldout_v_unscored": float(values_np[~scored].mean()) if (~scored).any() else float("nan"),
        "heldout_v_mean": float(values_np.mean()),
        "heldout_explained_variance": explained_variance(values_np, returns),
        "heldout_auc_won_vs_lost": roc_auc(first[won], first[~won]),
    }


#: a mean V that still moves by more than this from one epoch to the next means the critic has not
#: converged: IQL's values propagate back from the rewards one bootstrap per target-network lag, so a
#: buffer with few steps per epoch needs more epochs (or a faster ``iql.polyak``). Measured on the
#: WebShop protocol (docs/results.md): 20 epochs left V rising by 0.016 per epoch, EV -0.33.
UNCONVERGED_V_CHANGE = 0.01


def unconverged_warning(history: list[dict[str, Any]]) -> str | None:
    """A warning when the last epoch still moved the mean V by more than :data:`UNCONVERGED_V_CHANGE`."""
    if len(history) < 2 or "v_mean" not in history[-1] or "v_mean" not in history[-2]:
        return None
    change = history[-1]["v_mean"] - history[-2]["v_mean"]
    if not abs(change) > UNCONVERGED_V_CHANGE:
        return None
    return (f"critic: the mean V moved by {change:+.4f} in the last epoch (more than {UNCONVERGED_V_CHANGE}): not "
            f"converged after {history[-1]['epoch']} epochs ({history[-1]['steps']} steps); raise epochs or "
            f"iql.polyak (see `qevolve data critic-fit` on the labelled buffer, e.g. runs/NAME/iter_1/label)")


def _value_fit(values: np.ndarray, samples: list[CriticSample]) -> dict[str, float]:
    """How V (one value per turn of ``samples``, concatenated in order) fits: its explained variance against
    the Monte-Carlo returns of r_env + r_aux, and the AUC of V(s_0) between won and lost episodes
    (``Episode.won``; nan without both)."""
    if not samples:
        return {"explained_variance": float("nan"), "auc_won_vs_lost": float("nan")}
    returns = torch.cat([s.mc_returns for s in samples]).double().numpy()
    starts = np.cumsum([0] + [s.num_turns for s in samples[:-1]])
    won = np.array([s.won for s in samples])
    first = values[starts]
    return {"explained_variance": explained_variance(values, returns),
            "auc_won_vs_lost": roc_auc(first[won], first[~won])}


VALUE_SOURCES = ("ema", "last")


@torch.no_grad()
def fit_metrics(critic: Critic, samples: list[CriticSample], features: Features,
                device: torch.device) -> dict[str, dict[str, float]]:
    """:func:`_value_fit` of both Vs of ``critic`` (``ema``: the V average; ``last``: the V head) on
    ``samples``, whose hidden states are ``features``."""
    if not samples:
        return {source: _value_fit(np.zeros(0), samples) for source in VALUE_SOURCES}
    v_features = torch.cat([f[0] for f in features]).to(device)
    return {source: _value_fit(critic.label_value(v_features, source).double().cpu().numpy(), samples)
            for source in VALUE_SOURCES}


def kfold_assignment(samples: list[CriticSample], folds: int, seed: int) -> list[int]:
    """The fold (0..folds-1) of each sample: whole trajectories, dealt out per outcome ``won``.

    Each outcome's episode ids, sorted (the buffer's file order plays no part), are shuffled by an RNG of
    their own seeded from ``seed`` and dealt round-robin, the second outcome going on where the first
    stopped, so every fold gets its share of both outcomes and the folds differ in size by at most one.
    """
    fold_of: dict[str, int] = {}
    position = 0
    for won in (False, True):
        ids = sorted({sample.episode_id for sample in samples if sample.won == won})
        random.Random(f"qevolve critic k-fold split {seed} {int(won)}").shuffle(ids)
        for episode_id in ids:
            fold_of[episode_id] = position % folds
            position += 1
    return [fold_of[sample.episode_id] for sample in samples]


def _fit_fold(train: list[CriticSample], train_features: Features, held: list[CriticSample],
              held_features: Features, config: CriticConfig, epochs: int, seed: int,
              device: torch.device) -> list[dict[str, np.ndarray]]:
    """Heads trained as :func:`train_critic` trains them (frozen backbone, one process), from fresh ones seeded
    by ``seed``, on ``train``; returns both Vs (ema, last) on ``held`` after every epoch."""
    hidden_size = int(train_features[0][0].shape[1])
    torch.manual_seed(seed)
    critic = Critic(None, hidden_size, config).to(device)
    if config.feature_norm:
        critic.heads.fit_normalizer(torch.cat([torch.cat(pair) for pair in train_features]))
    head_params = list(critic.heads.parameters())
    optimizer = torch.optim.AdamW(head_params, lr=config.lr, weight_decay=config.weight_decay)
    learner = IQLLearner(critic, optimizer, head_params, config.iql, config.grad_clip, config.value_ema)
    held_v = torch.cat([f[0] for f in held_features]).to(device)
    curve = []
    for epoch in range(epochs):
        def check(values: dict[str, torch.Tensor], same_on_all_ranks: bool) -> None:
            for quantity, value in values.items():
                if not bool(torch.isfinite(value)):
                    raise NonFiniteError(f"critic k-fold refit: non-finite {quantity} ({float(value)}) in epoch "
                                         f"{epoch + 1}")

        for indices in token_budget_batches(train, _epoch_order(len(train), seed, epoch), config.batch_tokens):
            batch = [train[i] for i in indices]
            v_features, q_features = _batch_features(critic, batch, indices, train_features, device)
            values, q_values = critic.heads.value(v_features), critic.heads.q_values(q_features)
            learner.update(values, q_values, q_features, batch, check=check)
        with torch.no_grad():
            curve.append({source: critic.label_value(held_v, source).double().cpu().numpy()
                          for source in VALUE_SOURCES})
    return curve


def kfold_fit(samples: list[CriticSample], features: Features, config: CriticConfig, device: torch.device,
              log: Callable[[str], None] = lambda message: None) -> dict[str, Any]:
    """The k-fold held-out fit of the critic's training on ``samples`` (frozen backbone: ``features`` are
    their cached hidden states): ``diagnostics.folds`` refits of fresh heads, each without one fold
    (:func:`kfold_assignment`), for ``diagnostics.fold_epochs`` epochs (null: ``epochs``).

    Each held-out trajectory gets V from the refit that never saw it; the pooled predictions give the
    explained variance and the AUC of V(s_0) won vs lost after every epoch (``curve``) and at the end, for
    the V average (ema) and the V head (last); the top-level numbers are those of ``label_value``. Every
    refit is seeded from ``seed`` and its fold, and the global RNG streams are left as they were."""
    diagnostics = config.diagnostics
    folds, epochs = diagnostics.folds, diagnostics.fold_epochs or config.epochs
    assignment = kfold_assignment(samples, folds, config.seed)
    order = sorted(range(len(samples)), key=lambda i: (assignment[i], i))  # pooled predictions: fold by fold
    pooled = [samples[i] for i in order]
    predictions: list[list[dict[str, np.ndarray]]] = []
    per_fold = []
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        for fold in range(folds):
            held = [i for i in order if assignment[i] == fold]
            train = [i for i in range(len(samples)) if assignment[i] != fold]
            if not held or not train:
                continue
            log(f"critic: k-fold refit {fold + 1}/{folds} ({len(train)} trajectories, {len(held)} held out, "
                f"{epochs} epochs)")
            curve = _fit_fold([samples[i] for i in train], [features[i] for i in train], [samples[i] for i in held],
                              [features[i] for i in held], config, epochs, derive_seed(config.seed, f"k-fold/{fold}"),
                              device)
            predictions.append(curve)
            last = _value_fit(curve[-1][config.label_value], [samples[i] for i in held])
            per_fold.append({"fold": fold, "episodes": len(held), **last})
    if not predictions:  # fewer trajectories than two folds need
        return {"folds": folds, "epochs": epochs, "episodes": len(samples), "curve": [], "per_fold": [],
                "explained_variance": float("nan"), "auc_won_vs_lost": float("nan")}
    curve_rows = []
    for epoch in range(epochs):
        row: dict[str, Any] = {"epoch": epoch + 1}
        for source in VALUE_SOURCES:
            fit = _value_fit(np.concatenate([fold_curve[epoch][source] for fold_curve in predictions]), pooled)
            row.update({f"{key}_{source}": value for key, value in fit.items()})
        curve_rows.append(row)
    final = curve_rows[-1]
    return {"folds": folds, "epochs": epochs, "episodes": len(samples), "label_value": config.label_value,
            "explained_variance": final[f"explained_variance_{config.label_value}"],
            "auc_won_vs_lost": final[f"auc_won_vs_lost_{config.label_value}"],
            "per_fold": per_fold, "curve": curve_rows}


def convergence(history: list[dict[str, Any]], config: CriticConfig,
                kfold_curve: list[float] | None = None) -> dict[str, Any]:
    """Whether the critic had converged where training stopped, and which criterion decided.

    ``heldout``: the held-out split's explained variance per epoch (``heldout_fraction`` > 0); else
    ``kfold``: the pooled k-fold curve (``kfold_curve``, when its refits ran as many epochs as the critic);
    converged when the mean over the last ``diagnostics.converged_window`` epochs rose by at most
    ``converged_min_improvement`` over the mean of the window before. Without such a curve (or with fewer
    than two windows of epochs, or a nan in them): ``drift``, the last epoch's change of the mean V
    (:func:`unconverged_warning`). Returns ``converged``, ``by``, ``improvement`` (held-out criteria) and
    ``warning`` (None, or why training should go on, or that the held-out fit is past its best).
    """
    window = config.diagnostics.converged_window
    threshold = config.diagnostics.converged_min_improvement
    curves = []
    if config.heldout_fraction > 0 and history and "heldout_explained_variance" in history[-1]:
        curves.append(("heldout", [row["heldout_explained_variance"] for row in history]))
    if kfold_curve is not None and len(kfold_curve) == len(history):
        curves.append(("kfold", list(kfold_curve)))
    for name, curve in curves:
        values = np.array(curve[-2 * window:], dtype=np.float64)
        if len(curve) < 2 * window or not np.isfinite(values).all():
            continue
        earlier, last = float(values[:window].mean()), float(values[window:].mean())
        improvement = last - earlier
        converged = improvement <= threshold
        what = "the held-out" if name == "heldout" else "the k-fold held-out"
        warning = None
        if not converged:
            warning = (f"critic: {what} explained variance still rose by {improvement:+.4f} over the last {window} "
                       f"epochs (more than {threshold}): not converged after {history[-1]['epoch']} epochs "
                       f"({history[-1]['steps']} steps); raise epochs or iql.polyak")
        else:
            finite = np.array(curve, dtype=np.float64)
            means = np.convolve(finite, np.ones(window) / window, mode="valid")  # nan where a window has one
            best = int(np.nanargmax(means))
            if means[best] - last > threshold:
                warning = (f"critic: {what} explained variance is past its best ({means[best]:.3f} over epochs "
                           f"{best + 1}-{best + window}, {last:.3f} over the last {window}): the critic fits its "
                           f"training trajectories at the expense of new ones; fewer epochs would generalise better")
        return {"converged": converged, "by": name, "improvement": improvement, "warning": warning}
    warning = unconverged_warning(history)
    return {"converged": warning is None, "by": "drift", "improvement": None, "warning": warning}


def _write_metrics(folder: Path, history: list[dict[str, Any]]) -> None:
    atomic_write_text(folder / METRICS_FILE, "".join(json.dumps(row) + "\n" for row in history))


def _same_run(state: dict[str, Any], config: CriticConfig, init: str, fingerprint: str,
              heldout: list[str]) -> str | None:
    """Why ``state`` cannot be resumed with this config and buffer (None when it can)."""
    if state.get("format") != FORMAT_VERSION:
        return f"state format {state.get('format')}, expected {FORMAT_VERSION}"
    saved = dict(state["config"])
    saved.setdefault("heldout_fraction", 0.0)  # a state written before the field existed held nothing out
    current = config.model_dump(mode="json")
    # A state written before the V average existed resumes with it started from the V head then
    # (train_critic says so): no uninterrupted run of that state with an average exists to differ from.
    saved.setdefault("value_ema", current["value_ema"])
    # A state written while the built-in environments' penalties were the config's default records them;
    # read through today's schema, entries that repeat an environment's declaration drop out (same labels).
    try:
        saved["retrospective"] = RetrospectiveConfig.model_validate(saved["retrospective"]).model_dump(mode="json")
    except (KeyError, TypeError, ValueError):  # not readable so: compared as it stands
        pass
    # Fields that may change between attempts (e.g. more epochs to extend training, another device), and
    # those that change what is measured or read after training, never the trained weights.
    for name in ("epochs", "checkpoint_every_steps", "device", "feature_cache", "feature_cache_dir", "distributed",
                 "label_value", "diagnostics"):
        saved.pop(name, None)
        current.pop(name, None)
    if saved != current:
        changed = sorted(k for k in current if saved.get(k) != current.get(k))
        return f"config differs in {changed}"
    if state["init"] != init:
        return f"backbone init differs ({state['init']} vs {init})"
    if state["fingerprint"] != fingerprint:
        return "the buffer differs (tokens, rewards or weights)"
    if sorted(state.get("heldout", [])) != sorted(heldout):  # the split also reads each episode's `won`
        return "the held-out trajectories differ (an episode's won flag changed)"
    return None


class _StepForward(torch.nn.Module):
    """V and Q of a batch given by sample indices, as one module (the unit DDP wraps)."""

    def __init__(self, critic: Critic, samples: list[CriticSample], features: Features | None,
                 device: torch.device):
        super().__init__()
        self.critic = critic
        self.samples, self.features, self.device = samples, features, device

    def forward(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        batch = [self.samples[i] for i in indices]
        v_features, q_features = _batch_features(self.critic, batch, indices, self.features, self.device)
        return self.critic.heads.value(v_features), self.critic.heads.q_values(q_features), q_features


def train_critic(episodes: list[Episode], config: CriticConfig, output_dir: str | Path, *, restart: bool = False,
                 progress: bool = True, log: Callable[[str], None] | None = None,
                 stop_after_steps: int | None = None) -> dict[str, Any]:
    """Weighted IQL on ``episodes``; resumes from ``output_dir/train_state.pt`` unless ``restart``.

    ``stop_after_steps`` ends the call after that many optimiser steps in total (the state is saved),
    which is how an interruption is simulated. Returns a summary with the per-epoch ``history``.
    """
    dist: DistContext = init_distributed(config.distributed, config.device, stage="critic", allow_fsdp=False)
    log = log if log is not None and dist.is_main else (lambda message: None)
    quiet_third_party(bars=use_bars(progress))
    progress = progress and dist.is_main
    output = Path(output_dir)
    output.mkdir(parents=True, exist_ok=True)
    device = resolve_device(config.device)
    init_path = init_path_of(config)
    samples = critic_samples(episodes, config)
    if not samples:
        raise ValueError("critic: the buffer holds no episodes")
    fingerprint = buffer_fingerprint(samples)  # of the whole buffer, held-out trajectories included
    held = heldout_indices(samples, config.heldout_fraction, config.seed)
    heldout_ids = [samples[i].episode_id for i in held]
    if config.heldout_fraction > 0 and not held:
        log(f"WARNING: critic: heldout_fraction={config.heldout_fraction} holds out no trajectory of "
            f"{len(samples)} (each outcome keeps at least one to train on); the heldout_* metrics are nan")
    if dist.is_main:
        (output / "config.yaml").write_text(dump_config(config))

    critic = build_critic(config, init_path, device)
    head_params = list(critic.heads.parameters())
    backbone_params = [p for p in critic.backbone.parameters() if p.requires_grad] if config.backbone != "frozen" else []
    groups = [{"params": head_params, "lr": config.lr}]
    if backbone_params:
        groups.append({"params": backbone_params, "lr": config.backbone_lr})
    optimizer = torch.optim.AdamW(groups, weight_decay=config.weight_decay)

    epoch, batch_done, global_step, history, acc = 0, 0, 0, [], _new_accumulator()
    state_path = output / STATE_FILE
    if state_path.is_file() and not restart:
        state = load_state(state_path)
        reason = _same_run(state, config, str(init_path), fingerprint, heldout_ids)
        if reason:
            raise ValueError(f"{state_path}: cannot resume ({reason}); use another output folder or restart")
        critic.heads.load_state_dict(state["heads"])
        critic.target_q.load_state_dict(state["target_q"])
        if "value_ema" in state:
            critic.value_ema.load_state_dict(state["value_ema"])
        else:
            critic.value_ema.load_state_dict(critic.heads.v.state_dict())
            log("critic: the saved state has no V average (written by an older version); it starts from the "
                "V head at this step")
        if state["backbone"]:
            critic.backbone.load_state_dict(state["backbone"], strict=False)
        optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"])
        epoch, batch_done, global_step = state["epoch"], state["batch"], state["global_step"]
        # a state saved before the v_scored rename: its history and open epoch under today's names
        history = [critic_metrics_renamed(line) for line in state["history"]]
        acc = state["accumulator"]
        if "success" in acc:
            acc["scored"] = acc.pop("success")
        log(f"resuming at epoch {epoch + 1}, batch {batch_done}, step {global_step}")

    def save_state() -> None:
        if not dist.is_main:
            return
        atomic_torch_save({
            "format": FORMAT_VERSION, "config": config.model_dump(mode="json"), "init": str(init_path),
            "fingerprint": fingerprint, "epoch": epoch, "batch": batch_done, "global_step": global_step,
            "heads": critic.heads.state_dict(), "target_q": critic.target_q.state_dict(),
            "value_ema": critic.value_ema.state_dict(),
            "backbone": critic.trainable_backbone_state(), "optimizer": optimizer.state_dict(),
            "rng": torch.get_rng_state(), "history": history, "accumulator": acc, "heldout": heldout_ids,
        }, state_path)

    with main_first(dist):  # rank 0 fills the feature cache, the others read it
        features = frozen_features(critic, samples, config, init_path, device, progress) \
            if config.backbone == "frozen" else None
    heldout_samples: list[CriticSample] = [samples[i] for i in held]
    heldout_features = [features[i] for i in held] if features is not None else None
    if held:  # from here on `samples` (and `features`) are the training trajectories only
        keep = sorted(set(range(len(samples))) - set(held))
        samples = [samples[i] for i in keep]
        features = [features[i] for i in keep] if features is not None else None
        log(f"critic: {len(heldout_samples)} of {len(samples) + len(heldout_samples)} trajectories held out "
            f"(heldout_fraction={config.heldout_fraction}), {len(samples)} train")
    if config.feature_norm and global_step == 0:  # fitted once, before the first step; then saved with the heads
        subset = sorted(_epoch_order(len(samples), config.seed, -1)[: config.feature_norm_trajectories])
        fit_on = features if features is not None else extract_features(
            critic.backbone, [samples[i] for i in subset], config.batch_tokens, device, critic.compute_dtype,
            progress=progress, desc="feature statistics")
        critic.heads.fit_normalizer(torch.cat([torch.cat(pair) for pair in fit_on]))

    def guard(values: dict[str, torch.Tensor], same_on_all_ranks: bool = False) -> None:
        """Stop before a non-finite loss or gradient is applied; the last saved state stays as it was.

        Under DDP a loss is this rank's, so whether any rank saw a non-finite one is all-reduced first:
        every rank raises together, none is left waiting in a backward pass (a gradient norm is that of
        the all-reduced gradients, the same on every rank)."""
        bad = [(quantity, value) for quantity, value in values.items() if not bool(torch.isfinite(value))]
        if dist.enabled and not same_on_all_ranks and dist.sum([float(len(bad))])[0] > 0 and not bad:
            bad = [("loss (on another rank)", float("nan"))]
        for quantity, value in bad[:1]:
            check_finite(value, f"critic (epoch {epoch + 1})", global_step + 1, quantity,
                         state_path if state_path.is_file() else None)

    learner = IQLLearner(critic, optimizer, head_params + backbone_params, config.iql, config.grad_clip,
                         config.value_ema, global_step)
    step_module = _StepForward(critic, samples, features, device)
    step_forward = dist.wrap_ddp(step_module, device)  # step_module itself in one process
    if dist.enabled:
        log(f"critic: ddp over {dist.world_size} processes (this is rank 0)")
    while epoch < config.epochs:
        batches = token_budget_batches(samples, _epoch_order(len(samples), config.seed, epoch), config.batch_tokens)
        if config.backbone != "frozen":
            critic.backbone.train()
        bar = progress_bar(total=len(batches), initial=batch_done, desc=f"critic epoch {epoch + 1}/{config.epochs}",
                           unit="batch", enabled=progress, silent=not dist.is_main)
        while batch_done < len(batches):
            started = time.perf_counter()
            indices = batches[batch_done]
            share = 1.0
            if dist.enabled:  # this rank's trajectories of the batch, and their share of its turns
                mine = indices[dist.rank::dist.world_size]
                weight = 1.0 if mine else 0.0  # a rank without a trajectory runs the whole batch, weight 0
                indices = mine or indices
                share = weight * sum(samples[i].num_turns for i in indices) / \
                    sum(samples[i].num_turns for i in batches[batch_done])
            batch = [samples[i] for i in indices]
            values, q_values, q_features = step_forward(indices)
            # DDP averages the ranks' gradients: scale by the share of the batch's turns times the world size
            learner.steps = global_step
            losses = learner.update(values, q_values, q_features, batch,
                                    share * dist.world_size if dist.enabled else 1.0, guard)

            if dist.enabled:
                loss_v, loss_q = dist.sum([share * float(losses["loss_v"].detach()),
                                           share * float(losses["loss_q"].detach())])
                parts = dist.gather_objects(None if share == 0 else (
                    values.detach().cpu().numpy(), torch.cat([s.mc_returns for s in batch]).numpy(),
                    np.concatenate([np.full(s.num_turns, s.scored) for s in batch])))
                parts = [p for p in parts if p is not None]
                acc["loss_v"] += loss_v
                acc["loss_q"] += loss_q
                acc["batches"] += 1
                for key, column in (("values", 0), ("returns", 1), ("scored", 2)):
                    acc[key].append(np.concatenate([p[column] for p in parts]))
            else:
                acc["loss_v"] += float(losses["loss_v"].detach())
                acc["loss_q"] += float(losses["loss_q"].detach())
                acc["batches"] += 1
                acc["values"].append(values.detach().cpu().numpy())
                acc["returns"].append(torch.cat([s.mc_returns for s in batch]).numpy())
                acc["scored"].append(np.concatenate([np.full(s.num_turns, s.scored) for s in batch]))
            acc["seconds"] += time.perf_counter() - started
            batch_done += 1
            global_step += 1
            bar.set_postfix(loss_v=f"{acc['loss_v'] / acc['batches']:.4f}", loss_q=f"{acc['loss_q'] / acc['batches']:.4f}")
            bar.update(1)
            if global_step % config.checkpoint_every_steps == 0:
                save_state()
            if stop_after_steps is not None and global_step >= stop_after_steps:
                bar.close()
                save_state()
                dist.barrier()
                return {"finished": False, "global_step": global_step, "history": history, "output": str(output)}
        bar.close()
        metrics = _epoch_metrics(epoch, acc, global_step)
        if config.heldout_fraction > 0:
            metrics.update(_heldout_metrics(critic, heldout_samples, heldout_features, config, device))
        history.append(metrics)
        if dist.is_main:
            _write_metrics(output, history)
        log("epoch {epoch}: loss_v {loss_v:.4f} loss_q {loss_q:.4f} V(score > 0) {v_scored:.3f} "
            "V(score 0) {v_unscored:.3f} explained variance {explained_variance:.3f}".format(**metrics)
            + (" (held-out {heldout_explained_variance:.3f})".format(**metrics) if held else ""))
        epoch, batch_done, acc = epoch + 1, 0, _new_accumulator()
        save_state()

    # never a non-finite critic.pt (the heads are the same on every rank, so every rank raises alike)
    check_finite_parameters([*critic.heads.named_parameters(), *critic.target_q.named_parameters(),
                             *critic.value_ema.named_parameters()], "critic", global_step, state_path)
    if dist.is_main:
        atomic_torch_save({
            "format": FORMAT_VERSION, "config": config.model_dump(mode="json"), "init": str(init_path),
            "init_relative": relative_to_folder(init_path, output),  # survives moving the run folder
            "fingerprint": fingerprint, "hidden_size": critic.heads.v[0].in_features,
            "heads": critic.heads.state_dict(), "target_q": critic.target_q.state_dict(),
            "value_ema": critic.value_ema.state_dict(),
            "backbone": critic.trainable_backbone_state(), "history": history, "heldout": heldout_ids,
        }, output / CRITIC_FILE)
    dist.barrier()  # the critic is on disk for every rank

    # The fit after training: the saved critic on the trajectories it trained on, beside the k-fold held-out
    # fit. Both read the cached hidden states (frozen backbone); rank 0 alone measures, the others are done.
    fit: dict[str, Any] = {}
    kfold: dict[str, Any] | None = None
    if features is not None and dist.is_main:
        insample = fit_metrics(critic, samples, features, device)
        fit.update({f"insample_{key}": value for key, value in insample[config.label_value].items()})
        if config.diagnostics.folds >= 2:
            kfold = kfold_fit(samples, features, config, device, log=log)
            kfold["insample"] = insample
            write_json_atomic(output / KFOLD_FILE, kfold)
            fit.update({"kfold_explained_variance": kfold["explained_variance"],
                        "kfold_auc_won_vs_lost": kfold["auc_won_vs_lost"], "kfold_folds": kfold["folds"],
                        "kfold_epochs": kfold["epochs"]})
    elif config.diagnostics.folds >= 2 and config.backbone != "frozen" and dist.is_main:
        log(f"critic: no k-fold held-out fit with backbone {config.backbone} (it would train the backbone "
            f"{config.diagnostics.folds} more times); use heldout_fraction in a variant to measure the fit")
    kfold_curve = [row[f"explained_variance_{config.label_value}"] for row in kfold["curve"]] if kfold else None
    verdict = convergence(history, config, kfold_curve)
    if verdict["warning"]:
        log(f"WARNING: {verdict['warning']}")
    summary = {"finished": True, "converged": verdict["converged"], "converged_by": verdict["by"],
               "global_step": global_step, "history": history,
               "output": str(output), "episodes": len(samples), "turns": sum(s.num_turns for s in samples), **fit}
    if verdict["improvement"] is not None:
        summary["converged_improvement"] = verdict["improvement"]
    if config.heldout_fraction > 0:  # the trained-on counts above; the held-out fit of the last epoch
        summary.update({"heldout_episodes": len(heldout_samples),
                        "heldout_turns": sum(s.num_turns for s in heldout_samples),
                        **{key: history[-1][key] for key in HELDOUT_KEYS if history and key in history[-1]}})
    return summary


#: the summary's keys of the fit after training (:func:`train_critic`), which a run's critic stage records
FIT_KEYS = ("insample_explained_variance", "insample_auc_won_vs_lost", "kfold_explained_variance",
            "kfold_auc_won_vs_lost", "kfold_folds", "kfold_epochs", "converged_improvement")

CONVERGED_BY = {"heldout": "the held-out split's explained variance", "kfold": "the k-fold held-out explained "
                "variance", "drift": "the last epoch's change of the mean V (no held-out curve)"}


def critic_fit_line(summary: dict[str, Any]) -> str:
    """One line on the trained critic: explained variance and AUC of V(s_0) won vs lost, in-sample and
    held out (k-fold, else the held-out split), and whether it converged by which criterion."""
    def number(key: str) -> str:
        value = summary.get(key)
        return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.3f}"

    if "kfold_explained_variance" in summary:
        held, where = "kfold", f"{summary['kfold_folds']}-fold held-out"
    elif "heldout_explained_variance" in summary:
        held, where = "heldout", "held-out split"
    else:
        held, where = None, None
    parts = []
    for label, key in (("explained variance", "explained_variance"), ("AUC V(s_0) won vs lost", "auc_won_vs_lost")):
        text = f"{label}: in-sample {number('insample_' + key)}" if "insample_" + key in summary else \
            f"{label}: in-sample {number(key)}" if key in summary else f"{label}:"
        if held is not None:
            text += f", {where} {number(held + '_' + key)}"
        if text != f"{label}:":
            parts.append(text)
    verdict = "converged" if summary.get("converged") else "NOT converged"
    parts.append(f"{verdict} by {CONVERGED_BY.get(summary.get('converged_by', 'drift'), summary.get('converged_by'))}")
    return "; ".join(parts)


def load_critic(folder: str | Path, device: str | None = None) -> Critic:
    """Rebuild a trained critic from ``folder/critic.pt`` (its backbone from the recorded init folder)."""
    path = Path(folder)
    path = path / CRITIC_FILE if path.is_dir() else path
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no trained critic (run `qevolve critic` to completion first)")
    saved = load_state(path)
    if saved.get("format") != FORMAT_VERSION:
        raise ValueError(f"{path}: critic format {saved.get('format')}, expected {FORMAT_VERSION}")
    config = CriticConfig.model_validate(saved["config"])
    if device is not None:
        config.device = device
    init = recorded_path(saved["init"], saved.get("init_relative"), path.parent)
    if "value_ema" not in saved:  # saved before the V average existed: its labels read the V head
        config.label_value = "last"
    critic = build_critic(config, init, resolve_device(config.device))
    critic.heads.load_state_dict(saved["heads"])
    critic.target_q.load_state_dict(saved["target_q"])
    if "value_ema" in saved:
        critic.value_ema.load_state_dict(saved["value_ema"])
    if saved["backbone"]:
        critic.backbone.load_state_dict(saved["backbone"], strict=False)
    critic.init_path = init  # type: ignore[attr-defined]
    critic.source = str(path)  # type: ignore[attr-defined]
    return critic.eval()


@torch.inference_mode()
def predict_values(critic: Critic, samples: list[CriticSample], progress: bool = True,
                   batch_tokens: int | None = None, q_source: str = "online",
                   value_source: str | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
    """(V(s_t), Q(s_t, a_t)) of every turn of every sample, float64 arrays.

    V is the critic's ``label_value`` (the V average, or the V head after the last step) unless
    ``value_source`` (``ema`` or ``last``) says which.

    ``q_source="online"`` (default): Q is the minimum over the online Q heads, the Q of the method's
    ``Q - V`` advantage. ``"target"``: the minimum over the Polyak target heads Qbar, the quantity
    V was fitted to (as in IQL's policy extraction).
    """
    if q_source not in ("online", "target"):
        raise ValueError(f"q_source {q_source!r}: expected online or target")
    config = critic.config
    device = next(critic.heads.parameters()).device
    critic.eval()
    init_path = Path(getattr(critic, "init_path", None) or init_path_of(config))
    if config.backbone == "frozen":
        features = frozen_features(critic, samples, config, init_path, device, progress)
    else:
        features = extract_features(critic.backbone, samples, batch_tokens or config.batch_tokens, device,
                                    critic.compute_dtype, progress=progress)
    results = []
    for sample, (v_features, q_features) in zip(samples, features):
        values, q_heads, target_q = _head_outputs(critic, v_features, q_features, device, value_source)
        values = values.double().cpu().numpy()
        q_values = (target_q if q_source == "target" else q_heads.min(dim=0).values).double().cpu().numpy()
        for name, array in (("V", values), ("Q", q_values)):
            if not np.isfinite(array).all():
                turn = int(np.flatnonzero(~np.isfinite(array))[0])
                raise NonFiniteError(f"critic {getattr(critic, 'source', '')}: non-finite {name} ({array[turn]}) "
                                     f"for episode {sample.episode_id!r} turn {turn}; refusing to label with it")
        results.append((values, q_values))
    return results
