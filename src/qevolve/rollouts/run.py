"""``qevolve rollout`` and ``qevolve eval``: load a checkpoint, act on a split, write trajectories.

Both write a sharded trajectory folder as episodes finish, so a killed run resumes where it
stopped (episodes already in the shards are skipped). Episodes lost to an environment failure are
written too, with ``failed`` and ``failure_reason`` (they count as lost in the metrics, and a
resumed run does not replay them). ``eval`` also writes ``metrics.json``.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Callable, Literal

from pydantic import Field

from qevolve.atomic_io import write_json_atomic
from qevolve.buffer.metrics import check_failed_share, episode_metrics, first_failure
from qevolve.buffer.store import Episode, StoreError, read_episodes, read_metadata, shard_paths, write_shard
from qevolve.config import StageConfig
from qevolve.environments.episodes import JobOrder
from qevolve.environments.experts import filter_task_types
from qevolve.environments.play import list_tasks
from qevolve.machine import package_versions
from qevolve.models.loading import ModelConfig, load_policy
from qevolve.progress import quiet_third_party, use_bars
from qevolve.prompting import PromptBuilder, PromptConfig
from qevolve.rollouts.agent import AgentConfig, expand_jobs, resolve_backend, run_agent
from qevolve.rollouts.generation import GenerationBackend, HFGenerationBackend

log = logging.getLogger(__name__)


class RolloutConfig(StageConfig):
    """Acting with a policy checkpoint on one split of one environment."""

    env: str = Field("alfworld", description="environment name")
    split: str = Field("train", description="task split (train, seen, unseen, or any the environment has)")
    limit: int | None = Field(None, ge=1, description="only the first N tasks of the split (quick runs)")
    task_stride: int = Field(1, ge=1, description="take every k-th task of the split (spreads a small --limit "
                             "over task types, which ALFWorld lists grouped)")
    task_types: list[str] | None = Field(None, description="only tasks of these types (the environment's "
                                         "grouping, e.g. ALFWorld pick_and_place_simple); null: all")
    episodes_per_task: int = Field(1, ge=1, description="episodes per task (N in the paper)")
    shard_size: int = Field(50, ge=1, description="episodes per written shard (the unit of resume)")
    model: ModelConfig = Field(default_factory=ModelConfig, description="the acting policy")
    prompt: PromptConfig = Field(default_factory=PromptConfig, description="prompt building (same as BC)")
    agent: AgentConfig = Field(default_factory=AgentConfig, description="batching, decoding, format errors")
    source: str = Field("self", description="label of the trajectories in the store")
    rerank_critic: str | None = Field(None, description="test-time critic re-ranking: a trained critic folder; "
                                      "each turn samples rerank_candidates turns (agent.temperature > 0) and acts "
                                      "with the highest Q (null: act with the policy alone)")
    rerank_candidates: int = Field(4, ge=1, description="candidate turns sampled per state for re-ranking")
    rerank_q_source: Literal["online", "target"] = Field("online", description="re-ranking Q: the online heads "
                                                         "(min of the twins) or the Polyak target heads")


def select_tasks(tasks: list[str], stride: int, limit: int | None) -> list[str]:
    picked = tasks[::stride]
    return picked[:limit] if limit is not None else picked


def load_tokenizer(model: ModelConfig) -> Any:
    """The checkpoint's tokeniser alone (the vllm backend holds the weights), as load_policy sets it up."""
    from transformers import AutoTokenizer

    from qevolve.models.loading import _resolve_source

    source = Path(_resolve_source(model.name_or_path))
    tokenizer = AutoTokenizer.from_pretrained(source)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def acting_setup(config: RolloutConfig, policy: Any = None) -> tuple[Any, Any, PromptBuilder, list[int]]:
    """What acting with ``config`` needs besides the backend: the policy (loaded from ``config.model`` for
    the hf backend when not given; None for vllm, whose engine serves the checkpoint folder), the
    tokeniser (a given policy lends its own), the prompt builder and the ids that end a turn."""
    if policy is None and resolve_backend(config.agent.backend) != "vllm":
        policy = load_policy(config.model.for_acting(), trainable=False)
    tokenizer = policy.tokenizer if policy is not None else load_tokenizer(config.model)
    builder = PromptBuilder.for_environment(tokenizer, config.prompt, config.env)
    stop_ids = list(builder.formatter.eot_ids[-1:])
    if tokenizer.eos_token_id is not None:
        stop_ids.append(tokenizer.eos_token_id)
    return policy, tokenizer, builder, stop_ids


