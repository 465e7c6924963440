"""The interface every environment implements, and the registry that builds them by name.

An environment is split in three (after verl-agent): the raw simulator behind :class:`Environment`,
the parsing of an agent turn into an action with a validity flag (:mod:`qevolve.environments.turn_format`),
and the instruction prompt (:attr:`Environment.instruction`). Rollouts, expert generation and
evaluation only talk to this interface, usually through :class:`qevolve.environments.pool.EnvPool`.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, Callable

SPLITS = ("train", "seen", "unseen")


@dataclass
class StepResult:
    """What the environment answered to one action.

    ``reward`` is the method's sparse r_env: 0 on every step but the one that ends the episode
    (``done``), which carries the episode's final reward. ``info`` holds at least ``won`` (bool),
    ``score`` (the episode's reward so far, in [0, 1]) and ``valid_action`` (False when the
    environment rejected the action). When the runner ends an episode that is not done (turn limit),
    the last turn's reward becomes the episode's ``score`` (:func:`qevolve.buffer.store.settle_final_reward`).
    """

    observation: str
    reward: float
    done: bool
    info: dict[str, Any] = field(default_factory=dict)


class Environment(abc.ABC):
    """A text environment that plays one task at a time."""

    #: registry name ("alfworld", "sciworld", "webshop", ...)
    name: str = ""
    #: the instruction/system prompt for an agent in this environment (in this project's own words)
    instruction: str = ""
    #: the turn format of this environment's demonstrations ("action" or "thought_action"), which
    #: ``prompt.turn_format: auto`` picks
    turn_format: str = "action"

    @abc.abstractmethod
    def tasks(self, split: str) -> list[str]:
        """Stable task ids of a split (``train``, ``seen``, ``unseen``, or an env-specific one)."""

    @abc.abstractmethod
    def reset(self, task_id: str) -> str:
        """Start task ``task_id``; return the first observation (including the task description)."""

    @abc.abstractmethod
    def step(self, action: str) -> StepResult:
        """Apply one action (already parsed from the agent's turn)."""

    def max_turns(self, task_id: str | None = None) -> int:
        """The maximum number of agent turns of an episode (may depend on the task)."""
        return 30

    def admissible_actions(self) -> list[str]:
        """Actions valid in the current state, when the environment can list them."""
        raise NotImplementedError(f"{self.name} cannot list admissible actions")

    def expert_actions(self) -> list[str]:
        """An expert action sequence for the current task, when the environment has one."""
        raise NotImplementedError(f"{self.name} has no expert for the current task")

    def close(self) -> None:
        """Release simulator resources (processes, JVMs, files)."""


EnvFactory = Callable[..., Environment]
_REGISTRY: dict[str, EnvFactory] = {}


def register_environment(name: str, factory: EnvFactory | None = None):
    """Register ``factory`` (a class or callable returning an :class:`Environment`) under ``name``.

    Usable as a decorator. User environments register the same way as the built-in ones; a factory
    may also be given as ``"package.module:callable"`` to :func:`make_environment`.
    """

    def _register(obj: EnvFactory) -> EnvFactory:
        _REGISTRY[name] = obj
        return obj

    return _register(factory) if factory is not None else _register


_BUILTIN_MODULES = {
    "alfworld": "qevolve.environments.alfworld",
    "sciworld": "qevolve.environments.sciworld",
    "webshop": "qevolve.environments.webshop",
}


def environment_names() -> list[str]:
    return sorted(set(_REGISTRY) | set(_BUILTIN_MODULES))


def get_factory(name: str) -> EnvFactory:
    if name not in _REGISTRY and name in _BUILTIN_MODULES:
        import importlib

        importlib.import_module(_BUILTIN_MODULES[name])  # registers itself on import
    if name not in _REGISTRY and ":" in name:
        import importlib

        module_name, _, attr = name.partition(":")
        _REGISTRY[name] = getattr(importlib.import_module(module_name), attr)
    if name not in _REGISTRY:
        raise KeyError(f"unknown environment {name!r}; known: {', '.join(environment_names())}")
    return _REGISTRY[name]


def make_environment(name: str, **kwargs: Any) -> Environment:
    """Build a registered environment by name with keyword settings."""
    return get_factory(name)(**kwargs)
