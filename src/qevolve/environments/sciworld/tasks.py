"""ScienceWorld task ids, the ETO protocol's task lists and per-task turn limits.

A task id is ``"<task_name>/<variation>"``, e.g. ``"boil/3"``: ``task_name`` is one of the 30 names
of ``scienceworld`` 1.2.3 (``boil``, ``measure-melting-point-known-substance``, ...) and
``variation`` the simulator's variation index. Ids are stable across machines and independent of
the split they were listed from.

ETO protocol splits (from ETO's own index files, installed by ``qevolve data install sciworld``):
``train`` (1,483 pairs), ``seen`` (194, ETO's dev list), ``unseen`` (211, ETO's test list) over
24 task types, and ``seen_not_train`` (the 140 seen pairs that are not also in ETO's train list;
ETO's files share 54). The simulator's own variation splits of all 30 tasks are
``official_train``, ``official_dev`` and ``official_test`` (they need the simulator to list them,
see :meth:`SciWorldEnv.tasks`).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from scienceworld.constants import ID2TASK
from scienceworld.utils import infer_task

from qevolve.environments.base import DataFile
from qevolve.environments.installed_data import require_installed

#: the 30 task names of scienceworld 1.2.3, in the package's order (topic 1-1 ... 10-2)
TASK_NAMES: tuple[str, ...] = tuple(ID2TASK.values())
ETO_SPLIT_FILES = {"train": "eto_train_indices.json", "seen": "eto_dev_indices.json",
                   "unseen": "eto_test_indices.json"}
ETO_SPLITS = (*ETO_SPLIT_FILES, "seen_not_train")
OFFICIAL_SPLITS = ("official_train", "official_dev", "official_test")
SPLITS = (*ETO_SPLITS, *OFFICIAL_SPLITS)
ETO_MAX_STEPS_FILE = "eto_max_steps.json"

_ETO = "https://raw.githubusercontent.com/Yifan-Song793/ETO/a2fc5da38f8d00cfaf3f9b6370d586eebaf72904/eval_agent/data/sciworld/"
#: what ``qevolve data install sciworld`` copies: ETO's task lists and turn limits (their provenance and
#: checksums are listed in the data README, shared/data/README.md)
DATA_FILES = (
    DataFile("sciworld/eto_train_indices.json",
             "c79eea7858383b829269986ee83d0d9a504533e7b4b3a5bc76e5bdc1e6999cd0",
             url=_ETO + "train_indices.json"),
    DataFile("sciworld/eto_dev_indices.json",
             "78084ef4393d2da87b21507451821e431daa1a70ab1a486fd1a964ab2404d741",
             url=_ETO + "dev_indices.json"),
    DataFile("sciworld/eto_test_indices.json",
             "dfe4ab263824f04a49cf977b8f6d65af516ce13b8cfbef5736a97ed993da7152",
             url=_ETO + "test_indices.json"),
    DataFile("sciworld/eto_max_steps.json",
             "035592f47fbe1309b6ed1a260b392a50d94d3163de951508a74e985d93048f73",
             url=_ETO + "max_steps.json"),
    DataFile("sciworld/eto_taskname2id.json",
             "5b02636ef23caeb1da567814fa59ab1f62e2a9276b7f28f57ee4d7cfab784fe2",
             url=_ETO + "taskname2id.json"),
)
#: tasks with random dynamics whose gold path may fail on replay (retry them)
STOCHASTIC_TASKS = ("mendelian-genetics-known-plant", "mendelian-genetics-unknown-plant")


def task_id(task_name: str, variation: int) -> str:
    return f"{task_name}/{variation}"


def parse_task_id(task_id_text: str) -> tuple[str, int]:
    """``"boil/3"`` -> ``("boil", 3)``; a one-line ValueError for anything else."""
    name, sep, variation = str(task_id_text).rpartition("/")
    if not sep or not variation.isdigit():
        raise ValueError(f"ScienceWorld task id {task_id_text!r}: expected '<task_name>/<variation>', e.g. 'boil/3'")
    if name not in TASK_NAMES:
        canonical = infer_task(name)
        hint = f" (did you mean {task_id(canonical, int(variation))!r}?)" if canonical in TASK_NAMES else ""
        raise ValueError(f"ScienceWorld task id {task_id_text!r}: unknown task name {name!r}{hint}; "
                         f"known: {', '.join(TASK_NAMES)}")
    return name, int(variation)


def task_type(task_id_text: str) -> str:
    """The task type of an id is its task name (24 types in the ETO protocol, 30 in all)."""
    return str(task_id_text).rpartition("/")[0] or str(task_id_text)


def eto_task_name(eto_name: str) -> str:
    """ETO's older names ("task-1-boil", "task-10-measure-melting-point-(known-substance)") -> 1.2.3 names."""
    name = infer_task(eto_name)
    if name not in TASK_NAMES:
        raise ValueError(f"ETO task name {eto_name!r} maps to {name!r}, which scienceworld does not know")
    return name


def _data_folder(data_root: str | Path | None) -> Path:
    return Path(data_root) if data_root is not None else require_installed("sciworld")


@functools.lru_cache(maxsize=8)
def _eto_split(folder: str, split: str) -> tuple[str, ...]:
    if split == "seen_not_train":
        train = set(_eto_split(folder, "train"))
        return tuple(t for t in _eto_split(folder, "seen") if t not in train)
    path = Path(folder) / ETO_SPLIT_FILES[split]
    try:
        pairs = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"{path}: unreadable ETO task list ({err})") from None
    ids: list[str] = []
    for pair in pairs:
        if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[1], int)):
            raise ValueError(f"{path}: expected [task_name, variation] pairs, found {pair!r}")
        ids.append(task_id(eto_task_name(pair[0]), pair[1]))
    return tuple(ids)


def eto_tasks(split: str, data_root: str | Path | None = None) -> list[str]:
    """Task ids of an ETO split, in the order of ETO's file."""
    if split not in ETO_SPLITS:
        raise ValueError(f"ScienceWorld ETO split {split!r}: expected one of {', '.join(ETO_SPLITS)}")
    return list(_eto_split(str(_data_folder(data_root)), split))


@functools.lru_cache(maxsize=8)
def _eto_max_steps(folder: str) -> dict[str, int]:
    path = Path(folder) / ETO_MAX_STEPS_FILE
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"{path}: unreadable ETO max-steps file ({err})") from None
    return {eto_task_name(name): int(steps) for name, steps in raw.items()}


def eto_max_turns(data_root: str | Path | None = None) -> dict[str, int]:
    """Task name -> ETO's maximum number of agent turns (10-120), for the 24 ETO task types."""
    return dict(_eto_max_steps(str(_data_folder(data_root))))
