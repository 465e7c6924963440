"""Where the in-process (transformers) generation backend spends an evaluation's time on a CPU.

An evaluation-shaped workload on the embedded model: ``--rows`` episodes generated as one batch, a first
prompt of about ``--prompt`` tokens, then ``--turns`` turns, each adding ``--observation`` tokens of
observation to every row and generating ``--generate`` tokens (random token ids; no stop token is ever
produced, so every row generates the same number of tokens, as the longest row of a real batch makes the
whole batch do). Per turn it prints the time to encode the new tokens (prompt chunk, through the reused KV
cache) and the time per decoding step; then it profiles one more turn's encoding and decoding with
``torch.profiler`` and prints the time per operator group (attention, the linear layers, the output layer,
gathering the cache's rows, the rest).

``--force-gather`` restores the behaviour before 2026-12-07 (the cache's rows gathered at every call, even
when the batch holds the same rows in the same order), for a before/after comparison.

    python benchmarks/hf_generation_profile.py [--precision fp32] [--rows 25] [--turns 4]
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

SRC = Path(__file__).resolve().parents[1] / "src"
if SRC.is_dir() and str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))


def operator_group(name: str, shapes: list) -> str:
    if "scaled_dot_product" in name or "flash_attention" in name:
        return "attention"
    if name == "aten::mm":  # the output layer multiplies by a [hidden, vocabulary] matrix
        vocabulary = len(shapes) > 1 and len(shapes[1]) == 2 and shapes[1][1] > 10_000
        return "output layer (vocabulary)" if vocabulary else "linear layers"
    if name == "aten::index_select" and shapes and len(shapes[0]) == 4:
        return "cache row gather"
    return "rest"


def timed_call(backend, requests, params, profiled: bool) -> tuple[float, dict[str, float] | None, list]:
    """``backend.generate``: its wall time, its time per operator group when ``profiled``, its results."""
    from torch.profiler import ProfilerActivity, profile

    if not profiled:
        started = time.perf_counter()
        results = backend.generate(requests, params)
        return time.perf_counter() - started, None, results
    started = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        results = backend.generate(requests, params)
    seconds = time.perf_counter() - started
    groups: dict[str, float] = defaultdict(float)
    for event in prof.key_averages(group_by_input_shape=True):
        groups[operator_group(event.key, event.input_shapes)] += event.self_cpu_time_total / 1e6
    total = sum(groups.values())
    return seconds, {k: v / total * seconds for k, v in groups.items()}, results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--precision", default="fp32", help="model.precision (fp32, bf16, bf16-autocast)")
    parser.add_argument("--rows", type=int, default=25, help="episodes in the batch (the eval's batch_size)")
    parser.add_argument("--prompt", type=int, default=800, help="first prompt length in tokens (about)")
    parser.add_argument("--turns", type=int, default=4, help="timed turns before the profiled one")
    parser.add_argument("--observation", type=int, default=290, help="new observation tokens per turn")
    parser.add_argument("--generate", type=int, default=40, help="generated tokens per turn")
    parser.add_argument("--force-gather", action="store_true", help="gather the cache's rows at every call")
    parser.add_argument("--batch-dependence", action="store_true",
                        help="also check whether a row's logits depend on which rows share its batch")
    args = parser.parse_args()

    from qevolve.machine import run_environment
    from qevolve.models.loading import ModelConfig, load_policy
    from qevolve.rollouts.generation import GenerationRequest, HFGenerationBackend, SamplingParams

    torch.manual_seed(0)
    policy = load_policy(ModelConfig(name_or_path="default", precision=args.precision), trainable=False)
    vocab = policy.model.config.vocab_size
    autocast = torch.bfloat16 if policy.precision == "bf16-autocast" else None
    backend = HFGenerationBackend(policy.model, [vocab + 1], 0, autocast_dtype=autocast)  # never sampled
    if args.force_gather:
        def always_gather(self, indices):  # the code before the identity check
            index = torch.tensor(indices, dtype=torch.long, device=self.device)
            self._cache.batch_select_indices(index)
            self._mask = self._mask.index_select(0, index)
            self._rows = [self._rows[i] for i in indices]
            self.stats.row_selections += 1

        backend._select_rows = always_gather.__get__(backend)
    env = run_environment({"precision": policy.precision})
    print(f"{platform.processor() or platform.machine()}: {env['cpu']}, torch {torch.__version__}, "
          f"threads {torch.get_num_threads()}, precision {policy.precision}")
    gen = torch.Generator().manual_seed(0)

    def tokens(n: int) -> list[int]:
        return torch.randint(1, vocab, (n,), generator=gen).tolist()

    prompts = [tokens(args.prompt + 13 * i) for i in range(args.rows)]  # rows of unequal length, as in an eval

    def turn(prompts, label, profiled=False):
        requests = [GenerationRequest(i, p) for i, p in enumerate(prompts)]
        encode, encode_groups, first = timed_call(backend, requests, SamplingParams(max_new_tokens=1), profiled)
        # the same turn's decoding: each row's cache ends one token short of its prompt and first token
        requests = [GenerationRequest(i, p + r.token_ids) for i, (p, r) in enumerate(zip(prompts, first))]
        steps = args.generate - 1
        decode, decode_groups, rest = timed_call(backend, requests, SamplingParams(max_new_tokens=steps), profiled)
        context = sum(len(p) for p in prompts) / len(prompts)
        print(f"{label}: context {context:,.0f} tokens per row: encode {encode:.1f} s, decode {decode / steps * 1000:.0f} "
              f"ms per step ({args.rows * steps / decode:.1f} tokens/s)", flush=True)
        following = [p + a.token_ids + b.token_ids + tokens(args.observation) for p, a, b in zip(prompts, first, rest)]
        return following, encode_groups, decode_groups, steps, context

    for t in range(args.turns):
        prompts, *_ = turn(prompts, f"turn {t}")
    prompts, encode_groups, decode_groups, steps, context = turn(prompts, f"turn {args.turns} (profiled)", profiled=True)
    print(f"\nprofiled turn, seconds by operator group (cache row gathers so far: {backend.stats.row_selections}):")
    config = policy.model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_bytes = (args.rows * config.num_key_value_heads * context * head_dim * 2 * config.num_hidden_layers
                * next(policy.model.parameters()).element_size())
    attention_seconds = decode_groups.get("attention", 0.0) / steps
    block = torch.ones(256 * 1024 * 1024)  # 1 GiB of fp32: what a plain reduction reads per second here
    block.sum()
    started = time.perf_counter()
    for _ in range(5):
        block.sum()
    read_rate = 5 * block.numel() * 4 / (time.perf_counter() - started) / 1e9
    print(f"decode attention reads {kv_bytes / 1e9:.2f} GB of keys and values per step: "
          f"{kv_bytes / attention_seconds / 1e9:.1f} GB/s; torch.sum over 1 GiB reads {read_rate:.1f} GB/s")
    print("| group | encode (s) | decode (ms per step) |")
    print("|---|---|---|")
    for group in ("attention", "linear layers", "output layer (vocabulary)", "cache row gather", "rest"):
        print(f"| {group} | {encode_groups.get(group, 0.0):.2f} | {decode_groups.get(group, 0.0) / steps * 1000:.0f} |")
    if args.batch_dependence:
        batch_dependence(policy.model, args.rows, args.prompt, gen)


def batch_dependence(model, rows: int, length: int, gen: torch.Generator) -> None:
    """Encode ``rows`` prompts and decode one token as one batch, then the same for subsets of the rows: are a
    row's logits the same bits? Where they are not, computing only the rows still generating (instead of the
    whole batch until its longest row stops) could change greedy turns."""
    from transformers import DynamicCache

    ids = torch.randint(1, model.config.vocab_size, (rows, length), generator=gen)

    def last_logits(subset: list[int]) -> torch.Tensor:
        cache = DynamicCache()
        with torch.inference_mode():
            first = model(input_ids=ids[subset], past_key_values=cache, use_cache=True, logits_to_keep=1)
            token = first.logits[:, -1].argmax(-1, keepdim=True)
            return model(input_ids=token, past_key_values=cache, use_cache=True).logits[:, -1]

    full = last_logits(list(range(rows)))
    for subset in ([0, 3, 7, 11, 20], [5], list(range(rows // 2))):
        subset = [i for i in subset if i < rows]
        if not subset:  # a small --rows leaves none of these rows
            continue
        part = last_logits(subset)
        print(f"{len(subset)} of {rows} rows as their own batch: logits bitwise equal: {torch.equal(part, full[subset])}, "
              f"largest difference {(part - full[subset]).abs().max().item():.1e}")


if __name__ == "__main__":
    main()
