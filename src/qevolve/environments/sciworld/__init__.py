"""ScienceWorld (a Scala simulator behind py4j) over ``scienceworld==1.2.3``, ETO protocol by default.

Task ids are ``"<task_name>/<variation>"`` (e.g. ``"boil/3"``); see :mod:`.tasks` for the splits.
Needs a Java runtime: :func:`qevolve.environments.sciworld.java.check_java` (not imported here, so
``python -m qevolve.environments.sciworld.java`` runs it cleanly).
"""

from qevolve.environments.experts import register_expert_source
from qevolve.environments.play import register_play_policy
from qevolve.environments.sciworld.env import SciWorldConfig, SciWorldEnv, is_invalid_answer
from qevolve.environments.sciworld.expert import GoldPathPolicy, expert_retries, sciworld_expert_jobs
from qevolve.environments.sciworld.tasks import SPLITS, TASK_NAMES, eto_tasks, parse_task_id, task_type

register_expert_source("sciworld", task_type=task_type, retries=expert_retries)(sciworld_expert_jobs)
# "walkthrough" in ScienceWorld is the gold path, which must be asked for before the reset.
register_play_policy("sciworld", "walkthrough", lambda seed: GoldPathPolicy(source="walkthrough"))

__all__ = ["SciWorldEnv", "SciWorldConfig", "GoldPathPolicy", "sciworld_expert_jobs", "eto_tasks", "parse_task_id",
           "task_type", "is_invalid_answer", "SPLITS",
           "TASK_NAMES"]
