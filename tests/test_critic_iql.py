"""Weighted IQL pieces against hand values and plain-Python loops: expectile loss, w_t, TD targets."""

from __future__ import annotations

import random

import pytest
import torch

from qevolve.config import ConfigError, load_config
from qevolve.critic.config import CriticConfig, WeightingConfig
from qevolve.critic.data import build_samples, monte_carlo_returns, token_budget_batches, transition_weights
from qevolve.critic.iql import expectile_loss, iql_losses, next_state_values
from qevolve.critic.retrospective import RetrospectiveConfig
from qevolve.critic.testing import synthetic_buffer, synthetic_episode


# torch runs on one thread in the tests (tests/conftest.py): tiny tensors, shared CPU.



def test_expectile_loss_hand_values():
    diff = torch.tensor([2.0, -1.0, 0.0, 0.5])
    # |0.7 - 1(x<0)| x^2 -> [0.7*4, 0.3*1, 0, 0.7*0.25]
    torch.testing.assert_close(expectile_loss(diff, 0.7), torch.tensor([2.8, 0.3, 0.0, 0.175]))
    torch.testing.assert_close(expectile_loss(diff, 0.5), 0.5 * diff ** 2)


def test_expectile_minimiser_is_the_expectile():
    # V minimising E[L2_m(q - V)] is the m-expectile: above the mean for m > 0.5.
    q = torch.tensor([0.0, 0.0, 0.0, 1.0])
    v = torch.zeros((), requires_grad=True)
    optimizer = torch.optim.SGD([v], lr=0.5)
    for _ in range(500):
        optimizer.zero_grad()
        expectile_loss(q - v, 0.9).mean().backward()
        optimizer.step()
    # first-order condition: 0.9 * (1 - v) = 0.1 * 3 v  ->  v = 0.9 / 1.2 = 0.75
    assert float(v.detach()) == pytest.approx(0.75, abs=1e-4)


def test_transition_weights_hand_values():
    weighted = WeightingConfig()
    torch.testing.assert_close(transition_weights(4, True, weighted), torch.tensor([1.0, 1.125, 1.25, 1.375]))
    torch.testing.assert_close(transition_weights(4, False, weighted), torch.tensor([0.5, 0.625, 0.75, 0.875]))
    torch.testing.assert_close(transition_weights(1, True, weighted), torch.tensor([1.0]))
    no_time = WeightingConfig(temporal=False)
    torch.testing.assert_close(transition_weights(3, True, no_time), torch.tensor([1.0, 1.0, 1.0]))
    torch.testing.assert_close(transition_weights(3, False, no_time), torch.tensor([0.5, 0.5, 0.5]))
    no_success = WeightingConfig(success=False)
    torch.testing.assert_close(transition_weights(2, True, no_success), torch.tensor([0.5, 0.75]))
    torch.testing.assert_close(transition_weights(5, True, WeightingConfig(scheme="plain")), torch.ones(5))


def test_transition_weights_match_plain_loop():
    rng = random.Random(3)
    for _ in range(50):
        length, success = rng.randint(1, 30), rng.random() < 0.5
        expected = [0.5 * (t / length + (1 if success else 0)) + 0.5 for t in range(length)]
        torch.testing.assert_close(transition_weights(length, success, WeightingConfig()), torch.tensor(expected))
        # bounds from the paper: [0.5, 1) on failures, [1, 1.5) on successes
        w = transition_weights(length, success, WeightingConfig())
        assert (w >= (1.0 if success else 0.5)).all() and (w < (1.5 if success else 1.0)).all()


def test_monte_carlo_returns():
    torch.testing.assert_close(monte_carlo_returns(torch.tensor([-0.1, 0.0, 1.0]), 0.5),
                               torch.tensor([-0.1 + 0.25, 0.5, 1.0]))


def _samples(episodes):
    return build_samples(episodes, RetrospectiveConfig(), WeightingConfig(), gamma=0.9)


