"""The agent loop: many LLM-driven episodes advancing together in parallel environments.

Each step, every live episode's pending turn is generated in one batched call of the generation
backend, parsed, and the environments step in the pool's worker processes. Prompts come from the
same :class:`qevolve.policy.prompts.PromptBuilder` as behaviour cloning, so acting and training
see identical token sequences (token-in-token-out: a turn's ``context_ids`` are what the
conversation appended before it, its ``action_ids`` are exactly the generated ids, with the
log-probs of the acting policy).

A turn that does not parse is recorded as a format error (``format_valid=False``) and the episode
goes on; what the environment sees is ``format_error_policy``: ``skip`` (no step; the agent is
told its reply was malformed), ``noop`` (a configured no-op action is executed) or
``execute_readable`` (a readable action in a malformed turn is executed, else skip).
"""

from __future__ import annotations

import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

import torch
from pydantic import Field

from qevolve.buffer.store import Episode, Turn, settle_final_reward
from qevolve.config import StageConfig
from qevolve.environments.pool import PoolConfig, make_pool
from qevolve.environments.turn_format import parse_turn
from qevolve.progress import progress_bar
from qevolve.rollouts.generation import GenerationBackend, GenerationRequest, SamplingParams, request_seed
from qevolve.rollouts.vllm_backend import VLLMSettings


class AgentConfig(StageConfig):
    """How the agent acts: batching, decoding, and what happens on malformed turns."""

    backend: Literal["auto", "hf", "vllm"] = Field(
        "auto", description="generation backend: hf (in-process transformers), vllm (a vLLM engine, the optional "
        "extra qevolve[vllm]), auto (vllm where it is installed, else hf)")
    vllm: VLLMSettings = Field(default_factory=VLLMSettings, description="the vLLM engine (backend: vllm)")
    batch_size: int = Field(16, ge=1, description="episodes advancing together (one generation batch)")
    num_workers: int = Field(2, ge=1, description="environment worker processes")
    max_new_tokens: int = Field(48, ge=1, description="token limit of one agent turn")
    temperature: float = Field(0.0, ge=0.0, description="sampling temperature (0: greedy, as in the paper)")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus sampling mass")
    seed: int = Field(0, description="seed of sampled decoding: each turn of each episode samples from its own "
                      "generator seeded by (seed, episode id, turn), whatever else is in its batch (`qevolve "
                      "evolve` sets it from the run's seed tree)")
    reuse_cache: bool = Field(True, description="keep each episode's attention cache between turns (encode only "
                              "new tokens); false re-encodes the whole prompt every turn (hf backend; vllm "
                              "always reuses cached prefixes)")
    kv_cache: Literal["growing", "dynamic"] = Field(
        "growing", description="HF backend key/value storage: growing (one preallocated buffer per batch, "
        "written in place) or dynamic (transformers' DynamicCache, reallocated at every token; more memory)")
    format_error_policy: Literal["skip", "noop", "execute_readable"] = Field(
        "skip", description="what the environment sees after a malformed turn")
    format_error_observation: str = Field(
        "Your reply was not in the required format; no action was taken.",
        description="observation given to the agent when a malformed turn is skipped")
    noop_action: str = Field("look", description="action executed for a malformed turn under format_error_policy=noop")
    step_timeout: float = Field(120.0, gt=0, description="seconds an environment step may take before its worker "
                                "is replaced (the episode then counts as failed)")
    max_turns: int | None = Field(None, ge=1, description="cap on turns per episode (null: the environment's own)")
    max_failed_share: float = Field(0.5, ge=0.0, le=1.0, description="the rollout or evaluation stops with an "
                                    "error quoting the first failure when more than this share of its episodes "
                                    "failed (environment exception, worker crash or timeout), instead of "
                                    "reporting their score; 1.0: never stop")
    pool: PoolConfig = Field(default_factory=PoolConfig, description="where the environments run (worker "
                             "processes or Ray actors)")


