"""The stages of ``qevolve evolve``: each a function ``stage(ctx, inputs) -> (outputs, metrics)``.

A stage reads the run-relative paths ``inputs`` names (what the manifest records it read), writes
into ``ctx.workdir`` and returns the paths of its outputs inside that folder and its metrics. What it
needs besides its inputs, a stage takes as keyword arguments (the variant's critic config, the
evaluation split, ...). :class:`StageContext` carries what every stage shares: the run's config, its
folder, its log, the run's BC policy, the stage's name and its seed, ``derive_seed(config.seed,
name)``, which the stage gives its stage config (trainer, critic heads, sampled decoding).

Stages do not run themselves: a recipe (:mod:`qevolve.evolve.recipes`) calls ``run.stage(name,
stage, inputs, ...)``, and the loop (:func:`qevolve.evolve.loop.run_evolve`) seeds it, runs it in its
work folder, records it in the manifest, or skips it when ``--resume`` finds it recorded. A stage
marked :func:`training_stage` continues from the newest checkpoint of an interrupted attempt; one
marked :func:`generating_stage` may reuse the vLLM engine the stage before it left.

Every stage builds its stage config from the run's sections with :func:`qevolve.evolve.settings.replaced`,
validated, setting the fields the loop decides (:data:`qevolve.evolve.settings.DERIVED_FIELDS`).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from qevolve.buffer.metrics import truncation_warning
from qevolve.buffer.store import Episode, read_episodes, sorted_episodes, write_episodes
from qevolve.config import merge_trees
from qevolve.critic.config import CriticConfig
from qevolve.environments.experts import filter_task_types
from qevolve.evolve.settings import EvolveSettings, OnlineRoundSettings, PPOSettings, replaced
from qevolve.policy.bc import BCConfig, BCDataConfig
from qevolve.policy.bppo import PolicyStageConfig
from qevolve.policy.dpo import DPOConfig
from qevolve.process_rewards.label import LabelConfig
from qevolve.seeding import DEMONSTRATIONS, derive_seed

#: the metrics of a rollout or evaluation stage that the manifest records
EVAL_KEYS = ("success_rate", "mean_reward", "mean_turns", "format_error_rate", "invalid_action_rate",
             "truncated_turn_rate", "episodes", "failed_episodes", "env_steps", "tokens_generated")

#: what a stage returns: the paths of its outputs inside its work folder, and its metrics
StageResult = tuple[dict[str, str], dict[str, Any]]


@dataclass(frozen=True)
class StageContext:
    """What a stage works with besides its inputs."""

    config: EvolveSettings          # the run's config
    root: Path                      # the run's folder, RUNS_DIR/NAME; inputs are relative to it
    log: Callable[[str], None]
    bc_policy: str | None           # the run's BC policy (the KL reference of every update); None before bc
    name: str                       # the stage's name, e.g. iter_1/critic
    seed: int                       # derive_seed(config.seed, name)
    workdir: Path                   # the stage writes here; renamed into root/name when it finishes

    def path(self, recorded: str) -> Path:
        """The file or folder at ``recorded``, a path relative to the run (absolute paths stay as they are)."""
        return self.root / recorded

    @property
    def iteration(self) -> int:
        """k of the stage's iteration ``iter_k``; 0 for the stages of behaviour cloning."""
        head = self.name.split("/")[0]
        return int(head.split("_")[1]) if head.startswith("iter_") else 0


def training_stage(stage: Callable[..., StageResult]) -> Callable[..., StageResult]:
    """Marks a training stage: an interrupted attempt continues from its newest checkpoint."""
    stage.resumable = True  # type: ignore[attr-defined]
    return stage


def generating_stage(stage: Callable[..., StageResult]) -> Callable[..., StageResult]:
    """Marks a stage that generates (rollouts, evaluations, probes): it may keep the vLLM engine of the stage
    before it; before every other stage the loop releases the engine."""
    stage.generates = True  # type: ignore[attr-defined]
    return stage


def builds(builder: Callable[..., Any]) -> Callable[[Callable[..., StageResult]], Callable[..., StageResult]]:
    """Marks ``builder(ctx, inputs, **options)`` as the function that builds the stage's config (validated, with
    the fields the loop decides) from the run's sections, without loading a model or reading an input: the
    stage calls it, and ``qevolve evolve --dry-run`` calls it instead of the stage."""
    def mark(stage: Callable[..., StageResult]) -> Callable[..., StageResult]:
        stage.build_config = builder  # type: ignore[attr-defined]
        return stage
    return mark


def numeric_metrics(summary: dict[str, Any]) -> dict[str, Any]:
    """The numeric entries of a summary (a trainer's, the labels'): what the manifest records of it."""
    return {key: value for key, value in summary.items() if isinstance(value, (int, float))}


