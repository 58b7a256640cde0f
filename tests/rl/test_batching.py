"""From processed rows to samples, batches and padded tensors, on small hand-written rows."""

from __future__ import annotations

import random
from collections import deque

import numpy as np
import pytest
import torch

from rl.advantages import adaptive_lambda, skip_observation_gae
from rl.batching import Sample, micro_batches, pad_batch, samples_from_table, take_batch
from storage.schema import PROCESSED_SCHEMA, TRAJECTORY_SCHEMA, to_table
from tests.rl.test_advantages import reference_skip_gae

PROMPT_ACTION = [False, False, True, True]


def processed(tid, tokens=(3, 4, 5, 6), mask=PROMPT_ACTION, **overrides):
    """One processed row: prompt tokens with log-prob 0, actions with −0.5, every action
    token trained with weight 1."""
    mask = list(mask)
    row = {
        "trajectory_id": tid,
        "execution_id": f"e-{tid}",
        "task": "toy",
        "prompt_id": "p",
        "group_id": None,
        "tokens": list(tokens),
        "logprobs": [-0.5 if m else 0.0 for m in mask],
        "action_mask": mask,
        "turn": [0] * len(mask),
        "versions": [2 if m else -1 for m in mask],
        "reward": 1.0,
        "status": "ok",
        "train_mask": mask,
        "loss_weight": [1.0] * len(mask),
    }
    return row | overrides


def samples_of(rows, vocab_size=10):
    return samples_from_table(to_table(rows, PROCESSED_SCHEMA), "processed/w/0", vocab_size)


def test_a_token_id_equal_to_the_vocabulary_size_rejects_the_whole_shard():
    samples, rejected = samples_of([processed("a"), processed("b", tokens=(3, 4, 10, 6))], vocab_size=10)
    assert samples == []
    reason = "token id 10 outside the policy's vocabulary of 10: shard from another tokenizer"
    assert rejected == [(0, "a", reason), (1, "b", reason)]


def test_the_largest_id_inside_the_vocabulary_is_accepted():
    samples, rejected = samples_of([processed("a", tokens=(0, 4, 9, 6))], vocab_size=10)
    assert rejected == [] and [s.trajectory_id for s in samples] == ["a"]


def test_an_action_token_at_position_zero_rejects_the_row():
    rows = [processed("first-is-action", mask=[True, False, True, True]), processed("fine")]
    samples, rejected = samples_of(rows)
    assert rejected == [(0, "first-is-action", "action token at position 0 has no context to score it")]
    assert [s.trajectory_id for s in samples] == ["fine"]


def test_train_mask_on_a_prompt_token_is_not_trained():
    row = processed("a", train_mask=[False, True, True, False])  # token 1 is a prompt token
    (sample,), rejected = samples_of([row])
    assert rejected == []
    assert sample.train_mask.tolist() == [False, False, True, False]
    assert sample.action_mask.tolist() == PROMPT_ACTION


def test_a_non_finite_action_log_prob_rejects_the_row():
    row = processed("nan", logprobs=[0.0, 0.0, -0.5, float("-inf")])
    samples, rejected = samples_of([row, processed("fine")])
    assert rejected == [(0, "nan", "non-finite rollout log-prob on an action token")]
    assert [s.trajectory_id for s in samples] == ["fine"]


@pytest.mark.parametrize("reward", [float("inf"), float("nan"), None])
def test_a_missing_or_infinite_reward_rejects_the_row(reward):
    samples, rejected = samples_of([processed("r", reward=reward), processed("fine")])
    assert rejected == [(0, "r", "reward is missing or not finite")]
    assert [s.trajectory_id for s in samples] == ["fine"]


def test_padded_rollout_log_probs_are_zero_off_actions():
    # log-probs recorded on prompt tokens too (−0.25): only the action tokens' are kept
    row = processed("a", logprobs=[-0.25, -0.25, -0.5, -1.0])
    short = processed("b", tokens=(3, 4, 5), mask=[False, True, True], logprobs=[-0.25, -2.0, -0.5])
    samples, rejected = samples_of([row, short])
    assert rejected == []
    batch = pad_batch(samples, pad_id=0)
    assert batch.rollout_logprobs.tolist() == [[0.0, 0.0, -0.5, -1.0], [0.0, -2.0, -0.5, 0.0]]


