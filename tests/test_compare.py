"""``qevolve compare``: the paired bootstrap, and tables from run directories."""

import json

import numpy as np
import pytest

from qevolve.buffer.store import Episode, Turn, write_shard
from qevolve.evaluation.compare import compare_runs, paired_bootstrap, render_markdown


def test_paired_bootstrap_matches_a_plain_loop_and_is_seeded():
    rng = np.random.default_rng(1)
    a, b = rng.integers(0, 2, 40).astype(float), rng.integers(0, 2, 40).astype(float)
    mean, low, high = paired_bootstrap(a, b, resamples=2000, seed=7)
    assert mean == pytest.approx(float((a - b).mean()))
    # the same resampling written as a plain loop
    draw = np.random.default_rng(7).integers(0, 40, size=(2000, 40))
    means = [float(np.mean([a[i] - b[i] for i in row])) for row in draw]
    assert (low, high) == pytest.approx(tuple(np.percentile(means, [2.5, 97.5])))
    assert paired_bootstrap(a, b, resamples=2000, seed=7) == (mean, low, high)
    assert low < mean < high


def test_pairing_removes_task_difficulty():
    # the method wins exactly the baseline's wins plus 5 more: every paired resample shows a gain
    base = np.array([1.0] * 10 + [0.0] * 30)
    method = base.copy()
    method[10:15] = 1.0
    mean, low, high = paired_bootstrap(method, base, resamples=5000, seed=0)
    assert mean == pytest.approx(5 / 40) and low > 0
    assert paired_bootstrap(base, base, resamples=100) == (0.0, 0.0, 0.0)


def _fake_run(root, name, outcomes_by_stage):
    run = root / name
    stages = []
    for stage, outcomes in outcomes_by_stage.items():
        episodes = []
        for task, (won, score) in outcomes.items():
            ep = Episode(f"alfworld/seen/{task}#0", task, "alfworld", "seen", "eval", won=won, score=score)
            ep.turns.append(Turn(observation="o", agent_text="Action: look", action="look", format_valid=True,
                                 action_valid=(task != "t0")))
            episodes.append(ep)
        write_shard(run / stage / "trajectories", 0, episodes)
        stages.append({"name": stage, "outputs": {"trajectories": f"{stage}/trajectories"},  # run-relative
                       "metrics": {"success_rate": sum(w for w, _ in outcomes.values()) / len(outcomes)}})
    # v_success: the name of v_scored (mean V where the final score is > 0) in runs made before its rename
    stages.append({"name": "iter_1/critic", "outputs": {}, "metrics": {"explained_variance": 0.25, "v_success": 0.5}})
    (run / "manifest.json").write_text(json.dumps({"stages": stages}))
    return run


def test_compare_pairs_by_episode_and_pools_runs(tmp_path):
    tasks = [f"t{i}" for i in range(6)]
    bc = {t: (i < 2, 1.0 if i < 2 else 0.0) for i, t in enumerate(tasks)}
    qe = {t: (i < 4, 1.0 if i < 4 else 0.0) for i, t in enumerate(tasks)}
    run_a = _fake_run(tmp_path, "seed0", {"bc/eval_seen": bc, "iter_1/eval_seen": qe})
    run_b = _fake_run(tmp_path, "seed1", {"bc/eval_seen": bc, "iter_1/eval_seen": bc})
    result = compare_runs([run_a, run_b], resamples=500, seed=0)
    rows = {(r["method"], r["run"]): r for r in result["rows"]}
    assert rows[("SFT (BC)", "seed0")]["success_rate"] == pytest.approx(2 / 6)
    assert "success_diff" not in rows[("SFT (BC)", "seed0")]
    qe_a = rows[("Q-Evolve iter 1", "seed0")]
    assert qe_a["success_diff"] == pytest.approx(2 / 6) and qe_a["paired_episodes"] == 6
    assert rows[("Q-Evolve iter 1", "seed1")]["success_diff"] == 0.0
    pooled = rows[("Q-Evolve iter 1", "all runs")]
    assert pooled["paired_episodes"] == 12 and pooled["success_diff"] == pytest.approx(2 / 12)
    assert result["diagnostics"]["seed0"] == {"iter_1/critic:explained_variance": 0.25, "iter_1/critic:v_scored": 0.5}
    text = render_markdown(result)
    assert "| seen | Q-Evolve iter 1 | seed0 | 6 | 0.667 |" in text and "explained_variance" in text


