"""Multi-process training on CPU (gloo, 2 processes, tiny random models): one step with world size 2 on a
split batch gives the loss and the all-reduced gradients of world size 1 on the whole batch, and a
checkpoint made with one world size resumes with another.

Tolerance: float32 sums in another order; gradients agree to ``atol=1e-6, rtol=1e-4`` and losses to
``rtol=1e-5`` (measured differences are about 1e-8).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qevolve.buffer.store import write_episodes
from qevolve.distributed import DistributedConfig, init_distributed, shard_round_robin

pytest.importorskip("accelerate", reason="multi-process training needs accelerate")

WORKER = Path(__file__).with_name("distributed_worker.py")
GRAD_TOL = {"atol": 1e-6, "rtol": 1e-4}
LAUNCH_VARS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def launch(tmp_path: Path, name: str, spec: dict, nproc: int, launcher: str = "torchrun") -> list[dict]:
    """Run the worker in ``nproc`` processes; return every rank's dump."""
    spec = {**spec, "dump": str(tmp_path / name)}
    spec_path = tmp_path / f"{name}.json"
    spec_path.write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env["OMP_NUM_THREADS"] = "1"  # 1 thread per rank
    src = str(Path(__file__).resolve().parents[1] / "src")
    env["PYTHONPATH"] = os.pathsep.join([src, env["PYTHONPATH"]]) if env.get("PYTHONPATH") else src
    if nproc == 1:
        command = [sys.executable, str(WORKER), str(spec_path)]
    elif launcher == "torchrun":
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                   str(WORKER), str(spec_path)]
    else:
        # accelerate's --cpu picks its one-process launcher (it expects mpirun for several CPU processes);
        # --multi_gpu is its torchrun-style launcher, which works on CPUs (the stage then picks gloo)
        command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", f"--num_processes={nproc}",
                   "--num_machines=1", "--mixed_precision=no", "--dynamo_backend=no", "--main_process_port=0",
                   str(WORKER), str(spec_path)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return [torch.load(tmp_path / f"{name}.rank{r}.pt", weights_only=False) for r in range(nproc)]


def assert_same_step(one: dict, two: list[dict], steps: int | None = None) -> None:
    """World size 2 (every rank) matches world size 1: the losses, and the gradients of the first step."""
    n = steps or len(one["losses"])
    for rank in two:
        assert rank["world_size"] == 2
        torch.testing.assert_close(torch.tensor(rank["losses"][:n], dtype=torch.float64),
                                   torch.tensor(one["losses"][:n], dtype=torch.float64), rtol=1e-5, atol=1e-7)
        assert len(rank["grads"]) == len(one["grads"]) > 0
        for got, want in zip(rank["grads"], one["grads"]):
            torch.testing.assert_close(got, want, **GRAD_TOL)


def test_round_robin_shards_pad_to_the_same_count():
    assert shard_round_robin([1, 2, 3], 0, 2, 1) == [(1, 1.0), (3, 1.0)]
    assert shard_round_robin([1, 2, 3], 1, 2, 1) == [(2, 1.0), (1, 0.0)]
    assert shard_round_robin([7], 1, 2, 7) == [(7, 0.0)]


def test_launch_settings_are_checked(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert not init_distributed(DistributedConfig(backend="ddp")).enabled  # no launcher: one process
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="distributed.backend=none, but a launcher started 2 processes"):
        init_distributed(DistributedConfig(backend="none"))
    with pytest.raises(ValueError, match="fsdp: not supported by the critic stage"):
        init_distributed(DistributedConfig(backend="fsdp"), "cpu", stage="critic", allow_fsdp=False)
    with pytest.raises(ValueError, match="names one GPU"):
        init_distributed(DistributedConfig(backend="ddp"), "cuda:0")
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(ValueError, match="WORLD_SIZE='two'"):
        init_distributed(DistributedConfig())


# ---------------------------------------------------------------------------------------------
# Behaviour cloning


@pytest.fixture(scope="module")
def bc_data(alfworld_experts, tmp_path_factory) -> Path:
    return write_episodes(tmp_path_factory.mktemp("dist-bc") / "experts.parquet", alfworld_experts)


