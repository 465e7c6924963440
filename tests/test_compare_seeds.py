"""``qevolve compare`` over seed replicates: the estimators against plain loops, the two-level
bootstrap's coverage, tables from fake run directories of 3 and 5 seeds, and runs that are not seeds
of one protocol."""

import json
import re
from fractions import Fraction

import numpy as np
import pytest

from qevolve.buffer.store import Episode, Turn, write_shard
from qevolve.evaluation import stats
from qevolve.evaluation.compare import compare_runs, render_markdown
from qevolve.evaluation.stats import (draw_seeds, improvement_probability, interquartile_mean, percentile_interval,
                                      probability_of_improvement, two_level_means)

# ------------------------------------------------------------------------------ the estimators


def _iqm_loop(values):
    """scipy.stats.trim_mean(values, 0.25) written out: cut floor(n / 4) values from each end."""
    ordered = sorted(values)
    cut = int(0.25 * len(ordered))
    middle = ordered[cut:len(ordered) - cut]
    return sum(middle) / len(middle)


def test_interquartile_mean_equals_a_plain_loop_and_trims_whole_values():
    rng = np.random.default_rng(3)
    for n in range(1, 14):
        values = rng.integers(0, 64, n) / 32  # dyadic: sums are exact, so equality is exact
        assert interquartile_mean(values) == _iqm_loop(list(values))
    assert interquartile_mean([0.0, 1.0, 2.0, 3.0, 100.0]) == 2.0  # 5 seeds: the middle 3
    assert interquartile_mean([0, 1, 2, 3, 4, 5, 100]) == 3.0  # 7: floor(1.75) = 1 cut from each end
    assert interquartile_mean([0, 1, 2, 3, 4, 5, 6, 100]) == 3.5  # 8: the middle 4
    batch = rng.integers(0, 64, (4, 6)) / 32
    assert list(interquartile_mean(batch)) == [_iqm_loop(list(row)) for row in batch]


def _poi_loop(x, y):
    wins = sum(Fraction(1) if a > b else Fraction(1, 2) if a == b else Fraction(0) for a in x for b in y)
    return float(wins / (len(x) * len(y)))


def test_probability_of_improvement_equals_a_plain_loop():
    rng = np.random.default_rng(4)
    for n, m in [(1, 1), (3, 3), (5, 4), (2, 7)]:
        x, y = rng.integers(0, 4, n).astype(float), rng.integers(0, 4, m).astype(float)  # with ties
        assert improvement_probability(x, y) == _poi_loop(x, y)
    tasks_x = [rng.integers(0, 4, 5).astype(float) for _ in range(3)]
    tasks_y = [rng.integers(0, 4, 5).astype(float) for _ in range(3)]
    assert probability_of_improvement(tasks_x, tasks_y) == sum(_poi_loop(x, y) for x, y in zip(tasks_x, tasks_y)) / 3
    assert improvement_probability([2.0, 3.0], [0.0, 1.0]) == 1.0
    assert improvement_probability([1.0, 1.0], [1.0, 1.0]) == 0.5
    batch_x, batch_y = rng.integers(0, 4, (6, 5)).astype(float), rng.integers(0, 4, (6, 5)).astype(float)
    assert list(improvement_probability(batch_x, batch_y)) == [_poi_loop(a, b) for a, b in zip(batch_x, batch_y)]


def _two_level_loop(seeds, seed_draws, u):
    """The two-level bootstrap written as loops, on the same draws: slot j of resample r takes seed
    seed_draws[r, j] and its goals floor(u[r, j, g] * n_s) for g < n_s."""
    resamples, slots = seed_draws.shape
    out = np.empty((resamples, slots, seeds[0].shape[1]))
    for r in range(resamples):
        for j in range(slots):
            goals = seeds[seed_draws[r, j]]
            n = len(goals)
            picked = [goals[min(int(u[r, j, g] * n), n - 1)] for g in range(n)]
            out[r, j] = [sum(row[c] for row in picked) / n for c in range(goals.shape[1])]
    return out


def test_two_level_bootstrap_equals_a_plain_loop_on_the_same_draws(monkeypatch):
    rng = np.random.default_rng(5)
    seeds = [rng.integers(0, 2, (n, 2)).astype(float) for n in (7, 4, 9)]  # uneven goal counts
    resamples = 300
    mine = np.random.default_rng(11)
    draws = draw_seeds(mine, 3, resamples)
    fast = two_level_means(seeds, draws, mine)
    again = np.random.default_rng(11)
    same_draws = again.integers(0, 3, size=(resamples, 3))
    assert (same_draws == draws).all()
    slow = _two_level_loop(seeds, same_draws, again.random((resamples, 3, 9)))
    assert fast == pytest.approx(slow, rel=1e-12, abs=1e-12)
    # drawn in small chunks: the same numbers (the uniforms are one stream, chunk by chunk)
    monkeypatch.setattr(stats, "_CHUNK_ELEMENTS", 100)
    chunked = np.random.default_rng(11)
    assert (two_level_means(seeds, draw_seeds(chunked, 3, resamples), chunked) == fast).all()


