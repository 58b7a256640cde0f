"""Log-probs of a sequence's own tokens under a causal LM, without holding its full logits.

The ``(B, T, V)`` float32 logits are what bound a training micro-batch on a large
vocabulary: 32,768 tokens × Qwen3's 151,936 entries take 20 GB, and their gradient as
much again. For a model whose logits are its LM head applied to the decoder's last
hidden state, :func:`token_logprobs` runs the head only on the positions asked for, a
chunk at a time under activation checkpointing, so one chunk's logits exist at a time in
the forward pass and again in the backward pass (the head's matmul runs twice per chunk).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

PLAIN_HEAD_MODELS = frozenset({"llama", "mistral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe"})
"""``config.model_type`` of the models whose logits are exactly ``lm_head`` of the decoder's
last hidden state (no soft-capping, scaling or bias); any other model runs its own forward
and its full logits are taken."""

LOGIT_CHUNK_ELEMENTS = 1 << 27
"""Logits worked out in one go (512 MiB in float32): ``LOGIT_CHUNK_ELEMENTS // V`` positions."""


def check_temperature(temperature: float) -> None:
    """Raise a ``ValueError`` unless ``temperature`` is a finite number above 0: logits / 0
    are NaN, and a negative one gives the log-probs of the reversed logits."""
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number above 0, got {temperature}")


def token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    where: torch.Tensor | None = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Log-prob of each token given the ones before it, under ``softmax(logits / temperature)``.

    Args:
        model: a causal LM (Hugging Face ``…ForCausalLM``) returning ``.logits`` ``(B, T, V)``.
        input_ids: ``(B, T)`` int64.
        attention_mask: ``(B, T)`` bool.
        where: ``(B, T)`` bool, the tokens whose log-prob is wanted (default: every token
            ``attention_mask`` keeps); the others read 0.
        temperature: divides the logits, as an engine sampling at it does: the trainer's
            log-probs compare with the rollout's only at the temperature the rollout used.
            A finite number above 0, or a ``ValueError``.

    Returns:
        ``(B, T)`` float32; a row's first attended token (no context) reads 0, as does
        position 0. Padding may be on either side: positions count from a row's first
        attended token.
    """
    # a 0/1 integer mask (Hugging Face's convention) would index positions instead of
    # selecting them, giving other tokens' log-probs without an error
    for name, mask in (("attention_mask", attention_mask), ("where", where)):
        if mask is not None and mask.dtype != torch.bool:
            raise ValueError(f"{name} must be a bool tensor, got {mask.dtype}")
    check_temperature(temperature)
    wanted = attention_mask if where is None else where & attention_mask
    # a token is predicted from the one before it, which padding is not
    wanted = wanted[:, 1:] & attention_mask[:, :-1]
    # counted from each row's first token: left padding is no part of the sequence, and a learned
    # position table (GPT-2) would otherwise see every token shifted by it
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask.long(), "position_ids": position_ids}
    if getattr(model.config, "model_type", None) not in PLAIN_HEAD_MODELS:
        logits = model(**inputs).logits[:, :-1].float()
        logits = logits / temperature
        taken = logits.gather(-1, input_ids[:, 1:, None])[..., 0] - torch.logsumexp(logits, dim=-1)
        return F.pad(torch.where(wanted, taken, 0.0), (1, 0))
    hidden = model.get_decoder()(**inputs, use_cache=False).last_hidden_state
    head = model.get_output_embeddings()
    states = hidden[:, :-1][wanted]  # (N, H)
    targets = input_ids[:, 1:][wanted]  # (N,)
    chunk = max(1, LOGIT_CHUNK_ELEMENTS // head.out_features)
    pieces = []
    for start in range(0, len(targets), chunk):
        piece = (states[start : start + chunk], targets[start : start + chunk], temperature)
        if torch.is_grad_enabled() and len(targets) > chunk:
            pieces.append(checkpoint(_head_logprobs, head, *piece, use_reentrant=False))
        else:
            pieces.append(_head_logprobs(head, *piece))
    out = hidden.new_zeros(wanted.shape, dtype=torch.float32)
    # with nothing wanted, an empty sum of the states still ties the zeros to the graph, so a
    # loss over them can be backpropagated like any other
    out[wanted] = torch.cat(pieces) if pieces else states.sum(-1).float()
    return F.pad(out, (1, 0))


def _head_logprobs(
    head: torch.nn.Module, states: torch.Tensor, targets: torch.Tensor, temperature: float
) -> torch.Tensor:
    """``(N,)`` log-probs of ``targets`` ``(N,)`` under the head's logits of ``states`` ``(N, H)``
    divided by ``temperature``."""
    logits = head(states).float() / temperature  # (N, V)
    return logits.gather(-1, targets[:, None])[:, 0] - torch.logsumexp(logits, dim=-1)
