"""The interface every environment implements, and the registry that builds them by name.

An environment is split in three (after verl-agent): the raw simulator behind :class:`Environment`,
the parsing of an agent turn into an action with a validity flag (:mod:`qevolve.environments.turn_format`),
and the instruction prompt (:attr:`Environment.instruction`). Rollouts, expert generation and
evaluation only talk to this interface, usually through :class:`qevolve.environments.pool.EnvPool`.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from pathlib import Path
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


@dataclass(frozen=True)
class DataFile:
    """One file of an environment's data: its path inside the source folder, checksum, and how to install it."""

    relpath: str
    sha256: str
    unpack: bool = False  # a .tar.gz unpacked into the dataset folder (else copied as is)
    url: str | None = None  # upstream download for users without a local copy


_PARTICLES = frozenset({"to", "around", "at", "up", "on"})


class Environment(abc.ABC):
    """A text environment that plays one task at a time."""

    #: registry name ("alfworld", "sciworld", "webshop", ...)
    name: str = ""
    #: the instruction/system prompt for an agent in this environment (in this project's own words)
    instruction: str = ""
    #: the turn format of this environment's demonstrations ("action" or "thought_action"), which
    #: ``prompt.turn_format: auto`` picks
    turn_format: str = "action"
    #: the retrospective penalties (r_aux) of this environment's turns, used when the critic config's
    #: ``retrospective.penalties`` has no entry for it: ``{"format_error": ..., "invalid_action": ...,
    #: "repeat": ...}`` (missing keys take the defaults of
    #: :class:`qevolve.critic.retrospective.AuxPenalties`); None: the config must have one
    retrospective_penalties: dict[str, float] | None = None
    #: episodes after which a worker pool replaces a worker by default, for simulators whose memory grows
    #: without bound while they play (None: never)
    recycle_workers_after: int | None = None
    #: the files ``qevolve data install NAME`` copies (or unpacks) into the data directory's folder NAME,
    #: each checked against its sha256; the environment finds that folder with
    #: :func:`qevolve.environments.installed_data.require_installed` (empty: nothing to install)
    data_files: tuple[DataFile, ...] = ()

    @staticmethod
    def action_kind(action: str) -> str:
        """The kind of a (lower-cased, non-empty) action for the label diagnostics: by default its verb, the
        words before its first object, so ``go to desk 1`` and ``go to shelf 3`` are both ``go to``. An
        environment whose actions read otherwise overrides this."""
        words = action.split()
        # phrasal verbs: "go to", "look around", "look at", "pick up", "focus on", "teleport to"
        return " ".join(words[:2]) if len(words) > 1 and words[1] in _PARTICLES else words[0]

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

    def expert_actions(self) -> list[str | tuple[str, str]]:
        """An expert plan for the current task, when the environment has one: per step, the action, or a
        ``(thought, action)`` pair (needed when :attr:`turn_format` is ``thought_action``: the thought
        becomes the demonstration's ``Thought:`` line).

        Called after :meth:`reset`. An environment that implements it gets expert demonstrations
        without more code: ``qevolve data expert ENV`` replays it on every task of a split and keeps
        the won episodes (see :mod:`qevolve.environments.experts`)."""
        raise NotImplementedError(f"{self.name} has no expert for the current task")

    def close(self) -> None:
        """Release simulator resources (processes, JVMs, files)."""


EnvFactory = Callable[..., Environment]
_REGISTRY: dict[str, EnvFactory] = {}

#: the Python entry-point group through which an installed package names its environments
ENTRY_POINT_GROUP = "qevolve.environments"

#: what every environment must provide, checked before anything is played (one line names what is missing)
CONTRACT = ("an environment is built as Factory(split=...) and has tasks(split) -> list of task ids, "
            "reset(task_id) -> observation and step(action) -> StepResult (subclass "
            "qevolve.environments.Environment)")


class EnvironmentContractError(ValueError):
    """An environment class or factory does not meet :data:`CONTRACT` (a user error: one line, exit 2)."""


class EnvironmentCodeError(ValueError):
    """An environment's own code raised in the main process (a user error: one line, exit 2, naming the
    environment, the call and the exception; the original is its ``__cause__``)."""


