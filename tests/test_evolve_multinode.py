"""``qevolve evolve`` over two nodes (``distributed.nnodes=2``): one machine pretending to be two (CPU, gloo).

Node 0 is ``run_evolve`` in the test process; node 1 is ``python -m qevolve.cli evolve --config FILE
--node-rank 1``, a follower that joins every training stage through torch's static rendezvous at
127.0.0.1 on a free port, one process per node (a world of two ranks, as ``nproc_per_node=2`` on one
node). On the tiny run of tests/evolve_launch.py (BC, one iteration and the rft baseline):

* the run finishes, the follower exits 0, and the trajectories and weights equal the in-process
  run's within the tolerance of the two-process tests (tests/test_evolve_distributed.py);
* the follower killed in a step of bc fails node 0's stage with one line naming the stage and the
  follower's rank, leaves no process behind on either "node", and node 0's ``--resume`` with the
  follower started again finishes the run;
* nnodes above 1 without master_addr, and a follower's options node 0 alone takes, are one-line errors;
* node 0's heartbeat keeps a waiting follower waiting, and its end (node 0 killed) ends the follower.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from evolve_launch import (TRAINING, install_fault_hook, WEIGHT_TOL, assert_same_trajectories, processes_mentioning, stages,
                           tiny_config, wait_until, weights)

from qevolve.evolve.loop import recorded_config, run_evolve
from qevolve.evolve.nodes import LAUNCH
from qevolve.evolve.stage_worker import StageFailedError

pytest.importorskip("accelerate", reason="multi-process training needs accelerate")

PACKAGE = Path(__file__).resolve().parents[1] / "src"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def two_node_config(runs: Path, counter_experts: Path, tiny_model_dir: Path, *extra: str):
    return tiny_config(runs, counter_experts, tiny_model_dir, "distributed.nnodes=2",
                       "distributed.master_addr=127.0.0.1", f"distributed.master_port={free_port()}",
                       "distributed.join_timeout_s=120", *extra)


def start_follower(config, folder: Path, log_name: str) -> tuple[subprocess.Popen, Path]:
    """Node 1: ``qevolve evolve --config FILE --node-rank 1`` on the config node 0 runs; its output goes to a file."""
    path = folder / "node-config.yaml"
    path.write_text(yaml.safe_dump(recorded_config(config)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(PACKAGE), os.environ.get("PYTHONPATH", "")]))
    log = folder / log_name
    with log.open("w") as out:
        process = subprocess.Popen([sys.executable, "-m", "qevolve.cli", "evolve", "--config", str(path),
                                    "--node-rank", "1"], env=env, stdout=out, stderr=subprocess.STDOUT)
    return process, log


def test_two_nodes_run_the_loop_and_give_the_two_process_results(evolve_reference_run, counter_experts,
                                                                 tiny_model_dir, tmp_path):
    config = two_node_config(tmp_path / "runs", counter_experts, tiny_model_dir)
    follower, follower_log = start_follower(config, tmp_path, "node1.log")
    messages: list[str] = []
    try:
        run_evolve(config, log=messages.append)
        assert follower.wait(timeout=120) == 0, follower_log.read_text()
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.wait()
    root = tmp_path / "runs" / "run"
    assert sum("2 nodes x 1 processes: python -m torch.distributed.run --nnodes 2 --node_rank 0" in line
               for line in messages) == len(TRAINING)
    assert follower_log.read_text().count("joining launch") == len(TRAINING)
    two, one = stages(root), stages(evolve_reference_run)
    assert list(two) == list(one)
    for name in two:
        assert two[name]["inputs"] == one[name]["inputs"] and two[name]["outputs"] == one[name]["outputs"], name
    for name in ("iter_1/rollouts", "iter_1/eval_seen", "iter_1/rft/eval_seen"):
        trajectories = two[name]["outputs"]["trajectories"]
        assert_same_trajectories(root / trajectories, evolve_reference_run / trajectories)
    for name in ("bc", "iter_1/policy", "iter_1/rft/policy"):
        got, want = weights(root / name / "final"), weights(evolve_reference_run / name / "final")
        assert list(got) == list(want)
        for key in want:
            torch.testing.assert_close(got[key], want[key], **WEIGHT_TOL, msg=lambda m, key=key: f"{name} {key}: {m}")
    assert yaml.safe_load((root / LAUNCH).read_text())["state"] == "finished"
    assert not processes_mentioning(str(tmp_path))


def test_a_killed_follower_fails_the_stage_on_one_line_and_resume_finishes_it(counter_experts, tiny_model_dir,
                                                                               tmp_path, monkeypatch):
    fired = install_fault_hook(tmp_path, monkeypatch, "kill_node")
    # bc: 3 steps, a checkpoint after each; rank 1 (node 1's only rank) kills its follower in step 2
    config = two_node_config(tmp_path / "runs", counter_experts, tiny_model_dir, "iterations=0", "baselines=[]",
                             "bc.max_steps=3")
    root = tmp_path / "runs" / "run"
    follower, follower_log = start_follower(config, tmp_path, "node1.log")
    try:
        with pytest.raises(StageFailedError) as failed:
            run_evolve(config, log=lambda line: None)
        assert follower.wait(timeout=60) == -9
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.wait()
    assert str(failed.value) == "stage bc: rank 1 of 2 failed: node 1's launcher was stopped by SIGTERM"
    assert os.listdir(fired) == ["0"]
    assert wait_until(lambda: not processes_mentioning(str(tmp_path))), processes_mentioning(str(tmp_path))
    assert yaml.safe_load((root / LAUNCH).read_text())["state"] == "stopped"
    # node 0 resumed, node 1 started again with the same command
    follower, follower_log = start_follower(config, tmp_path, "node1-again.log")
    messages: list[str] = []
    try:
        run_evolve(config, resume=True, log=messages.append)
        assert follower.wait(timeout=120) == 0, follower_log.read_text()
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.wait()
    assert any(line.startswith("[bc] continuing the unfinished stage") for line in messages), messages
    assert list(stages(root)) == ["bc", "bc/eval_seen"]
    assert stages(root)["bc"]["metrics"]["steps"] == 3
    assert not processes_mentioning(str(tmp_path))


def test_a_run_over_nodes_needs_master_addr_and_a_follower_takes_no_run_options(counter_experts, tiny_model_dir,
                                                                                tmp_path):
    from typer.testing import CliRunner

    from qevolve.cli import app
    from qevolve.config import ConfigError

    with pytest.raises(ConfigError) as error:
        tiny_config(tmp_path, counter_experts, tiny_model_dir, "distributed.nnodes=2")
    assert "nnodes=2 needs master_addr: the host of node 0, reachable from every node" in str(error.value)
    assert "\n" not in str(error.value).strip()
    with pytest.raises(ConfigError, match="master_port=0"):
        tiny_config(tmp_path, counter_experts, tiny_model_dir, "distributed.master_port=0")
    config = two_node_config(tmp_path, counter_experts, tiny_model_dir)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(recorded_config(config)))
    runner = CliRunner()
    result = runner.invoke(app, ["evolve", "--config", str(path), "--node-rank", "1", "--resume"])
    assert result.exit_code == 2 and "--resume: give it to node 0's command only" in result.output
    result = runner.invoke(app, ["evolve", "--config", str(path), "--node-rank", "2"])
    assert result.exit_code == 1 and "--node-rank 2: expected 1 to 1 for a follower" in result.output
    # the dry run shows how each training stage runs
    result = runner.invoke(app, ["evolve", "--config", str(path), "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "bc  (training: 2 nodes x 1 process)" in result.output


def test_node_0_beats_while_its_run_goes_and_a_waiting_follower_ends_when_the_beats_stop(
        counter_experts, tiny_model_dir, tmp_path):
    """Node 0 advances a heartbeat in its launch file until its run ends; a follower waiting between stages
    ends with one line when the heartbeat stops moving (node 0 killed without ending its run), measured by
    its own clock; a run that ends normally ends the follower normally."""
    import json
    import threading
    import time

    from qevolve.evolve.nodes import FollowerError, LaunchAnnouncer, follow, run_root

    config = two_node_config(tmp_path, counter_experts, tiny_model_dir, "distributed.heartbeat_timeout_s=1")
    root = run_root(config)
    root.mkdir(parents=True)
    announcer = LaunchAnnouncer(root, beat_s=0.05)
    assert wait_until(lambda: json.loads((root / LAUNCH).read_text())["beat"] >= 3, timeout_s=10)
    # a follower waits through the beats and ends when node 0's run finishes
    messages: list[str] = []
    ender = threading.Timer(1.5, announcer.end, args=(True,))  # longer than the timeout: the beats kept it waiting
    ender.start()
    follow(config, 1, log=messages.append, poll_s=0.02)
    ender.join()
    assert messages[-1] == "node 1: node 0's run finished"
    state = json.loads((root / LAUNCH).read_text())
    time.sleep(0.2)
    assert json.loads((root / LAUNCH).read_text()) == state  # no beat after the end
    # node 0 "killed": a running launch file whose heartbeat no longer moves
    (root / LAUNCH).write_text(json.dumps({**state, "session": "killed", "state": "running"}))
    start = time.monotonic()
    with pytest.raises(FollowerError) as error:
        follow(config, 1, log=messages.append, poll_s=0.02)
    assert 1.0 <= time.monotonic() - start < 10
    message = str(error.value)
    assert message.startswith("node 0 gave no sign of life for 1 s") and "\n" not in message
    assert "heartbeat_timeout_s=1): it was killed or lost without ending its run" in message
    from qevolve.config import ConfigError

    with pytest.raises(ConfigError, match="heartbeat_timeout_s=0.5: expected at least 1 second"):
        two_node_config(tmp_path, counter_experts, tiny_model_dir, "distributed.heartbeat_timeout_s=0.5")
