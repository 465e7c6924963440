"""Retrospective r_aux labels and the advantage estimators (against hand values and a plain loop)."""

from __future__ import annotations

import math
import random
from collections import Counter

import numpy as np
import pytest

from qevolve.buffer.store import Episode, Turn
from qevolve.process_rewards.advantages import (TrajectoryValues, advantage_estimators, estimate_advantages,
                                                estimator_needs_critic, gae, get_advantage_estimator, standardize)
from qevolve.config import ConfigError, load_config
from qevolve.critic.retrospective import AuxPenalties, RetrospectiveConfig, aux_rewards, label_retrospective
from qevolve.process_rewards.label import LabelConfig


# ------------------------------------------------------------------------------------ retrospective


def _episode(env: str, turns: list[tuple[str, bool, bool]], final: str) -> Episode:
    return Episode(episode_id="e", task_id="t", env=env, split="train", source="self", final_observation=final,
                   turns=[Turn(observation=o, agent_text="x", action=None if not f else "a",
                               format_valid=f, action_valid=v) for o, f, v in turns])


def test_retrospective_cases_and_priority_alfworld():
    episode = _episode("alfworld", [
        ("start", True, True),          # -> "room": changes, valid: 0
        ("room", True, False),          # invalid action -> "Nothing happens.": -0.2
        ("Nothing happens.", False, False),  # format error (also invalid and repeat): -0.3 wins
        ("Nothing happens.", True, True),    # valid, next obs equals this one: repeat -0.1
        ("Nothing happens. ", True, True),   # the final observation differs: 0
    ], final="You win.")
    assert aux_rewards(episode, RetrospectiveConfig()) == [0.0, -0.2, -0.3, -0.1, 0.0]


def test_retrospective_webshop_values_and_switch_off():
    episode = _episode("webshop", [("a", True, False), ("a", False, True), ("b", True, True)], final="b")
    assert aux_rewards(episode, RetrospectiveConfig()) == [0.0, -0.3, 0.0]
    assert aux_rewards(episode, RetrospectiveConfig(enabled=False)) == [0.0, 0.0, 0.0]
    sciworld = _episode("sciworld", [("a", True, False), ("b", True, True)], final="b")
    assert aux_rewards(sciworld, RetrospectiveConfig()) == [-0.2, -0.1]
    custom = RetrospectiveConfig(penalties={"sciworld": AuxPenalties(format_error=-1.0, invalid_action=-0.5, repeat=0)})
    assert aux_rewards(sciworld, custom) == [-0.5, 0.0]
    labelled = label_retrospective([sciworld], RetrospectiveConfig())
    assert [t.r_aux for t in labelled[0].turns] == [-0.2, -0.1]


def test_retrospective_unknown_env_is_a_named_error():
    with pytest.raises(ValueError, match="no entry for environment 'babyai'"):
        aux_rewards(_episode("babyai", [("a", True, True)], final="b"), RetrospectiveConfig())