def test_the_two_level_interval_is_seeded():
    rng = np.random.default_rng(6)
    seeds = [rng.integers(0, 2, (20, 1)).astype(float) for _ in range(4)]

    def interval(seed):
        gen = np.random.default_rng(seed)
        return percentile_interval(two_level_means(seeds, draw_seeds(gen, 4, 500), gen).mean(axis=1)[:, 0])

    assert interval(1) == interval(1) and interval(1) != interval(2)


def test_two_level_interval_of_the_difference_covers_the_true_difference():
    """200 synthetic experiments, 5 seeds x 50 goals with a known true difference of 0.1: the goals'
    difficulty (shared by the seeds, as in one protocol) plus a per-seed offset of each method's
    success probability (seed-level noise), and a win drawn per goal (goal-level Bernoulli noise,
    one uniform per goal for both methods: paired). The 95% interval must cover 0.1 in 90-99%."""
    gen = np.random.default_rng(0)
    delta, n_seeds, n_goals, hits = 0.1, 5, 50, 0
    for experiment in range(200):
        difficulty = gen.uniform(0.25, 0.6, size=n_goals)  # + offsets within [-0.05, 0.15]: no clipping
        baseline = difficulty + gen.uniform(-0.05, 0.05, size=(n_seeds, 1))
        method = difficulty + delta + gen.uniform(-0.05, 0.05, size=(n_seeds, 1))
        u = gen.random((n_seeds, n_goals))
        seeds = [np.stack([u[s] < method[s], u[s] < baseline[s]], axis=1) for s in range(n_seeds)]
        rng = np.random.default_rng(experiment)
        means = two_level_means(seeds, draw_seeds(rng, n_seeds, 1000), rng)
        low, high = percentile_interval((means[..., 0] - means[..., 1]).mean(axis=1))
        hits += low <= delta <= high
    assert 0.90 <= hits / 200 <= 0.99, hits


# ------------------------------------------------------------------------------ fake run directories


def _seed_run(root, name, stages, failed=None, environment=None):
    """A run directory whose evaluation stages hold ``stages[stage] = [(task, won, score), ...]``;
    ``failed[stage]`` more episodes of tasks f0, f1, ... failed (lost, reward 0, recorded as failed)."""
    run = root / name
    records = []
    for stage, outcomes in stages.items():
        episodes = []
        for task, won, score in outcomes:
            ep = Episode(f"webshop/test/{task}#0", task, "webshop", "test", "eval", won=won, score=score)
            ep.turns.append(Turn(observation="o", agent_text="Action: search[x]", action="search[x]",
                                 format_valid=True, action_valid=True))
            episodes.append(ep)
        lost = (failed or {}).get(stage, 0)
        episodes += [Episode(f"webshop/test/f{i}#0", f"f{i}", "webshop", "test", "eval", failed=True,
                             failure_reason="worker died") for i in range(lost)]
        write_shard(run / stage / "trajectories", 0, episodes)
        records.append({"name": stage, "outputs": {"trajectories": f"{stage}/trajectories"},
                        "metrics": {"failed_episodes": lost}})
    manifest = {"stages": records, **({"environment": environment} if environment else {})}
    (run / "manifest.json").write_text(json.dumps(manifest))
    return run


def _outcomes(p_win, goals, rng):
    won = rng.random(goals) < p_win
    return [(f"t{g}", bool(w), float(w) * 0.5 + 0.5 * rng.random()) for g, w in enumerate(won)]


def _seeds(root, n_seeds, goals=20):
    rng = np.random.default_rng(n_seeds)
    runs = []
    for s in range(n_seeds):
        stages = {"bc/eval_test": _outcomes(0.3, goals, rng), "iter_1/eval_test": _outcomes(0.6, goals, rng)}
        # the failed episodes are goals too: every run evaluated f0, f1 (lost in some runs, played in others)
        lost_bc, lost_qe = (2, 0) if s == 1 else (0, 1 if s == 2 else 0)
        stages["bc/eval_test"] += [(f"f{i}", False, 0.0) for i in range(lost_bc, 2)]
        stages["iter_1/eval_test"] += [(f"f{i}", False, 0.0) for i in range(lost_qe, 2)]
        runs.append(_seed_run(root, f"seed{s}", stages, {"bc/eval_test": lost_bc, "iter_1/eval_test": lost_qe}))
    return runs


