"""The critic's view of a buffer: one token sequence per trajectory with per-turn arrays.

Each trajectory becomes a :class:`CriticSample`: its token ids (from the store, never re-tokenised),
the positions where V(s_t) and Q(s_t, a_t) are read, and per-turn rewards, done flags, transition
weights and Monte-Carlo returns. Batches group whole trajectories (V(s_{t+1}) of a turn comes from
the same forward pass) under a budget in tokens.

History restarts. When the policy's prompt outgrew its token budget, the conversation restarted:
turn t with ``turn.info["segment_start"]`` holds in its ``context_ids`` the whole new prompt, and
the stored ids of the episode are a sequence of *segments*, each the exact token sequence the
policy conditioned on (the contract of ``qevolve.prompting``). A sample therefore holds one
:class:`Segment` per such sequence; each is one row of a forward pass, and V/Q of a turn are read
from the segment that contains it. Episodes without restarts have a single segment.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch

from qevolve.buffer.store import Episode
from qevolve.buffer.tokenized import TokenizedTrajectory
from qevolve.critic.config import WeightingConfig
from qevolve.critic.retrospective import RetrospectiveConfig, aux_rewards
from qevolve.prompting import episode_segments

__all__ = ["CriticSample", "Segment", "episode_token_segments", "build_samples", "transition_weights",
           "monte_carlo_returns", "token_budget_batches", "sample_tensors", "buffer_fingerprint", "ensure_tokenized"]


@dataclass
class Segment:
    """One token sequence of a trajectory and the read positions of the turns it contains."""

    input_ids: torch.Tensor  # [L] long
    value_positions: torch.Tensor  # [turns] long: the last token before the turn's action
    q_positions: torch.Tensor  # [turns] long: the last token of the turn's action

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())


@dataclass
class CriticSample:
    """One trajectory, ready for the critic."""

    episode_index: int
    episode_id: str
    segments: list[Segment]  # token sequences in turn order; one unless the history restarted
    env_rewards: torch.Tensor  # [T] float: r_env after turn t
    aux_rewards: torch.Tensor  # [T] float: r_aux of turn t
    dones: torch.Tensor  # [T] bool
    weights: torch.Tensor  # [T] float: w_t
    mc_returns: torch.Tensor  # [T] float: discounted sum of r_env + r_aux from t to the end (no bootstrap)
    scored: bool  # d: the episode's final score is non-zero (Episode.ended_with_reward); not Episode.won
    won: bool = False  # Episode.won: the outcome the held-out split is stratified by (not part of the loss)

    @property
    def num_turns(self) -> int:
        return int(self.env_rewards.numel())

    @property
    def num_tokens(self) -> int:
        return sum(segment.num_tokens for segment in self.segments)

    @property
    def longest_segment(self) -> int:
        return max(segment.num_tokens for segment in self.segments)

    @property
    def rewards(self) -> torch.Tensor:
        """The critic's reward r_env + r_aux."""
        return self.env_rewards + self.aux_rewards


def episode_token_segments(episode: Episode) -> list[TokenizedTrajectory]:
    """The episode's token sequences (:func:`qevolve.prompting.episode_segments`), checked for the critic:
    V reads the token before each action and Q the action's last token, so neither may be empty."""
    segments = episode_segments(episode)
    for segment in segments:
        first_turn = segment.turn_indices[0]
        if segment.trajectory.action_spans[0][0] == 0:
            raise ValueError(f"episode {episode.episode_id!r} turn {first_turn}: the first turn of a token sequence "
                             f"needs a non-empty context (V reads the token before the action)")
        for t, (start, end) in zip(segment.turn_indices, segment.trajectory.action_spans):
            if start == end:
                raise ValueError(f"episode {episode.episode_id!r} turn {t}: empty action_ids (Q reads its last token)")
    return [segment.trajectory for segment in segments]


def transition_weights(num_turns: int, success: bool, config: WeightingConfig) -> torch.Tensor:
    """w_t = 0.5 * (t/T + d) + 0.5 (t 0-based, T = num_turns, d = success); plain IQL: w_t = 1.

    A switched-off term is dropped from the sum (temporal off: w_t = 0.5 d + 0.5).
    """
    if config.scheme == "plain":
        return torch.ones(num_turns)
    t = torch.arange(num_turns, dtype=torch.float32)
    temporal = t / num_turns if config.temporal else torch.zeros(num_turns)
    d = float(success) if config.success else 0.0
    return 0.5 * (temporal + d) + 0.5