def test_retrospective_config_from_yaml_overrides(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("enabled: true\npenalties:\n  alfworld: {format_error: -1.0}\n")
    config = load_config(RetrospectiveConfig, path, ["penalties.alfworld.repeat=-0.05"])
    assert config.penalties["alfworld"].format_error == -1.0
    assert config.penalties["alfworld"].repeat == -0.05
    assert config.penalties["alfworld"].invalid_action == -0.2
    with pytest.raises(ConfigError, match="penalties.alfworld.typo"):
        load_config(RetrospectiveConfig, None, ["penalties.alfworld.typo=1"])


# ------------------------------------------------------------------------------------ advantages


def test_gae_hand_computed_done_and_truncated():
    values = np.array([0.5, 0.6, 0.8])
    done = TrajectoryValues(np.array([0.0, 0.0, 1.0]), np.zeros(3), values, np.zeros(3), np.array([False, False, True]),
                            bootstrap_value=123.0)  # ignored: the last turn is done
    # delta = [0.9*0.6-0.5, 0.9*0.8-0.6, 1-0.8] = [0.04, 0.12, 0.2]; A_t = delta_t + 0.45 A_{t+1}
    np.testing.assert_allclose(get_advantage_estimator("gae_env")(done, 0.9, 0.5), [0.1345, 0.21, 0.2])
    truncated = TrajectoryValues(np.zeros(3), np.zeros(3), values, np.zeros(3), np.zeros(3, dtype=bool),
                                 bootstrap_value=0.7)
    # last delta = 0 + 0.9*0.7 - 0.8 = -0.17; A1 = 0.12 + 0.45*-0.17 = 0.0435; A0 = 0.04 + 0.45*0.0435
    np.testing.assert_allclose(get_advantage_estimator("gae_env")(truncated, 0.9, 0.5),
                               [0.04 + 0.45 * 0.0435, 0.0435, -0.17])
    np.testing.assert_allclose(get_advantage_estimator("td1")(truncated, 0.9, 0.5), [0.04, 0.12, -0.17])


def test_gae_length_one():
    one = TrajectoryValues(np.array([1.0]), np.array([-0.3]), np.array([0.25]), np.array([0.9]), np.array([True]))
    assert get_advantage_estimator("gae_env")(one, 0.99, 0.95) == pytest.approx([0.75])
    assert get_advantage_estimator("gae_env_aux")(one, 0.99, 0.95) == pytest.approx([0.45])
    assert get_advantage_estimator("q_minus_v")(one, 0.99, 0.95) == pytest.approx([0.65])
    cut = TrajectoryValues(np.array([0.0]), np.array([0.0]), np.array([0.25]), np.array([0.0]), np.array([False]),
                           bootstrap_value=0.5)
    assert get_advantage_estimator("gae_env")(cut, 0.5, 0.95) == pytest.approx([0.0])


def _plain_loop_advantages(trajectories, gamma, lam, use_aux):
    """CleanRL-style: one flat stream of steps, walked backwards, episode boundaries by flags."""
    rewards, values, dones, last_of_episode, bootstrap = [], [], [], [], []
    for traj in trajectories:
        for t in range(len(traj.values)):
            rewards.append(traj.env_rewards[t] + (traj.aux_rewards[t] if use_aux else 0.0))
            values.append(traj.values[t])
            dones.append(bool(traj.dones[t]))
            last_of_episode.append(t == len(traj.values) - 1)
            bootstrap.append(traj.bootstrap_value)
    advantages = [0.0] * len(rewards)
    lastgaelam = 0.0
    for i in reversed(range(len(rewards))):
        nextnonterminal = 0.0 if dones[i] else 1.0
        if last_of_episode[i]:
            nextvalues = bootstrap[i]
            lastgaelam = 0.0  # no advantage flows in from the next episode
        else:
            nextvalues = values[i + 1]
        delta = rewards[i] + gamma * nextvalues * nextnonterminal - values[i]
        lastgaelam = delta + gamma * lam * nextnonterminal * lastgaelam
        advantages[i] = lastgaelam
    return advantages


def _random_trajectories(rng: random.Random, count: int) -> list[TrajectoryValues]:
    out = []
    for _ in range(count):
        length = rng.choice([1, 1, 2, 3, 7, 30])
        done = rng.random() < 0.5
        env = [0.0] * length
        if done:
            env[-1] = rng.choice([0.0, 1.0, 0.37])
        out.append(TrajectoryValues(
            env_rewards=np.array(env), aux_rewards=np.array([rng.choice([0, -0.1, -0.2, -0.3]) for _ in range(length)]),
            values=np.array([rng.uniform(-1, 1) for _ in range(length)]),
            q_values=np.array([rng.uniform(-1, 1) for _ in range(length)]),
            dones=np.array([False] * (length - 1) + [done]), bootstrap_value=rng.uniform(-1, 1)))
    return out


@pytest.mark.parametrize("gamma,lam", [(0.99, 0.95), (0.9, 0.0), (1.0, 1.0), (0.5, 0.7)])
def test_estimators_match_plain_loop_on_random_trajectories(gamma, lam):
    trajectories = _random_trajectories(random.Random(7), 40)
    assert any(len(t.values) == 1 for t in trajectories) and any(not t.dones[-1] for t in trajectories)
    for name, use_aux, lam_used in [("gae_env", False, lam), ("gae_env_aux", True, lam), ("td1", False, 0.0)]:
        fn = get_advantage_estimator(name)
        ours = np.concatenate([fn(t, gamma, lam) for t in trajectories])
        np.testing.assert_allclose(ours, _plain_loop_advantages(trajectories, gamma, lam_used, use_aux),
                                   rtol=1e-12, atol=1e-12)
    ours = np.concatenate([get_advantage_estimator("q_minus_v")(t, gamma, lam) for t in trajectories])
    np.testing.assert_allclose(ours, np.concatenate([t.q_values - t.values for t in trajectories]))
    ours = [get_advantage_estimator("outcome")(t, gamma, lam) for t in trajectories]
    for advantages, trajectory in zip(ours, trajectories):  # the return on every turn, whatever V says
        assert advantages.shape == trajectory.values.shape
        np.testing.assert_allclose(advantages, sum(trajectory.env_rewards), rtol=0, atol=0)


def test_gae_lambda_one_is_monte_carlo_minus_value():
    rng = np.random.default_rng(0)
    rewards, values = rng.normal(size=6), rng.normal(size=6)
    dones = np.array([False] * 5 + [True])
    next_values = np.append(values[1:], 0.0)
    returns = [sum(0.9 ** k * rewards[t + k] for k in range(6 - t)) for t in range(6)]
    np.testing.assert_allclose(gae(rewards, values, next_values, dones, 0.9, 1.0), np.array(returns) - values)


def test_registry_and_standardize():
    assert advantage_estimators() == ["gae_env", "gae_env_aux", "gigpo", "grpo", "outcome", "q_minus_v", "rloo",
                                      "td1"]
    with pytest.raises(ValueError, match="advantage estimator 'gae'"):
        get_advantage_estimator("gae")
    out = standardize([np.array([1.0, 2.0]), np.array([3.0])])
    flat = np.concatenate(out)
    assert flat.mean() == pytest.approx(0.0, abs=1e-12) and flat.std() == pytest.approx(1.0, rel=1e-6)
    assert out[0][0] == pytest.approx(-math.sqrt(1.5))


def test_label_config_validates_estimator_name():
    assert LabelConfig().estimator == "gae_env"
    with pytest.raises(ConfigError, match="estimator"):
        load_config(LabelConfig, None, ["estimator=gea_env"])
    with pytest.raises(ConfigError, match="truncated_bootstrap"):
        load_config(LabelConfig, None, ["truncated_bootstrap=one"])


def test_trajectory_values_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="share one non-zero length"):
        TrajectoryValues(np.zeros(2), np.zeros(3), np.zeros(2), np.zeros(2), np.zeros(2, dtype=bool))


