"""What the policy stage will push up and down: a labelled buffer's advantages by action kind and outcome.

A policy that collapses after BPPO (docs/results.md, WebShop 2026-12-04: it stopped buying) is
explained by which actions carry negative advantages *as the policy stage sees them*, i.e. after
its standardisation. This module groups every turn by the kind of its action (the environment's
verb: ``search``, ``click[Buy Now]``, ``go to``, ...) and by whether its episode was won (the
environment's success, ``Episode.won``: on WebShop a reward of 1, not the critic's d = final score
> 0), and reports the labelled and the standardised mean advantage side by side, with V and Q.

:func:`label_audit` asks the sharper question where the environment can judge single actions (a
turn judge, :mod:`qevolve.environments.judges`; WebShop's judges product and option clicks against
the goal's target): do the labels put the right actions above the wrong ones?

    qevolve data advantages runs/NAME/iter_1/label/labelled.parquet --standardize buffer
    qevolve data label-audit runs/NAME/iter_1/label/labelled.parquet
"""

from __future__ import annotations

import functools

import re
from collections import defaultdict
from typing import Any, Callable, Literal

import numpy as np
import torch

from qevolve.buffer.store import Episode, usable_episodes
from qevolve.critic.data import monte_carlo_returns
from qevolve.process_rewards.advantages import shift_and_scale

__all__ = ["action_kind", "action_kind_counts", "advantage_by_action_kind", "critic_fit", "label_audit",
           "audit_metrics", "audit_line", "STANDARDIZE_MODES"]

STANDARDIZE_MODES = ("buffer", "buffer_scale", "none")  # the policy stage's modes that do not depend on batching

def action_kind(env: str, action: str | None) -> str:
    """The kind of an action as its environment reads it (``Environment.action_kind``: the verb by default,
    WebShop's search / button / product / option); a missing action (format error) is ``(none)``."""
    text = (action or "").strip().lower()
    if not text:
        return "(none)"
    return _action_kind_of(env)(text)


@functools.lru_cache(maxsize=None)
def _action_kind_of(env: str):
    from qevolve.environments.base import Environment, get_factory

    try:
        kind = getattr(get_factory(env), "action_kind", None)
    except KeyError:  # an environment this process cannot import: its verbs
        kind = None
    return kind if callable(kind) else Environment.action_kind


def advantage_by_action_kind(episodes: list[Episode],
                             standardize: Literal["buffer", "buffer_scale", "none"] = "buffer",
                             min_std: float = 1e-6, include_failed: bool = False) -> dict[str, Any]:
    """Rows (kind x outcome) of turns, labelled and standardised mean advantage, share pushed down, V, Q.

    The turns are the ones the policy stage trains on (episodes lost to environment failures left out
    unless ``include_failed``); the standardisation is computed over all of them, as the stage does.
    """
    episodes = usable_episodes(episodes, include_failed)
    turns = [(ep, turn) for ep in episodes for turn in ep.turns]
    labelled, shift, scale = _standardized(episodes, standardize, min_std)
    groups: dict[tuple[str, str], list[int]] = defaultdict(list)
    for i, (ep, turn) in enumerate(turns):
        groups[(action_kind(ep.env, turn.action), "won" if ep.won else "lost")].append(i)

    def mean_of(values: list[float | None]) -> float | None:
        present = [v for v in values if v is not None]
        return float(np.mean(present)) if present else None

    rows = []
    for (kind, outcome), index in sorted(groups.items(), key=lambda item: (-len(item[1]), item[0])):
        standardized = (labelled[index] - shift) / scale
        rows.append({
            "action_kind": kind, "outcome": outcome, "turns": len(index),
            "advantage": float(labelled[index].mean()), "standardized": float(standardized.mean()),
            "pushed_down": float((standardized < 0).mean()),
            "V": mean_of([turns[i][1].value for i in index]), "Q": mean_of([turns[i][1].q_value for i in index]),
        })
    return {"standardize": standardize, "turns": len(turns), "episodes": len(episodes),
            "shift": shift, "scale": scale, "rows": rows}


