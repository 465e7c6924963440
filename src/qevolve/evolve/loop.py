"""``qevolve evolve``: the run of a method's recipe, stage by stage.

The method and its baselines are recipes (:mod:`qevolve.evolve.recipes`) over the stages of
:mod:`qevolve.evolve.stages`; :func:`run_evolve` runs :func:`qevolve.evolve.recipes.qevolve` (which
runs the recipes ``baselines`` names in iteration 1) with the stage runner of this module.

Every stage runs through :class:`qevolve.evolve.run_dir.RunDirectory`: it writes into a work
folder that is renamed into ``runs/NAME/<stage>`` when it finishes, and the manifest records what
it read, wrote and measured. ``--resume`` skips recorded stages; the training stages (bc, critic,
policy, rft, eto) continue from the newest checkpoint of an interrupted attempt, so a killed run
loses at most the steps since that checkpoint. Every stage seeds its random generators from (seed,
stage name) and every trainer restores its own from its checkpoint, so a resumed run computes what
an uninterrupted one would.

With ``distributed.nproc_per_node`` above 1 every training stage runs as that many processes under
torch's launcher (:mod:`qevolve.evolve.stage_worker`), with the same seed, inputs and options; the
other stages stay in this process. With ``distributed.nnodes`` above 1 this process is node 0: the
other nodes' followers join each training stage it announces (:mod:`qevolve.evolve.nodes`).
"""

from __future__ import annotations

import gc
import json
import re
import shutil
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from pydantic import ValidationError, field_validator

from qevolve.allocator import release_free_memory
from qevolve.buffer.metrics import FailedEpisodesError
from qevolve.config import strip_derived
from qevolve.evaluation.compare import online_budgets, success_table
from qevolve.evolve import stage_worker
from qevolve.evolve.nodes import LaunchAnnouncer
from qevolve.evolve.recipes import Run, main_critic_read, qevolve, registered_recipe
from qevolve.evolve.run_dir import (TIMINGS, RunDirectory, StageRecord, gpu_memory_now, preview_resume,
                                    recorded_stage_seconds, reset_peak_gpu)
from qevolve.evolve.settings import DERIVED_FIELDS, EvolveSettings, GRPOSettings, PPOSettings, override
from qevolve.evolve.stages import (
    StageContext, bc_data_config, evaluation_settings, grpo_round_tasks, probe_store, record_evaluation, rft_config,
    stage_processes,
)
from qevolve.machine import run_environment
from qevolve.progress import duration_text
from qevolve.seeding import derive_seed, seed_everything

__all__ = [
    "EvolveConfig", "run_evolve", "dry_run_evolve", "PlannedStage", "seed_replicates", "validate_inputs", "recorded_config", "upgrade_recorded",
    "extension_of", "environment_of",
    # the settings and stage helpers that scripts and tests import from here, where they were defined before
    # the settings and the stages had modules of their own
    "DERIVED_FIELDS", "GRPOSettings", "PPOSettings", "bc_data_config", "evaluation_settings", "grpo_round_tasks",
    "record_evaluation", "rft_config",
]

_override = override  # its name before it moved to qevolve.evolve.settings


class EvolveConfig(EvolveSettings):
    """The whole loop: ``qevolve evolve --config configs/cpu/webshop-quick.yaml [key=value ...]``."""

    @field_validator("baselines")
    @classmethod
    def _baselines_are_recipes(cls, names: list[str]) -> list[str]:
        for name in names:
            registered_recipe(name)  # a one-line error listing the registered recipes
        return names


