"""Supervised warm start: next-token cross-entropy on demonstration actions.

Demonstrations arrive as token sequences with a loss mask (true on the tokens the
policy should learn to produce), built by the caller exactly as the gateway builds
rollouts, so the warm-started policy sees the same token layout in RL.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from rl.batching import micro_batches
from rl.config import SFTConfig
from rl.logprobs import token_logprobs


def pad_batch(
    sequences: Sequence[Sequence[int]], masks: Sequence[Sequence[bool]], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-pad token sequences.

    Returns:
        input_ids: (B, T) int64, attention_mask: (B, T) bool, loss_mask: (B, T) bool.
    """
    length = max(len(s) for s in sequences)
    input_ids = torch.full((len(sequences), length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(sequences), length), dtype=torch.bool)
    loss_mask = torch.zeros((len(sequences), length), dtype=torch.bool)
    for row, (tokens, mask) in enumerate(zip(sequences, masks, strict=True)):
        input_ids[row, : len(tokens)] = torch.as_tensor(tokens, dtype=torch.long)
        attention_mask[row, : len(tokens)] = True
        loss_mask[row, : len(tokens)] = torch.as_tensor(mask, dtype=torch.bool)
    return input_ids, attention_mask, loss_mask


def masked_nll(token_logp: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Mean negative log-likelihood of the masked tokens.

    Args:
        token_logp: (B, T) log-prob of each token given the ones before it
            (:func:`~rl.logprobs.token_logprobs`).
        loss_mask: (B, T) true on tokens whose prediction is trained (position 0, which
            nothing predicts, is never trained).
    Returns:
        scalar loss (0 when nothing is masked in).
    """
    target_mask = loss_mask[:, 1:]
    count = target_mask.sum().clamp(min=1)
    return -(token_logp[:, 1:] * target_mask).sum() / count


def length_bucketed_batches(
    lengths: Sequence[int], batch_size: int, generator: torch.Generator, pool_batches: int = 32
) -> list[list[int]]:
    """One epoch of index batches, each drawn from similar lengths so little is padding.

    The indices are shuffled, cut into pools of ``pool_batches`` batches, each pool sorted
    by length and cut into batches; the batch order is shuffled again.
    """
    order = torch.randperm(len(lengths), generator=generator).tolist()
    pool = batch_size * pool_batches
    batches = []
    for start in range(0, len(order), pool):
        chunk = sorted(order[start : start + pool], key=lambda i: lengths[i])
        batches += [chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size)]
    return [batches[i] for i in torch.randperm(len(batches), generator=generator).tolist()]


def supervised_warm_start(
    model: torch.nn.Module,
    sequences: Sequence[Sequence[int]],
    masks: Sequence[Sequence[bool]],
    pad_id: int,
    config: SFTConfig,
    on_step: Callable[[int, float], None] | None = None,
) -> list[float]:
    """Train ``model`` on demonstrations; return the loss of every step.

    Args:
        sequences: token ids of each demonstration (prompt, actions, observations).
        masks: per-token loss mask of each demonstration, true on action tokens.
    """
    if not sequences:
        raise ValueError("no demonstrations to train on")
    if len(masks) != len(sequences):
        raise ValueError(f"{len(sequences)} demonstrations but {len(masks)} loss masks")
    # positions past the model's table: an IndexError deep in torch where they are learned
    # (GPT-2), positions no engine serves where they are computed (RoPE)
    positions = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    # ids past the embedding (a tokenizer's tokens added without resizing the model): an
    # IndexError deep in torch on CPU, a device-side assert on a GPU
    rows = model.get_input_embeddings().num_embeddings
    if pad_id is None or not 0 <= pad_id < rows:  # None: a tokenizer's pad_token_id where it has none
        raise ValueError(
            f"pad_id {pad_id} is no row of the {rows} of the model's input embedding: pad with "
            "rl.models.padding_id(tokenizer, model)"
        )
    for index, (tokens, mask) in enumerate(zip(sequences, masks, strict=True)):
        # a batch of only empty rows is a reshape error deep in the model's attention
        if not tokens:
            raise ValueError(f"demonstration {index} has no tokens")
        outside = [token for token in tokens if not 0 <= token < rows]
        if outside:
            raise ValueError(
                f"demonstration {index} holds token id {outside[0]}, outside the {rows} rows of the "
                "model's input embedding"
            )
        if positions is not None and len(tokens) > positions:
            raise ValueError(
                f"demonstration {index} has {len(tokens)} tokens, more than the {positions} positions "
                "of the model (max_position_embeddings)"
            )
        # a mask of another length is not an error to pad_batch: one of length 1 broadcasts
        # over the whole demonstration, training on every token
        if len(mask) != len(tokens):
            raise ValueError(
                f"demonstration {index} has {len(tokens)} tokens but {len(mask)} loss-mask entries"
            )
    # position 0 is never trained (nothing predicts it): with no other token masked in, every
    # loss is 0 and the policy would be published as warm-started without having learned
    if not any(any(mask[1:]) for mask in masks):
        raise ValueError(
            f"no demonstration has a token to train: the loss masks of all {len(masks)} are false "
            "on every token after the first"
        )
    generator = torch.Generator().manual_seed(config.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    device = next(model.parameters()).device
    model.train()
    losses: list[float] = []
    started = time.monotonic()
    lengths = [len(s) for s in sequences]
    batches: list[list[int]] = []
    # dropout draws its masks from the global generators: seeded here, so that the seed gives
    # the same run whatever was drawn before; the caller's generators are left as they were
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.random.default_generator.manual_seed(config.seed)
        if device.type == "cuda":
            with torch.cuda.device(device):
                torch.cuda.manual_seed(config.seed)
        for step in range(config.max_steps):
            if not batches:
                batches = length_bucketed_batches(lengths, config.batch_size, generator)
            picked = batches.pop()
            # each part's mean weighed by its share of the step's trained tokens: the loss and
            # gradient of the whole batch in one pass
            counts = {i: sum(masks[i][1:]) for i in picked}
            total = max(sum(counts.values()), 1)
            optimizer.zero_grad(set_to_none=True)
            loss = 0.0
            for part in micro_batches(picked, config.micro_token_budget, tokens=lengths.__getitem__):
                trained = sum(counts[i] for i in part)
                if not trained:
                    continue
                input_ids, attention_mask, loss_mask = pad_batch(
                    [sequences[i] for i in part], [masks[i] for i in part], pad_id
                )
                loss_mask = loss_mask.to(device)
                token_logp = token_logprobs(
                    model, input_ids.to(device), attention_mask.to(device), where=loss_mask
                )
                part_loss = masked_nll(token_logp, loss_mask) * (trained / total)
                part_loss.backward()
                loss += part_loss.item()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            losses.append(loss)
            if on_step is not None:
                on_step(step, losses[-1])
            # checked after a step: a budget spent before the first would leave no loss to report
            if time.monotonic() - started > config.max_seconds:
                break
    model.eval()
    return losses