# ------------------------------------------------------------------------------------ group estimators


def _plain_group_advantages(returns: list[float], groups: list[int], kind: str, eps: float) -> list[float]:
    """GRPO and RLOO written as plain loops over each trajectory's group."""
    out = []
    for i, (r, g) in enumerate(zip(returns, groups)):
        others = [returns[j] for j in range(len(returns)) if groups[j] == g and j != i]
        if not others:
            out.append(0.0)
            continue
        members = others + [r]
        mean = sum(members) / len(members)
        if kind == "grpo":
            std = math.sqrt(sum((x - mean) ** 2 for x in members) / (len(members) - 1))
            out.append((r - mean) / (std + eps))
        else:
            out.append(r - sum(others) / len(others))
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_group_estimators_match_a_plain_loop_on_random_batches(kind, seed):
    rng = random.Random(seed)
    trajectories = _random_trajectories(rng, 30)
    groups = [rng.randrange(8) for _ in trajectories]  # some groups of one, some of several
    groups[0] = 99  # at least one lone trajectory
    advantages = estimate_advantages(kind, trajectories, groups, 0.99, 0.95, eps=1e-6)
    want = _plain_group_advantages([float(sum(t.env_rewards)) for t in trajectories], groups, kind, 1e-6)
    for adv, traj, value in zip(advantages, trajectories, want):
        assert adv.shape == traj.values.shape
        np.testing.assert_allclose(adv, value, rtol=1e-12, atol=1e-12)  # the same value on every turn
    assert np.all(advantages[0] == 0.0)
    # V, Q, r_aux, gamma and lambda play no part
    shuffled = [TrajectoryValues(t.env_rewards, -t.aux_rewards, t.values + 5, -t.q_values, t.dones, 3.0)
                for t in trajectories]
    again = estimate_advantages(kind, shuffled, groups, 0.5, 0.1, eps=1e-6)
    assert all(np.array_equal(a, b) for a, b in zip(advantages, again))


