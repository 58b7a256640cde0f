"""DIS policy loss and value loss against references written out here, and the DIS
gradient on a toy softmax policy against its analytic form."""

from __future__ import annotations

import math
import random

import pytest
import torch

from rl.losses import dis_policy_loss, value_loss


def reference_dis(logprobs, rollout, advantages, mask, eps_low, eps_high, weight=None):
    total, n, masked, ratios, k3 = 0.0, 0, 0, [], []
    for b in range(len(logprobs)):
        for t in range(len(logprobs[b])):
            if not mask[b][t]:
                continue
            n += 1
            r = math.exp(logprobs[b][t] - rollout[b][t])
            ratios.append(r)
            k3.append((r - 1) - math.log(r))
            f = r if 1 - eps_low < r < 1 + eps_high else 0.0
            masked += f == 0.0
            w = 1.0 if weight is None else weight[b][t]
            total += f * w * advantages[b][t] * logprobs[b][t]
    return -total / max(n, 1), masked / n, sum(ratios) / n, sum(k3) / n


@pytest.mark.parametrize("with_weight", [False, True])
@pytest.mark.parametrize("seed", range(8))
def test_dis_loss_matches_reference(seed, with_weight):
    rng = random.Random(seed)
    batch, length = rng.randint(1, 5), rng.randint(1, 12)
    rollout = [[-rng.uniform(0.01, 4) for _ in range(length)] for _ in range(batch)]
    # spread the ratios widely so both sides of the interval are hit
    logprobs = [[min(-1e-3, r + rng.uniform(-2.0, 2.0)) for r in row] for row in rollout]
    advantages = [[rng.gauss(0, 1) for _ in range(length)] for _ in range(batch)]
    mask = [[rng.random() < 0.7 for _ in range(length)] for _ in range(batch)]
    mask[0][0] = True
    weight = [[rng.uniform(0, 2) for _ in range(length)] for _ in range(batch)] if with_weight else None

    loss, stats = dis_policy_loss(
        torch.tensor(logprobs, dtype=torch.float64),
        torch.tensor(rollout, dtype=torch.float64),
        torch.tensor(advantages, dtype=torch.float64),
        torch.tensor(mask),
        0.3,
        5.0,
        loss_weight=torch.tensor(weight, dtype=torch.float64) if with_weight else None,
    )
    want_loss, want_masked, want_ratio, want_kl = reference_dis(
        logprobs, rollout, advantages, mask, 0.3, 5.0, weight
    )
    assert loss.item() == pytest.approx(want_loss, rel=1e-9, abs=1e-12)
    assert stats["masked_fraction"] == pytest.approx(want_masked)
    assert stats["mean_ratio"] == pytest.approx(want_ratio)
    assert stats["kl"] == pytest.approx(want_kl)
    assert stats["num_tokens"] == sum(map(sum, mask))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("seed", range(6))
def test_dis_loss_of_any_float_dtype_matches_the_reference_on_its_values(seed, dtype):
    # rows of length 1, all-masked rows and single action tokens among them
    rng = random.Random(seed)
    batch, length = rng.randint(1, 5), rng.choice([1, 2, rng.randint(3, 40)])
    rollout = [[-rng.uniform(0.01, 30) for _ in range(length)] for _ in range(batch)]
    logprobs = [[min(-1e-3, r + rng.uniform(-3.0, 3.0)) for r in row] for row in rollout]
    advantages = [[rng.gauss(0, 1) for _ in range(length)] for _ in range(batch)]
    mask = [[rng.random() < 0.6 for _ in range(length)] for _ in range(batch)]
    mask[0] = [t == length - 1 for t in range(length)]
    if batch > 1:
        mask[1] = [False] * length
    logprobs_t = torch.tensor(logprobs, dtype=dtype, requires_grad=True)
    loss, stats = dis_policy_loss(
        logprobs_t, torch.tensor(rollout), torch.tensor(advantages), torch.tensor(mask), 0.3, 5.0
    )
    loss.backward()
    want_loss, want_masked, want_ratio, want_kl = reference_dis(
        logprobs_t.detach().double().tolist(), rollout, advantages, mask, 0.3, 5.0
    )
    assert loss.item() == pytest.approx(want_loss, rel=1e-5, abs=1e-7)
    assert stats["masked_fraction"] == pytest.approx(want_masked)
    assert stats["mean_ratio"] == pytest.approx(want_ratio, rel=1e-5)
    assert stats["kl"] == pytest.approx(want_kl, rel=1e-5)
    assert torch.isfinite(logprobs_t.grad).all()


