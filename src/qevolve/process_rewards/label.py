"""``qevolve label``: write V, Q, r_aux and the process reward (advantage) on every turn of a buffer.

The advantage estimator is a registered name (``process_rewards.advantages``), so the paper's
ablations (GAE over r_env, GAE over r_env + r_aux, one-step TD, Q - V) are a config value.
``r_aux`` comes from the critic's own retrospective config, so the labels match what it trained on.

Estimators that read no value (``outcome``, ``grpo``, ``rloo``, ``gigpo``: ``estimator_needs_critic`` is
False) label without a critic: only the advantage is written (V, Q and r_aux stay empty), and episodes
lost to environment failures pass through unlabelled. The group estimators group the trajectories by
task id: the episodes of one task, which started from the same state, are compared with each other;
``gigpo`` also groups the turns of a task by the observation each acted on (``Turn.observation``).

A buffer whose turns already carry V (``Turn.value``, as the online PPO baseline's value stage writes
it) is labelled by :func:`label_with_values` with an estimator that reads V alone (``gae_env``, ``td1``).
"""

from __future__ import annotations

from typing import Any, Literal, Mapping

import numpy as np
from pydantic import Field, field_validator

from qevolve.buffer.store import Episode, usable_episodes
from qevolve.config import StageConfig
from qevolve.finite import NonFiniteError
from qevolve.process_rewards.advantages import (TrajectoryValues, advantage_estimators, anchor_groups,
                                                estimate_advantages, estimator_needs_critic, standardize)

__all__ = ["LabelConfig", "label_episodes", "label_without_critic", "label_with_values", "advantages_from_values",
           "GIGPO_GAMMA", "VALUE_ONLY_ESTIMATORS"]

#: the discount of GiGPO's step returns when no critic gives one (the paper's and verl-agent's gamma)
GIGPO_GAMMA = 0.95


class GroupAdvantageFields(StageConfig):
    """The settings of the group estimators (grpo, rloo, gigpo), shared by ``label`` and the online baselines."""

    group_eps: float = Field(1e-6, gt=0.0, description="grpo, gigpo: added to the group's sample standard "
                             "deviation, so a group whose returns are all equal gets advantage 0 instead of a "
                             "division by 0")
    gigpo_weight: float = Field(1.0, ge=0.0, description="gigpo: omega, the weight of the step-level advantage "
                                "added to the episode-level one (the paper's 1.0; 0 gives grpo's advantages)")
    gigpo_norm: Literal["std", "mean"] = Field(
        "std", description="gigpo: how a group is normalised, at both levels: std = (x - mean) / (sample std + "
        "group_eps) (the reference implementation's default), mean = x - mean only")


class LabelConfig(GroupAdvantageFields):
    estimator: str = Field("gae_env", description="advantage estimator: gae_env (default), gae_env_aux, td1, "
                           "q_minus_v; without a critic: outcome (the return on every turn), grpo (the return "
                           "normalised within its task's group: (R - mean) / (sample std + group_eps)), rloo (the "
                           "return minus the mean of the other returns of its task), gigpo (grpo's advantage plus "
                           "gigpo_weight times the discounted return-to-go normalised among the turns of its task "
                           "that acted on the same observation)")
    gae_lambda: float = Field(0.95, ge=0.0, le=1.0, description="GAE lambda")
    gamma: float | None = Field(None, ge=0.0, le=1.0, description="discount (GAE, and gigpo's step returns); null = "
                                "the critic's iql.gamma, or 0.95 (the GiGPO paper's) when labelling without a critic")
    truncated_bootstrap: str | None = Field(
        None, description="V(s_T) after a truncated trajectory: zero or last_value; null = the critic's setting")
    q_source: Literal["online", "target"] = Field(
        "online", description="the Q written on every turn and used by q_minus_v: online = the minimum over the "
        "online Q heads (the method's Q - V, default), target = over the Polyak target heads Qbar")
    standardize: bool = Field(False, description="standardise the advantages over the whole buffer (mean 0, std 1, "
                              "each turn once; only centred when the std is below 1e-6)")
    batch_tokens: int | None = Field(None, ge=1, description="forward-pass batch size in tokens; null = the critic's")
    device: str | None = Field(None, description="device of the critic; null = the critic's config")

    @field_validator("estimator")
    @classmethod
    def _known_estimator(cls, value: str) -> str:
        if value not in advantage_estimators():
            raise ValueError(f"expected one of {advantage_estimators()}")
        return value

    @field_validator("truncated_bootstrap")
    @classmethod
    def _known_bootstrap(cls, value: str | None) -> str | None:
        if value not in (None, "zero", "last_value"):
            raise ValueError("expected zero, last_value or null")
        return value


