"""What the online baselines' tests share (GRPO and PPO): a run of the tiny loop in this process, its
manifest's stages, and the check that over its rounds on the one-decision environment the recipe learned
the rewarded action and its row counts the env steps of its rounds."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from qevolve.buffer.store import read_episodes
from qevolve.config import load_config
from qevolve.evolve.loop import EvolveConfig, run_evolve


def run_in_process(overrides: list[str], root: Path, name: str = "run") -> tuple[Path, list[dict[str, Any]], list[str]]:
    """``qevolve evolve`` with these overrides under ``root``: the run folder, the printed table's rows and the
    log lines."""
    config = load_config(EvolveConfig, None, [*overrides, f"runs_dir={root}", f"name={name}"])
    messages: list[str] = []
    table = run_evolve(config, log=messages.append)
    return root / name, table, messages


def stages_of(run: Path) -> dict[str, dict[str, Any]]:
    """The run's manifest stages by name, in the order they ran."""
    return {stage["name"]: stage for stage in json.loads((run / "manifest.json").read_text())["stages"]}


def assert_rounds_learned_and_counted(run: Path, stages: dict[str, Any], table: list[dict[str, Any]],
                                      messages: list[str], recipe: str, label: str, rounds: int) -> None:
    """``recipe``: the stage folder (``grpo``); ``label``: its row in the tables (``GRPO``)."""
    from qevolve.evaluation.compare import compare_runs

    rollouts = [stages[f"iter_1/{recipe}/round_{r}/rollouts"]["metrics"] for r in range(1, rounds + 1)]
    # the policy learned to say the rewarded direction: success of the rounds' own rollouts rose
    success = [metrics["success_rate"] for metrics in rollouts]
    assert success[0] < 0.45 and success[-1] >= success[0] + 0.25, success
    assert rollouts[-1]["mean_reward"] > rollouts[0]["mean_reward"]

    def right_share(r: int) -> float:
        said = Counter(t.action for ep in read_episodes(run / f"iter_1/{recipe}/round_{r}/rollouts") for t in ep.turns)
        return said["right"] / sum(said.values())

    assert right_share(rounds) > right_share(1) + 0.2
    # the recipe's row, with the env steps of all its rounds' rollouts (not its evaluation's)
    spent = sum(metrics["env_steps"] for metrics in rollouts)
    assert {row["policy"]: row["env_steps"] for row in table} == {
        "BC": 0, "Q-Evolve iter 1": stages["iter_1/rollouts"]["metrics"]["env_steps"], label: spent}
    assert f"[iter_1/{recipe}] {rounds} rounds, {spent} env steps" in messages
    rows = {row["method"]: row for row in compare_runs([run], resamples=100)["rows"]}
    assert rows[label]["env_steps"] == spent and rows["SFT (BC)"]["env_steps"] == 0