@pytest.mark.parametrize("n_seeds", [3, 5])
def test_table_over_seeds(tmp_path, n_seeds):
    from typer.testing import CliRunner

    from qevolve.cli import app

    runs = _seeds(tmp_path, n_seeds)
    result = compare_runs(runs, resamples=400, seed=0)
    rows = {r["method"]: r for r in result["seed_rows"]}
    sft, qe = rows["SFT (BC)"], rows["Q-Evolve iter 1"]
    assert sft["runs"] == qe["runs"] == n_seeds and result["seed_runs"] == [f"seed{s}" for s in range(n_seeds)]
    assert sft["failed_episodes"] == 2 and qe["failed_episodes"] == 1
    assert qe["failed_per_seed"][:3] == [0, 0, 1]
    # each seed's value is its run's row; the mean is theirs, the difference is paired seed by seed
    by_run = {(r["method"], r["run"]): r for r in result["rows"]}
    success = qe["success_rate"]
    assert success["per_seed"] == pytest.approx([by_run[("Q-Evolve iter 1", f"seed{s}")]["success_rate"]
                                                 for s in range(n_seeds)])
    assert success["mean"] == pytest.approx(np.mean(success["per_seed"]))
    assert success["diff"] == pytest.approx(np.mean([by_run[("Q-Evolve iter 1", f"seed{s}")]["success_diff"]
                                                     for s in range(n_seeds)]))
    assert success["diff_ci"][0] <= success["diff"] <= success["diff_ci"][1]
    assert success["p_improvement"] == pytest.approx(improvement_probability(success["per_seed"],
                                                                             sft["success_rate"]["per_seed"]))
    assert 0 <= success["p_improvement_ci"][0] <= success["p_improvement_ci"][1] <= 1
    reward = qe["mean_reward"]
    assert reward["mean"] == pytest.approx(np.mean([by_run[("Q-Evolve iter 1", f"seed{s}")]["mean_reward"]
                                                    for s in range(n_seeds)]))
    if n_seeds >= 5:
        assert success["iqm"] == pytest.approx(interquartile_mean(success["per_seed"]))
    else:
        assert success["iqm"] is None
    assert compare_runs(runs, resamples=400, seed=0)["seed_rows"] == result["seed_rows"]  # seeded
    overall = {e["method"]: e for e in result["seed_overall"]}
    assert overall["Q-Evolve iter 1"]["success_rate"]["p_improvement"] == success["p_improvement"]  # one split

    text = render_markdown(result)
    per_seed = " / ".join(f"{v:.3f}" for v in success["per_seed"])
    lo, hi = success["mean_ci"]
    dlo, dhi = success["diff_ci"]
    plo, phi = success["p_improvement_ci"]
    iqm = f" {success['iqm']:.3f} |" if n_seeds >= 5 else ""
    line = (f"| test | Q-Evolve iter 1 | {n_seeds} | {per_seed} | {success['mean']:.3f} [{lo:.3f}, {hi:.3f}] |{iqm} "
            f"{success['diff']:+.3f} [{dlo:+.3f}, {dhi:+.3f}] | {success['p_improvement']:.3f} [{plo:.3f}, {phi:.3f}] "
            f"| 1 |")
    assert line in text, text
    assert f"| test | SFT (BC) | {n_seeds} |" in text and "P(success > SFT) [95% CI]" in text
    assert "reward per seed" in text and "two-level bootstrap" in text
    assert ("| IQM |" in text) == (n_seeds >= 5)
    # the command writes the same numbers to results.json
    out = CliRunner().invoke(app, ["compare", *map(str, runs), "--output", str(tmp_path / "out"),
                                   "--resamples", "400"])
    assert out.exit_code == 0, out.output
    written = json.loads((tmp_path / "out" / "results.json").read_text())
    assert written["seed_rows"] == json.loads(json.dumps(result["seed_rows"]))
    assert (tmp_path / "out" / "results.md").read_text() == text


def test_a_single_run_has_no_summary_over_seeds(tmp_path):
    run = _seeds(tmp_path, 1)[0]
    result = compare_runs([run], resamples=100)
    assert "seed_rows" not in result and "Over " not in render_markdown(result)