def advantages_from_values(trajectories: list[TrajectoryValues], estimator: str, gamma: float, lam: float,
                           standardize_all: bool, groups: list[str] | None = None,
                           group_eps: float = 1e-6, options: Mapping[str, Any] | None = None) -> list[np.ndarray]:
    """The estimator's advantages (``groups``: a group id per trajectory, for the group estimators;
    ``options``: estimator settings by name, see ``estimate_advantages``), standardised over every turn
    when ``standardize_all``."""
    advantages = estimate_advantages(estimator, trajectories, groups, gamma, lam, group_eps, options)
    return standardize(advantages) if standardize_all else advantages


def _estimator_options(config: LabelConfig) -> dict[str, Any]:
    """The estimator settings of the label config (each estimator reads those it declared)."""
    return {"step_weight": config.gigpo_weight, "norm": config.gigpo_norm}


def _observations(episode: Episode) -> list[str]:
    """The anchor key of each turn for gigpo: the observation it acted on, as the environment gave it (the
    reference implementation's anchor is likewise the environment's current observation text, without the
    history the prompt adds)."""
    return [turn.observation for turn in episode.turns]


def _anchor_summary(episodes: list[Episode], trajectories: list[TrajectoryValues], gamma: float) -> dict[str, Any]:
    """gigpo's step groups: how many there are, their mean size, and the share of turns that share their
    observation with another turn of their task (the others get no step-level advantage)."""
    groups = anchor_groups(trajectories, [ep.task_id for ep in episodes])
    turns = sum(len(members) for members in groups.values())
    shared = sum(len(members) for members in groups.values() if len(members) > 1)
    return {"gamma": gamma, "step_groups": len(groups), "mean_step_group_size": turns / max(len(groups), 1),
            "turns_in_step_groups": shared / max(turns, 1)}


def _check_finite(episodes: list[Episode], advantages: list[np.ndarray], estimator: str) -> None:
    for episode, adv in zip(episodes, advantages):
        if not np.isfinite(adv).all():
            t = int(np.flatnonzero(~np.isfinite(adv))[0])
            raise NonFiniteError(f"label: non-finite advantage ({adv[t]}) for episode {episode.episode_id!r} "
                                 f"turn {t} (estimator {estimator})")


def _group_summary(episodes: list[Episode], trajectories: list[TrajectoryValues]) -> dict[str, Any]:
    """How many groups (tasks) the batch has, their mean size, and the share of groups without signal for
    a group estimator: one episode, or every return equal (each member's advantage is then 0)."""
    by_task: dict[str, list[float]] = {}
    for episode, traj in zip(episodes, trajectories):
        by_task.setdefault(episode.task_id, []).append(float(np.sum(traj.env_rewards)))
    silent = sum(len(returns) < 2 or max(returns) == min(returns) for returns in by_task.values())
    return {"groups": len(by_task), "mean_group_size": len(episodes) / max(len(by_task), 1),
            "groups_without_signal": silent / max(len(by_task), 1)}