def test_compare_cli_writes_results_and_refuses_a_non_run(tmp_path):
    from typer.testing import CliRunner

    from qevolve.cli import app

    run = _fake_run(tmp_path, "one", {"bc/eval_seen": {"t0": (True, 1.0)}, "iter_1/eval_seen": {"t0": (False, 0.0)}})
    result = CliRunner().invoke(app, ["compare", str(run), "--resamples", "100"])
    assert result.exit_code == 0, result.output
    assert (run / "results.md").is_file() and json.loads((run / "results.json").read_text())["rows"]
    bad = CliRunner().invoke(app, ["compare", str(tmp_path / "nowhere")])
    assert bad.exit_code == 2 and "not a run directory (no manifest.json)" in bad.output
    import shutil

    shutil.rmtree(run / "iter_1/eval_seen/trajectories")  # a done stage whose episodes are gone: said, not 0 rows
    gone = CliRunner().invoke(app, ["compare", str(run)])
    assert gone.exit_code == 2 and "stage 'iter_1/eval_seen' is recorded as done but its trajectories" in gone.output


def test_compare_adds_a_stand_alone_eval_folder_paired_with_the_first_runs_sft(tmp_path):
    from typer.testing import CliRunner

    from qevolve.cli import app

    tasks = [f"t{i}" for i in range(6)]
    bc = {t: (i < 2, 1.0 if i < 2 else 0.0) for i, t in enumerate(tasks)}
    run = _fake_run(tmp_path, "seed0", {"bc/eval_seen": bc})
    posthoc = _fake_run(tmp_path, "posthoc", {"eval": {t: (i < 5, 1.0 if i < 5 else 0.0)
                                                       for i, t in enumerate(tasks)}}) / "eval"
    (posthoc / "metrics.json").write_text(json.dumps({"protocol": {"split": "seen"}, "invalid_action_rate": 0.1}))
    result = compare_runs([run], resamples=500, seed=0, extras=[("post-hoc", posthoc)])
    row = next(r for r in result["rows"] if r["method"] == "post-hoc")
    assert row["split"] == "seen" and row["run"] == "seed0" and row["paired_episodes"] == 6
    assert row["success_diff"] == pytest.approx(3 / 6) and row["invalid_action_rate"] == 0.1
    out = CliRunner().invoke(app, ["compare", str(run), "--extra", f"post-hoc={posthoc}", "--resamples", "100"])
    assert out.exit_code == 0 and "| seen | post-hoc | seed0 | 6 | 0.833 |" in out.output, out.output
    bad = CliRunner().invoke(app, ["compare", str(run), "--extra", str(posthoc)])
    assert bad.exit_code != 0 and "expected LABEL=FOLDER" in bad.output
    (posthoc / "metrics.json").unlink()
    with pytest.raises(ValueError, match="not a `qevolve eval` output folder"):
        compare_runs([run], extras=[("post-hoc", posthoc)])


