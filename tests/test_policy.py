"""Model loading (precision, LoRA, checkpoints), token batches and target-only forward passes."""

from __future__ import annotations

import pytest
import torch

from qevolve.models.loading import ModelConfig, load_policy, resolve_precision
from qevolve.training.batching import TrainSequence, collate, plan_batches
from qevolve.training.forward import target_logprobs, target_nll


def random_sequences(n: int, vocab: int, seed: int = 0) -> list[TrainSequence]:
    g = torch.Generator().manual_seed(seed)
    sequences = []
    for i in range(n):
        length = int(torch.randint(12, 60, (1,), generator=g))
        ids = torch.randint(3, vocab, (length,), generator=g).tolist()
        spans = [(length // 3, length // 3 + 4), (length - 5, length)]
        sequences.append(TrainSequence(ids, spans, episode=i, turns=[0, 1]))
    return sequences


def full_logits_reference(model, sequence: TrainSequence) -> torch.Tensor:
    """log pi of the agent tokens from an ordinary forward pass over one unpadded sequence."""
    ids = torch.tensor([sequence.input_ids])
    logits = model(input_ids=ids).logits[0].float()
    logprobs = torch.log_softmax(logits, -1)
    out = []
    for start, end in sequence.spans:
        for i in range(start, end):
            out.append(logprobs[i - 1, sequence.input_ids[i]])
    return torch.stack(out)


def test_load_tiny_policy_with_lora(tiny_model_dir):
    policy = load_policy(ModelConfig(name_or_path=str(tiny_model_dir), precision="fp32", device="cpu"))
    assert policy.is_lora and policy.precision == "fp32"
    trainable = [n for n, p in policy.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert policy.tokenizer.chat_template
    full = load_policy(ModelConfig(name_or_path=str(tiny_model_dir), precision="bf16", device="cpu",
                                   lora={"enabled": False}))
    assert not full.is_lora
    assert next(full.model.parameters()).dtype == torch.bfloat16
    assert all(p.requires_grad for p in full.model.parameters())
    frozen = load_policy(ModelConfig(name_or_path=str(tiny_model_dir), device="cpu"), trainable=False)
    assert not any(p.requires_grad for p in frozen.model.parameters()) and not frozen.model.training


def test_precision_auto_follows_the_hardware(monkeypatch):
    import qevolve.models.loading as model_module

    monkeypatch.setattr(model_module, "cpu_has_fast_bf16", lambda: True)
    assert resolve_precision("auto", torch.device("cpu")) == "bf16-autocast"
    monkeypatch.setattr(model_module, "cpu_has_fast_bf16", lambda: False)
    assert resolve_precision("auto", torch.device("cpu")) == "fp32"
    assert resolve_precision("bf16", torch.device("cpu")) == "bf16"


def test_bad_model_paths_fail_clearly(tmp_path):
    with pytest.raises(ValueError, match="folder not found"):
        load_policy(ModelConfig(name_or_path="./no/such/model", device="cpu"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="neither config.json"):
        load_policy(ModelConfig(name_or_path=str(tmp_path / "empty"), device="cpu"))


def test_saved_adapter_reloads_with_identical_outputs_and_reference_is_the_base(tiny_model_dir, tmp_path):
    config = ModelConfig(name_or_path=str(tiny_model_dir), precision="fp32", device="cpu")
    policy = load_policy(config)
    with torch.no_grad():  # move the adapters away from their zero initialisation
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    base = load_policy(config.model_copy(update={"lora": config.lora.model_copy(update={"enabled": False})}),
                       trainable=False)
    ids = torch.tensor([[5, 9, 17, 33, 60, 2, 40]])
    policy.model.eval()
    with torch.no_grad():
        tuned = policy.model(input_ids=ids).logits
        with policy.reference() as reference:
            assert torch.equal(reference(input_ids=ids).logits, base.model(input_ids=ids).logits)
        assert not torch.allclose(tuned, base.model(input_ids=ids).logits)
    policy.save(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "adapter_config.json").is_file()
    reloaded = load_policy(ModelConfig(name_or_path=str(tmp_path / "ckpt"), precision="fp32", device="cpu"),
                           trainable=False)
    assert reloaded.is_lora and reloaded.base_source == str(tiny_model_dir)
    with torch.no_grad():
        assert torch.allclose(reloaded.model(input_ids=ids).logits, tuned, atol=1e-6)
    kept = load_policy(ModelConfig(name_or_path=str(tmp_path / "ckpt"), precision="fp32", device="cpu"))
    assert kept.is_lora and any(p.requires_grad for p in kept.model.parameters())  # trains on that adapter
    # merge_adapter: the checkpoint goes into the base, fresh adapters train on top, and the
    # adapter-free reference is the loaded policy; saving writes a whole merged model.
    merged = load_policy(ModelConfig(name_or_path=str(tmp_path / "ckpt"), precision="fp32", device="cpu",
                                     merge_adapter=True))
    assert merged.is_lora and merged.merged
    merged.model.eval()
    with torch.no_grad(), merged.reference() as reference:
        assert torch.allclose(reference(input_ids=ids).logits, tuned, atol=1e-5)
    with torch.no_grad():
        for name, p in merged.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
        twice = merged.model(input_ids=ids).logits
    merged.save(tmp_path / "merged")
    assert (tmp_path / "merged" / "config.json").is_file() and not (tmp_path / "merged" / "adapter_config.json").exists()
    whole = load_policy(ModelConfig(name_or_path=str(tmp_path / "merged"), precision="fp32", device="cpu"),
                        trainable=False)
    with torch.no_grad():
        assert torch.allclose(whole.model(input_ids=ids).logits, twice, atol=1e-5)


@pytest.mark.parametrize("mode", ["pack", "bucket"])
def test_plans_respect_the_budget_and_cover_every_sequence_once(mode):
    sequences = random_sequences(40, 300)
    groups = plan_batches(sequences, tokens_per_batch=150, mode=mode, seed=1)
    assert sorted(i for g in groups for i in g) == list(range(40))
    for group in groups:
        lengths = [len(sequences[i]) for i in group]
        cost = sum(lengths) if mode == "pack" else len(lengths) * max(lengths)
        assert cost <= 150 or len(group) == 1
    assert groups == plan_batches(sequences, 150, mode, seed=1)
    assert groups != plan_batches(sequences, 150, mode, seed=2)


@pytest.mark.parametrize("mode", ["pack", "bucket"])
def test_batched_logprobs_equal_one_sequence_at_a_time(tiny_model_dir, mode):
    """Packing must not let sequences see each other; padding must not change anything."""
    policy = load_policy(ModelConfig(name_or_path=str(tiny_model_dir), precision="fp32", device="cpu"),
                         trainable=False)
    sequences = random_sequences(6, len(policy.tokenizer), seed=3)
    batch = collate(sequences, list(range(6)), mode, pad_id=0)
    assert batch.input_ids.shape[0] == (1 if mode == "pack" else 6)
    assert (batch.attention_mask is None) == (mode == "pack")
    assert batch.num_targets == sum(s.num_targets for s in sequences)
    assert batch.turn_keys == [(i, k) for i in range(6) for k in (0, 1)]
    with torch.no_grad():
        batched = target_logprobs(policy.model, batch)
        reference = torch.cat([full_logits_reference(policy.model, s) for s in sequences])
    assert torch.allclose(batched, reference, atol=1e-5)
    nll, _ = target_nll(policy.model, batch)
    assert torch.allclose(nll, -reference.sum(), atol=1e-3)


def test_target_positions_are_the_tokens_before_each_agent_token():
    seq = TrainSequence([10, 11, 12, 13, 14, 15, 16], [(2, 4), (5, 7)], turns=[0, 1])
    other = TrainSequence([20, 21, 22], [(1, 3)], episode=1, turns=[0])
    batch = collate([seq, other], [0, 1], "pack")
    assert batch.target_index.tolist() == [1, 2, 4, 5, 7, 8]
    assert batch.target_ids.tolist() == [12, 13, 15, 16, 21, 22]
    assert batch.target_turn.tolist() == [0, 0, 1, 1, 2, 2]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4, 5, 6, 0, 1, 2]]
    with pytest.raises(ValueError, match="position 0"):
        collate([TrainSequence([1, 2], [(0, 2)])], [0])


def test_packed_attention_attends_per_sequence_without_a_dense_mask(tiny_model_dir, monkeypatch):
    from qevolve.models import attention

    policy = load_policy(ModelConfig(name_or_path=str(tiny_model_dir), precision="fp32", device="cpu"),
                         trainable=False)
    assert unwrap(policy).config._attn_implementation == attention.PACKED_SDPA
    sequences = random_sequences(3, len(policy.tokenizer), seed=5)
    batch = collate(sequences, [0, 1, 2], "pack")
    assert attention.packed_segments(batch.position_ids) == [
        (sum(len(s) for s in sequences[:i]), sum(len(s) for s in sequences[:i + 1])) for i in range(3)]
    calls = []
    original = attention.F.scaled_dot_product_attention

    def spy(q, k, v, **kwargs):
        calls.append((q.shape[2], kwargs.get("attn_mask") is None, kwargs.get("is_causal")))
        return original(q, k, v, **kwargs)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", spy)
    with torch.no_grad():
        packed = target_logprobs(policy.model, batch)
    lengths = [len(s) for s in sequences]
    assert calls == [(n, True, True) for _ in range(2) for n in lengths]  # 2 layers x 3 causal sequences
    monkeypatch.undo()
    sdpa = load_policy(ModelConfig(name_or_path=str(tiny_model_dir), precision="fp32", device="cpu",
                                   attn_implementation="sdpa"), trainable=False)
    with torch.no_grad():
        assert torch.allclose(packed, target_logprobs(sdpa.model, batch), atol=1e-5)


def test_block_causal_attention_matches_packed_sdpa_in_loss_and_gradients(tiny_model_dir, monkeypatch):
    """The opt-in block_causal attention (compiled blocks of queries on their causal prefix) gives packed_sdpa's
    log-probabilities and LoRA gradients within bf16 rounding, on packed rows and on an unpacked one."""
    from qevolve.models import attention

    monkeypatch.setattr(attention, "CAUSAL_BLOCK", 8)  # tiny sequences: several blocks, a padded last one
    monkeypatch.setattr(attention, "BLOCKS_FROM", 16)
    blocks = []
    original = attention.block_causal_attention

    def spy(q, k, v, scaling=None, block=attention.CAUSAL_BLOCK):
        blocks.append(q.shape[2])
        return original(q, k, v, scaling, block=block)

    monkeypatch.setattr(attention, "block_causal_attention", spy)

    def load(impl):
        torch.manual_seed(0)  # the same LoRA initialisation for both
        return load_policy(ModelConfig(name_or_path=str(tiny_model_dir), precision="bf16-autocast", device="cpu",
                                       attn_implementation=impl), trainable=True)

    ours, reference = load(attention.BLOCK_CAUSAL), load(attention.PACKED_SDPA)
    assert unwrap(ours).config._attn_implementation == attention.BLOCK_CAUSAL
    sequences = random_sequences(3, len(ours.tokenizer), seed=11)
    for batch in (collate(sequences, [0, 1, 2], "pack"), collate(sequences[:1], [0], "bucket")):
        results = []
        for policy in (ours, reference):
            policy.model.zero_grad()
            with policy.autocast():  # as the trainers run it: bf16 matmuls, float32 weights
                logprobs = target_logprobs(policy.model, batch)
            logprobs.sum().backward()
            grads = {n: p.grad.float().clone() for n, p in policy.model.named_parameters() if p.requires_grad}
            results.append((logprobs.detach().float(), grads))
        (got, got_grads), (want, want_grads) = results
        # bf16 attention on both sides, rounded at different points: differences of a few bf16 ulps
        assert (got - want).abs().max() < 0.01, (got - want).abs().max()  # measured 1e-3 (log-probs near -6)
        for name, g in want_grads.items():
            scale = g.abs().max().clamp_min(1e-6)
            assert (got_grads[name] - g).abs().max() / scale < 0.05, name  # measured up to 1.3e-2
    assert blocks and all(n >= 16 for n in blocks)  # every sequence here is long enough for blocks
    assert len(blocks) == 2 * (3 + 1)  # 2 layers x (3 packed sequences + 1 unpacked), packed_sdpa none
    # Acting (bf16 weights, no grad): an unpadded prompt's prefill goes through blocks, decoding with a cache
    # through the fused kernel; the greedy tokens are packed_sdpa's.
    from qevolve.rollouts.generation import GenerationRequest, HFGenerationBackend, SamplingParams

    prompt = list(sequences[0].input_ids)
    tokens = []
    for policy in (ours, reference):
        model = policy.model.to(torch.bfloat16).eval()
        with torch.no_grad():
            result = HFGenerationBackend(model, [1], 0).generate([GenerationRequest(0, prompt)],
                                                                 SamplingParams(max_new_tokens=6))
        tokens.append(result[0].token_ids)
    assert len(blocks) > 2 * (3 + 1) and tokens[0] == tokens[1]


def test_masked_grouped_query_attention_skips_the_key_value_copy(tiny_model_dir, monkeypatch):
    """Padded batches and cached decoding take enable_gqa=True and match transformers' sdpa (values, grads, tokens)."""
    from qevolve.models import attention
    from qevolve.rollouts.generation import GenerationRequest, HFGenerationBackend, SamplingParams

    def load(impl):
        return load_policy(ModelConfig(name_or_path=str(tiny_model_dir), precision="fp32", device="cpu",
                                       attn_implementation=impl, lora={"enabled": False}), trainable=True)

    ours, reference = load(attention.PACKED_SDPA), load("sdpa")
    batch = collate(random_sequences(3, len(ours.tokenizer), seed=7), [0, 1, 2], "bucket")
    assert batch.attention_mask is not None and not bool(batch.attention_mask.all())  # padded rows
    calls = []
    original = attention.F.scaled_dot_product_attention

    def spy(q, k, v, **kwargs):
        calls.append((q.shape[1], k.shape[1], kwargs.get("enable_gqa", False)))
        return original(q, k, v, **kwargs)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", spy)
    got = target_logprobs(ours.model, batch)
    got.sum().backward()
    assert calls and all(kv < q and gqa for q, kv, gqa in calls)  # key/value heads not repeated
    monkeypatch.undo()
    want = target_logprobs(reference.model, batch)
    want.sum().backward()
    assert torch.allclose(got, want, atol=1e-5)
    for (name, a), (_, b) in zip(ours.model.named_parameters(), reference.model.named_parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-5, rtol=1e-4), name
    prompts = [list(s.input_ids) for s in random_sequences(4, len(ours.tokenizer), seed=8)]
    outputs = []
    for policy in (ours, reference):
        backend = HFGenerationBackend(policy.model.eval(), [1], 0)
        first = backend.generate([GenerationRequest(i, p) for i, p in enumerate(prompts)],
                                 SamplingParams(max_new_tokens=6))
        again = backend.generate([GenerationRequest(i, p + r.token_ids + [5, 6]) for i, (p, r)
                                  in enumerate(zip(prompts, first))], SamplingParams(max_new_tokens=6))
        outputs.append([(r.token_ids, r.logprobs) for r in first + again])
    for (ids_a, lp_a), (ids_b, lp_b) in zip(*outputs):
        assert ids_a == ids_b and torch.allclose(torch.tensor(lp_a), torch.tensor(lp_b), atol=1e-4)


def unwrap(policy):
    from qevolve.models.loading import unwrap_model

    return unwrap_model(policy.model)


def test_acting_precision_picks_bf16_weights_where_training_autocasts(monkeypatch):
    import qevolve.models.loading as model_module

    assert ModelConfig(precision="bf16-autocast", device="cpu").for_acting().precision == "bf16"
    assert ModelConfig(precision="fp32", device="cpu").for_acting().precision == "fp32"
    assert ModelConfig(precision="bf16-autocast", device="cpu", acting_precision="same").for_acting().precision \
        == "bf16-autocast"
    assert ModelConfig(precision="bf16", device="cpu", acting_precision="fp32").for_acting().precision == "fp32"
    monkeypatch.setattr(model_module, "cpu_has_fast_bf16", lambda: True)
    assert ModelConfig(device="cpu").for_acting().precision == "bf16"
    monkeypatch.setattr(model_module, "cpu_has_fast_bf16", lambda: False)
    assert ModelConfig(device="cpu").for_acting().precision == "auto"  # resolves to fp32 when loaded


def test_bf16_weights_generate_like_bf16_autocast(tiny_model_dir):
    """Greedy turns with bf16 weights (acting default where training autocasts) match bf16 autocast:
    the same tokens, and log-probs within 0.05 nats (bfloat16 rounding of norms and residuals)."""
    import random

    from qevolve.rollouts.generation import GenerationRequest, HFGenerationBackend, SamplingParams

    outputs = {}
    for acting in ("same", "auto"):
        config = ModelConfig(name_or_path=str(tiny_model_dir), precision="bf16-autocast", device="cpu",
                             acting_precision=acting)
        policy = load_policy(config.for_acting(), trainable=False)
        expected = "bf16-autocast" if acting == "same" else "bf16"
        assert policy.precision == expected
        assert next(policy.model.parameters()).dtype == (torch.float32 if acting == "same" else torch.bfloat16)
        backend = HFGenerationBackend(policy.model, [policy.tokenizer.eos_token_id], 0,
                                      autocast_dtype=torch.bfloat16 if expected == "bf16-autocast" else None)
        rng = random.Random(0)
        requests = [GenerationRequest(k, [rng.randint(3, 380) for _ in range(rng.randint(5, 30))]) for k in range(6)]
        outputs[acting] = backend.generate(requests, SamplingParams(max_new_tokens=12))
    for autocast, weights in zip(outputs["same"], outputs["auto"]):
        assert weights.token_ids == autocast.token_ids
        assert weights.logprobs == pytest.approx(autocast.logprobs, abs=0.05)
