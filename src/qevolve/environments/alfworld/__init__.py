"""ALFWorld (text, TextWorld engine) over ``alfworld==0.4.2`` and the pinned games of json_2.1.1."""

from qevolve.environments.alfworld.env import AlfWorldEnv, alfworld_tasks, task_type
from qevolve.environments.alfworld.expert import alfworld_expert_jobs
from qevolve.environments.experts import register_expert_source

register_expert_source("alfworld", task_type=task_type)(alfworld_expert_jobs)

__all__ = ["AlfWorldEnv", "alfworld_tasks", "alfworld_expert_jobs", "task_type"]
