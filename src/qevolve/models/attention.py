"""Attention for packed rows: each packed sequence attends causally to itself only, and no more.

transformers handles a packed row (several sequences in one row, position ids restarting at 0)
by building a dense block-diagonal mask over the whole row. PyTorch's CPU attention kernels do not
skip the masked blocks, so a row of four 1,024-token sequences costs as much attention as one
4,096-token sequence: 7x slower than four separate causal calls (measured here, bf16, one thread:
1,029 ms vs 146 ms per layer). ``packed_sdpa`` (the attention implementation registered here, the
default of :class:`qevolve.models.loading.ModelConfig`) runs ``scaled_dot_product_attention`` with
``is_causal=True`` on each sequence of a packed row instead, and behaves exactly like ``sdpa``
everywhere else (padding masks, generation with a cache).

On CPU, grouped-query attention with a mask (every decode step of generation with a cache, and
padded training batches) also goes through PyTorch's kernel directly with ``enable_gqa=True``:
transformers only does that on CUDA without a mask, and otherwise copies every key and value head
``num_key_value_groups`` times first (SmolLM2: 3 query heads per key/value head), which costs
memory traffic on every decode step. End to end the gain is small: ``benchmarks/memory.py --stages
decode --batch 20 --prompt 1500 --turns 2 --new-tokens 16 --threads 2 --attention packed_sdpa,sdpa``
(2026-12-04, 2-core AMD EPYC with AVX-512 BF16, bf16 weights; prefill of the 30,000 prompt tokens
dominates) took 65.3 s vs 69.1 s with the default cache, and 77.8 s vs 69.2 s (slower) with
transformers' DynamicCache; docs/memory.md has the table.

``block_causal`` (opt-in, also registered here) is ``packed_sdpa`` with a faster causal attention for long
bf16 sequences on CPU, for training: each block of ``CAUSAL_BLOCK`` queries attends to its causal prefix
of keys through two bf16 matmuls and a float32 softmax compiled by ``torch.compile`` (dynamic in the sequence
length; the masked upper triangle is skipped block by block). As in flash attention, the forward pass keeps
only its output and one log-sum-exp per query and head, and the backward pass recomputes each block's
probabilities from them, so the memory it keeps grows linearly with the length, like the fused kernel's.
PyTorch's fused CPU kernel reaches a fraction of the matmul rate at these lengths;
``benchmarks/attention_kernels.py`` measures both on SmolLM2-135M's layer (docs/performance.md, "Attention
kernels on this CPU"), with differences from the fused kernel at bf16 rounding level. Its first calls in a
process compile for 5-15 seconds (a forward and a backward graph, then any length).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["PACKED_SDPA", "BLOCK_CAUSAL", "register_packed_attention", "packed_segments", "block_causal_attention"]

PACKED_SDPA = "packed_sdpa"
BLOCK_CAUSAL = "block_causal"
CAUSAL_BLOCK = 256  # queries per block: 128 to 512 measured, 256 best at 2-3k tokens (larger blocks spill caches)
BLOCKS_FROM = 2 * CAUSAL_BLOCK  # shorter sequences keep the fused kernel (one block would skip nothing)


def packed_segments(position_ids: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) of each sequence in one packed row: a new one starts where positions do not step by 1."""
    row = position_ids.reshape(-1)
    breaks = (torch.nonzero(row[1:] - row[:-1] != 1).flatten() + 1).tolist()
    edges = [0, *breaks, row.numel()]
    return list(zip(edges[:-1], edges[1:]))


def _packed_sdpa_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                           is_causal=None, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    position_ids = kwargs.get("position_ids")
    q_length = query.shape[2]
    if (attention_mask is None and position_ids is not None and query.shape[0] == 1 and q_length > 1
            and key.shape[2] == q_length and position_ids.shape[-1] == q_length):
        segments = packed_segments(position_ids)
        if len(segments) > 1:
            gqa = query.shape[1] != key.shape[1]
            parts = [F.scaled_dot_product_attention(query[:, :, s:e], key[:, :, s:e], value[:, :, s:e],
                                                    dropout_p=dropout if module.training else 0.0, is_causal=True,
                                                    scale=scaling, enable_gqa=gqa)
                     for s, e in segments]
            return torch.cat(parts, dim=2).transpose(1, 2).contiguous(), None
    groups = getattr(module, "num_key_value_groups", 1)
    kv_length = key.shape[2]
    if (query.device.type == "cpu" and groups > 1 and kwargs.get("position_bias") is None
            and kwargs.get("cache") is None and not kwargs.get("output_attentions", False)
            and (attention_mask is not None or q_length == 1 or kv_length == q_length)):
        # Same semantics as transformers' sdpa_attention_forward, without repeating the key/value heads.
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        causal = bool(q_length > 1 and attention_mask is None and causal)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                             scale=scaling, is_causal=causal, enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)