def test_build_samples_positions_rewards_and_success():
    rng = random.Random(0)
    episode = synthetic_episode(rng, 0, 3, success=True)
    episode.turns[1].action_valid = False
    (sample,) = _samples([episode])
    (segment,) = sample.segments
    ids = segment.input_ids.tolist()
    start = len(episode.turns[0].context_ids)
    assert segment.value_positions[0] == start - 1
    assert segment.q_positions[0] == start + len(episode.turns[0].action_ids) - 1
    assert ids[int(segment.q_positions[-1])] == episode.turns[-1].action_ids[-1]
    assert segment.q_positions[-1] == len(ids) - 1
    assert sample.aux_rewards.tolist() == pytest.approx([0.0, -0.2, 0.0])
    assert sample.env_rewards.tolist() == [0.0, 0.0, 1.0] and sample.scored
    assert sample.dones.tolist() == [False, False, True]


def test_success_flag_d_comes_from_the_final_score():
    """d = 1 iff the episode's final score is non-zero, whatever the sign of the last turn's reward."""
    rng = random.Random(0)
    # a failure after partial progress, with old dense rewards [0.25, 0, -0.25]: final score 0 -> d = 0
    failed = synthetic_episode(rng, 0, 3, success=False, done=True)
    for turn, reward in zip(failed.turns, [0.25, 0.0, -0.25]):
        turn.reward = reward
    # cut at the turn limit after reaching 0.5, old dense rewards [0.25, 0.25, 0]: final score 0.5 -> d = 1
    truncated = synthetic_episode(rng, 1, 3, success=False)
    for turn, reward in zip(truncated.turns, [0.25, 0.25, 0.0]):
        turn.reward = reward
    truncated.score = 0.5
    first, second = _samples([failed, truncated])
    assert not first.scored and second.scored
    torch.testing.assert_close(first.weights, transition_weights(3, False, WeightingConfig()))
    torch.testing.assert_close(second.weights, transition_weights(3, True, WeightingConfig()))


def test_build_samples_errors_name_the_episode():
    episode = synthetic_episode(random.Random(0), 5, 2, success=False)
    episode.turns[1].action_ids = []
    with pytest.raises(ValueError, match="syn-5.*turn 1: empty action_ids"):
        _samples([episode])
    episode.turns[1].action_ids = None
    with pytest.raises(ValueError, match="syn-5.*tokenise the buffer first"):
        _samples([episode])
    long = synthetic_episode(random.Random(0), 6, 3, success=False)
    with pytest.raises(ValueError, match="syn-6.*more than max_sequence_tokens=4"):
        build_samples([long], RetrospectiveConfig(), WeightingConfig(), 0.9, max_sequence_tokens=4)


def test_next_state_values_done_and_truncated():
    episodes = [synthetic_episode(random.Random(1), 0, 3, success=True),  # done at the end
                synthetic_episode(random.Random(2), 1, 2, success=False),  # truncated
                synthetic_episode(random.Random(3), 2, 1, success=False)]  # length 1, truncated
    samples = _samples(episodes)
    values = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    torch.testing.assert_close(next_state_values(values, samples, "zero"), torch.tensor([2.0, 3.0, 0.0, 5.0, 0.0, 0.0]))
    torch.testing.assert_close(next_state_values(values, samples, "last_value"),
                               torch.tensor([2.0, 3.0, 0.0, 5.0, 5.0, 6.0]))