def test_a_method_missing_in_a_seed_is_summarised_over_the_seeds_that_have_it(tmp_path):
    rng = np.random.default_rng(0)
    runs = []
    for s in range(3):
        stages = {"bc/eval_test": _outcomes(0.3, 10, rng), "iter_1/eval_test": _outcomes(0.6, 10, rng)}
        if s != 1:
            stages["iter_1/rft/eval_test"] = _outcomes(0.4, 10, rng)
        runs.append(_seed_run(tmp_path, f"seed{s}", stages))
    result = compare_runs(runs, resamples=200)
    rft = next(r for r in result["seed_rows"] if r["prefix"] == "iter_1/rft")
    assert rft["runs"] == 2 and rft["run_names"] == ["seed0", "seed2"] and rft["success_rate"]["per_seed"][1] is None
    assert "diff_ci" in rft["success_rate"]
    assert "| test | RFT (iter 1 buffer) | 2 | " in render_markdown(result)
    assert " / - / " in render_markdown(result)


def test_runs_of_different_protocols_are_refused_naming_the_run(tmp_path):
    from typer.testing import CliRunner

    from qevolve.cli import app

    rng = np.random.default_rng(0)
    a = _seed_run(tmp_path, "a", {"bc/eval_test": _outcomes(0.3, 5, rng), "bc/eval_dev": _outcomes(0.3, 5, rng)})
    other_split = _seed_run(tmp_path, "b", {"bc/eval_test": _outcomes(0.3, 5, rng)})
    with pytest.raises(ValueError, match="^" + re.escape(f"{other_split}: no bc/eval_dev (SFT (BC) on split 'dev'), "
                                                         f"which {a} has")):
        compare_runs([a, other_split], resamples=50)
    other_goals = _seed_run(tmp_path, "c", {"bc/eval_test": _outcomes(0.3, 6, rng),
                                            "bc/eval_dev": _outcomes(0.3, 5, rng)})
    with pytest.raises(ValueError, match="^" + re.escape(f"{other_goals}: SFT (BC) on split 'test' evaluates other "
                                                         f"episodes than in {a} (1 differ, e.g. 'webshop/test/t5#0')")):
        compare_runs([a, other_goals], resamples=50)
    no_sft = _seed_run(tmp_path, "d", {"iter_1/eval_test": _outcomes(0.3, 5, rng)})
    with pytest.raises(ValueError, match="^" + re.escape(f"{no_sft}: no evaluation of the baseline SFT (BC)")):
        compare_runs([a, no_sft], resamples=50)
    out = CliRunner().invoke(app, ["compare", str(a), str(other_split), "--output", str(tmp_path / "out")])
    assert out.exit_code == 2 and f"{other_split}: no bc/eval_dev" in out.output
    assert len(out.output.strip().splitlines()) == 1, out.output


# ------------------------------------------------------------------------------ outcomes files, environments


def test_outcomes_files_compare_like_their_run_directories(tmp_path):
    from typer.testing import CliRunner

    from qevolve.cli import app

    runs = _seeds(tmp_path / "runs", 3)
    out = CliRunner().invoke(app, ["export", *map(str, runs), "--output", str(tmp_path / "outcomes")])
    assert out.exit_code == 0, out.output
    files = [tmp_path / "outcomes" / f"seed{s}.json" for s in range(3)]
    assert all(f.is_file() for f in files) and "2 evaluations, 44 episodes" in out.output
    from_dirs = compare_runs(runs, resamples=300, seed=1)
    # the run directories are gone (checkpoints pruned, machine lost): the files give the same comparison
    import shutil
    shutil.rmtree(tmp_path / "runs")
    from_files = compare_runs(files, resamples=300, seed=1)
    for key in ("rows", "seed_rows", "seed_overall", "seed_runs", "diagnostics"):
        assert from_files[key] == from_dirs[key], key
    failed = {r["method"]: r["failed_episodes"] for r in from_files["seed_rows"]}
    assert failed == {"SFT (BC)": 2, "Q-Evolve iter 1": 1}
    # a file and a directory mix (a seed exported earlier beside one still on disk)
    again = _seeds(tmp_path / "again", 3)
    mixed = compare_runs([files[0], files[1], again[2]], resamples=300, seed=1)
    assert mixed["seed_rows"] == from_dirs["seed_rows"]


