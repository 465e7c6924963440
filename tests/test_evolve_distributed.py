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

import json
import os
from pathlib import Path

import psutil
import pytest
import torch

from qevolve.buffer.store import episode_record, read_episodes, sorted_episodes, write_episodes
from qevolve.config import load_config
from qevolve.evolve import stage_worker
from qevolve.evolve.loop import EvolveConfig, run_evolve
from qevolve.evolve.stage_worker import StageFailedError

pytest.importorskip("accelerate", reason="multi-process training needs accelerate")

ENV = "qevolve.environments.testing:QuietCounterEnv"
WEIGHT_TOL = {"atol": 1e-5, "rtol": 1e-4}
LOGPROB_TOL = {"atol": 1e-4, "rtol": 1e-4}
TRAINING = ("bc", "iter_1/critic", "iter_1/policy", "iter_1/rft/policy")

# Faults of rank 1 in the second optimizer step of the launched stages' attempts, one per attempt in the order
# QEVOLVE_TEST_FAULTS lists them (raise: an exception; kill: SIGKILL); each leaves a file in QEVOLVE_TEST_FAULT_DIR
# when it fires. The hook is this sitecustomize on the ranks' PYTHONPATH.
FAULT_HOOK = '''
import os
faults, folder = os.environ.get("QEVOLVE_TEST_FAULTS"), os.environ.get("QEVOLVE_TEST_FAULT_DIR")
if faults and folder and os.environ.get("RANK") == "1" and len(os.listdir(folder)) < len(faults.split(",")):
    from qevolve.training.trainer import Trainer

    done = len(os.listdir(folder))
    kind, real, calls = faults.split(",")[done], Trainer.optimizer_step, [0]

    def optimizer_step(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] == 2:
            open(os.path.join(folder, str(done)), "w").close()
            if kind == "kill":
                os.kill(os.getpid(), 9)
            raise RuntimeError("injected fault on rank 1")
        return real(self, *args, **kwargs)

    Trainer.optimizer_step = optimizer_step
'''


@pytest.fixture(scope="module")
def experts(tmp_path_factory) -> Path:
    from qevolve.environments.episodes import EpisodeJob
    from qevolve.environments.play import play_jobs
    from qevolve.environments.policies import WalkthroughPolicy

    jobs = [EpisodeJob(f"count-{n}", WalkthroughPolicy(), split="train", episode_id=f"expert/{n}")
            for n in range(1, 6)]
    path = tmp_path_factory.mktemp("dist-evolve") / "experts.parquet"
    write_episodes(path, play_jobs(ENV, jobs, split="train", num_workers=1, progress=False).episodes)
    return path


def tiny_config(runs_dir: Path, experts: Path, model_dir: Path, *extra: str) -> EvolveConfig:
    # 2 micro-batches a step (about one sequence each): with 2 processes each rank takes one
    train = ("max_steps=2", "grad_accum_steps=2", "tokens_per_batch=256", "tensorboard=false", "save_every=1")
    overrides = [
        f"env={ENV}", "name=run", f"runs_dir={runs_dir}", "iterations=1", "baselines=[rft]", "progress=false",
        "num_threads=1", "tensorboard=false", "seed=3",
        f"model.name_or_path={model_dir}", "model.precision=fp32", "model.device=cpu",
        "prompt.max_prompt_tokens=512", "prompt.reserve_action_tokens=16", f"bc.data.train_path={experts}",
        *(f"{section}.{item}" for section in ("bc", "policy", "rft") for item in train),
        "rollout.limit=2", "rollout.agent.max_turns=3", "rollout.agent.max_new_tokens=8",
        "eval.splits=[seen]", "eval.limit=2", "eval.agent.max_turns=2", "eval.agent.max_new_tokens=8",
        f"buffer.expert_path={experts}", "critic.epochs=1", "critic.feature_cache=false", "critic.head_hidden=16",
        "critic.device=cpu", "critic.retrospective.enabled=false", "critic.checkpoint_every_steps=1",
        "critic.diagnostics.folds=0", "probe.states=0", *extra,
    ]
    return load_config(EvolveConfig, None, overrides)


def children() -> dict[int, str]:
    """The processes this test process started, still running: pid -> command line."""
    out = {}
    for child in psutil.Process().children(recursive=True):
        try:
            out[child.pid] = " ".join(child.cmdline())
        except psutil.NoSuchProcess:
            pass
    return out


def stages(root: Path) -> dict[str, dict]:
    return {stage["name"]: stage for stage in json.loads((root / "manifest.json").read_text())["stages"]}


def weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for path in sorted(folder.rglob("*.safetensors")):
        out.update({f"{path.relative_to(folder)}:{key}": value for key, value in load_file(path).items()})
    assert out, f"no weights in {folder}"
    return out


def without_logprobs(record: dict) -> tuple[dict, list[float]]:
    logprobs = [p for turn in record["turns"] for p in (turn.pop("action_logprobs", None) or [])]
    return record, logprobs