def test_compare_against_rft_names_it_and_keeps_the_sft_table(tmp_path):
    """--baseline iter_1/rft gives Q-Evolve - RFT, headed as such, in its own files beside results.md."""
    from typer.testing import CliRunner

    from qevolve.cli import app

    tasks = [f"t{i}" for i in range(4)]
    run = _fake_run(tmp_path, "one", {"bc/eval_seen": {t: (False, 0.0) for t in tasks},
                                      "iter_1/eval_seen": {t: (i < 3, 1.0 if i < 3 else 0.0) for i, t in enumerate(tasks)},
                                      "iter_1/rft/eval_seen": {t: (i < 1, 1.0 if i < 1 else 0.0) for i, t in enumerate(tasks)}})
    assert CliRunner().invoke(app, ["compare", str(run), "--resamples", "100"]).exit_code == 0
    sft_table = (run / "results.md").read_text()
    out = CliRunner().invoke(app, ["compare", str(run), "--baseline", "iter_1/rft", "--resamples", "100"])
    assert out.exit_code == 0, out.output
    assert (run / "results.md").read_text() == sft_table and "success - SFT [95% CI]" in sft_table
    text = (run / "results_vs_iter_1_rft.md").read_text()
    assert "success - RFT (iter 1 buffer) [95% CI]" in text
    rows = {r["method"]: r for r in json.loads((run / "results_vs_iter_1_rft.json").read_text())["rows"]}
    assert rows["Q-Evolve iter 1"]["success_diff"] == pytest.approx(2 / 4)  # 3/4 won against RFT's 1/4
    assert rows["SFT (BC)"]["success_diff"] == pytest.approx(-1 / 4)


def test_every_row_shows_the_env_steps_of_the_interaction_that_made_its_policy(tmp_path):
    """BC 0; Q-Evolve iter k the rollouts of iterations 1..k; RFT and the other iteration-1 rows iteration 1's
    rollouts; GRPO all its rounds' rollouts; evaluations and demonstrations never count."""
    from qevolve.evaluation.compare import policy_env_steps, success_table

    tasks = [f"t{i}" for i in range(3)]
    outcome = {t: (i < 1, 1.0 if i < 1 else 0.0) for i, t in enumerate(tasks)}
    runs = []
    for name, scale in (("s0", 1), ("s1", 3)):
        run = _fake_run(tmp_path, name, {p: outcome for p in ("bc/eval_seen", "iter_1/eval_seen", "iter_1/rft/eval_seen",
                                                               "iter_1/grpo/eval_seen", "iter_2/eval_seen")})
        manifest = json.loads((run / "manifest.json").read_text())
        for stage in manifest["stages"]:  # the evaluations' own steps must not count
            stage["metrics"]["env_steps"] = 1000
        manifest["stages"] += [
            {"name": "iter_1/rollouts", "metrics": {"env_steps": 40 * scale}},
            {"name": "iter_1/grpo/round_1/rollouts", "metrics": {"env_steps": 100 * scale}},
            {"name": "iter_1/grpo/round_1/policy", "metrics": {"steps": 7}},
            {"name": "iter_1/grpo/round_2/rollouts", "metrics": {"env_steps": 90 * scale}},
            {"name": "iter_2/rollouts", "metrics": {"env_steps": 30 * scale}}]
        (run / "manifest.json").write_text(json.dumps(manifest))
        runs.append(run)
    stages = json.loads((runs[0] / "manifest.json").read_text())["stages"]
    want = {"bc": 0, "iter_1": 40, "iter_1/rft": 40, "iter_1/grpo": 190, "iter_2": 70}
    assert {prefix: policy_env_steps(stages, prefix) for prefix in want} == want
    assert policy_env_steps(stages, "iter_3") is None  # a rollout stage it would need is not in the manifest
    assert policy_env_steps(stages, "extra:post-hoc") is None
    assert {row["policy"]: row["env_steps"] for row in success_table(stages, ["seen"])} == {
        "BC": 0, "Q-Evolve iter 1": 40, "RFT (iter 1 buffer)": 40, "GRPO": 190, "Q-Evolve iter 2": 70}
    result = compare_runs(runs, resamples=100, seed=0)
    rows = {(r["method"], r["run"]): r["env_steps"] for r in result["rows"]}
    assert rows[("GRPO", "s0")] == 190 and rows[("GRPO", "s1")] == 570 and rows[("GRPO", "all runs")] == 380
    assert rows[("SFT (BC)", "all runs")] == 0 and rows[("Q-Evolve iter 2", "s1")] == 210
    text = render_markdown(result)
    assert text.splitlines()[2].endswith("| env steps |")
    assert any(line.startswith("| seen | GRPO | s1 | 3 |") and line.endswith("| 570 |") for line in text.splitlines())
    assert any(line.startswith("| seen | Q-Evolve iter 2 | all runs |") and line.endswith("| 140 |")
               for line in text.splitlines())


