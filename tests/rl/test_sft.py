"""Supervised warm start: length-bucketed batches and masked next-token loss."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from rl.config import SFTConfig, TinyModelConfig
from rl.models import build_tiny_model
from rl.sft import length_bucketed_batches, masked_nll, supervised_warm_start
from tests.rl.architectures import tiny_causal_lm

SMALL = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64)


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


@pytest.mark.parametrize(
    ("masks", "message"),
    [
        ([[True]] * 2, "demonstration 0 has 5 tokens but 1 loss-mask entries"),
        ([[False] * 5, [True] * 4], "demonstration 1 has 3 tokens but 4 loss-mask entries"),
        ([[False] * 5], "2 demonstrations but 1 loss masks"),
    ],
)
def test_loss_masks_that_do_not_fit_their_demonstrations_are_refused(masks, message):
    """A mask of length 1 broadcast over its whole demonstration and trained every token of it."""
    model, _ = build_tiny_model(SMALL)
    before = {name: p.clone() for name, p in model.named_parameters()}
    with pytest.raises(ValueError, match=message):
        supervised_warm_start(model, [[5, 6, 7, 8, 9], [5, 6, 7]], masks, 0, SFTConfig(max_steps=1))
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())


def test_a_budget_spent_before_the_first_step_still_trains_one():
    """The warm start reports its first and last loss: a ``max_seconds`` that runs out at
    once still gives one step, not an empty list."""
    model, _ = build_tiny_model(SMALL)
    losses = supervised_warm_start(
        model, [[5, 6, 7, 8, 9]], [[False, False, True, True, True]], 0, SFTConfig(max_seconds=1e-12)
    )
    assert len(losses) == 1


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_a_demonstration_longer_than_the_models_positions_is_refused(arch):
    """GPT-2's learned position table raised an IndexError deep in torch; Llama's RoPE trained
    without a word on positions the engine never serves."""
    model = tiny_causal_lm(arch, vocab_size=64)  # max_position_embeddings 64
    before = {name: p.clone() for name, p in model.named_parameters()}
    sequences = [[5] * 64, [5] * 65]
    masks = [[False] * 32 + [True] * 32, [False] * 32 + [True] * 33]
    with pytest.raises(ValueError, match="demonstration 1 has 65 tokens, more than the 64 positions"):
        supervised_warm_start(model, sequences, masks, 0, SFTConfig(max_steps=1))
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())
    assert len(supervised_warm_start(model, sequences[:1], masks[:1], 0, SFTConfig(max_steps=1))) == 1


@pytest.mark.parametrize("token", [512, -1])
def test_a_demonstration_holding_a_token_id_outside_the_models_embedding_is_refused(token):
    """A tokenizer with tokens added past the model's embedding (its own chat tokens, a pad
    token, without resizing the model) gave an IndexError deep in torch on CPU and a
    device-side assert on a GPU, naming neither the demonstration nor the id."""
    model, _ = build_tiny_model(SMALL)
    rows = model.get_input_embeddings().num_embeddings
    assert rows == 512
    before = {name: p.clone() for name, p in model.named_parameters()}
    sequences = [[5, 6, 7], [5, token, 7, 8]]
    masks = [[False, True, True], [False, True, True, True]]
    with pytest.raises(ValueError, match=rf"demonstration 1 holds token id {token}, outside the 512 rows"):
        supervised_warm_start(model, sequences, masks, 0, SFTConfig(max_steps=1))
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())


def test_the_seed_makes_a_warm_start_reproducible_whatever_ran_before_it():
    """A model with dropout (GPT-2's 0.1) drew its masks from the process's global generator:
    the same demonstrations under the same seed gave other weights after other random draws."""
    model = tiny_causal_lm("gpt2", vocab_size=64)
    assert model.config.resid_pdrop > 0
    rng = random.Random(0)
    sequences = [[rng.randrange(3, 64) for _ in range(rng.randint(4, 20))] for _ in range(6)]
    masks = [[index > 1 for index in range(len(tokens))] for tokens in sequences]
    runs = []
    for draws_before in (1, 2):
        torch.manual_seed(draws_before)
        trained = copy.deepcopy(model)
        losses = supervised_warm_start(trained, sequences, masks, 0, SFTConfig(max_steps=3, batch_size=4))
        runs.append((losses, trained.state_dict()))
    (losses, weights), (again, weights_again) = runs
    assert losses == again
    assert all(torch.equal(weights[name], weights_again[name]) for name in weights)


def test_an_empty_demonstration_is_refused_naming_it():
    """A batch drawing only empty demonstrations failed deep in the model's attention with a
    reshape error naming neither the demonstration nor what was wrong with it."""
    model, _ = build_tiny_model(SMALL)
    before = {name: p.clone() for name, p in model.named_parameters()}
    with pytest.raises(ValueError, match="demonstration 1 has no tokens"):
        supervised_warm_start(model, [[5, 6, 7], []], [[False, True, True], []], 0, SFTConfig(batch_size=1))
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())


def test_demonstrations_whose_masks_train_no_token_are_refused():
    """Loss masks false everywhere (or true only on position 0, which nothing predicts) gave a
    loss of 0 at every step: the warm start reported 0.000 → 0.000 and the policy was published
    as warm-started without having learned anything."""
    model, _ = build_tiny_model(SMALL)
    before = {name: p.clone() for name, p in model.named_parameters()}
    sequences = [[5, 6, 7], [5, 6, 7, 8]]
    masks = [[True, False, False], [False] * 4]
    with pytest.raises(ValueError, match="no demonstration has a token to train"):
        supervised_warm_start(model, sequences, masks, 0, SFTConfig(max_steps=2))
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())
    masks[1][3] = True
    assert len(supervised_warm_start(model, sequences, masks, 0, SFTConfig(max_steps=2))) == 2


def test_a_step_runs_its_demonstrations_in_micro_batches_within_the_token_budget():
    """A step ran its ``batch_size`` demonstrations in one forward pass whatever their length:
    64 code demonstrations of 300 tokens are 19,200 at once, some 60 GiB of activations for
    Qwen3-0.6B in float32 (configs/qwen3-0.6b-gpu.yaml's count), where the trainer keeps to its
    ``micro_token_budget``. A step now accumulates gradients over micro-batches of at most
    ``micro_token_budget`` padded tokens, to the loss and gradient of a slow reference: the
    whole batch, one demonstration and one token at a time."""
    model, _ = build_tiny_model(SMALL)
    rng = random.Random(0)
    sequences = [[rng.randrange(4, 500) for _ in range(rng.randint(5, 12))] for _ in range(6)]
    masks = [[index >= len(tokens) // 2 for index in range(len(tokens))] for tokens in sequences]
    masks[0] = [False] * len(sequences[0])  # one that trains nothing
    config = SFTConfig(max_steps=1, batch_size=6, micro_token_budget=24, lr=1e-2)
    reference = copy.deepcopy(model)
    reference.train()
    total, count = 0.0, 0
    for tokens, mask in zip(sequences, masks, strict=True):
        logits = reference(torch.tensor([tokens])).logits[0].float()
        for t in range(1, len(tokens)):
            if mask[t]:
                total = total - torch.log_softmax(logits[t - 1], -1)[tokens[t]]
                count += 1
    reference_loss = total / count
    optimizer = torch.optim.AdamW(reference.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    reference_loss.backward()
    torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
    optimizer.step()

    padded_tokens = []
    hook = lambda module, args: padded_tokens.append(args[0].numel())  # noqa: E731
    model.get_input_embeddings().register_forward_pre_hook(hook)
    losses = supervised_warm_start(model, sequences, masks, 0, config)
    assert padded_tokens and max(padded_tokens) <= 24
    assert losses == pytest.approx([reference_loss.item()], rel=1e-5)
    # the step's gradient (Adam's first step moves by ±lr wherever it is not 0, whatever its size)
    for (name, trained), expected in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.allclose(trained.grad, expected.grad, rtol=1e-4, atol=1e-7), name


@pytest.mark.parametrize("pad_id", [512, None])
def test_a_padding_id_outside_the_models_embedding_is_refused(pad_id):
    """A tokenizer's own pad token added without resizing the model (Llama 3 given '<|pad|>')
    gave an IndexError deep in torch at the first batch of demonstrations of two lengths (a
    device-side assert on a GPU), and one without a pad token (None) a TypeError from
    torch.full; neither named the padding id."""
    model, _ = build_tiny_model(SMALL)
    before = {name: p.clone() for name, p in model.named_parameters()}
    sequences = [[5, 6, 7], [5, 6, 7, 8]]
    masks = [[False, True, True], [False, True, True, True]]
    with pytest.raises(
        ValueError, match=rf"pad_id {pad_id} is no row of the 512 of the model's input embedding"
    ):
        supervised_warm_start(model, sequences, masks, pad_id, SFTConfig(max_steps=1))
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())
