"""Policy losses (method section 6), registered by name: ``bppo`` (default) and ``awr`` (ablation).

Every loss is a pure tensor function of per-token arrays of one batch, all shaped like the token
batch (e.g. ``[batch, seq]``):

- ``logprobs``      log pi_theta(token) under the policy being trained (with gradient)
- ``old_logprobs``  log pi_old(token), the policy that started this phase (no gradient)
- ``ref_logprobs``  log pi_ref(token), the behaviour-cloned reference (no gradient; optional when
                    the KL weight is 0)
- ``advantages``    the advantage of the token's turn, repeated on every token of the turn
- ``mask``          1 on action tokens, 0 on prompt, observation and padding tokens

Each returns an :class:`ObjectiveOutput`: the scalar loss to minimise (averaged over the action
tokens of the whole batch) and detached statistics for logging.

KL estimator: the KL penalty KL(pi_theta || pi_ref) is estimated per action token with Schulman's
"k3" estimator ``exp(log_ref - log_theta) - 1 - (log_ref - log_theta)`` (non-negative, low variance;
unbiased for tokens sampled from pi_theta, an approximation for the buffer's tokens). ``k1``
(``log_theta - log_ref``) and ``k2`` (``0.5 (log_theta - log_ref)^2``) are available.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Literal

import torch
from pydantic import Field, model_validator

from qevolve.config import StageConfig

__all__ = ["ObjectiveConfig", "ObjectiveOutput", "register_objective", "get_objective", "objective_names",
           "compute_objective", "bppo_loss", "awr_loss", "kl_penalty", "masked_mean",
           "gather_token_logprobs"]


class ObjectiveConfig(StageConfig):
    """The policy loss and its hyper-parameters."""

    name: str = Field("bppo", description="registered policy loss: bppo (clipped, behaviour-proximal) or awr (DPO, "
                      "the ETO baseline, has a config and a command of its own: qevolve dpo)")
    eps_low: float = Field(0.8, ge=0.0, le=1.0,
                           description="BPPO lower clip: the ratio may fall to 1 - eps_low on negative advantages "
                                       "(unverified default from one write-up of the paper)")
    eps_high: float = Field(0.4, ge=0.0,
                            description="BPPO upper clip: the ratio may rise to 1 + eps_high on positive advantages")
    kl_coef: float = Field(0.02, ge=0.0, description="alpha, the weight of KL(pi_theta || pi_ref) (paper range 0.01-0.05)")
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k3", description="per-token KL estimator (see module docs)")
    awr_beta: float = Field(1.0, gt=0.0, description="AWR temperature: weight = exp(beta * A)")
    awr_max_weight: float = Field(20.0, gt=0.0, description="AWR clamp on exp(beta * A)")

    @model_validator(mode="before")
    @classmethod
    def _dpo_has_its_own_config(cls, data: Any) -> Any:
        # DPO was once an objective here, with objective.dpo_* settings that every policy config recorded
        # (manifests, checkpoints): at their defaults beside another objective they never acted and are dropped.
        if not isinstance(data, dict):
            return data
        if data.get("name") == "dpo":
            raise ValueError("name 'dpo': DPO has a config and a command of its own: `qevolve dpo --buffer B "
                             "--init C` (configs/dpo.yaml), or the eto baseline of qevolve evolve; expected one of "
                             f"{objective_names()}")
        data = dict(data)
        for key, default in _OLD_DPO_DEFAULTS.items():
            if key in data:
                value = data.pop(key)
                if value != default:
                    raise ValueError(f"{key}={value!r}: a DPO setting, which the {data.get('name', 'bppo')} "
                                     "objective never used; remove it (DPO has its own command: qevolve dpo)")
        return data

    @model_validator(mode="after")
    def _known_name(self) -> "ObjectiveConfig":
        if self.name not in _OBJECTIVES:
            raise ValueError(f"name {self.name!r}: expected one of {objective_names()}")
        return self


#: the DPO settings that objective configs recorded while DPO was one of them, with their defaults
_OLD_DPO_DEFAULTS = {"dpo_beta": 0.1, "dpo_sft_coef": 0.0, "dpo_min_score_gap": 1e-6, "dpo_max_pairs_per_task": None}


@dataclass
class ObjectiveOutput:
    loss: torch.Tensor  # scalar, to minimise
    stats: dict[str, float] = field(default_factory=dict)


Objective = Callable[..., ObjectiveOutput]
_OBJECTIVES: dict[str, Objective] = {}


def register_objective(name: str) -> Callable[[Objective], Objective]:
    """Register ``fn(config, logprobs, old_logprobs, ref_logprobs, advantages, mask) -> ObjectiveOutput``."""

    def decorate(fn: Objective) -> Objective:
        _OBJECTIVES[name] = fn
        return fn

    return decorate


def objective_names() -> list[str]:
    return sorted(_OBJECTIVES)


def get_objective(name: str) -> Objective:
    if name not in _OBJECTIVES:
        raise ValueError(f"policy objective {name!r}: expected one of {sorted(_OBJECTIVES)}")
    return _OBJECTIVES[name]


def compute_objective(config: ObjectiveConfig, logprobs: torch.Tensor, old_logprobs: torch.Tensor,
                      ref_logprobs: torch.Tensor | None, advantages: torch.Tensor,
                      mask: torch.Tensor) -> ObjectiveOutput:
    """Evaluate the loss named by ``config.name``."""
    return get_objective(config.name)(config, logprobs, old_logprobs, ref_logprobs, advantages, mask)


# --------------------------------------------------------------------------------------------- helpers


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` over the tokens where ``mask`` is set (0 when no token is)."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


def gather_token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """log p(input_ids[:, i] | input_ids[:, :i]) for i >= 1, from a causal LM's ``logits``.

    Returns ``[batch, seq]`` with position 0 set to 0 (no token predicts it), so it lines up with
    ``input_ids`` and with an action mask over the same positions.
    """
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    picked = logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return torch.cat([torch.zeros_like(picked[:, :1]), picked], dim=1)


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref) from the log-probabilities of the buffer's tokens."""
    log_ratio = ref_logprobs - logprobs  # log pi_ref / pi_theta
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio ** 2
    if estimator == "k3":
        return torch.exp(log_ratio) - 1.0 - log_ratio
    raise ValueError(f"kl_estimator {estimator!r}: expected k1, k2 or k3")


