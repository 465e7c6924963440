"""A run directory with a manifest: every stage writes atomically and is recorded once.

``runs/NAME/`` holds ``manifest.json`` (config, versions, seeds, and for each completed stage
what it read, what it wrote and its metrics), ``metrics.jsonl`` (one line per completed stage,
regenerated from the manifest so it never holds a duplicate or a stage that did not finish), and
one folder per stage output (``bc/``, ``iter_1/rollouts/``, ``iter_1/critic/``, ...).

A stage runs in a temporary folder beside its target and is renamed into place only when it
returns; then the manifest is rewritten atomically. A run killed at any moment therefore loses at
most the stage in progress, and ``--resume`` skips every stage the manifest records. The manifest
holds no wall-clock values (they go to ``timings.jsonl``), so an interrupted-then-resumed run and
an uninterrupted run with the same seeds write the same manifest.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import tempfile
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

MANIFEST = "manifest.json"
METRICS = "metrics.jsonl"
TIMINGS = "timings.jsonl"

TRACKED_PACKAGES = ("qevolve", "torch", "transformers", "peft", "alfworld", "textworld", "scienceworld", "pyarrow")


def package_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for name in TRACKED_PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return versions


def write_json_atomic(path: Path, payload: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(payload, handle, indent=1, sort_keys=True, default=str)
            handle.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class RunError(RuntimeError):
    pass


@dataclass
class StageRecord:
    name: str  # e.g. "bc", "iter_1/critic"
    inputs: dict[str, str]
    outputs: dict[str, str]  # relative to the run directory
    metrics: dict[str, Any]


StageFn = Callable[[Path], tuple[dict[str, str], dict[str, Any]]]


class RunDirectory:
    """``runs/NAME`` with its manifest. ``resume=False`` refuses to touch an existing run."""

    def __init__(self, root: str | Path, config: dict[str, Any], seed: int, resume: bool = False):
        self.root = Path(root)
        manifest_path = self.root / MANIFEST
        if manifest_path.exists():
            if not resume:
                raise RunError(f"{self.root} already holds a run: pass --resume to continue it, or choose another name")
            self.manifest = json.loads(manifest_path.read_text())
            if self.manifest.get("config") != config:
                raise RunError(f"{manifest_path}: the run was started with a different config; "
                               "resume with the same config or start a new run")
        else:
            self.manifest = {"config": config, "seed": seed, "versions": package_versions(), "stages": []}
            self.root.mkdir(parents=True, exist_ok=True)
            self._save()
        # Leftovers of a stage that was killed mid-way.
        for leftover in self.root.glob("**/.*.partial-*"):
            shutil.rmtree(leftover, ignore_errors=True)

    # -- manifest ------------------------------------------------------------------------------

    def _save(self) -> None:
        write_json_atomic(self.root / MANIFEST, self.manifest)
        lines = [json.dumps({"stage": s["name"], **s["metrics"]}, sort_keys=True) for s in self.manifest["stages"]]
        fd, tmp = tempfile.mkstemp(prefix=f".{METRICS}.", dir=self.root)
        with os.fdopen(fd, "w") as handle:
            handle.write("".join(line + "\n" for line in lines))
        os.replace(tmp, self.root / METRICS)

    def completed(self, name: str) -> StageRecord | None:
        for stage in self.manifest["stages"]:
            if stage["name"] == name:
                return StageRecord(stage["name"], stage["inputs"], stage["outputs"], stage["metrics"])
        return None

    def path(self, relative: str) -> Path:
        return self.root / relative

    # -- stages --------------------------------------------------------------------------------

    def run_stage(self, name: str, inputs: dict[str, str], fn: StageFn, log: Callable[[str], None] = print) -> StageRecord:
        """Run ``fn(workdir) -> (outputs, metrics)`` unless the manifest records ``name`` as done.

        ``fn`` writes everything into ``workdir``; ``outputs`` name files inside it (relative paths).
        On return the folder becomes ``runs/NAME/<name>`` and outputs are recorded relative to the run.
        """
        done = self.completed(name)
        if done is not None:
            log(f"[{name}] done earlier, skipped (resume)")
            return done
        target = self.root / name
        if target.exists():
            # Renamed into place but not recorded: the run died between the two; redo the stage.
            shutil.rmtree(target)
        target.parent.mkdir(parents=True, exist_ok=True)
        workdir = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
        started = time.time()
        log(f"[{name}] running")
        try:
            outputs, metrics = fn(workdir)
            os.replace(workdir, target)
        except BaseException:
            shutil.rmtree(workdir, ignore_errors=True)
            raise
        recorded = {key: f"{name}/{value}" if value not in ("", ".") else name for key, value in outputs.items()}
        record = StageRecord(name, dict(inputs), recorded, dict(metrics))
        self.manifest["stages"].append({"name": name, "inputs": record.inputs, "outputs": record.outputs,
                                        "metrics": record.metrics})
        self._save()
        with open(self.root / TIMINGS, "a") as handle:
            handle.write(json.dumps({"stage": name, "seconds": round(time.time() - started, 2),
                                     "finished": time.strftime("%Y-%m-%dT%H:%M:%S")}) + "\n")
        return record