def test_dis_interval_is_open_and_padding_cannot_poison_the_loss():
    rollout = torch.zeros(1, 4, dtype=torch.float64)
    # ratios exactly 0.7, 6.0 (both borders: masked), 1.0 (kept), and a -inf pad position
    logprobs = torch.tensor([[math.log(0.7), math.log(6.0), 0.0, -math.inf]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True, False]])
    loss, stats = dis_policy_loss(logprobs, rollout, torch.ones(1, 4, dtype=torch.float64), mask, 0.3, 5.0)
    assert stats["masked_fraction"] == pytest.approx(2 / 3)
    assert stats["masked_low"] == pytest.approx(1 / 3) and stats["masked_high"] == pytest.approx(1 / 3)
    assert loss.item() == pytest.approx(0.0)
    assert math.isfinite(loss.item())


def test_dis_non_finite_values_on_tokens_outside_the_loss_leave_it_finite():
    # token 0 is kept (ratio 1); token 1 is an action the interval masks for its -inf
    # log-prob; tokens 2 and 3 are padding with a NaN advantage and a NaN weight
    logprobs = torch.tensor([[-1.0, -math.inf, -1.0, -1.0]], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[True, True, False, False]])
    advantages = torch.tensor([[2.0, 1.0, math.nan, 1.0]], dtype=torch.float64)
    weight = torch.tensor([[1.0, 1.0, 1.0, math.nan]], dtype=torch.float64)
    loss, stats = dis_policy_loss(
        logprobs,
        torch.full((1, 4), -1.0, dtype=torch.float64),
        advantages,
        mask,
        0.3,
        5.0,
        loss_weight=weight,
    )
    loss.backward()
    assert stats["masked_low"] == pytest.approx(0.5)
    assert loss.item() == pytest.approx(-(2.0 * -1.0) / 2)
    assert logprobs.grad.tolist() == [[-1.0, 0.0, 0.0, 0.0]]


def test_dis_ratio_statistics_are_over_the_action_tokens_only():
    # every action ratio is below 1 (0.8, 0.5); the padding's ratio would read as exp(0) = 1
    logprobs = torch.tensor([[math.log(0.8), math.log(0.5), -3.0, -0.1]], dtype=torch.float64)
    mask = torch.tensor([[True, True, False, False]])
    _, stats = dis_policy_loss(
        logprobs,
        torch.zeros(1, 4, dtype=torch.float64),
        torch.ones(1, 4, dtype=torch.float64),
        mask,
        0.3,
        5.0,
    )
    assert stats["max_ratio"] == pytest.approx(0.8)
    assert stats["mean_ratio"] == pytest.approx(0.65)
    assert stats["masked_low"] == pytest.approx(0.5) and stats["masked_high"] == 0.0


