"""Test-time critic re-ranking: the paper's "w/o policy improvement" row (method section 6).

The policy is not updated. At every turn the policy samples ``num_candidates`` candidate turns for
the state, the critic scores each with Q(s_t, a), and the agent acts with the highest-scoring one:

    a_t = argmax_{a in {a^1..a^N} ~ pi(.|s_t)} Q(s_t, a)

Q(s_t, a) is read where training reads it, at the last token of the candidate (its end-of-turn
token) after the exact prompt the policy conditioned on. ``q_source`` picks the online Q heads
(the minimum of the twin heads) or the Polyak target heads. The paper reports that this scored
below plain SFT (58.6/59.0 vs 60.0/67.2 on ALFWorld): the critic is only trusted on the actions of
its buffer, and sampled candidates leave that distribution.

Cost: the critic's backbone encodes each prompt once per turn (its cache is shared by the N
candidates, which are scored as one batch of continuations); the policy's backend samples the N
candidates of every episode in one batch.
"""

from __future__ import annotations

from typing import Hashable, Literal, Sequence

import torch

from qevolve.rollouts.generation import GenerationBackend, GenerationRequest, GenerationResult, GenerationStats, \
    SamplingParams, request_seed

__all__ = ["CriticRerankBackend", "critic_q_scores"]


@torch.inference_mode()
def critic_q_scores(critic, prompt_ids: list[int], candidates: list[list[int]],
                    q_source: Literal["online", "target"] = "online") -> torch.Tensor:
    """Q(s, a) of each candidate action (token ids) after ``prompt_ids``: ``[len(candidates)]`` float64."""
    if not candidates or any(not c for c in candidates):
        raise ValueError("every candidate needs at least one token (Q reads its last token)")
    backbone = critic.backbone
    if backbone is None:
        raise ValueError("critic re-ranking needs the critic's backbone (a critic loaded with load_critic)")
    device = next(critic.heads.parameters()).device
    dtype = critic.compute_dtype
    n = len(candidates)
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.autocast(device_type=device.type, dtype=dtype, enabled=dtype != torch.float32):
        backbone(input_ids=torch.tensor([prompt_ids], device=device), past_key_values=cache, use_cache=True)
        cache.batch_repeat_interleave(n)
        width = max(len(c) for c in candidates)
        ids = torch.zeros((n, width), dtype=torch.long)
        mask = torch.zeros((n, len(prompt_ids) + width), dtype=torch.long)
        mask[:, : len(prompt_ids)] = 1
        for row, candidate in enumerate(candidates):
            ids[row, : len(candidate)] = torch.tensor(candidate)
            mask[row, len(prompt_ids): len(prompt_ids) + len(candidate)] = 1  # right padding: never attended to
        positions = torch.arange(len(prompt_ids), len(prompt_ids) + width).expand(n, width)
        hidden = backbone(input_ids=ids.to(device), attention_mask=mask.to(device), position_ids=positions.to(device),
                          past_key_values=cache, use_cache=True).last_hidden_state
    last = torch.tensor([len(c) - 1 for c in candidates], device=device)
    features = hidden[torch.arange(n, device=device), last].float()
    if q_source == "target":
        q = critic.target_q_min(features)
    else:
        q = critic.heads.q_values(features).min(dim=0).values
    return q.double().cpu()


class CriticRerankBackend(GenerationBackend):
    """Samples ``num_candidates`` turns per request from ``policy_backend`` and returns the critic's best."""

    def __init__(self, policy_backend: GenerationBackend, critic, num_candidates: int = 4,
                 q_source: Literal["online", "target"] = "online"):
        if num_candidates < 1:
            raise ValueError(f"num_candidates must be >= 1, got {num_candidates}")
        self.inner = policy_backend
        self.critic = critic
        self.num_candidates = num_candidates
        self.q_source = q_source
        self.stats = GenerationStats()
        self.chosen_q: list[float] = []  # Q of every chosen candidate (diagnostics)
        self.q_spread: list[float] = []  # max - min Q over each turn's candidates

    def release(self, keys: Sequence[Hashable]) -> None:
        self.inner.release([(key, j) for key in keys for j in range(self.num_candidates)])

    def generate(self, requests: Sequence[GenerationRequest], params: SamplingParams) -> list[GenerationResult]:
        if self.num_candidates > 1 and params.temperature <= 0:
            raise ValueError("critic re-ranking samples its candidates: set a temperature > 0")
        n = self.num_candidates
        expanded = [GenerationRequest((r.key, j), r.prompt_ids,
                                      None if r.seed is None else request_seed(r.seed, j))
                    for r in requests for j in range(n)]
        candidates = self.inner.generate(expanded, params)
        results = []
        for i, request in enumerate(requests):
            group = candidates[i * n:(i + 1) * n]
            q = critic_q_scores(self.critic, request.prompt_ids, [g.token_ids for g in group], self.q_source)
            best = int(torch.argmax(q))
            self.chosen_q.append(float(q[best]))
            self.q_spread.append(float(q.max() - q.min()))
            results.append(group[best])
        inner = self.inner.stats
        self.stats = GenerationStats(inner.calls, inner.prompt_tokens_encoded, inner.tokens_generated,
                                     inner.cache_rebuilds, inner.seconds)
        return results