def test_keep_groups_does_not_join_samples_without_a_group():
    samples, _ = samples_of(
        [processed(f"t{i}", tokens=range(11), mask=[False] * 5 + [True] * 6) for i in range(3)], vocab_size=20
    )
    assert [s.num_tokens for s in samples] == [11, 11, 11] and samples[0].group_id is None
    buffer = deque(samples)
    assert [s.trajectory_id for s in take_batch(buffer, 11, keep_groups=True)] == ["t0"]
    assert [s.trajectory_id for s in buffer] == ["t1", "t2"]


def test_a_samples_min_version_is_its_oldest_action_token_version():
    # a multi-turn row whose turns were sampled by versions 1 then 3 (prompt tokens: −1)
    row = processed("mixed", tokens=(3, 4, 5, 6, 7), mask=[False, False, True, False, True])
    row["versions"] = [-1, -1, 1, -1, 3]
    (sample,), rejected = samples_of([row])
    assert rejected == [] and sample.min_version == 1


def test_a_sample_ends_at_its_last_action_token_and_its_reward_sits_there():
    # the observation after row "tail"'s last action (tokens 7, 8) enters neither its sample nor the batch
    tail = processed("tail", tokens=(3, 4, 5, 6, 7, 8), mask=[False, True, False, True, False, False])
    full = processed("full", tokens=(3, 4, 5, 6, 7, 8), mask=[False] * 5 + [True])
    samples, rejected = samples_of([tail, full])
    assert rejected == [] and [s.tokens.tolist() for s in samples] == [[3, 4, 5, 6], [3, 4, 5, 6, 7, 8]]
    batch = pad_batch(samples, pad_id=0)
    assert batch.input_ids.tolist() == [[3, 4, 5, 6, 0, 0], [3, 4, 5, 6, 7, 8]]
    assert batch.rewards.tolist() == [[0.0, 0.0, 0.0, 1.0, 0.0, 0.0], [0.0] * 5 + [1.0]]


def test_a_batch_takes_the_samples_that_fill_its_token_budget_exactly():
    samples, _ = samples_of([processed(f"t{i}") for i in range(3)])
    buffer = deque(samples)
    assert [s.trajectory_id for s in take_batch(buffer, 8)] == ["t0", "t1"]
    assert [s.trajectory_id for s in buffer] == ["t2"]


def test_a_negative_token_id_rejects_the_whole_shard_and_is_named():
    samples, rejected = samples_of([processed("a"), processed("b", tokens=(3, -1, 5, 6))])
    assert samples == []
    reason = "token id -1 outside the policy's vocabulary of 10: shard from another tokenizer"
    assert rejected == [(0, "a", reason), (1, "b", reason)]


@pytest.mark.parametrize("status", ["env_error", "infra_error"])
def test_a_failure_outside_the_policy_rejects_the_row(status):
    samples, rejected = samples_of([processed("x", status=status), processed("fine")])
    assert rejected == [(0, "x", f"status {status!r} is excluded from the loss")]
    assert [s.trajectory_id for s in samples] == ["fine"]


def test_a_row_with_actions_but_no_trained_token_is_rejected():
    samples, rejected = samples_of([processed("untrained", train_mask=[False] * 4), processed("fine")])
    assert rejected == [(0, "untrained", "no trainable tokens (train_mask empty)")]
    assert [s.trajectory_id for s in samples] == ["fine"]


def test_a_raw_shard_trains_every_action_token_with_weight_one():
    # no train_mask / loss_weight columns: they default to action_mask and 1
    row = processed("raw", tokens=(3, 4, 5, 6, 7), mask=[False, True, False, True, True])
    del row["train_mask"], row["loss_weight"]
    (sample,), rejected = samples_from_table(to_table([row], TRAJECTORY_SCHEMA), "raw/w/0", 10)
    assert rejected == []
    assert sample.train_mask.tolist() == [False, True, False, True, True]
    assert sample.loss_weight.tolist() == [1.0] * 5


def test_sequence_rewards_are_each_samples_own_in_order():
    samples, _ = samples_of(
        [processed("a", reward=0.25), processed("b", reward=-1.5), processed("c", reward=2.0)]
    )
    assert pad_batch(samples, pad_id=0).sequence_rewards.tolist() == [0.25, -1.5, 2.0]


