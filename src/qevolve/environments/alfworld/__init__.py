"""ALFWorld (text, TextWorld engine) over ``alfworld==0.4.2`` and the pinned games of json_2.1.1."""

from qevolve.environments.alfworld.env import AlfWorldEnv, alfworld_tasks, task_type
from qevolve.environments.alfworld.expert import alfworld_expert_jobs
from qevolve.environments.alfworld.judge import alfworld_turn_judge
from qevolve.environments.experts import register_expert_source
from qevolve.environments.judges import register_turn_judge

register_expert_source("alfworld", task_type=task_type)(alfworld_expert_jobs)
# the label audit's judge: valid actions that serve the task or are useless for it (qevolve data label-audit)
register_turn_judge("alfworld", alfworld_turn_judge)

__all__ = ["AlfWorldEnv", "alfworld_tasks", "alfworld_expert_jobs", "task_type"]
