"""Supervised warm start: length-bucketed batches and masked next-token loss."""

from __future__ import annotations

import random

import torch

from rl.sft import length_bucketed_batches, masked_nll


def test_bucketed_batches_cover_each_index_once_and_pad_little():
    rng = random.Random(0)
    lengths = [rng.choice([16, 50, 90]) + rng.randint(0, 3) for _ in range(1000)]
    batches = length_bucketed_batches(lengths, 32, torch.Generator().manual_seed(0), pool_batches=8)
    flat = [i for batch in batches for i in batch]
    assert sorted(flat) == list(range(1000))
    assert all(1 <= len(batch) <= 32 for batch in batches)
    padded = sum(len(b) * max(lengths[i] for i in b) for b in batches)
    order = list(range(1000))
    rng.shuffle(order)
    unsorted = sum(
        len(order[i : i + 32]) * max(lengths[j] for j in order[i : i + 32]) for i in range(0, 1000, 32)
    )
    assert padded < 0.75 * unsorted


def test_masked_nll_matches_a_reference_loop():
    torch.manual_seed(0)
    token_logp = -torch.rand(3, 7) * 5
    loss_mask = torch.rand(3, 7) < 0.5
    loss_mask[0, 3] = True
    loss_mask[1, 0] = True  # nothing predicts position 0: never trained
    total, count = 0.0, 0
    for b in range(3):
        for t in range(1, 7):
            if loss_mask[b, t]:
                total -= token_logp[b, t].item()
                count += 1
    assert abs(masked_nll(token_logp, loss_mask).item() - total / count) < 1e-5