def assert_same_trajectories(a: Path, b: Path) -> None:
    left = [without_logprobs(episode_record(ep)) for ep in sorted_episodes(read_episodes(a))]
    right = [without_logprobs(episode_record(ep)) for ep in sorted_episodes(read_episodes(b))]
    assert [r for r, _ in left] == [r for r, _ in right]
    for (_, x), (_, y) in zip(left, right):
        torch.testing.assert_close(torch.tensor(x, dtype=torch.float64), torch.tensor(y, dtype=torch.float64),
                                   **LOGPROB_TOL)


@pytest.fixture(scope="module")
def in_process(experts, tiny_model_dir, tmp_path_factory) -> Path:
    runs = tmp_path_factory.mktemp("in-process")
    run_evolve(tiny_config(runs, experts, tiny_model_dir), log=lambda line: None)
    return runs / "run"


def test_the_processes_of_a_training_stage(experts, tiny_model_dir, tmp_path):
    from qevolve.config import ConfigError
    from qevolve.evolve.stages import bc_stage, critic_stage, eto_stage, policy_stage, rft_stage, stage_processes

    config = tiny_config(tmp_path, experts, tiny_model_dir, "distributed.nproc_per_node=4")
    assert config.distributed.processes() == 4
    for stage in (bc_stage, critic_stage, rft_stage):
        assert stage_processes(stage, config, {}, 4) == 4
    assert stage_processes(policy_stage, config, {"policy": config.policy}, 4) == 4
    # DPO (the eto baseline) trains in one process
    assert stage_processes(eto_stage, config, {}, 4) == 1
    if not torch.cuda.is_available():
        assert tiny_config(tmp_path, experts, tiny_model_dir, "distributed.nproc_per_node=auto").distributed.processes() == 1
    with pytest.raises(ConfigError, match="nproc_per_node"):
        tiny_config(tmp_path, experts, tiny_model_dir, "distributed.nproc_per_node=0")


def test_one_launched_process_records_what_the_evolve_process_does(in_process, experts, tiny_model_dir, tmp_path,
                                                                   monkeypatch):
    monkeypatch.setattr(stage_worker, "LAUNCH_ONE_PROCESS", True)
    messages: list[str] = []
    run_evolve(tiny_config(tmp_path, experts, tiny_model_dir, "iterations=0", "baselines=[]"), log=messages.append)
    assert any("--nproc_per_node 1 -m qevolve.evolve.stage_worker run" in line for line in messages)
    launched, reference = stages(tmp_path / "run"), stages(in_process)
    assert list(launched) == ["bc", "bc/eval_seen"]
    for name, stage in launched.items():
        assert stage == reference[name], name
    assert not list((tmp_path / "run" / "bc").glob(".stage_*"))  # the request and the result are gone


def test_two_processes_give_the_same_trajectories_and_weights_within_ddp_tolerance(in_process, experts,
                                                                                  tiny_model_dir, tmp_path):
    messages: list[str] = []
    run_evolve(tiny_config(tmp_path, experts, tiny_model_dir, "distributed.nproc_per_node=2"), log=messages.append)
    two, one = stages(tmp_path / "run"), stages(in_process)
    assert list(two) == list(one)
    assert sum("--nproc_per_node 2 -m qevolve.evolve.stage_worker run" in line for line in messages) == len(TRAINING)
    for name in two:
        assert two[name]["inputs"] == one[name]["inputs"] and two[name]["outputs"] == one[name]["outputs"], name
        assert set(two[name]["metrics"]) == set(one[name]["metrics"]), name
    for name in ("iter_1/rollouts", "bc/eval_seen", "iter_1/eval_seen", "iter_1/rft/eval_seen"):
        trajectories = two[name]["outputs"]["trajectories"]
        assert_same_trajectories(tmp_path / "run" / trajectories, in_process / trajectories)
    for name in ("bc", "iter_1/policy", "iter_1/rft/policy"):
        got, want = weights(tmp_path / "run" / name / "final"), weights(in_process / name / "final")
        assert list(got) == list(want)
        for key in want:
            torch.testing.assert_close(got[key], want[key], **WEIGHT_TOL, msg=lambda m, key=key: f"{name} {key}: {m}")
    critic = {k: v for k, v in two["iter_1/critic"]["metrics"].items() if isinstance(v, float)}
    for key, value in critic.items():
        assert value == pytest.approx(one["iter_1/critic"]["metrics"][key], rel=1e-4, abs=1e-5), key


def test_a_failing_or_killed_rank_fails_the_stage_on_one_line_and_resume_finishes_it(experts, tiny_model_dir,
                                                                                    tmp_path, monkeypatch):
    hook, fired = tmp_path / "hook", tmp_path / "fired"
    hook.mkdir()
    fired.mkdir()
    (hook / "sitecustomize.py").write_text(FAULT_HOOK)
    monkeypatch.setenv("QEVOLVE_TEST_FAULTS", "raise,kill")
    monkeypatch.setenv("QEVOLVE_TEST_FAULT_DIR", str(fired))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")]))
    # bc: 3 steps, a checkpoint after each
    config = tiny_config(tmp_path / "runs", experts, tiny_model_dir, "iterations=0", "baselines=[]",
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