# ------------------------------------------------------------------------------------------ what the stages read


def bc_data_config(config: EvolveSettings) -> BCDataConfig:
    """Behaviour cloning's data settings as the loop runs them: the protocol's environment and task
    types, and the demonstrations drawn with the seed tree's node :data:`DEMONSTRATIONS` (unless
    ``bc.data.seed`` is set), which the buffer's D_expert is drawn from too."""
    data = config.bc.data
    return replaced(data, {"env": config.env, "task_types": config.task_types, "seed": data.seed
                           if data.seed is not None else derive_seed(config.seed, DEMONSTRATIONS)})


def expert_store(config: EvolveSettings) -> str:
    """Where the buffer's D_expert comes from (:func:`buffer_experts`), as the buffer stages record it."""
    from qevolve.paths import data_dir

    if config.buffer.expert_source == "bc":
        return str(config.bc.data.train_path or data_dir() / "experts" / config.env)
    return str(config.buffer.expert_path or data_dir() / "experts" / config.env)


def buffer_experts(config: EvolveSettings) -> list[Episode]:
    """D_expert of the buffer (the same in every iteration), sorted by episode id.

    ``buffer.expert_source`` bc: the demonstrations behaviour cloning trained on (with a reused
    ``init_checkpoint``: those ``bc.data`` selects); extra: the usable episodes of ``buffer.expert_path``
    that are not among them. Either way ``buffer.num_expert`` takes a subset seeded by the node
    ``buffer/experts`` of the seed tree, after sorting, so the store's file order never matters."""
    from qevolve.buffer.store import usable_episodes
    from qevolve.paths import data_dir
    from qevolve.policy.bc import select_demonstrations

    demonstrations, _, _ = select_demonstrations(bc_data_config(config), derive_seed(config.seed, "bc"))
    if config.buffer.expert_source == "bc":
        experts = list(demonstrations)
    else:
        path = Path(config.buffer.expert_path).expanduser() if config.buffer.expert_path else \
            data_dir() / "experts" / config.env
        taken = {ep.episode_id for ep in demonstrations}
        experts = [ep for ep in usable_episodes(read_episodes(path)) if ep.episode_id not in taken]
        if config.task_types is not None:
            keep = set(filter_task_types(config.env, sorted({ep.task_id for ep in experts}), config.task_types,
                                         f"task_types (experts {path})"))
            experts = [ep for ep in experts if ep.task_id in keep]
    if config.buffer.only_won_expert:
        experts = [ep for ep in experts if ep.won]
    experts = sorted_episodes(experts)
    if config.buffer.num_expert is not None and config.buffer.num_expert < len(experts):
        rng = random.Random(derive_seed(config.seed, "buffer/experts"))
        experts = sorted_episodes(rng.sample(experts, config.buffer.num_expert))
    return experts


def probe_store(config: EvolveSettings) -> Path | None:
    """The expert store the format probe draws its states from: behaviour cloning's (``bc.data.train_path``,
    else DATA_DIR/experts/ENV); None when it does not exist (a reused ``init_checkpoint`` without expert data)."""
    from qevolve.paths import data_dir

    path = Path(config.bc.data.train_path).expanduser() if config.bc.data.train_path else \
        data_dir() / "experts" / config.env
    return path if path.exists() else None


def probe_states(config: EvolveSettings) -> tuple[list[tuple[Episode, int]], bool]:
    """The states of the run's format probes (``probe.states`` of them, the same for every policy of the
    run, so the trained policies compare with the BC policy on equal terms) and whether they are held out.

    Held out: turns of the expert store's usable episodes of the run's task types that behaviour
    cloning did not train on and that are not in the buffer's D_expert (e.g. BC's held-out episodes, or
    demonstrations beyond ``bc.data.num_demonstrations``), so no stage of the run trained on them. When
    every episode was used (a small expert set), the states are turns of BC's demonstrations: BC and
    every policy update trained on those (the buffer holds them), so the probe then measures the format
    on familiar contexts, which still exposes a policy whose format broke. Self-generated rollouts are
    never used: they are trained on by the update being probed, and their contexts come from the
    policy before it. The turns are drawn with the seed tree's node ``probe/states``."""
    from qevolve.buffer.store import usable_episodes
    from qevolve.evaluation.probe import sample_states
    from qevolve.policy.bc import select_demonstrations

    path = probe_store(config)
    if path is None or not config.probe.states:
        return [], False
    demonstrations, _, _ = select_demonstrations(bc_data_config(config), derive_seed(config.seed, "bc"))
    used = {ep.episode_id for ep in demonstrations}
    if config.iterations:
        used |= {ep.episode_id for ep in buffer_experts(config)}
    store = [ep for ep in usable_episodes(read_episodes(path)) if ep.episode_id not in used]
    if config.task_types is not None and store:
        keep = set(filter_task_types(config.env, sorted({ep.task_id for ep in store}), config.task_types,
                                     f"task_types (experts {path})"))
        store = [ep for ep in store if ep.task_id in keep]
    pool, held_out = (store, True) if store else (list(demonstrations), False)
    return sample_states(pool, config.probe.states, derive_seed(config.seed, "probe/states")), held_out


