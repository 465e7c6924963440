"""The grpo baseline of ``qevolve evolve``: online rounds of rollouts, group advantages and a PPO-clip update
from the BC policy, on a one-decision environment whose reward a tiny policy learns in a few rounds
(``ChoiceEnv``: say ``right`` of left/right/up); its stages, its table row with env steps, the
env-step budget, and a run killed inside a round that resumes to the same weights.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from online_rounds import assert_rounds_learned_and_counted, run_in_process, stages_of

from qevolve.buffer.store import read_episodes
from qevolve.config import ConfigError, load_config
from qevolve.evolve.loop import EvolveConfig, GRPOSettings, grpo_round_tasks, run_evolve

ENV = "qevolve.environments.testing:ChoiceEnv"
ROUNDS = 4


@pytest.fixture(scope="module")
def overrides(choice_run_overrides):
    """The ChoiceEnv settings of the online baselines' tests (``choice_run_overrides``), and
    GRPO with groups of 8 on the 8 tasks."""
    return [
        *choice_run_overrides,
        "baselines=[grpo]", f"grpo.rounds={ROUNDS}", "grpo.group_size=8", "grpo.policy.epochs=2",
        "grpo.policy.optim.lr=3e-4", "grpo.policy.grad_accum_steps=1", "grpo.policy.tokens_per_batch=4096",
        "grpo.policy.save_every=2", "grpo.policy.tensorboard=false",
    ]


@pytest.fixture(scope="module")
def uninterrupted(overrides, tmp_path_factory):
    return run_in_process(overrides, tmp_path_factory.mktemp("grpo-runs"))


def test_grpo_rounds_learn_the_rewarded_action_and_the_row_counts_their_env_steps(uninterrupted):
    run, table, messages = uninterrupted
    stages = stages_of(run)
    rounds = [f"iter_1/grpo/round_{r}/{part}" for r in range(1, ROUNDS + 1) for part in ("rollouts", "label", "policy")]
    # outcome labels need no critic: the iteration trains none, and no label stage reads one
    assert list(stages) == ["bc", "bc/eval_seen", "iter_1/rollouts", "iter_1/buffer", "iter_1/label", "iter_1/policy",
                            "iter_1/eval_seen", *rounds, "iter_1/grpo/eval_seen"]
    assert stages["iter_1/label"]["inputs"] == {"buffer": "iter_1/buffer/buffer.parquet"}
    assert stages["iter_1/grpo/round_1/label"]["inputs"] == {"rollouts": "iter_1/grpo/round_1/rollouts"}
    # each round acts with the policy of the round before, the first with BC's
    assert stages["iter_1/grpo/round_1/rollouts"]["inputs"]["policy"] == "bc/final"
    for r in range(2, ROUNDS + 1):
        assert stages[f"iter_1/grpo/round_{r}/rollouts"]["inputs"]["policy"] == f"iter_1/grpo/round_{r - 1}/policy/final"
        assert stages[f"iter_1/grpo/round_{r}/policy"]["inputs"]["start"] == f"iter_1/grpo/round_{r - 1}/policy/final"
    assert stages["iter_1/grpo/eval_seen"]["inputs"]["policy"] == f"iter_1/grpo/round_{ROUNDS}/policy/final"
    # group_size episodes of each of the 8 tasks, sampled (T = 1): groups with both outcomes carry the signal
    first = stages["iter_1/grpo/round_1/rollouts"]["metrics"]
    assert first["episodes"] == 64
    labels = stages["iter_1/grpo/round_1/label"]["metrics"]
    assert labels["groups"] == 8 and labels["mean_group_size"] == 8 and labels["groups_without_signal"] < 1
    assert abs(labels["advantage_mean"]) < 1e-9  # group-normalised: every group's advantages sum to 0
    labelled = read_episodes(run / "iter_1/grpo/round_1/label/labelled.parquet")
    assert all(t.value is None and t.advantage is not None for ep in labelled for t in ep.turns)
    assert_rounds_learned_and_counted(run, stages, table, messages, "grpo", "GRPO", ROUNDS)


def test_a_budget_of_env_steps_stops_before_a_round_and_a_kill_inside_a_round_resumes_to_the_same_weights(
        uninterrupted, overrides, tmp_path, killed_in_round_2_and_resumed):
    """The budget is checked before each round: with the steps of two rounds still under it, a third runs
    (and passes it), then GRPO stops. Killed inside round 2's update (after its checkpoint at step 2), the
    run resumes from that checkpoint, and every round's stages equal the uninterrupted run's, weights
    included (rounds 1-3 do not depend on how many rounds follow)."""
    reference, _, _ = uninterrupted
    ref = stages_of(reference)
    steps = [ref[f"iter_1/grpo/round_{r}/rollouts"]["metrics"]["env_steps"] for r in range(1, ROUNDS + 1)]
    budget = steps[0] + steps[1] + 1  # two rounds leave it unspent: the third runs and passes it
    config = load_config(EvolveConfig, None, [*overrides, f"runs_dir={tmp_path}", "name=run", "grpo.rounds=null",
                                              f"grpo.env_steps={budget}"])
    run, messages = killed_in_round_2_and_resumed(config, "grpo")
    ours = stages_of(run)
    assert [name for name in ours if "/grpo/" in name] == [
        f"iter_1/grpo/round_{r}/{part}" for r in (1, 2, 3) for part in ("rollouts", "label", "policy")] + [
        "iter_1/grpo/eval_seen"]
    assert f"[iter_1/grpo] 3 rounds, {sum(steps[:3])} env steps (budget {budget})" in messages
    for name, stage in ours.items():
        if name != "iter_1/grpo/eval_seen":  # evaluates round 3's policy here, round 4's there
            assert {k: stage[k] for k in ("inputs", "outputs", "metrics", "digests")} == \
                   {k: ref[name][k] for k in ("inputs", "outputs", "metrics", "digests")}, name
    final = sorted((reference / "iter_1/grpo/round_3/policy/final").glob("*.safetensors"))
    assert final and all((run / "iter_1/grpo/round_3/policy/final" / f.name).read_bytes() == f.read_bytes()
                         for f in final)
    assert ours["iter_1/grpo/eval_seen"]["inputs"]["policy"] == "iter_1/grpo/round_3/policy/final"


def test_grpo_settings_defaults_and_refusals():
    settings = GRPOSettings()
    assert (settings.rounds, settings.env_steps, settings.group_size, settings.estimator) == (4, None, 4, "grpo")
    objective = settings.policy.objective
    assert (objective.name, objective.eps_low, objective.eps_high, objective.kl_coef) == ("bppo", 0.2, 0.2, 0.01)
    assert settings.policy.standardize_advantages == "none"  # already normalised within each group
    assert (settings.policy.optim.warmup_steps, settings.policy.optim.min_lr_ratio) == (0, 1.0)  # constant lr
    # one field given: the others keep GRPO's defaults, not the policy stage's
    config = load_config(EvolveConfig, None, ["baselines=[grpo]", "grpo.policy.max_steps=3"])
    assert config.grpo.policy.max_steps == 3 and config.grpo.policy.objective.eps_low == 0.2
    assert config.grpo.policy.standardize_advantages == "none"
    with pytest.raises(ConfigError, match="rounds and env_steps are both null"):
        load_config(EvolveConfig, None, ["grpo.rounds=null"])
    with pytest.raises(ConfigError, match=r"DPO has a config and a command of its own.*expected one of \['awr', "
                                          r"'bppo'\]"):
        load_config(EvolveConfig, None, ["grpo.policy.objective.name=dpo"])
    with pytest.raises(ConfigError, match="group_size"):
        load_config(EvolveConfig, None, ["grpo.group_size=1"])
    with pytest.raises(ConfigError, match="grpo.policy.reference"):  # the loop sets it: the BC policy
        load_config(EvolveConfig, None, ["grpo.policy.reference=somewhere"])
    assert load_config(EvolveConfig, None, []).grpo.evaluate_at_env_steps == []  # only the last round's policy
    for budgets, message in (("[0,5]", "positive"), ("[5,5]", "increasing order"), ("[9,5]", "increasing order")):
        with pytest.raises(ConfigError, match=rf"evaluate_at_env_steps \[.*{message}"):
            load_config(EvolveConfig, None, [f"grpo.evaluate_at_env_steps={budgets}"])
    with pytest.raises(ConfigError, match="evaluate_at_env_steps .*30 passes env_steps 20"):
        load_config(EvolveConfig, None, ["ppo.env_steps=20", "ppo.evaluate_at_env_steps=[10,30]"])


def test_gigpo_settings_reach_the_round_label_config():
    config = load_config(EvolveConfig, None, ["baselines=[grpo]", "grpo.estimator=gigpo"])
    settings = config.grpo
    assert (settings.estimator, settings.gamma, settings.gigpo_weight, settings.gigpo_norm) == ("gigpo", 0.95, 1.0,
                                                                                                 "std")
    config = load_config(EvolveConfig, None, ["grpo.estimator=gigpo", "grpo.gamma=0.9", "grpo.gigpo_weight=0.5",
                                              "grpo.gigpo_norm=mean"])
    assert (config.grpo.gamma, config.grpo.gigpo_weight, config.grpo.gigpo_norm) == (0.9, 0.5, "mean")
    with pytest.raises(ConfigError, match="grpo.estimator"):
        load_config(EvolveConfig, None, ["grpo.estimator=gae_env"])  # a group estimator, without a critic
    with pytest.raises(ConfigError, match="grpo.gigpo_norm"):
        load_config(EvolveConfig, None, ["grpo.gigpo_norm=max"])
    with pytest.raises(ConfigError, match="grpo.gigpo_weight"):
        load_config(EvolveConfig, None, ["grpo.gigpo_weight=-1"])
    with pytest.raises(ConfigError, match="grpo.gamma"):
        load_config(EvolveConfig, None, ["grpo.gamma=1.5"])


def test_a_gigpo_round_labels_each_turn_by_its_episode_and_its_state(uninterrupted, overrides, tmp_path):
    """One GiGPO round from the BC policy of the run above: every turn of a task's episodes acted first on
    the same observation (the task's), so the first turns of a task form one step group, and both levels
    are centred within the task: their advantages sum to 0 task by task."""
    reference, _, _ = uninterrupted
    config = load_config(EvolveConfig, None, [*overrides, f"runs_dir={tmp_path}", "name=run",
                                              f"init_checkpoint={reference / 'bc/final'}", "grpo.rounds=1",
                                              "grpo.estimator=gigpo"])
    run_evolve(config, log=lambda m: None)
    stages = stages_of(tmp_path / "run")
    assert [name for name in stages if "/grpo/" in name] == [
        "iter_1/grpo/round_1/rollouts", "iter_1/grpo/round_1/label", "iter_1/grpo/round_1/policy",
        "iter_1/grpo/eval_seen"]
    labels = stages["iter_1/grpo/round_1/label"]["metrics"]
    assert labels["gamma"] == 0.95 and labels["step_groups"] >= 8 and labels["turns_in_step_groups"] > 0
    episodes = read_episodes(tmp_path / "run/iter_1/grpo/round_1/label/labelled.parquet")
    first: dict[str, list[float]] = {}
    for episode in episodes:
        first.setdefault(episode.task_id, []).append(episode.turns[0].advantage)
    assert len(first) == 8 and all(len(values) == 8 for values in first.values())
    assert all(abs(sum(values)) < 1e-9 for values in first.values())
    assert any(max(values) > 0 for values in first.values())  # some task's episodes differ: a signal
    # a task whose episodes all ended after one turn (BC's policy says a direction at once): the step
    # return-to-go is the return and the step group the episode group, so A = 2 A_grpo with omega 1
    checked = 0
    for task, values in first.items():
        mine = [ep for ep in episodes if ep.task_id == task]
        returns = np.array([ep.turns[0].reward for ep in mine])
        if all(ep.num_turns == 1 for ep in mine) and returns.std() > 0:
            want = 2 * (returns - returns.mean()) / (returns.std(ddof=1) + 1e-6)
            np.testing.assert_allclose(values, want, rtol=1e-9, atol=1e-9)
            checked += 1
    assert checked >= 1


def test_a_round_plays_the_rollout_tasks_or_a_seeded_subset_of_them():
    config = load_config(EvolveConfig, None, [f"env={ENV}", "rollout.task_stride=2"])
    assert grpo_round_tasks(config, "iter_1/grpo/round_1/rollouts") is None  # the split's selection, as rollouts
    config = load_config(EvolveConfig, None, [f"env={ENV}", "rollout.task_stride=2", "grpo.tasks_per_round=2"])
    one = grpo_round_tasks(config, "iter_1/grpo/round_1/rollouts")
    assert len(one) == 2 and set(one) <= {"choice-0", "choice-2", "choice-4", "choice-6"} and one == sorted(one)
    assert one == grpo_round_tasks(config, "iter_1/grpo/round_1/rollouts")  # seeded by the stage's name
    draws = {tuple(grpo_round_tasks(config, f"iter_1/grpo/round_{r}/rollouts")) for r in range(1, 9)}
    assert len(draws) > 1  # rounds draw their own subsets
    other_seed = load_config(EvolveConfig, None, [f"env={ENV}", "rollout.task_stride=2", "grpo.tasks_per_round=2",
                                                  "seed=1"])
    assert {tuple(grpo_round_tasks(other_seed, f"iter_1/grpo/round_{r}/rollouts")) for r in range(1, 9)} != draws
    config = load_config(EvolveConfig, None, [f"env={ENV}", "grpo.tasks_per_round=20"])
    assert grpo_round_tasks(config, "iter_1/grpo/round_1/rollouts") == [f"choice-{n}" for n in range(8)]


def test_budgets_on_the_way_evaluate_the_round_that_reaches_each_and_name_its_rows_by_the_budget(
        uninterrupted, overrides, tmp_path):
    """grpo.evaluate_at_env_steps: the first round whose rollouts reach a budget has its policy evaluated
    (``iter_1/grpo/round_r/eval_seen``) before the next round; the rounds are the uninterrupted run's (a run
    with a budget is a prefix of one with more); the table, ``qevolve compare`` and the report name those
    rows by their budget, with the steps actually spent, on the GRPO line. (The run without the field,
    ``uninterrupted``, has exactly the stages it had before: the first test lists them.)"""
    from qevolve.evaluation.compare import compare_runs, online_budgets
    from qevolve.evaluation.report import env_step_points

    reference, _, _ = uninterrupted
    ref = stages_of(reference)
    steps = [ref[f"iter_1/grpo/round_{r}/rollouts"]["metrics"]["env_steps"] for r in (1, 2, 3)]
    budgets = [steps[0], steps[0] + 1]  # reached by round 1, then by round 2
    run, table, messages = run_in_process(
        [*overrides, "grpo.rounds=3", f"grpo.evaluate_at_env_steps=[{budgets[0]},{budgets[1]}]"], tmp_path)
    ours = stages_of(run)

    def round_stages(r: int) -> list[str]:
        return [f"iter_1/grpo/round_{r}/{part}" for part in ("rollouts", "label", "policy")]

    assert [name for name in ours if name.startswith("iter_1/grpo")] == [
        *round_stages(1), "iter_1/grpo/round_1/eval_seen", *round_stages(2), "iter_1/grpo/round_2/eval_seen",
        *round_stages(3), "iter_1/grpo/eval_seen"]  # round 3 is the last: evaluated once, as iter_1/grpo
    for r in (1, 2):
        assert ours[f"iter_1/grpo/round_{r}/eval_seen"]["inputs"]["policy"] == f"iter_1/grpo/round_{r}/policy/final"
    for name in (n for r in (1, 2, 3) for n in round_stages(r)):
        assert {k: ours[name][k] for k in ("inputs", "outputs", "metrics", "digests")} == \
               {k: ref[name][k] for k in ("inputs", "outputs", "metrics", "digests")}, name
    assert f"[iter_1/grpo/round_1] {steps[0]} env steps reach the budget {budgets[0]}: its policy is evaluated" \
        in messages

    want = {f"GRPO at {budgets[0]:,} env steps": steps[0], f"GRPO at {budgets[1]:,} env steps": steps[0] + steps[1],
            "GRPO": sum(steps)}
    assert {row["policy"]: row["env_steps"] for row in table if "GRPO" in row["policy"]} == want
    rows = {row["method"]: row["env_steps"] for row in compare_runs([run], resamples=100)["rows"]}
    assert {method: steps for method, steps in rows.items() if "GRPO" in method} == want
    manifest = json.loads((run / "manifest.json").read_text())
    points = env_step_points(manifest["stages"], online_budgets(manifest["config"]))["success_rate"]
    assert {(p.method, p.env_steps) for p in points if p.series == "GRPO"} == set(want.items())
