"""The ALFWorld turn judge: valid actions that serve the task, and valid actions that are useless for it.

ALFWorld names the task in each game's folder, ``<task type>-<Object>-<Recep>-<Parent>-<scene>``
(e.g. ``pick_clean_then_place_in_recep-Mug-None-CoffeeMachine-10``): the kind of object to bring, and
the kind of receptacle it must end in (for ``look_at_obj_in_light``, the lamp to look at it under). That
is a cheap oracle for the actions that name objects. A turn is judged when the environment accepted it
(a rejected one, "Nothing happens.", is not "valid but useless", it is invalid) and it is

- ``take``: correct when it takes an object of the task's kind; taking anything else is useless;
- ``move`` (``move X to Y``, or the older ``put X in/on Y``): correct when it puts an object of the
  task's kind into a receptacle of the task's kind; any other placement, and any placement in a
  ``look_at_obj_in_light`` task, is useless;
- ``transform`` (``clean``/``heat``/``cool X with Y``): correct when the task asks for that change
  and X is of the task's kind;
- ``use`` (a lamp): correct in a ``look_at_obj_in_light`` task on a lamp of the task's kind, useless
  in every other task.

Moving around (``go to``), opening, closing, examining, ``look`` and ``inventory`` are not judged:
whether they help depends on where things are, which the folder name does not say. Neither is the
order of the steps: a placement of the right object in the right receptacle before it was cleaned
counts as correct here.
"""

from __future__ import annotations

import re

from qevolve.buffer.store import Episode

__all__ = ["TAKE", "MOVE", "TRANSFORM", "USE", "TaskGoal", "task_goal", "judge_turns", "alfworld_turn_judge"]

TAKE, MOVE, TRANSFORM, USE = "take", "move", "transform", "use"
LOOK_AT = "look_at_obj_in_light"
_CHANGE_OF = {"pick_clean_then_place_in_recep": "clean", "pick_heat_then_place_in_recep": "heat",
              "pick_cool_then_place_in_recep": "cool"}
_TAKE_RE = re.compile(r"^take (\S+) \d+ from .+$")
_MOVE_RE = re.compile(r"^(?:move (\S+) \d+ to|put (\S+) \d+ (?:in/on|in|on)) (\S+) \d+$")
_TRANSFORM_RE = re.compile(r"^(clean|heat|cool) (\S+) \d+ with .+$")
_USE_RE = re.compile(r"^use (\S+) \d+$")


class TaskGoal:
    """What a game's folder name says: its task type, the object kind and the receptacle kind (lower case,
    as the game's text names them: ``CoffeeMachine`` -> ``coffeemachine``)."""

    def __init__(self, task_type: str, target: str, receptacle: str):
        self.task_type, self.target, self.receptacle = task_type, target, receptacle

    def __repr__(self) -> str:
        return f"TaskGoal({self.task_type!r}, {self.target!r}, {self.receptacle!r})"


def task_goal(task_id: str) -> TaskGoal:
    """The goal of an ALFWorld task id (``<task type>-<Object>-<Recep>-<Parent>-<scene>/<trial>``)."""
    parts = task_id.split("/", 1)[0].split("-")
    if len(parts) != 5:
        raise ValueError(f"ALFWorld task {task_id!r}: expected a game folder named "
                         "<task type>-<Object>-<Recep>-<Parent>-<scene>")
    return TaskGoal(parts[0], parts[1].lower(), parts[3].lower())


def judge_turns(episode: Episode, goal: TaskGoal) -> list[tuple[str, bool] | None]:
    """One verdict per turn of ``episode`` played for ``goal`` (see the module)."""
    verdicts: list[tuple[str, bool] | None] = []
    for turn in episode.turns:
        action = (turn.action or "").strip().lower() if turn.format_valid and turn.action_valid else ""
        verdict = None
        if match := _TAKE_RE.match(action):
            verdict = (TAKE, match.group(1) == goal.target)
        elif match := _MOVE_RE.match(action):
            moved = match.group(1) or match.group(2)
            verdict = (MOVE, goal.task_type != LOOK_AT and moved == goal.target
                       and match.group(3) == goal.receptacle)
        elif match := _TRANSFORM_RE.match(action):
            verdict = (TRANSFORM, _CHANGE_OF.get(goal.task_type) == match.group(1) and match.group(2) == goal.target)
        elif match := _USE_RE.match(action):
            verdict = (USE, goal.task_type == LOOK_AT and match.group(1) == goal.receptacle)
        verdicts.append(verdict)
    return verdicts


def alfworld_turn_judge():
    """The judge of ALFWorld episodes: everything it needs is in each episode's task id."""
    def judge(episode: Episode) -> list[tuple[str, bool] | None]:
        return judge_turns(episode, task_goal(episode.task_id))

    return judge
