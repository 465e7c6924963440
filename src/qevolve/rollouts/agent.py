"""The agent loop: many LLM-driven episodes advancing together in parallel environments.

Two schedules (``agent.schedule``). *Lockstep*: every live episode's pending turn is generated in
one batched call of the generation backend, parsed, and the environments step in the pool's worker
processes; a call lasts as long as its longest turn. *Continuous* (backends that stream, i.e. vLLM):
after each engine step the turns it finished are parsed and their environments stepped, and their
next turns (and new episodes in freed slots) join the engine's batch while the other rows keep
decoding. Both play turns with the same code (:meth:`_AgentLoop.play`). Prompts come from the
same :class:`qevolve.prompting.PromptBuilder` as behaviour cloning, so acting and training
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

from pydantic import Field

from qevolve.buffer.store import Episode, Turn, settle_final_reward
from qevolve.config import StageConfig
from qevolve.environments.pool import PoolConfig, make_pool
from qevolve.environments.turn_format import parse_turn
from qevolve.progress import progress_bar
from qevolve.rollouts.generation import GenerationBackend, GenerationRequest, GenerationResult, SamplingParams, \
    StreamingBackend, request_seed
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
    # lockstep by default: continuous changes which rows share an engine step, and in bf16 that moves some
    # greedy turns (6 of 50 WebShop episodes) for 8% less generation time (docs/vllm.md)
    schedule: Literal["auto", "lockstep", "continuous"] = Field(
        "lockstep", description="how generation and environment steps interleave: lockstep (one generation call "
        "for every live episode's turn, then every environment steps: each call lasts as long as its longest "
        "turn), continuous (an episode's next turn joins the running engine batch as soon as its last one is "
        "played, and freed slots take new episodes at once; deterministic, the engine stays full; vllm "
        "backend only), auto (continuous where the backend supports it, else lockstep)")
    pool: PoolConfig = Field(default_factory=PoolConfig, description="where the environments run (worker "
                             "processes or Ray actors)")


def resolve_backend(name: str) -> str:
    """``auto`` -> ``vllm`` where vLLM is installed, else ``hf``; ``vllm`` without vLLM installed is a
    one-line error.

    vLLM computes in bfloat16 where the hardware does so natively and in float32 on a CPU without native
    bf16 (``vllm_backend.engine_dtype``). There, in bfloat16, it had generated 0.69x HF fp32's tokens/s
    (docs/vllm.md, 2026-12-03); in float32 it gave the same greedy turns as HF fp32 on a WebShop evaluation,
    in about half the time after its engine started (docs/vllm.md, "On a CPU without native bf16").

    The environment variable ``QEVOLVE_AUTO_BACKEND=hf|vllm`` overrides what ``auto`` picks."""
    from qevolve.rollouts import vllm_backend

    if name == "auto":
        forced = os.environ.get("QEVOLVE_AUTO_BACKEND", "")
        if forced in ("hf", "vllm"):  # e.g. the test suite: auto means hf, vLLM is tested where asked for
            return resolve_backend(forced)
        return "vllm" if vllm_backend.vllm_available() else "hf"
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


def read_turn(ids: list[int], builder: Any, tokenizer: Any) -> tuple[str, Any]:
    """The text of a generated turn (its end-of-turn ids left out) and its parse in the builder's turn
    format: what the agent loop records and the environment is told."""
    eot_ids = list(builder.formatter.eot_ids)
    text_ids = ids[: -len(eot_ids)] if list(ids[-len(eot_ids):]) == eot_ids else ids
    agent_text = tokenizer.decode(text_ids, skip_special_tokens=False)
    return agent_text, parse_turn(agent_text, builder.config.turn_format)


def resolve_schedule(schedule: str, backend: GenerationBackend) -> str:
    """``auto`` -> ``continuous`` where the backend streams (:class:`StreamingBackend`), else ``lockstep``;
    ``continuous`` with a backend that cannot stream is a one-line ValueError."""
    streams = isinstance(backend, StreamingBackend)
    if schedule == "auto":
        return "continuous" if streams else "lockstep"
    if schedule == "continuous" and not streams:
        raise ValueError(f"agent.schedule 'continuous' needs a backend that streams requests (vllm); "
                         f"{type(backend).__name__} generates in lock-step only: use 'lockstep' or 'auto'")
    return schedule


class _AgentLoop:
    """State of one :func:`run_agent` call and the steps both schedules share: starting episodes in
    free slots, the request of a slot's pending turn, and playing generated turns (parse, record,
    step the environments, finish or observe)."""

    def __init__(self, env_name: str, split: str, jobs: list[tuple[str, str]], backend: GenerationBackend,
                 builder: Any, tokenizer: Any, config: AgentConfig, source: str, pool: Any, bar: Any,
                 on_episode: Callable[[Episode], None] | None):
        self.env_name, self.split, self.source = env_name, split, source
        self.backend, self.builder, self.tokenizer, self.config = backend, builder, tokenizer, config
        self.pool, self.bar, self.on_episode = pool, bar, on_episode
        self.queue = deque(jobs)
        self.free_slots = list(range(config.batch_size))[::-1]
        self.live: dict[int, _Live] = {}
        self.finished: list[Episode] = []
        self.failed: list[tuple[str, str]] = []
        self.gen_seconds = self.env_seconds = 0.0
        self.tokens = 0
        # Sampled decoding: each turn has its own seed from (seed, episode, turn), so an episode draws
        # the same tokens whatever else is in its batch (a resumed run batches differently).
        self.sampled = config.temperature > 0
        self.params = SamplingParams(config.max_new_tokens, config.temperature, config.top_p,
                                     config.seed if self.sampled else None)

    def finish(self, slot: int, final_observation: str, reason: str | None = None) -> None:
        state = self.live.pop(slot)
        self.backend.release([state.episode.episode_id])
        self.free_slots.append(slot)
        if reason is not None:  # recorded with the turns played so far, never dropped
            self.failed.append((state.episode.episode_id, reason))
            state.episode.failed, state.episode.failure_reason = True, reason
        else:
            settle_final_reward(state.episode)  # cut at the turn limit: the final reward goes on the last turn
        state.episode.final_observation = final_observation
        self.finished.append(state.episode)
        if self.on_episode:
            self.on_episode(state.episode)
        won = sum(ep.won for ep in self.finished)
        self.bar.set_postfix(won=f"{won}/{len(self.finished)}",
                             tok_s=f"{self.tokens / max(self.gen_seconds, 1e-9):.0f}")
        self.bar.update(1)

    def start_episodes(self) -> None:
        """Start queued episodes in the free slots (a failed reset finishes its episode at once)."""
        starting: list[tuple[int, str, str]] = []
        while self.queue and self.free_slots:
            episode_id, task_id = self.queue.popleft()
            starting.append((self.free_slots.pop(), episode_id, task_id))
        if not starting:
            return
        t0 = time.perf_counter()
        first = self.pool.reset([(slot, task_id) for slot, _, task_id in starting])
        self.env_seconds += time.perf_counter() - t0
        for slot, episode_id, task_id in starting:
            episode = Episode(episode_id, task_id, self.env_name, self.split, self.source)
            self.live[slot] = _Live(episode, self.builder.conversation(task_id), 0)
            result = first[slot]
            if not isinstance(result, str):  # the reset itself failed
                self.finish(slot, "", result.info.get("error", "reset failed"))
                continue
            limit = self.config.max_turns or int(self.pool.call(slot, "max_turns", task_id))
            self.live[slot].max_turns = limit
            self.live[slot].observe(result)

    def request(self, slot: int) -> GenerationRequest:
        """The generation request of the slot's pending turn."""
        state = self.live[slot]
        seed = request_seed(self.config.seed, state.episode.episode_id, state.episode.num_turns) \
            if self.sampled else None
        return GenerationRequest(state.episode.episode_id, state.conversation.prompt_ids, seed)

    def play(self, slots: list[int], requests: list[GenerationRequest], generations: list[GenerationResult],
             seconds: list[float]) -> None:
        """Record the generated turns of ``slots`` (``seconds``: each one's share of generation time), step
        their environments together, and finish each episode or give it its next observation."""
        config = self.config
        # 1. Parse; decide what each environment sees.
        to_step: list[tuple[int, str]] = []
        pending: dict[int, tuple[Turn, str | None]] = {}
        for slot, request, generation, turn_seconds in zip(slots, requests, generations, seconds):
            state = self.live[slot]
            ids = generation.token_ids
            self.tokens += len(ids)
            agent_text, parsed = read_turn(ids, self.builder, self.tokenizer)
            state.conversation.act(ids)
            turn = Turn(observation=state.observation, agent_text=agent_text, action=parsed.action,
                        format_valid=parsed.format_valid, action_valid=parsed.format_valid,
                        context_ids=list(state.context_ids), action_ids=list(ids),
                        action_logprobs=list(generation.logprobs), generation_seconds=turn_seconds,
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

        # 2. Step the environments in parallel.
        t0 = time.perf_counter()
        results = self.pool.step(to_step) if to_step else {}
        step_seconds = time.perf_counter() - t0
        self.env_seconds += step_seconds
        for slot in slots:
            state = self.live[slot]
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
                    self.finish(slot, "", f"at turn {len(state.episode.turns)} (action {command!r}): {error}")
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
                self.finish(slot, observation)
                continue
            state.observe(observation)

    def run_lockstep(self) -> None:
        """Every live episode's pending turn in one ``generate`` call, then every environment steps."""
        while self.queue or self.live:
            self.start_episodes()
            if not self.live:
                continue
            slots = sorted(self.live)
            requests = [self.request(s) for s in slots]
            t0 = time.perf_counter()
            generations = self.backend.generate(requests, self.params)
            batch_seconds = time.perf_counter() - t0
            self.gen_seconds += batch_seconds
            self.play(slots, requests, generations, [batch_seconds / len(slots)] * len(slots))

    def run_continuous(self, backend: StreamingBackend) -> None:
        """Each episode's next turn is submitted as soon as its last one is played, while the other rows
        keep decoding; freed slots take new episodes at once.

        Deterministic, whatever the wall-clock: after each engine step the turns it finished are played
        in slot order (their environments step together), and every next turn and new episode is
        submitted before the next step."""
        in_flight: dict[str, tuple[int, GenerationRequest]] = {}  # request id -> (slot, request)
        shares: dict[int, float] = {}  # slot -> generation seconds attributed to its pending turn so far
        try:
            while self.queue or self.live:
                self.start_episodes()
                waiting = sorted(set(self.live) - {slot for slot, _ in in_flight.values()})
                if waiting:
                    requests = [self.request(s) for s in waiting]
                    # unique and the same in every run: the episode and its turn
                    ids = [f"{r.key}@turn{self.live[s].episode.num_turns}" for s, r in zip(waiting, requests)]
                    backend.submit(requests, self.params, ids)
                    in_flight.update((i, (s, r)) for i, s, r in zip(ids, waiting, requests))
                    shares.update((s, 0.0) for s in waiting)
                if not in_flight:
                    continue
                t0 = time.perf_counter()
                done = backend.poll()
                step_seconds = time.perf_counter() - t0
                self.gen_seconds += step_seconds
                for slot, _ in in_flight.values():  # the step's time, shared by the requests in flight
                    shares[slot] += step_seconds / len(in_flight)
                if not done:
                    continue
                played = sorted(((*in_flight.pop(request_id), generation) for request_id, generation in done),
                                key=lambda item: item[0])  # slot order, not the engine's
                slots = [slot for slot, _, _ in played]
                self.play(slots, [request for _, request, _ in played], [generation for _, _, generation in played],
                          [shares.pop(slot) for slot in slots])
        finally:
            backend.cancel()  # a loop stopped by an error leaves nothing running in the engine


def run_agent(env_name: str, split: str, jobs: list[tuple[str, str]], backend: GenerationBackend,
              builder: Any, tokenizer: Any, config: AgentConfig, source: str = "self",
              env_kwargs: dict[str, Any] | None = None, progress: bool = True,
              on_episode: Callable[[Episode], None] | None = None) -> RolloutResult:
    """Play ``jobs`` = [(episode_id, task_id)] with the LLM policy behind ``backend``.

    ``config.schedule`` picks the loop (see :class:`AgentConfig`); ``episodes`` are in the order they
    finished, which differs between the schedules (``run_rollouts`` writes them in job order)."""
    schedule = resolve_schedule(config.schedule, backend)
    env_kwargs = {"split": split, **(env_kwargs or {})}
    started = time.perf_counter()
    bar = progress_bar(total=len(jobs), desc=f"{env_name}/{split} agent", unit="ep", enabled=progress)
    with make_pool(config.pool, env_name, env_kwargs, num_workers=config.num_workers,
                   step_timeout=config.step_timeout) as pool:
        loop = _AgentLoop(env_name, split, jobs, backend, builder, tokenizer, config, source, pool, bar, on_episode)
        if schedule == "continuous":
            loop.run_continuous(backend)  # type: ignore[arg-type]  # resolve_schedule checked it streams
        else:
            loop.run_lockstep()
    bar.close()
    return RolloutResult(loop.finished, loop.failed, time.perf_counter() - started, loop.gen_seconds,
                         loop.env_seconds, loop.tokens)


def expand_jobs(env_name: str, split: str, tasks: list[str], episodes_per_task: int) -> list[tuple[str, str]]:
    """[(episode_id, task_id)]: ``episodes_per_task`` episodes of each task, ids stable across runs."""
    return [(f"{env_name}/{split}/{task}#{k}", task) for task in tasks for k in range(episodes_per_task)]