def resolve_backend(name: str) -> str:
    """``auto`` -> ``vllm`` where vLLM is installed and the hardware computes bfloat16 natively (a GPU, or a
    CPU with AVX-512 BF16 / AMX), else ``hf``; ``vllm`` without vLLM installed is a one-line error.

    Why not vLLM on every CPU: on a 2-core AVX2 CPU without native bf16 (docs/vllm.md, 2026-12-03) vLLM's
    bf16 engine generated 6.4 tokens/s at batch 32 against HF fp32's 9.3 on the same prompts, after a
    121 s engine start; on a bf16 CPU it was about 2x HF's best.

    The environment variable ``QEVOLVE_AUTO_BACKEND=hf|vllm`` overrides what ``auto`` picks."""
    from qevolve.policy.model import cpu_has_fast_bf16
    from qevolve.rollouts import vllm_backend

    if name == "auto":
        forced = os.environ.get("QEVOLVE_AUTO_BACKEND", "")
        if forced in ("hf", "vllm"):  # e.g. the test suite: auto means hf, vLLM is tested where asked for
            return resolve_backend(forced)
        if not vllm_backend.vllm_available():
            return "hf"
        return "vllm" if torch.cuda.is_available() or cpu_has_fast_bf16() else "hf"
    if name == "vllm" and not vllm_backend.vllm_available():
        raise vllm_backend.MissingVLLM(vllm_backend.MISSING_VLLM)
    return name


@dataclass
class _Live:
    """An episode in flight."""

    episode: Episode
    conversation: Any
    max_turns: int
    context_ids: list[int] = field(default_factory=list)  # pending turn's context
    observation: str = ""
    info: dict[str, Any] = field(default_factory=dict)  # prompt facts of the pending turn

    def observe(self, observation: str) -> None:
        """Add o_t to the conversation; remember its context ids and whether the history restarted."""
        self.observation = observation
        self.context_ids = self.conversation.observe(observation)
        self.info = {}
        if self.conversation.restarted:
            self.info["segment_start"] = True  # same flag as PromptBuilder.tokenize writes
        if self.conversation.over_budget:
            self.info["over_budget"] = True


@dataclass
class RolloutResult:
    episodes: list[Episode]  # every episode, failed ones included (``failed``, ``failure_reason``)
    failed: list[tuple[str, str]]  # (episode id, reason) of episodes lost to environment failures
    seconds: float
    generation_seconds: float
    env_seconds: float
    tokens_generated: int


