"""Causal attention kernels on a CPU, for training: one layer's forward + backward, each candidate against
PyTorch's fused kernel (what ``packed_sdpa`` calls), measured in the same process.

The layer is SmolLM2-135M's (9 query heads, 3 key/value heads, head dim 64) in bf16, and the inputs come
as transformers passes them: the projections' (batch, tokens, heads, dim) outputs transposed to
(batch, heads, tokens, dim), so not contiguous. Each row times forward and backward (best of
``--repeats``, candidates interleaved so that a noisy neighbour hits them all alike), the ratio of the
fused kernel's forward + backward time over the candidate's (> 1: the candidate is faster), GFLOP/s
(causal attention FLOPs, backward counted as 2x forward, whatever the candidate really computes) and the
largest difference from the fused kernel over the output and the three input gradients (absolute, and
relative to the largest fused value). ``fp32 reference`` is the fused kernel in float32 on the same
inputs: its difference is the bf16 kernel's own rounding, the scale against which the others compare.

Candidates (``--candidates``, default all but the slow ones marked *):
    fused               F.scaled_dot_product_attention(is_causal=True, enable_gqa=True) on the transposed views
    fused contiguous    the same on contiguous copies of q, k, v
    fused repeated kv   key/value heads repeated (repeat_interleave) instead of enable_gqa
    fused fp32          q, k, v cast to float32, the fused kernel, the output cast back
    fused 1 thread      the fused kernel with torch.set_num_threads(1) (shows how the kernel scales)
    query chunks        the fused kernel per block of --chunk queries, each on its causal prefix of keys
                        (the block's own keys through a causal mask, earlier keys unmasked)
    eager*              QK^T, causal mask, float32 softmax, PV as plain matmuls (what transformers' eager does)
    compiled eager      the eager maths under torch.compile (key/value heads shared by folding each group's
                        query heads into one matmul); its compilation is in "first call s"
    compiled blocks     qevolve.models.attention.block_causal_attention (the ``block_causal`` attention): per
                        block of --block queries, the same maths on the block's causal prefix of keys, a
                        forward and a backward torch.compile'd function dynamic in the length (compiled once,
                        on the first length); the backward recomputes the probabilities from the forward's
                        log-sum-exp, as flash attention does

FlexAttention is not a candidate: in torch 2.13 it raises on CPU when an input requires grad
("FlexAttention does not support backward on CPU"), and its compiled CPU forward was slower than the
fused kernel's (docs/performance.md).

    PYTHONPATH=src python benchmarks/attention_kernels.py --lengths 2048,2900 --threads 2
    python benchmarks/attention_kernels.py --lengths 64,96 --repeats 1 --json out.json   # seconds, CI
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from typing import Any, Callable

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the qevolve CLI sets it; read when OpenMP starts

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
SAVED = "saved MB"
GROUPS = HEADS // KV_HEADS
SLOW = ("eager",)
ALL = ("fused", "fused contiguous", "fused repeated kv", "fused fp32", "fused 1 thread", "query chunks", "eager",
       "compiled eager", "compiled blocks")


def attention_flops(n: int) -> float:
    """Forward FLOPs of causal attention over n tokens (QK^T and PV over the n(n+1)/2 kept pairs)."""
    return 4 * HEADS * HEAD_DIM * n * (n + 1) / 2


def fused(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def fused_contiguous(q, k, v):
    return F.scaled_dot_product_attention(q.contiguous(), k.contiguous(), v.contiguous(), is_causal=True,
                                          enable_gqa=True)


def fused_repeated_kv(q, k, v):
    return F.scaled_dot_product_attention(q, k.repeat_interleave(GROUPS, dim=1), v.repeat_interleave(GROUPS, dim=1),
                                          is_causal=True)


def fused_fp32(q, k, v):
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True,
                                          enable_gqa=True).to(q.dtype)


def query_chunks(chunk: int) -> Callable:
    """Each block of queries attends to keys [0, end of block): unmasked before the block, causal inside it.
    Both parts go through one fused call with a boolean mask (True = attend)."""
    def run(q, k, v):
        n = q.shape[2]
        parts = []
        for start in range(0, n, chunk):
            end = min(start + chunk, n)
            rows = torch.arange(start, end).unsqueeze(1)
            mask = torch.arange(end).unsqueeze(0) <= rows
            parts.append(F.scaled_dot_product_attention(q[:, :, start:end], k[:, :, :end], v[:, :, :end],
                                                        attn_mask=mask, enable_gqa=True))
        return torch.cat(parts, dim=2)
    return run


def grouped_scores(q, k):
    """Scores of each query head against its key/value head, without repeating keys: the GROUPS query heads
    that share a key/value head become one (GROUPS * tokens) x dim matrix -> (batch, kv heads, GROUPS, tq, tk)."""
    b, _, tq, d = q.shape
    folded = q.reshape(b, KV_HEADS, GROUPS * tq, d)
    return (folded @ k.transpose(-1, -2)).view(b, KV_HEADS, GROUPS, tq, k.shape[2])


def grouped_output(probs, v):
    b, kv, g, tq, tk = probs.shape
    return (probs.reshape(b, kv, g * tq, tk) @ v).view(b, kv * g, tq, v.shape[-1])


def eager(q, k, v):
    n = q.shape[2]
    scores = grouped_scores(q, k).float() * HEAD_DIM ** -0.5
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    return grouped_output(torch.softmax(scores, dim=-1).to(q.dtype), v)


class OneThread:
    """Runs fn with one torch thread (restores the previous count)."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, *args):
        before = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return self.fn(*args)
        finally:
            torch.set_num_threads(before)


