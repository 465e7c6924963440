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

* **Key/value storage** (``kv_cache``). ``growing`` (the default) keeps each layer's keys and values
  in one preallocated buffer per batch, ``[rows, kv heads, capacity, head dim]``, written in place:
  a generate call reserves room for its whole turn (cached length + new chunk + ``max_new_tokens``)
  up front, and capacity grows geometrically (x1.25), so a turn allocates at most once instead of
  once per generated token. When fewer than half of the cached slots hold real tokens (rows that
  stopped early, truncated histories, left padding), the rows are compacted to their real tokens.
  ``dynamic`` is transformers' ``DynamicCache``, which concatenates (reallocates) every layer's
  whole cache at every generated token; with glibc malloc that churn fragments the heap and grows
  resident memory far beyond the cache itself (see docs/memory.md). Both give the same tokens.

Log-probs are those of the sampled tokens under the policy's own distribution at temperature 1
(what an importance ratio needs), whatever temperature/top-p was used to sample.

The interface used by :mod:`qevolve.rollouts.agent` is :meth:`GenerationBackend.generate` and
:meth:`GenerationBackend.release` plus ``stats``; ``kv_cache`` is a constructor argument of the HF
backend only. A backend that can also generate request by request (the vLLM backend) implements
:class:`StreamingBackend` (``submit``/``poll``/``cancel``), which the agent's continuous schedule uses.
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass
from typing import Hashable, Literal, Sequence

import torch

from qevolve.allocator import release_free_memory

KVCache = Literal["growing", "dynamic"]


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
    # sampled decoding: this request's own seed (the agent derives it from the run's seed, the episode
    # and the turn), so what it draws does not depend on the other requests of its batch; null: the
    # batch-level SamplingParams.seed
    seed: int | None = None


def request_seed(seed: int, *key: Hashable) -> int:
    """A 32-bit seed for one request from a base seed and a key (e.g. the episode id and the turn)."""
    import zlib

    return zlib.crc32("/".join(str(part) for part in (seed, *key)).encode())


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
    compactions: int = 0  # growing cache: times the padding slots were dropped
    row_selections: int = 0  # times the cache's rows were gathered (a row ended, or the batch came reordered)
    seconds: float = 0.0


def has_requests(requests: Sequence[GenerationRequest]) -> bool:
    """False for an empty batch (nothing to generate); a request without prompt tokens is a ValueError."""
    if any(not r.prompt_ids for r in requests):
        raise ValueError("every prompt needs at least one token")
    return bool(requests)


class GenerationBackend(abc.ABC):
    """Generates one agent turn for each of a batch of prompts."""

    stats: GenerationStats

    @abc.abstractmethod
    def generate(self, requests: Sequence[GenerationRequest], params: SamplingParams) -> list[GenerationResult]:
        ...

    def release(self, keys: Sequence[Hashable]) -> None:
        """Forget per-episode state (the episodes ended)."""


class StreamingBackend(GenerationBackend):
    """A backend that also takes requests while others are generating and reports each as it finishes,
    so the agent loop can keep the engine full (``agent.schedule: continuous``).

    ``submit`` queues requests under caller-chosen ids (unique among the requests in flight), ``poll``
    advances generation by one engine step and returns ``(request id, result)`` for the requests that
    finished in it, and ``cancel`` drops whatever is still in flight (a loop that stops early must not
    leave requests behind for the next ``generate``). A result is what ``generate`` would return for
    the same request; ``generate`` may not be called while requests are in flight."""

    @abc.abstractmethod
    def submit(self, requests: Sequence[GenerationRequest], params: SamplingParams,
               request_ids: Sequence[str]) -> None:
        ...

    @abc.abstractmethod
    def poll(self) -> list[tuple[str, GenerationResult]]:
        ...

    @abc.abstractmethod
    def cancel(self) -> None:
        ...


@dataclass
class _Row:
    key: Hashable
    tokens: list[int]  # the real tokens this row's cache holds, in order
    next_position: int  # position id of the row's next real token


