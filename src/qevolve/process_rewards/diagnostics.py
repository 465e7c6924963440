"""What the policy stage will push up and down: a labelled buffer's advantages by action kind and outcome.

A policy that collapses after BPPO (docs/results.md, WebShop 2026-12-04: it stopped buying) is
explained by which actions carry negative advantages *as the policy stage sees them*, i.e. after
its standardisation. This module groups every turn by the kind of its action (the environment's
verb: ``search``, ``click[Buy Now]``, ``go to``, ...) and by whether its episode was won (the
environment's success, ``Episode.won``: on WebShop a reward of 1, not the critic's d = final score
> 0 that `qevolve label` summarises as won/lost), and
reports the labelled and the standardised mean advantage side by side, with V and Q.

    qevolve data advantages runs/NAME/iter_1/label/labelled.parquet --standardize buffer
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Any, Literal

import numpy as np

from qevolve.buffer.store import Episode, usable_episodes
from qevolve.process_rewards.advantages import shift_and_scale

__all__ = ["action_kind", "action_kind_counts", "advantage_by_action_kind", "STANDARDIZE_MODES"]

STANDARDIZE_MODES = ("buffer", "buffer_scale", "none")  # the policy stage's modes that do not depend on batching

_WEBSHOP_ASIN = re.compile(r"^b0[0-9a-z]{8}$")
_WEBSHOP_BUTTONS = {"buy now": "click[buy now]", "< prev": "click[< prev]", "next >": "click[next >]",
                    "back to search": "click[back to search]", "description": "click[description]",
                    "features": "click[features]", "reviews": "click[reviews]"}
_PARTICLES = {"to", "around", "at", "up", "on"}


def action_kind(env: str, action: str | None) -> str:
    """The kind of an action: WebShop's search / button / product / option; elsewhere the verb.

    ALFWorld and ScienceWorld verbs are the action's words before its first object, so ``go to
    desk 1`` and ``go to shelf 3`` are both ``go to``; a missing action (format error) is ``(none)``.
    """
    text = (action or "").strip().lower()
    if not text:
        return "(none)"
    if env == "webshop":
        from qevolve.environments.webshop.env import parse_action

        parsed = parse_action(text)
        if parsed is None:
            return "(unparsed)"
        verb, argument = parsed
        if verb == "search":
            return "search"
        if argument in _WEBSHOP_BUTTONS:
            return _WEBSHOP_BUTTONS[argument]
        return "click[product]" if _WEBSHOP_ASIN.match(argument) else "click[option]"
    words = text.split()
    # phrasal verbs: "go to", "look around", "look at", "pick up", "focus on", "teleport to"
    return " ".join(words[:2]) if len(words) > 1 and words[1] in _PARTICLES else words[0]


def advantage_by_action_kind(episodes: list[Episode],
                             standardize: Literal["buffer", "buffer_scale", "none"] = "buffer",
                             min_std: float = 1e-6, include_failed: bool = False) -> dict[str, Any]:
    """Rows (kind x outcome) of turns, labelled and standardised mean advantage, share pushed down, V, Q.

    The turns are the ones the policy stage trains on (episodes lost to environment failures left out
    unless ``include_failed``); the standardisation is computed over all of them, as the stage does.
    """
    if standardize not in STANDARDIZE_MODES:
        raise ValueError(f"standardize: expected one of {', '.join(STANDARDIZE_MODES)}, got {standardize!r}")
    episodes = usable_episodes(episodes, include_failed)
    turns = [(ep, turn) for ep in episodes for turn in ep.turns]
    missing = next(((ep, t) for ep in episodes for t, turn in enumerate(ep.turns) if turn.advantage is None), None)
    if missing is not None:
        raise ValueError(f"episode {missing[0].episode_id!r} turn {missing[1]} has no advantage; "
                         "label the buffer first (`qevolve label`)")
    labelled = np.array([float(turn.advantage) for _, turn in turns], dtype=np.float64)
    shift, scale = shift_and_scale(labelled, min_std) if standardize != "none" else (0.0, 1.0)
    shift = shift if standardize == "buffer" else 0.0  # buffer_scale: the same divisor, no centring
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


def action_kind_counts(episodes: list[Episode], top: int | None = None) -> dict[str, Any]:
    """How a policy acts: the share of its actions of each kind, and how many episodes used each kind.

    ``episodes_with`` is the number of episodes with at least one action of the kind (e.g. how many
    WebShop episodes ever clicked Buy Now)."""
    counts: dict[str, int] = defaultdict(int)
    with_kind: dict[str, int] = defaultdict(int)
    for ep in episodes:
        kinds = [action_kind(ep.env, turn.action) for turn in ep.turns]
        for kind in kinds:
            counts[kind] += 1
        for kind in set(kinds):
            with_kind[kind] += 1
    actions = sum(counts.values())
    rows = [{"action_kind": kind, "actions": n, "share": n / actions, "episodes_with": with_kind[kind]}
            for kind, n in sorted(counts.items(), key=lambda item: (-item[1], item[0]))][:top]
    return {"episodes": len(episodes), "won": sum(ep.won for ep in episodes), "actions": actions, "rows": rows}