def test_an_online_baselines_policies_on_the_way_are_rows_of_their_budget_pooled_across_seeds(tmp_path):
    """GRPO evaluated at budgets (grpo.evaluate_at_env_steps [150, 250]): each seed's round that first reaches a
    budget is a row named by the budget, with the steps that round actually spent; seeds whose rounds differ
    in length pool the budget (round 2 in one seed, round 1 in the other), and a budget that only the last
    round reached is the last policy's evaluation."""
    from qevolve.evaluation.compare import policy_env_steps, success_table

    tasks = [f"t{i}" for i in range(4)]
    outcome = {t: (i < 2, 1.0 if i < 2 else 0.0) for i, t in enumerate(tasks)}
    runs = []
    for name, round_steps, on_the_way in (("s0", (100, 100, 100), [2]), ("s1", (160, 60, 100), [1])):
        evaluated = ["bc", "iter_1", *(f"iter_1/grpo/round_{r}" for r in on_the_way), "iter_1/grpo"]
        run = _fake_run(tmp_path, name, {f"{prefix}/eval_seen": outcome for prefix in evaluated})
        manifest = json.loads((run / "manifest.json").read_text())
        manifest["config"] = {"grpo": {"evaluate_at_env_steps": [150, 250]}, "ppo": {"evaluate_at_env_steps": []}}
        manifest["stages"] += [{"name": "iter_1/rollouts", "metrics": {"env_steps": 40}}] + [
            {"name": f"iter_1/grpo/round_{r}/rollouts", "metrics": {"env_steps": steps}}
            for r, steps in enumerate(round_steps, start=1)]
        (run / "manifest.json").write_text(json.dumps(manifest))
        runs.append(run)
    stages = json.loads((runs[0] / "manifest.json").read_text())["stages"]
    assert policy_env_steps(stages, "iter_1/grpo/round_2") == 200
    assert policy_env_steps(stages, "iter_1/grpo@150") == 200 and policy_env_steps(stages, "iter_1/grpo@250") == 300
    assert policy_env_steps(stages, "iter_1/grpo@400") is None  # no round reached it
    budgets = {"grpo": [150, 250]}
    assert {row["policy"]: row["env_steps"] for row in success_table(stages, ["seen"], budgets)} == {
        "BC": 0, "Q-Evolve iter 1": 40, "GRPO at 150 env steps": 200, "GRPO": 300, "GRPO at 250 env steps": 300}
    # without the budgets (an older reader's view) the round's policy is named by its round
    assert "GRPO after round 2" in {row["policy"] for row in success_table(stages, ["seen"])}

    result = compare_runs(runs, resamples=100, seed=0)
    rows = {(r["method"], r["run"]): r["env_steps"] for r in result["rows"]}
    assert rows[("GRPO at 150 env steps", "s0")] == 200 and rows[("GRPO at 150 env steps", "s1")] == 160
    assert rows[("GRPO at 150 env steps", "all runs")] == 180
    assert rows[("GRPO at 250 env steps", "s0")] == 300 and rows[("GRPO at 250 env steps", "s1")] == 320
    assert not any("round" in method for method, _ in rows)
    pooled = {row["method"]: row for row in result["seed_rows"]}
    assert pooled["GRPO at 150 env steps"]["runs"] == 2 and pooled["GRPO at 250 env steps"]["runs"] == 2
    assert pooled["GRPO at 150 env steps"]["prefix"] == "iter_1/grpo@150"
    assert "| seen | GRPO at 150 env steps | all runs |" in render_markdown(result)