def _standardized(episodes: list[Episode], standardize: str, min_std: float) -> tuple[np.ndarray, float, float]:
    """Every turn's labelled advantage (episodes in order) and the shift and divisor that the policy stage's
    ``standardize_advantages`` mode applies to them."""
    if standardize not in STANDARDIZE_MODES:
        raise ValueError(f"standardize: expected one of {', '.join(STANDARDIZE_MODES)}, got {standardize!r}")
    _require_label(episodes, "advantage", "advantage")
    labelled = np.array([float(turn.advantage) for ep in episodes for turn in ep.turns], dtype=np.float64)
    shift, scale = shift_and_scale(labelled, min_std) if standardize != "none" else (0.0, 1.0)
    return labelled, (shift if standardize == "buffer" else 0.0), scale  # buffer_scale: no centring


def label_audit(episodes: list[Episode], standardize: Literal["buffer", "buffer_scale", "none"] = "buffer",
                min_std: float = 1e-6, include_failed: bool = False,
                judge: Callable[[Episode], list[tuple[str, bool] | None]] | None = None) -> dict[str, Any] | None:
    """Do the labels put the right actions above the wrong ones? None when the environment has no turn judge.

    Every turn the environment's judge (:func:`qevolve.environments.judges.turn_judge`, or ``judge``)
    can judge is *correct* or *wrong* for its kind (WebShop: ``click[product]``, ``click[option]``).
    Rows per kind and outcome (``won``, ``lost``: ``Episode.won``; ``all``): how many correct and wrong
    turns, their mean standardised advantage (standardised as the policy stage does, over every turn it
    trains on), the share of each pushed down (negative after standardisation), and the AUC of the
    advantage, correct against wrong (1: every correct turn above every wrong one; 0.5: no better than a
    coin). Standardisation does not change the order of the advantages, so the AUC is the labels' own.
    A number without turns to compute it from (an AUC without both correct and wrong turns) is None.
    """
    episodes = usable_episodes(episodes, include_failed)
    labelled, shift, scale = _standardized(episodes, standardize, min_std)
    envs = sorted({ep.env for ep in episodes})
    if judge is None:
        if len(envs) != 1:
            raise ValueError(f"label audit: the buffer mixes environments ({', '.join(envs)}); audit one at a time")
        from qevolve.environments.judges import turn_judge

        judge = turn_judge(envs[0])
        if judge is None:
            return None
    standardized = (labelled - shift) / scale
    groups: dict[tuple[str, str, bool], list[float]] = defaultdict(list)
    position = 0
    for ep in episodes:
        verdicts = judge(ep)
        if len(verdicts) != ep.num_turns:
            raise ValueError(f"label audit: the judge gave {len(verdicts)} verdicts for the {ep.num_turns} turns "
                             f"of episode {ep.episode_id!r}")
        for verdict, value in zip(verdicts, standardized[position:position + ep.num_turns]):
            if verdict is not None:
                kind, correct = verdict
                for outcome in ("won" if ep.won else "lost", "all"):
                    groups[(kind, outcome, bool(correct))].append(float(value))
        position += ep.num_turns

    def mean(values: list[float]) -> float | None:
        return float(np.mean(values)) if values else None

    rows = []
    for kind in sorted({kind for kind, _, _ in groups}):
        for outcome in ("won", "lost", "all"):
            right, wrong = groups.get((kind, outcome, True), []), groups.get((kind, outcome, False), [])
            rows.append({"action_kind": kind, "outcome": outcome, "correct": len(right), "wrong": len(wrong),
                         "advantage_correct": mean(right), "advantage_wrong": mean(wrong),
                         "pushed_down_correct": mean([float(v < 0) for v in right]),
                         "pushed_down_wrong": mean([float(v < 0) for v in wrong]),
                         "auc_correct_vs_wrong": _auc(np.array(right), np.array(wrong))})
    return {"env": envs[0] if len(envs) == 1 else ",".join(envs), "standardize": standardize,
            "episodes": len(episodes), "won": int(sum(ep.won for ep in episodes)), "turns": int(labelled.size),
            "judged_turns": sum(r["correct"] + r["wrong"] for r in rows if r["outcome"] == "all"),
            "shift": shift, "scale": scale, "rows": rows}


