"""Advantage estimators against slow pure-Python references written out here."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rl.advantages import (
    adaptive_lambda,
    carry_rewards_to_actions,
    gae,
    group_advantages,
    skip_observation_gae,
)


def reference_skip_gae(rewards, values, mask, gamma, lam):
    """One row at a time, list by list, exactly as the SAO text says."""
    advantages, returns = [], []
    for row_r, row_v, row_m, row_lam in zip(rewards, values, mask, lam, strict=True):
        actions = [t for t, m in enumerate(row_m) if m]
        carried = [0.0] * len(row_r)
        for t, r in enumerate(row_r):
            owners = [a for a in actions if a <= t]
            if owners:
                carried[owners[-1]] += r
        adv = [0.0] * len(row_r)
        nxt_adv = 0.0
        for k in range(len(actions) - 1, -1, -1):
            t = actions[k]
            next_value = row_v[actions[k + 1]] if k + 1 < len(actions) else 0.0
            delta = carried[t] + gamma * next_value - row_v[t]
            nxt_adv = delta + gamma * row_lam * nxt_adv
            adv[t] = nxt_adv
        advantages.append(adv)
        returns.append([adv[t] + row_v[t] if row_m[t] else 0.0 for t in range(len(row_r))])
    return advantages, returns


def reference_gae(rewards, values, mask, gamma, lam):
    advantages, returns = [], []
    for row_r, row_v, row_m, row_lam in zip(rewards, values, mask, lam, strict=True):
        n = len(row_r)
        adv = [0.0] * n
        last = 0.0
        for t in range(n - 1, -1, -1):
            if not row_m[t]:
                last = 0.0
                continue
            next_ok = t + 1 < n and row_m[t + 1]
            next_value = row_v[t + 1] if next_ok else 0.0
            delta = row_r[t] + gamma * next_value - row_v[t]
            last = delta + gamma * row_lam * (last if next_ok else 0.0)
            adv[t] = last
        advantages.append(adv)
        returns.append([adv[t] + row_v[t] if row_m[t] else 0.0 for t in range(n)])
    return advantages, returns


def random_case(rng: random.Random, batch: int, length: int):
    """Rows of prompt / alternating action and observation runs / padding, with rewards
    scattered anywhere (also on observations, prompts and padding)."""
    mask, rewards, values = [], [], []
    for row in range(batch):
        kind = row % 4
        m = [False] * length
        if kind != 3:  # kind 3: an all-masked row
            t = rng.randint(0, max(0, length // 4))
            end = rng.randint(t, length)
            while t < end:
                run = 1 if kind == 1 else rng.randint(1, 4)  # kind 1: single-token actions
                for i in range(t, min(t + run, end)):
                    m[i] = True
                t += run + rng.randint(0, 3)  # observation gap; may also leave trailing observations
        mask.append(m)
        rewards.append([rng.gauss(0, 1) if rng.random() < 0.3 else 0.0 for _ in range(length)])
        values.append([rng.gauss(0, 1) for _ in range(length)])
    return rewards, values, mask


def as_tensors(rewards, values, mask):
    return (
        torch.tensor(rewards, dtype=torch.float64),
        torch.tensor(values, dtype=torch.float64),
        torch.tensor(mask, dtype=torch.bool),
    )


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    batch=st.integers(1, 6),
    length=st.integers(1, 24),
    gamma=st.sampled_from([1.0, 0.99, 0.5]),
    per_row_lambda=st.booleans(),
)
def test_skip_observation_gae_matches_reference(seed, batch, length, gamma, per_row_lambda):
    rng = random.Random(seed)
    rewards, values, mask = random_case(rng, batch, length)
    lam_rows = [rng.uniform(0, 1) for _ in range(batch)] if per_row_lambda else [0.95] * batch
    lam = torch.tensor(lam_rows, dtype=torch.float64) if per_row_lambda else 0.95

    advantages, returns = skip_observation_gae(*as_tensors(rewards, values, mask), gamma, lam)
    want_adv, want_ret = reference_skip_gae(rewards, values, mask, gamma, lam_rows)

    torch.testing.assert_close(advantages, torch.tensor(want_adv, dtype=torch.float64))
    torch.testing.assert_close(returns, torch.tensor(want_ret, dtype=torch.float64))


def stepwise_skip_gae(rewards, values, mask, gamma, lam):
    """The observation-skip GAE as it was first written: every step of the chain a few torch
    operations on the batch's column (before the chain moved to the host)."""
    lam_rows = (
        lam if isinstance(lam, torch.Tensor) else torch.full((values.shape[0],), lam, dtype=values.dtype)
    )
    carried = carry_rewards_to_actions(rewards.to(values.dtype), mask)
    counts = mask.sum(dim=1)
    width = int(counts.max()) if counts.numel() else 0
    order = torch.argsort((~mask).to(torch.uint8), dim=1, stable=True)[:, :width]
    is_action = torch.arange(width) < counts[:, None]
    action_values, action_rewards = values.gather(1, order), carried.gather(1, order)
    compact = torch.zeros_like(action_values)
    next_value = torch.zeros(values.shape[0], dtype=values.dtype)
    next_advantage = torch.zeros_like(next_value)
    for j in reversed(range(width)):
        delta = action_rewards[:, j] + gamma * next_value - action_values[:, j]
        advantage_j = torch.where(is_action[:, j], delta + gamma * lam_rows * next_advantage, 0.0)
        compact[:, j] = advantage_j
        next_value = torch.where(is_action[:, j], action_values[:, j], 0.0)
        next_advantage = advantage_j
    advantages = torch.zeros_like(values).scatter_(1, order, compact)
    return advantages, torch.where(mask, advantages + values, torch.zeros_like(values))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("seed", range(6))
