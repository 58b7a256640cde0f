"""From processed shard rows to training tensors: samples, token-budget batches, padding.

A :class:`Sample` is one trajectory row of a processed shard, checked and ready to train;
:func:`pad_batch` right-pads a list of them into ``(B, T)`` tensors.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import pyarrow as pa
import torch

from storage.schema import EXCLUDED_STATUSES

Item = TypeVar("Item")


@dataclass
class Sample:
    """One trainable trajectory. Per-token arrays are ``(L,)``."""

    shard_id: str
    row: int
    trajectory_id: str
    execution_id: str
    tokens: np.ndarray
    rollout_logprobs: np.ndarray
    action_mask: np.ndarray
    train_mask: np.ndarray
    loss_weight: np.ndarray
    reward: float
    min_version: int
    group_id: str | None

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)


@dataclass
class Batch:
    """Right-padded ``(B, T)`` tensors of a list of samples."""

    input_ids: torch.Tensor
    """``(B, T)`` int64, padded with ``pad_id``."""
    attention_mask: torch.Tensor
    """``(B, T)`` bool, true on real tokens."""
    action_mask: torch.Tensor
    """``(B, T)`` bool, tokens the policy generated (the GAE chain)."""
    train_mask: torch.Tensor
    """``(B, T)`` bool, tokens that enter the policy loss."""
    loss_weight: torch.Tensor
    """``(B, T)`` float32 per-token loss weight (0 on padding)."""
    rollout_logprobs: torch.Tensor
    """``(B, T)`` float32 sampling log-probs (0 off actions)."""
    rewards: torch.Tensor
    """``(B, T)`` float32: each row's reward on its last real token, 0 elsewhere."""
    sequence_rewards: torch.Tensor
    """``(B,)`` float32."""
    group_ids: list[str | None]

    def to(self, device: torch.device | str) -> Batch:
        fields = {name: getattr(self, name) for name in self.__dataclass_fields__}
        return Batch(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in fields.items()})


def _list_column(table: pa.Table, name: str) -> tuple[np.ndarray, np.ndarray]:
    """Flat values and ``(N+1,)`` offsets of a list column."""
    column = table.column(name).combine_chunks()
    if isinstance(column, pa.ChunkedArray):  # an empty table has no chunks
        column = pa.array([], type=column.type)
    offsets = column.offsets.to_numpy()
    values = column.values.to_numpy(zero_copy_only=False)
    return values, offsets


def samples_from_table(
    table: pa.Table, shard_id: str, vocab_size: int
) -> tuple[list[Sample], list[tuple[int, str, str]]]:
    """Check every row of a processed shard and turn the good ones into samples.

    A whole shard is rejected when any token id lies outside ``[0, vocab_size)`` (it was
    made with another tokenizer). A row is rejected when its status is ``env_error`` /
    ``infra_error``, its reward is null, it has no token in ``train_mask``, an action token
    sits at position 0 (no context to score it), or an action log-prob is not finite.

    A sample ends at its row's last action token. The tokens after it (the observation that
    ended a rollout, which may have taken it past the engine's positions: the engine then
    refused the next turn) enter no loss and no advantage, and the reward the batch puts on
    a sample's last token is carried back to that action token anyway; fed to the models they
    would only cost compute, or index past a policy's learned positions (GPT-2).

    Args:
        table: a processed shard (``PROCESSED_SCHEMA``; ``train_mask`` / ``loss_weight``
            default to ``action_mask`` / 1 when absent).
        shard_id: the shard's id, kept on every sample.
        vocab_size: the policy's vocabulary size.

    Returns:
        ``(samples, rejected)`` with ``rejected`` a list of ``(row, trajectory_id, reason)``.
    """
    num_rows = table.num_rows
    ids = table.column("trajectory_id").to_pylist()
    if num_rows == 0:
        return [], []
    tokens, offsets = _list_column(table, "tokens")
    if len(tokens) and (tokens.min() < 0 or tokens.max() >= vocab_size):
        bad = int(tokens.max()) if tokens.max() >= vocab_size else int(tokens.min())
        reason = (
            f"token id {bad} outside the policy's vocabulary of {vocab_size}: shard from another tokenizer"
        )
        return [], [(row, ids[row], reason) for row in range(num_rows)]
    logprobs, _ = _list_column(table, "logprobs")
    action, _ = _list_column(table, "action_mask")
    versions, _ = _list_column(table, "versions")
    has_train = "train_mask" in table.column_names
    train = _list_column(table, "train_mask")[0] if has_train else action
    weight = (
        _list_column(table, "loss_weight")[0].astype(np.float32)
        if "loss_weight" in table.column_names
        else np.ones(len(tokens), dtype=np.float32)
    )
    statuses = table.column("status").to_pylist()
    executions = table.column("execution_id").to_pylist()
    rewards = table.column("reward").to_pylist()
    groups = table.column("group_id").to_pylist() if "group_id" in table.column_names else [None] * num_rows

    samples: list[Sample] = []
    rejected: list[tuple[int, str, str]] = []
    for row in range(num_rows):
        start, end = int(offsets[row]), int(offsets[row + 1])
        row_action = action[start:end].astype(bool)
        row_train = train[start:end].astype(bool) & row_action
        row_logprobs = logprobs[start:end].astype(np.float32)
        reason = None
        if statuses[row] in EXCLUDED_STATUSES:
            reason = f"status {statuses[row]!r} is excluded from the loss"
        elif rewards[row] is None or not np.isfinite(rewards[row]):
            reason = "reward is missing or not finite"
        elif not row_train.any():
            reason = "no trainable tokens (train_mask empty)"
        elif row_action[0]:
            reason = "action token at position 0 has no context to score it"
        elif not np.all(np.isfinite(row_logprobs[row_action])):
            reason = "non-finite rollout log-prob on an action token"
        if reason is not None:
            rejected.append((row, ids[row], reason))
            continue
        kept = int(np.flatnonzero(row_action)[-1]) + 1
        samples.append(
            Sample(
                shard_id=shard_id,
                row=row,
                trajectory_id=ids[row],
                execution_id=executions[row],
                tokens=tokens[start : start + kept].astype(np.int64),
                rollout_logprobs=np.where(row_action, row_logprobs, 0.0)[:kept].astype(np.float32),
                action_mask=row_action[:kept],
                train_mask=row_train[:kept],
                loss_weight=weight[start : start + kept],
                reward=float(rewards[row]),
                min_version=int(versions[start:end][row_action].min()),
                group_id=groups[row],
            )
        )
    return samples, rejected