def run_agent(env_name: str, split: str, jobs: list[tuple[str, str]], backend: GenerationBackend,
              builder: Any, tokenizer: Any, config: AgentConfig, source: str = "self",
              env_kwargs: dict[str, Any] | None = None, progress: bool = True,
              on_episode: Callable[[Episode], None] | None = None) -> RolloutResult:
    """Play ``jobs`` = [(episode_id, task_id)] with the LLM policy behind ``backend``."""
    env_kwargs = {"split": split, **(env_kwargs or {})}
    queue = deque(jobs)
    free_slots = list(range(config.batch_size))[::-1]
    live: dict[int, _Live] = {}
    finished: list[Episode] = []
    failed: list[tuple[str, str]] = []
    eot_ids = list(builder.formatter.eot_ids)
    started = time.perf_counter()
    gen_seconds = env_seconds = 0.0
    tokens = 0
    bar = progress_bar(total=len(jobs), desc=f"{env_name}/{split} agent", unit="ep", enabled=progress)

    def finish(slot: int, final_observation: str, reason: str | None = None) -> None:
        state = live.pop(slot)
        backend.release([state.episode.episode_id])
        free_slots.append(slot)
        if reason is not None:  # recorded with the turns played so far, never dropped
            failed.append((state.episode.episode_id, reason))
            state.episode.failed, state.episode.failure_reason = True, reason
        else:
            settle_final_reward(state.episode)  # cut at the turn limit: the final reward goes on the last turn
        state.episode.final_observation = final_observation
        finished.append(state.episode)
        if on_episode:
            on_episode(state.episode)
        won = sum(ep.won for ep in finished)
        bar.set_postfix(won=f"{won}/{len(finished)}", tok_s=f"{tokens / max(gen_seconds, 1e-9):.0f}")
        bar.update(1)

    with make_pool(config.pool, env_name, env_kwargs, num_workers=config.num_workers,
                   step_timeout=config.step_timeout) as pool:
        while queue or live:
            # 1. Start new episodes in free slots.
            starting: list[tuple[int, str, str]] = []
            while queue and free_slots:
                episode_id, task_id = queue.popleft()
                starting.append((free_slots.pop(), episode_id, task_id))
            if starting:
                t0 = time.perf_counter()
                first = pool.reset([(slot, task_id) for slot, _, task_id in starting])
                env_seconds += time.perf_counter() - t0
                for slot, episode_id, task_id in starting:
                    episode = Episode(episode_id, task_id, env_name, split, source)
                    live[slot] = _Live(episode, builder.conversation(task_id), 0)
                    result = first[slot]
                    if not isinstance(result, str):  # the reset itself failed
                        finish(slot, "", result.info.get("error", "reset failed"))
                        continue
                    limit = config.max_turns or int(pool.call(slot, "max_turns", task_id))
                    live[slot].max_turns = limit
                    live[slot].observe(result)
            if not live:
                continue

            # 2. One batched generation for every live episode.
            slots = sorted(live)
            # Sampled decoding: each turn has its own seed from (seed, episode, turn), so an episode draws
            # the same tokens whatever else is in its batch (a resumed run batches differently).
            sampled = config.temperature > 0
            requests = [GenerationRequest(live[s].episode.episode_id, live[s].conversation.prompt_ids,
                                          request_seed(config.seed, live[s].episode.episode_id,
                                                       live[s].episode.num_turns) if sampled else None)
                        for s in slots]
            params = SamplingParams(config.max_new_tokens, config.temperature, config.top_p,
                                    config.seed if sampled else None)
            t0 = time.perf_counter()
            generations = backend.generate(requests, params)
            batch_seconds = time.perf_counter() - t0
            gen_seconds += batch_seconds

            # 3. Parse; decide what each environment sees.
            to_step: list[tuple[int, str]] = []
            pending: dict[int, tuple[Turn, str | None]] = {}
            for slot, request, generation in zip(slots, requests, generations):
                state = live[slot]
                ids = generation.token_ids
                tokens += len(ids)
                text_ids = ids[: -len(eot_ids)] if ids[-len(eot_ids):] == eot_ids else ids
                agent_text = tokenizer.decode(text_ids, skip_special_tokens=False)
                parsed = parse_turn(agent_text, builder.config.turn_format)
                state.conversation.act(ids)
                turn = Turn(observation=state.observation, agent_text=agent_text, action=parsed.action,
                            format_valid=parsed.format_valid, action_valid=parsed.format_valid,
                            context_ids=list(state.context_ids), action_ids=list(ids),
                            action_logprobs=list(generation.logprobs),
                            generation_seconds=batch_seconds / len(slots),
                            info={**state.info, "stopped": generation.stopped,
                                  "prompt_tokens": len(request.prompt_ids)})
                if not generation.stopped:
                    turn.info["truncated_generation"] = True
                if not parsed.format_valid:
                    turn.info["format_error"] = parsed.error
                command: str | None = parsed.action if parsed.format_valid else None
                if not parsed.format_valid:
                    if config.format_error_policy == "noop":
                        command = config.noop_action
                    elif config.format_error_policy == "execute_readable":
                        command = parsed.action
                if command is not None:
                    to_step.append((slot, command))
                pending[slot] = (turn, command)

            # 4. Step the environments in parallel.
            t0 = time.perf_counter()
            results = pool.step(to_step) if to_step else {}
            step_seconds = time.perf_counter() - t0
            env_seconds += step_seconds
            for slot in slots:
                state = live[slot]
                turn, command = pending[slot]
                if command is None:
                    observation, reward, done = config.format_error_observation, 0.0, False
                    turn.info["env_stepped"] = False
                    turn.action_valid = False
                else:
                    result = results[slot]
                    if result.info.get("failed"):  # the turn is kept: what the agent did when the env failed
                        turn.done, turn.info["env_failed"] = True, True
                        state.episode.turns.append(turn)
                        error = str(result.info.get("error", "environment failure"))
                        finish(slot, "", f"at turn {len(state.episode.turns)} (action {command!r}): {error}")
                        continue
                    observation, reward, done = result.observation, float(result.reward), bool(result.done)
                    turn.action_valid = bool(result.info.get("valid_action", True))
                    turn.env_seconds = step_seconds / max(len(to_step), 1)
                    if result.info.get("won"):
                        state.episode.won = True
                    state.episode.score = float(result.info.get("score", state.episode.score))
                turn.reward, turn.done = reward, done
                state.episode.turns.append(turn)
                if done or state.episode.num_turns >= state.max_turns:
                    finish(slot, observation)
                    continue
                state.observe(observation)
    bar.close()
    return RolloutResult(finished, failed, time.perf_counter() - started, gen_seconds, env_seconds, tokens)


def expand_jobs(env_name: str, split: str, tasks: list[str], episodes_per_task: int) -> list[tuple[str, str]]:
    """[(episode_id, task_id)]: ``episodes_per_task`` episodes of each task, ids stable across runs."""
    return [(f"{env_name}/{split}/{task}#{k}", task) for task in tasks for k in range(episodes_per_task)]