def bc_tree(model_dir: Path, data: Path, output: Path, **changes) -> dict:
    tree = {"model": {"name_or_path": str(model_dir), "device": "cpu", "precision": "fp32",
                      "lora": {"enabled": False}},
            "data": {"env": "alfworld", "train_path": str(data)},
            "optim": {"lr": 1e-3, "warmup_steps": 0},
            # 3 micro-batches a step: with 2 ranks one rank runs a weight-0 padding pass
            "tokens_per_batch": 1024, "grad_accum_steps": 3, "max_steps": 4, "save_every": 2,
            "output_dir": str(output), "progress": False, "tensorboard": False, "seed": 0}
    tree.update(changes)
    return tree


@pytest.fixture(scope="module")
def bc_world_1(tiny_model_dir, bc_data, tmp_path_factory):
    folder = tmp_path_factory.mktemp("dist-bc-ws1")
    (dump,) = launch(folder, "ws1", {"stage": "bc", "config": bc_tree(tiny_model_dir, bc_data, folder / "run")}, 1)
    return dump, folder / "run"


@pytest.mark.slow
def test_bc_ddp_step_equals_one_process_and_resumes_with_another_world_size(tiny_model_dir, bc_data, bc_world_1,
                                                                            tmp_path):
    one, _ = bc_world_1
    run = tmp_path / "run"
    # world size 2 stops after 3 steps (the "crash"); its newest checkpoint is step 2
    two = launch(tmp_path, "ws2", {"stage": "bc", "config": bc_tree(
        tiny_model_dir, bc_data, run, stop_after_steps=3, distributed={"backend": "ddp"})}, 2)
    assert all(r["steps"] == 3 for r in two)
    assert_same_step(one, two, steps=3)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000002"]  # rank 0 alone wrote
    # ... and one process finishes the run from it, on the same trajectory
    (rest,) = launch(tmp_path, "resume", {"stage": "bc", "config": bc_tree(tiny_model_dir, bc_data, run)}, 1)
    assert rest["steps"] == 4
    torch.testing.assert_close(torch.tensor(rest["losses"]), torch.tensor(one["losses"][2:]), rtol=1e-5, atol=1e-7)
    assert (run / "final" / "config.json").is_file() and (run / "bc_summary.json").is_file()


@pytest.mark.slow
def test_bc_fsdp_step_equals_one_process_saves_full_weights_and_resumes(tiny_model_dir, bc_data, bc_world_1,
                                                                        tmp_path):
    one, one_run = bc_world_1
    run = tmp_path / "run"

    def spec(**changes) -> dict:
        return {"stage": "bc", "config": bc_tree(tiny_model_dir, bc_data, run, max_steps=2, save_every=1,
                                                 distributed={"backend": "fsdp"}, **changes)}

    first = launch(tmp_path, "fsdp1", spec(stop_after_steps=1), 2)
    assert_same_step(one, first, steps=1)
    # the optimizer state is saved as one process saves it (gathered, keyed by parameter index)
    state = torch.load(run / "checkpoints" / "step-000001" / "trainer_state.pt", weights_only=False)
    assert len(state["optimizer"]["state"]) == len(one["grads"])
    rest = launch(tmp_path, "fsdp2", spec(), 2)  # FSDP resumes it: sharded again from the full state
    for rank in rest:
        torch.testing.assert_close(torch.tensor(rank["losses"]), torch.tensor(one["losses"][1:2]), rtol=1e-5,
                                   atol=1e-7)
    from safetensors.torch import load_file

    saved = load_file(str(run / "final" / "model.safetensors"))
    reference = load_file(str(one_run / "checkpoints" / "step-000002" / "model.safetensors"))
    assert saved.keys() == reference.keys()
    assert all(saved[k].shape == reference[k].shape for k in saved)  # gathered, not shards


# ---------------------------------------------------------------------------------------------
# BPPO and the critic