def test_group_estimators_on_hand_values_and_groups_of_one():
    def traj(reward: float, turns: int = 2) -> TrajectoryValues:
        env = np.zeros(turns)
        env[-1] = reward
        return TrajectoryValues(env, np.zeros(turns), np.zeros(turns), np.zeros(turns),
                                np.array([False] * (turns - 1) + [True]))

    batch = [traj(1.0), traj(0.0, 3), traj(0.0), traj(0.5, 1), traj(1.0), traj(1.0)]
    groups = ["a", "a", "a", "b", "c", "c"]
    grpo = estimate_advantages("grpo", batch, groups, 1.0, 1.0, eps=1e-6)
    # group a: returns 1, 0, 0; mean 1/3, sample std sqrt(1/3)
    assert grpo[0] == pytest.approx([(2 / 3) / (math.sqrt(1 / 3) + 1e-6)] * 2)
    assert grpo[1] == pytest.approx([(-1 / 3) / (math.sqrt(1 / 3) + 1e-6)] * 3)
    assert list(grpo[3]) == [0.0]  # a group of one: no comparison, no push
    assert list(grpo[4]) == list(grpo[5]) == [0.0, 0.0]  # all returns equal: 0, not 0 / 0
    rloo = estimate_advantages("rloo", batch, groups, 1.0, 1.0)
    assert rloo[0] == pytest.approx([1.0, 1.0]) and rloo[1] == pytest.approx([-0.5] * 3)
    assert list(rloo[3]) == [0.0] and list(rloo[4]) == [0.0, 0.0]
    # the group-normalised advantages of a group sum to 0 over its trajectories
    assert sum(a[0] for a, g in zip(grpo, groups) if g == "a") == pytest.approx(0.0, abs=1e-12)
    # no group ids: each trajectory its own group
    assert all(np.all(a == 0) for a in estimate_advantages("grpo", batch, None, 1.0, 1.0))
    with pytest.raises(ValueError, match="2 group ids for 6 trajectories"):
        estimate_advantages("grpo", batch, ["a", "b"], 1.0, 1.0)


def test_which_estimators_need_a_critic_and_which_have_a_per_trajectory_form():
    assert {name: estimator_needs_critic(name) for name in advantage_estimators()} == {
        "gae_env": True, "gae_env_aux": True, "td1": True, "q_minus_v": True,
        "outcome": False, "grpo": False, "rloo": False, "gigpo": False}
    for name in ("grpo", "rloo", "gigpo"):
        with pytest.raises(ValueError, match="compares the trajectories of a group"):
            get_advantage_estimator(name)
    # the per-trajectory estimators keep working through the batch form, unchanged
    trajectories = _random_trajectories(random.Random(3), 10)
    ours = estimate_advantages("gae_env", trajectories, ["x"] * 10, 0.9, 0.8)
    for adv, traj in zip(ours, trajectories):
        np.testing.assert_array_equal(adv, get_advantage_estimator("gae_env")(traj, 0.9, 0.8))


# ------------------------------------------------------------------------------------ gigpo