def _growing_cache_class():
    """The preallocated cache classes, built on transformers' cache API (imported lazily)."""
    from transformers.cache_utils import Cache, DynamicLayer

    class GrowingLayer(DynamicLayer):
        """One layer's keys/values in a buffer of ``capacity`` slots; ``keys``/``values`` are views of the used part."""

        def __init__(self, owner: "GrowingCache"):
            super().__init__()
            self.owner = owner
            self.key_buffer: torch.Tensor | None = None
            self.value_buffer: torch.Tensor | None = None
            self.length = 0

        def lazy_initialization(self, key_states, value_states) -> None:
            self.device = key_states.device
            self.is_initialized = True

        def _set_views(self) -> None:
            if self.key_buffer is None:
                self.keys = self.values = None
                return
            self.keys = self.key_buffer[:, :, : self.length]
            self.values = self.value_buffer[:, :, : self.length]

        def _resize(self, capacity: int, like: torch.Tensor) -> None:
            shape = (*like.shape[:2], capacity, like.shape[-1])
            keys = torch.empty(shape, dtype=like.dtype, device=like.device)
            values = torch.empty(shape, dtype=like.dtype, device=like.device)
            if self.length:
                keys[:, :, : self.length].copy_(self.key_buffer[:, :, : self.length])
                values[:, :, : self.length].copy_(self.value_buffer[:, :, : self.length])
            self.key_buffer, self.value_buffer = keys, values

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            end = self.length + key_states.shape[-2]
            capacity = 0 if self.key_buffer is None else self.key_buffer.shape[-2]
            if end > capacity:
                self._resize(self.owner.capacity_for(end, capacity), key_states)
            self.key_buffer[:, :, self.length:end].copy_(key_states)
            self.value_buffer[:, :, self.length:end].copy_(value_states)
            self.length = end
            self._set_views()
            return self.keys, self.values

        def get_seq_length(self) -> int:
            return self.length

        def batch_select_indices(self, indices: torch.Tensor) -> None:
            if self.key_buffer is not None:
                self.key_buffer = self.key_buffer.index_select(0, indices.to(self.key_buffer.device))
                self.value_buffer = self.value_buffer.index_select(0, indices.to(self.value_buffer.device))
                self._set_views()

        def gather_slots(self, index: torch.Tensor, capacity: int) -> None:
            """Keep, per row, the slots ``index[row]`` (``[rows, n]``), in a buffer of ``capacity`` slots."""
            if self.key_buffer is None:
                return
            rows, heads, _, dim = self.key_buffer.shape
            n = index.shape[1]
            expanded = index.to(self.key_buffer.device)[:, None, :, None].expand(rows, heads, n, dim)
            keys = self.key_buffer.new_empty((rows, heads, capacity, dim))
            values = self.value_buffer.new_empty((rows, heads, capacity, dim))
            torch.gather(self.key_buffer[:, :, : self.length], 2, expanded, out=keys[:, :, :n])
            torch.gather(self.value_buffer[:, :, : self.length], 2, expanded, out=values[:, :, :n])
            self.key_buffer, self.value_buffer, self.length = keys, values, n
            self._set_views()

        def reset(self) -> None:
            self.key_buffer = self.value_buffer = None
            self.length = 0
            super().reset()

        def crop(self, tokens_to_remove: int) -> None:
            raise NotImplementedError("the growing cache is not croppable")

    class GrowingCache(Cache):
        """A cache of :class:`GrowingLayer`; ``reserve`` sizes every layer's buffer for the coming tokens."""

        growth = 1.25  # capacity grows to at least this multiple of the old one
        block = 64  # capacities are multiples of this many slots

        def __init__(self):
            self.reserved = 0
            super().__init__(layer_class_to_replicate=lambda: GrowingLayer(self))

        def capacity_for(self, needed: int, current: int) -> int:
            target = max(needed, self.reserved, math.ceil(current * self.growth) if current else 0)
            return -(-target // self.block) * self.block

        def reserve(self, length: int) -> None:
            """The next writes will reach ``length`` slots: a layer that must grow grows to at least that."""
            self.reserved = length

        def gather_slots(self, index: torch.Tensor, capacity: int) -> None:
            for layer in self.layers:
                layer.gather_slots(index, capacity)

    return GrowingCache


_GROWING_CACHE = None


def new_growing_cache():
    """A preallocated, geometrically growing key/value cache (see the module docstring)."""
    global _GROWING_CACHE
    if _GROWING_CACHE is None:
        _GROWING_CACHE = _growing_cache_class()
    return _GROWING_CACHE()


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

    compact_below = 0.5  # compact the cache when fewer than this fraction of its slots hold real tokens

    def __init__(self, model, stop_token_ids: Sequence[int], pad_token_id: int = 0, reuse_cache: bool = True,
                 autocast_dtype: torch.dtype | None = None, kv_cache: KVCache = "growing"):
        if kv_cache not in ("growing", "dynamic"):
            raise ValueError(f"kv_cache {kv_cache!r}: expected 'growing' or 'dynamic'")
        self.model = model
        self.kv_cache = kv_cache
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
        had_cache = self._cache is not None
        self._rows, self._cache, self._mask = [], None, None
        if had_cache and self.kv_cache == "growing":
            release_free_memory()  # the freed buffers of a whole batch go back to the system

    def _compact(self, reserve: int) -> None:
        """Drop the padding slots of every row (growing cache only): keep each row's real tokens, in order."""
        mask = self._mask.bool()
        counts = mask.sum(dim=1)
        length = int(counts.max())
        # Row i keeps its real slots right-aligned; the left part repeats slot 0 and is masked out.
        order = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)  # real slots first, in order
        shift = (length - counts).unsqueeze(1)
        columns = torch.arange(length, device=mask.device).unsqueeze(0)
        source = columns - shift
        index = torch.where(source >= 0, order.gather(1, source.clamp(min=0)), torch.zeros_like(source))
        self._cache.gather_slots(index, self._cache.capacity_for(length + reserve, 0))
        self._mask = (source >= 0).to(self._mask.dtype)
        self.stats.compactions += 1
        release_free_memory()

    def _select_rows(self, indices: list[int]) -> None:
        if indices == list(range(len(self._rows))):
            # The same rows in the same order: gathering would copy the whole cache (every layer's keys and
            # values, about 1 s per call at 25 rows of 2k tokens in fp32 on 2 cores) to change nothing.
            return
        self.stats.row_selections += 1
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

    def _new_cache(self, batch: int) -> None:
        if self.kv_cache == "growing":
            self._cache = new_growing_cache()
        else:
            from transformers import DynamicCache

            self._cache = DynamicCache()
        self._mask = torch.zeros((batch, 0), dtype=torch.long, device=self.device)

    def _forward(self, input_ids: torch.Tensor, new_mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
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
        if not has_requests(requests):
            return []
        chunks = self._plan(requests)
        device = self.device
        batch = len(requests)
        width = max(len(c) for c in chunks)
        if self._cache is None:
            self._new_cache(batch)
        if self.kv_cache == "growing":
            cached = self._mask.shape[1]
            if cached and int(self._mask.sum()) < self.compact_below * cached * batch:
                self._compact(width + params.max_new_tokens)
            self._cache.reserve(self._mask.shape[1] + width + params.max_new_tokens)
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

        generator, row_generators = None, None
        if params.temperature > 0 and any(r.seed is not None for r in requests):
            row_generators = [torch.Generator(device="cpu").manual_seed(
                r.seed if r.seed is not None else request_seed(params.seed or 0, r.key)) for r in requests]
        elif params.seed is not None:
            generator = torch.Generator(device="cpu").manual_seed(params.seed)
        stop_ids = self.stop_token_ids
        out_ids: list[list[int]] = [[] for _ in range(batch)]
        out_logprobs: list[list[float]] = [[] for _ in range(batch)]
        live = torch.ones(batch, dtype=torch.bool)
        for step in range(params.max_new_tokens):
            logits_cpu = logits.cpu()
            if row_generators is None:
                token = _sample(logits_cpu, params, generator)
            else:  # each row from its own generator: a row's draws do not depend on its batch
                token = torch.cat([_sample(logits_cpu[i:i + 1], params, g) for i, g in enumerate(row_generators)])
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