def rollout_task_ids(config: EvolveSettings) -> list[str] | None:
    """The tasks of the rollout stages when ``rollout.tasks`` names them (buffer_experts: the tasks of the
    buffer's expert demonstrations, sorted); None: the split's selection (task_types, task_stride, limit)."""
    if config.rollout.tasks == "buffer_experts":
        return sorted({ep.task_id for ep in buffer_experts(config)})
    return None


def grpo_round_tasks(config: EvolveSettings, stage: str) -> list[str] | None:
    """The tasks of GRPO round ``stage`` (its rollouts stage's name): :func:`online_round_tasks` with
    ``grpo.tasks_per_round``."""
    return online_round_tasks(config, stage, config.grpo.tasks_per_round)


def online_round_tasks(config: EvolveSettings, stage: str, n: int | None) -> list[str] | None:
    """The tasks of an online baseline's round ``stage`` (its rollouts stage's name): the rollout tasks, or
    with ``n`` (its ``tasks_per_round``) a subset of them drawn with the seed tree's node ``<stage>/tasks``,
    in the rollout tasks' order. None: the split's selection, as :func:`rollout_task_ids`."""
    from qevolve.environments.play import list_tasks
    from qevolve.rollouts.run import select_tasks

    tasks = rollout_task_ids(config)
    if n is None:
        return tasks
    if tasks is None:
        tasks = filter_task_types(config.env, list_tasks(config.env, config.rollout.split), config.task_types,
                                  "task_types")
        tasks = select_tasks(tasks, config.rollout.task_stride, config.rollout.limit)
    if n >= len(tasks):
        return list(tasks)
    chosen = set(random.Random(derive_seed(config.seed, f"{stage}/tasks")).sample(sorted(tasks), n))
    return [task for task in tasks if task in chosen]


def rft_config(config: EvolveSettings, start: str, buffer_file: Path, output_dir: Path, seed: int) -> BCConfig:
    """The RFT baseline's training: behaviour cloning from ``start`` on every won episode of the buffer,
    expert and self alike (``only_won``; failed episodes are left out by ``include_failed: false``), with
    the budget of ``config.rft`` and the stage's ``seed``."""
    return replaced(config.rft, {
        "model": replaced(config.model, {"name_or_path": start}), "prompt": config.prompt,
        "output_dir": str(output_dir), "seed": seed,
        "progress": config.progress, "resume": True, "data": replaced(config.rft.data, {
            "env": config.env, "train_path": str(buffer_file), "only_won": True,
            "task_types": None, "num_demonstrations": None})})


def evaluation_settings(config: EvolveSettings, prefix: str) -> dict[str, Any]:
    """How the run evaluates the policy of stages ``<prefix>/eval_<split>``: ``rollout``, the evaluation
    config of every split (:class:`qevolve.rollouts.run.RolloutConfig` fields, without ``split`` and the
    policy's ``model.name_or_path``), ``splits``, and ``agent_seeds``, each split's stage seed. The loop's
    evaluation stages are built from it and saved policies record it, so that a stand-alone ``qevolve
    eval --checkpoint POLICY`` repeats the run's evaluation."""
    model = config.model.model_dump(mode="json")
    model.pop("name_or_path")
    if model["num_threads"] is None and config.num_threads is not None:
        model["num_threads"] = config.num_threads  # the loop runs every stage with the run's thread count
    agent = config.eval.agent.model_dump(mode="json")
    agent.pop("seed")
    return {"rollout": {"env": config.env, "limit": config.eval.limit, "task_stride": config.eval.task_stride,
                        "task_types": config.task_types, "model": model,
                        "prompt": config.prompt.model_dump(mode="json"), "agent": agent, "source": "eval"},
            "splits": list(config.eval.splits),
            "agent_seeds": {split: derive_seed(config.seed, f"{prefix}/eval_{split}") for split in config.eval.splits},
            "run": config.name, "stages": [f"{prefix}/eval_{split}" for split in config.eval.splits]}


