"""Advantage estimators: observation-skip GAE (SAO), plain GAE, GRPO group advantages.

All tensors are ``(B, T)`` over the whole token sequence (prompt, actions, observations,
padding) unless stated otherwise. Sources are cited per function; see PAPERS.md.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

import numpy as np
import torch
import torch.nn.functional as F


def carry_rewards_to_actions(rewards: torch.Tensor, action_mask: torch.Tensor) -> torch.Tensor:
    """Move every reward onto the closest action token at or before its position.

    A reward on an action token stays where it is; a reward on an observation (or
    padding) position is added to the nearest preceding action token; rewards before
    the first action token of a row are dropped.

    Args:
        rewards: ``(B, T)`` float.
        action_mask: ``(B, T)`` bool, true on tokens the policy generated.

    Returns:
        ``(B, T)`` rewards, zero on every non-action position.
    """
    batch, length = rewards.shape
    positions = torch.arange(length, device=rewards.device).expand(batch, length)
    # index of the last action token at or before each position (-1 when there is none)
    last_action = torch.where(action_mask, positions, torch.full_like(positions, -1)).cummax(dim=1).values
    has_owner = last_action >= 0
    carried = torch.zeros_like(rewards)
    carried.scatter_add_(
        1, last_action.clamp(min=0), torch.where(has_owner, rewards, torch.zeros_like(rewards))
    )
    return carried


def _as_row_tensor(value: float | torch.Tensor, like: torch.Tensor, name: str) -> torch.Tensor:
    """``value`` as a ``(B,)`` tensor on ``like``'s device and dtype."""
    batch = like.shape[0]
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            return value.to(like).expand(batch)
        if value.shape != (batch,):
            raise ValueError(
                f"{name} must be a float or a (B,) tensor with B={batch}, got shape {tuple(value.shape)}"
            )
        return value.to(like)
    return torch.full((batch,), float(value), dtype=like.dtype, device=like.device)