def test_iql_losses_match_plain_loop():
    episodes = synthetic_buffer(7, seed=4, min_turns=1, max_turns=5)
    episodes[1].turns[0].format_valid = False
    samples = _samples(episodes)
    n = sum(s.num_turns for s in samples)
    gen = torch.Generator().manual_seed(0)
    values, q_values, target_q = torch.randn(n, generator=gen), torch.randn(2, n, generator=gen), torch.randn(n, generator=gen)
    for bootstrap in ("zero", "last_value"):
        losses = iql_losses(values, q_values, target_q, samples, expectile=0.7, gamma=0.9, truncated_bootstrap=bootstrap)
        loss_v = loss_q1 = loss_q2 = 0.0
        i = 0
        for s in samples:
            T = s.num_turns
            d = 1.0 if s.scored else 0.0
            for t in range(T):
                w = 0.5 * (t / T + d) + 0.5
                x = float(target_q[i]) - float(values[i])
                loss_v += w * (0.3 if x < 0 else 0.7) * x * x
                if t + 1 < T:
                    v_next = float(values[i + 1])
                else:
                    v_next = float(values[i]) if bootstrap == "last_value" else 0.0
                if bool(s.dones[t]):
                    v_next = 0.0
                target = float(s.env_rewards[t]) + float(s.aux_rewards[t]) + 0.9 * v_next
                loss_q1 += w * (target - float(q_values[0, i])) ** 2
                loss_q2 += w * (target - float(q_values[1, i])) ** 2
                i += 1
        assert float(losses["loss_v"]) == pytest.approx(loss_v / n, rel=1e-5)
        assert float(losses["loss_q"]) == pytest.approx((loss_q1 + loss_q2) / n, rel=1e-5)


def test_iql_gradients_do_not_flow_into_targets():
    samples = _samples(synthetic_buffer(3, seed=1))
    n = sum(s.num_turns for s in samples)
    values = torch.randn(n, requires_grad=True)
    q_values = torch.randn(1, n, requires_grad=True)
    losses = iql_losses(values, q_values, torch.randn(n), samples, 0.7, 0.99, "zero")
    # V gets gradient only from L_V (the TD target uses a detached V(s_{t+1}))
    grad_v, = torch.autograd.grad(losses["loss_q"], values, allow_unused=True)
    assert grad_v is None or (grad_v == 0).all()


def test_token_budget_batches():
    samples = _samples(synthetic_buffer(6, seed=2))
    lengths = [s.num_tokens for s in samples]
    order = list(range(6))
    budget = max(lengths) * 2
    batches = token_budget_batches(samples, order, budget)
    assert [i for b in batches for i in b] == order
    for batch in batches:
        assert len(batch) == 1 or max(lengths[i] for i in batch) * len(batch) <= budget
    # A restarted episode is several rows: two 2-segment samples do not fit where two 1-segment ones do.
    episodes = [synthetic_episode(random.Random(i), i, 4, success=True) for i in range(2)]
    plain = _samples(episodes)
    budget = 2 * max(s.longest_segment for s in plain)
    assert token_budget_batches(plain, [0, 1], budget) == [[0, 1]]
    for episode in episodes:
        episode.turns[2].info["segment_start"] = True
    split = _samples(episodes)
    assert [len(s.segments) for s in split] == [2, 2]
    assert token_budget_batches(split, [0, 1], 2 * max(s.longest_segment for s in split)) == [[0], [1]]
    assert token_budget_batches(samples, order, 1) == [[i] for i in order]


def test_critic_config_documents_every_field_and_rejects_typos():
    from qevolve.config import describe_config

    rows = describe_config(CriticConfig)
    assert all(description for _, _, _, description in rows)
    assert any(name == "iql.weighting.scheme" for name, *_ in rows)
    with pytest.raises(ConfigError, match="iql.expectile"):
        load_config(CriticConfig, None, ["iql.expectile=1.5"])
    with pytest.raises(ConfigError, match="backbone"):
        load_config(CriticConfig, None, ["backbone=partial"])


def test_shipped_yaml_files_equal_the_defaults():
    from pathlib import Path

    from qevolve.process_rewards.label import LabelConfig

    configs = Path(__file__).resolve().parents[1] / "configs"
    assert load_config(CriticConfig, configs / "critic.yaml") == CriticConfig()
    assert load_config(LabelConfig, configs / "label.yaml") == LabelConfig()