def record_evaluation(policy_folder: Path, config: EvolveSettings, prefix: str) -> None:
    """Add :func:`evaluation_settings` to the saved policy at ``policy_folder`` (its ``qevolve_policy.json``;
    nothing when the stage saved no final policy). In a launched stage rank 0 alone writes, as it alone
    saved the policy: another rank rewriting the file could leave rank 0 reading it half written."""
    from qevolve.atomic_io import atomic_write_text
    from qevolve.distributed import launcher_rank
    from qevolve.models.loading import POLICY_INFO, read_policy_info

    path = Path(policy_folder) / POLICY_INFO
    if launcher_rank() == 0 and path.is_file():
        info = read_policy_info(policy_folder)
        info["evaluation"] = evaluation_settings(config, prefix)
        atomic_write_text(path, json.dumps(info, indent=1, default=str))


# ------------------------------------------------------------------------------------------ the stages


def bc_stage_config(ctx: StageContext, inputs: dict[str, str]) -> BCConfig | None:
    """Behaviour cloning's config; None when ``init_checkpoint`` gives the BC policy."""
    config = ctx.config
    if config.init_checkpoint:
        return None
    return replaced(config.bc, {
        "model": config.model, "prompt": config.prompt, "output_dir": str(ctx.workdir),
        "data": bc_data_config(config), "seed": ctx.seed, "progress": config.progress, "resume": True})


@training_stage
@builds(bc_stage_config)
def bc_stage(ctx: StageContext, inputs: dict[str, str]) -> StageResult:
    """pi <- BC(D_expert): behaviour cloning of the base model on the expert demonstrations (nothing to
    train when ``init_checkpoint`` gives the BC policy)."""
    from qevolve.policy.bc import run_bc

    config = ctx.config
    bc_config = bc_stage_config(ctx, inputs)
    if bc_config is None:
        return {}, {"reused_checkpoint": 1}
    result = run_bc(bc_config, log=ctx.log)
    record_evaluation(ctx.workdir / "final", config, "bc")
    metrics = {"steps": result.steps, "train_tokens": result.train_tokens,
               "tokens_per_second": round(result.tokens_per_second, 1)}
    for tag, values in (("before", result.eval_before), ("after", result.eval_after)):
        if values:
            metrics[f"heldout_agent_nll_{tag}"] = values["agent_nll"]
    return {"policy": "final"}, metrics


def _run_rollouts(ctx: StageContext, rollout_config: Any, task_ids: list[str] | None) -> StageResult:
    """Episodes of the rollout config's policy on its tasks (or ``task_ids``), as a rollouts stage records them."""
    from qevolve.rollouts.run import run_rollouts

    metrics = run_rollouts(rollout_config, ctx.workdir, progress=ctx.config.progress, task_ids=task_ids)
    warning = truncation_warning(metrics, rollout_config.agent.max_new_tokens)
    if warning:
        ctx.log(f"[{ctx.name}] {warning}")
    return {"trajectories": "."}, {key: metrics[key] for key in EVAL_KEYS if key in metrics}


def rollouts_stage_config(ctx: StageContext, inputs: dict[str, str]) -> Any:
    """The rollouts stage's :class:`qevolve.rollouts.run.RolloutConfig`."""
    from qevolve.rollouts.run import RolloutConfig

    config = ctx.config
    return RolloutConfig(
        env=config.env, split=config.rollout.split, limit=config.rollout.limit,
        task_stride=config.rollout.task_stride, task_types=config.task_types,
        episodes_per_task=config.rollout.episodes_per_task,
        model=replaced(config.model, {"name_or_path": inputs["policy"]}), prompt=config.prompt, source="self",
        agent=replaced(config.rollout.agent, {"seed": ctx.seed}))


@generating_stage
@builds(rollouts_stage_config)
def rollouts_stage(ctx: StageContext, inputs: dict[str, str]) -> StageResult:
    """D_self <- rollouts of the policy at ``inputs["policy"]`` on the training tasks (``rollout``)."""
    return _run_rollouts(ctx, rollouts_stage_config(ctx, inputs), rollout_task_ids(ctx.config))


def buffer_stage_config(ctx: StageContext, inputs: dict[str, str], *, self_trajectories: Sequence[str],
                        tokenizer_of: str) -> Any:
    """The model config of the tokeniser the buffer stage loads (the policy at ``tokenizer_of``)."""
    return replaced(ctx.config.model, {"name_or_path": tokenizer_of})


