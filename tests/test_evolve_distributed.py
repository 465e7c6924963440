"""``qevolve evolve`` with ``distributed.nproc_per_node``: every training stage under torch's launcher (CPU, gloo).

On the counter testing environment with a tiny random model (BC, one iteration and the rft baseline):

* the launched path with one process records what the in-process path records, bit for bit (stage
  names, seeds, inputs, outputs, metrics and the digests of every output);
* two processes give the same trajectories (every action, observation, reward and token id; the
  acting policy's log-probabilities within float tolerance) and the same weights within the
  tolerance DDP promises against one process (tests/test_distributed.py: float32 sums in another
  order; gradients agree to atol 1e-6 / rtol 1e-4). Adam divides by the gradient's own scale, so
  weight differences stay at the same relative scale: asserted to atol 1e-5, rtol 1e-4;
* a rank that raises, or is SIGKILLed, inside a training stage fails the stage with one line naming the
  stage and the rank, leaves no process behind, and ``--resume`` continues the stage from its checkpoint.
"""

from __future__ import annotations

import os

import pytest
import torch
from evolve_launch import (TRAINING, install_fault_hook, WEIGHT_TOL, assert_same_trajectories, children, stages, tiny_config,
                           weights)

from qevolve.evolve import stage_worker
from qevolve.evolve.loop import run_evolve
from qevolve.evolve.stage_worker import StageFailedError

pytest.importorskip("accelerate", reason="multi-process training needs accelerate")


def test_the_processes_of_a_training_stage(counter_experts, tiny_model_dir, tmp_path):
    from qevolve.config import ConfigError
    from qevolve.evolve.stages import bc_stage, critic_stage, eto_stage, policy_stage, rft_stage, stage_processes

    config = tiny_config(tmp_path, counter_experts, tiny_model_dir, "distributed.nproc_per_node=4")
    assert config.distributed.processes() == 4
    for stage in (bc_stage, critic_stage, rft_stage):
        assert stage_processes(stage, config, {}, 4) == 4
    assert stage_processes(policy_stage, config, {"policy": config.policy}, 4) == 4
    # DPO (the eto baseline) trains in one process
    assert stage_processes(eto_stage, config, {}, 4) == 1
    if not torch.cuda.is_available():
        auto = tiny_config(tmp_path, counter_experts, tiny_model_dir, "distributed.nproc_per_node=auto")
        assert auto.distributed.processes() == 1
    with pytest.raises(ConfigError, match="nproc_per_node"):
        tiny_config(tmp_path, counter_experts, tiny_model_dir, "distributed.nproc_per_node=0")


