"""The block causal attention's own forward and backward (the opt-in ``block_causal`` implementation)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qevolve.models.attention import block_causal_attention


def _leaves(tokens: int, heads: int = 6, kv_heads: int = 2, dim: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    leaves = [torch.randn(1, tokens, h, dim, generator=g).to(torch.bfloat16).requires_grad_()
              for h in (heads, kv_heads, kv_heads)]
    return leaves, torch.randn(1, heads, tokens, dim, generator=g).to(torch.bfloat16)


def _output_and_grads(fn, leaves, out_grad):
    for leaf in leaves:
        leaf.grad = None
    q, k, v = (leaf.transpose(1, 2) for leaf in leaves)  # the layout transformers hands over
    out = fn(q, k, v)
    out.backward(out_grad)
    return [out.detach().float(), *(leaf.grad.float() for leaf in leaves)]


@pytest.mark.parametrize("tokens", [32, 45])  # a multiple of the block, and a padded last block
def test_block_causal_attention_matches_float32_attention_in_output_and_gradients(tokens):
    """Output, dq, dk and dv (recomputed from the forward's log-sum-exp) against float32 causal attention with
    grouped key/value heads: within bf16 rounding, no further than PyTorch's fused bf16 kernel is."""
    leaves, out_grad = _leaves(tokens)
    want = _output_and_grads(lambda q, k, v: F.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), is_causal=True, enable_gqa=True), leaves, out_grad.float())
    got = _output_and_grads(lambda q, k, v: block_causal_attention(q, k, v, block=8), leaves, out_grad)
    fused = _output_and_grads(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                               enable_gqa=True), leaves, out_grad)
    for name, g, f, w in zip(("out", "dq", "dk", "dv"), got, fused, want):
        scale = w.abs().max()
        assert (g - w).abs().max() / scale < 0.03, name
        assert (g - w).abs().max() / scale <= 3 * max((f - w).abs().max() / scale, 4e-3), name


def test_block_causal_attention_keeps_no_probabilities_for_the_backward_pass():
    """Only O(tokens) tensors are saved (inputs, output, one log-sum-exp per query and head), never a
    tokens x tokens block of probabilities: memory for the backward pass grows linearly with the length."""
    tokens, block = 64, 8
    leaves, _ = _leaves(tokens)
    largest = []

    def pack(t):
        largest.append(t.numel())
        return t

    q, k, v = (leaf.transpose(1, 2) for leaf in leaves)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block_causal_attention(q, k, v, block=block)
    assert largest and max(largest) <= q.numel()  # the query itself (6 heads x 64 tokens x 16) is the largest
    assert sum(largest) <= 5 * q.numel()  # q, k, v, out, log-sum-exp: no block x tokens scores