@builds(buffer_stage_config)
def buffer_stage(ctx: StageContext, inputs: dict[str, str], *, self_trajectories: Sequence[str],
                 tokenizer_of: str) -> StageResult:
    """D <- D_expert U D_self: the buffer's expert episodes and the rollouts at ``self_trajectories``, in
    token space with the tokeniser of the policy at ``tokenizer_of``."""
    from qevolve.models.loading import load_policy
    from qevolve.prompting import PromptBuilder

    config = ctx.config
    experts = buffer_experts(config)
    own = sorted_episodes(ep for path in self_trajectories for ep in read_episodes(ctx.path(path)))
    policy = load_policy(buffer_stage_config(ctx, inputs, self_trajectories=self_trajectories,
                                             tokenizer_of=tokenizer_of), trainable=False)
    builder = PromptBuilder.for_environment(policy.tokenizer, config.prompt, config.env)
    # Self turns keep their generated ids (token-in-token-out); expert turns are tokenised once here.
    episodes = [builder.tokenize(ep) for ep in experts + own]
    write_episodes(ctx.workdir / "buffer.parquet", episodes, {"env": config.env, "iteration": ctx.iteration})
    return {"buffer": "buffer.parquet"}, {
        "expert_episodes": len(experts), "self_episodes": len(own),
        "self_success_rate": sum(ep.won for ep in own) / max(len(own), 1),
        "turns": sum(ep.num_turns for ep in episodes)}


def critic_stage_config(ctx: StageContext, inputs: dict[str, str], *, critic: CriticConfig) -> CriticConfig:
    """The critic stage's config: ``critic`` from the run's critic backbone, with the stage's seed."""
    config = ctx.config
    init = config.critic.init or (ctx.bc_policy if config.critic_init == "bc" else None)
    return replaced(critic, {"init": init, "seed": ctx.seed})


@training_stage
@builds(critic_stage_config)
def critic_stage(ctx: StageContext, inputs: dict[str, str], *, critic: CriticConfig) -> StageResult:
    """V, Q <- weighted IQL on the buffer at ``inputs["buffer"]`` with the settings ``critic`` (the run's
    ``critic`` section, or a variant's override of it), from the run's critic backbone."""
    from qevolve.critic.train import FIT_KEYS, critic_fit_line, train_critic

    config = ctx.config
    critic_config = critic_stage_config(ctx, inputs, critic=critic)
    summary = train_critic(read_episodes(ctx.path(inputs["buffer"])), critic_config, ctx.workdir, restart=False,
                           progress=config.progress, log=ctx.log)
    last = summary["history"][-1] if summary["history"] else {}
    metrics = {key: value for key, value in last.items()
               if isinstance(value, (int, float)) and not isinstance(value, bool)}
    # the fit after training (in-sample and k-fold held out) beside the last epoch's numbers
    metrics.update({key: summary[key] for key in FIT_KEYS if key in summary})
    ctx.log(f"[{ctx.name}] {critic_fit_line(summary)}")
    return {"critic": "."}, {**metrics, "converged": int(summary["converged"]),  # 1/0: see train_critic
                             "converged_by": summary["converged_by"]}


def given_label(ctx: StageContext, inputs: dict[str, str], *, label: LabelConfig, **_: Any) -> LabelConfig:
    """A label stage's config: the ``label`` it is given (validated again)."""
    return replaced(label, {})


@builds(given_label)
def label_stage(ctx: StageContext, inputs: dict[str, str], *, label: LabelConfig) -> StageResult:
    """A_t <- process rewards of every turn of the buffer at ``inputs["buffer"]`` with the settings ``label``
    (from the critic at ``inputs["critic"]`` where its estimator needs one), and the label audit where
    the environment judges single actions."""
    from qevolve.critic.train import load_critic
    from qevolve.evaluation.diagnostics import STANDARDIZE_MODES, audit_line, audit_metrics, label_audit
    from qevolve.process_rewards.advantages import estimator_needs_critic
    from qevolve.process_rewards.label import label_episodes

    config = ctx.config
    model = load_critic(ctx.path(inputs["critic"]), device=label.device) \
        if estimator_needs_critic(label.estimator) else None
    episodes, summary = label_episodes(read_episodes(ctx.path(inputs["buffer"])), model, label,
                                       progress=config.progress)
    write_episodes(ctx.workdir / "labelled.parquet", episodes, {"env": config.env, "iteration": ctx.iteration})
    outputs = {"labelled": "labelled.parquet"}
    metrics = numeric_metrics(summary)
    penalised, others = summary.get("advantage_mean_penalised"), summary.get("advantage_mean_unpenalised")
    if penalised is not None and others is not None and penalised > others:
        ctx.log(f"WARNING: [{ctx.name}] the {summary['penalised_turns']} turns the retrospective penalties mark have "
                f"a higher mean advantage ({penalised:+.3f}) than the other turns ({others:+.3f}): the policy update "
                "will push them up (GAE on r_env takes each penalty back out of V; docs/critic.md)")
    # the environment's judge of single actions, where it has one (WebShop): do the labels put
    # the right clicks above the wrong ones? A diagnostic: it never stops the run.
    # (standardised as the policy update does, where its mode does not depend on batching)
    mode = config.policy.standardize_advantages
    try:
        audit = label_audit(episodes, standardize=mode if mode in STANDARDIZE_MODES else "buffer",
                            include_failed=model.config.include_failed if model is not None else False)
    except Exception as error:  # noqa: BLE001
        ctx.log(f"WARNING: [{ctx.name}] no label audit ({type(error).__name__}: {error})")
        audit = None
    if audit is not None:
        (ctx.workdir / "label_audit.json").write_text(json.dumps(audit, indent=1))
        outputs["audit"] = "label_audit.json"
        metrics.update(audit_metrics(audit))
        ctx.log(f"[{ctx.name}] {audit_line(audit)}")
    return outputs, metrics


