"""The ScienceWorld adapter over ``scienceworld==1.2.3``: one simulator JVM per instance, reused.

The simulator is a Scala program behind a py4j gateway. Each :class:`SciWorldEnv` starts its own
JVM lazily (on the first ``reset`` or when a split has to be listed by the simulator), with a
bounded heap (``-Xmx``; the default heap grows to 1.3-4.4 GiB per simulator, 512 MiB costs no
speed), and keeps it for every later episode: a new task is a ``load`` into the same JVM (0.03-0.3 s)
instead of a new JVM (2-3.5 s). ``close()`` ends the JVM; the JVM is also started with py4j's
"die when the parent's pipe breaks" flag, so a killed worker leaves no JVM behind.

The fast step path: the package's ``ScienceWorldEnv.step`` also lists every valid action of the
new state (up to thousands of strings, 40 ms-1 s) and looks around, takes the inventory and the
task description on every step. Here a step is one ``server.step`` plus ``getScore`` and
``getCompleted``; valid actions are listed only by :meth:`SciWorldEnv.admissible_actions`.

Reward (the ETO protocol): the episode's reward is the best score reached so far / 100, and 0 once
the simulator's score turns negative (which ends the episode). ``info["score"]`` carries it after
every step. ``StepResult.reward`` is the method's sparse r_env: 0 on every step but the one that
ends the episode, which gets the final ``info["score"]`` (a truncated episode gets it on its last
turn from the runner, see :func:`qevolve.buffer.store.settle_final_reward`). The per-step change of
the score is ``info["score_delta"]``. ``info["won"]`` is True once the score reached 100.
"""

from __future__ import annotations

import functools
import subprocess
import threading
from pathlib import Path
from typing import Any

from pydantic import Field

from qevolve.config import StageConfig, build_config
from qevolve.environments.base import Environment, StepResult, register_environment
from qevolve.environments.sciworld.prompt import SCIWORLD_INSTRUCTION
from qevolve.environments.sciworld.tasks import (
    DATA_FILES, ETO_SPLITS, OFFICIAL_SPLITS, SPLITS, TASK_NAMES, eto_max_turns, eto_tasks, parse_task_id, task_id,
)

#: Answers of the simulator's input parser to an action it cannot read (found by experiment:
#: an unparsable or unknown command, a referent that does not exist here, or an answer to an
#: "Ambiguous request" question that is not one of the offered numbers). An ambiguous request
#: itself is a valid action (the simulator asks which object was meant).
INVALID_ACTION_PREFIXES = (
    "No known action matches that input.",
    "Unknown action.",
    "ERROR: Unknown response",
    "ERROR: Value out of range",
)
FIRST_LOOK = "look around"  # the package's own reset also starts with this move


def is_invalid_answer(observation: str) -> bool:
    return observation.lstrip().startswith(INVALID_ACTION_PREFIXES)


class SciWorldConfig(StageConfig):
    """Settings of a ScienceWorld environment (keyword arguments of ``make_environment("sciworld")``)."""

    split: str = Field("train", description="the split this environment plays (for logs and checks; task ids "
                       "are global): train, seen, unseen, seen_not_train (ETO protocol) or official_train, "
                       "official_dev, official_test (the simulator's variation splits of all 30 tasks)")
    simplification: str = Field("easy", description="ScienceWorld simplification string (the ETO protocol uses "
                                "'easy'; '' for none, or a comma list such as 'teleportAction,openDoors')")
    jvm_heap_mb: int = Field(512, ge=64, description="maximum Java heap of the simulator (-Xmx), MiB")
    jvm_options: list[str] = Field(default_factory=list, description="extra JVM options, e.g. ['-XX:+UseSerialGC']")
    java_path: str | None = Field(None, description="java executable (default: $JAVA_HOME/bin/java, else PATH)")
    max_turns: int | None = Field(None, ge=1, description="turn limit for every task (default: ETO's per-task "
                                  "limits, see default_max_turns for the other tasks)")
    default_max_turns: int = Field(100, ge=1, description="turn limit of the 6 tasks ETO has no limit for")
    task_names: list[str] | None = Field(None, description="only list tasks of these task names (any split)")
    data_root: str | None = Field(None, description="folder of the installed ETO lists (default: the data dir)")
    close_timeout: float = Field(5.0, gt=0, description="seconds to wait for the JVM to exit before killing it")


_LAUNCH_LOCK = threading.Lock()


