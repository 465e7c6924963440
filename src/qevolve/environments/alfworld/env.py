"""The ALFWorld adapter: one TextWorld environment per instance, reused across games.

Games are loaded straight into a TextWorld ``GenericEnvironment`` wrapped with ALFWorld's
demangler (object names like "mug 1") and info wrapper, so any game can be reset by id without
the shuffled game iterator of the gym wrapper. Re-creating environments per game leaks memory
(about 0.8 GB per 100 games, measured here), so an instance loads game after game.

Task ids are the game folder relative to its split, ``<task-folder>/<trial>``, stable across
machines. Splits: ``train`` (3,553 games), ``seen`` = valid_seen (140), ``unseen`` = valid_unseen
(134), and ``valid_train`` (200).
"""

from __future__ import annotations

import functools
from pathlib import Path

from qevolve.data.install import require_installed
from qevolve.environments.alfworld.prompt import ALFWORLD_INSTRUCTION
from qevolve.environments.base import Environment, StepResult, register_environment

SPLIT_FOLDERS = {"train": "train", "seen": "valid_seen", "unseen": "valid_unseen", "valid_train": "valid_train"}
GAME_FILE = "game.tw-pddl"
INVALID_ACTION_TEXT = "Nothing happens."
WELCOME_BANNER = "-= Welcome to TextWorld, ALFRED! =-"
DEFAULT_MAX_TURNS = 30  # the ETO protocol's limit, as in the paper


def games_root(data_root: str | Path | None = None) -> Path:
    root = Path(data_root) if data_root is not None else require_installed("alfworld")
    return root / "json_2.1.1"


@functools.lru_cache(maxsize=16)
def _tasks_cached(root: str, split: str) -> tuple[str, ...]:
    folder = Path(root) / SPLIT_FOLDERS[split]
    return tuple(sorted(str(p.parent.relative_to(folder)) for p in folder.glob(f"*/*/{GAME_FILE}")))


def alfworld_tasks(split: str, data_root: str | Path | None = None) -> list[str]:
    if split not in SPLIT_FOLDERS:
        raise ValueError(f"ALFWorld split {split!r}: expected one of {sorted(SPLIT_FOLDERS)}")
    return list(_tasks_cached(str(games_root(data_root)), split))


def task_type(task_id: str) -> str:
    """The task type, from the folder name ``<task_type>-<Object>-<Recep>-<Parent>-<scene>``."""
    return task_id.split("/", 1)[0].split("-", 1)[0]


def clean_observation(text: str) -> str:
    """Drop the TextWorld welcome banner and surrounding whitespace."""
    text = text.replace(WELCOME_BANNER, "")
    return text.strip()


@register_environment("alfworld")
class AlfWorldEnv(Environment):
    """ALFWorld text games. ``split`` picks where task ids are looked up (``train`` by default)."""

    name = "alfworld"
    instruction = ALFWORLD_INSTRUCTION

    def __init__(self, split: str = "train", data_root: str | Path | None = None,
                 max_turns: int = DEFAULT_MAX_TURNS):
        import textworld
        from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredInfos
        from textworld.envs.wrappers import Filter, GenericEnvironment

        self.root = games_root(data_root)
        self.default_split = split
        self._max_turns = max_turns
        infos = textworld.EnvInfos(won=True, admissible_commands=True, extras=["gamefile", "walkthrough"])
        self._env = Filter(AlfredInfos(AlfredDemangler(GenericEnvironment(infos), shuffle=False)))
        self._info: dict = {}
        self._task_id: str | None = None

    # Task ids may carry their split as a prefix ("unseen:<folder>/<trial>") so one pool can mix splits.
    def _game_path(self, task_id: str) -> Path:
        split, sep, rest = task_id.partition(":")
        if not sep:
            split, rest = self.default_split, task_id
        if split not in SPLIT_FOLDERS:
            raise ValueError(f"ALFWorld task {task_id!r}: unknown split {split!r}")
        path = self.root / SPLIT_FOLDERS[split] / rest / GAME_FILE
        if not path.is_file():
            raise FileNotFoundError(f"ALFWorld task {task_id!r}: no game at {path}")
        return path

    def tasks(self, split: str) -> list[str]:
        return alfworld_tasks(split, self.root.parent)

    def max_turns(self, task_id: str | None = None) -> int:
        return self._max_turns

    def reset(self, task_id: str) -> str:
        self._env.load(str(self._game_path(task_id)))
        observation, self._info = self._env.reset()
        self._task_id = task_id
        return clean_observation(observation)

    def step(self, action: str) -> StepResult:
        if self._task_id is None:
            raise RuntimeError("step() before reset()")
        observation, score, done, self._info = self._env.step(action.strip())
        observation = clean_observation(observation)
        won = bool(self._info.get("won", False))
        info = {"won": won, "score": 1.0 if won else 0.0, "valid_action": observation != INVALID_ACTION_TEXT}
        # ALFWorld's reward is 1 on the winning step, 0 elsewhere (sparse, as in the paper).
        return StepResult(observation, 1.0 if (won and done) else 0.0, bool(done), info)

    def admissible_actions(self) -> list[str]:
        return [a for a in self._info.get("admissible_commands", []) if a not in ("help",)]

    def expert_actions(self) -> list[str]:
        """The stored walkthrough: an optimal plan (privileged: it knows where objects are)."""
        return list(self._info.get("extra.walkthrough") or [])

    def close(self) -> None:
        try:
            self._env.close()
        except Exception:
            pass