def build(names: list[str], chunk: int, block: int, dynamic: bool) -> dict[str, Callable]:
    made = {"fused": fused, "fused contiguous": fused_contiguous, "fused repeated kv": fused_repeated_kv,
            "fused fp32": fused_fp32, "fused 1 thread": OneThread(fused), "query chunks": query_chunks(chunk),
            "eager": eager}
    if "compiled eager" in names:
        made["compiled eager"] = torch.compile(eager, dynamic=dynamic)
    if "compiled blocks" in names:
        from qevolve.models.attention import block_causal_attention

        made["compiled blocks"] = lambda q, k, v: block_causal_attention(q, k, v, block=block)
    return {name: made[name] for name in names}


def inputs(n: int, seed: int = 0):
    """Leaves shaped like the projections' outputs (batch, tokens, heads, dim), and the output's gradient."""
    g = torch.Generator().manual_seed(seed)
    leaves = [torch.randn(1, n, h, HEAD_DIM, generator=g).to(torch.bfloat16).requires_grad_()
              for h in (HEADS, KV_HEADS, KV_HEADS)]
    grad = torch.randn(1, HEADS, n, HEAD_DIM, generator=g).to(torch.bfloat16)
    return leaves, grad


def saved_bytes(fn, leaves) -> int:
    """Bytes the forward keeps for the backward pass (each saved tensor's own storage, counted once)."""
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return t

    q, k, v = (leaf.transpose(1, 2) for leaf in leaves)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(q, k, v)
    inputs_storage = {leaf.untyped_storage().data_ptr() for leaf in leaves}
    return sum(n for ptr, n in seen.items() if ptr not in inputs_storage)


def run_once(fn, leaves, grad) -> tuple[float, float, list[torch.Tensor]]:
    """Forward and backward seconds, then [output, dq, dk, dv]."""
    for leaf in leaves:
        leaf.grad = None
    q, k, v = (leaf.transpose(1, 2) for leaf in leaves)  # as transformers hands them to the attention function
    t0 = time.perf_counter()
    out = fn(q, k, v)
    t1 = time.perf_counter()
    out.backward(grad)
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, [out.detach(), *(leaf.grad for leaf in leaves)]


def difference(results: list[torch.Tensor], reference: list[torch.Tensor]) -> tuple[float, float]:
    """Largest absolute difference over output and gradients, and the largest of each tensor's abs
    difference relative to that tensor's largest reference value."""
    worst_abs = worst_rel = 0.0
    for got, want in zip(results, reference):
        diff = (got.float() - want.float()).abs().max().item()
        worst_abs = max(worst_abs, diff)
        worst_rel = max(worst_rel, diff / max(want.float().abs().max().item(), 1e-12))
    return worst_abs, worst_rel