def test_skip_gae_is_bit_for_bit_the_stepwise_torch_chain(seed, dtype):
    rng = random.Random(seed)
    rewards, values, mask = random_case(rng, rng.randint(1, 6), rng.randint(1, 400))
    gamma = rng.choice([1.0, 0.99, 0.7])
    lam = rng.choice([0.95, torch.tensor([rng.uniform(0, 1) for _ in mask], dtype=dtype)])
    rewards, values, mask = (
        torch.tensor(rewards, dtype=dtype),
        torch.tensor(values, dtype=dtype),
        torch.tensor(mask),
    )

    advantages, returns = skip_observation_gae(rewards, values, mask, gamma, lam)
    want_advantages, want_returns = stepwise_skip_gae(rewards, values, mask, gamma, lam)

    assert advantages.dtype == dtype and torch.equal(advantages, want_advantages)
    assert torch.equal(returns, want_returns)


@pytest.mark.parametrize("seed", range(6))
def test_skip_gae_on_bfloat16_chains_in_float32_and_rounds_once(seed):
    # small integer rewards and values with γ = 1: every δ is exact in bfloat16 and every
    # A = Σ δ·0.5^k exact in float32, so a float32 chain rounded once at the end is the
    # float64 reference rounded to bfloat16 (a bfloat16 chain would round at each step)
    rng = random.Random(seed)
    _, _, mask = random_case(rng, 4, 24)
    rewards = [[float(rng.randint(-4, 4)) if rng.random() < 0.3 else 0.0 for _ in row] for row in mask]
    values = [[float(rng.randint(-4, 4)) for _ in row] for row in mask]

    advantages, _ = skip_observation_gae(
        torch.tensor(rewards, dtype=torch.bfloat16),
        torch.tensor(values, dtype=torch.bfloat16),
        torch.tensor(mask),
        1.0,
        0.5,
    )
    want, _ = reference_skip_gae(rewards, values, mask, 1.0, [0.5] * len(mask))

    assert advantages.dtype == torch.bfloat16
    assert torch.equal(advantages, torch.tensor(want, dtype=torch.float64).to(torch.bfloat16))


@pytest.mark.parametrize("lam", [0.999, torch.tensor([0.999, 0.99])])
def test_skip_gae_on_bfloat16_keeps_lambda_near_1_unrounded(lam):
    # λ was cast to the values' dtype first: in bfloat16 0.999 read 1.0 and 0.99 read 0.988,
    # so the first of 300 action tokens got 1.0 instead of 0.999^299 = 0.74 of the reward
    mask = [[True] * 300 + [False] * 100, [t % 4 != 3 for t in range(400)]]
    rewards = [[0.0] * 399 + [1.0] for _ in mask]
    values = [[0.0] * 400 for _ in mask]
    lam_rows = lam.tolist() if isinstance(lam, torch.Tensor) else [lam] * 2

    advantages, _ = skip_observation_gae(
        torch.tensor(rewards, dtype=torch.bfloat16),
        torch.tensor(values, dtype=torch.bfloat16),
        torch.tensor(mask),
        1.0,
        lam,
    )
    want, _ = reference_skip_gae(rewards, values, mask, 1.0, lam_rows)

    assert advantages.dtype == torch.bfloat16
    torch.testing.assert_close(
        advantages.double(), torch.tensor(want, dtype=torch.float64), rtol=2**-8, atol=0
    )