#: the sections a policy-training stage is built from: a BPPO/AWR update or DPO (the eto baseline)
PolicyConfig = PolicyStageConfig | DPOConfig


def update_config(ctx: StageContext, section: PolicyConfig, data: str, start: str) -> PolicyConfig:
    """The policy update ``section`` (BPPO/AWR or DPO) from the policy at ``start`` on the episodes at ``data``,
    its reference the run's BC policy."""
    config = ctx.config
    return replaced(section, {
        "env": config.env, "buffer_path": str(ctx.path(data)),
        "model": replaced(config.model, {"name_or_path": start}), "reference": ctx.bc_policy,
        "prompt": config.prompt, "output_dir": str(ctx.workdir), "seed": ctx.seed,
        "progress": config.progress, "resume": True})


def _update_policy(ctx: StageContext, section: PolicyStageConfig, data: str, start: str,
                   evaluated_as: str) -> StageResult:
    """The policy update ``section`` (:func:`update_config`); the saved policy records how the stages
    ``<evaluated_as>/eval_<split>`` evaluate it."""
    from qevolve.policy.bppo import run_policy_update

    config = ctx.config
    policy_config = update_config(ctx, section, data, start)
    result = run_policy_update(policy_config, log=ctx.log)
    record_evaluation(ctx.workdir / "final", config, evaluated_as)
    return {"policy": "final"}, numeric_metrics(result.summary())


def policy_stage_config(ctx: StageContext, inputs: dict[str, str], *, policy: PolicyStageConfig,
                        evaluated_as: str | None = None) -> PolicyStageConfig:
    """The policy stage's config (:func:`update_config`)."""
    return update_config(ctx, policy, inputs["labelled"], inputs["start"])


@training_stage
@builds(policy_stage_config)
def policy_stage(ctx: StageContext, inputs: dict[str, str], *, policy: PolicyStageConfig,
                 evaluated_as: str | None = None) -> StageResult:
    """pi <- the update ``policy`` (BPPO in the method) of the policy at ``inputs["start"]`` on the labelled
    turns at ``inputs["labelled"]``. Its policy is evaluated as ``evaluated_as`` (default: the stage's
    folder, ``iter_k`` for ``iter_k/policy``)."""
    return _update_policy(ctx, policy, inputs["labelled"], inputs["start"],
                          evaluated_as or ctx.name.rpartition("/")[0])


def rft_stage_config(ctx: StageContext, inputs: dict[str, str]) -> BCConfig:
    """The rft stage's config (:func:`rft_config`)."""
    return rft_config(ctx.config, inputs["start"], ctx.path(inputs["buffer"]), ctx.workdir, ctx.seed)


@training_stage
@builds(rft_stage_config)
def rft_stage(ctx: StageContext, inputs: dict[str, str]) -> StageResult:
    """The rft baseline's training: BC from ``inputs["start"]`` on the won episodes of the buffer at
    ``inputs["buffer"]`` (:func:`rft_config`)."""
    from qevolve.policy.bc import run_bc

    config = ctx.config
    result = run_bc(rft_stage_config(ctx, inputs), log=ctx.log)
    record_evaluation(ctx.workdir / "final", config, ctx.name.rpartition("/")[0])
    return {"policy": "final"}, {"steps": result.steps, "train_sequences": result.train_sequences,
                                 "train_tokens": result.train_tokens}


def eto_stage_config(ctx: StageContext, inputs: dict[str, str]) -> DPOConfig:
    """The eto stage's config: the ``eto`` section (:func:`update_config`)."""
    return update_config(ctx, ctx.config.eto, inputs["buffer"], inputs["start"])