def label_without_critic(episodes: list[Episode], config: LabelConfig) -> tuple[list[Episode], dict[str, Any]]:
    """Set ``advantage`` on every turn with an estimator that reads no value (outcome, grpo, rloo, gigpo); V,
    Q and r_aux stay empty. Failed episodes pass through unlabelled (as the policy update leaves them out)."""
    if estimator_needs_critic(config.estimator):
        raise ValueError(f"label: estimator {config.estimator!r} reads the critic's values; give a trained critic")
    all_episodes = episodes
    episodes = usable_episodes(episodes)
    if not episodes:
        raise ValueError("label: the buffer holds no episodes to label")
    trajectories = [TrajectoryValues(
        env_rewards=np.array([turn.reward for turn in ep.turns], dtype=np.float64),
        aux_rewards=np.zeros(ep.num_turns), values=np.zeros(ep.num_turns), q_values=np.zeros(ep.num_turns),
        dones=np.array([turn.done for turn in ep.turns], dtype=bool), observations=_observations(ep))
        for ep in episodes]
    gamma = GIGPO_GAMMA if config.gamma is None else config.gamma  # outcome, grpo and rloo ignore it
    advantages = advantages_from_values(trajectories, config.estimator, gamma, config.gae_lambda, config.standardize,
                                        groups=[ep.task_id for ep in episodes], group_eps=config.group_eps,
                                        options=_estimator_options(config))
    _check_finite(episodes, advantages, config.estimator)
    for episode, adv in zip(episodes, advantages):
        for t, turn in enumerate(episode.turns):
            turn.advantage = float(adv[t])
    flat = np.concatenate(advantages)
    won = np.array([ep.won for ep in episodes])

    def turn_mean(mask: np.ndarray) -> float:
        chosen = [a for a, keep in zip(advantages, mask) if keep]
        return float(np.concatenate(chosen).mean()) if chosen else float("nan")

    summary: dict[str, Any] = {
        "episodes": len(episodes), "episodes_won": int(won.sum()),
        "unlabelled_failed": len(all_episodes) - len(episodes), "turns": int(flat.size),
        "estimator": config.estimator, "standardized": config.standardize,
        "mean_return": float(np.mean([np.sum(t.env_rewards) for t in trajectories])),
        "advantage_mean": float(flat.mean()), "advantage_std": float(flat.std()),
        "advantage_mean_won": turn_mean(won), "advantage_mean_lost": turn_mean(~won),
        **_group_summary(episodes, trajectories)}
    if config.estimator == "gigpo":
        summary.update(_anchor_summary(episodes, trajectories, gamma))
    return all_episodes, summary


#: the estimators that read V and nothing else of a critic (no Q, no r_aux): those :func:`label_with_values` takes
VALUE_ONLY_ESTIMATORS = ("gae_env", "td1")


