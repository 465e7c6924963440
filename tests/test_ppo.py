"""The ppo baseline of ``qevolve evolve``: online rounds of rollouts, a value head fitted to the round's
lambda-returns, GAE labels and a PPO-clip update from the BC policy.

The math on hand-made batches (lambda-returns, GAE against a plain loop, the value loss with and without
clipping, the regression targets the value stage fits), the value stage on a tiny backbone (the head
carries over from round to round), the config's defaults and refusals, and a run on ``ChoiceEnv`` (say
``right`` of left/right/up) whose rounds learn the rewarded action, with its stages, its table row with
env steps, and a run killed inside round 2's update that resumes to the same weights.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from online_rounds import assert_rounds_learned_and_counted, run_in_process, stages_of

from qevolve.buffer.store import read_episodes
from qevolve.config import ConfigError, load_config
from qevolve.critic.testing import save_tiny_llama, synthetic_buffer
from qevolve.critic.value import (ValueConfig, ValueHead, ValueLearner, lambda_returns, load_value_head, train_value,
                                  value_loss)
from qevolve.evolve.loop import EvolveConfig, PPOSettings
from qevolve.process_rewards.advantages import TrajectoryValues, gae_env
from qevolve.process_rewards.label import LabelConfig, label_with_values

ROUNDS = 4


# -- the math, on hand-made batches --------------------------------------------------------------------------

def test_lambda_returns_by_hand():
    # three turns, done at the end: G_2 = r_2; G_1 = r_1 + g((1-l) V_2 + l G_2); G_0 = r_0 + g((1-l) V_1 + l G_1)
    g, l = 0.9, 0.8
    rewards, values = [0.0, 0.5, 1.0], [0.2, 0.4, 0.7]
    g2 = 1.0
    g1 = 0.5 + g * ((1 - l) * 0.7 + l * g2)
    g0 = 0.0 + g * ((1 - l) * 0.4 + l * g1)
    np.testing.assert_allclose(lambda_returns(rewards, values, [False, False, True], g, l), [g0, g1, g2])
    # truncated (the last turn not done): V(s_T) = G_T = the bootstrap value
    t1 = 1.0 + g * 0.3
    t0 = 0.5 + g * ((1 - l) * 0.7 + l * t1)
    np.testing.assert_allclose(lambda_returns([0.5, 1.0], [0.2, 0.7], [False, False], g, l, bootstrap_value=0.3),
                               [t0, t1])
    # lambda 1: the discounted Monte-Carlo return; lambda 0: the one-step TD target
    np.testing.assert_allclose(lambda_returns(rewards, values, [False, False, True], g, 1.0),
                               [0.5 * g + g * g, 0.5 + g, 1.0])
    np.testing.assert_allclose(lambda_returns(rewards, values, [False, False, True], g, 0.0),
                               [g * 0.4, 0.5 + g * 0.7, 1.0])


def _plain_gae(rewards, values, dones, gamma, lam, bootstrap):
    """GAE as a plain loop over turns, forwards: A_t = sum_k (gamma lambda)^k delta_{t+k} up to the end."""
    T = len(rewards)
    nxt = [values[t + 1] if t + 1 < T else bootstrap for t in range(T)]
    deltas = [rewards[t] + gamma * nxt[t] * (0.0 if dones[t] else 1.0) - values[t] for t in range(T)]
    out = []
    for t in range(T):
        total, weight = 0.0, 1.0
        for k in range(t, T):
            total += weight * deltas[k]
            if dones[k]:
                break
            weight *= gamma * lam
        out.append(total)
    return np.array(out)


@pytest.mark.parametrize("truncated", [False, True])
def test_gae_equals_a_plain_loop_and_the_lambda_return_minus_v(truncated):
    rng = np.random.default_rng(0)
    gamma, lam = 0.99, 0.95
    for length in (1, 2, 5, 9):
        rewards, values = rng.normal(size=length), rng.normal(size=length)
        dones = np.zeros(length, dtype=bool)
        dones[-1] = not truncated
        bootstrap = float(values[-1]) if truncated else 0.0
        traj = TrajectoryValues(env_rewards=rewards, aux_rewards=np.zeros(length), values=values,
                                q_values=np.zeros(length), dones=dones, bootstrap_value=bootstrap)
        advantages = gae_env(traj, gamma, lam)
        np.testing.assert_allclose(advantages, _plain_gae(rewards, values, dones, gamma, lam, bootstrap), atol=1e-12)
        np.testing.assert_allclose(advantages + values, lambda_returns(rewards, values, dones, gamma, lam, bootstrap),
                                   atol=1e-12)


def test_value_loss_plain_and_clipped_by_hand():
    values = torch.tensor([1.0, 0.0, 0.5])
    targets = torch.tensor([0.0, 1.0, 0.5])
    old = torch.tensor([0.8, 0.5, 0.0])
    plain = value_loss(values, targets, old)
    assert float(plain["loss"]) == pytest.approx((1.0 + 1.0 + 0.0) / 3) and float(plain["clip_fraction"]) == 0.0
    # clip 0.2: V_clip = [1.0, 0.3, 0.2]; per turn max((V-G)^2, (V_clip-G)^2) = [1, max(1, 0.49), max(0, 0.09)]
    clipped = value_loss(values, targets, old, clip=0.2)
    assert float(clipped["loss"]) == pytest.approx((1.0 + 1.0 + 0.09) / 3)
    assert float(clipped["clip_fraction"]) == pytest.approx(2 / 3)  # turns 2 and 3 moved more than 0.2


def test_a_fresh_value_head_says_zero_and_a_learner_step_lowers_the_loss():
    torch.manual_seed(0)
    head = ValueHead(8, 16, 2)
    features = torch.randn(32, 8)
    assert torch.equal(head.value(features), torch.zeros(32))
    targets = features[:, 0].clone()
    config = ValueConfig(lr=1e-2)
    learner = ValueLearner(head, torch.optim.AdamW(head.parameters(), lr=config.lr), config)
    first = learner.update(features, targets, torch.zeros(32))["loss"]
    for _ in range(50):
        last = learner.update(features, targets, torch.zeros(32))["loss"]
    assert last < first / 4 and learner.steps == 51


def test_label_with_values_reads_the_turns_values():
    episodes = synthetic_buffer(6, seed=1, min_turns=1, max_turns=4)
    rng = np.random.default_rng(2)
    for episode in episodes:
        for turn in episode.turns:
            turn.value = float(rng.normal())
    config = LabelConfig(estimator="gae_env", gamma=0.9, gae_lambda=0.7)
    labelled, summary = label_with_values(episodes, config, truncated_bootstrap="last_value")
    for episode in labelled:
        values = [t.value for t in episode.turns]
        dones = [t.done for t in episode.turns]
        bootstrap = values[-1] if not dones[-1] else 0.0
        want = lambda_returns([t.reward for t in episode.turns], values, dones, 0.9, 0.7, bootstrap)
        np.testing.assert_allclose([t.advantage + t.value for t in episode.turns], want, atol=1e-12)
    assert summary["gamma"] == 0.9 and summary["lambda"] == 0.7 and summary["turns"] == sum(
        ep.num_turns for ep in episodes)
    with pytest.raises(ValueError, match="reads more of a critic than V"):
        label_with_values(episodes, LabelConfig(estimator="q_minus_v", gamma=0.9))
    with pytest.raises(ValueError, match="needs gamma"):
        label_with_values(episodes, LabelConfig(estimator="gae_env"))
    episodes[0].turns[0].value = None
    with pytest.raises(ValueError, match="has no value"):
        label_with_values(episodes, config)


def test_the_ppo_rows_name_and_env_steps_from_a_manifest():
    from qevolve.evaluation.compare import method_label, policy_env_steps

    stages = [{"name": "iter_1/rollouts", "metrics": {"env_steps": 100}},
              {"name": "iter_2/rollouts", "metrics": {"env_steps": 90}},
              {"name": "iter_2/ppo/round_1/rollouts", "metrics": {"env_steps": 40}},
              {"name": "iter_2/ppo/round_1/value", "metrics": {"turns": 40}},
              {"name": "iter_2/ppo/round_2/rollouts", "metrics": {"env_steps": 30}},
              {"name": "iter_1/ppo/round_1/rollouts", "metrics": {"env_steps": 7}}]
    # from iteration 2's starting policy: iteration 1's rollouts and its own rounds', not iteration 2's
    assert policy_env_steps(stages, "iter_2/ppo") == 100 + 40 + 30
    assert policy_env_steps(stages, "iter_1/ppo") == 7
    assert policy_env_steps(stages[:2], "iter_2/ppo") is None  # no round recorded: cannot be told
    assert (method_label("iter_1/ppo"), method_label("iter_2/ppo")) == ("PPO", "PPO (from iter 2)")


# -- the value stage on a tiny backbone ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def backbone(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("ppo-tiny") / "model", seed=0)


def test_the_value_stage_fits_lambda_returns_of_v_old_and_carries_the_head_to_the_next_round(backbone, tmp_path,
                                                                                             monkeypatch):
    config = ValueConfig(dtype="float32", device="cpu", epochs=3, lr=3e-3, head_hidden=16, batch_tokens=256,
                         feature_cache=True, feature_cache_dir=str(tmp_path / "features"), seed=5)
    gamma, lam = 0.9, 0.8
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    real_update = ValueLearner.update

    def update(self, features, targets, old_values):
        seen.append((targets.clone(), old_values.clone()))
        return real_update(self, features, targets, old_values)

    monkeypatch.setattr(ValueLearner, "update", update)
    # round 1: a fresh head, V_old = 0, so the targets are the discounted returns of r_env
    one = synthetic_buffer(8, seed=0)
    _, first = train_value(one, config, tmp_path / "r1", backbone=backbone, previous=None, gamma=gamma, lam=lam)
    assert all(t.value == 0.0 for ep in one for t in ep.turns)
    returns = sorted(float(x) for ep in one for x in lambda_returns(
        [t.reward for t in ep.turns], [0.0] * ep.num_turns, [t.done for t in ep.turns], gamma, lam))
    epoch_targets = sorted(float(x) for targets, _ in seen[: len(seen) // 3] for x in targets)
    np.testing.assert_allclose(epoch_targets, returns, atol=1e-6)
    assert first["rounds"] == 1 and first["loss_after"] < first["loss_before"]
    assert first["loss_before"] == pytest.approx(float(np.mean(np.square(returns))))

    # round 2 on new trajectories: V_old is round 1's fitted head, the targets its lambda-returns
    seen.clear()
    head, saved = load_value_head(tmp_path / "r1")
    assert saved["rounds"] == 1 and Path(saved["backbone"]).resolve() == Path(backbone).resolve()
    two = synthetic_buffer(8, seed=3)
    _, second = train_value(two, config, tmp_path / "r2", backbone=backbone, previous=tmp_path / "r1", gamma=gamma,
                            lam=lam, truncated_bootstrap="last_value")
    assert second["rounds"] == 2 and second["total_steps"] == first["total_steps"] + second["steps"]
    v_old = [np.array([t.value for t in ep.turns]) for ep in two]
    assert any(np.abs(v).max() > 0 for v in v_old)
    want = []
    for ep, values in zip(two, v_old):
        bootstrap = 0.0 if ep.turns[-1].done else float(values[-1])
        want += list(lambda_returns([t.reward for t in ep.turns], values, [t.done for t in ep.turns], gamma, lam,
                                    bootstrap))
    np.testing.assert_allclose(sorted(float(x) for targets, _ in seen[: len(seen) // 3] for x in targets),
                               sorted(want), atol=1e-5)
    # V_old on the turns is round 1's head on these trajectories' hidden states (the same features path)
    from qevolve.critic.data import build_samples
    from qevolve.critic.config import WeightingConfig
    from qevolve.critic.retrospective import RetrospectiveConfig
    from qevolve.critic.model import extract_features, load_backbone

    samples = build_samples(two, RetrospectiveConfig(enabled=False), WeightingConfig(scheme="plain"), gamma)
    features = extract_features(load_backbone(backbone), samples, 256, torch.device("cpu"), torch.float32,
                                progress=False)
    with torch.no_grad():
        np.testing.assert_allclose(np.concatenate(v_old), torch.cat([head.value(f[0]) for f in features]).numpy(),
                                   atol=1e-5)
    # the same inputs give the same head, bit for bit (the stage is deterministic), the hidden states read
    # back from the cache the first attempt wrote
    assert len(list((tmp_path / "features").glob("*.pt"))) == 2  # one entry per round's trajectories
    again = synthetic_buffer(8, seed=3)
    train_value(again, config, tmp_path / "r2b", backbone=backbone, previous=tmp_path / "r1", gamma=gamma, lam=lam,
                truncated_bootstrap="last_value")
    assert len(list((tmp_path / "features").glob("*.pt"))) == 2  # read, not written again
    a, _ = load_value_head(tmp_path / "r2")
    b, _ = load_value_head(tmp_path / "r2b")
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


# -- config --------------------------------------------------------------------------------------------------

def test_ppo_settings_defaults_and_refusals():
    settings = PPOSettings()
    assert (settings.rounds, settings.env_steps, settings.episodes_per_task, settings.temperature) == (4, None, 4, 1.0)
    assert (settings.gamma, settings.gae_lambda, settings.truncated_bootstrap) == (0.99, 0.95, "zero")
    assert (settings.value.epochs, settings.value.lr, settings.value.batch_tokens, settings.value.clip) == (
        4, 3e-4, 16384, None)
    objective = settings.policy.objective
    assert (objective.name, objective.eps_low, objective.eps_high, objective.kl_coef) == ("bppo", 0.2, 0.2, 0.01)
    assert settings.policy.standardize_advantages == "buffer"  # PPO normalises its advantages
    assert (settings.policy.optim.warmup_steps, settings.policy.optim.min_lr_ratio) == (0, 1.0)  # constant lr
    # one field given: the others keep PPO's defaults, not the policy stage's
    config = load_config(EvolveConfig, None, ["baselines=[ppo]", "ppo.policy.epochs=3", "ppo.value.clip=0.2"])
    assert config.ppo.policy.epochs == 3 and config.ppo.policy.objective.eps_low == 0.2
    assert config.ppo.value.clip == 0.2 and config.ppo.policy.standardize_advantages == "buffer"
    refusals = [
        ("ppo.rounds=null", "rounds and env_steps are both null"),
        ("ppo.policy.objective.name=dpo", r"expected one of \['awr', 'bppo'\]"),
        ("ppo.gamma=1.5", "ppo.gamma"),
        ("ppo.gae_lambda=-0.1", "ppo.gae_lambda"),
        ("ppo.episodes_per_task=0", "ppo.episodes_per_task"),
        ("ppo.truncated_bootstrap=mean", "ppo.truncated_bootstrap"),
        ("ppo.value.epochs=0", "ppo.value.epochs"),
        ("ppo.value.clip=0", "ppo.value.clip"),
        ("ppo.value.seed=3", "ppo.value.seed"),  # the loop sets it: the stage's seed
        ("ppo.policy.reference=somewhere", "ppo.policy.reference"),  # the loop sets it: the BC policy
        ("baselines=[dppo]", "baselines"),
    ]
    for override, message in refusals:
        with pytest.raises(ConfigError, match=message) as error:
            load_config(EvolveConfig, None, [override])
        assert "\n" not in str(error.value).strip(), override  # one line


# -- a run on ChoiceEnv --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def overrides(choice_run_overrides):
    """The ChoiceEnv settings of the online baselines' tests (``choice_run_overrides``), and
    PPO with 8 episodes of each of the 8 tasks a round."""
    return [
        *choice_run_overrides,
        "baselines=[ppo]", f"ppo.rounds={ROUNDS}", "ppo.episodes_per_task=8", "ppo.policy.epochs=2",
        "ppo.policy.optim.lr=3e-4", "ppo.policy.grad_accum_steps=1", "ppo.policy.tokens_per_batch=4096",
        "ppo.policy.save_every=2", "ppo.policy.tensorboard=false",
        "ppo.value.dtype=float32", "ppo.value.device=cpu", "ppo.value.lr=3e-3", "ppo.value.head_hidden=32",
    ]


@pytest.fixture(scope="module")
def uninterrupted(overrides, tmp_path_factory):
    return run_in_process(overrides, tmp_path_factory.mktemp("ppo-runs"))


def test_ppo_rounds_learn_the_rewarded_action_and_the_row_counts_their_env_steps(uninterrupted):
    run, table, messages = uninterrupted
    stages = stages_of(run)
    rounds = [f"iter_1/ppo/round_{r}/{part}" for r in range(1, ROUNDS + 1)
              for part in ("rollouts", "value", "label", "policy")]
    assert list(stages) == ["bc", "bc/eval_seen", "iter_1/rollouts", "iter_1/buffer", "iter_1/label", "iter_1/policy",
                            "iter_1/eval_seen", *rounds, "iter_1/ppo/eval_seen"]
    # each round acts with the policy of the round before, the first with BC's; its value stage reads the
    # BC policy's hidden states and starts from the round before's head; its labels read the value stage
    assert stages["iter_1/ppo/round_1/rollouts"]["inputs"]["policy"] == "bc/final"
    assert stages["iter_1/ppo/round_1/value"]["inputs"] == {"rollouts": "iter_1/ppo/round_1/rollouts",
                                                            "backbone": "bc/final"}
    for r in range(2, ROUNDS + 1):
        assert stages[f"iter_1/ppo/round_{r}/rollouts"]["inputs"]["policy"] == f"iter_1/ppo/round_{r - 1}/policy/final"
        assert stages[f"iter_1/ppo/round_{r}/policy"]["inputs"]["start"] == f"iter_1/ppo/round_{r - 1}/policy/final"
        assert stages[f"iter_1/ppo/round_{r}/value"]["inputs"]["value"] == f"iter_1/ppo/round_{r - 1}/value/value.pt"
        assert stages[f"iter_1/ppo/round_{r}/value"]["metrics"]["rounds"] == r
    assert stages["iter_1/ppo/round_2/label"]["inputs"] == {"valued": "iter_1/ppo/round_2/value/valued.parquet"}
    assert stages["iter_1/ppo/eval_seen"]["inputs"]["policy"] == f"iter_1/ppo/round_{ROUNDS}/policy/final"
    assert stages["iter_1/ppo/round_1/rollouts"]["metrics"]["episodes"] == 64

    # round 1's head starts at 0: V_old = 0, and the labels are the discounted returns
    first = read_episodes(run / "iter_1/ppo/round_1/label/labelled.parquet")
    assert all(t.value == 0.0 for ep in first for t in ep.turns)
    # every round: advantage + V_old is the lambda-return of r_env and V_old (the value stage's target)
    for r in range(1, ROUNDS + 1):
        for ep in read_episodes(run / f"iter_1/ppo/round_{r}/label/labelled.parquet"):
            values = [t.value for t in ep.turns]
            want = lambda_returns([t.reward for t in ep.turns], values, [t.done for t in ep.turns], 0.99, 0.95)
            np.testing.assert_allclose([t.advantage + t.value for t in ep.turns], want, atol=1e-9)
    # the value head learned the success rate: its V_old of later rounds tracks the round's return
    value = [stages[f"iter_1/ppo/round_{r}/value"]["metrics"] for r in range(1, ROUNDS + 1)]
    assert all(v["loss_after"] < v["loss_before"] for v in value)
    assert value[-1]["v_old_mean"] > 0.1

    assert_rounds_learned_and_counted(run, stages, table, messages, "ppo", "PPO", ROUNDS)


def test_a_budget_of_env_steps_stops_before_a_round_and_a_kill_inside_a_round_resumes_to_the_same_weights(
        uninterrupted, overrides, tmp_path, killed_in_round_2_and_resumed):
    """The budget is checked before each round: with the steps of two rounds still under it, a third runs
    (and passes it), then PPO stops. Killed inside round 2's update (after its checkpoint at step 2), the
    run resumes from that checkpoint, and every round's stages equal the uninterrupted run's, value heads
    and weights included (rounds 1-3 do not depend on how many rounds follow)."""
    reference, _, _ = uninterrupted
    ref = stages_of(reference)
    steps = [ref[f"iter_1/ppo/round_{r}/rollouts"]["metrics"]["env_steps"] for r in range(1, ROUNDS + 1)]
    budget = steps[0] + steps[1] + 1  # two rounds leave it unspent: the third runs and passes it
    config = load_config(EvolveConfig, None, [*overrides, f"runs_dir={tmp_path}", "name=run", "ppo.rounds=null",
                                              f"ppo.env_steps={budget}",
                                              f"init_checkpoint={reference / 'bc/final'}"])
    run, messages = killed_in_round_2_and_resumed(config, "ppo")
    ours = stages_of(run)
    assert [name for name in ours if "/ppo/" in name] == [
        f"iter_1/ppo/round_{r}/{part}" for r in (1, 2, 3) for part in ("rollouts", "value", "label", "policy")] + [
        "iter_1/ppo/eval_seen"]
    assert f"[iter_1/ppo] 3 rounds, {sum(steps[:3])} env steps (budget {budget})" in messages
    for name, stage in ours.items():
        if "/ppo/round_" in name:  # the run reuses the reference's BC policy: its own inputs name it elsewhere
            want = {k: ref[name][k] for k in ("outputs", "metrics", "digests")}
            assert {k: stage[k] for k in ("outputs", "metrics", "digests")} == want, name
    final = sorted((reference / "iter_1/ppo/round_3/policy/final").glob("*.safetensors"))
    assert final and all((run / "iter_1/ppo/round_3/policy/final" / f.name).read_bytes() == f.read_bytes()
                         for f in final)
    assert ours["iter_1/ppo/eval_seen"]["inputs"]["policy"] == "iter_1/ppo/round_3/policy/final"