@pytest.mark.parametrize("log_ratio", [0.0, 1e-6, 1e-4, -3e-4, 1e-2])
def test_dis_kl_of_near_on_policy_tokens_is_not_float32_rounding(log_ratio):
    # k3 = e^x − 1 − x ≈ x²/2 is far below float32's step near 1 (1.2e-7) when the trainer
    # and the engine nearly agree: worked out as (r − 1) − log r in float32 it read 0 for
    # x = 1e-4 (true 5e-9) and could be negative
    rollout = torch.full((1, 3), -1.5)
    logprobs = rollout + torch.tensor([[log_ratio, log_ratio / 2, -log_ratio]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    _, stats = dis_policy_loss(logprobs, rollout, torch.ones(1, 3), mask, 0.3, 5.0)
    ratios = (logprobs.double() - rollout.double())[0].tolist()
    want = sum(math.expm1(x) - x for x in ratios) / 3
    assert stats["kl"] >= 0.0
    assert stats["kl"] == pytest.approx(want, rel=1e-6, abs=1e-30)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dis_low_precision_log_probs_keep_the_rollouts_float32_precision(dtype):
    # the float32 rollout log-probs were rounded to the policy's dtype before the ratio:
    # in bfloat16 −20.06 reads −20.0 (a 6% weight lost) and −2.645 reads −2.641, pushing a
    # ratio of 0.701 below the interval's 0.7; in float16 e^12 overflowed, giving an
    # infinite KL
    logprobs = torch.tensor([[-20.0, -3.0, -1.0]], dtype=dtype)
    rollout = torch.tensor([[-20.06, -2.645, -13.0]])
    advantages = torch.tensor([[1.0, -2.0, 0.5]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    loss, stats = dis_policy_loss(logprobs, rollout, advantages, mask, 0.3, 5.0)
    want_loss, want_masked, want_ratio, want_kl = reference_dis(
        logprobs.double().tolist(), rollout.double().tolist(), advantages.tolist(), mask.tolist(), 0.3, 5.0
    )
    assert stats["masked_fraction"] == pytest.approx(want_masked) == 1 / 3
    assert loss.item() == pytest.approx(want_loss, rel=1e-6)
    assert stats["mean_ratio"] == pytest.approx(want_ratio, rel=1e-6)
    assert stats["kl"] == pytest.approx(want_kl, rel=1e-6)


def test_dis_a_log_ratio_past_float32s_exp_masks_the_token_and_keeps_the_statistics_finite():
    # e^100 overflows float32: the token is masked either way, but its ratio and k3 read inf
    logprobs = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    rollout = torch.tensor([[-101.0, -2.0]])
    loss, stats = dis_policy_loss(
        logprobs, rollout, torch.ones(1, 2), torch.ones(1, 2, dtype=torch.bool), 0.3, 5.0
    )
    loss.backward()
    assert stats["masked_high"] == 0.5 and loss.item() == pytest.approx(1.0)
    assert logprobs.grad.tolist() == [[0.0, -0.5]]
    assert stats["max_ratio"] == pytest.approx(math.exp(100.0))
    assert stats["mean_ratio"] == pytest.approx((math.exp(100.0) + 1.0) / 2)
    assert stats["kl"] == pytest.approx((math.expm1(100.0) - 100.0) / 2)


def test_dis_all_masked_gives_zero_loss_with_a_graph():
    logprobs = torch.randn(2, 3, requires_grad=True)
    loss, stats = dis_policy_loss(
        logprobs, torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2, 3, dtype=torch.bool), 0.3, 5.0
    )
    loss.backward()
    assert loss.item() == 0.0 and stats["num_tokens"] == 0.0
    assert torch.all(logprobs.grad == 0)


@pytest.mark.parametrize(("ratio", "side"), [(0.5, "masked_low"), (7.0, "masked_high")])
def test_dis_statistics_of_a_single_action_token_outside_the_interval(ratio, side):
    # one action token, masked: every fraction is over that one token
    logprobs = torch.tensor([[0.0, math.log(ratio)]], dtype=torch.float64)
    mask = torch.tensor([[False, True]])
    loss, stats = dis_policy_loss(
        logprobs,
        torch.zeros(1, 2, dtype=torch.float64),
        torch.ones(1, 2, dtype=torch.float64),
        mask,
        0.3,
        5.0,
    )
    other = "masked_high" if side == "masked_low" else "masked_low"
    assert stats[side] == 1.0 and stats[other] == 0.0 and stats["masked_fraction"] == 1.0
    assert stats["max_ratio"] == pytest.approx(ratio) and stats["num_tokens"] == 1.0
    assert loss.item() == 0.0


@pytest.mark.parametrize(
    ("eps_low", "eps_high"), [(0.0, 5.0), (-0.1, 5.0), (1.5, 5.0), (0.3, 0.0), (0.3, -1.0)]
)
def test_dis_rejects_an_empty_or_inverted_trust_interval(eps_low, eps_high):
    with pytest.raises(ValueError, match="need 0 < eps_low <= 1 and eps_high > 0"):
        dis_policy_loss(
            torch.zeros(1, 2),
            torch.zeros(1, 2),
            torch.ones(1, 2),
            torch.ones(1, 2, dtype=torch.bool),
            eps_low,
            eps_high,
        )


def test_dis_accepts_an_eps_low_of_one_as_no_lower_bound():
    # ε_low = 1: every ratio > 0 is inside on the low side
    logprobs = torch.tensor([[0.0, math.log(1e-3)]], dtype=torch.float64)
    _, stats = dis_policy_loss(
        logprobs,
        torch.zeros(1, 2, dtype=torch.float64),
        torch.ones(1, 2, dtype=torch.float64),
        torch.tensor([[False, True]]),
        1.0,
        5.0,
    )
    assert stats["masked_fraction"] == 0.0


def test_dis_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="share one"):
        dis_policy_loss(
            torch.zeros(2, 3),
            torch.zeros(2, 4),
            torch.zeros(2, 3),
            torch.ones(2, 3, dtype=torch.bool),
            0.3,
            5.0,
        )


@pytest.mark.parametrize("seed", range(4))
def test_dis_gradient_on_toy_softmax_policy_equals_analytic(seed):
    """π(a|x) = softmax(W x)_a. With r detached, ∂L/∂W = −Σ_t f(r_t)·w_t·A_t·(e_{a_t} − π(·|x_t)) x_tᵀ / N."""
    gen = torch.Generator().manual_seed(seed)
    batch, length, vocab, dim = 3, 5, 6, 4
    weights = torch.randn(vocab, dim, generator=gen, dtype=torch.float64, requires_grad=True)
    states = torch.randn(batch, length, dim, generator=gen, dtype=torch.float64)
    actions = torch.randint(0, vocab, (batch, length), generator=gen)
    advantages = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    mask = torch.rand(batch, length, generator=gen) < 0.8
    loss_weight = torch.rand(batch, length, generator=gen, dtype=torch.float64)
    probs = torch.softmax(states @ weights.detach().T, dim=-1)  # (B, T, V)
    logp_taken = torch.log(probs.gather(-1, actions[..., None]))[..., 0]
    # rollout log-probs so that some ratios fall outside (0.7, 6)
    rollout = logp_taken + torch.randn(batch, length, generator=gen, dtype=torch.float64)

    logprobs = torch.log_softmax(states @ weights.T, dim=-1).gather(-1, actions[..., None])[..., 0]
    loss, _ = dis_policy_loss(logprobs, rollout, advantages, mask, 0.3, 5.0, loss_weight=loss_weight)
    loss.backward()

    ratio = torch.exp(logp_taken - rollout)
    f = torch.where((ratio > 0.7) & (ratio < 6.0) & mask, ratio, torch.zeros_like(ratio))
    coeff = -(f * loss_weight * advantages) / mask.sum()  # (B, T)
    onehot = torch.nn.functional.one_hot(actions, vocab).double()
    analytic = torch.einsum("bt,btv,btd->vd", coeff, onehot - probs, states)
    torch.testing.assert_close(weights.grad, analytic)


def reference_value_loss(values, returns, mask, old, clip):
    total, n = 0.0, 0
    for b in range(len(values)):
        for t in range(len(values[b])):
            if not mask[b][t]:
                continue
            n += 1
            err = (values[b][t] - returns[b][t]) ** 2
            if clip is not None:
                clipped = old[b][t] + max(-clip, min(clip, values[b][t] - old[b][t]))
                err = max(err, (clipped - returns[b][t]) ** 2)
            total += err
    return 0.5 * total / max(n, 1)


@pytest.mark.parametrize("clip", [None, 0.2])
@pytest.mark.parametrize("seed", range(5))
def test_value_loss_matches_reference(seed, clip):
    rng = random.Random(seed)
    batch, length = rng.randint(1, 4), rng.randint(1, 10)
    values = [[rng.gauss(0, 1) for _ in range(length)] for _ in range(batch)]
    returns = [[rng.gauss(0, 1) for _ in range(length)] for _ in range(batch)]
    old = [[v + rng.gauss(0, 0.5) for v in row] for row in values]
    mask = [[rng.random() < 0.6 for _ in range(length)] for _ in range(batch)]
    loss, _ = value_loss(
        torch.tensor(values, dtype=torch.float64),
        torch.tensor(returns, dtype=torch.float64),
        torch.tensor(mask),
        old_values=torch.tensor(old, dtype=torch.float64),
        clip=clip,
    )
    assert loss.item() == pytest.approx(
        reference_value_loss(values, returns, mask, old, clip), rel=1e-9, abs=1e-12
    )


@pytest.mark.parametrize("clip", [None, 0.2])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_value_loss_of_low_precision_values_keeps_the_float32_targets(dtype, clip):
    # the float32 returns and old values were rounded to the values' dtype first: in bfloat16
    # a return of 100.3 read 100.5, and the error of a value of 100 grew from 0.3 to 0.5
    values = torch.tensor([[100.0, 2.0, 50.0, 7.0]], dtype=dtype, requires_grad=True)
    returns = torch.tensor([[100.3, 2.01, 49.0, 9.0]])
    old = torch.tensor([[100.2, 2.0, 50.5, 7.0]])  # with the clip, token 2's clipped error wins
    mask = torch.tensor([[True, True, True, False]])
    loss, stats = value_loss(values, returns, mask, old_values=old, clip=clip)
    loss.backward()
    as_lists = [t.detach().double().tolist() for t in (values, returns, mask, old)]
    assert loss.item() == pytest.approx(reference_value_loss(*as_lists, clip), rel=1e-5)
    want_grad = [(v - r) / 3 for v, r in zip(as_lists[0][0][:3], as_lists[1][0][:3], strict=True)]
    if clip is not None:
        want_grad[2] = 0.0
    assert values.grad[0, :3].double().tolist() == pytest.approx(want_grad, rel=1e-2)
    assert stats["explained_variance"] == pytest.approx(
        reference_explained_variance(as_lists[0], as_lists[1], mask.tolist()), rel=1e-6
    )


def test_explained_variance_of_a_single_action_token_is_zero_not_nan():
    # one masked token: no variance to explain (a sample variance of one value is NaN)
    values = torch.tensor([[0.3, -0.2, 1.0]], dtype=torch.float64)
    returns = torch.tensor([[1.0, 0.5, -1.0]], dtype=torch.float64)
    mask = torch.tensor([[False, True, False]])
    loss, stats = value_loss(values, returns, mask)
    assert stats["explained_variance"] == 0.0
    assert stats["explained_variance"] == reference_explained_variance(
        values.tolist(), returns.tolist(), mask.tolist()
    )
    assert loss.item() == pytest.approx(0.5 * 0.7**2)


def test_clipped_value_loss_needs_old_values():
    with pytest.raises(ValueError, match="old_values"):
        value_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool), clip=0.2)


