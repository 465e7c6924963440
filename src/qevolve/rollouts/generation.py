"""Generation backends: a batch of token-id prompts in, token ids and their log-probs out.

The interface is deliberately narrow (:class:`GenerationBackend`) so that a vLLM backend can be
added without touching the agent loop. Each request carries a ``key`` (the episode) so a backend
may keep per-episode state between turns.

:class:`HFGenerationBackend` runs a Hugging Face causal LM in-process (CPU or GPU) with its own
decoding loop:

* **Batching.** All pending turns are generated together; each row's new tokens are left-padded
  within the chunk so every row's last position is a real token.
* **Cache reuse across turns** (``reuse_cache=True``). An episode's prompt at turn t+1 extends its
  prompt at turn t by the generated turn and the new observation. The backend keeps the batch's
  key/value cache between calls and feeds only those new tokens, so a turn costs its new tokens
  instead of the whole history. Rows of different lengths coexist through the attention mask:
  padding may sit in the middle of a row (after a row stopped early, or where a shorter chunk was
  left-padded), and position ids count real tokens only, so every row sees exactly the positions
  and attention it would see alone. When the requested keys or prompts do not extend the cached
  rows (a new wave of episodes, a truncated history), the cache is rebuilt from the full prompts.

Log-probs are those of the sampled tokens under the policy's own distribution at temperature 1
(what an importance ratio needs), whatever temperature/top-p was used to sample.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Hashable, Sequence

import torch


@dataclass
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int | None = None


@dataclass
class GenerationRequest:
    key: Hashable  # the episode this prompt belongs to
    prompt_ids: list[int]


@dataclass
class GenerationResult:
    token_ids: list[int]  # generated tokens, including the stop token when one was produced
    logprobs: list[float]  # log pi(token | prefix) at temperature 1, one per token
    stopped: bool  # True when a stop token ended the turn (False: hit max_new_tokens)
    prompt_tokens_encoded: int = 0  # how many prompt tokens were run through the model for this row


@dataclass
class GenerationStats:
    calls: int = 0
    prompt_tokens_encoded: int = 0
    tokens_generated: int = 0
    cache_rebuilds: int = 0
    seconds: float = 0.0


class GenerationBackend(abc.ABC):
    """Generates one agent turn for each of a batch of prompts."""

    stats: GenerationStats

    @abc.abstractmethod
    def generate(self, requests: Sequence[GenerationRequest], params: SamplingParams) -> list[GenerationResult]:
        ...

    def release(self, keys: Sequence[Hashable]) -> None:
        """Forget per-episode state (the episodes ended)."""


@dataclass
class _Row:
    key: Hashable
    tokens: list[int]  # the real tokens this row's cache holds, in order
    next_position: int  # position id of the row's next real token


def _sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    if params.temperature <= 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        cumulative = sorted_probs.cumsum(dim=-1)
        # keep the smallest prefix whose mass reaches top_p (always at least the top token)
        drop = cumulative - sorted_probs >= params.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        choice = torch.multinomial(sorted_probs, 1, generator=generator).squeeze(-1)
        return order.gather(-1, choice.unsqueeze(-1)).squeeze(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


class HFGenerationBackend(GenerationBackend):
    """In-process Hugging Face generation with batch-level KV-cache reuse between turns."""

    def __init__(self, model, stop_token_ids: Sequence[int], pad_token_id: int = 0, reuse_cache: bool = True,
                 autocast_dtype: torch.dtype | None = None):
        self.model = model
        self.stop_token_ids = torch.tensor(sorted(set(stop_token_ids)), dtype=torch.long)
        if not len(self.stop_token_ids):
            raise ValueError("at least one stop token id is needed to end a turn")
        self.pad_token_id = pad_token_id
        self.reuse_cache = reuse_cache
        self.autocast_dtype = autocast_dtype
        self.stats = GenerationStats()
        self._rows: list[_Row] = []
        self._cache = None
        self._mask: torch.Tensor | None = None  # (rows, cached length): 1 where a real token sits

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def release(self, keys: Sequence[Hashable]) -> None:
        gone = set(keys)
        keep = [i for i, row in enumerate(self._rows) if row.key not in gone]
        if len(keep) == len(self._rows):
            return
        if not keep:
            self._reset_cache()
            return
        self._select_rows(keep)

    def _reset_cache(self) -> None:
        self._rows, self._cache, self._mask = [], None, None

    def _select_rows(self, indices: list[int]) -> None:
        index = torch.tensor(indices, dtype=torch.long, device=self.device)
        self._cache.batch_select_indices(index)
        self._mask = self._mask.index_select(0, index)
        self._rows = [self._rows[i] for i in indices]

    def _plan(self, requests: Sequence[GenerationRequest]) -> list[list[int]]:
        """Choose reuse or rebuild; return each request's new tokens to encode."""
        if self.reuse_cache and self._cache is not None:
            position = {row.key: i for i, row in enumerate(self._rows)}
            known = all(r.key in position for r in requests) and len({r.key for r in requests}) == len(requests)
            if known:
                self._select_rows([position[r.key] for r in requests])
                chunks = []
                for i, (request, row) in enumerate(zip(requests, self._rows)):
                    n = len(row.tokens)
                    if len(request.prompt_ids) > n and request.prompt_ids[:n] == row.tokens:
                        chunks.append(request.prompt_ids[n:])
                        continue
                    # This row's prompt no longer extends its cache (its history was truncated):
                    # hide its old entries and encode its whole prompt afresh, positions from 0.
                    self._mask[i].zero_()
                    row.tokens, row.next_position = [], 0
                    chunks.append(list(request.prompt_ids))
                return chunks
        self._reset_cache()
        self.stats.cache_rebuilds += 1
        self._rows = [_Row(r.key, [], 0) for r in requests]
        return [list(r.prompt_ids) for r in requests]

    def _forward(self, input_ids: torch.Tensor, new_mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        from transformers import DynamicCache

        if self._cache is None:
            self._cache = DynamicCache()
            self._mask = new_mask
        else:
            self._mask = torch.cat([self._mask, new_mask], dim=1)
        with torch.autocast(self.device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None):
            out = self.model(input_ids=input_ids, attention_mask=self._mask, position_ids=positions,
                             past_key_values=self._cache, use_cache=True, logits_to_keep=1)
        # The DynamicCache is extended in place by the forward pass.
        return out.logits[:, -1, :].float()

    @torch.inference_mode()
    def generate(self, requests: Sequence[GenerationRequest], params: SamplingParams) -> list[GenerationResult]:
        import time

        started = time.perf_counter()
        if not requests:
            return []
        if any(not r.prompt_ids for r in requests):
            raise ValueError("every prompt needs at least one token")
        chunks = self._plan(requests)
        device = self.device
        batch = len(requests)
        width = max(len(c) for c in chunks)
        ids = torch.full((batch, width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((batch, width), dtype=torch.long)
        positions = torch.zeros((batch, width), dtype=torch.long)
        for i, (chunk, row) in enumerate(zip(chunks, self._rows)):
            n = len(chunk)
            ids[i, width - n:] = torch.tensor(chunk, dtype=torch.long)
            mask[i, width - n:] = 1
            positions[i, width - n:] = torch.arange(row.next_position, row.next_position + n)
            row.tokens.extend(chunk)
            row.next_position += n
        logits = self._forward(ids.to(device), mask.to(device), positions.to(device))
        self.stats.prompt_tokens_encoded += sum(len(c) for c in chunks)

        generator = None
        if params.seed is not None:
            generator = torch.Generator(device="cpu").manual_seed(params.seed)
        stop_ids = self.stop_token_ids
        out_ids: list[list[int]] = [[] for _ in range(batch)]
        out_logprobs: list[list[float]] = [[] for _ in range(batch)]
        live = torch.ones(batch, dtype=torch.bool)
        for step in range(params.max_new_tokens):
            logits_cpu = logits.cpu()
            token = _sample(logits_cpu, params, generator)
            logprob = torch.log_softmax(logits_cpu, dim=-1).gather(-1, token.unsqueeze(-1)).squeeze(-1)
            for i in torch.nonzero(live).flatten().tolist():
                out_ids[i].append(int(token[i]))
                out_logprobs[i].append(float(logprob[i]))
            finished = torch.isin(token, stop_ids) & live
            live &= ~finished
            if not live.any() or step == params.max_new_tokens - 1:
                # The last sampled tokens are not yet in the cache: the next turn's chunk starts with
                # them (their row's tokens list below does not include them).
                break
            # Feed the sampled token of live rows; finished rows get a masked pad that no one sees.
            step_ids = torch.where(live, token, torch.full_like(token, self.pad_token_id)).unsqueeze(1)
            step_mask = live.long().unsqueeze(1)
            step_pos = torch.tensor([row.next_position for row in self._rows], dtype=torch.long).unsqueeze(1)
            for i in torch.nonzero(live).flatten().tolist():
                self._rows[i].tokens.append(int(token[i]))
                self._rows[i].next_position += 1
            logits = self._forward(step_ids.to(device), step_mask.to(device), step_pos.to(device))
        # Rows whose final token was never fed (the stop token, or the max_new_tokens-th token) still
        # hold everything before it; the next call's chunk for that row begins with that token.
        results = []
        for i in range(batch):
            stopped = bool(out_ids[i]) and out_ids[i][-1] in set(stop_ids.tolist())
            results.append(GenerationResult(out_ids[i], out_logprobs[i], stopped, len(chunks[i])))
            self.stats.tokens_generated += len(out_ids[i])
        self.stats.calls += 1
        self.stats.seconds += time.perf_counter() - started
        return results