def build_backend(config: RolloutConfig, policy: Any, tokenizer: Any, stop_ids: list[int]) -> GenerationBackend:
    """The configured generation backend (``agent.backend``) for the checkpoint ``config.model``.

    ``auto`` takes vllm where it is installed and falls back to hf, with a logged reason, when the
    engine cannot serve this checkpoint (e.g. a head size its CPU kernels lack); ``vllm`` raises."""
    name = resolve_backend(config.agent.backend)
    if name == "vllm":
        from qevolve.models.loading import _resolve_source
        from qevolve.rollouts.vllm_backend import backend_for_checkpoint

        try:
            return backend_for_checkpoint(_resolve_source(config.model.name_or_path), config.agent.vllm, stop_ids)
        except Exception as err:  # noqa: BLE001 - auto falls back, explicit vllm does not
            if config.agent.backend == "vllm":
                raise
            first_line = (str(err).strip().splitlines() or [type(err).__name__])[0]
            log.warning("agent.backend auto: vLLM cannot serve %s (%s); generating with hf",
                        config.model.name_or_path, first_line)
    if policy is None:
        policy = load_policy(config.model.for_acting(), trainable=False)
    autocast = None
    if policy.precision == "bf16-autocast":
        import torch

        autocast = torch.bfloat16
    return HFGenerationBackend(policy.model, stop_ids, tokenizer.pad_token_id or 0,
                               reuse_cache=config.agent.reuse_cache, autocast_dtype=autocast,
                               kv_cache=config.agent.kv_cache)


def check_shards_belong(output: Path, expected: dict[str, Any]) -> None:
    """Refuse to resume into a folder whose shards another rollout wrote (another environment, split,
    checkpoint or generation backend): its episodes would be counted with this run's."""
    for path in shard_paths(output):
        recorded = read_metadata(path)
        for key, value in expected.items():
            if key in recorded and recorded[key] != value:
                raise StoreError(f"{path}: written by a rollout with {key} {recorded[key]!r}, not {value!r}; "
                                 f"choose another output folder or delete it")