def start_simulator(heap_mb: int, extra_options: list[str], java_path: str):
    """A stock ``ScienceWorldEnv`` whose JVM gets a bounded heap and the given java executable.

    The package builds its gateway with ``launch_gateway(...)`` and no way to pass JVM options, so
    its module-level reference is wrapped for the duration of the constructor (under a lock).
    """
    import scienceworld.scienceworld as sw_module

    with _LAUNCH_LOCK:
        stock_launch = sw_module.launch_gateway
        sw_module.launch_gateway = functools.partial(
            stock_launch, javaopts=[f"-Xmx{heap_mb}m", *extra_options], java_path=java_path)
        try:
            # envStepLimit: the package's own step ends episodes after N moves; turns are counted here
            return sw_module.ScienceWorldEnv("", envStepLimit=10**9)
        finally:
            sw_module.launch_gateway = stock_launch


@register_environment("sciworld")
class SciWorldEnv(Environment):
    """ScienceWorld text tasks; task ids ``"<task_name>/<variation>"`` (see :mod:`.tasks`)."""

    name = "sciworld"
    turn_format = "action"  # the gold-path demonstrations (experts.py replay) are Action:-only turns
    instruction = SCIWORLD_INSTRUCTION
    # r_aux of the critic's reward: the paper's table (docs/method.md, section 3)
    retrospective_penalties = {"format_error": -0.3, "invalid_action": -0.2, "repeat": -0.1}
    data_files = DATA_FILES

    def __init__(self, **settings: Any):
        self.config = build_config(SciWorldConfig, settings, "sciworld environment")
        if self.config.split not in SPLITS:
            raise ValueError(f"sciworld split {self.config.split!r}: expected one of {', '.join(SPLITS)}")
        for name in self.config.task_names or []:
            if name not in TASK_NAMES:
                raise ValueError(f"sciworld task_names: unknown task {name!r}; known: {', '.join(TASK_NAMES)}")
        from qevolve.environments.sciworld.java import check_java  # lazy: see the package docstring

        # Checked here, in whichever process builds the environment, so a missing Java runtime is
        # one clear error before any work starts (not a failure of every episode in the workers).
        self._java = check_java(self.config.java_path).path
        self._simulator = None  # the package's ScienceWorldEnv, started on first use
        self._max_variations: dict[str, int] = {}
        self._official: dict[str, list[str]] = {}
        self._eto_limits = eto_max_turns(self.config.data_root)
        self._gold_requested = False
        self._task: tuple[str, int] | None = None
        self._gold: list[str] | None = None
        self._first_look = ""
        self._turns = 0
        self._best_score = 0  # best simulator score of the episode, 0..100
        self._failed = False  # the simulator score went negative

    # -- the simulator process -----------------------------------------------------------------

    @property
    def simulator(self):
        """The package's ``ScienceWorldEnv`` (started if needed); its ``server`` is the JVM object."""
        if self._simulator is not None and self._simulator._gateway.java_process.poll() is not None:
            self._discard_simulator()  # the JVM died: start a fresh one
        if self._simulator is None:
            self._simulator = start_simulator(self.config.jvm_heap_mb, self.config.jvm_options, self._java)
        return self._simulator

    @property
    def _server(self):
        return self.simulator.server

    def jvm_pid(self) -> int | None:
        """Process id of this environment's JVM (None before it started)."""
        return self._simulator._gateway.java_process.pid if self._simulator is not None else None

    def jvm_resident_mb(self) -> float | None:
        """Resident memory of the JVM in MiB, from /proc (None where unavailable)."""
        pid = self.jvm_pid()
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        except (OSError, TypeError):
            pass
        return None

    def _discard_simulator(self) -> None:
        simulator, self._simulator = self._simulator, None
        if simulator is None:
            return
        self._task = None  # a new JVM has nothing loaded
        process: subprocess.Popen = simulator._gateway.java_process
        try:
            simulator.close()  # gateway shutdown plus the newline that makes the JVM exit
        except Exception:
            pass
        simulator.close = lambda: None  # its __del__ would close again
        try:
            process.wait(timeout=self.config.close_timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=self.config.close_timeout)

    def close(self) -> None:
        self._discard_simulator()

    def __del__(self):
        try:
            self._discard_simulator()
        except Exception:
            pass

    # -- tasks ---------------------------------------------------------------------------------

    def tasks(self, split: str) -> list[str]:
        if split in ETO_SPLITS:
            ids = eto_tasks(split, self.config.data_root)
        elif split in OFFICIAL_SPLITS:
            ids = self._official_split(split)
        else:
            raise ValueError(f"sciworld split {split!r}: expected one of {', '.join(SPLITS)}")
        if self.config.task_names is not None:
            wanted = set(self.config.task_names)
            ids = [t for t in ids if parse_task_id(t)[0] in wanted]
        return ids

    def _official_split(self, split: str) -> list[str]:
        """The simulator's own train/dev/test variations of all 30 tasks (listed once per instance)."""
        if not self._official:
            server = self._server
            lists: dict[str, list[str]] = {s: [] for s in OFFICIAL_SPLITS}
            for name in TASK_NAMES:
                server.load(name, 0, "", False)
                lists["official_train"] += [task_id(name, v) for v in server.getVariationsTrain()]
                lists["official_dev"] += [task_id(name, v) for v in server.getVariationsDev()]
                lists["official_test"] += [task_id(name, v) for v in server.getVariationsTest()]
            self._official = lists
            self._task = None  # the listing loaded other tasks
        return list(self._official[split])

    def max_turns(self, task_id: str | None = None) -> int:
        if self.config.max_turns is not None:
            return self.config.max_turns
        if task_id is None:
            return self.config.default_max_turns
        return self._eto_limits.get(parse_task_id(task_id)[0], self.config.default_max_turns)

    # -- episodes ------------------------------------------------------------------------------

    def request_gold_path(self) -> None:
        """Make the next ``reset`` also generate the simulator's gold action sequence (slower load)."""
        self._gold_requested = True

    def reset(self, task_id: str) -> str:
        name, variation = parse_task_id(task_id)
        server = self._server
        if name not in self._max_variations:
            self._max_variations[name] = int(server.getTaskMaxVariations(name))
        if variation >= self._max_variations[name]:
            raise ValueError(f"ScienceWorld task id {task_id!r}: task {name!r} has variations "
                             f"0..{self._max_variations[name] - 1}")
        with_gold, self._gold_requested = self._gold_requested, False
        # A load alone puts the world in its initial state (checked: same first observation and
        # same gold-path score as the package's load + reset, which costs a second load).
        server.load(name, variation, self.config.simplification, with_gold)
        self._gold = list(server.getGoldActionSequence()) if with_gold else None
        self._task = (name, variation)
        self._turns = 0
        self._best_score = 0
        self._failed = False
        self._first_look = server.step(FIRST_LOOK)
        return f"{server.freeActionTaskDesc().strip()}\n\n{self._first_look.strip()}"

    def step(self, action: str) -> StepResult:
        if self._task is None:
            raise RuntimeError("step() before reset()")
        server = self._server
        observation = server.step(action.strip())
        sim_score = int(round(100 * server.getScore()))
        completed = bool(server.getCompleted())
        self._turns += 1
        before = self.episode_reward()
        if sim_score < 0:
            self._failed = True  # a failed task: the episode ends with reward 0
        else:
            self._best_score = max(self._best_score, sim_score)
        reward_now = self.episode_reward()
        won = not self._failed and self._best_score >= 100
        done = completed or self._failed or won
        info = {"won": won, "score": reward_now, "score_delta": reward_now - before,
                "valid_action": not is_invalid_answer(observation), "sim_score": sim_score}
        # sparse r_env (method section 1): 0 until the end, then the final score
        return StepResult(observation.strip(), reward_now if done else 0.0, done, info)

    def episode_reward(self) -> float:
        """The ETO reward of the episode so far: best score / 100, or 0 after a negative score."""
        return 0.0 if self._failed else self._best_score / 100.0

    def admissible_actions(self) -> list[str]:
        """Every valid action-object combination of the current state (can be thousands; slow)."""
        if self._task is None:
            raise RuntimeError("admissible_actions() before reset()")
        return list(self._server.getValidActionObjectCombinations())

    def expert_actions(self) -> list[str]:
        """The simulator's gold action sequence for the current variation.

        Generated at load time: call :meth:`request_gold_path` before ``reset`` (what the gold-path
        policy does). Asked for later, before any step, the task is reloaded with its gold path;
        that is refused for tasks whose initial state is random (the reloaded world would not be
        the one already shown).
        """
        if self._task is None:
            raise RuntimeError("expert_actions() before reset()")
        if self._gold is None:
            if self._turns:
                raise RuntimeError("the gold path must be requested before the first step "
                                   "(call request_gold_path() before reset())")
            name, variation = self._task
            server = self._server
            server.load(name, variation, self.config.simplification, True)
            self._gold = list(server.getGoldActionSequence())
            look = server.step(FIRST_LOOK)
            # Loads list the objects of a room in varying order: compare the lines as a multiset.
            if sorted(look.splitlines()) != sorted(self._first_look.splitlines()):
                raise RuntimeError(f"{task_id(name, variation)}: the world reloaded with its gold path differs "
                                   "from the one shown; call request_gold_path() before reset()")
        return list(self._gold)