@pytest.mark.parametrize("seed", range(3))
def test_skip_gae_on_bfloat16_rounds_only_its_results(seed):
    # each δ = r + γ·V' − V was rounded to bfloat16 before the float32 chain: at values near
    # 5 that is up to 0.016 a token, and over a long chain with γλ near 1 those errors add up
    rng = random.Random(seed)
    _, _, mask = random_case(rng, 3, 1200)
    mask[0] = [True] * 1200
    values = torch.tensor([[rng.gauss(5, 1) for _ in row] for row in mask]).to(torch.bfloat16)
    rewards = torch.tensor([[rng.gauss(0, 0.3) if rng.random() < 0.1 else 0.0 for _ in row] for row in mask])

    advantages, returns = skip_observation_gae(rewards, values, torch.tensor(mask), 0.999, 0.99)
    want_adv, want_ret = reference_skip_gae(
        rewards.double().tolist(), values.double().tolist(), mask, 0.999, [0.99] * 3
    )

    assert advantages.dtype == returns.dtype == torch.bfloat16
    for got, want in ((advantages, want_adv), (returns, want_ret)):
        torch.testing.assert_close(
            got.double(), torch.tensor(want, dtype=torch.float64), rtol=2**-8, atol=1e-4
        )


def test_skip_gae_hand_example_links_across_observations():
    # prompt, action(2 tokens), observation(2), action(1), trailing observation with the reward
    mask = torch.tensor([[False, True, True, False, False, True, False]])
    values = torch.tensor([[9.0, 1.0, 2.0, 9.0, 9.0, 3.0, 9.0]])
    rewards = torch.tensor([[5.0, 0.0, 0.0, 0.5, 0.0, 0.0, 1.0]])
    adv, ret = skip_observation_gae(rewards, values, mask, gamma=1.0, lam=1.0)
    # carried rewards: 0.5 -> token 2, 1.0 -> token 5; the prompt reward 5.0 is dropped
    # token 5: δ = 1 + 0 − 3 = −2;  token 2: δ = 0.5 + 3 − 2 = 1.5, A = 1.5 − 2 = −0.5
    # token 1: δ = 0 + 2 − 1 = 1, A = 1 − 0.5 = 0.5
    torch.testing.assert_close(adv, torch.tensor([[0.0, 0.5, -0.5, 0.0, 0.0, -2.0, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[0.0, 1.5, 1.5, 0.0, 0.0, 1.0, 0.0]]))


def test_all_masked_row_is_zero_and_carry_drops_leading_rewards():
    rewards = torch.tensor([[1.0, 2.0, 3.0], [1.0, 0.0, 2.0]])
    mask = torch.tensor([[False, False, False], [False, True, False]])
    carried = carry_rewards_to_actions(rewards, mask)
    torch.testing.assert_close(carried, torch.tensor([[0.0, 0.0, 0.0], [0.0, 2.0, 0.0]]))
    adv, ret = skip_observation_gae(rewards, torch.ones(2, 3), mask, 1.0, 0.95)
    assert torch.all(adv[0] == 0) and torch.all(ret[0] == 0)
    assert adv[1, 1].item() == pytest.approx(1.0)


def test_skip_gae_rejects_bad_lambda_shape():
    with pytest.raises(ValueError, match="lam must be"):
        skip_observation_gae(
            torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool), 1.0, torch.ones(3)
        )


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), batch=st.integers(1, 5), length=st.integers(1, 20))
def test_plain_gae_matches_reference(seed, batch, length):
    rng = random.Random(seed)
    rewards, values, mask = random_case(rng, batch, length)
    lam_rows = [rng.uniform(0, 1) for _ in range(batch)]
    advantages, returns = gae(
        *as_tensors(rewards, values, mask), 0.9, torch.tensor(lam_rows, dtype=torch.float64)
    )
    want_adv, want_ret = reference_gae(rewards, values, mask, 0.9, lam_rows)
    torch.testing.assert_close(advantages, torch.tensor(want_adv, dtype=torch.float64))
    torch.testing.assert_close(returns, torch.tensor(want_ret, dtype=torch.float64))