def _check_shapes(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> None:
    if rewards.dim() != 2 or rewards.shape != values.shape or rewards.shape != mask.shape:
        raise ValueError(
            "rewards, values and mask must all be (B, T); got "
            f"{tuple(rewards.shape)}, {tuple(values.shape)}, {tuple(mask.shape)}"
        )
    if mask.dtype != torch.bool:
        raise ValueError(f"mask must be a bool tensor, got {mask.dtype}")


@torch.no_grad()
def skip_observation_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    action_mask: torch.Tensor,
    gamma: float,
    lam: float | torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-level GAE over action tokens only, linking actions across observations (SAO).

    Inside a run of consecutive action tokens this is ordinary GAE. From the last token
    of action ``i`` to the first token of action ``i+1`` it links directly, skipping the
    observation tokens between them (SAO, PAPERS.md "Observation-skip GAE")::

        δ(a_i,N)  = r + γ·V(a_{i+1},0) − V(a_i,N)
        A(a_i,N)  = δ(a_i,N) + γλ·A(a_{i+1},0)

    A reward on a non-action position is first carried to the closest preceding action
    token (:func:`carry_rewards_to_actions`). After the last action token the next value
    is 0. Observation tokens leave the chain untouched, so the scan runs backwards over each
    row's action tokens alone, gathered to the front of the row (as many steps as the
    longest row has action tokens, not ``T``), vectorized across the batch.

    Args:
        rewards: ``(B, T)`` float, per-token rewards (typically the final reward on the
            last token).
        values: ``(B, T)`` float, the critic's value of each token's state.
        action_mask: ``(B, T)`` bool, true on action tokens; padding is false.
        gamma: discount γ.
        lam: GAE λ, a float or a ``(B,)`` tensor (length-adaptive λ, see
            :func:`adaptive_lambda`).

    Returns:
        ``(advantages, returns)``, both ``(B, T)`` in the values' dtype, zero on non-action
        tokens; ``returns = advantages + values`` on action tokens.
    """
    _check_shapes(rewards, values, action_mask)
    dtype = values.dtype
    # bfloat16 (which numpy lacks) is worked on in float32 and only the results rounded:
    # rounded to bfloat16, λ = 0.999 reads 1.0 and each δ is off by up to 0.016 at values
    # near 5, errors a long chain adds up
    values = values.detach().to(torch.float32 if dtype == torch.bfloat16 else dtype)
    lam_rows = _as_row_tensor(lam, values, "lam")
    carried = carry_rewards_to_actions(rewards.to(values.dtype), action_mask)
    counts = action_mask.sum(dim=1)
    width = int(counts.max()) if counts.numel() else 0
    # each row's action positions in order, then its other positions (a stable sort)
    order = torch.argsort((~action_mask).to(torch.uint8), dim=1, stable=True)[:, :width]
    is_action = torch.arange(width, device=values.device) < counts[:, None]
    action_values = values.gather(1, order)
    action_rewards = carried.gather(1, order)
    # a row's slots past its last action token hold 0, so its chain starts from 0 there
    next_values = F.pad(torch.where(is_action, action_values, 0.0)[:, 1:], (0, 1))
    deltas = action_rewards + gamma * next_values - action_values
    compact = _discounted_sums(deltas, gamma * lam_rows, is_action)
    advantages = torch.zeros_like(values).scatter_(1, order, compact)
    returns = torch.where(action_mask, advantages + values, torch.zeros_like(values))
    return advantages.to(dtype), returns.to(dtype)


def _discounted_sums(deltas: torch.Tensor, discounts: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """``A_j = δ_j + c·A_{j+1}`` along each row from its end (``A`` 0 past the end and where
    ``live`` is false), for ``deltas`` and ``live`` ``(B, W)`` and ``discounts`` ``(B,)``.

    The chain is sequential in ``j``, so it runs one step per column: in numpy on the host,
    where a step costs about a microsecond, instead of several torch operations (a kernel
    launch each on a GPU). Each step rounds as the same torch operations would, so the sums
    are bit for bit theirs, in the deltas' dtype (one numpy has: not bfloat16).
    """
    delta = deltas.detach().cpu().T.contiguous().numpy()
    on = live.cpu().T.contiguous().numpy()
    discount = discounts.detach().to("cpu", deltas.dtype).numpy()
    out = np.zeros_like(delta)
    running = np.zeros_like(discount)
    for j in range(len(delta) - 1, -1, -1):
        running = np.where(on[j], delta[j] + discount * running, 0)
        out[j] = running
    return torch.from_numpy(out.T).to(deltas.device, deltas.dtype)


@torch.no_grad()
def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float | torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain GAE (Schulman et al. 2016, eq. 11–16) over the masked tokens, for comparison.

    Every masked position is one step of the chain and links to the very next position
    ``t+1``; an unmasked position ends the episode (its value counts as 0), so with
    ``mask = attention_mask`` observation tokens take part in the chain, unlike
    :func:`skip_observation_gae`. Rewards on unmasked positions are ignored::

        δ_t = r_t + γ·V_{t+1}·m_{t+1} − V_t
        A_t = δ_t + γλ·m_{t+1}·A_{t+1}

    Args:
        rewards: ``(B, T)`` float.
        values: ``(B, T)`` float.
        mask: ``(B, T)`` bool, the tokens that take part.
        gamma: discount γ.
        lam: GAE λ, a float or a ``(B,)`` tensor.

    Returns:
        ``(advantages, returns)``, both ``(B, T)`` in the values' dtype, zero where ``mask`` is
        false.
    """
    _check_shapes(rewards, values, mask)
    dtype = values.dtype
    # bfloat16 is worked on in float32 and only the results rounded, as in skip_observation_gae
    values = values.detach().to(torch.float32 if dtype == torch.bfloat16 else dtype)
    lam_rows = _as_row_tensor(lam, values, "lam")
    rewards = rewards.to(values.dtype)
    batch, length = values.shape
    advantages = torch.zeros_like(values)
    next_value = torch.zeros(batch, dtype=values.dtype, device=values.device)
    next_advantage = torch.zeros_like(next_value)
    for t in reversed(range(length)):
        is_step = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage_t = torch.where(is_step, delta + gamma * lam_rows * next_advantage, torch.zeros_like(delta))
        advantages[:, t] = advantage_t
        next_value = torch.where(is_step, values[:, t], torch.zeros_like(next_value))
        next_advantage = advantage_t
    returns = torch.where(mask, advantages + values, torch.zeros_like(values))
    return advantages.to(dtype), returns.to(dtype)


def _as_keys(ids: Sequence[Hashable] | torch.Tensor) -> list[Hashable]:
    """``ids`` as a list of hashable values: a tensor's elements hash by identity, so read one by
    one every row of a tensor would be a key of its own."""
    return ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)