def _check_shapes(logprobs: torch.Tensor, mask: torch.Tensor, **others: torch.Tensor | None) -> None:
    for name, tensor in others.items():
        if tensor is not None and tensor.shape != logprobs.shape:
            raise ValueError(f"{name}: shape {tuple(tensor.shape)} differs from logprobs {tuple(logprobs.shape)}")
    if mask.shape != logprobs.shape:
        raise ValueError(f"mask: shape {tuple(mask.shape)} differs from logprobs {tuple(logprobs.shape)}")


def _kl_to_ref(config: ObjectiveConfig, logprobs: torch.Tensor, ref_logprobs: torch.Tensor | None,
               mask: torch.Tensor) -> torch.Tensor:
    if ref_logprobs is None:
        if config.kl_coef > 0:
            raise ValueError("ref_logprobs is None but kl_coef > 0: pass the reference policy's log-probabilities")
        return torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    return masked_mean(kl_penalty(logprobs, ref_logprobs, config.kl_estimator), mask)


# --------------------------------------------------------------------------------------------- losses


@register_objective("bppo")
def bppo_loss(config: ObjectiveConfig, logprobs: torch.Tensor, old_logprobs: torch.Tensor,
              ref_logprobs: torch.Tensor | None, advantages: torch.Tensor, mask: torch.Tensor) -> ObjectiveOutput:
    """Behaviour-proximal PPO with asymmetric clipping and a KL penalty to the reference policy.

    eta_t = pi_theta(a_t|s_t) / pi_old(a_t|s_t)                                         (per token)
    J     = E[ min(eta_t A_t, clip(eta_t, 1 - eps_low, 1 + eps_high) A_t) ] - alpha KL(pi_theta || pi_ref)
    loss  = -J, both expectations averaged over the action tokens of the batch
    """
    _check_shapes(logprobs, mask, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs, advantages=advantages)
    mask = mask.to(logprobs.dtype)
    advantages = advantages.to(logprobs.dtype)
    log_ratio = logprobs - old_logprobs.detach()
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1.0 - config.eps_low, 1.0 + config.eps_high)
    surrogate = torch.minimum(ratio * advantages, clipped * advantages)
    policy_term = masked_mean(surrogate, mask)
    kl_ref = _kl_to_ref(config, logprobs, None if ref_logprobs is None else ref_logprobs.detach(), mask)
    loss = -policy_term + config.kl_coef * kl_ref

    with torch.no_grad():
        on = mask > 0
        # A token's gradient is clipped away when the ratio left the trust region on its advantage's side.
        clipped_low = on & (advantages < 0) & (ratio < 1.0 - config.eps_low)
        clipped_high = on & (advantages > 0) & (ratio > 1.0 + config.eps_high)
        ratios = ratio[on]
        stats = {
            "loss": float(loss.detach()),
            "policy_objective": float(policy_term.detach()),
            "approx_kl_old": float(masked_mean((ratio - 1.0) - log_ratio, mask)),  # k3 of KL(pi_old || pi_theta)
            "kl_ref": float(kl_ref.detach()),
            "clip_frac_low": float(masked_mean(clipped_low.to(mask.dtype), mask)),
            "clip_frac_high": float(masked_mean(clipped_high.to(mask.dtype), mask)),
            "ratio_mean": float(ratios.mean()) if ratios.numel() else 1.0,
            "ratio_min": float(ratios.min()) if ratios.numel() else 1.0,
            "ratio_max": float(ratios.max()) if ratios.numel() else 1.0,
            "action_tokens": float(mask.sum()),
        }
    return ObjectiveOutput(loss, stats)