def _plain_gigpo(trajectories: list[TrajectoryValues], groups: list, gamma: float, weight: float, norm: str,
                 eps: float) -> list[list[float]]:
    """GiGPO written as plain loops: for every turn, its episode group and its step group are looked up by
    scanning the whole batch; returns-to-go are explicit sums of gamma^(k-t) r_k."""
    def relative(x: float, members: list[float]) -> float:
        if len(members) < 2:
            return 0.0
        mean = sum(members) / len(members)
        if norm == "mean":
            return x - mean
        std = math.sqrt(sum((m - mean) ** 2 for m in members) / (len(members) - 1))
        return (x - mean) / (std + eps)

    def to_go(j: int, k: int) -> float:
        rewards = trajectories[j].env_rewards
        return sum(gamma ** (n - k) * float(rewards[n]) for n in range(k, len(rewards)))

    returns = [sum(float(r) for r in traj.env_rewards) for traj in trajectories]
    out = []
    for i, traj in enumerate(trajectories):
        episode = relative(returns[i], [returns[j] for j in range(len(trajectories)) if groups[j] == groups[i]])
        row = []
        for t, observation in enumerate(traj.observations):
            same_state = [to_go(j, k) for j, other in enumerate(trajectories) if groups[j] == groups[i]
                          for k, seen in enumerate(other.observations) if seen == observation]
            row.append(episode + weight * relative(to_go(i, t), same_state))
        out.append(row)
    return out


def _with_observations(rng: random.Random, trajectories: list[TrajectoryValues]) -> list[TrajectoryValues]:
    """The trajectories with observations drawn from a few states, so that turns of a group, of different
    trajectories and of the same one, share them (and some turns see a state no other turn sees)."""
    out = []
    for traj in trajectories:
        rewards = np.array(traj.env_rewards)
        rewards[:-1] = [rng.choice([0.0, 0.0, 0.25, -0.5]) for _ in range(len(rewards) - 1)]  # some dense rewards
        observations = ["start"] + [rng.choice(["a", "b", "c", f"rare {rng.random()}"]) for _ in range(len(rewards) - 1)]
        out.append(TrajectoryValues(rewards, traj.aux_rewards, traj.values, traj.q_values, traj.dones,
                                    traj.bootstrap_value, observations=observations))
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("gamma,weight,norm", [(0.95, 1.0, "std"), (1.0, 0.5, "std"), (0.8, 2.0, "mean"),
                                               (0.0, 1.0, "std")])
def test_gigpo_matches_a_plain_loop_on_random_batches_with_repeated_observations(seed, gamma, weight, norm):
    rng = random.Random(seed)
    trajectories = _with_observations(rng, _random_trajectories(rng, 30))
    groups = [rng.randrange(4) for _ in trajectories]
    groups[0] = 99  # a lone trajectory
    ours = estimate_advantages("gigpo", trajectories, groups, gamma, 0.3, eps=1e-6,
                               options={"step_weight": weight, "norm": norm})
    want = _plain_gigpo(trajectories, groups, gamma, weight, norm, 1e-6)
    for adv, traj, row in zip(ours, trajectories, want):
        assert adv.shape == traj.values.shape
        np.testing.assert_allclose(adv, row, rtol=1e-9, atol=1e-9)
    # the batch had step groups of several turns and of one
    keys = Counter((g, o) for traj, g in zip(trajectories, groups) for o in traj.observations)
    assert max(keys.values()) > 2 and min(keys.values()) == 1
    # V, Q, r_aux, lambda and the order of the batch play no part
    order = list(range(len(trajectories)))
    rng.shuffle(order)
    moved = [TrajectoryValues(trajectories[i].env_rewards, -trajectories[i].aux_rewards, trajectories[i].values + 5,
                              -trajectories[i].q_values, trajectories[i].dones, 3.0, trajectories[i].observations)
             for i in order]
    again = estimate_advantages("gigpo", moved, [groups[i] for i in order], gamma, 0.9, eps=1e-6,
                                options={"step_weight": weight, "norm": norm})
    for adv, i in zip(again, order):
        np.testing.assert_allclose(adv, ours[i], rtol=1e-12, atol=1e-12)