def call_environment(env_name: str, call: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, an environment's own code called in the main process (its constructor,
    ``tasks``, ``expert_actions``): an exception it raises becomes one line saying which environment and
    which call raised what, and where, e.g. ``environment 'game:guess': tasks('valid') raised KeyError:
    'valid' (game.py:21)``; without it a user sees only ``error: valid``."""
    import traceback

    if env_name in _BUILTIN_MODULES:  # the built-in environments' errors are one-line messages already
        return fn(*args, **kwargs)
    try:
        return fn(*args, **kwargs)
    except EnvironmentContractError:
        raise
    except Exception as err:
        frames = traceback.extract_tb(err.__traceback__)
        where = f" ({Path(frames[-1].filename).name}:{frames[-1].lineno})" if len(frames) > 1 else ""
        message = " ".join(str(err).split())
        raise EnvironmentCodeError(f"environment {env_name!r}: {call} raised {type(err).__name__}"
                                   f"{': ' + message if message else ''}{where}") from err


def register_environment(name: str, factory: EnvFactory | None = None):
    """Register ``factory`` (a class or callable returning an :class:`Environment`) under ``name``.

    Usable as a decorator. User environments register the same way as the built-in ones. The CLI, the
    configs and the worker processes find a user's environment by the spec ``"package.module:name"``:
    importing ``package.module`` registers ``name`` (or the module defines ``name``, a class or
    callable). Installed packages can instead declare an entry point in the group
    :data:`ENTRY_POINT_GROUP`. The factory is checked against :data:`CONTRACT` here, so a wrong
    constructor fails on import, naming the class, not later inside a worker.
    """

    def _register(obj: EnvFactory) -> EnvFactory:
        check_factory(name, obj)
        _REGISTRY[name] = obj
        return obj

    return _register(factory) if factory is not None else _register


_BUILTIN_MODULES = {
    "alfworld": "qevolve.environments.alfworld",
    "sciworld": "qevolve.environments.sciworld",
    "webshop": "qevolve.environments.webshop",
}


def _entry_points() -> dict[str, Any]:
    from importlib.metadata import entry_points

    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def environment_names() -> list[str]:
    """The names an environment can be asked for by: registered, built-in and installed ones. A
    ``package.module:name`` spec loaded earlier in the process is cached under that spec, but it is not
    a name to list (which ones are cached depends on what the process did before)."""
    registered = {name for name in _REGISTRY if ":" not in name}
    return sorted(registered | set(_BUILTIN_MODULES) | set(_entry_points()))


def _describe(factory: Any) -> str:
    return getattr(factory, "__name__", None) or type(factory).__name__


def check_factory(name: str, factory: Any) -> None:
    """Raise :class:`EnvironmentContractError` (one line naming ``factory``) unless it meets :data:`CONTRACT`.

    Only what can be seen without building an environment: that it is callable, that its signature
    takes ``split=`` (every worker builds its environment with the split it plays) and, for a class,
    that it has ``tasks``, ``reset`` and ``step`` and no abstract method left."""
    import inspect

    what = _describe(factory)
    if not callable(factory):
        raise EnvironmentContractError(f"environment {name!r}: {what} is not a class or callable; {CONTRACT}")
    if inspect.isclass(factory):
        missing = [m for m in ("tasks", "reset", "step") if not callable(getattr(factory, m, None))]
        if missing:
            raise EnvironmentContractError(f"environment {name!r}: {what} has no method {missing[0]}(); {CONTRACT}")
        if inspect.isabstract(factory):
            left = sorted(getattr(factory, "__abstractmethods__", ()))
            raise EnvironmentContractError(f"environment {name!r}: {what} does not implement {', '.join(left)}; "
                                           f"{CONTRACT}")
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # no introspectable signature (e.g. a C extension): checked when built
        return
    # shown without annotations: they add nothing to what is wrong, and postponed ones print quoted
    signature = signature.replace(parameters=[p.replace(annotation=p.empty) for p in signature.parameters.values()],
                                  return_annotation=signature.empty)
    takes_split = any(p.kind is p.VAR_KEYWORD or (p.name == "split" and p.kind in (p.KEYWORD_ONLY,
                                                                                  p.POSITIONAL_OR_KEYWORD))
                      for p in signature.parameters.values())
    if not takes_split:
        raise EnvironmentContractError(
            f"environment {name!r}: {what}{signature} does not accept the keyword argument split= (e.g. "
            f"def __init__(self, split: str = 'train')); {CONTRACT}")


def _load_spec(spec: str) -> EnvFactory:
    """The factory of ``"package.module:name"``: the environment the module's import registers as
    ``name``, else the module's attribute ``name``."""
    import importlib

    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        # The module itself is not there (a module it imports that is missing keeps its traceback).
        if err.name and (module_name == err.name or module_name.startswith(err.name + ".")):
            raise KeyError(f"environment {spec!r}: cannot import module {module_name!r} ({err}); run from the "
                           "folder that holds it, put that folder on PYTHONPATH or install its package") from None
        raise
    if attr in _REGISTRY:
        return _REGISTRY[attr]
    if hasattr(module, attr):
        factory = getattr(module, attr)
        check_factory(spec, factory)
        return factory
    raise KeyError(f"environment {spec!r}: module {module_name!r} neither registers an environment {attr!r} "
                   f"(with register_environment) nor defines it; registered: {', '.join(sorted(_REGISTRY))}")


def get_factory(name: str) -> EnvFactory:
    """The factory of environment ``name``: a registered or built-in name, a ``"package.module:name"``
    spec (see :func:`register_environment`), or the name of an installed entry point."""
    if name in _REGISTRY:
        return _REGISTRY[name]
    if name in _BUILTIN_MODULES:
        import importlib

        importlib.import_module(_BUILTIN_MODULES[name])  # registers itself on import
    elif ":" in name:
        _REGISTRY[name] = _load_spec(name)
    else:
        entry_point = _entry_points().get(name)
        if entry_point is not None:
            loaded = entry_point.load()  # a module (whose import registers ``name``) or the factory itself
            if name not in _REGISTRY:
                import inspect

                if inspect.ismodule(loaded):
                    raise KeyError(f"environment {name!r}: the entry point {entry_point.value!r} (group "
                                   f"{ENTRY_POINT_GROUP}) registers no environment {name!r}")
                check_factory(name, loaded)
                _REGISTRY[name] = loaded
    if name not in _REGISTRY:
        raise KeyError(f"unknown environment {name!r}; known: {', '.join(environment_names())} (or "
                       "'package.module:name' for your own)")
    return _REGISTRY[name]


def make_environment(name: str, **kwargs: Any) -> Environment:
    """Build a registered environment by name with keyword settings."""
    return get_factory(name)(**kwargs)
