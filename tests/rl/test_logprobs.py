"""token_logprobs against the model's own full logits, value and gradient, chunked or not, at
the sampling temperature."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, Qwen3Config

import rl.logprobs
from rl.logprobs import token_logprobs
from tests.rl.architectures import ARCHITECTURES, tiny_causal_lm

VOCAB = 509  # prime, so no other dimension of these models equals it
HIDDEN = 32


def plain_head_model(config_class) -> torch.nn.Module:
    torch.manual_seed(0)
    config = config_class(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        tie_word_embeddings=config_class is Qwen3Config,
    )
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def gpt2_model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0
    )
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids ``(3, 20)``, their attention mask, and a random ``where``."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, VOCAB, (3, 20), generator=generator)
    attention_mask = torch.ones(3, 20, dtype=torch.bool)
    attention_mask[1, 14:] = False
    attention_mask[2, 7:] = False
    where = torch.rand(3, 20, generator=generator) < 0.6
    return input_ids, attention_mask, where


def reference(model, input_ids, attention_mask, where, temperature: float = 1.0) -> torch.Tensor:
    """Log-probs read one by one off the model's full logits divided by ``temperature``; 0 where
    not wanted."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask.long()).logits
    rows = []
    for b in range(input_ids.shape[0]):
        row = [torch.zeros(())]
        for t in range(1, input_ids.shape[1]):
            if where[b, t] and attention_mask[b, t]:
                row.append(
                    torch.log_softmax(logits[b, t - 1].double() / temperature, -1)[input_ids[b, t]].float()
                )
            else:
                row.append(torch.zeros(()))
        rows.append(torch.stack(row))
    return torch.stack(rows)