def label_with_values(episodes: list[Episode], config: LabelConfig, truncated_bootstrap: Literal[
        "zero", "last_value"] = "zero") -> tuple[list[Episode], dict[str, Any]]:
    """Set ``advantage`` on every turn from the V already written on it (``Turn.value``: the online PPO
    baseline's value stage writes the V that acted), with ``config.estimator`` (gae_env or td1, which read
    V alone; the estimators that read no value work too) at ``config.gamma`` (required) and ``gae_lambda``.

    After the last turn V(s_T) is 0 when it is done and, for a truncated trajectory, 0 (``zero``) or the
    last turn's own V (``last_value``). Failed episodes pass through unlabelled, as the policy update
    leaves them out."""
    if estimator_needs_critic(config.estimator) and config.estimator not in VALUE_ONLY_ESTIMATORS:
        raise ValueError(f"label: estimator {config.estimator!r} reads more of a critic than V; expected one of "
                         f"{VALUE_ONLY_ESTIMATORS} or an estimator without a critic")
    if config.gamma is None:
        raise ValueError("label: labelling with the turns' own values needs gamma (no critic gives one)")
    all_episodes = episodes
    episodes = usable_episodes(episodes)
    if not episodes:
        raise ValueError("label: the buffer holds no episodes to label")
    missing = [(ep.episode_id, t) for ep in episodes for t, turn in enumerate(ep.turns) if turn.value is None]
    if missing:
        raise ValueError(f"label: episode {missing[0][0]!r} turn {missing[0][1]} has no value (V(s_t)); "
                         "write the values first")
    trajectories = []
    for ep in episodes:
        values = np.array([turn.value for turn in ep.turns], dtype=np.float64)
        trajectories.append(TrajectoryValues(
            env_rewards=np.array([turn.reward for turn in ep.turns], dtype=np.float64),
            aux_rewards=np.zeros(ep.num_turns), values=values, q_values=np.zeros(ep.num_turns),
            dones=np.array([turn.done for turn in ep.turns], dtype=bool),
            bootstrap_value=float(values[-1]) if truncated_bootstrap == "last_value" else 0.0,
            observations=_observations(ep)))
    advantages = advantages_from_values(trajectories, config.estimator, config.gamma, config.gae_lambda,
                                        config.standardize, groups=[ep.task_id for ep in episodes],
                                        group_eps=config.group_eps, options=_estimator_options(config))
    _check_finite(episodes, advantages, config.estimator)
    for episode, adv in zip(episodes, advantages):
        for t, turn in enumerate(episode.turns):
            turn.advantage = float(adv[t])
    flat = np.concatenate(advantages)
    values = np.concatenate([traj.values for traj in trajectories])
    won = np.array([ep.won for ep in episodes])

    def turn_mean(arrays: list[np.ndarray], mask: np.ndarray) -> float:
        chosen = [a for a, keep in zip(arrays, mask) if keep]
        return float(np.concatenate(chosen).mean()) if chosen else float("nan")

    return all_episodes, {
        "episodes": len(episodes), "episodes_won": int(won.sum()),
        "unlabelled_failed": len(all_episodes) - len(episodes), "turns": int(flat.size),
        "estimator": config.estimator, "gamma": config.gamma, "lambda": config.gae_lambda,
        "standardized": config.standardize,
        "mean_return": float(np.mean([np.sum(t.env_rewards) for t in trajectories])),
        "v_mean": float(values.mean()),
        "v0_won": turn_mean([t.values[:1] for t in trajectories], won),
        "v0_lost": turn_mean([t.values[:1] for t in trajectories], ~won),
        "advantage_mean": float(flat.mean()), "advantage_std": float(flat.std()),
        "advantage_mean_won": turn_mean(advantages, won), "advantage_mean_lost": turn_mean(advantages, ~won)}


