"""benchmarks/eval_backends.py's comparison of two evaluations: identical turns, where they first differ, and
the log-prob gap over the turns both generated alike (no backend is run here)."""

from __future__ import annotations

from pathlib import Path

import pytest

from qevolve.buffer.store import Episode, Turn, write_episodes


def _episode(episode_id: str, turns: list[tuple[list[int], list[float]]]) -> Episode:
    return Episode(episode_id=episode_id, task_id=episode_id, env="webshop", split="test", source="self",
                   turns=[Turn(observation="o", agent_text="a", action="a", action_ids=ids, action_logprobs=lps)
                          for ids, lps in turns])


def _write(folder: Path, episodes: list[Episode]) -> Path:
    write_episodes(folder / "trajectories" / "part-00000.parquet", episodes)
    return folder


def test_compare_counts_identical_turns_and_stops_an_episode_at_its_first_difference(tmp_path, benchmark_module):
    bench = benchmark_module("eval_backends")
    first = _write(tmp_path / "hf", [
        _episode("e1", [([1, 2], [-0.5, -0.25]), ([3], [-1.0])]),
        _episode("e2", [([4], [-0.1]), ([5, 6], [-0.2, -0.3]), ([7], [-0.4])]),
    ])
    second = _write(tmp_path / "vllm", [
        _episode("e1", [([1, 2], [-0.5, -0.2]), ([3], [-1.0])]),  # same tokens, log-probs 0.05 apart
        _episode("e2", [([4], [-0.1]), ([5, 9], [-0.2, -0.3]), ([7], [-0.4])]),  # differs at its turn 1
    ])
    result = bench.compare(first, second)
    assert result["episodes"] == 2 and result["identical_episodes"] == 1
    # e1: 2 turns alike; e2: turn 0 alike, turn 1 differs, and the turns after it are not compared
    assert result["turns_compared"] == 4 and result["identical_turns"] == 3
    assert result["first_difference"] == ("e2", 1)
    assert result["max_logprob_difference"] == pytest.approx(0.05)


def test_compare_refuses_evaluations_of_different_episodes(tmp_path, benchmark_module):
    bench = benchmark_module("eval_backends")
    first = _write(tmp_path / "hf", [_episode("e1", [([1], [-0.5])])])
    second = _write(tmp_path / "vllm", [_episode("e2", [([1], [-0.5])])])
    with pytest.raises(SystemExit, match="different episodes"):
        bench.compare(first, second)
