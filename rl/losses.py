"""Policy and value losses: direct double-sided importance sampling (DIS) and a clipped MSE.

Tensors are ``(B, T)`` over the whole token sequence; ``action_mask`` selects the tokens
that enter the loss (the trainer passes the processor's ``train_mask`` when present).
"""

from __future__ import annotations

import torch

MIN_TARGET_VAR = 1e-8
"""Below this variance of the value targets (e.g. every return of a batch equal up to float
rounding) explained variance is reported as 0, not as a ratio of rounding errors."""


def dis_policy_loss(
    logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    eps_low: float,
    eps_high: float,
    *,
    loss_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Direct double-sided importance-sampling policy loss (GLM-5, PAPERS.md "DIS").

    ``r_t = exp(logπθ(a_t) − logπrollout(a_t))`` (detached) and
    ``f(r) = r if 1 − ε_low < r < 1 + ε_high else 0`` (open interval: out-of-range tokens
    are masked, not clipped). No π_old is kept::

        L = −Σ_t f(r_t) · w_t · Â_t · logπθ(a_t) / N

    with ``N`` the number of tokens in ``action_mask`` and ``w_t = loss_weight`` (1 when
    ``None``, giving the plain token mean). With no action token at all the loss is a zero
    that still carries a graph, and every statistic is 0.

    Args:
        logprobs: ``(B, T)`` log-probs of the sequence's tokens under the current policy
            (with grad).
        rollout_logprobs: ``(B, T)`` sampling log-probs recorded by the engine.
        advantages: ``(B, T)`` advantages (no grad needed).
        action_mask: ``(B, T)`` bool, the tokens that enter the loss.
        eps_low: ε_low, lower width of the trust interval (0.3 for SAO).
        eps_high: ε_high, upper width (5.0 for SAO).
        loss_weight: optional ``(B, T)`` per-token weight from the trajectory processor.

    Returns:
        ``(loss, stats)``: the scalar loss (in float32 or wider, as the ratio is) and detached
        diagnostics (worked out in float64) — ``masked_fraction`` (action tokens outside the
        interval), ``masked_low`` / ``masked_high`` (below / above it), ``mean_ratio``,
        ``max_ratio``, ``kl`` (k3 estimate of KL(π_rollout ‖ πθ), mean of
        ``(r − 1) − log r``), ``num_tokens``.
    """
    if not (logprobs.shape == rollout_logprobs.shape == advantages.shape == action_mask.shape):
        raise ValueError(
            "logprobs, rollout_logprobs, advantages and action_mask must share one (B, T) shape; got "
            f"{tuple(logprobs.shape)}, {tuple(rollout_logprobs.shape)}, {tuple(advantages.shape)}, "
            f"{tuple(action_mask.shape)}"
        )
    if action_mask.dtype != torch.bool:
        raise ValueError(f"action_mask must be a bool tensor, got {action_mask.dtype}")
    if loss_weight is not None and loss_weight.shape != logprobs.shape:
        raise ValueError(f"loss_weight must be {tuple(logprobs.shape)}, got {tuple(loss_weight.shape)}")
    if not 0 < eps_low <= 1 or eps_high <= 0:
        raise ValueError(
            f"need 0 < eps_low <= 1 and eps_high > 0, got eps_low={eps_low}, eps_high={eps_high}"
        )

    num_tokens = int(action_mask.sum())
    # the ratio in float32 at least: rounded to bfloat16, a rollout log-prob of −20.06 reads
    # −20.0 (a weight off by 6%), and float16's exp overflows past a log-ratio of 11
    ratio_dtype = torch.promote_types(logprobs.dtype, torch.float32)
    zeros = torch.zeros_like(logprobs, dtype=ratio_dtype)
    log_ratio = torch.where(
        action_mask, logprobs.detach().to(ratio_dtype) - rollout_logprobs.to(ratio_dtype), zeros
    )
    ratio = torch.exp(log_ratio)
    too_low = action_mask & (ratio <= 1.0 - eps_low)
    too_high = action_mask & (ratio >= 1.0 + eps_high)
    kept = action_mask & ~too_low & ~too_high
    # every factor is zeroed off the kept tokens, not just the ratio: a -inf log-prob the
    # interval masks, or a NaN advantage or weight on padding, times a zero weight is NaN
    is_weight = torch.where(kept, ratio, zeros)
    token_weight = (
        is_weight
        if loss_weight is None
        else is_weight * torch.where(kept, loss_weight.to(ratio_dtype), zeros)
    )
    kept_advantages = torch.where(kept, advantages.detach().to(ratio_dtype), zeros)
    safe_logprobs = torch.where(kept, logprobs, torch.zeros_like(logprobs))
    loss_sum = -(token_weight * kept_advantages * safe_logprobs).sum()
    loss = loss_sum / max(num_tokens, 1)

    if num_tokens == 0:
        names = ("masked_fraction", "masked_low", "masked_high", "mean_ratio", "max_ratio", "kl")
        return loss, {**dict.fromkeys(names, 0.0), "num_tokens": 0.0}
    with torch.no_grad():
        # k3 ≈ x²/2 is far below float32's step near 1 when the policies nearly agree: as
        # (r − 1) − log r in float32 it read 0 for x = 1e-4, or a negative KL
        action_log_ratio = log_ratio[action_mask].double()
        k3 = torch.expm1(action_log_ratio) - action_log_ratio
        stats = {
            "masked_fraction": float((too_low | too_high).sum()) / num_tokens,
            "masked_low": float(too_low.sum()) / num_tokens,
            "masked_high": float(too_high.sum()) / num_tokens,
            "mean_ratio": float(action_log_ratio.exp().mean()),
            "max_ratio": float(action_log_ratio.max().exp()),
            "kl": float(k3.mean()),
            "num_tokens": float(num_tokens),
        }
    return loss, stats


def value_loss(
    values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    old_values: torch.Tensor | None = None,
    clip: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Squared error of the critic against its targets, optionally clipped (PPO, Schulman et
    al. 2017, as in OpenAI baselines' ``vf_loss``).

    ``L = ½ · mean_t (V_t − R_t)²`` over ``mask``. With ``clip`` and ``old_values``:
    ``L = ½ · mean_t max((V_t − R_t)², (V_old + clamp(V_t − V_old, −c, c) − R_t)²)``.

    Args:
        values: ``(B, T)`` critic outputs (with grad).
        returns: ``(B, T)`` targets.
        mask: ``(B, T)`` bool, the tokens that enter the loss.
        old_values: ``(B, T)`` values before this update; needed with ``clip``.
        clip: clip range c, or ``None`` for the plain squared error.

    Returns:
        ``(loss, stats)`` with ``value_loss``, ``clip_fraction`` and ``explained_variance``
        (``1 − Var(R − V) / Var(R)``; 0 when the targets' variance is at most
        :data:`MIN_TARGET_VAR`, where the ratio measures float noise).
    """
    if not (values.shape == returns.shape == mask.shape):
        raise ValueError(
            f"values, returns and mask must share one shape; got {tuple(values.shape)}, "
            f"{tuple(returns.shape)}, {tuple(mask.shape)}"
        )
    if clip is not None and old_values is None:
        raise ValueError("a clipped value loss needs old_values")
    if clip is not None and old_values.shape != values.shape:
        raise ValueError(
            f"old_values must be {tuple(values.shape)} like values, got {tuple(old_values.shape)}"
        )
    num_tokens = int(mask.sum())
    # in float32 at least: the float32 targets rounded to bfloat16 are off by up to 0.25 at 100
    values = values.to(torch.promote_types(values.dtype, torch.float32))
    targets = returns.detach().to(values.dtype)
    error = torch.where(mask, values - targets, torch.zeros_like(values)) ** 2
    clip_fraction = 0.0
    if clip is not None:
        old = old_values.detach().to(values.dtype)
        clipped_values = old + (values - old).clamp(-clip, clip)
        clipped_error = torch.where(mask, clipped_values - targets, torch.zeros_like(values)) ** 2
        if num_tokens:
            clip_fraction = float((mask & (clipped_error > error)).sum()) / num_tokens
        error = torch.maximum(error, clipped_error)
    loss = 0.5 * error.sum() / max(num_tokens, 1)
    return loss, {
        "value_loss": float(loss.detach()),
        "clip_fraction": clip_fraction,
        "explained_variance": explained_variance(values.detach()[mask], targets[mask]),
    }


@torch.no_grad()
def explained_variance(values: torch.Tensor, targets: torch.Tensor) -> float:
    """``1 − Var(R − V) / Var(R)`` of the critic's values against their targets.

    Args:
        values: ``(N,)`` critic outputs.
        targets: ``(N,)`` their targets.

    Returns:
        The explained variance; 0 with fewer than two values, or when the targets' variance
        is at most :data:`MIN_TARGET_VAR` (the ratio would measure float noise).
    """
    if values.numel() < 2:
        return 0.0
    target_var = targets.var()
    if target_var <= MIN_TARGET_VAR:
        return 0.0
    return float(1.0 - (targets - values).var() / target_var)