@pytest.mark.parametrize("old_shape", [(2, 1), (3,)])
def test_clipped_value_loss_refuses_old_values_of_another_shape(old_shape):
    # broadcast against (2, 3), one old value per row (or per column) clipped every token silently
    values, mask = torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="old_values must be"):
        value_loss(values, torch.ones(2, 3), mask, old_values=torch.zeros(old_shape), clip=0.2)


def reference_explained_variance(values, returns, mask):
    pairs = [
        (v, r)
        for vr, rr, mr in zip(values, returns, mask, strict=True)
        for v, r, m in zip(vr, rr, mr, strict=True)
        if m
    ]
    n = len(pairs)
    if n < 2:
        return 0.0

    def var(xs):
        mean = sum(xs) / n
        return sum((x - mean) ** 2 for x in xs) / (n - 1)

    target_var = var([r for _, r in pairs])
    return 1.0 - var([r - v for v, r in pairs]) / target_var if target_var > 1e-8 else 0.0


@pytest.mark.parametrize("seed", range(5))
def test_explained_variance_matches_reference_and_is_zero_for_constant_returns(seed):
    rng = random.Random(seed)
    values = [[rng.gauss(0, 1) for _ in range(6)] for _ in range(3)]
    returns = [[v + rng.gauss(0, 0.5) for v in row] for row in values]
    mask = [[rng.random() < 0.7 for _ in range(6)] for _ in range(3)]
    mask[0][:2] = [True, True]
    _, stats = value_loss(torch.tensor(values), torch.tensor(returns), torch.tensor(mask))
    assert stats["explained_variance"] == pytest.approx(
        reference_explained_variance(values, returns, mask), rel=1e-4
    )
    # every return equal up to float rounding (a batch of all-successful rollouts): the
    # ratio would be of rounding errors, so it is reported as 0
    flat = torch.full((3, 6), 1.0) + torch.randn(3, 6) * 1e-7
    _, stats = value_loss(torch.tensor(values), flat, torch.tensor(mask))
    assert stats["explained_variance"] == 0.0


