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
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from qevolve.buffer.store import read_episodes, shard_paths

__all__ = ["paired_bootstrap", "load_run_evaluations", "compare_runs", "render_markdown", "method_name",
           "results_stem"]

# What the diagnosis of a run reads from its manifest: (stage suffix, metric) pairs, where present.
DIAGNOSTICS = [
    ("critic", "explained_variance"), ("critic", "v_success"), ("critic", "v_failure"),
    ("label", "advantage_mean_won"), ("label", "advantage_mean_lost"), ("label", "v_mean_won"),
    ("label", "v_mean_lost"), ("policy", "last_kl_ref"), ("policy", "last_clip_frac_low"),
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
    prefix: str
    split: str
    outcomes: dict[str, tuple[float, float]]  # episode id -> (won, score)
    metrics: dict[str, Any]


def load_run_evaluations(run_dir: Path) -> tuple[list[Evaluation], dict[str, Any]]:
    """The evaluation stages of a run directory and its manifest."""
    manifest_path = run_dir / "manifest.json"
    if not manifest_path.is_file():
        raise ValueError(f"{run_dir}: not a run directory (no manifest.json)")
    manifest = _read_json(manifest_path)
    evaluations = []
    for stage in manifest.get("stages", []):
        prefix, _, leaf = stage["name"].rpartition("/")
        if not leaf.startswith("eval_"):
            continue
        # outputs are recorded relative to the run directory (qevolve.evolve.run_dir)
        folder = run_dir / stage.get("outputs", {}).get("trajectories", f"{stage['name']}/trajectories")
        if not (folder.is_dir() and shard_paths(folder)):
            raise ValueError(f"{manifest_path}: stage {stage['name']!r} is recorded as done but its trajectories "
                             f"{folder} hold no shards (moved or deleted? `qevolve evolve --redo {stage['name']}`)")
        evaluations.append(Evaluation(run_dir.name, prefix, leaf[len("eval_"):], _outcomes(folder),
                                      stage.get("metrics", {})))
    return evaluations, manifest


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not valid JSON ({error})") from None


def _outcomes(trajectories: Path) -> dict[str, tuple[float, float]]:
    """Episode id -> (won, final score) of an evaluation's trajectory shards."""
    return {ep.episode_id: (float(ep.won), float(ep.score)) for ep in read_episodes(trajectories)}


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
    return Evaluation(run, f"extra:{label}", split, _outcomes(trajectories), metrics)


def compare_runs(run_dirs: list[Path], baseline: str = "bc", resamples: int = 10_000,
                 seed: int = 0, extras: list[tuple[str, Path]] | None = None) -> dict[str, Any]:
    """Rows method x split (x run, plus pooled rows over runs) and each run's diagnostics.

    ``extras`` are (label, folder) pairs of stand-alone ``qevolve eval`` outputs (e.g. a post-hoc
    policy trained from a run's buffer); each is compared with the first run's baseline, paired over
    the episodes both evaluated."""

    runs = []
    for run_dir in run_dirs:
        evaluations, manifest = load_run_evaluations(run_dir)
        if not evaluations:
            raise ValueError(f"{run_dir}: no evaluation stages (<prefix>/eval_<split>) in its manifest")
        runs.append((run_dir, evaluations, manifest))
    for label, folder in extras or []:
        runs[0][1].append(load_eval_folder(folder, runs[0][0].name, label))
    rows: list[dict[str, Any]] = []
    order: list[tuple[str, str]] = []  # (prefix, split) in first-seen order
    for _, evaluations, _ in runs:
        for e in evaluations:
            if (e.prefix, e.split) not in order:
                order.append((e.prefix, e.split))
    order.sort(key=lambda key: (key[1], key[0] != baseline))  # split by split, the baseline first
    for prefix, split in order:
        label = method_name(prefix)
        per_run = []
        for run_dir, evaluations, _ in runs:
            found = {(e.prefix, e.split): e for e in evaluations}
            if (prefix, split) in found:
                base = found.get((baseline, split)) if prefix != baseline else None
                per_run.append((run_dir.name, found[(prefix, split)], base))
        for run_name, evaluation, base in per_run:
            rows.append(_row(label, run_name, split, [(evaluation, base)], resamples, seed))
        if len(runs) > 1 and len(per_run) == len(runs):
            pooled = [(_with_run(e, name), _with_run(b, name) if b else None) for name, e, b in per_run]
            rows.append(_row(label, "all runs", split, pooled, resamples, seed))
    diagnostics = {}
    for run_dir, _, manifest in runs:
        diag: dict[str, Any] = {}
        for stage in manifest.get("stages", []):
            kind = stage["name"].rpartition("/")[2]
            for suffix, key in DIAGNOSTICS:
                if kind == suffix and key in stage.get("metrics", {}):
                    diag[f"{stage['name']}:{key}"] = stage["metrics"][key]
        diagnostics[run_dir.name] = diag
    return {"baseline": baseline, "resamples": resamples, "seed": seed, "runs": [str(r[0]) for r in runs],
            "rows": rows, "diagnostics": diagnostics}


def method_name(prefix: str) -> str:
    """A row's method name: SFT (BC) for ``bc``, an extra's label, else the evolve loop's label."""
    from qevolve.evolve.loop import method_label

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
                      {f"{run}::{k}": v for k, v in evaluation.outcomes.items()}, evaluation.metrics)


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def render_markdown(result: dict[str, Any]) -> str:
    name = "SFT" if result["baseline"] == "bc" else method_name(result["baseline"])
    lines = [f"Baseline: `{result['baseline']}` ({name}); paired bootstrap over common episodes, "
             f"{result['resamples']:,} resamples, seed {result['seed']}; 95% percentile intervals.", "",
             f"| split | method | run | episodes | success | mean reward | invalid actions | success - {name} [95% CI] "
             f"| reward - {name} [95% CI] |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        diff = reward = "-"
        if "success_diff" in row:
            lo, hi = row["success_diff_ci"]
            diff = f"{row['success_diff']:+.3f} [{lo:+.3f}, {hi:+.3f}]"
            lo, hi = row["reward_diff_ci"]
            reward = f"{row['reward_diff']:+.3f} [{lo:+.3f}, {hi:+.3f}]"
        lines.append(f"| {row['split']} | {row['method']} | {row['run']} | {row['episodes']} | "
                     f"{_fmt(row['success_rate'])} | {_fmt(row['mean_reward'])} | {_fmt(row['invalid_action_rate'])} "
                     f"| {diff} | {reward} |")
    for run, diag in result["diagnostics"].items():
        if diag:
            lines += ["", f"Diagnostics of `{run}` (from its manifest):", "", "| stage:metric | value |", "|---|---|"]
            lines += [f"| {key} | {_fmt(value, 4)} |" for key, value in diag.items()]
    return "\n".join(lines) + "\n"
