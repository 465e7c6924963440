"""Worker-side policies for the environment pool: replay, walkthrough, random.

These run inside the environment worker processes (see :mod:`qevolve.environments.pool`), so they
must be cheap and picklable. LLM policies live in :mod:`qevolve.rollouts` instead.
"""

from __future__ import annotations

import random

from qevolve.environments.base import Environment
from qevolve.environments.pool import EpisodePolicy


class ReplayPolicy(EpisodePolicy):
    """Replays a fixed action sequence (e.g. a human expert demonstration), then stops."""

    source = "expert"

    def __init__(self, actions: list[str], source: str = "expert"):
        self.actions = list(actions)
        self.source = source
        self._next = 0

    def start(self, env: Environment, task_id: str, observation: str) -> None:
        self._next = 0

    def act(self, env: Environment, observation: str) -> str | None:
        if self._next >= len(self.actions):
            return None
        action = self.actions[self._next]
        self._next += 1
        return action


class WalkthroughPolicy(ReplayPolicy):
    """Replays the environment's own expert plan for the task (``env.expert_actions()``)."""

    def __init__(self, source: str = "walkthrough"):
        super().__init__([], source)

    def start(self, env: Environment, task_id: str, observation: str) -> None:
        self.actions = env.expert_actions()
        self._next = 0


class RandomPolicy(EpisodePolicy):
    """Uniform over the admissible actions, seeded per task so runs repeat."""

    source = "random"

    def __init__(self, seed: int = 0):
        self.seed = seed
        self._rng = random.Random(seed)

    def start(self, env: Environment, task_id: str, observation: str) -> None:
        self._rng = random.Random(f"{self.seed}/{task_id}")

    def act(self, env: Environment, observation: str) -> str | None:
        actions = env.admissible_actions()
        return self._rng.choice(actions) if actions else None