def _packed_sdpa_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, attention_mask=None, **kwargs):
    """No dense mask when there is no padding and no cache: causality is handled per sequence above."""
    from transformers.masking_utils import sdpa_mask

    if attention_mask is None and q_length == kv_length and not q_offset and not kv_offset:
        return None
    return sdpa_mask(batch_size, q_length, kv_length, q_offset=q_offset, kv_offset=kv_offset,
                     attention_mask=attention_mask, **kwargs)


def _block_scores(query_block, key_prefix, start: int, scaling: float):
    """Masked float32 scores of queries start..start+B against keys 0..start+B: (batch, kv heads, groups, B, keys).

    The query heads that share a key/value head are folded into one (groups x B) x dim matrix, so one bf16
    matmul serves the whole group and no key/value head is copied."""
    batch, heads, block, dim = query_block.shape
    kv_heads, keys = key_prefix.shape[1], key_prefix.shape[2]
    groups = heads // kv_heads
    scores = query_block.reshape(batch, kv_heads, groups * block, dim) @ key_prefix.transpose(-1, -2)
    scores = scores.view(batch, kv_heads, groups, block, keys).float() * scaling
    rows = start + torch.arange(block, dtype=torch.int32, device=scores.device).unsqueeze(1)
    keep = torch.arange(keys, dtype=torch.int32, device=scores.device) <= rows
    return scores.masked_fill(~keep, float("-inf"))