def gradients(model, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    "model_factory",
    [lambda: plain_head_model(LlamaConfig), lambda: plain_head_model(Qwen3Config), gpt2_model],
    ids=["llama", "qwen3", "gpt2-full-logits"],
)
@pytest.mark.parametrize("chunk_positions", [1, 5, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_log_probs_and_their_gradient_match_the_full_logits(
    monkeypatch, model_factory, chunk_positions, temperature
):
    monkeypatch.setattr(rl.logprobs, "LOGIT_CHUNK_ELEMENTS", chunk_positions * VOCAB)
    model = model_factory()
    input_ids, attention_mask, where = batch(seed=chunk_positions)
    weights = torch.randn(3, 20, generator=torch.Generator().manual_seed(1))

    ours = token_logprobs(model, input_ids, attention_mask, where=where, temperature=temperature)
    expected = reference(model, input_ids, attention_mask, where, temperature)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)
    assert ours.dtype == torch.float32 and ours.shape == (3, 20)

    ours_grad = gradients(
        model,
        (
            token_logprobs(model, input_ids, attention_mask, where=where, temperature=temperature) * weights
        ).sum(),
    )
    expected_grad = gradients(
        model, (reference(model, input_ids, attention_mask, where, temperature) * weights).sum()
    )
    assert ours_grad.keys() == expected_grad.keys() and ours_grad
    for name, grad in expected_grad.items():
        torch.testing.assert_close(ours_grad[name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_without_where_every_attended_token_gets_its_log_prob():
    model = plain_head_model(LlamaConfig)
    input_ids, attention_mask, _ = batch(seed=3)
    with torch.no_grad():
        ours = token_logprobs(model, input_ids, attention_mask)
        expected = reference(model, input_ids, attention_mask, torch.ones_like(attention_mask))
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)
    assert ours[attention_mask].ne(0).sum() == attention_mask[:, 1:].sum()
    assert (ours[~attention_mask] == 0).all()


@pytest.mark.parametrize("argument", ["attention_mask", "where"])
def test_an_integer_mask_is_refused(argument):
    """A 0/1 int64 mask (Hugging Face's convention) indexed positions instead of selecting
    them: the log-probs of other tokens came back without an error."""
    model = plain_head_model(LlamaConfig)
    input_ids, attention_mask, where = batch(seed=3)
    masks = {"attention_mask": attention_mask, "where": where}
    masks[argument] = masks[argument].long()
    with pytest.raises(ValueError, match=f"{argument} must be a bool tensor, got torch.int64"):
        token_logprobs(model, input_ids, **masks)


class LargestLogits(TorchDispatchMode):
    """Most rows of any tensor an op returns whose last dimension is the vocabulary, other
    than the ``(H, V)`` transposed gradient of the head's weight."""

    def __init__(self) -> None:
        super().__init__()
        self.rows = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(tensor, torch.Tensor) and tensor.dim() and tensor.shape[-1] == VOCAB:
                if tensor.shape == (HIDDEN, VOCAB):
                    continue
                self.rows = max(self.rows, tensor.numel() // VOCAB)
        return out


@pytest.mark.parametrize("chunked", [True, False])
def test_a_chunked_pass_never_holds_more_than_one_chunk_of_logits(monkeypatch, chunked):
    chunk = 4
    if chunked:
        monkeypatch.setattr(rl.logprobs, "LOGIT_CHUNK_ELEMENTS", chunk * VOCAB)
    model = plain_head_model(Qwen3Config)
    input_ids, attention_mask, where = batch(seed=5)
    wanted = int((where & attention_mask)[:, 1:].sum())
    assert wanted > 3 * chunk
    with LargestLogits() as seen:
        token_logprobs(model, input_ids, attention_mask, where=where).sum().backward()
    if chunked:
        assert seen.rows == chunk, "a pass held logits of more positions than one chunk"
    else:
        assert seen.rows == wanted, "an unchunked pass works out every wanted position at once"
    # what the forward keeps for the backward: a chunked pass recomputes each chunk's
    # logits there (activation checkpointing), so it keeps none; one tensor at a time
    # above says nothing of how many chunks stay alive until the backward
    kept = []

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dim() and tensor.shape[-1] == VOCAB and tensor.shape != (HIDDEN, VOCAB):
            kept.append(tensor.numel() // VOCAB)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        token_logprobs(model, input_ids, attention_mask, where=where)
        if chunked:  # and with just two chunks, the second of them one position long
            monkeypatch.setattr(rl.logprobs, "LOGIT_CHUNK_ELEMENTS", (wanted - 1) * VOCAB)
            token_logprobs(model, input_ids, attention_mask, where=where)
    assert sum(kept) == 0 if chunked else sum(kept) >= wanted


@pytest.mark.parametrize(
    "model_factory", [lambda: plain_head_model(Qwen3Config), gpt2_model], ids=["qwen3", "gpt2"]
)
def test_with_no_token_wanted_the_zeros_still_backpropagate(model_factory):
    model = model_factory()
    input_ids, attention_mask, _ = batch(seed=7)
    where = torch.zeros_like(attention_mask)
    where[0, 0] = True  # position 0 has no log-prob: still nothing wanted
    logprobs = token_logprobs(model, input_ids, attention_mask, where=where)
    assert (logprobs == 0).all() and logprobs.requires_grad
    (-logprobs.sum()).backward()  # a masked NLL of 0, as the warm start takes on such a batch


@pytest.mark.parametrize("model_type", list(ARCHITECTURES))
def test_left_padding_gives_the_log_probs_of_the_unpadded_sequence(model_type):
    """Positions count from a row's first attended token: left padding read as positions
    shifted the learned position embeddings (GPT-2, GPT-Neo) and changed every log-prob."""
    model = tiny_causal_lm(model_type, VOCAB)
    generator = torch.Generator().manual_seed(11)
    tokens = torch.randint(3, VOCAB, (8,), generator=generator)
    input_ids = torch.cat([torch.zeros(4, dtype=torch.long), tokens])[None]
    attention_mask = torch.arange(12)[None] >= 4
    with torch.no_grad():
        padded = token_logprobs(model, input_ids, attention_mask)
        logits = model(input_ids=tokens[None]).logits[0].double()
    expected = torch.log_softmax(logits[:-1], -1).gather(-1, tokens[1:, None])[:, 0].float()
    torch.testing.assert_close(padded[0, 5:], expected, atol=1e-5, rtol=1e-5)
    assert (padded[0, :5] == 0).all()


@pytest.mark.parametrize("temperature", [0.0, -0.7, float("nan"), float("inf")])
def test_a_temperature_that_is_not_a_positive_number_is_refused(temperature):
    """Dividing by it gave NaN log-probs at 0 and those of softmax(−logits / 0.7) at −0.7,
    each without an error."""
    model = plain_head_model(LlamaConfig)
    input_ids, attention_mask, where = batch(seed=5)
    with pytest.raises(ValueError, match=f"temperature must be a finite number above 0, got {temperature}"):
        token_logprobs(model, input_ids, attention_mask, where=where, temperature=temperature)
