"""Selecting tasks by type: the protocol lever of the CPU configs (e.g. ALFWorld pick/look tasks)."""

import pytest

from qevolve.environments.alfworld.env import task_type
from qevolve.environments.experts import filter_task_types
from qevolve.environments.play import list_tasks


def test_alfworld_tasks_filtered_by_type(alfworld_installed):
    tasks = list_tasks("alfworld", "seen")
    picked = filter_task_types("alfworld", tasks, ["pick_and_place_simple", "look_at_obj_in_light"])
    assert picked and len(picked) < len(tasks)
    assert {task_type(t) for t in picked} == {"pick_and_place_simple", "look_at_obj_in_light"}
    assert picked == [t for t in tasks if t in set(picked)]  # order kept
    assert filter_task_types("alfworld", tasks, None) == tasks


def test_unknown_task_type_names_it_and_the_known_ones(alfworld_installed):
    tasks = list_tasks("alfworld", "seen")
    with pytest.raises(ValueError, match=r"rollout.task_types: alfworld has no task type 'pick_and_plce'.*"
                                         r"pick_and_place_simple"):
        filter_task_types("alfworld", tasks, ["pick_and_plce"], "rollout.task_types")