def audit_metrics(audit: dict[str, Any]) -> dict[str, float | int]:
    """A run's stage metrics from a :func:`label_audit`: per kind (``click[product]`` -> ``product``) the
    counts, the mean standardised advantage of correct and wrong turns, and the AUC (``auc``: every
    episode; ``auc_won``, ``auc_lost``: within won and lost episodes)."""
    metrics: dict[str, float | int | None] = {}
    for row in audit["rows"]:
        kind = re.sub(r"\W+", "_", row["action_kind"].removeprefix("click[").removesuffix("]")).strip("_")
        suffix = "" if row["outcome"] == "all" else f"_{row['outcome']}"
        metrics[f"audit_{kind}_auc{suffix}"] = row["auc_correct_vs_wrong"]
        if row["outcome"] == "all":
            metrics.update({f"audit_{kind}_correct": row["correct"], f"audit_{kind}_wrong": row["wrong"],
                            f"audit_{kind}_advantage_correct": row["advantage_correct"],
                            f"audit_{kind}_advantage_wrong": row["advantage_wrong"]})
    return {key: value for key, value in metrics.items() if value is not None}


def audit_line(audit: dict[str, Any]) -> str:
    """One line per kind of a :func:`label_audit`: counts, mean standardised advantage, AUC overall and by outcome."""
    def number(value: float | None, signed: bool = False) -> str:
        return "n/a" if value is None else f"{value:+.2f}" if signed else f"{value:.2f}"

    parts = []
    rows = {(row["action_kind"], row["outcome"]): row for row in audit["rows"]}
    for kind in dict.fromkeys(row["action_kind"] for row in audit["rows"]):
        every, won, lost = rows[(kind, "all")], rows[(kind, "won")], rows[(kind, "lost")]
        parts.append(f"{kind} {every['correct']} correct / {every['wrong']} wrong, standardised advantage "
                     f"{number(every['advantage_correct'], True)} vs {number(every['advantage_wrong'], True)}, AUC "
                     f"{number(every['auc_correct_vs_wrong'])} (won {number(won['auc_correct_vs_wrong'])}, lost "
                     f"{number(lost['auc_correct_vs_wrong'])})")
    return "label audit: " + ("; ".join(parts) if parts else "no turn the judge could judge")


def action_kind_counts(episodes: list[Episode], top: int | None = None) -> dict[str, Any]:
    """How a policy acts: the share of its actions of each kind, and how many episodes used each kind.

    ``episodes_with`` is the number of episodes with at least one action of the kind (e.g. how many
    WebShop episodes ever clicked Buy Now). ``invalid`` is the share of the kind's actions that the
    environment rejected, ``repeated`` the share that repeat the episode's previous action word for word
    (case and surrounding spaces aside): together they show a policy that loops on an action the page does
    not offer."""
    counts: dict[str, int] = defaultdict(int)
    invalid: dict[str, int] = defaultdict(int)
    repeated: dict[str, int] = defaultdict(int)
    with_kind: dict[str, int] = defaultdict(int)
    for ep in episodes:
        kinds = [action_kind(ep.env, turn.action) for turn in ep.turns]
        said = [(turn.action or "").strip().lower() for turn in ep.turns]
        for t, (kind, turn) in enumerate(zip(kinds, ep.turns)):
            counts[kind] += 1
            invalid[kind] += not turn.action_valid
            repeated[kind] += t > 0 and bool(said[t]) and said[t] == said[t - 1]
        for kind in set(kinds):
            with_kind[kind] += 1
    actions = sum(counts.values())
    rows = [{"action_kind": kind, "actions": n, "share": n / actions, "episodes_with": with_kind[kind],
             "invalid": invalid[kind] / n, "repeated": repeated[kind] / n}
            for kind, n in sorted(counts.items(), key=lambda item: (-item[1], item[0]))][:top]
    return {"episodes": len(episodes), "won": sum(ep.won for ep in episodes), "actions": actions, "rows": rows}