@register_objective("awr")
def awr_loss(config: ObjectiveConfig, logprobs: torch.Tensor, old_logprobs: torch.Tensor,
             ref_logprobs: torch.Tensor | None, advantages: torch.Tensor, mask: torch.Tensor) -> ObjectiveOutput:
    """Advantage-weighted regression: loss = E[ -min(exp(beta A_t), w_max) log pi_theta(a_t|s_t) ] (+ alpha KL).

    The weight is never negative, so AWR can only imitate good actions more, never push bad ones
    down: the paper's explanation of its ablation result. ``old_logprobs`` only feed the statistics.
    """
    _check_shapes(logprobs, mask, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs, advantages=advantages)
    mask = mask.to(logprobs.dtype)
    raw_weights = torch.exp(config.awr_beta * advantages.to(logprobs.dtype).detach())
    weights = torch.clamp(raw_weights, max=config.awr_max_weight)
    weighted_nll = masked_mean(-weights * logprobs, mask)
    kl_ref = _kl_to_ref(config, logprobs, None if ref_logprobs is None else ref_logprobs.detach(), mask)
    loss = weighted_nll + config.kl_coef * kl_ref
    with torch.no_grad():
        on = mask > 0
        log_ratio = logprobs - old_logprobs
        stats = {
            "loss": float(loss.detach()),
            "weighted_nll": float(weighted_nll.detach()),
            "weight_mean": float(weights[on].mean()) if on.any() else 0.0,
            "weight_max": float(weights[on].max()) if on.any() else 0.0,
            "weight_clamp_frac": float(masked_mean((raw_weights > config.awr_max_weight).to(mask.dtype), mask)),
            "approx_kl_old": float(masked_mean(torch.exp(log_ratio) - 1.0 - log_ratio, mask)),
            "kl_ref": float(kl_ref.detach()),
            "action_tokens": float(mask.sum()),
        }
    return ObjectiveOutput(loss, stats)