@pytest.mark.parametrize("lam", [0.999, torch.tensor([0.999, 0.99])])
def test_plain_gae_on_bfloat16_keeps_lambda_near_1_and_chains_in_float32(lam):
    # as skip_observation_gae: λ cast to bfloat16 read 0.999 as 1.0 (and 0.99 as 0.988), and a
    # bfloat16 chain rounded every step; the first of 300 tokens got 1.0, not 0.999^299 = 0.74
    mask = [[True] * 300 + [False] * 100, [True] * 400]
    rewards = [[0.0] * 299 + [1.0] + [0.0] * 100, [0.0] * 399 + [1.0]]
    values = [[0.0] * 400 for _ in mask]
    lam_rows = lam.tolist() if isinstance(lam, torch.Tensor) else [lam] * 2

    advantages, returns = gae(
        torch.tensor(rewards, dtype=torch.bfloat16),
        torch.tensor(values, dtype=torch.bfloat16),
        torch.tensor(mask),
        1.0,
        lam,
    )
    want_adv, want_ret = reference_gae(rewards, values, mask, 1.0, lam_rows)

    assert advantages.dtype == returns.dtype == torch.bfloat16
    for got, want in ((advantages, want_adv), (returns, want_ret)):
        torch.testing.assert_close(got.double(), torch.tensor(want, dtype=torch.float64), rtol=2**-8, atol=0)


def test_skip_gae_equals_plain_gae_without_observations():
    rng = random.Random(3)
    values = torch.tensor([[rng.gauss(0, 1) for _ in range(10)] for _ in range(3)], dtype=torch.float64)
    rewards = torch.zeros(3, 10, dtype=torch.float64)
    rewards[:, 7] = torch.tensor([1.0, -1.0, 0.5], dtype=torch.float64)
    mask = torch.zeros(3, 10, dtype=torch.bool)
    mask[:, 2:8] = True
    skip = skip_observation_gae(rewards, values, mask, 0.99, 0.9)
    plain = gae(rewards, values, mask, 0.99, 0.9)
    torch.testing.assert_close(skip[0], plain[0])
    torch.testing.assert_close(skip[1], plain[1])


@pytest.mark.parametrize("normalize_std", [False, True])
@pytest.mark.parametrize("seed", range(5))
def test_group_advantages_match_reference(seed, normalize_std):
    rng = random.Random(seed)
    n = rng.randint(1, 20)
    groups = [f"g{rng.randint(0, 4)}" for _ in range(n)]
    rewards = [rng.choice([0.0, 1.0, rng.gauss(0, 1)]) for _ in range(n)]
    want = []
    for i in range(n):
        members = [rewards[j] for j in range(n) if groups[j] == groups[i]]
        mean = sum(members) / len(members)
        centered = rewards[i] - mean
        if normalize_std:
            var = sum((x - mean) ** 2 for x in members) / max(len(members) - 1, 1)
            centered /= math.sqrt(var) + 1e-6
        want.append(centered)
    got = group_advantages(torch.tensor(rewards), groups, normalize_std=normalize_std)
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float32), atol=1e-5, rtol=1e-5)


def reference_execution_group_advantages(rewards, groups, executions, weights, normalize_std):
    """Row by row, as group_advantages' docstring says: each execution of a group weighs 1,
    shared by its rows in proportion to their weights (equally when those sum to 0)."""
    share = []
    for i in range(len(rewards)):
        rows = [j for j in range(len(rewards)) if (groups[j], executions[j]) == (groups[i], executions[i])]
        total = sum(weights[j] for j in rows)
        share.append(weights[i] / total if total > 0 else 1 / len(rows))
    want = []
    for i in range(len(rewards)):
        members = [j for j in range(len(rewards)) if groups[j] == groups[i]]
        n = len({executions[j] for j in members})
        if n == 1:
            want.append(0.0)
            continue
        mean = sum(share[j] * rewards[j] for j in members) / n
        centered = rewards[i] - mean
        if normalize_std:
            var = sum(share[j] * (rewards[j] - mean) ** 2 for j in members) / (n - 1)
            centered /= math.sqrt(var) + 1e-6
        want.append(centered)
    return want