def test_gigpo_on_hand_values():
    """Two episodes of one task share their first observation: won (reward 1 after turn 2) and lost."""
    def traj(rewards: list[float], observations: list[str]) -> TrajectoryValues:
        n = len(rewards)
        return TrajectoryValues(np.array(rewards), np.zeros(n), np.zeros(n), np.zeros(n),
                                np.array([False] * (n - 1) + [True]), observations=observations)

    batch = [traj([0.0, 1.0], ["start", "kitchen"]), traj([0.0, 0.0], ["start", "hall"])]
    eps, gamma = 1e-6, 0.95
    ours = estimate_advantages("gigpo", batch, ["t", "t"], gamma, 0.95, eps=eps)  # defaults: omega 1, std
    # episode level = grpo: returns 1 and 0, mean 1/2, sample std sqrt(1/2)
    episode = 0.5 / (math.sqrt(0.5) + eps)
    # step level at "start": returns-to-go 0.95 and 0, mean 0.475, sample std 0.95 / sqrt(2)
    step = 0.475 / (0.95 / math.sqrt(2) + eps)
    assert ours[0] == pytest.approx([episode + step, episode], abs=1e-12)  # "kitchen" was seen once: no step term
    assert ours[1] == pytest.approx([-episode - step, -episode], abs=1e-12)
    mean_only = estimate_advantages("gigpo", batch, ["t", "t"], gamma, 0.95, eps=eps,
                                    options={"step_weight": 0.5, "norm": "mean"})
    assert mean_only[0] == pytest.approx([0.5 + 0.5 * 0.475, 0.5]) and mean_only[1] == pytest.approx([-0.7375, -0.5])
    # omega 0 is grpo, to the bit
    grpo = estimate_advantages("grpo", batch, ["t", "t"], gamma, 0.95, eps=eps)
    zero = estimate_advantages("gigpo", batch, ["t", "t"], gamma, 0.95, eps=eps, options={"step_weight": 0.0})
    assert all(np.array_equal(a, b) for a, b in zip(zero, grpo))
    # grpo reads none of gigpo's options
    assert all(np.array_equal(a, b) for a, b in zip(
        grpo, estimate_advantages("grpo", batch, ["t", "t"], gamma, 0.95, eps=eps, options={"step_weight": 3.0})))


def test_gigpo_groups_of_one_and_missing_observations():
    def traj(rewards: list[float], observations: list[str]) -> TrajectoryValues:
        n = len(rewards)
        return TrajectoryValues(np.array(rewards), np.zeros(n), np.zeros(n), np.zeros(n),
                                np.array([False] * (n - 1) + [True]), observations=observations)

    # a lone trajectory whose states are all new: 0 everywhere; the same observation in another task's
    # group is no anchor for it
    lone = [traj([0.0, 1.0], ["start", "kitchen"]), traj([0.0, 0.0], ["start", "kitchen"])]
    assert all(np.all(a == 0.0) for a in estimate_advantages("gigpo", lone, ["t1", "t2"], 0.95, 0.95))
    # a lone trajectory that comes back to a state: its two visits form a step group of their own
    loop = [traj([0.0, 0.0, 1.0], ["start", "hall", "start"])]
    (adv,) = estimate_advantages("gigpo", loop, ["t"], 0.5, 0.95, options={"norm": "mean"})
    assert adv == pytest.approx([(0.25 - 0.625), 0.0, (1.0 - 0.625)])  # returns-to-go 0.25 and 1 at "start"
    # equal returns-to-go in a step group: 0, not 0 / 0
    same = [traj([0.0, 0.0], ["start", "hall"]), traj([0.0, 0.0], ["start", "hall"])]
    assert all(np.all(a == 0.0) for a in estimate_advantages("gigpo", same, ["t", "t"], 0.95, 0.95))
    with pytest.raises(ValueError, match="trajectory 1 has no observations"):
        estimate_advantages("gigpo", [lone[0], TrajectoryValues(np.zeros(1), np.zeros(1), np.zeros(1), np.zeros(1),
                                                               np.ones(1, dtype=bool))], ["t", "t"], 0.95, 0.95)
    with pytest.raises(ValueError, match="share one non-zero length"):
        traj([0.0, 1.0], ["start"])
    with pytest.raises(ValueError, match="norm 'max'"):
        estimate_advantages("gigpo", lone, ["t", "t"], 0.95, 0.95, options={"norm": "max"})


