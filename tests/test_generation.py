"""The HF generation backend on a tiny random Llama: batching and cache reuse change nothing."""

import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from qevolve.rollouts.generation import GenerationRequest, HFGenerationBackend, SamplingParams


@pytest.fixture(scope="module")
def tiny_model():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    return LlamaForCausalLM(config).eval()


def frequent_tokens(model, n=12):
    """Tokens the random model emits often, used as stop tokens so turns end at different lengths."""
    with torch.no_grad():
        logits = model(input_ids=torch.arange(10, 200).unsqueeze(0)).logits[0]
    return logits.argmax(-1).unique()[:n].tolist()


def play(backend, batched, turns=5, seed=0, truncate=False):
    """Four episodes of random 'observations'; episode 1 ends after turn 1."""
    rng = random.Random(seed)
    prompts = {k: [rng.randint(10, 299) for _ in range(rng.randint(3, 12))] for k in range(4)}
    outputs = {k: [] for k in prompts}
    for turn in range(turns):
        keys = list(prompts)
        requests = [GenerationRequest(k, prompts[k]) for k in keys]
        params = SamplingParams(max_new_tokens=7)
        if batched:
            results = backend.generate(requests, params)
        else:
            results = [backend.generate([r], params)[0] for r in requests]
        for k, r in zip(keys, results):
            outputs[k].append((len(prompts[k]), r))  # where the turn starts in the full sequence
            prompts[k] = prompts[k] + r.token_ids + [rng.randint(10, 299) for _ in range(rng.randint(1, 5))]
        if turn == 1:
            backend.release([1])
            del prompts[1]
        if turn == 2 and truncate:
            # episode 2's history is cut (as a prompt budget would): no longer an extension of its cache
            prompts[2] = prompts[2][:3] + prompts[2][-4:]
    return outputs, prompts


def test_batched_cached_equals_one_at_a_time_uncached(tiny_model):
    stops = frequent_tokens(tiny_model)
    fast = HFGenerationBackend(tiny_model, stops, reuse_cache=True)
    slow = HFGenerationBackend(tiny_model, stops, reuse_cache=False)
    a, _ = play(fast, batched=True, truncate=True)
    b, _ = play(slow, batched=False, truncate=True)
    lengths = set()
    for k in a:
        for (_, ra), (_, rb) in zip(a[k], b[k]):
            assert ra.token_ids == rb.token_ids
            assert ra.stopped == rb.stopped
            assert ra.logprobs == pytest.approx(rb.logprobs, abs=1e-4)
            lengths.add(len(ra.token_ids))
    assert len(lengths) > 1, "turns should end at different lengths to exercise the padding"
    # Reuse encodes only the new tokens: far fewer than re-encoding every history.
    assert fast.stats.cache_rebuilds == 1
    assert fast.stats.prompt_tokens_encoded < slow.stats.prompt_tokens_encoded / 2
    # the cache's rows are gathered once, when episode 1 ended; the turns whose batch holds the same
    # episodes in the same order copy nothing
    assert fast.stats.row_selections == 1


def test_a_reordered_batch_gathers_its_rows_and_gets_the_same_turns(tiny_model):
    stops = frequent_tokens(tiny_model)
    backend = HFGenerationBackend(tiny_model, stops)
    fresh = HFGenerationBackend(tiny_model, stops, reuse_cache=False)
    params = SamplingParams(max_new_tokens=6)
    prompts = {k: list(range(20 + k, 30 + 2 * k)) for k in range(3)}
    first = backend.generate([GenerationRequest(k, prompts[k]) for k in range(3)], params)
    follow = {k: prompts[k] + first[k].token_ids + [50 + k, 60] for k in range(3)}
    order = [2, 0, 1]
    again = backend.generate([GenerationRequest(k, follow[k]) for k in order], params)
    assert backend.stats.row_selections == 1 and backend.stats.cache_rebuilds == 1
    for k, result in zip(order, again):
        assert result.token_ids == fresh.generate([GenerationRequest(k, follow[k])], params)[0].token_ids


def test_logprobs_match_a_fresh_forward_pass(tiny_model):
    backend = HFGenerationBackend(tiny_model, frequent_tokens(tiny_model))
    outputs, prompts = play(backend, batched=True, turns=3)
    sequence = prompts[0]  # the whole episode: prompt, turns and observations
    with torch.no_grad():
        logp = torch.log_softmax(tiny_model(input_ids=torch.tensor([sequence])).logits[0].float(), -1)
    for start, result in outputs[0]:  # turn 2 was generated from the reused cache
        assert sequence[start:start + len(result.token_ids)] == result.token_ids
        fresh = [float(logp[start + i - 1, tok]) for i, tok in enumerate(result.token_ids)]
        assert result.logprobs == pytest.approx(fresh, abs=1e-4)


def test_sampling_is_seeded(tiny_model):
    backend = HFGenerationBackend(tiny_model, [0], reuse_cache=False)
    params = SamplingParams(max_new_tokens=8, temperature=1.0, top_p=0.9, seed=3)
    request = [GenerationRequest("a", [11, 12, 13]), GenerationRequest("b", [14, 15])]
    first = [r.token_ids for r in backend.generate(request, params)]
    second = [r.token_ids for r in backend.generate(request, params)]
    assert first == second
    other = [r.token_ids for r in backend.generate(request, SamplingParams(8, 1.0, 0.9, seed=4))]
    assert other != first
    with pytest.raises(ValueError, match="at least one token"):
        backend.generate([GenerationRequest("c", [])], params)


def test_growing_cache_matches_dynamic_cache(tiny_model):
    """The preallocated cache (default) gives the tokens and log-probs of transformers' DynamicCache."""
    stops = frequent_tokens(tiny_model)
    growing = HFGenerationBackend(tiny_model, stops, kv_cache="growing")
    dynamic = HFGenerationBackend(tiny_model, stops, kv_cache="dynamic")
    a, _ = play(growing, batched=True, turns=6, truncate=True)
    b, _ = play(dynamic, batched=True, turns=6, truncate=True)
    for k in a:
        for (_, ra), (_, rb) in zip(a[k], b[k]):
            assert ra.token_ids == rb.token_ids
            assert ra.logprobs == pytest.approx(rb.logprobs, abs=1e-4)
    # it writes in place: far fewer buffers than tokens (one reservation per turn at most)
    layer = growing._cache.layers[0]
    assert layer.key_buffer.shape[2] >= layer.length == growing._mask.shape[1]
    with pytest.raises(ValueError, match="kv_cache 'paged'"):
        HFGenerationBackend(tiny_model, stops, kv_cache="paged")


def test_growing_cache_compacts_padding_and_keeps_results(tiny_model):
    """Rows that stop early leave padding slots; compaction drops them and changes no token."""
    stops = frequent_tokens(tiny_model)
    compacting = HFGenerationBackend(tiny_model, stops)
    compacting.compact_below = 0.99  # compact at almost every turn
    plain = HFGenerationBackend(tiny_model, stops, kv_cache="dynamic")
    a, _ = play(compacting, batched=True, turns=6, truncate=True)
    b, _ = play(plain, batched=True, turns=6, truncate=True)
    assert compacting.stats.compactions > 0
    for k in a:
        for (_, ra), (_, rb) in zip(a[k], b[k]):
            assert ra.token_ids == rb.token_ids
            assert ra.logprobs == pytest.approx(rb.logprobs, abs=1e-4)
    # after compaction the longest row has no padding: the cache is as long as its real tokens
    assert compacting._mask.shape[1] < plain._mask.shape[1]