@pytest.mark.parametrize("normalize_std", [False, True])
@pytest.mark.parametrize("seed", range(8))
def test_group_advantages_over_executions_match_reference(seed, normalize_std):
    rng = random.Random(seed)
    n = rng.randint(1, 24)
    executions = [f"e{rng.randint(0, 7)}" for _ in range(n)]
    group_of_execution = {e: f"g{rng.randint(0, 2)}" for e in executions}
    groups = [group_of_execution[e] for e in executions]
    rewards = [rng.choice([0.0, 1.0, rng.gauss(0, 1)]) for _ in range(n)]
    weights = [rng.choice([0.0, rng.random()]) for _ in range(n)]
    want = reference_execution_group_advantages(rewards, groups, executions, weights, normalize_std)
    got = group_advantages(
        torch.tensor(rewards),
        groups,
        normalize_std=normalize_std,
        execution_ids=executions,
        weights=torch.tensor(weights),
    )
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float32), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("normalize_std", [False, True])
def test_a_branching_execution_whose_leaves_share_its_reward_counts_as_one_rollout(normalize_std):
    # rollouts a (3 leaves), b (1), c (2) of one prompt with rewards 1, 0, 0.5: the rows'
    # advantages are those of the three rollouts, unbranched
    executions = ["a", "a", "b", "a", "c", "c"]
    per_execution = {"a": 1.0, "b": 0.0, "c": 0.5}
    rows = group_advantages(
        torch.tensor([per_execution[e] for e in executions]),
        ["g"] * 6,
        normalize_std=normalize_std,
        execution_ids=executions,
        weights=torch.tensor([0.2, 0.5, 1.0, 0.3, 0.9, 0.1]),
    )
    unbranched = group_advantages(torch.tensor(list(per_execution.values())), ["g"] * 3, normalize_std)
    want = torch.stack([unbranched[list(per_execution).index(e)] for e in executions])
    torch.testing.assert_close(rows, want)


@pytest.mark.parametrize("reward", [0.1, 3.3, 1000.1])
def test_a_group_of_equal_rewards_has_zero_advantage_with_std_normalization(reward):
    # the float32 mean of seven equal rewards misses them by an ulp; divided by the std of
    # those ulps it would give every row an advantage near ±1
    executions = [f"e{i}" for i in range(7)]
    plain = group_advantages(torch.full((7,), reward), ["g"] * 7, normalize_std=True)
    branched = group_advantages(
        torch.full((8,), reward),
        ["g"] * 8,
        normalize_std=True,
        execution_ids=[*executions, "e0"],
        weights=torch.tensor([0.3, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.7]),
    )
    assert torch.equal(plain, torch.zeros(7))
    assert torch.equal(branched, torch.zeros(8))


@pytest.mark.parametrize("spread", [1e-3, 1e-4])
def test_group_advantages_default_eps_shows_on_a_narrow_group(spread):
    # rewards 0, s, 2s: mean s, unbiased std s, so the default eps = 1e-6 is a visible share of it
    rewards = torch.tensor([0.0, spread, 2 * spread])
    values = rewards.tolist()
    mean = sum(values) / 3
    std = math.sqrt(sum((x - mean) ** 2 for x in values) / 2)
    want = [(x - mean) / (std + 1e-6) for x in values]
    got = group_advantages(rewards, ["g"] * 3, normalize_std=True)
    torch.testing.assert_close(got, torch.tensor(want), rtol=1e-4, atol=0.0)


def test_group_advantages_accepts_tensor_ids_and_checks_length():
    got = group_advantages(torch.tensor([1.0, 0.0, 3.0]), torch.tensor([7, 7, 2]))
    torch.testing.assert_close(got, torch.tensor([0.5, -0.5, 0.0]))
    with pytest.raises(ValueError, match="group ids"):
        group_advantages(torch.tensor([1.0, 0.0]), ["a"])
    with pytest.raises(ValueError, match="execution ids"):
        group_advantages(torch.tensor([1.0, 0.0]), ["a", "a"], execution_ids=["x"])
    with pytest.raises(ValueError, match="weights"):
        group_advantages(torch.tensor([1.0, 0.0]), ["a", "a"], weights=torch.ones(3))


def test_adaptive_lambda_formula():
    # up to α·L = 500: λ = 0.998, so an upper bound below 1 would show
    lengths = torch.tensor([1, 20, 100, 1000, 10_000])
    got = adaptive_lambda(lengths, alpha=0.05)
    want = [max(0.0, 1 - 1 / (0.05 * n)) for n in (1, 20, 100, 1000, 10_000)]
    torch.testing.assert_close(got, torch.tensor(want))
    with pytest.raises(ValueError, match="alpha"):
        adaptive_lambda(lengths, alpha=0.0)


def test_group_advantages_takes_execution_ids_as_a_tensor_like_group_ids():
    # a tensor's elements hash by identity: taken one by one, every row was an execution of its own
    rewards, groups = torch.tensor([1.0, 1.0, 0.0]), torch.tensor([5, 5, 5])
    as_list = group_advantages(rewards, groups, execution_ids=[0, 0, 1])
    as_tensor = group_advantages(rewards, groups, execution_ids=torch.tensor([0, 0, 1]))
    torch.testing.assert_close(as_tensor, as_list)
    torch.testing.assert_close(as_list, torch.tensor([0.5, 0.5, -0.5]))