def measure(lengths: list[int], names: list[str], repeats: int = 3, chunk: int = 512, block: int = 256,
            dynamic: bool = False) -> list[dict[str, Any]]:
    candidates = build(names, chunk, block, dynamic)
    if "fused" not in candidates:
        candidates = {"fused": fused, **candidates}
    rows = []
    for n in lengths:
        leaves, grad = inputs(n)
        reference, timings, first_call = {}, {}, {}
        for name, fn in candidates.items():  # first call: results, and any compilation
            t0 = time.perf_counter()
            _, _, reference[name] = run_once(fn, leaves, grad)
            first_call[name] = time.perf_counter() - t0
            timings[name] = [float("inf"), float("inf")]
        saved = {name: saved_bytes(fn, leaves) for name, fn in candidates.items()}
        fp32_leaves = [leaf.detach().float().requires_grad_() for leaf in leaves]
        _, _, fp32 = run_once(fused, fp32_leaves, grad.float())
        for _ in range(repeats):
            for name, fn in candidates.items():
                forward, backward, _ = run_once(fn, leaves, grad)
                timings[name] = [min(timings[name][0], forward), min(timings[name][1], backward)]
        base = sum(timings["fused"])
        flops = 3 * attention_flops(n)
        for name in ["fp32 reference", *candidates]:
            if name == "fp32 reference":
                abs_err, rel_err = difference(fp32, reference["fused"])
                rows.append({"tokens": n, "candidate": name, "fwd ms": "-", "bwd ms": "-", "fwd+bwd ms": "-",
                             "bwd share": "-", "x fused": "-", "GFLOP/s": "-", SAVED: "-", "first call s": "-",
                             "max abs diff": f"{abs_err:.2e}", "max rel diff": f"{rel_err:.2e}"})
                continue
            forward, backward = timings[name]
            abs_err, rel_err = difference(reference[name], reference["fused"])
            rows.append({"tokens": n, "candidate": name, "fwd ms": round(forward * 1e3, 1),
                         "bwd ms": round(backward * 1e3, 1), "fwd+bwd ms": round((forward + backward) * 1e3, 1),
                         "bwd share": f"{backward / (forward + backward):.0%}",
                         "x fused": round(base / (forward + backward), 2),
                         "GFLOP/s": round(flops / (forward + backward) / 1e9, 1),
                         SAVED: round(saved[name] / 2 ** 20, 1),
                         "first call s": round(first_call[name], 1),
                         "max abs diff": f"{abs_err:.2e}", "max rel diff": f"{rel_err:.2e}"})
    return rows


def matmul_rate(size: int = 2048, repeats: int = 8) -> float:
    """Best bf16 FLOP/s of a square matmul: the machine's attainable peak for this precision."""
    a, b = torch.randn(size, size, dtype=torch.bfloat16), torch.randn(size, size, dtype=torch.bfloat16)
    best = math.inf
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        torch.matmul(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * size ** 3 / best


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="2048,2900", help="comma-separated sequence lengths")
    parser.add_argument("--candidates", default=",".join(n for n in ALL if n not in SLOW),
                        help=f"comma-separated, from: {', '.join(ALL)}")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per candidate (the best is kept)")
    parser.add_argument("--chunk", type=int, default=512, help="queries per call (query chunks)")
    parser.add_argument("--block", type=int, default=256, help="queries per block (compiled blocks)")
    parser.add_argument("--dynamic", action="store_true", help="torch.compile(dynamic=True) for compiled eager")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--json", dest="json_out", default=None, help="write the rows here")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.candidates.split(",") if n.strip()]
    unknown = [n for n in names if n not in ALL]
    if unknown:
        parser.error(f"--candidates {unknown[0]!r}: expected some of {', '.join(ALL)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"{time.strftime('%Y-%m-%d')}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"bf16 matmul {matmul_rate() / 1e9:.0f} GFLOP/s", flush=True)
    rows = measure([int(n) for n in args.lengths.split(",")], names, repeats=args.repeats, chunk=args.chunk,
                   block=args.block, dynamic=args.dynamic)
    from train_throughput import print_rows  # the benchmarks' shared table printer (this script's folder)

    print_rows(rows)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"torch": torch.__version__, "threads": torch.get_num_threads(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
