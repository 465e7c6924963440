"""Policy losses: BPPO against a hand-computed example, AWR, and a tiny-model direction test."""

from __future__ import annotations

import math

import pytest
import torch

from qevolve.config import ConfigError, load_config
from qevolve.policy.objectives import (ObjectiveConfig, compute_objective, gather_token_logprobs, kl_penalty,

                                       objective_names)


# torch runs on one thread in the tests (tests/conftest.py): tiny tensors, shared CPU.


def _hand_batch():
    # Four action tokens and one masked token, laid out as one row.
    probs = torch.tensor([0.3, 0.2, 0.5, 0.6, 0.1], dtype=torch.float64)
    ratios = torch.tensor([1.5, 0.5, 1.0, 1.2, 9.0], dtype=torch.float64)  # pi_theta / pi_old
    ref_over_theta = torch.tensor([1.0, 2.0, 0.5, 1.0, 9.0], dtype=torch.float64)
    logprobs = probs.log().unsqueeze(0).requires_grad_(True)
    old = (probs / ratios).log().unsqueeze(0)
    ref = (probs * ref_over_theta).log().unsqueeze(0)
    advantages = torch.tensor([[1.0, -1.0, 2.0, -0.5, 100.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    return logprobs, old, ref, advantages, mask


def test_bppo_hand_computed_both_clip_sides_and_kl():
    config = ObjectiveConfig(name="bppo", eps_low=0.2, eps_high=0.1, kl_coef=0.1, kl_estimator="k3")
    logprobs, old, ref, advantages, mask = _hand_batch()
    out = compute_objective(config, logprobs, old, ref, advantages, mask)
    # token 1: A>0, ratio 1.5 clipped to 1.1 -> 1.1;   token 2: A<0, ratio 0.5 clipped to 0.8 -> -0.8
    # token 3: ratio 1 -> 2.0;                          token 4: A<0, ratio 1.2 (not clipped on this side) -> -0.6
    policy = (1.1 - 0.8 + 2.0 - 0.6) / 4
    # k3 = r - 1 - log r with r = ref/theta: [0, 1 - ln 2, -0.5 + ln 2, 0] -> mean 0.5 / 4
    kl = 0.125
    assert out.stats["policy_objective"] == pytest.approx(policy)
    assert out.stats["kl_ref"] == pytest.approx(kl)
    assert float(out.loss.detach()) == pytest.approx(-policy + 0.1 * kl)
    assert out.stats["clip_frac_high"] == pytest.approx(0.25)
    assert out.stats["clip_frac_low"] == pytest.approx(0.25)
    assert out.stats["ratio_mean"] == pytest.approx(1.05)
    assert out.stats["ratio_min"] == pytest.approx(0.5) and out.stats["ratio_max"] == pytest.approx(1.5)
    assert out.stats["action_tokens"] == 4
    expected_kl_old = sum(r - 1 - math.log(r) for r in [1.5, 0.5, 1.0, 1.2]) / 4
    assert out.stats["approx_kl_old"] == pytest.approx(expected_kl_old)

    out.loss.backward()
    # Clipped tokens get no policy gradient; d k3/d logp = 1 - ref/theta; masked tokens get nothing.
    expected = [0.0 + 0.1 * (1 - 1.0) / 4,
                0.0 + 0.1 * (1 - 2.0) / 4,
                -2.0 * 1.0 / 4 + 0.1 * (1 - 0.5) / 4,
                0.5 * 1.2 / 4 + 0.0,
                0.0]
    torch.testing.assert_close(logprobs.grad[0], torch.tensor(expected, dtype=torch.float64))


def test_kl_estimators():
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    assert float(kl_penalty(logp, ref, "k1")) == pytest.approx(math.log(2))
    assert float(kl_penalty(logp, ref, "k2")) == pytest.approx(0.5 * math.log(2) ** 2)
    assert float(kl_penalty(logp, ref, "k3")) == pytest.approx(0.5 - 1 + math.log(2))


def test_awr_hand_computed_weights_and_clamp():
    config = ObjectiveConfig(name="awr", awr_beta=1.0, awr_max_weight=2.0, kl_coef=0.0)
    logprobs, old, _, advantages, mask = _hand_batch()
    out = compute_objective(config, logprobs, old, None, advantages, mask)
    weights = [2.0, math.exp(-1), 2.0, math.exp(-0.5)]
    logps = [math.log(p) for p in [0.3, 0.2, 0.5, 0.6]]
    assert float(out.loss.detach()) == pytest.approx(-sum(w * l for w, l in zip(weights, logps)) / 4)
    assert out.stats["weight_clamp_frac"] == pytest.approx(0.5)
    assert out.stats["weight_max"] == pytest.approx(2.0)
    out.loss.backward()
    # Every weight is positive: AWR raises the probability of every action, bad ones included.
    assert (logprobs.grad[0, :4] < 0).all() and logprobs.grad[0, 4] == 0


def test_config_and_errors():
    assert objective_names() == ["awr", "bppo"]  # DPO, the ETO baseline, has a config of its own
    with pytest.raises(ConfigError, match="name 'dpo': DPO has a config and a command of its own"):
        load_config(ObjectiveConfig, None, ["name=dpo"])
    with pytest.raises(ConfigError, match="name"):
        load_config(ObjectiveConfig, None, ["name=ppo"])
    with pytest.raises(ConfigError, match="eps_low"):
        load_config(ObjectiveConfig, None, ["eps_low=1.5"])
    logprobs, old, _, advantages, mask = _hand_batch()
    with pytest.raises(ValueError, match="ref_logprobs is None but kl_coef > 0"):
        compute_objective(ObjectiveConfig(kl_coef=0.05), logprobs, old, None, advantages, mask)
    with pytest.raises(ValueError, match="advantages: shape"):
        compute_objective(ObjectiveConfig(kl_coef=0.0), logprobs, old, None, advantages[:, :3], mask)


def test_gather_token_logprobs_lines_up_with_input_ids():
    logits = torch.randn(2, 5, 11)
    ids = torch.randint(0, 11, (2, 5))
    out = gather_token_logprobs(logits, ids)
    assert out.shape == (2, 5) and (out[:, 0] == 0).all()
    assert float(out[1, 3]) == pytest.approx(float(torch.log_softmax(logits[1, 2], -1)[ids[1, 3]]), abs=1e-6)


@pytest.mark.parametrize("name", ["bppo", "awr"])
def test_tiny_model_positive_action_rises_negative_falls(name):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2))
    context = [5, 9, 17, 3]
    good, bad = [20, 21, 22], [30, 31, 32]
    ids = torch.tensor([context + good, context + bad])
    mask = torch.tensor([[0] * 4 + [1] * 3, [0] * 4 + [1] * 3])
    advantages = torch.tensor([[1.0] * 7, [-1.0] * 7]) * mask
    with torch.no_grad():
        initial = gather_token_logprobs(model(input_ids=ids).logits, ids)
    config = ObjectiveConfig(name=name, kl_coef=0.02, eps_low=0.8, eps_high=0.4)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(5):
        logprobs = gather_token_logprobs(model(input_ids=ids).logits, ids)
        out = compute_objective(config, logprobs, initial, initial, advantages, mask)
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
    with torch.no_grad():
        final = gather_token_logprobs(model(input_ids=ids).logits, ids)
    change = ((final - initial) * mask).sum(dim=1)
    assert change[0] > 0.05  # the positive-advantage action became more likely
    if name == "bppo":
        assert change[1] < -0.05  # and the negative one less likely