def _require_label(episodes: list[Episode], field: str, name: str) -> None:
    """Refuse a buffer with a turn whose ``field`` is unset (not labelled), naming the first such turn."""
    missing = next(((ep, t) for ep in episodes for t, turn in enumerate(ep.turns) if getattr(turn, field) is None),
                   None)
    if missing is not None:
        raise ValueError(f"episode {missing[0].episode_id!r} turn {missing[1]} has no {name}; "
                         "label the buffer first (`qevolve label`)")


def _fit(values: np.ndarray, returns: np.ndarray) -> dict[str, float | None]:
    """Explained variance, Pearson correlation and mean error (V - G) of values against returns."""
    if values.size < 2:
        return {"explained_variance": None, "correlation": None, "bias": None}
    spread = float(np.var(returns))
    both = float(np.std(values)) * float(np.std(returns))
    return {"explained_variance": 1.0 - float(np.var(returns - values)) / spread if spread > 0 else None,
            "correlation": float(np.mean((values - values.mean()) * (returns - returns.mean()))) / both
            if both > 0 else None,
            "bias": float(np.mean(values - returns))}


def _auc(positive: np.ndarray, negative: np.ndarray) -> float | None:
    """The critic's Mann-Whitney AUC (:func:`qevolve.critic.train.roc_auc`), None without both groups."""
    from qevolve.critic.train import roc_auc

    if not positive.size or not negative.size:
        return None
    return roc_auc(np.asarray(positive, dtype=np.float64), np.asarray(negative, dtype=np.float64))


def critic_fit(episodes: list[Episode], gamma: float = 0.99, include_failed: bool = False) -> dict[str, Any]:
    """How well a labelled buffer's V(s_t) predicts what followed: the discounted env return-to-go G_t.

    G_t = sum_k gamma^k r_env_{t+k} over the rest of the episode (no bootstrap): the quantity GAE's
    advantages are built from (only r_env enters them). Reported over all turns, at the first turn
    (with the AUC of V(s_0) between won and lost episodes: 0.5 = the critic cannot tell them apart
    at the start), and per turn index for won and lost episodes (does V rise along an episode?).
    IQL's V is an upper expectile (m > 0.5), so a positive ``bias`` is expected; ``correlation``
    is the measure of ranking that ignores it.
    """
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma: expected a value in [0, 1], got {gamma}")
    episodes = usable_episodes(episodes, include_failed)
    _require_label(episodes, "value", "value V")
    values, returns, index, won = [], [], [], []
    for ep in episodes:
        to_go = monte_carlo_returns(torch.tensor([float(turn.reward) for turn in ep.turns]), gamma)
        for t, (turn, g) in enumerate(zip(ep.turns, to_go.tolist())):
            values.append(float(turn.value))
            returns.append(g)
            index.append(t)
            won.append(ep.won)
    v, g, t_index, w = (np.array(values), np.array(returns), np.array(index), np.array(won, dtype=bool))
    first = t_index == 0
    by_turn = []
    for t in range(int(t_index.max()) + 1 if t_index.size else 0):
        row: dict[str, Any] = {"turn": t}
        for outcome, mask in (("won", w), ("lost", ~w)):
            here = (t_index == t) & mask
            row[f"{outcome}_turns"] = int(here.sum())
            row[f"V_{outcome}"] = float(v[here].mean()) if here.any() else None
            row[f"G_{outcome}"] = float(g[here].mean()) if here.any() else None
        by_turn.append(row)
    return {"episodes": len(episodes), "won": int(sum(ep.won for ep in episodes)), "turns": int(v.size),
            "gamma": gamma, "all_turns": _fit(v, g),
            "first_turn": {**_fit(v[first], g[first]), "auc_won_vs_lost": _auc(v[first & w], v[first & ~w])},
            "by_turn": by_turn}
