"""Per-step training scalars in a plain file, and reading them back.

Every training stage (behaviour cloning, the RFT baseline, BPPO/AWR, DPO) writes, beside its
TensorBoard folder, ``scalars.jsonl`` in its output folder: one line per logged optimizer step,
``{"step": N, "<tag>": value, ...}`` with the tags TensorBoard gets (``train/loss``,
``policy/kl_ref``, ...). It is what the run report and the run-level TensorBoard and W&B loggers
read: a few kilobytes, written whether TensorBoard is on or not, readable without TensorBoard.

The critic keeps its per-epoch history in ``metrics.jsonl`` (one line per epoch) and its k-fold
held-out curve in ``kfold.json``; :func:`stage_scalars` reads either kind of stage, and falls back to
a stage's TensorBoard event files for runs made before ``scalars.jsonl`` existed.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, TextIO

SCALARS_FILE = "scalars.jsonl"
CRITIC_HISTORY_FILE = "metrics.jsonl"  # qevolve.critic.train.METRICS_FILE (not imported: that pulls in torch)
CRITIC_KFOLD_FILE = "kfold.json"  # qevolve.critic.train.KFOLD_FILE

Series = dict[str, list[tuple[int, float]]]  # tag -> [(step, value)] sorted by step

# Keys of a critic history line that are its coordinates or a wall time, not a curve.
_CRITIC_NON_CURVES = frozenset({"epoch", "steps", "seconds"})

# Critic metrics under their former names: mean V on the trajectories whose final score is > 0 (the
# weighting's d) and = 0 were called v_success/v_failure, although on WebShop a wrong purchase scores
# > 0; "success" now means Episode.won everywhere. Older runs' files are read under the new names.
CRITIC_METRIC_RENAMES = {"v_success": "v_scored", "v_failure": "v_unscored",
                         "heldout_v_success": "heldout_v_scored", "heldout_v_failure": "heldout_v_unscored"}


def critic_metrics_renamed(metrics: dict[str, Any]) -> dict[str, Any]:
    """A critic metrics line (or a stage's critic metrics) with former names replaced by today's."""
    return {CRITIC_METRIC_RENAMES.get(key, key): value for key, value in metrics.items()}


class ScalarLog:
    """Appends one line per logged step to ``path``.

    ``resume_step``: the step a resumed training continues from. Lines of later steps (logged by
    the interrupted attempt after its last checkpoint) are dropped first, so the file of a resumed
    run holds each step once, with the values the resumed run computes."""

    def __init__(self, path: str | Path, resume_step: int = 0):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = []
        if resume_step > 0 and self.path.is_file():
            kept = [line for line in _lines(self.path) if line["step"] <= resume_step]
        with open(self.path.with_name(self.path.name + ".tmp"), "w") as handle:
            for line in kept:
                handle.write(json.dumps(line) + "\n")
        self.path.with_name(self.path.name + ".tmp").replace(self.path)
        self._handle: TextIO | None = open(self.path, "a")

    def write(self, step: int, values: dict[str, float]) -> None:
        if self._handle is None or not values:
            return
        self._handle.write(json.dumps({"step": int(step), **{k: float(v) for k, v in values.items()}}) + "\n")
        self._handle.flush()  # a killed stage keeps the steps it logged

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None


def _lines(path: Path, key: str = "step") -> list[dict[str, Any]]:
    """The parseable lines of a jsonl file that carry a numeric ``key`` (a line cut by a kill is skipped)."""
    out = []
    with open(path) as handle:
        for text in handle:
            try:
                line = json.loads(text)
            except json.JSONDecodeError:
                continue
            if isinstance(line, dict) and isinstance(line.get(key), (int, float)) and not isinstance(line[key], bool):
                out.append(line)
    return out


def _series(rows: list[tuple[int, str, float]]) -> Series:
    """Per tag, the last value logged for each step, in step order."""
    by_tag: dict[str, dict[int, float]] = {}
    for step, tag, value in rows:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            by_tag.setdefault(tag, {})[int(step)] = float(value)
    return {tag: sorted(values.items()) for tag, values in sorted(by_tag.items())}


def read_scalars(path: str | Path) -> Series:
    """The curves of a ``scalars.jsonl`` file."""
    return _series([(line["step"], tag, value) for line in _lines(Path(path))
                    for tag, value in line.items() if tag != "step"])


def read_critic_history(path: str | Path) -> Series:
    """The critic's per-epoch history (``metrics.jsonl``) as curves ``critic/<key>`` over the epoch."""
    return _series([(line["epoch"], f"critic/{key}", value) for line in _lines(Path(path), "epoch")
                    for key, value in critic_metrics_renamed(line).items() if key not in _CRITIC_NON_CURVES])


def read_critic_kfold(path: str | Path) -> Series:
    """The k-fold held-out curve of ``kfold.json`` over the epoch, for the V the labels read:
    ``critic/kfold_explained_variance`` and ``critic/kfold_auc_won_vs_lost``; {} when unreadable."""
    try:
        kfold = json.loads(Path(path).read_text())
        source = kfold["label_value"]
        return _series([(row["epoch"], f"critic/kfold_{key}", row[f"{key}_{source}"]) for row in kfold["curve"]
                        for key in ("explained_variance", "auc_won_vs_lost")])
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def read_event_scalars(folder: str | Path) -> Series:
    """The scalars of the TensorBoard event files in ``folder`` (all of them, not a sample)."""
    from tensorboard.backend.event_processing import event_accumulator

    accumulator = event_accumulator.EventAccumulator(
        str(folder), size_guidance={event_accumulator.SCALARS: 0, event_accumulator.TENSORS: 1,
                                    event_accumulator.HISTOGRAMS: 1, event_accumulator.IMAGES: 1,
                                    event_accumulator.AUDIO: 1, event_accumulator.COMPRESSED_HISTOGRAMS: 1})
    accumulator.Reload()
    return _series([(event.step, tag, event.value) for tag in accumulator.Tags().get("scalars", [])
                    for event in accumulator.Scalars(tag)])


def stage_scalars(folder: str | Path) -> tuple[Series, str]:
    """The training curves a stage folder holds and their x axis (``step`` or ``epoch``).

    ``scalars.jsonl`` (policy training stages), else ``metrics.jsonl`` (the critic's epochs), else
    the event files in ``tensorboard/`` (runs written before ``scalars.jsonl``); ({}, "step") when
    the stage trains nothing (rollouts, evaluations, buffers)."""
    folder = Path(folder)
    if (folder / SCALARS_FILE).is_file():
        return read_scalars(folder / SCALARS_FILE), "step"
    if (folder / CRITIC_HISTORY_FILE).is_file():
        series = read_critic_history(folder / CRITIC_HISTORY_FILE)
        if (folder / CRITIC_KFOLD_FILE).is_file():
            series.update(read_critic_kfold(folder / CRITIC_KFOLD_FILE))
        return series, "epoch"
    events = folder / "tensorboard"
    if events.is_dir() and any(events.glob("events.out.tfevents.*")):
        return read_event_scalars(events), "step"
    return {}, "step"
