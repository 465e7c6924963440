"""Weighted implicit Q-learning losses (method section 4).

    L_V = E_D[ w_t * L2_m( Qbar(s_t, a_t) - V(s_t) ) ]             L2_m(x) = |m - 1(x < 0)| * x^2
    L_Q = E_D[ w_t * ( r_env + r_aux + gamma * V(s_{t+1}) * (1 - done_t) - Q(s_t, a_t) )^2 ]

Only actions in the buffer are evaluated (no max over unseen actions), which keeps the critic
in-distribution. The expectations are plain means over the batch's transitions.
"""

from __future__ import annotations

import torch

from qevolve.critic.data import CriticSample

__all__ = ["expectile_loss", "next_state_values", "iql_losses"]


def expectile_loss(diff: torch.Tensor, expectile: float) -> torch.Tensor:
    """L2_m(x) = |m - 1(x < 0)| * x^2, elementwise; x = Qbar - V, so V is pushed towards the m-expectile."""
    weight = torch.abs(expectile - (diff < 0).to(diff.dtype))
    return weight * diff ** 2


def next_state_values(values: torch.Tensor, samples: list[CriticSample], truncated_bootstrap: str) -> torch.Tensor:
    """V(s_{t+1}) * (1 - done_t) for the concatenated turns of ``samples`` (detached).

    Inside a trajectory V(s_{t+1}) is the V of turn t+1 (same forward pass). After the last turn it
    is 0 when the turn is done; when the trajectory was truncated it is 0 (``zero``) or the last
    turn's own V(s_{T-1}) (``last_value``).
    """
    values = values.detach()
    next_values = torch.zeros_like(values)
    offset = 0
    for sample in samples:
        end = offset + sample.num_turns
        next_values[offset:end - 1] = values[offset + 1:end]
        if truncated_bootstrap == "last_value":
            next_values[end - 1] = values[end - 1]
        elif truncated_bootstrap != "zero":
            raise ValueError(f"truncated_bootstrap {truncated_bootstrap!r}: expected zero or last_value")
        offset = end
    dones = torch.cat([s.dones for s in samples]).to(values.device)
    return next_values * (~dones).to(values.dtype)


def iql_losses(values: torch.Tensor, q_values: torch.Tensor, target_q: torch.Tensor, samples: list[CriticSample],
               expectile: float, gamma: float, truncated_bootstrap: str) -> dict[str, torch.Tensor]:
    """Both weighted IQL losses for a batch of whole trajectories.

    ``values`` [N] = V(s_t), ``q_values`` [heads, N] = each Q head, ``target_q`` [N] = Qbar (no grad),
    turns of ``samples`` concatenated in order. Returns ``loss_v``, ``loss_q`` (summed over Q heads,
    each head fitting the same target) and ``loss`` = their sum.
    """
    device = values.device
    weights = torch.cat([s.weights for s in samples]).to(device)
    rewards = torch.cat([s.rewards for s in samples]).to(device)
    loss_v = (weights * expectile_loss(target_q.detach() - values, expectile)).mean()
    td_target = rewards + gamma * next_state_values(values, samples, truncated_bootstrap)
    loss_q = (weights * (td_target.unsqueeze(0) - q_values) ** 2).mean(dim=1).sum()
    return {"loss_v": loss_v, "loss_q": loss_q, "loss": loss_v + loss_q}