def _block_forward(query_block, key_prefix, value_prefix, start: int, scaling: float):
    """One block's output and the log-sum-exp of its scores (batch, heads, B), which the backward pass
    recomputes the probabilities from."""
    batch, heads, block, dim = query_block.shape
    kv_heads, keys = key_prefix.shape[1], key_prefix.shape[2]
    scores = _block_scores(query_block, key_prefix, start, scaling)
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    probs = torch.exp(scores - lse).to(value_prefix.dtype).view(batch, kv_heads, heads // kv_heads * block, keys)
    return (probs @ value_prefix).view(batch, heads, block, dim), lse.view(batch, heads, block)


def _block_backward(query_block, key_prefix, value_prefix, out_grad, delta, lse, start: int, scaling: float):
    """Gradients of one block: dq for its queries, and its share of dk and dv over the prefix's keys.

    With P = softmax(S), O = P V and D = rowsum(dO * O): dV = P^T dO, dS = P * (dO V^T - D), dQ = scale dS K
    and dK = scale dS^T Q; P is recomputed from the forward's log-sum-exp instead of being kept."""
    batch, heads, block, dim = query_block.shape
    kv_heads, keys = key_prefix.shape[1], key_prefix.shape[2]
    groups = heads // kv_heads
    probs = torch.exp(_block_scores(query_block, key_prefix, start, scaling)
                      - lse.view(batch, kv_heads, groups, block, 1))
    folded_grad = out_grad.reshape(batch, kv_heads, groups * block, dim)
    value_grad = probs.to(value_prefix.dtype).view(batch, kv_heads, groups * block, keys).transpose(-1, -2) @ folded_grad
    probs_grad = (folded_grad @ value_prefix.transpose(-1, -2)).view(batch, kv_heads, groups, block, keys).float()
    scores_grad = (probs * (probs_grad - delta.view(batch, kv_heads, groups, block, 1)) * scaling)
    scores_grad = scores_grad.to(query_block.dtype).view(batch, kv_heads, groups * block, keys)
    query_grad = (scores_grad @ key_prefix).view(batch, heads, block, dim)
    key_grad = scores_grad.transpose(-1, -2) @ query_block.reshape(batch, kv_heads, groups * block, dim)
    return query_grad, key_grad, value_grad


_compiled: dict[str, object] = {}


def _compiled_block(name: str):
    if name not in _compiled:  # compiled on first use: dynamic in the length, so two graphs serve every length
        _compiled[name] = torch.compile({"forward": _block_forward, "backward": _block_backward}[name], dynamic=True)
    return _compiled[name]


class _BlockCausalAttention(torch.autograd.Function):
    """Causal attention block by block, keeping only the output and one log-sum-exp per query and head for the
    backward pass (as flash attention does), not the probabilities. The tokens are a multiple of ``block``."""

    @staticmethod
    def forward(ctx, query, key, value, scaling: float, block: int):
        forward = _compiled_block("forward")
        outs, lses = [], []
        for s in range(0, query.shape[2], block):
            out, lse = forward(query[:, :, s:s + block], key[:, :, :s + block], value[:, :, :s + block], s, scaling)
            outs.append(out)
            lses.append(lse)
        out, lse = torch.cat(outs, dim=2), torch.cat(lses, dim=2)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.scaling, ctx.block = scaling, block
        return out

    @staticmethod
    def backward(ctx, out_grad):
        query, key, value, out, lse = ctx.saved_tensors
        backward = _compiled_block("backward")
        out_grad = out_grad.to(query.dtype)
        delta = (out_grad.float() * out.float()).sum(-1)  # D = rowsum(dO * O), float32
        query_grad = torch.empty_like(query)
        key_grad = torch.zeros(key.shape, dtype=torch.float32, device=key.device)  # summed over blocks in float32
        value_grad = torch.zeros(value.shape, dtype=torch.float32, device=value.device)
        block = ctx.block
        for s in range(0, query.shape[2], block):
            q_grad, k_grad, v_grad = backward(query[:, :, s:s + block], key[:, :, :s + block],
                                              value[:, :, :s + block], out_grad[:, :, s:s + block],
                                              delta[:, :, s:s + block], lse[:, :, s:s + block], s, ctx.scaling)
            query_grad[:, :, s:s + block] = q_grad
            key_grad[:, :, :s + block] += k_grad
            value_grad[:, :, :s + block] += v_grad
        return query_grad, key_grad.to(key.dtype), value_grad.to(value.dtype), None, None


def block_causal_attention(query, key, value, scaling: float | None = None, block: int = CAUSAL_BLOCK):
    """Causal attention of (batch, heads, tokens, dim) tensors, block by block (see the module docstring).

    The tokens are padded at the end to a multiple of ``block``: causality keeps the padding out of every
    real query's keys, and the padded rows are dropped."""
    n = query.shape[2]
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    pad = -n % block
    if pad:  # padded in the (batch, tokens, heads, dim) layout transformers' projections give, then viewed back
        query, key, value = (F.pad(t.transpose(1, 2), (0, 0, 0, 0, 0, pad)).transpose(1, 2)
                             for t in (query, key, value))
    return _BlockCausalAttention.apply(query, key, value, scale, block)[:, :, :n]


def _causal_attention(query, key, value, scaling):
    """Blocks for long bf16 CPU sequences, the fused kernel otherwise."""
    on_cpu = query.device.type == "cpu"
    # Under bf16 autocast the rotary embedding hands over float32 q and k; the fused kernel is autocast to bf16.
    dtype = torch.get_autocast_dtype("cpu") if on_cpu and torch.is_autocast_enabled("cpu") else query.dtype
    if on_cpu and dtype == torch.bfloat16 and query.shape[2] >= BLOCKS_FROM:
        with torch.autocast("cpu", enabled=False):  # bf16 throughout, whatever autocast would pick per op
            return block_causal_attention(query.to(dtype), key.to(dtype), value.to(dtype), scaling,
                                          block=CAUSAL_BLOCK)
    return F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling,
                                          enable_gqa=query.shape[1] != key.shape[1])


def _block_causal_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                            is_causal=None, **kwargs):
    """``packed_sdpa``, with each unpadded causal sequence (whole rows, or the sequences of a packed row)
    through ``_causal_attention``."""
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    q_length = query.shape[2]
    if (attention_mask is None and causal and q_length > 1 and key.shape[2] == q_length
            and not (dropout and module.training) and kwargs.get("position_bias") is None
            and not kwargs.get("output_attentions", False)):
        position_ids = kwargs.get("position_ids")
        segments = [(0, q_length)]
        if position_ids is not None and query.shape[0] == 1 and position_ids.shape[-1] == q_length:
            segments = packed_segments(position_ids)
        parts = [_causal_attention(query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], scaling) for s, e in segments]
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
        return out.transpose(1, 2).contiguous(), None
    return _packed_sdpa_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)


def register_packed_attention() -> str:
    """Register ``packed_sdpa`` and ``block_causal`` with transformers (idempotent); return packed_sdpa's name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(PACKED_SDPA, _packed_sdpa_attention)
    AttentionMaskInterface.register(PACKED_SDPA, _packed_sdpa_mask)
    AttentionInterface.register(BLOCK_CAUSAL, _block_causal_attention)
    AttentionMaskInterface.register(BLOCK_CAUSAL, _packed_sdpa_mask)
    return PACKED_SDPA