def take_batch(buffer: deque[Sample], token_budget: int, keep_groups: bool = False) -> list[Sample]:
    """Pop samples from the front of ``buffer`` while they fit in ``token_budget`` tokens.

    At least one sample is taken (a sample longer than the budget forms its own batch).
    With ``keep_groups`` the batch then grows while the next sample shares the last one's
    ``group_id``, so GRPO groups are not split at the boundary.
    """
    batch: list[Sample] = []
    total = 0
    while buffer and (not batch or total + buffer[0].num_tokens <= token_budget):
        total += buffer[0].num_tokens
        batch.append(buffer.popleft())
    while (
        keep_groups and buffer and batch[-1].group_id is not None and buffer[0].group_id == batch[-1].group_id
    ):
        batch.append(buffer.popleft())
    return batch


def _sample_tokens(sample: Sample) -> int:
    return sample.num_tokens


def micro_batches(
    samples: Sequence[Item], micro_token_budget: int, tokens: Callable[[Item], int] = _sample_tokens
) -> list[list[Item]]:
    """Split ``samples`` (in order; each of ``tokens(sample)`` tokens, a :class:`Sample`'s
    by default) so that rows × longest row ≤ ``micro_token_budget`` in every part (a single
    longer row is a part of its own)."""
    parts: list[list[Item]] = []
    current: list[Item] = []
    longest = 0
    for sample in samples:
        new_longest = max(longest, tokens(sample))
        if current and new_longest * (len(current) + 1) > micro_token_budget:
            parts.append(current)
            current, new_longest = [], tokens(sample)
        current.append(sample)
        longest = new_longest
    if current:
        parts.append(current)
    return parts


def pad_batch(samples: Sequence[Sample], pad_id: int) -> Batch:
    """Right-pad ``samples`` into a :class:`Batch` of ``(B, T)`` tensors, ``T`` the longest row."""
    if not samples:
        raise ValueError("cannot pad an empty list of samples")
    batch, length = len(samples), max(s.num_tokens for s in samples)
    input_ids = torch.full((batch, length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((batch, length), dtype=torch.bool)
    action_mask = torch.zeros((batch, length), dtype=torch.bool)
    train_mask = torch.zeros((batch, length), dtype=torch.bool)
    loss_weight = torch.zeros((batch, length), dtype=torch.float32)
    rollout_logprobs = torch.zeros((batch, length), dtype=torch.float32)
    rewards = torch.zeros((batch, length), dtype=torch.float32)
    for row, sample in enumerate(samples):
        n = sample.num_tokens
        input_ids[row, :n] = torch.from_numpy(sample.tokens)
        attention_mask[row, :n] = True
        action_mask[row, :n] = torch.from_numpy(sample.action_mask)
        train_mask[row, :n] = torch.from_numpy(sample.train_mask)
        loss_weight[row, :n] = torch.from_numpy(sample.loss_weight)
        rollout_logprobs[row, :n] = torch.from_numpy(sample.rollout_logprobs)
        rewards[row, n - 1] = sample.reward
    return Batch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        action_mask=action_mask,
        train_mask=train_mask,
        loss_weight=loss_weight,
        rollout_logprobs=rollout_logprobs,
        rewards=rewards,
        sequence_rewards=torch.tensor([s.reward for s in samples], dtype=torch.float32),
        group_ids=[s.group_id for s in samples],
    )
