"""A run directory with a manifest: every stage writes atomically and is recorded once.

``runs/NAME/`` holds ``manifest.json`` (config, versions, seeds, and for each completed stage
what it read, what it wrote and its metrics), ``metrics.jsonl`` (one line per completed stage,
regenerated from the manifest so it never holds a duplicate or a stage that did not finish), and
one folder per stage output (``bc/``, ``iter_1/rollouts/``, ``iter_1/critic/``, ...).

A stage runs in a work folder beside its target (``.<leaf>.partial``, e.g. ``iter_1/.policy.partial``)
and is renamed into place only when it returns; then the manifest is rewritten atomically. The work
folder has a fixed name and survives an interruption (Ctrl-C, SIGTERM, kill -9, the OOM killer):
``--resume`` skips every stage the manifest records, and a training stage (``resumable``) continues
from the newest checkpoint its work folder holds, while any other stage starts over. A work folder
records what its stage read (``.stage.json``: the stage's inputs, their digests and the run's
config), and one made from other inputs or another config is discarded, never reused. The manifest
holds no wall-clock values (they go to ``timings.jsonl``), so an interrupted-then-resumed run and
an uninterrupted run with the same seeds write the same manifest.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from qevolve.atomic_io import atomic_write_text, write_json_atomic
from qevolve.evolve.digests import differing_fields, output_digests
from qevolve.machine import package_versions, torch_threads
from qevolve.resident import peak_resident_bytes, reset_peak_resident


def _cuda_in_use() -> bool:
    """Whether this process has CUDA initialised (never initialises it)."""
    import torch

    return torch.cuda.is_available() and torch.cuda.is_initialized()


def reset_peak_gpu() -> None:
    """Reset this process's peak of allocated CUDA memory (all devices), where CUDA is initialised. A stage
    that initialises CUDA itself starts from zero anyway."""
    import torch

    if _cuda_in_use():
        for device in range(torch.cuda.device_count()):
            torch.cuda.reset_peak_memory_stats(device)


def peak_gpu_bytes() -> int | None:
    """This process's peak of allocated CUDA memory since :func:`reset_peak_gpu`, the largest over its devices;
    None where CUDA is not initialised."""
    import torch

    if not _cuda_in_use():
        return None
    return max((torch.cuda.max_memory_allocated(device) for device in range(torch.cuda.device_count())),
               default=None)


def gpu_memory_now() -> dict[str, int]:
    """GPU memory in use now, in MiB, where this process has CUDA initialised (else empty, and CUDA is left
    alone): ``gpu_mb_at_start``, torch's allocations in this process (an in-process vLLM engine's weights and
    KV cache included), and ``gpu_used_mb_at_start``, all that the devices have in use (other processes,
    CUDA contexts and torch's cache of freed blocks included); each the largest over the devices. Two
    driver queries per device: cheap enough for every stage."""
    import torch

    if not _cuda_in_use():
        return {}
    devices = range(torch.cuda.device_count())
    used = []
    for device in devices:
        free, total = torch.cuda.mem_get_info(device)
        used.append(total - free)
    return {"gpu_mb_at_start": round(max(torch.cuda.memory_allocated(device) for device in devices) / 2**20),
            "gpu_used_mb_at_start": round(max(used) / 2**20)}

MANIFEST = "manifest.json"
METRICS = "metrics.jsonl"
TIMINGS = "timings.jsonl"
LOCK = ".lock"

#: config fields that may differ on resume: where the run lives and how it reports, not what it computes
LOCATION_FIELDS = ("name", "runs_dir", "progress")

#: dotted config fields that may differ on resume and are recorded (``resume_changes`` in the manifest,
#: with the stage after which they changed): the threads and worker processes a run uses, how it logs
#: and how often it checkpoints. Worker counts change no result (trajectories are written in job order
#: and sampling seeds are per request); a thread count can change the low bits of CPU reductions, which
#: is why every stage record holds the count it ran with, and so can the processes of a training stage
#: (float sums in another order; its checkpoints resume with any process count).
RESUME_FREE_FIELDS = (
    "num_threads", "model.num_threads", "tensorboard", "wandb", "distributed.nproc_per_node",
    "distributed.nnodes", "distributed.master_addr", "distributed.master_port", "distributed.join_timeout_s",
    "distributed.heartbeat_timeout_s", "keep_finished_checkpoints",
    *(f"{part}.agent.{field}" for part in ("rollout", "eval")
      for field in ("num_workers", "pool.ray_address", "pool.ray_cpus_per_worker")),
    "critic.checkpoint_every_steps", "critic.feature_cache", "critic.feature_cache_dir",
    "ppo.value.feature_cache", "ppo.value.feature_cache_dir",
    *(f"{part}.{field}" for part in ("bc", "policy", "rft", "eto", "grpo.policy", "ppo.policy")
      for field in ("tensorboard", "progress", "log_every", "save_every", "keep_checkpoints")),
)

#: a stage's work folder (see the module docs) and the record of what it was made from
PARTIAL_SUFFIX = ".partial"
STAGE_MARKER = ".stage.json"

class RunError(RuntimeError):
    """A user-facing problem with a run directory (the CLI prints it on one line, exit 2)."""


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived (raised by the CLI's signal handlers). Like any KeyboardInterrupt that
    leaves :meth:`RunDirectory.run_stage`, it then carries ``stage`` (the stage it interrupted) and
    ``resume_step`` (the step of the checkpoint that stage continues from, or None)."""

    def __init__(self, signum: int):
        super().__init__(f"signal {signum}")
        self.signum = signum


def saved_step(workdir: Path) -> int | None:
    """The step of the newest complete checkpoint in a training stage's work folder (None: none yet).

    A policy trainer's checkpoints are ``checkpoints/step-N`` folders, complete once they hold
    ``trainer_state.pt``; the critic's state is ``train_state.pt`` (written atomically)."""
    steps = [int(p.parent.name.split("-")[1]) for p in workdir.glob("checkpoints/step-*/trainer_state.pt")
             if p.parent.name.split("-")[1].isdigit()]
    if steps:
        return max(steps)
    state = workdir / "train_state.pt"
    if state.is_file():
        from qevolve.atomic_io import load_state

        try:
            return int(load_state(state)["global_step"])
        except Exception:  # noqa: BLE001 - unreadable: the critic says so itself when it resumes
            return None
    return None


def _get(tree: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return "<missing>"
        tree = tree[part]
    return tree


def _without(tree: dict[str, Any], dotted_fields: tuple[str, ...]) -> dict[str, Any]:
    """A copy of ``tree`` without the (dotted) fields."""
    out = json.loads(json.dumps(tree, default=str))
    for dotted in dotted_fields:
        *parents, last = dotted.split(".")
        node = out
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(last, None)
    return out


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


def existing_run(manifest_path: Path, resume: bool, redo: str | None) -> dict[str, Any] | None:
    """The manifest that a run opened with ``resume`` and ``redo`` continues, or None where it starts afresh: no
    run there yet, or (without ``resume``) a run that completed no stage, which holds nothing worth keeping
    under its name. A :class:`RunError` for a folder that holds a run when ``resume`` is not given, and for
    ``redo`` where there is no run."""
    if not manifest_path.exists():
        if redo is not None:
            raise RunError(f"--redo {redo}: {manifest_path.parent} holds no run yet")
        return None
    manifest = RunDirectory._read_manifest(manifest_path)
    if not resume and redo is None:
        if manifest["stages"]:
            raise RunError(f"{manifest_path}: this folder already holds a run; pass --resume to continue it, or "
                           "choose another name")
        return None
    return manifest


def resumable_config(manifest_path: Path, manifest: dict[str, Any], config: dict[str, Any],
                     upgrade: Callable[[dict[str, Any]], dict[str, Any]] | None,
                     extend: Callable[[dict[str, Any], dict[str, Any]], tuple[dict[str, Any], list[str]]] | None,
                     ) -> tuple[dict[str, Any], list[str]]:
    """Whether ``config`` may continue the run ``manifest`` records (see :class:`RunDirectory`): the recorded
    config as today's schema reads it, with ``extend``'s additions adopted, and a line per addition. A field
    that differs otherwise (outside :data:`RESUME_FREE_FIELDS` and the location) is a :class:`RunError`
    naming it. Reads nothing and writes nothing."""
    recorded = manifest["config"]
    if upgrade is not None:
        try:
            recorded = upgrade(recorded)
        except Exception:  # e.g. a field removed since: the comparison below names it
            recorded = manifest["config"]
    changes: list[str] = []
    if extend is not None:
        recorded, changes = extend(recorded, config)
    old = _without({k: v for k, v in recorded.items() if k not in LOCATION_FIELDS}, RESUME_FREE_FIELDS)
    new = _without({k: v for k, v in config.items() if k not in LOCATION_FIELDS}, RESUME_FREE_FIELDS)
    field = first_difference(old, new)
    if field is not None:
        def at(tree: Any) -> Any:
            for part in field.split("."):
                tree = tree.get(part, "<missing>") if isinstance(tree, dict) else "<missing>"
            return tree
        raise RunError(f"{manifest_path}: the run was started with {field}={_short(at(old))}, "
                       f"this config has {field}={_short(at(new))}; resume with the same config "
                       "or start a new run")
    return recorded, changes


def free_field_changes(manifest: dict[str, Any], recorded: dict[str, Any],
                       config: dict[str, Any]) -> dict[str, list[Any]]:
    """The fields of :data:`RESUME_FREE_FIELDS` that ``config`` sets otherwise than the run's last
    invocation: ``{field: [before, now]}``."""
    before = {field: _get(recorded, field) for field in RESUME_FREE_FIELDS}
    for entry in manifest.get("resume_changes", []):
        before.update({field: change[1] for field, change in entry["changes"].items()})
    return {field: [before[field], _get(config, field)] for field in RESUME_FREE_FIELDS
            if before[field] != _get(config, field)}


def _change_lines(changes: dict[str, list[Any]]) -> list[str]:
    """``free_field_changes`` as the lines a resume logs: ``field before -> now``."""
    return [f"{field} {_short(old)} -> {_short(new)}" for field, (old, new) in changes.items()]


def kept_before_redo(manifest_path: Path, manifest: dict[str, Any], name: str) -> list[str]:
    """``--redo NAME``: the recorded stages that stay (those before NAME); a :class:`RunError` when the
    manifest records no stage NAME."""
    names = [stage["name"] for stage in manifest["stages"]]
    if name not in names:
        raise RunError(f"--redo {name}: {manifest_path} records no such stage; recorded: {', '.join(names) or 'none'}")
    return names[:names.index(name)]


def recorded_stage_seconds(runs: list[Path]) -> dict[str, list[float]]:
    """Each stage's wall time as these run folders recorded it (``timings.jsonl``; a stage recorded twice, after
    a ``--redo``, counts with its last time): ``{stage: [seconds in each run that has it]}``. A missing or
    unreadable file adds nothing."""
    seconds: dict[str, list[float]] = {}
    for run in runs:
        last: dict[str, float] = {}
        try:
            lines = (Path(run) / TIMINGS).read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            try:
                entry = json.loads(line)
                last[str(entry["stage"])] = float(entry["seconds"])
            except (ValueError, KeyError, TypeError):
                continue  # a line cut by a kill mid-write
        for stage, value in last.items():
            seconds.setdefault(stage, []).append(value)
    return seconds


@dataclass(frozen=True)
class ResumePreview:
    """What ``--resume`` (or ``--redo``) would find in a run folder, read without touching it
    (:func:`preview_resume`): the stages it keeps, and the changes it would record."""

    done: tuple[str, ...]                # recorded stages that would be skipped
    extensions: tuple[str, ...] = ()     # stages the config adds to the run (more iterations, baselines, variants)
    free_changes: tuple[str, ...] = ()   # RESUME_FREE_FIELDS set otherwise than last time
    environment_changed: tuple[str, ...] = ()  # fields of the run's environment that differ from this machine's
    note: str | None = None              # why nothing is kept (no run yet, or a run that completed no stage)


def preview_resume(root: str | Path, config: dict[str, Any], resume: bool = False, redo: str | None = None,
                   upgrade: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
                   extend: Callable[[dict[str, Any], dict[str, Any]], tuple[dict[str, Any], list[str]]] | None = None,
                   environment: Callable[[], dict[str, Any] | None] | None = None) -> ResumePreview:
    """The checks :class:`RunDirectory` makes when it opens ``root`` with these arguments, made read-only: no
    lock, no folder created, no manifest written, so it may run beside the run itself. Raises the
    :class:`RunError` the real open would raise. ``environment`` is called only where a recorded run is
    resumed, and may return None where this machine cannot resolve it (no comparison then)."""
    manifest_path = Path(root) / MANIFEST
    manifest = existing_run(manifest_path, resume, redo)
    if manifest is None:
        return ResumePreview(done=(), note="its manifest records no completed stage: the run starts afresh"
                             if manifest_path.exists() else "no run there yet: every stage runs")
    recorded, changes = resumable_config(manifest_path, manifest, config, upgrade, extend)
    done = kept_before_redo(manifest_path, manifest, redo) if redo is not None else \
        [stage["name"] for stage in manifest["stages"]]
    free = free_field_changes(manifest, recorded, config)
    before = manifest.get("environment")
    now = environment() if environment is not None and before is not None else None
    moved = differing_fields(before, now) if now is not None and before != now else []
    return ResumePreview(done=tuple(done), extensions=tuple(changes),
                         free_changes=tuple(_change_lines(free)),
                         environment_changed=tuple(moved))


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
        ``self.environment_changed`` for the caller to warn about).

        The fields of :data:`RESUME_FREE_FIELDS` may differ on resume: each change is recorded under
        ``resume_changes`` and described in ``self.resume_changes`` for the caller to log. A manifest
        that records no completed stage does not hold the folder: without ``resume`` the run starts
        afresh (``self.restarted`` is then True)."""
        self.root = Path(root)
        manifest_path = self.root / MANIFEST
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = self._acquire_lock()
        self.resume_changes: list[str] = []
        self.restarted = False
        try:
            existing = existing_run(manifest_path, resume, redo)
            # a run that completed no stage starts afresh (its unfinished work folders are reused only if they
            # match the new config, see run_stage)
            self.restarted = existing is None and manifest_path.exists()
            if existing is not None:
                self.manifest = existing
                recorded, changes = resumable_config(manifest_path, self.manifest, config, upgrade, extend)
                if changes:
                    # Recorded stages were computed by a config that agrees with this one on every
                    # field they read; the new stages are named by the added fields and run fresh.
                    self.manifest["config"] = config
                    self.manifest.setdefault("extensions", []).append(
                        {"changes": changes, "versions": package_versions()})
                    self._save()
                self._record_free_changes(recorded, config)
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
                self.manifest = {"config": config, "seed": seed, "versions": package_versions(), "stages": []}
                if environment is not None:
                    self.manifest["environment"] = environment
                self._save()
        except BaseException:
            self.close()
            raise
        # What the stages' work folders are checked against: the run's config, less what may change on resume.
        self._config_key = hashlib.sha256(json.dumps(
            _without({k: v for k, v in config.items() if k not in LOCATION_FIELDS}, RESUME_FREE_FIELDS),
            sort_keys=True, default=str).encode()).hexdigest()
        # Staging folders of older versions (random names, never resumed; no other process runs here: we
        # hold the lock).
        for leftover in self.root.glob("**/.*.partial-*"):
            shutil.rmtree(leftover, ignore_errors=True)

    def _record_free_changes(self, recorded: dict[str, Any], config: dict[str, Any]) -> None:
        """Record the fields of :data:`RESUME_FREE_FIELDS` that differ from the previous invocation's."""
        changes = free_field_changes(self.manifest, recorded, config)
        if changes:
            self.manifest.setdefault("resume_changes", []).append(
                {"after_stage": (self.manifest["stages"] or [{"name": None}])[-1]["name"], "changes": changes})
            self._save()
            self.resume_changes = _change_lines(changes)

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
        names = kept_before_redo(self.root / MANIFEST, self.manifest, name)
        dropped = self.manifest["stages"][len(names):]
        self.manifest["stages"] = self.manifest["stages"][:len(names)]
        self._save()  # the record goes first: a kill now leaves folders that are redone anyway
        for stage in dropped:
            shutil.rmtree(self.root / stage["name"], ignore_errors=True)
        # Unfinished work belongs to stages after the recorded ones, which may read what is redone.
        for partial in self.root.glob(f"**/.*{PARTIAL_SUFFIX}"):
            shutil.rmtree(partial, ignore_errors=True)

    # -- manifest ------------------------------------------------------------------------------

    def _save(self) -> None:
        write_json_atomic(self.root / MANIFEST, self.manifest)
        lines = [json.dumps({"stage": s["name"], **s["metrics"]}, sort_keys=True) for s in self.manifest["stages"]]
        atomic_write_text(self.root / METRICS, "".join(line + "\n" for line in lines))

    def completed(self, name: str) -> StageRecord | None:
        for stage in self.manifest["stages"]:
            if stage["name"] == name:
                return StageRecord(stage["name"], stage["inputs"], stage["outputs"], stage["metrics"],
                                   stage.get("digests"))
        return None

    def path(self, relative: str) -> Path:
        return self.root / relative

    # -- stages --------------------------------------------------------------------------------

    def _stage_key(self, name: str, inputs: dict[str, str]) -> dict[str, Any]:
        """What a stage's work folder is made from: the stage, its inputs with the digests of the recorded
        stages that wrote them, the run's config (less what may change on resume) and where the run
        lives (trainers record absolute paths: a moved run's unfinished work is not theirs to resume)."""
        def producer(value: str) -> dict[str, str] | None:
            for stage in self.manifest["stages"]:
                if value == stage["name"] or value.startswith(stage["name"] + "/"):
                    return stage.get("digests")
            return None
        return {"stage": name, "inputs": dict(inputs), "config": self._config_key, "root": str(self.root.resolve()),
                "input_digests": {key: producer(value) for key, value in sorted(inputs.items())}}

    @staticmethod
    def _made_from(folder: Path, key: dict[str, Any]) -> bool:
        try:
            return json.loads((folder / STAGE_MARKER).read_text()) == json.loads(json.dumps(key))
        except (OSError, ValueError):
            return False

    def run_stage(self, name: str, inputs: dict[str, str], fn: StageFn, log: Callable[[str], None] = print,
                  resumable: bool = False, timing: dict[str, Any] | None = None) -> StageRecord:
        """Run ``fn(workdir) -> (outputs, metrics)`` unless the manifest records ``name`` as done.

        ``fn`` writes everything into ``workdir`` (``.<leaf>.partial`` beside the target); ``outputs``
        name files inside it (relative paths). On return the folder becomes ``runs/NAME/<name>`` and
        outputs are recorded relative to the run.

        ``resumable``: ``fn`` continues from what an interrupted attempt left in ``workdir`` (a trainer
        resuming from its newest checkpoint), so the folder is kept when ``fn`` raises and reused
        next time if it was made from the same inputs and config. Otherwise ``workdir`` starts empty.
        A KeyboardInterrupt leaving here carries ``stage`` and ``resume_step`` (see :class:`Interrupted`).
        ``timing``: more fields of the stage's line in ``timings.jsonl``, read when ``fn`` has returned (so
        ``fn`` may fill it in, e.g. the GPU memory in use when its work started).
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
        workdir = target.parent / f".{target.name}{PARTIAL_SUFFIX}"
        stage_key = self._stage_key(name, inputs)
        if target.exists():
            # Renamed into place but not recorded: the run died between the two. A training stage's
            # folder goes back to being its work folder (its trainer finds the last checkpoint and
            # only writes the final files again); anything else is redone.
            if resumable and not workdir.exists() and self._made_from(target, stage_key):
                os.replace(target, workdir)
            else:
                shutil.rmtree(target)
        if workdir.exists():
            if resumable and self._made_from(workdir, stage_key):
                step = saved_step(workdir)
                log(f"[{name}] continuing the unfinished stage in {workdir}"
                    + (f" from its checkpoint at step {step}" if step is not None else ""))
            else:
                if resumable:
                    log(f"[{name}] discarding unfinished work made from other inputs or another config ({workdir})")
                shutil.rmtree(workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        if resumable:
            write_json_atomic(workdir / STAGE_MARKER, stage_key)  # hidden: not a result, left out of the digests
        started = time.time()
        measured_peak = reset_peak_resident()
        reset_peak_gpu()
        log(f"[{name}] running")
        try:
            outputs, metrics = fn(workdir)
            digests = output_digests(workdir)
            os.replace(workdir, target)
        except BaseException as error:
            if not resumable:
                shutil.rmtree(workdir, ignore_errors=True)
            if isinstance(error, KeyboardInterrupt) and getattr(error, "stage", None) is None:
                error.stage = name  # type: ignore[attr-defined]
                error.resume_step = saved_step(workdir) if resumable else None  # type: ignore[attr-defined]
            raise
        recorded = {key: f"{name}/{value}" if value not in ("", ".") else name for key, value in outputs.items()}
        record = StageRecord(name, dict(inputs), recorded, dict(metrics), digests)
        # threads: what was in force when the stage ended (CPU reductions, hence results, depend on it)
        self.manifest["stages"].append({"name": name, "inputs": record.inputs, "outputs": record.outputs,
                                        "metrics": record.metrics, "digests": digests,
                                        "threads": torch_threads()})
        self._save()
        # Memory, like time, depends on the machine and the load: timings, not the (reproducible) manifest.
        timing = {"stage": name, "seconds": round(time.time() - started, 2),
                  "finished": time.strftime("%Y-%m-%dT%H:%M:%S"), **(timing or {})}
        peak = peak_resident_bytes() if measured_peak else None
        if peak is not None:
            timing["peak_rss_mb"] = round(peak / 2**20)  # this process only, not its environment workers
        gpu_peak = peak_gpu_bytes()
        if gpu_peak is not None:
            # torch's allocations in this process only: not a launched stage's ranks, not vLLM's KV cache
            timing["peak_gpu_mb"] = round(gpu_peak / 2**20)
        with open(self.root / TIMINGS, "a") as handle:
            handle.write(json.dumps(timing) + "\n")
        return record