def test_clipped_value_loss_gradient_flows_through_the_clamped_delta_when_inside_the_clip():
    # old_values == values: every delta is 0, inside the clip, so the clipped branch is V
    # itself and the gradient is the plain (V − R)·mask / N with N = 2 masked tokens
    values = torch.tensor([[0.3, -0.2, 1.0]], dtype=torch.float64, requires_grad=True)
    returns = torch.tensor([[1.0, 0.5, -1.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, False]])
    loss, stats = value_loss(values, returns, mask, old_values=values.detach(), clip=0.2)
    loss.backward()
    torch.testing.assert_close(values.grad, torch.tensor([[-0.35, -0.35, 0.0]], dtype=torch.float64))
    assert loss.item() == pytest.approx(0.5 * (0.7**2 + 0.7**2) / 2)
    # neither error exceeds the other on any token: nothing counts as clipped
    assert stats["clip_fraction"] == 0.0


def test_clipped_value_loss_gradient_is_zero_where_the_clipped_branch_wins():
    # old = 0, clip = 0.2, N = 3:
    #   t0: V=0.5 → clipped 0.2; (0.2−1)² = 0.64 > (0.5−1)² = 0.25: clipped wins, grad 0
    #   t1: V=0.1 inside the clip → both errors (0.1−0.5)²: tie, grad (0.1−0.5)/3
    #   t2: V=0.5 → clipped 0.2; (0.5+1)² = 2.25 > (0.2+1)² = 1.44: unclipped wins, grad 1.5/3
    values = torch.tensor([[0.5, 0.1, 0.5]], dtype=torch.float64, requires_grad=True)
    returns = torch.tensor([[1.0, 0.5, -1.0]], dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.bool)
    old = torch.zeros(1, 3, dtype=torch.float64)
    loss, stats = value_loss(values, returns, mask, old_values=old, clip=0.2)
    loss.backward()
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, -0.4 / 3, 1.5 / 3]], dtype=torch.float64))
    assert loss.item() == pytest.approx(0.5 * (0.64 + 0.16 + 2.25) / 3)
    # only t0, where the clipped error is strictly the larger, counts
    assert stats["clip_fraction"] == pytest.approx(1 / 3)