def test_bad_outcomes_files_and_duplicate_runs_get_one_line_errors(tmp_path):
    from typer.testing import CliRunner

    from qevolve.cli import app

    run = _seeds(tmp_path / "runs", 1)[0]
    CliRunner().invoke(app, ["export", str(run), "--output", str(tmp_path / "out")])
    good = json.loads((tmp_path / "out" / "seed0.json").read_text())
    wrong_format = tmp_path / "wrong.json"
    wrong_format.write_text(json.dumps({**good, "format": "other/9"}))
    with pytest.raises(ValueError, match=re.escape(f"{wrong_format}: not an outcomes file (format 'other/9', "
                                                   "expected 'qevolve-outcomes/1'")):
        compare_runs([wrong_format])
    missing = tmp_path / "missing.json"
    missing.write_text(json.dumps({**good, "outcomes": {"bc/eval_test": good["outcomes"]["bc/eval_test"]}}))
    with pytest.raises(ValueError, match=re.escape(f"{missing}: no outcomes for the evaluation stage "
                                                   "'iter_1/eval_test'")):
        compare_runs([missing])
    out = CliRunner().invoke(app, ["compare", str(run), str(tmp_path / "out" / "seed0.json"),
                                   "--output", str(tmp_path / "cmp")])
    assert out.exit_code == 2 and "two runs named 'seed0'" in out.output, out.output
    assert len(out.output.strip().splitlines()) == 1, out.output
    out = CliRunner().invoke(app, ["export", str(tmp_path / "nowhere"), "--output", str(tmp_path / "x")])
    assert out.exit_code == 2 and "not a run directory (no manifest.json)" in out.output


def test_seeds_from_different_environments_are_flagged(tmp_path):
    rng = np.random.default_rng(0)
    env = {"cpu": {"model": "AMD EPYC", "features": ["avx2", "fma", "avx512f", "avx512_bf16"], "cores": 2},
           "precision": "bf16", "generation_backend": {"rollout": "vllm", "eval": "vllm"}, "threads": {"torch": 2}}
    other = {**env, "cpu": {**env["cpu"], "features": ["avx2", "fma"]}, "precision": "fp32",
             "generation_backend": {"rollout": "hf", "eval": "hf"}}

    def seeds(envs):
        return [_seed_run(tmp_path / f"{len(envs)}-{id(envs)}", f"s{i}",
                          {"bc/eval_test": _outcomes(0.3, 8, rng), "iter_1/eval_test": _outcomes(0.5, 8, rng)},
                          environment=e) for i, e in enumerate(envs)]

    same = compare_runs(seeds([env, env, env]), resamples=50)
    assert same["environment_differences"] == {} and "not made in one environment" not in render_markdown(same)
    mixed = compare_runs(seeds([env, env, other]), resamples=50)
    diff = mixed["environment_differences"]
    assert set(diff) == {"cpu.features", "precision", "generation_backend"}
    assert diff["precision"] == {'"bf16"': ["s0", "s1"], '"fp32"': ["s2"]}
    text = render_markdown(mixed)
    assert "not made in one environment" in text and '- precision: "bf16" (s0, s1); "fp32" (s2)' in text
    unrecorded = compare_runs(seeds([env, None]), resamples=50)["environment_differences"]
    assert unrecorded["precision"] == {'"bf16"': ["s0"], "not recorded": ["s1"]}


def test_a_run_continued_in_another_environment_is_flagged(tmp_path):
    rng = np.random.default_rng(1)
    env = {"cpu": {"model": "AMD EPYC", "features": ["avx2", "avx512_bf16"], "cores": 2}, "precision": "bf16",
           "versions": {"torch": "2.13.0+cpu"}}
    run = _seed_run(tmp_path, "r", {"bc/eval_test": _outcomes(0.3, 6, rng), "iter_1/eval_test": _outcomes(0.4, 6, rng)},
                    environment=env)
    manifest = json.loads((run / "manifest.json").read_text())
    result = compare_runs([run], resamples=50)
    assert result["resumed_elsewhere"] == {} and "continued in another environment" not in render_markdown(result)
    # a resume with the same numbers-relevant fields (another qevolve version only) is not flagged
    same = {**env, "versions": {"torch": "2.13.0+cpu", "qevolve": "9"}}
    moved = {**env, "cpu": {**env["cpu"], "features": ["avx2"]}, "precision": "fp32"}
    manifest["environment_changes"] = [{"after_stage": "bc/eval_test", "environment": same},
                                       {"after_stage": "bc/eval_test", "environment": moved}]
    (run / "manifest.json").write_text(json.dumps(manifest))
    result = compare_runs([run], resamples=50)
    assert result["resumed_elsewhere"] == {"r": [{"after_stage": "bc/eval_test",
                                                  "fields": ["cpu.features", "precision"]}]}
    assert ("Note: `r` was continued in another environment: after stage bc/eval_test (cpu.features, precision "
            "differ)") in render_markdown(result)