def test_one_launched_process_records_what_the_evolve_process_does(evolve_reference_run, counter_experts,
                                                                   tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(stage_worker, "LAUNCH_ONE_PROCESS", True)
    messages: list[str] = []
    run_evolve(tiny_config(tmp_path, counter_experts, tiny_model_dir, "iterations=0", "baselines=[]"),
               log=messages.append)
    assert any("--nproc_per_node 1 -m qevolve.evolve.stage_worker run" in line for line in messages)
    launched, reference = stages(tmp_path / "run"), stages(evolve_reference_run)
    assert list(launched) == ["bc", "bc/eval_seen"]
    for name, stage in launched.items():
        assert stage == reference[name], name
    assert not list((tmp_path / "run" / "bc").glob(".stage_*"))  # the request and the result are gone


def test_two_processes_give_the_same_trajectories_and_weights_within_ddp_tolerance(evolve_reference_run,
                                                                                  counter_experts, tiny_model_dir,
                                                                                  tmp_path):
    messages: list[str] = []
    run_evolve(tiny_config(tmp_path, counter_experts, tiny_model_dir, "distributed.nproc_per_node=2"),
               log=messages.append)
    two, one = stages(tmp_path / "run"), stages(evolve_reference_run)
    assert list(two) == list(one)
    assert sum("--nproc_per_node 2 -m qevolve.evolve.stage_worker run" in line for line in messages) == len(TRAINING)
    for name in two:
        assert two[name]["inputs"] == one[name]["inputs"] and two[name]["outputs"] == one[name]["outputs"], name
        assert set(two[name]["metrics"]) == set(one[name]["metrics"]), name
    for name in ("iter_1/rollouts", "bc/eval_seen", "iter_1/eval_seen", "iter_1/rft/eval_seen"):
        trajectories = two[name]["outputs"]["trajectories"]
        assert_same_trajectories(tmp_path / "run" / trajectories, evolve_reference_run / trajectories)
    for name in ("bc", "iter_1/policy", "iter_1/rft/policy"):
        got, want = weights(tmp_path / "run" / name / "final"), weights(evolve_reference_run / name / "final")
        assert list(got) == list(want)
        for key in want:
            torch.testing.assert_close(got[key], want[key], **WEIGHT_TOL, msg=lambda m, key=key: f"{name} {key}: {m}")
    critic = {k: v for k, v in two["iter_1/critic"]["metrics"].items() if isinstance(v, float)}
    for key, value in critic.items():
        assert value == pytest.approx(one["iter_1/critic"]["metrics"][key], rel=1e-4, abs=1e-5), key


def test_a_failing_or_killed_rank_fails_the_stage_on_one_line_and_resume_finishes_it(counter_experts, tiny_model_dir,
                                                                                    tmp_path, monkeypatch):
    fired = install_fault_hook(tmp_path, monkeypatch, "raise,kill")
    # bc: 3 steps, a checkpoint after each
    config = tiny_config(tmp_path / "runs", counter_experts, tiny_model_dir, "iterations=0", "baselines=[]",
                         "distributed.nproc_per_node=2", "bc.max_steps=3")
    root = tmp_path / "runs" / "run"
    # (processes of this test session that outlive their fixtures, e.g. multiprocessing's resource tracker)
    before = children()
    # rank 1 raises in step 2 (rank 0 then fails in its collective: a consequence, not the cause)
    with pytest.raises(StageFailedError) as failed:
        run_evolve(config, log=lambda line: None)
    assert str(failed.value) == "stage bc: rank 1 of 2 failed: RuntimeError: injected fault on rank 1"
    assert children() == before
    # resumed from step 1, rank 1 is killed in step 3
    messages: list[str] = []
    with pytest.raises(StageFailedError) as failed:
        run_evolve(config, resume=True, log=messages.append)
    assert "[bc] continuing the unfinished stage in " + str(root / ".bc.partial") + \
        " from its checkpoint at step 1" in messages
    assert str(failed.value) == "stage bc: rank 1 of 2 failed: killed by SIGKILL (exit code -9)"
    assert children() == before
    assert sorted(os.listdir(fired)) == ["0", "1"]
    messages.clear()
    run_evolve(config, resume=True, log=messages.append)
    assert any(line.startswith("[bc] continuing the unfinished stage") and line.endswith("at step 2")
               for line in messages), messages
    assert list(stages(root)) == ["bc", "bc/eval_seen"]
    assert stages(root)["bc"]["metrics"]["steps"] == 3
    assert children() == before


def test_the_failure_named_is_the_cause_not_the_ranks_that_followed_it():
    from types import SimpleNamespace

    from qevolve.evolve.stage_worker import failure_reason, first_failure

    def failure(exitcode: int, message: str = "", timestamp: int = 100):
        return SimpleNamespace(exitcode=exitcode, message=message, timestamp=timestamp,
                               signal_name=lambda: {-9: "SIGKILL", -15: "SIGTERM"}[exitcode])

    broken = {"message": "RuntimeError: [third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
                         "[127.0.0.1]:60124: Connection reset by peer.", "extraInfo": {"timestamp": "100"}}
    # the same second: rank 0's broken collective and the launcher's SIGTERM come after rank 1's death
    assert first_failure({0: failure(1, broken), 1: failure(-9)})[0] == 1
    assert first_failure({0: failure(-15), 1: failure(-9)})[0] == 1
    assert first_failure({0: failure(-15), 1: failure(1, {"message": "ValueError: bad\nvalue"})})[0] == 1
    # two causes: the earlier one
    assert first_failure({0: failure(-9, timestamp=101), 1: failure(-9, timestamp=100)})[0] == 1
    assert failure_reason(failure(1, {"message": "ValueError: bad\nvalue"})) == "ValueError: bad value"
    assert failure_reason(failure(-9)) == "killed by SIGKILL (exit code -9)"
    assert failure_reason(failure(3, "To enable traceback see: ...")) == "exited with code 3"