def run_rollouts(config: RolloutConfig, output: Path, progress: bool = True, policy=None,
                 task_ids: list[str] | None = None, check_failures: bool = True,
                 load_critic: Callable[..., Any] | None = None) -> dict[str, Any]:
    """Act on the configured split; write shards into ``output`` (resumable). Returns metrics.

    Raises :class:`~qevolve.buffer.metrics.FailedEpisodesError` (after writing the shards) when
    more than ``agent.max_failed_share`` of the episodes failed, unless ``check_failures`` is false.

    ``load_critic`` (:func:`qevolve.critic.train.load_critic`) loads ``config.rerank_critic`` for critic
    re-ranking; without it a config that asks for re-ranking is refused.

    ``task_ids`` replaces the split's task selection (task_types, task_stride, limit) by these tasks,
    which must belong to the split.

    The generation backend is ``config.agent.backend``: hf runs ``policy`` (loaded from
    ``config.model`` when not given); vllm serves the checkpoint folder ``config.model.name_or_path``
    in the process's engine (reloaded in place when the checkpoint changed, see
    :mod:`qevolve.rollouts.vllm_backend`)."""
    output.mkdir(parents=True, exist_ok=True)
    check_shards_belong(output, {"env": config.env, "split": config.split, "checkpoint": config.model.name_or_path})
    done_ids = {ep.episode_id for path in shard_paths(output) for ep in read_episodes(path)}
    split_tasks = list_tasks(config.env, config.split)
    if task_ids is not None:
        missing = sorted(set(task_ids) - set(split_tasks))
        if missing:
            raise ValueError(f"task {missing[0]!r} is not in the {config.env} split {config.split!r}")
        tasks = list(task_ids)
    else:
        tasks = filter_task_types(config.env, split_tasks, config.task_types, "task_types")
        tasks = select_tasks(tasks, config.task_stride, config.limit)
    all_jobs = expand_jobs(config.env, config.split, tasks, config.episodes_per_task)
    strangers = sorted(done_ids - {episode_id for episode_id, _ in all_jobs})
    if strangers:
        raise StoreError(f"{output}: holds episode {strangers[0]!r}, which this run would not play (another task "
                         f"selection or episodes_per_task); choose another output folder or delete it")
    jobs = [job for job in all_jobs if job[0] not in done_ids]
    quiet_third_party(bars=use_bars(progress))
    policy, tokenizer, builder, stop_ids = acting_setup(config, policy)
    backend = build_backend(config, policy, tokenizer, stop_ids)
    backend_name = "vllm" if type(backend).__name__ == "VLLMGenerationBackend" else "hf"
    if config.rerank_critic:
        from qevolve.rollouts.rerank import CriticRerankBackend

        if load_critic is None:  # the critic is a later layer than acting: its loader comes from the caller
            raise ValueError("rerank_critic: this caller cannot load a critic (pass load_critic)")
        if config.agent.temperature <= 0 and config.rerank_candidates > 1:
            raise ValueError("rerank_critic: critic re-ranking samples its candidates; set agent.temperature > 0")
        device = str(policy.device) if policy is not None else None
        backend = CriticRerankBackend(backend, load_critic(config.rerank_critic, device=device),
                                      config.rerank_candidates, config.rerank_q_source)
    check_shards_belong(output, {"generation_backend": backend_name})
    shard_index = len(shard_paths(output))
    pending: list[Episode] = []

    def flush() -> None:
        nonlocal shard_index
        if pending:
            write_shard(output, shard_index, pending, {"env": config.env, "split": config.split,
                                                       "checkpoint": config.model.name_or_path,
                                                       "generation_backend": backend_name})
            shard_index += 1
            pending.clear()

    # Episodes finish in an order that depends on their lengths and the batch; they are written in
    # job order (each waits until every earlier job has finished), so the shards hold the same
    # sequence in a fresh and in a resumed run.
    index_of = {episode_id: i for i, (episode_id, _) in enumerate(jobs)}
    in_order = JobOrder()

    def on_episode(episode: Episode) -> None:
        for ready in in_order.add(index_of[episode.episode_id], episode):
            pending.append(ready)
            if len(pending) >= config.shard_size:
                flush()

    result = run_agent(config.env, config.split, jobs, backend, builder, tokenizer, config.agent,
                       source=config.source, progress=progress, on_episode=on_episode)
    pending.extend(in_order.remaining())  # none unless an episode went missing
    flush()
    episodes = read_episodes(output) if shard_paths(output) else []  # failed ones too, marked failed
    metrics = episode_metrics(episodes)
    metrics.update({
        "env": config.env, "split": config.split, "wall_seconds": round(result.seconds, 1),
        "generation_seconds": round(result.generation_seconds, 1), "env_seconds": round(result.env_seconds, 1),
        "tokens_generated_this_run": result.tokens_generated,
        "generated_tokens_per_second": round(result.tokens_generated / result.generation_seconds, 2)
        if result.generation_seconds else 0.0,
        "failed": [list(f) for f in result.failed], "generation_backend": backend_name,
        # where generation's time goes: prompt tokens run through the model (a reused key/value cache
        # encodes only a turn's new tokens; a rebuilt one, every token of the prompt again) against
        # tokens generated
        "prompt_tokens_encoded_this_run": backend.stats.prompt_tokens_encoded,
        "cache_rebuilds_this_run": backend.stats.cache_rebuilds,
    })
    failure = first_failure(episodes)
    if failure is not None:
        metrics["first_failure"] = {"task": failure[0], "reason": failure[1]}
    if check_failures:
        check_failed_share(episodes, config.agent.max_failed_share, f"{config.env} {config.split}")
    return metrics


def run_eval(config: RolloutConfig, output: Path, progress: bool = True, policy=None,
             load_critic: Callable[..., Any] | None = None) -> dict[str, Any]:
    """Rollouts on an evaluation split plus ``metrics.json`` with the protocol recorded beside it
    (``load_critic`` as for :func:`run_rollouts`)."""
    metrics = run_rollouts(config, output / "trajectories", progress, policy, check_failures=False,
                           load_critic=load_critic)
    metrics["protocol"] = {"env": config.env, "split": config.split, "task_types": config.task_types,
                           "limit": config.limit,
                           "task_stride": config.task_stride, "max_turns": config.agent.max_turns,
                           "decoding": "greedy" if config.agent.temperature <= 0 else
                           f"T={config.agent.temperature}, top_p={config.agent.top_p}",
                           "checkpoint": config.model.name_or_path,
                           "generation_backend": metrics["generation_backend"],
                           "rerank": None if not config.rerank_critic else {
                               "critic": config.rerank_critic, "candidates": config.rerank_candidates,
                               "q_source": config.rerank_q_source}}
    metrics["versions"] = package_versions()
    metrics["date"] = time.strftime("%Y-%m-%d")
    write_json_atomic(output / "metrics.json", metrics)
    # Checked after metrics.json is written, so the failures can be read there and in the trajectories.
    trajectories = output / "trajectories"
    check_failed_share(read_episodes(trajectories) if shard_paths(trajectories) else [],
                       config.agent.max_failed_share, f"{config.env} {config.split}")
    return metrics
