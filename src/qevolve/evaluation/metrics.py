"""Episode-level metrics shared by ``qevolve eval``, rollouts, ``data show`` and the evolve loop."""

from __future__ import annotations

from typing import Any, Iterable

from qevolve.buffer.store import Episode


def episode_metrics(episodes: Iterable[Episode], failed: int = 0) -> dict[str, Any]:
    """Success rate, mean final reward, mean turns, format-error and invalid-action rates.

    Episodes lost to environment failures (worker crash, timeout) count as unsuccessful episodes
    with reward 0 in the rates, never silently dropped: those stored with ``failed = True``, plus
    ``failed`` more that are not in ``episodes``. The turn rates are over the episodes that did not fail.
    """
    episodes = list(episodes)
    failed += sum(ep.failed for ep in episodes)
    episodes = [ep for ep in episodes if not ep.failed]
    n = len(episodes) + failed
    turns = [turn for ep in episodes for turn in ep.turns]
    n_turns = max(len(turns), 1)
    return {
        "episodes": n,
        "failed_episodes": failed,
        "success_rate": sum(ep.won for ep in episodes) / n if n else 0.0,
        "mean_reward": sum(ep.score for ep in episodes) / n if n else 0.0,
        "mean_turns": len(turns) / len(episodes) if episodes else 0.0,
        "format_error_rate": sum(not t.format_valid for t in turns) / n_turns,
        "invalid_action_rate": sum(t.format_valid and not t.action_valid for t in turns) / n_turns,
        "env_steps": sum(t.info.get("env_stepped", True) for t in turns),
        "tokens_generated": sum(len(t.action_ids or ()) for t in turns if t.action_logprobs is not None),
    }