def label_episodes(episodes: list[Episode], critic, config: LabelConfig,
                   progress: bool = True) -> tuple[list[Episode], dict[str, Any]]:
    """Set ``r_aux``, ``value``, ``q_value`` and ``advantage`` on every turn (in place); return a summary.

    Episodes the critic leaves out (failed ones, unless its ``include_failed``) pass through
    unlabelled. A critic whose V or Q is NaN or infinite is refused (``NonFiniteError``).

    ``critic`` None: :func:`label_without_critic`, for the estimators that read no value (an estimator
    that needs one is refused). With a critic, those estimators' advantages ignore it, and V, Q and
    r_aux are still written for the diagnostics."""
    if critic is None:
        return label_without_critic(episodes, config)
    from qevolve.critic.train import critic_samples, predict_values

    all_episodes = episodes
    critic_config = critic.config
    episodes = usable_episodes(episodes, critic_config.include_failed)
    if not episodes:
        raise ValueError("label: the buffer holds no episodes the critic can label")
    gamma = critic_config.iql.gamma if config.gamma is None else config.gamma
    bootstrap = config.truncated_bootstrap or critic_config.iql.truncated_bootstrap
    samples = critic_samples(episodes, critic_config)
    predictions = predict_values(critic, samples, progress=progress, batch_tokens=config.batch_tokens,
                                 q_source=config.q_source)

    trajectories = []
    for episode, sample, (values, q_values) in zip(episodes, samples, predictions):
        trajectories.append(TrajectoryValues(
            env_rewards=sample.env_rewards.double().numpy(),
            aux_rewards=sample.aux_rewards.double().numpy(),
            values=values, q_values=q_values,
            dones=sample.dones.numpy(),
            bootstrap_value=float(values[-1]) if bootstrap == "last_value" else 0.0,
            observations=_observations(episode),
        ))
    advantages = advantages_from_values(trajectories, config.estimator, gamma, config.gae_lambda, config.standardize,
                                        groups=[ep.task_id for ep in episodes], group_eps=config.group_eps,
                                        options=_estimator_options(config))
    _check_finite(episodes, advantages, config.estimator)

    for episode, traj, adv in zip(episodes, trajectories, advantages):
        for t, turn in enumerate(episode.turns):
            turn.r_aux = float(traj.aux_rewards[t])
            turn.value = float(traj.values[t])
            turn.q_value = float(traj.q_values[t])
            turn.advantage = float(adv[t])

    flat_adv = np.concatenate(advantages)
    first_values = np.array([traj.values[0] for traj in trajectories])
    values = [np.asarray(t.values) for t in trajectories]
    # Two ways to split the episodes: won/lost is the environment's success (Episode.won: on WebShop a
    # reward of 1); scored/unscored is the critic's d (the final score is > 0: a WebShop purchase of the
    # wrong size scores, and is lost).
    outcomes = {"won": np.array([s.won for s in samples]), "scored": np.array([s.scored for s in samples])}
    names = {"won": ("won", "lost"), "scored": ("scored", "unscored")}

    def turn_mean(arrays: list[np.ndarray], mask: np.ndarray) -> float:
        chosen = [a for a, keep in zip(arrays, mask) if keep]
        return float(np.concatenate(chosen).mean()) if chosen else float("nan")

    summary: dict[str, Any] = {
        "episodes": len(episodes),
        "episodes_won": int(outcomes["won"].sum()),
        "episodes_scored": int(outcomes["scored"].sum()),
        "unlabelled_failed": len(all_episodes) - len(episodes),
        "turns": int(flat_adv.size),
        "estimator": config.estimator,
        "q_source": config.q_source,
        "value_source": critic_config.label_value,
        "gamma": gamma,
        "lambda": config.gae_lambda,
        "standardized": config.standardize,
        "advantage_mean": float(flat_adv.mean()),
        "advantage_std": float(flat_adv.std()),
    }
    for split, mask in outcomes.items():
        yes, no = names[split]
        for name, keep in ((yes, mask), (no, ~mask)):
            summary[f"v0_{name}"] = float(first_values[keep].mean()) if keep.any() else float("nan")
        for name, keep in ((yes, mask), (no, ~mask)):  # over all turns of the episodes
            summary[f"v_mean_{name}"] = turn_mean(values, keep)
        for name, keep in ((yes, mask), (no, ~mask)):
            summary[f"advantage_mean_{name}"] = turn_mean(advantages, keep)
    summary["r_aux_nonzero"] = float(np.mean(np.concatenate([t.aux_rewards for t in trajectories]) != 0))
    summary.update(_penalised_summary(trajectories, advantages))
    if config.estimator == "gigpo":
        summary.update(_anchor_summary(episodes, trajectories, gamma))
    return all_episodes, summary


def _penalised_summary(trajectories: list[TrajectoryValues], advantages: list[np.ndarray]) -> dict[str, Any]:
    """The advantages of the turns the retrospective penalties mark (r_aux < 0) against the others'.

    With GAE on r_env alone and V fitted to r_env + r_aux, a penalised turn's TD error is
    ``Q(s_t, a_t) - V(s_t) - r_aux_t``: the penalty comes back out. Where the buffer holds one action per
    state (V close to Q), that leaves ``-r_aux_t > 0``, so the marked turns can end up the buffer's best
    (docs/critic.md); a higher mean here than the others' is the sign of it."""
    penalised = np.concatenate([t.aux_rewards < 0 for t in trajectories])
    flat = np.concatenate(advantages)
    summary: dict[str, Any] = {"penalised_turns": int(penalised.sum())}
    if penalised.any():
        summary["advantage_mean_penalised"] = float(flat[penalised].mean())
    if (~penalised).any():
        summary["advantage_mean_unpenalised"] = float(flat[~penalised].mean())
    return summary