def test_labelling_with_gigpo_reads_each_turns_observation():
    from qevolve.process_rewards.label import label_episodes

    def episode(task: str, k: int, observations: list[str], reward: float) -> Episode:
        turns = [Turn(observation=o, agent_text=f"Action: a{t}", action=f"a{t}") for t, o in enumerate(observations)]
        turns[-1].reward, turns[-1].done = reward, True
        return Episode(f"e/{task}#{k}", task, "env", "train", "self", turns, won=reward == 1.0, score=reward)

    episodes = [episode("t1", 0, ["start", "kitchen"], 1.0), episode("t1", 1, ["start", "hall"], 0.0),
                episode("t2", 0, ["start", "hall", "start"], 0.0)]
    _, summary = label_episodes(episodes, None, LabelConfig(estimator="gigpo"), progress=False)
    # gamma: 0.95 without a critic (the paper's); t1's two "start" turns form the only step group of two
    # or more with a signal (t2's two visits to "start" have equal returns-to-go, 0)
    episode_level = 0.5 / (math.sqrt(0.5) + 1e-6)
    step = 0.475 / (0.95 / math.sqrt(2) + 1e-6)
    assert [t.advantage for t in episodes[0].turns] == pytest.approx([episode_level + step, episode_level])
    assert [t.advantage for t in episodes[1].turns] == pytest.approx([-episode_level - step, -episode_level])
    assert [t.advantage for t in episodes[2].turns] == [0.0, 0.0, 0.0]
    assert summary["gamma"] == 0.95 and summary["step_groups"] == 5  # (t1: start, kitchen, hall; t2: start, hall)
    assert summary["mean_step_group_size"] == pytest.approx(7 / 5)
    assert summary["turns_in_step_groups"] == pytest.approx(4 / 7)
    _, summary = label_episodes(episodes, None, LabelConfig(estimator="gigpo", gamma=0.5, gigpo_weight=0.0),
                                progress=False)
    assert summary["gamma"] == 0.5
    assert [t.advantage for t in episodes[0].turns] == pytest.approx([episode_level] * 2)
    _, summary = label_episodes(episodes, None, LabelConfig(estimator="grpo"), progress=False)
    assert "step_groups" not in summary  # the other estimators' summaries are unchanged


def test_label_config_gigpo_fields():
    config = LabelConfig()
    assert (config.gigpo_weight, config.gigpo_norm) == (1.0, "std")
    assert load_config(LabelConfig, None, ["estimator=gigpo", "gigpo_norm=mean"]).gigpo_norm == "mean"
    with pytest.raises(ConfigError, match="gigpo_norm"):
        load_config(LabelConfig, None, ["gigpo_norm=max"])
    with pytest.raises(ConfigError, match="gigpo_weight"):
        load_config(LabelConfig, None, ["gigpo_weight=-1"])


