"""Retrospective reward labelling (method section 3): ``r_aux`` from the observation that followed.

A rule looks only at what the agent could see: whether its turn parsed (``Turn.format_valid``),
whether the environment accepted the action (``Turn.action_valid``, e.g. ALFWorld's "Nothing
happens."), and whether the next observation ``o_{t+1}`` repeats ``o_t``. The cases are exclusive
and checked from the most to the least severe, so a turn gets at most one penalty:

    format error  >  invalid action  >  repeated observation  >  otherwise 0

``r_aux`` shapes the critic's reward (``r_env + r_aux``) but, by default, not the policy's
advantage (section 5).
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from qevolve.buffer.store import Episode
from qevolve.config import StageConfig

__all__ = ["AuxPenalties", "RetrospectiveConfig", "aux_rewards", "label_retrospective", "penalties_for"]


class AuxPenalties(StageConfig):
    """The penalties of one environment (the paper's table in method.md section 3)."""

    format_error: float = Field(-0.3, description="r_aux when the turn did not parse into an action")
    invalid_action: float = Field(-0.2, description="r_aux when the environment rejected the action")
    repeat: float = Field(-0.1, description="r_aux when the next observation equals the current one")


class RetrospectiveConfig(StageConfig):
    enabled: bool = Field(True, description="false: r_aux = 0 on every turn (the 'without RR' ablation)")
    penalties: dict[str, AuxPenalties] = Field(
        default_factory=dict,
        description="overrides of the penalties, keyed by Episode.env (the environment's name, e.g. webshop); an "
        "environment without an entry uses those its class declares (Environment.retrospective_penalties). An "
        "entry equal to the class's declaration overrides nothing and is left out")

    @field_validator("penalties", mode="before")
    @classmethod
    def _over_declared(cls, penalties: Any) -> Any:
        # An entry overrides the keys it gives: `penalties.webshop.format_error=-0.5` keeps WebShop's own 0/0
        # for the other two, not AuxPenalties' field defaults (which are ALFWorld's numbers).
        if not isinstance(penalties, dict):
            return penalties
        merged = {}
        for env, entry in penalties.items():
            declared = _declaration_if_loadable(env) if isinstance(entry, dict) else None
            merged[env] = {**declared.model_dump(), **entry} if declared is not None else entry
        return merged

    @field_validator("penalties")
    @classmethod
    def _without_declared(cls, penalties: dict[str, AuxPenalties]) -> dict[str, AuxPenalties]:
        # Until the environments declared their penalties, the built-in ones' were this field's default, so
        # every run of that time recorded them in its manifest. Leaving out the entries that repeat a
        # declaration makes such a config equal to today's default: the run resumes, with the same labels.
        return {env: entry for env, entry in penalties.items() if _declaration_if_loadable(env) != entry}


def penalties_for(env: str, config: RetrospectiveConfig) -> AuxPenalties:
    """The penalties of environment ``env``: the config's entry for it, else those its class declares
    (``Environment.retrospective_penalties``); neither is a one-line error."""
    if env in config.penalties:
        return config.penalties[env]
    declared = _declared_penalties(env)
    if declared is None:
        have = f" (have {sorted(config.penalties)})" if config.penalties else ""
        raise ValueError(f"critic.retrospective.penalties: no entry for environment {env!r}{have} and its class "
                         "declares no retrospective_penalties; add one")
    return declared


def _declaration_if_loadable(env: str) -> AuxPenalties | None:
    """What ``env``'s class declares, None also when it cannot be loaded here or declares something
    invalid (then the config's entry stays: it is what the labels use either way)."""
    try:
        return _declared_penalties(env)
    except Exception:  # noqa: BLE001 - any failure of the environment's import keeps the config's entry
        return None


_DECLARED: dict[str, AuxPenalties | None] = {}


def _declared_penalties(env: str) -> AuxPenalties | None:
    # Looked up once per environment name: labelling asks for every episode.
    if env not in _DECLARED:
        from pydantic import ValidationError

        from qevolve.environments.base import get_factory

        try:
            declared = getattr(get_factory(env), "retrospective_penalties", None)
        except KeyError:  # an environment this process cannot import has declared nothing it can see
            return None  # not remembered: it may be importable later (its folder put on sys.path)
        if declared is not None and not isinstance(declared, AuxPenalties):
            try:
                declared = AuxPenalties.model_validate(dict(declared))
            except (TypeError, ValueError, ValidationError) as err:
                first = err.errors()[0] if isinstance(err, ValidationError) else {"loc": (), "msg": str(err)}
                where = ".".join(str(part) for part in first["loc"])
                raise ValueError(f"environment {env!r}: retrospective_penalties{'.' + where if where else ''}: "
                                 f"{first['msg']}; expected a dict of format_error, invalid_action and repeat "
                                 "(numbers)") from None
        _DECLARED[env] = declared
    return _DECLARED[env]


def aux_rewards(episode: Episode, config: RetrospectiveConfig) -> list[float]:
    """``r_aux`` of every turn of ``episode``: one rule on (turn flags, o_t, o_{t+1})."""
    if not config.enabled:
        return [0.0] * episode.num_turns
    penalties = penalties_for(episode.env, config)
    labels = []
    for t, turn in enumerate(episode.turns):
        if not turn.format_valid:
            labels.append(penalties.format_error)
        elif not turn.action_valid:
            labels.append(penalties.invalid_action)
        elif episode.next_observation(t).strip() == turn.observation.strip():  # o_{t+1} == o_t
            labels.append(penalties.repeat)
        else:
            labels.append(0.0)
    return labels


def label_retrospective(episodes: list[Episode], config: RetrospectiveConfig) -> list[Episode]:
    """Set ``Turn.r_aux`` on every turn (in place) and return the episodes."""
    for episode in episodes:
        for turn, r_aux in zip(episode.turns, aux_rewards(episode, config)):
            turn.r_aux = float(r_aux)
    return episodes
