"""Forward passes that only pay for the output layer where it is needed.

The output layer of the default model (49,152 x 576) costs about a fifth of the model's FLOPs per
token and its logits (49k floats per token) dominate memory. Training and scoring only need the
logits at the positions that predict agent tokens (a minority of a trajectory's tokens), so the
decoder runs over every token and the output layer only over those positions.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from qevolve.policy.batching import TokenBatch
from qevolve.policy.model import unwrap_model

__all__ = ["TargetLogits", "decoder_hidden_states", "target_logits", "target_logprobs", "target_nll"]


def decoder_hidden_states(model: Any, batch: TokenBatch) -> torch.Tensor:
    """The decoder's last hidden states, ``[B, L, H]`` (LoRA layers are active inside)."""
    inner = unwrap_model(model)
    decoder = inner.get_decoder()
    output = decoder(input_ids=batch.input_ids, position_ids=batch.position_ids,
                     attention_mask=batch.attention_mask, use_cache=False)
    return output.last_hidden_state


class TargetLogits(torch.nn.Module):
    """The policy model as one module whose forward is :func:`target_logits`.

    Multi-process training wraps this in DDP or FSDP (:mod:`qevolve.distributed`): their hooks
    run at the wrapper's forward, which the decoder-only path below would otherwise bypass."""

    def __init__(self, model: Any):
        super().__init__()
        self.model = model

    def forward(self, batch: TokenBatch) -> torch.Tensor:
        return _target_logits(self.model, batch)


def target_logits(model: Any, batch: TokenBatch) -> torch.Tensor:
    """Logits ``[N, V]`` at the positions predicting the batch's agent tokens."""
    if isinstance(model, TargetLogits) or isinstance(getattr(model, "module", None), TargetLogits):
        return model(batch)  # a DDP/FSDP-wrapped trainer model
    return _target_logits(model, batch)


def _target_logits(model: Any, batch: TokenBatch) -> torch.Tensor:
    hidden = decoder_hidden_states(model, batch)
    selected = hidden.reshape(-1, hidden.shape[-1]).index_select(0, batch.target_index)
    return unwrap_model(model).get_output_embeddings()(selected)


def target_logprobs(model: Any, batch: TokenBatch) -> torch.Tensor:
    """log pi(token) of every agent token of the batch, ``[N]``, in float32."""
    logits = target_logits(model, batch).float()
    return torch.log_softmax(logits, dim=-1).gather(1, batch.target_ids[:, None]).squeeze(1)


def target_nll(model: Any, batch: TokenBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed negative log-likelihood of the agent tokens, and how many were predicted correctly."""
    logits = target_logits(model, batch).float()
    nll = F.cross_entropy(logits, batch.target_ids, reduction="sum")
    correct = (logits.detach().argmax(-1) == batch.target_ids).sum()
    return nll, correct