def test_labelling_without_a_critic():
    from qevolve.process_rewards.label import label_episodes

    def episode(task: str, k: int, reward: float, failed: bool = False) -> Episode:
        turns = [Turn(observation="o", agent_text="Action: a", action="a"),
                 Turn(observation="o", agent_text="Action: b", action="b", reward=reward, done=True)]
        return Episode(f"e/{task}#{k}", task, "env", "train", "self", turns, won=reward == 1.0, score=reward,
                       failed=failed)

    episodes = [episode("t1", 0, 1.0), episode("t1", 1, 0.0), episode("t1", 2, 0.0, failed=True),
                episode("t2", 0, 1.0), episode("t3", 0, 0.0), episode("t3", 1, 0.0)]
    labelled, summary = label_episodes(episodes, None, LabelConfig(estimator="grpo"), progress=False)
    assert labelled is episodes
    # the failed episode passes through unlabelled and is no member of its group
    assert [ep.turns[0].advantage for ep in episodes] == pytest.approx(
        [1 / (math.sqrt(0.5) + 1e-6) / 2, -1 / (math.sqrt(0.5) + 1e-6) / 2, None, 0.0, 0.0, 0.0])
    assert all(t.advantage == ep.turns[0].advantage for ep in episodes for t in ep.turns)
    assert all(t.value is None and t.q_value is None and t.r_aux is None for ep in episodes for t in ep.turns)
    assert summary["unlabelled_failed"] == 1 and summary["groups"] == 3
    assert summary["groups_without_signal"] == pytest.approx(2 / 3)  # t2 alone, t3 all equal
    _, summary = label_episodes(episodes, None, LabelConfig(estimator="outcome"), progress=False)
    assert [ep.turns[1].advantage for ep in episodes if not ep.failed] == [1.0, 0.0, 1.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="'gae_env' reads the critic's values"):
        label_episodes(episodes, None, LabelConfig(), progress=False)


def test_qevolve_label_needs_no_critic_for_the_group_estimators(tmp_path):
    from typer.testing import CliRunner

    from qevolve.buffer.store import read_episodes, write_episodes
    from qevolve.cli import app

    episodes = [Episode(f"e/t#{k}", "t", "env", "train", "self",
                        [Turn(observation="o", agent_text="Action: a", action="a", reward=float(k), done=True)],
                        won=k == 1, score=float(k)) for k in (0, 1)]
    buffer = write_episodes(tmp_path / "buffer.parquet", episodes)
    result = CliRunner().invoke(app, ["label", "--buffer", str(buffer), "--no-progress", "estimator=rloo"])
    assert result.exit_code == 0, result.output
    labelled = read_episodes(tmp_path / "buffer.labelled.parquet")
    assert [ep.turns[0].advantage for ep in labelled] == [-1.0, 1.0]
    refused = CliRunner().invoke(app, ["label", "--buffer", str(buffer), "estimator=td1"])
    assert refused.exit_code == 2 and "--critic: required by estimator td1" in refused.output


def test_gae_on_env_reward_takes_a_penalty_back_out_of_a_value_fitted_with_it():
    """A looping episode (every turn penalised, cut at the turn limit) whose V is the penalties still to come,
    as a critic fitted on r_env + r_aux learns it in sample, beside a won one: GAE on r_env gives the
    penalised turns positive TD errors (the penalty, back out of V), GAE on r_env + r_aux gives them none, and
    the labels' summary reports the penalised turns above the others."""
    from qevolve.process_rewards.label import _penalised_summary

    gamma, lam, p, n = 1.0, 0.95, 0.3, 5
    penalties_to_come = -p * np.arange(n, 0, -1, dtype=np.float64)  # V(s_t) = -p * (turns left)
    looping = TrajectoryValues(np.zeros(n), np.full(n, -p), penalties_to_come, penalties_to_come,
                               np.zeros(n, dtype=bool), bootstrap_value=0.0)
    won = TrajectoryValues(np.array([0.0, 0.0, 1.0]), np.zeros(3), np.ones(3), np.ones(3),
                           np.array([False, False, True]))
    env_only = get_advantage_estimator("gae_env")(looping, gamma, lam)
    np.testing.assert_allclose(get_advantage_estimator("td1")(looping, gamma, lam), np.full(n, p))
    assert (env_only > 0).all()
    np.testing.assert_allclose(get_advantage_estimator("gae_env_aux")(looping, gamma, lam), np.zeros(n), atol=1e-12)
    summary = _penalised_summary([looping, won], [env_only, get_advantage_estimator("gae_env")(won, gamma, lam)])
    assert summary["penalised_turns"] == n
    assert summary["advantage_mean_penalised"] == pytest.approx(env_only.mean())
    assert summary["advantage_mean_unpenalised"] == pytest.approx(0.0)
    assert _penalised_summary([won], [np.zeros(3)]) == {"penalised_turns": 0, "advantage_mean_unpenalised": 0.0}