@training_stage
@builds(eto_stage_config)
def eto_stage(ctx: StageContext, inputs: dict[str, str]) -> StageResult:
    """The eto baseline's training: the ``eto`` section (DPO) from ``inputs["start"]`` on the (better, worse)
    trajectory pairs of the buffer at ``inputs["buffer"]``."""
    from qevolve.policy.dpo import run_dpo

    result = run_dpo(eto_stage_config(ctx, inputs), log=ctx.log)
    record_evaluation(ctx.workdir / "final", ctx.config, ctx.name.rpartition("/")[0])
    return {"policy": "final"}, numeric_metrics(result.summary())


def stage_processes(stage: Callable[..., StageResult], config: EvolveSettings, options: dict[str, Any],
                    processes: int) -> int:
    """How many processes the training ``stage`` runs as when the run asks for ``processes``: DPO (the eto
    baseline) trains in one process."""
    return 1 if stage is eto_stage else processes


def eval_stage_config(ctx: StageContext, inputs: dict[str, str], *, split: str) -> Any:
    """An evaluation stage's :class:`qevolve.rollouts.run.RolloutConfig` (see :func:`eval_stage`)."""
    from qevolve.rollouts.run import RolloutConfig

    config = ctx.config
    prefix = ctx.name.removesuffix(f"/eval_{split}")
    rerank: dict[str, Any] = {}
    if "critic" in inputs:
        rerank = {"limit": config.rerank.limit or config.eval.limit,
                  "task_stride": config.rerank.task_stride or config.eval.task_stride,
                  "agent": {"temperature": config.rerank.temperature},
                  "rerank_critic": str(ctx.path(inputs["critic"])),
                  "rerank_candidates": config.rerank.num_candidates, "rerank_q_source": config.rerank.q_source}
    # the settings saved policies record (record_evaluation), so `qevolve eval` repeats this
    return RolloutConfig.model_validate(merge_trees(
        evaluation_settings(config, prefix)["rollout"],
        merge_trees(rerank, {"split": split, "model": {"name_or_path": inputs["policy"]},
                             "agent": {"seed": ctx.seed}})))


@generating_stage
@builds(eval_stage_config)
def eval_stage(ctx: StageContext, inputs: dict[str, str], *, split: str) -> StageResult:
    """Evaluation of the policy at ``inputs["policy"]`` on ``split`` with the run's evaluation settings
    (:func:`evaluation_settings`); re-ranked by the critic at ``inputs["critic"]`` when given (``rerank``)."""
    from qevolve.critic.train import load_critic
    from qevolve.rollouts.run import run_eval

    config = ctx.config
    rollout_config = eval_stage_config(ctx, inputs, split=split)
    metrics = run_eval(rollout_config, ctx.workdir, progress=config.progress, load_critic=load_critic)
    warning = truncation_warning(metrics, rollout_config.agent.max_new_tokens)
    if warning:
        ctx.log(f"[{ctx.name}] {warning}")
    return ({"trajectories": "trajectories", "metrics": "metrics.json"},
            {key: metrics[key] for key in EVAL_KEYS if key in metrics})


def probe_stage_config(ctx: StageContext, inputs: dict[str, str], **_: Any) -> Any:
    """A probe stage's :class:`qevolve.rollouts.run.RolloutConfig`: the evaluation's settings."""
    from qevolve.rollouts.run import RolloutConfig

    prefix = ctx.name.removesuffix("/probe")
    return RolloutConfig.model_validate(merge_trees(evaluation_settings(ctx.config, prefix)["rollout"], {
        "model": {"name_or_path": inputs["policy"]}, "agent": {"seed": ctx.seed}}))


@generating_stage
@builds(probe_stage_config)
def probe_stage(ctx: StageContext, inputs: dict[str, str], *,
                states: Callable[[], tuple[list[tuple[Episode, int]], bool]]) -> StageResult:
    """The format probe of the policy at ``inputs["policy"]``: one greedy turn on each of the run's probe
    states (``states()``: :func:`probe_states`, drawn once per run) with the evaluation's settings."""
    from qevolve.evaluation.probe import probe_policy

    drawn, held_out = states()
    rollout_config = probe_stage_config(ctx, inputs)
    result = probe_policy(rollout_config, drawn)
    return {"probe": result.write(ctx.workdir)}, {**result.metrics(), "held_out_states": int(held_out)}


# ------------------------------------------------------------------------------------------ the online baselines'


def online_rollouts_stage_config(ctx: StageContext, inputs: dict[str, str], *, settings: OnlineRoundSettings,
                                 episodes_per_task: int) -> Any:
    """An online round's :class:`qevolve.rollouts.run.RolloutConfig` (see :func:`online_rollouts_stage`)."""
    from qevolve.rollouts.run import RolloutConfig

    config = ctx.config
    return RolloutConfig(
        env=config.env, split=config.rollout.split, limit=config.rollout.limit,
        task_stride=config.rollout.task_stride, task_types=config.task_types, episodes_per_task=episodes_per_task,
        model=replaced(config.model, {"name_or_path": inputs["policy"]}), prompt=config.prompt, source="self",
        agent=replaced(config.rollout.agent, {"seed": ctx.seed, "temperature": settings.temperature,
                                              "top_p": settings.top_p}))


