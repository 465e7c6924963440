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

from qevolve.environments.alfworld.prompt import ALFWORLD_INSTRUCTION
from qevolve.environments.base import DataFile, Environment, StepResult, register_environment
from qevolve.environments.installed_data import require_installed

SPLIT_FOLDERS = {"train": "train", "seen": "valid_seen", "unseen": "valid_unseen", "valid_train": "valid_train"}
GAME_FILE = "game.tw-pddl"
INVALID_ACTION_TEXT = "Nothing happens."
WELCOME_BANNER = "-= Welcome to TextWorld, ALFRED! =-"
DEFAULT_MAX_TURNS = 30  # the ETO protocol's limit, as in the paper

#: what ``qevolve data install alfworld`` unpacks: the games and the expert trajectories of json_2.1.1 (their
#: provenance and checksums are listed in the data README, shared/data/README.md)
DATA_FILES = (
    DataFile("alfworld/games_json_2.1.1_tw-pddl.tar.gz",
             "a3e501cb421175b47d7b67c87bc04314ac99ac8fea6116eca779b8a4053a3395", unpack=True),
    DataFile("alfworld/expert_gt_traj_json_2.1.1.tar.gz",
             "83a633d6cf9ec1ed2fa050cd7b88a3d702639df4a711358db49f8317846d92f6", unpack=True),
)


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


def _share_textworld_parses() -> None:
    """Reuse TextWorld's pure text -> structure translations across loads, resets and steps.

    Profiled here (cProfile over game loads, resets and expert steps), two pure functions of their
    text arguments take most of an ALFWorld episode's time:

    * fast-downward's PDDL -> SAS translation, run four times per game (TextWorld builds a
      ``PddlState`` at load and again at reset, each translating plain and optimised) on the same
      domain and problem text. TextWorld only reads the task it returns, so the last results
      are kept and reused: two translations per game instead of four.
    * the text-grammar parser (tatsu) behind every observation: the same grammar rules and
      templates are parsed again for every game and step. Parses are kept in an LRU cache and a
      deep copy is returned, because the derivation mutates the symbols it gets.
    """
    import copy

    import fast_downward
    import textworld.envs.pddl.textgen as textgen

    if not getattr(fast_downward.pddl2sas, "_qevolve_shared", False):
        translate = fast_downward.pddl2sas

        @functools.lru_cache(maxsize=4)  # one game: plain + optimised; the next game evicts it
        def shared_translation(domain: str, problem: str, verbose: bool, optimize: bool):
            return translate(domain, problem, verbose=verbose, optimize=optimize)

        def pddl2sas(domain: str, problem: str, verbose: bool = False, optimize: bool = False):
            return shared_translation(domain, problem, bool(verbose), bool(optimize))

        pddl2sas._qevolve_shared = True  # type: ignore[attr-defined]
        fast_downward.pddl2sas = pddl2sas

    if not getattr(textgen._parse_and_convert, "_qevolve_shared", False):
        parse = textgen._parse_and_convert

        @functools.lru_cache(maxsize=16384)
        def shared_parse(text: str, rule_name: str, trace: bool):
            return parse(text, rule_name=rule_name, trace=trace)

        def parse_and_convert(text, **kwargs):
            if not isinstance(text, str) or "rule_name" not in kwargs or set(kwargs) - {"rule_name", "trace"}:
                return parse(text, **kwargs)  # a call this cache was not written for: parse it afresh
            return copy.deepcopy(shared_parse(text, kwargs["rule_name"], bool(kwargs.get("trace", False))))

        parse_and_convert._qevolve_shared = True  # type: ignore[attr-defined]
        textgen._parse_and_convert = parse_and_convert


def clean_observation(text: str) -> str:
    """Drop the TextWorld welcome banner and surrounding whitespace."""
    text = text.replace(WELCOME_BANNER, "")
    return text.strip()


@register_environment("alfworld")
class AlfWorldEnv(Environment):
    """ALFWorld text games. ``split`` picks where task ids are looked up (``train`` by default)."""

    name = "alfworld"
    turn_format = "action"  # the expert demonstrations have no thoughts
    instruction = ALFWORLD_INSTRUCTION
    # r_aux of the critic's reward: the paper's table (docs/method.md, section 3)
    retrospective_penalties = {"format_error": -0.3, "invalid_action": -0.2, "repeat": -0.1}
    # TextWorld's memory grows while it plays: worker RSS rose 158 -> 201 MiB (+27%) over 200 random episodes
    # with no plateau, about 0.2 MiB per episode; recycled every 50 episodes a worker still peaked at 179 MiB
    # (+14%), so every 25 (benchmarks/soak.py, docs/reliability.md)
    recycle_workers_after = 25
    data_files = DATA_FILES

    def __init__(self, split: str = "train", data_root: str | Path | None = None,
                 max_turns: int = DEFAULT_MAX_TURNS):
        import textworld
        from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredInfos
        from textworld.envs.wrappers import Filter, GenericEnvironment

        _share_textworld_parses()
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