@pytest.mark.slow
def test_bppo_ddp_under_accelerate_launch_equals_one_process(alfworld_experts, tiny_model_dir, tmp_path):
    import copy

    episodes = [copy.deepcopy(ep) for ep in alfworld_experts]
    for e, episode in enumerate(episodes):
        for t, turn in enumerate(episode.turns):
            turn.advantage = ((e + t) % 3 - 1) * 0.5
    buffer = write_episodes(tmp_path / "labelled.parquet", episodes)

    def spec(output: Path) -> dict:
        return {"stage": "bppo", "config": {
            "buffer_path": str(buffer), "prompt": {"max_prompt_tokens": 2048, "reserve_action_tokens": 16},
            "model": {"name_or_path": str(tiny_model_dir), "device": "cpu", "precision": "fp32"},  # LoRA
            "standardize_advantages": "buffer", "max_steps": 2, "grad_accum_steps": 2, "tokens_per_batch": 1024,
            "output_dir": str(output), "progress": False, "tensorboard": False}}

    (one,) = launch(tmp_path, "ws1", spec(tmp_path / "a"), 1)
    two = launch(tmp_path, "ws2", spec(tmp_path / "b"), 2, launcher="accelerate")
    assert_same_step(one, two)
    assert (tmp_path / "b" / "final" / "adapter_model.safetensors").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("heldout_fraction", [0.0, 0.3])
def test_critic_ddp_step_equals_one_process(tmp_path, heldout_fraction):
    """Also with trajectories held out: every rank trains on the same ones and measures the same fit."""
    from qevolve.critic.testing import save_tiny_llama, synthetic_buffer

    model = save_tiny_llama(tmp_path / "tiny", seed=0)
    buffer = write_episodes(tmp_path / "buffer.parquet", synthetic_buffer(13, seed=3))

    def spec(output: Path, **changes) -> dict:
        config = {"init": str(model), "dtype": "float32", "device": "cpu", "epochs": 2, "batch_tokens": 256,
                  "lr": 3e-3, "head_hidden": 32, "feature_cache_dir": str(tmp_path / "features"),
                  "checkpoint_every_steps": 2, "heldout_fraction": heldout_fraction, **changes}
        return {"stage": "critic", "config": config, "buffer": str(buffer), "output": str(output)}

    (one,) = launch(tmp_path, "ws1", spec(tmp_path / "a"), 1)
    two = launch(tmp_path, "ws2", spec(tmp_path / "b", distributed={"backend": "ddp"}), 2)
    assert_same_step(one, two)  # per-epoch loss_v, loss_q, explained variance (held-out too); first-step gradients
    assert len(one["losses"][0]) == (5 if heldout_fraction else 3)
    assert (tmp_path / "b" / "critic.pt").is_file() and (tmp_path / "b" / "metrics.jsonl").is_file()


@pytest.mark.slow
def test_a_nan_loss_on_one_rank_stops_every_rank_before_the_step(alfworld_experts, tiny_model_dir, tmp_path):
    """Rank 1 alone sees a NaN loss at step 2: both ranks raise NonFiniteError at that step (none is left
    waiting in a collective), the step-1 checkpoint is kept and no final model is written."""
    import copy

    episodes = [copy.deepcopy(ep) for ep in alfworld_experts]
    for episode in episodes:
        for turn in episode.turns:
            turn.advantage = 1.0
    buffer = write_episodes(tmp_path / "labelled.parquet", episodes)
    output = tmp_path / "run"
    spec = {"stage": "bppo", "poison": {"rank": 1, "call": 2}, "config": {
        "buffer_path": str(buffer), "prompt": {"max_prompt_tokens": 2048, "reserve_action_tokens": 16},
        "model": {"name_or_path": str(tiny_model_dir), "device": "cpu", "precision": "fp32"},
        "max_steps": 3, "grad_accum_steps": 2, "tokens_per_batch": 1024, "save_every": 1,
        "output_dir": str(output), "progress": False, "tensorboard": False, "distributed": {"backend": "ddp"}}}
    rank0, rank1 = launch(tmp_path, "nan", spec, 2)
    assert rank1["error"].startswith("policy/bppo: non-finite loss (nan) at step 2; stopped without applying it")
    assert rank0["error"].startswith("policy/bppo: non-finite loss (on another rank)")
    assert "step-000001 is kept" in rank0["error"] and "step-000001 is kept" in rank1["error"]
    assert sorted(p.name for p in (output / "checkpoints").iterdir()) == ["step-000001"]
    assert not (output / "final").exists()