def extension_of(recorded: dict[str, Any], new: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """How ``new`` extends a finished run's ``recorded`` config without changing a recorded stage: more
    ``iterations``, more ``baselines`` (with their own sections, which no recorded stage read), more
    ``variants`` (the recorded ones unchanged). Returns ``recorded`` with those fields taken from
    ``new`` and one line per change; anything else is left for the resume comparison to name."""
    out, changes = dict(recorded), []
    if isinstance(new.get("iterations"), int) and isinstance(recorded.get("iterations"), int) \
            and new["iterations"] > recorded["iterations"]:
        changes.append(f"iterations {recorded['iterations']} -> {new['iterations']}")
        out["iterations"] = new["iterations"]
    old_baselines, new_baselines = recorded.get("baselines"), new.get("baselines")
    if isinstance(old_baselines, list) and isinstance(new_baselines, list) and set(old_baselines) < set(new_baselines):
        added = [name for name in new_baselines if name not in old_baselines]
        changes.append("baselines + " + ", ".join(added))
        out["baselines"] = new_baselines
        for name in added:
            if name in new:
                out[name] = new[name]
    old_variants, new_variants = recorded.get("variants"), new.get("variants")
    if isinstance(old_variants, dict) and isinstance(new_variants, dict) and set(old_variants) < set(new_variants) \
            and all(new_variants[name] == settings for name, settings in old_variants.items()):
        changes.append("variants + " + ", ".join(name for name in new_variants if name not in old_variants))
        out["variants"] = new_variants
    return out, changes


class _Loggers:
    def __init__(self, config: EvolveConfig, root: Path):
        self.tb = None
        self.wandb = None
        if config.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(root / "tensorboard"))
        if config.wandb:
            try:
                import wandb
            except ImportError:
                raise ValueError("wandb: true needs the wandb package (pip install wandb)") from None
            self.wandb = wandb.init(project="qevolve", name=config.name, config=recorded_config(config))

    def log(self, stage: str, iteration: int, metrics: dict[str, Any]) -> None:
        scalars = {f"{stage.split('/', 1)[-1]}/{k}": float(v) for k, v in metrics.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self.tb is not None:
            for key, value in scalars.items():
                self.tb.add_scalar(key, value, iteration)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log({**scalars, "iteration": iteration})

    def log_steps(self, stage: str, folder: Path, warn: Callable[[str], None] = print) -> None:
        """The per-step training curves of a finished stage (:func:`qevolve.scalars.stage_scalars`) as
        ``<stage>/<tag>`` at the stage's own steps (a critic's: its epochs): in TensorBoard beside the
        per-stage points, in W&B against the stage's step metric ``<stage>/step``. A log that cannot be
        read is a warning: the stage's results are recorded already and the run goes on."""
        from qevolve.scalars import stage_scalars

        if self.tb is None and self.wandb is None:
            return
        try:
            series, axis = stage_scalars(folder)
        except Exception as error:  # noqa: BLE001 - curves are a view of the run, never a reason to stop it
            warn(f"WARNING: [{stage}] its per-step curves were not logged ({type(error).__name__}: {error})")
            return
        if not series:
            return
        by_step: dict[int, dict[str, float]] = {}
        for tag, points in series.items():
            for step, value in points:
                by_step.setdefault(step, {})[f"{stage}/{tag}"] = value
        if self.tb is not None:
            for step, values in sorted(by_step.items()):
                for key, value in values.items():
                    self.tb.add_scalar(key, value, step)
            self.tb.flush()
        if self.wandb is not None:
            # W&B's own step only grows; each stage's curves are plotted against their own x axis
            step_key = f"{stage}/{axis}"
            self.wandb.define_metric(step_key)
            for tag in series:
                self.wandb.define_metric(f"{stage}/{tag}", step_metric=step_key)
            for step, values in sorted(by_step.items()):
                self.wandb.log({step_key: step, **values})

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def _iteration_of(stage: str) -> int:
    return 0 if stage.startswith("bc") else int(stage.split("/")[0].split("_")[1])


def validate_inputs(config: EvolveConfig) -> None:
    """Fail in seconds, before the first stage, on what would otherwise fail after BC: an unknown
    environment, a split it does not have, a missing or damaged checkpoint, missing expert data."""
    from qevolve.environments.base import EnvironmentContractError
    from qevolve.environments.play import list_tasks
    from qevolve.models.loading import check_checkpoint

    splits = [("rollout.split", config.rollout.split)] if config.iterations else []
    splits += [(f"eval.splits[{i}]", split) for i, split in enumerate(config.eval.splits)]
    for field, split in splits:
        try:
            tasks = list_tasks(config.env, split)
        except KeyError as err:  # unknown environment
            raise ValueError(f"env {config.env!r}: {err.args[0] if err.args else err}") from None
        except EnvironmentContractError as err:  # the class, not the split, is wrong: named as env's
            message = str(err).removeprefix(f"environment {config.env!r}: ")
            raise ValueError(f"env {config.env!r}: {message}") from None
        except ValueError as err:
            raise ValueError(f"{field} {split!r}: {err}") from None
        if not tasks:
            raise ValueError(f"{field} {split!r}: environment {config.env!r} has no tasks in this split")
    critic_trained = main_critic_read(config) or any(settings.critic for settings in config.variants.values())
    if config.iterations and critic_trained and config.critic.retrospective.enabled:
        from qevolve.critic.retrospective import penalties_for

        try:
            penalties_for(config.env, config.critic.retrospective)
        except ValueError as err:
            raise ValueError(f"{err} or set critic.retrospective.enabled=false") from None
    for field, path, hub in (("init_checkpoint", config.init_checkpoint, config.model.hub),
                             ("critic.init", config.critic.init, False),
                             ("model.name_or_path", config.model.name_or_path, config.model.hub)):
        if path and path != "default":
            check_checkpoint(path, field, allow_hub=hub)
    from qevolve.paths import data_dir

    experts = data_dir() / "experts" / config.env
    from_bc = config.buffer.expert_source == "bc"
    if from_bc and config.buffer.expert_path and config.iterations and \
            Path(config.buffer.expert_path).expanduser() != Path(config.bc.data.train_path or experts).expanduser():
        raise ValueError(f"buffer.expert_path {config.buffer.expert_path!r}: with buffer.expert_source bc the "
                         "buffer's experts are behaviour cloning's demonstrations (bc.data.train_path); set "
                         "buffer.expert_source=extra to draw other ones from this store")
    for field, path, needed in (("bc.data.train_path", config.bc.data.train_path,
                                 not config.init_checkpoint or (from_bc and config.iterations > 0)),
                                ("buffer.expert_path", config.buffer.expert_path,
                                 not from_bc and config.iterations > 0)):
        path = Path(path).expanduser() if path else experts
        if needed and not path.exists():
            raise FileNotFoundError(f"{field} {str(path)!r}: no such file or folder (build the expert set with "
                                    f"`qevolve data expert {config.env}` or set {field})")


def environment_of(config: EvolveConfig) -> dict[str, Any]:
    """The run's environment (:func:`run_environment`) with the choices ``auto`` settings resolve to here."""
    from qevolve.models.loading import resolve_device, resolve_precision
    from qevolve.rollouts.agent import resolve_backend

    device = resolve_device(config.model.device)
    backends = {}
    for part, agent in (("rollout", config.rollout.agent), ("eval", config.eval.agent)):
        try:
            backends[part] = resolve_backend(agent.backend)
        except ValueError as err:  # vllm asked for but missing: the stage says so when it runs
            backends[part] = f"unavailable ({err})"
    return run_environment({
        "device": str(device), "precision": resolve_precision(config.model.precision, device),
        "generation_backend": backends,
        "batch_sizes": {"rollout": config.rollout.agent.batch_size, "eval": config.eval.agent.batch_size,
                        "bc_tokens": config.bc.tokens_per_batch, "policy_tokens": config.policy.tokens_per_batch}})


def recorded_config(config: EvolveConfig) -> dict[str, Any]:
    """The config a run's manifest records: every field as it acts, without the fields the loop decides
    itself (:data:`DERIVED_FIELDS`), whose values in the config would not be the ones the stages used."""
    return strip_derived(type(config), config.model_dump(mode="json"))


def upgrade_recorded(recorded: dict[str, Any]) -> dict[str, Any]:
    """A manifest's config through today's schema (fields added since: their defaults; fields the loop
    decides, which older runs recorded: left out), for the resume comparison."""
    return recorded_config(EvolveConfig.model_validate(recorded))


def seed_replicates(config: EvolveConfig) -> list[EvolveConfig]:
    """The runs ``config.seeds`` asks for, in its order: NAME-sSEED with seed=SEED each (``config`` itself
    when ``seeds`` is null). Each replicate records ``seeds: null``, so adding seeds later leaves the
    existing replicates resumable."""
    if not config.seeds:
        return [config]
    if len(set(config.seeds)) != len(config.seeds):
        raise ValueError(f"seeds {config.seeds}: each seed once")
    return [config.model_copy(update={"seed": seed, "seeds": None, "name": f"{config.name}-s{seed}"})
            for seed in config.seeds]




@dataclass(frozen=True)
class PlannedStage:
    """A stage a dry run walked: its name, for a training stage the processes it would run as, and, in a
    dry run of a resume, whether the run already records it (then it would be skipped)."""

    name: str
    processes: int | None   # None: not a training stage (it runs in the evolve process)
    done: bool = False
    estimate_s: float | None = None  # what earlier runs of this protocol took for the stage (median), if any did


class _PlannedOutputs(dict):
    """The outputs of a stage that a dry run did not run: each key a placeholder path in the stage's folder."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name

    def __missing__(self, key: str) -> str:
        return f"{self.name}/{key}"


def _one_line(error: ValueError) -> str:
    """A config error in one line: a validation error's first field and message."""
    if isinstance(error, ValidationError) and error.errors():
        first = error.errors()[0]
        field = ".".join(str(part) for part in first["loc"])
        return f"{field}: {first['msg']}" if field else str(first["msg"])
    return " ".join(str(error).split())


def dry_run_evolve(config: EvolveConfig, log: Callable[[str], None] = print, resume: bool = False,
                   redo: str | None = None) -> list[PlannedStage]:
    """Walk the run's recipe (:func:`qevolve.evolve.recipes.qevolve`, its baselines and variants) without
    running a stage: each stage builds and validates its stage config (the builder the stage itself
    calls, :func:`qevolve.evolve.stages.builds`) and nothing else; no model is loaded, no environment
    started, nothing written. Returns the stages a fresh run would run, in order. An online baseline
    lists its first round (its rounds repeat until the budget). A stage config that does not validate
    is a ``ValueError`` naming the stage and the field. ``log`` gets a line per stage as it is walked.

    It also makes, read-only, the checks the run folder gets when the run opens it with the same
    ``resume`` and ``redo`` (:func:`qevolve.evolve.run_dir.preview_resume`; no lock taken, so it may run
    beside the run): a folder that already holds a run without ``resume``, or a config the run cannot
    continue, is the same :class:`RunError`; on a resume each stage the run already records is marked
    ``done`` (its line ends in "done earlier").

    Each stage still to run gets the time earlier runs of the protocol took for it (``estimate_s``: the
    median over this run's and its seed replicates' ``timings.jsonl``, ``RUNS_DIR/NAME-s*``), and a last
    line sums them: how long the rest would take on the machine and load those runs had."""
    if config.seeds:
        raise ValueError("dry_run_evolve walks one seed: give each of seed_replicates(config) to it")
    processes = config.distributed.processes()
    root = Path(config.runs_dir).expanduser() / config.name
    planned: list[PlannedStage] = []

    def environment_here() -> dict[str, Any] | None:
        try:
            return environment_of(config)
        except ValueError:  # e.g. a GPU config walked on a machine without one: nothing to compare with
            return None

    # the run folder's checks, read-only: a fresh run into a folder that holds one is refused, as the run would be
    preview = preview_resume(root, recorded_config(config), resume=resume, redo=redo, upgrade=upgrade_recorded,
                             extend=extension_of, environment=environment_here)
    done = set(preview.done)
    timed_runs = _protocol_runs(root)
    seconds = recorded_stage_seconds(timed_runs)
    timed = {stage: statistics.median(values) for stage, values in seconds.items()}

    def kind_of(stage: str) -> tuple[str, str]:  # iter_1/eps_low_02/policy -> (iter_1, policy)
        parts = stage.split("/")
        return parts[0], parts[-1]

    # a stage no earlier run timed (a new variant's policy) takes the time of the stages of its kind that were
    timed_kinds: dict[tuple[str, str], list[float]] = {}
    for stage, values in seconds.items():
        timed_kinds.setdefault(kind_of(stage), []).extend(values)
    by_kind = {kind: statistics.median(values) for kind, values in timed_kinds.items()}
    if resume or redo is not None:
        if preview.note:
            log(f"  ({preview.note})")
        for line in preview.extensions:
            log(f"  (the config extends the run: {line})")
        if preview.free_changes:
            log("  (settings that would change on resume, leaving results as they are or changing only their low "
                "bits: " + ", ".join(preview.free_changes) + ")")
        if preview.environment_changed:
            log(f"  WARNING: the run started in another environment ({', '.join(preview.environment_changed)} "
                "differ): later stages may not compute what an uninterrupted run would")

    def plan_stage(name: str, stage: Callable[..., Any], inputs: dict[str, str],
                   options: dict[str, Any]) -> StageRecord:
        seed = derive_seed(config.seed, name)
        ctx = StageContext(config=config, root=root, log=log, bc_policy=run.bc_policy, name=name, seed=seed,
                           workdir=root / name)
        builder = getattr(stage, "build_config", None)
        if builder is not None:
            try:
                builder(ctx, inputs, **options)
            except ValueError as err:  # pydantic's ValidationError among them
                raise ValueError(f"stage {name}: {_one_line(err)}") from None
        resumable = getattr(stage, "resumable", False)
        estimate = None if name in done else timed.get(name, by_kind.get(kind_of(name)))
        alike = estimate is not None and name not in timed
        planned.append(PlannedStage(name, stage_processes(stage, config, options, processes) if resumable else None,
                                    done=name in done, estimate_s=estimate))
        count = planned[-1].processes
        spans_nodes = config.distributed.nnodes > 1 and resumable and stage_processes(stage, config, options, 2) > 1
        nodes = f"{config.distributed.nnodes} nodes x " if spans_nodes else ""
        log(f"  {name}" + ("" if count is None else
                           f"  (training: {nodes}{count} process{'es' if count > 1 else ''})")
            + ("  done earlier" if name in done else "")
            + ("" if estimate is None else f"  about {duration_text(estimate)}" + (" (as its kind)" if alike else "")))
        return StageRecord(name, dict(inputs), _PlannedOutputs(name), {})

    run = Run(config, root, log, plan_stage, probe_experts=probe_store(config) if config.probe.states else None,
              dry_run=True)
    if config.probe.states and run.probe_experts is None:
        log("format probe skipped: no expert store to draw its states from (set bc.data.train_path)")
    qevolve(run)
    to_run = [stage for stage in planned if not stage.done]
    estimated = [stage.estimate_s for stage in to_run if stage.estimate_s is not None]
    if estimated:
        untimed = len(to_run) - len(estimated)
        log(f"  (to run: about {duration_text(sum(estimated))} for {len(estimated)} of the {len(to_run)} stages, as "
            f"{', '.join(run.name for run in timed_runs)} recorded them (the median where several did; a stage "
            "marked 'as its kind' from the recorded stages of its iteration and kind, e.g. every iter_1/*/policy)"
            + (f"; {untimed} stage{'s' if untimed > 1 else ''} no earlier run timed" if untimed else "") + ")")
    return planned


def _protocol_runs(root: Path) -> list[Path]:
    """The run folder ``root`` and its seed replicates (``NAME-sSEED`` beside it) that recorded stage times."""
    stem = re.sub(r"-s\d+$", "", root.name)
    folders = {root, *root.parent.glob(f"{stem}-s*")} if stem != root.name else {root}
    return sorted(f for f in folders if re.fullmatch(rf"{re.escape(stem)}(-s\d+)?", f.name) and (f / TIMINGS).is_file())


def run_evolve(config: EvolveConfig, resume: bool = False, log: Callable[[str], None] = print,
               stop_before: str | None = None, redo: str | None = None, dry_run: bool = False) -> dict[str, Any]:
    """Run (or resume) the loop; returns the success-rate table. ``stop_before`` ends the run just
    before the named stage starts (used to simulate a kill); ``redo`` forgets that recorded stage
    and every later one, then resumes. ``dry_run``: only :func:`dry_run_evolve`, whose stages are
    returned as ``{"stages": [PlannedStage, ...]}``."""
    from qevolve.rollouts import vllm_backend

    if dry_run:
        return {"stages": dry_run_evolve(config, log, resume=resume, redo=redo)}

    # One thread count for the whole run: CPU reductions (hence weights) depend on it. Set before any
    # engine starts and asserted again at every stage (vLLM's CPU worker replaces torch.set_num_threads
    # with a no-op when its engine starts in this process; build_engine puts it back).
    if config.seeds:
        raise ValueError("run_evolve runs one seed: give each of seed_replicates(config) to it")
    threads = config.num_threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    processes = config.distributed.processes()
    validate_inputs(config)
    root = Path(config.runs_dir).expanduser() / config.name
    directory = RunDirectory(root, recorded_config(config), config.seed, resume=resume, redo=redo,
                             upgrade=upgrade_recorded, extend=extension_of, environment=environment_of(config))
    if directory.restarted:
        log(f"{root}: its manifest records no completed stage, so the run starts afresh under this config")
    if directory.resume_changes:
        # thread and process counts can move the low bits of float sums; the other such settings change nothing
        log(f"resuming {root} with changed settings that leave the results as they are, or change only their "
            "low bits where a thread or process count changed (recorded in the manifest): "
            + ", ".join(directory.resume_changes))
    if directory.environment_changed:
        log(f"WARNING: resuming {root} in another environment than it started in "
            f"({', '.join(directory.environment_changed)} differ): later stages may not compute what an "
            "uninterrupted run would; recorded in the manifest")
    try:
        loggers = _Loggers(config, root)
    except BaseException:
        directory.close()
        raise

    def rel(path: str) -> str:
        """Paths inside the run are recorded relative to it, so the manifest does not depend on where it lives."""
        try:
            return str(Path(path).resolve().relative_to(root.resolve()))
        except ValueError:
            return path

    def run_stage(name: str, stage: Callable[..., tuple[dict[str, str], dict[str, Any]]], inputs: dict[str, str],
                  options: dict[str, Any]):
        """Run ``stage(ctx, inputs, **options)`` as stage ``name``: a training stage (``resumable``) continues
        from the newest checkpoint of an interrupted attempt (see RunDirectory.run_stage); a generating
        stage may reuse the vLLM engine the previous stage left."""
        if stop_before == name and directory.completed(name) is None:
            raise KeyboardInterrupt(f"stopped before {name}")

        def seeded(workdir: Path):
            if not getattr(stage, "generates", False):
                # An idle vLLM engine (weights + KV cache: 3.4 GB on the WebShop quickstart) would stay
                # resident through the training stage that follows an evaluation. Consecutive generating
                # stages still share it (BC's evaluations and iteration 1's rollouts serve the same
                # weights). Every stage that does not generate comes before a training stage, and after
                # training the next engine serves new weights anyway: a fully fine-tuned policy needed a
                # new engine already; a LoRA policy now gets a new engine instead of an in-place reload.
                vllm_backend.release_engine()
                # The peak of this stage is its own, not the engine's it released.
                reset_peak_gpu()
            # What the stage starts with (only where CUDA is in use): after a generating stage, whether the
            # engine's memory went back (docs/gpu.md's check reads it from timings.jsonl).
            stage_timing.update(gpu_memory_now())
            # The seed tree: each stage's seed is derive_seed(seed, stage name), the name holding the
            # iteration (iter_1/critic, iter_1/plain_iql/critic, ...), which the stage gives its stage config
            # (trainer, critic heads, sampled decoding).
            seed = derive_seed(config.seed, name)
            seed_everything(seed)
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)
                if torch.get_num_threads() != threads:
                    log(f"WARNING: [{name}] runs with {torch.get_num_threads()} torch threads, not {threads} "
                        "(something in this process fixed the count); its results may differ from a run "
                        "with the asked count")
            ctx = StageContext(config=config, root=root, log=log, bc_policy=run.bc_policy, name=name, seed=seed,
                               workdir=workdir)
            try:
                if launched:
                    outputs, metrics = stage_worker.launch_stage(
                        ctx, stage, inputs, options, count, threads,
                        announce=announcer.launch if announcer is not None else None)
                else:
                    outputs, metrics = stage(ctx, inputs, **options)
            except FailedEpisodesError as err:  # name the stage; it is not recorded, so a fixed rerun redoes it
                raise FailedEpisodesError(f"stage {name}: {err}") from None
            finally:
                # A stage's models, optimizer and activations are garbage once it returns, but glibc keeps
                # the freed heap resident: without this the BC stage's ~8 GB (full fine-tuning, 4,096-token
                # micro-batches) stayed in the process through its evaluation (15 GB resident, WebShop).
                gc.collect()
                release_free_memory()
            # Wall-clock quantities go to timings, not into the manifest (it must be reproducible).
            return outputs, {k: v for k, v in metrics.items() if "second" not in k and k != "final_dir"}

        resumable = getattr(stage, "resumable", False)
        # a training stage in `processes` processes under torch's launcher (see qevolve.evolve.stage_worker)
        count = stage_processes(stage, config, options, processes) if resumable else 1
        # over several nodes every training stage that can train in several processes is launched on all of them
        single = resumable and stage_processes(stage, config, options, 2) == 1  # DPO
        launched = resumable and (count > 1 or stage_worker.LAUNCH_ONE_PROCESS or (nnodes > 1 and not single))
        if single and (processes > 1 or nnodes > 1) and directory.completed(name) is None:
            log(f"[{name}] trains in one process (DPO does), in this process")
        stage_timing: dict[str, Any] = {}
        record = directory.run_stage(name, {k: rel(v) for k, v in inputs.items()}, seeded, log=log,
                                     resumable=resumable, timing=stage_timing)
        if resumable and not config.keep_finished_checkpoints:
            # Recorded, so never resumed again: its checkpoints (1.6 GB each for a full fine-tuning of the
            # 135M model; a seed of the WebShop quick protocol left 11 GB of them) would only fill the disk.
            shutil.rmtree(root / name / "checkpoints", ignore_errors=True)
        loggers.log(name, _iteration_of(name), record.metrics)
        loggers.log_steps(name, root / name, warn=log)
        return record

    run = Run(config, root, log, run_stage, probe_experts=probe_store(config) if config.probe.states else None)
    if config.probe.states and run.probe_experts is None:
        log("format probe skipped: no expert store to draw its states from (set bc.data.train_path)")
    nnodes = config.distributed.nnodes
    # node 0 of several: the other nodes' followers join the training stages it announces (qevolve.evolve.nodes)
    announcer = LaunchAnnouncer(root, beat_s=config.distributed.heartbeat_timeout_s / 6) if nnodes > 1 else None
    finished = False
    try:
        qevolve(run)
        finished = True
    finally:
        if announcer is not None:
            announcer.end(finished)
        loggers.close()
        directory.close()

    table = success_table(directory.manifest["stages"], config.eval.splits,
                          online_budgets(directory.manifest["config"]))
    (root / "results.json").write_text(json.dumps(table, indent=1))
    return table