def monte_carlo_returns(rewards: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = r_t + gamma * G_{t+1}, G after the last turn = 0."""
    returns = torch.zeros_like(rewards, dtype=torch.float32)
    running = 0.0
    for t in range(rewards.numel() - 1, -1, -1):
        running = float(rewards[t]) + gamma * running
        returns[t] = running
    return returns


def build_samples(episodes: list[Episode], retrospective: RetrospectiveConfig, weighting: WeightingConfig,
                  gamma: float, max_sequence_tokens: int | None = None) -> list[CriticSample]:
    """One :class:`CriticSample` per episode; ``r_aux`` is computed from ``retrospective``."""
    samples = []
    for index, episode in enumerate(episodes):
        if not episode.turns:
            raise ValueError(f"episode {episode.episode_id!r} has no turns")
        segments = [Segment(torch.tensor(seg.input_ids, dtype=torch.long),
                            torch.tensor(seg.value_positions, dtype=torch.long),
                            torch.tensor(seg.q_positions, dtype=torch.long))
                    for seg in episode_token_segments(episode)]
        longest = max(seg.num_tokens for seg in segments)
        if max_sequence_tokens is not None and longest > max_sequence_tokens:
            raise ValueError(f"episode {episode.episode_id!r}: a token sequence of {longest} tokens, more than "
                             f"max_sequence_tokens={max_sequence_tokens}")
        env_rewards = torch.tensor([turn.reward for turn in episode.turns], dtype=torch.float32)
        aux = torch.tensor(aux_rewards(episode, retrospective), dtype=torch.float32)
        success = episode.ended_with_reward  # d from the final score, not the last reward's sign
        samples.append(CriticSample(
            episode_index=index,
            episode_id=episode.episode_id,
            segments=segments,
            env_rewards=env_rewards,
            aux_rewards=aux,
            dones=torch.tensor([turn.done for turn in episode.turns], dtype=torch.bool),
            weights=transition_weights(episode.num_turns, success, weighting),
            mc_returns=monte_carlo_returns(env_rewards + aux, gamma),
            scored=success,
            won=bool(episode.won),
        ))
    return samples


def token_budget_batches(samples: list[CriticSample], order: list[int], batch_tokens: int) -> list[list[int]]:
    """Cut ``order`` into consecutive batches whose padded size (segment rows x longest) fits ``batch_tokens``."""
    batches: list[list[int]] = []
    current: list[int] = []
    rows = longest = 0
    for index in order:
        sample = samples[index]
        new_rows, new_longest = rows + len(sample.segments), max(longest, sample.longest_segment)
        if current and new_rows * new_longest > batch_tokens:
            batches.append(current)
            current, rows, longest = [], 0, 0
            new_rows, new_longest = len(sample.segments), sample.longest_segment
        current.append(index)
        rows, longest = new_rows, new_longest
    if current:
        batches.append(current)
    return batches


def sample_tensors(sample: CriticSample) -> list[torch.Tensor]:
    """Every tensor that identifies a sample's tokens and read positions (for hashing)."""
    return [t for seg in sample.segments for t in (seg.input_ids, seg.value_positions, seg.q_positions)]


def buffer_fingerprint(samples: list[CriticSample]) -> str:
    """A hash of everything the critic trains on: tokens, read positions, rewards, dones, weights."""
    digest = hashlib.sha256()
    for sample in samples:
        for tensor in sample_tensors(sample) + [sample.env_rewards, sample.aux_rewards, sample.dones,
                                                sample.weights]:
            digest.update(tensor.numpy().tobytes())
            digest.update(b"|")
    return digest.hexdigest()


def ensure_tokenized(episodes: list[Episode], model_path: str | Path, source: str = "buffer") -> list[Episode]:
    """Fill missing ``context_ids``/``action_ids`` with the policy's tokeniser, or explain why it cannot."""
    missing = [ep for ep in episodes if any(t.context_ids is None or t.action_ids is None for t in ep.turns)]
    if not missing:
        return episodes
    try:
        from qevolve.prompting import tokenize_episode  # the policy's prompt builder (another module)
    except ImportError:
        raise ValueError(f"{source}: {len(missing)} episodes have no token ids and qevolve.prompting."
                         f"tokenize_episode is not available; tokenise the buffer first") from None
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    for episode in missing:
        result = tokenize_episode(episode, tokenizer)
        if isinstance(result, Episode) and result is not episode:
            episode.turns = result.turns
    return episodes