def test_keep_groups_takes_the_rest_of_the_group_past_the_budget():
    rows = [processed(f"t{i}", group_id="g" if i < 4 else "h") for i in range(6)]
    buffer = deque(samples_of(rows)[0])
    # the budget holds one 4-token sample; the three others of its group follow it
    assert [s.trajectory_id for s in take_batch(buffer, 4, keep_groups=True)] == ["t0", "t1", "t2", "t3"]
    assert [s.trajectory_id for s in buffer] == ["t4", "t5"]


def sample_of_length(n: int) -> Sample:
    ones = np.ones(n, dtype=bool)
    return Sample(
        "s", 0, f"t{n}", "e", np.zeros(n, np.int64), np.zeros(n, np.float32), ones, ones, ones, 0.0, 0, None
    )


@pytest.mark.parametrize("seed", range(20))
def test_micro_batches_are_the_longest_runs_within_the_budget(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(1, 9) for _ in range(rng.randint(1, 25))]
    budget = rng.randint(1, 30)
    parts = micro_batches([sample_of_length(n) for n in lengths], budget)
    sizes = [[s.num_tokens for s in part] for part in parts]
    assert [n for part in sizes for n in part] == lengths  # every sample once, in order
    for k, part in enumerate(sizes):
        # rows × longest row within the budget (a single longer row is a part of its own)
        assert len(part) == 1 or len(part) * max(part) <= budget, (part, budget)
        if k + 1 < len(sizes):  # the next part's first row would not have fitted
            grown = [*part, sizes[k + 1][0]]
            assert len(grown) * max(grown) > budget, (grown, budget)


def test_a_micro_batch_that_fills_its_budget_exactly_is_one_part():
    parts = micro_batches([sample_of_length(n) for n in (5, 3, 5, 2)], micro_token_budget=15)
    assert [[s.num_tokens for s in part] for part in parts] == [[5, 3, 5], [2]]


@pytest.mark.parametrize("seed", range(30))
def test_advantages_of_padded_micro_batches_are_each_rows_own(seed):
    """Rows cut at their last action into samples, packed into micro-batches and right-padded
    as the trainer does, get from observation-skip GAE (fixed and length-adaptive λ) the
    advantages and returns the slow reference gives each whole row alone, its reward on its
    last token (an observation after the last action included) and the critic's values the
    same per token: cropping and padding add no step to the chain and move no reward."""
    rng = random.Random(seed)
    rows, values = [], {}
    for i in range(rng.randint(1, 8)):
        length = rng.randint(2, 14)
        mask = [False] + [rng.random() < 0.5 for _ in range(length - 1)]
        mask[rng.randrange(1, length)] = True
        tid = f"t{i}"
        rows.append(
            processed(tid, tokens=[rng.randrange(10) for _ in mask], mask=mask, reward=rng.gauss(0, 1))
        )
        values[tid] = [rng.gauss(0, 1) for _ in mask]
    samples, rejected = samples_of(rows)
    assert rejected == []
    gamma = rng.choice([1.0, 0.9])
    by_id = {row["trajectory_id"]: row for row in rows}
    for part in micro_batches(samples, rng.randint(1, 40)):
        batch = pad_batch(part, pad_id=0)
        value = torch.zeros(batch.input_ids.shape, dtype=torch.float64)
        for b, sample in enumerate(part):
            value[b, : sample.num_tokens] = torch.tensor(values[sample.trajectory_id][: sample.num_tokens])
        for lam in (0.9, adaptive_lambda(batch.action_mask.sum(dim=1), alpha=0.5)):
            advantages, returns = skip_observation_gae(batch.rewards, value, batch.action_mask, gamma, lam)
            for b, sample in enumerate(part):
                row = by_id[sample.trajectory_id]
                row_lam = lam if isinstance(lam, float) else float(lam[b])
                reward = [0.0] * len(row["tokens"])
                reward[-1] = sample.reward
                (want_adv,), (want_ret,) = reference_skip_gae(
                    [reward], [values[sample.trajectory_id]], [row["action_mask"]], gamma, [row_lam]
                )
                n = sample.num_tokens
                assert want_adv[n:] == [0.0] * (len(want_adv) - n)  # nothing to train past the cut
                torch.testing.assert_close(advantages[b, :n], torch.tensor(want_adv[:n], dtype=torch.float64))
                torch.testing.assert_close(returns[b, :n], torch.tensor(want_ret[:n], dtype=torch.float64))
                assert not advantages[b, n:].any() and not returns[b, n:].any()