def group_advantages(
    rewards: torch.Tensor,
    group_ids: Sequence[Hashable] | torch.Tensor,
    normalize_std: bool = False,
    eps: float = 1e-6,
    execution_ids: Sequence[Hashable] | torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """GRPO advantages (Shao et al. 2024, DeepSeekMath §4.1.2): reward minus its group's mean.

    ``A_i = (R_i − mean_{g(i)} R) / (std_{g(i)} R + eps)`` when ``normalize_std``, else
    ``A_i = R_i − mean_{g(i)} R``. The members of a group are its executions (rollouts), not
    its rows: a branching execution holds several rows (one per trained leaf), and counted
    row by row it would weigh in its group's mean and std as often as it branched. So each
    execution has weight 1 in its group, split into its rows' shares ``w_i`` in proportion to
    ``weights`` (equally where they are None or sum to 0 over the execution): ``mean_g = Σ w_i·R_i / n_g``
    and ``std_g² = Σ w_i·(R_i − mean_g)² / (n_g − 1)`` over the group's rows, ``n_g`` its
    executions; with one row per execution these are the plain mean and unbiased sample std.
    A group of one execution, or whose rewards are all equal, has advantage 0.

    Args:
        rewards: ``(N,)`` float, one reward per row (trajectory).
        group_ids: ``N`` hashable group ids (or an ``(N,)`` integer tensor).
        normalize_std: divide by the group's std.
        eps: added to the std.
        execution_ids: ``N`` hashable execution ids (or an ``(N,)`` integer tensor); None: every
            row is an execution.
        weights: ``(N,)`` float ≥ 0, each row's share of its execution (e.g. its total loss
            weight); None: equal shares.

    Returns:
        ``(N,)`` advantages.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be (N,), got shape {tuple(rewards.shape)}")
    keys = _as_keys(group_ids)
    if len(keys) != rewards.shape[0]:
        raise ValueError(f"got {len(keys)} group ids for {rewards.shape[0]} rewards")
    executions = range(len(keys)) if execution_ids is None else _as_keys(execution_ids)
    if len(executions) != len(keys):
        raise ValueError(f"got {len(executions)} execution ids for {len(keys)} rewards")
    if weights is not None and weights.shape != rewards.shape:
        raise ValueError(f"weights must be (N,) like rewards, got shape {tuple(weights.shape)}")
    device = rewards.device
    group_of: dict[Hashable, int] = {}
    group = torch.tensor(
        [group_of.setdefault(key, len(group_of)) for key in keys], dtype=torch.long, device=device
    )
    execution_of: dict[tuple[Hashable, Hashable], int] = {}
    execution = torch.tensor(
        [execution_of.setdefault(pair, len(execution_of)) for pair in zip(keys, executions, strict=True)],
        dtype=torch.long,
        device=device,
    )
    rewards = rewards.float()
    num_executions, num_groups = len(execution_of), len(group_of)
    raw = torch.ones_like(rewards) if weights is None else weights.to(rewards)
    totals = torch.zeros(num_executions, device=device).index_add_(0, execution, raw)
    raw = torch.where(totals[execution] > 0, raw, 1.0)  # an execution of weight 0 shares equally
    share = raw / torch.zeros(num_executions, device=device).index_add_(0, execution, raw)[execution]
    # executions per group (execution_of's keys are (group, execution) in index order)
    execution_group = torch.tensor(
        [group_of[key] for key, _ in execution_of], dtype=torch.long, device=device
    )
    members = torch.bincount(execution_group, minlength=num_groups)
    means = torch.zeros(num_groups, device=device).index_add_(0, group, share * rewards) / members
    # a group whose rewards are all equal has no signal; its float mean can miss them by an
    # ulp, which normalize_std would blow up to advantages near ±1
    lowest = torch.full((num_groups,), math.inf, device=device).scatter_reduce_(0, group, rewards, "amin")
    highest = torch.full((num_groups,), -math.inf, device=device).scatter_reduce_(0, group, rewards, "amax")
    varied = (members > 1) & (highest != lowest)
    centered = torch.where(varied[group], rewards - means[group], 0.0)
    if not normalize_std:
        return centered
    squares = torch.zeros(num_groups, device=device).index_add_(0, group, share * centered**2)
    stds = torch.sqrt(squares / (members - 1).clamp(min=1))
    return centered / (stds[group] + eps)


def adaptive_lambda(lengths: torch.Tensor, alpha: float) -> torch.Tensor:
    """Length-adaptive GAE λ (VAPO, Yue et al. 2025, eq. 7): ``λ = 1 − 1/(α·L)``.

    Long responses get λ near 1 (less bias from the critic over many tokens), short ones
    a smaller λ. Clamped to ``[0, 1]``.

    Args:
        lengths: ``(B,)`` number of action tokens of each row.
        alpha: α > 0.

    Returns:
        ``(B,)`` float λ per row, ready for ``skip_observation_gae(..., lam=λ)``.
    """
    if alpha <= 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    lengths = lengths.float().clamp(min=1.0)
    return (1.0 - 1.0 / (alpha * lengths)).clamp(0.0, 1.0)