@generating_stage
@builds(online_rollouts_stage_config)
def online_rollouts_stage(ctx: StageContext, inputs: dict[str, str], *, settings: OnlineRoundSettings,
                          episodes_per_task: int) -> StageResult:
    """A round of an online baseline (``settings``: its section): ``episodes_per_task`` episodes of the policy
    at ``inputs["policy"]`` on each of the round's tasks (:func:`online_round_tasks`), sampled."""
    rollout_config = online_rollouts_stage_config(ctx, inputs, settings=settings, episodes_per_task=episodes_per_task)
    return _run_rollouts(ctx, rollout_config, online_round_tasks(ctx.config, ctx.name, settings.tasks_per_round))


@builds(given_label)
def group_label_stage(ctx: StageContext, inputs: dict[str, str], *, label: LabelConfig,
                      round_number: int) -> StageResult:
    """A grpo round's labels: every turn of the round's rollouts at ``inputs["rollouts"]`` gets its episode's
    group advantage (``label``: grpo, rloo or gigpo; no critic)."""
    from qevolve.process_rewards.label import label_episodes

    episodes, summary = label_episodes(read_episodes(ctx.path(inputs["rollouts"])), None, label,
                                       progress=ctx.config.progress)
    write_episodes(ctx.workdir / "labelled.parquet", episodes, {"env": ctx.config.env, "grpo_round": round_number})
    return {"labelled": "labelled.parquet"}, numeric_metrics(summary)


def value_stage_config(ctx: StageContext, inputs: dict[str, str], *, settings: PPOSettings,
                       round_number: int) -> Any:
    """A ppo round's value-head config: ``ppo.value`` with the stage's seed."""
    return replaced(settings.value, {"seed": ctx.seed})


@builds(value_stage_config)
def value_stage(ctx: StageContext, inputs: dict[str, str], *, settings: PPOSettings, round_number: int) -> StageResult:
    """A ppo round's value head: fitted (from the round before's head at ``inputs["value"]``, if any) to the
    lambda-returns of the round's rollouts at ``inputs["rollouts"]``, on the frozen hidden states of
    ``inputs["backbone"]`` (the BC policy); every turn gets V_old, the head's value before the fit."""
    from qevolve.critic.value import VALUE_FILE, train_value

    value_config = value_stage_config(ctx, inputs, settings=settings, round_number=round_number)
    previous = inputs.get("value")
    episodes, summary = train_value(
        read_episodes(ctx.path(inputs["rollouts"])), value_config, ctx.workdir, backbone=inputs["backbone"],
        previous=ctx.path(previous) if previous is not None else None, gamma=settings.gamma,
        lam=settings.gae_lambda, truncated_bootstrap=settings.truncated_bootstrap,
        progress=ctx.config.progress, log=ctx.log)
    write_episodes(ctx.workdir / "valued.parquet", episodes, {"env": ctx.config.env, "ppo_round": round_number})
    ctx.log(f"[{ctx.name}] loss {summary['loss_before']:.4f} -> {summary['loss_after']:.4f}, explained "
            f"variance {summary['explained_variance_before']:.3f} -> {summary['explained_variance_after']:.3f}")
    return {"value": VALUE_FILE, "valued": "valued.parquet"}, summary


def gae_label_stage_config(ctx: StageContext, inputs: dict[str, str], *, settings: PPOSettings,
                           round_number: int) -> LabelConfig:
    """A ppo round's label config: GAE over r_env with the section's gamma and lambda."""
    return LabelConfig(estimator="gae_env", gamma=settings.gamma, gae_lambda=settings.gae_lambda)


@builds(gae_label_stage_config)
def gae_label_stage(ctx: StageContext, inputs: dict[str, str], *, settings: PPOSettings,
                    round_number: int) -> StageResult:
    """A ppo round's labels: GAE over r_env and V_old (the V the round acted with) on every turn of the valued
    rollouts at ``inputs["valued"]``."""
    from qevolve.process_rewards.label import label_with_values

    label = gae_label_stage_config(ctx, inputs, settings=settings, round_number=round_number)
    episodes, summary = label_with_values(read_episodes(ctx.path(inputs["valued"])), label,
                                          settings.truncated_bootstrap)
    write_episodes(ctx.workdir / "labelled.parquet", episodes, {"env": ctx.config.env, "ppo_round": round_number})
    return {"labelled": "labelled.parquet"}, numeric_metrics(summary)
