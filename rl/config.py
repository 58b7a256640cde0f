"""Configuration of the rl package: the tiny model, the supervised warm start and the SAO /
GRPO trainer.

Kept apart from the code that uses them, which imports torch and transformers, so that a
run config loads without those (seconds on every flow's start).
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

TorchDtype = Literal["float32", "bfloat16", "float16"]
"""A config field naming the dtype of model weights."""

_COMMON_DEVICE = re.compile(r"cpu|cuda(:(0|[1-9][0-9]?))?")
"""Device names ``torch.device`` takes, checked without importing torch."""


def _torch_device(value: str) -> str:
    if _COMMON_DEVICE.fullmatch(value):
        return value
    import torch

    try:
        torch.device(value)
    except RuntimeError as exc:
        raise ValueError(f"{value!r} is not a torch device: {exc}") from None
    return value


TorchDevice = Annotated[str, AfterValidator(_torch_device)]
"""A config field naming a torch device (``cpu``, ``cuda``, ``cuda:1`` …), checked at load."""

TorchSeed = Annotated[int, Field(ge=-(2**63), lt=2**64)]
"""A config field holding a seed of ``torch.manual_seed``, which takes 64 bits, signed or not."""


class TinyModelConfig(BaseModel):
    """The embedded default policy: a tiny decoder built from scratch on the CPU."""

    model_config = ConfigDict(allow_inf_nan=False, extra="forbid")

    arch: Literal["llama", "qwen2", "qwen3"] = Field("llama", description="Hugging Face architecture family.")
    hidden_size: int = Field(96, ge=8, description="Width of the residual stream.")
    num_layers: int = Field(3, ge=1, description="Number of decoder blocks.")
    num_heads: int = Field(4, ge=1, description="Attention heads; must divide hidden_size.")
    num_kv_heads: int | None = Field(
        None, ge=1, description="Key/value heads (grouped-query attention); defaults to num_heads."
    )
    intermediate_size: int = Field(256, ge=8, description="Width of each MLP block.")
    vocab_size: int = Field(
        512,
        ge=260,
        description="Target size of the locally trained BPE vocabulary (the result may be smaller).",
    )
    max_position_embeddings: int = Field(1024, ge=16, description="Longest sequence (prompt + generation).")
    tie_word_embeddings: bool = Field(True, description="Share the input embedding with the output head.")
    seed: TorchSeed = Field(0, description="Seed for the weight initialisation and the tokenizer corpus.")

    @model_validator(mode="after")
    def _heads_fit(self) -> TinyModelConfig:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must divide hidden_size ({self.hidden_size})")
        if (self.hidden_size // self.num_heads) % 2:
            raise ValueError(
                f"hidden_size / num_heads ({self.hidden_size} / {self.num_heads}) must be even: it is "
                "each head's size, which RoPE rotates in pairs"
            )
        kv_heads = self.num_kv_heads or self.num_heads
        if self.num_heads % kv_heads:
            raise ValueError(f"num_kv_heads ({kv_heads}) must divide num_heads ({self.num_heads})")
        return self


class SFTConfig(BaseModel):
    """Supervised warm-start settings."""

    model_config = ConfigDict(allow_inf_nan=False, extra="forbid")

    lr: float = Field(3e-3, gt=0, description="AdamW learning rate.")
    batch_size: int = Field(64, ge=1, description="Demonstrations per optimizer step.")
    micro_token_budget: int = Field(
        8192, ge=1, description="Padded tokens (rows × longest row) per forward pass; gradients accumulate."
    )
    max_steps: int = Field(400, ge=1, description="Optimizer steps at most.")
    max_seconds: float = Field(60.0, gt=0, description="Wall-clock budget; training stops when it runs out.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    seed: TorchSeed = Field(0, description="Seed of the batch order and of the dropout masks.")


class SAOConfig(BaseModel):
    """Settings of the continuous trainer: losses, advantages, critic, batching, publishing.

    Defaults follow SAO, the single-rollout asynchronous optimization used for GLM-5.2:
    DIS with ε_low = 0.3, ε_high = 5.0, γ = 1, λ = 0.95, K = 2 critic steps per policy step.
    """

    model_config = ConfigDict(allow_inf_nan=False, extra="forbid")

    mode: Literal["sao", "grpo"] = Field(
        "sao",
        description="'sao': single rollout per prompt, value model, observation-skip GAE. "
        "'grpo': group advantages (reward minus group mean), no critic; the baseline.",
    )
    eps_low: float = Field(
        0.3, gt=0, le=1, description="DIS: tokens with ratio <= 1 - eps_low are masked out."
    )
    eps_high: float = Field(5.0, gt=0, description="DIS: tokens with ratio >= 1 + eps_high are masked out.")
    gamma: float = Field(1.0, ge=0, le=1, description="Discount γ of the GAE.")
    lam: float = Field(0.95, ge=0, le=1, description="GAE λ of the policy's advantages (when not adaptive).")
    adaptive_lambda: bool = Field(
        False, description="Use the length-adaptive λ = 1 − 1/(α·L) per row instead of the fixed lam."
    )
    lambda_alpha: float = Field(
        0.05, gt=0, description="α of the length-adaptive λ; L is the row's action tokens."
    )
    value_lam: float = Field(
        1.0, ge=0, le=1, description="GAE λ of the critic's targets (1.0: Monte-Carlo returns, as in VAPO)."
    )
    normalize_advantages: bool = Field(
        False,
        description="Whiten advantages over the batch's trained tokens (train_mask: action tokens, a "
        "shared prefix once) before the policy step.",
    )
    grpo_normalize_std: bool = Field(False, description="GRPO: divide by the group's reward std.")
    lr: float = Field(1e-5, gt=0, description="AdamW learning rate of the policy.")
    value_lr: float = Field(1e-4, gt=0, description="AdamW learning rate of the value model.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay (policy and value).")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient-norm clip of each optimizer step.")
    value_steps: int = Field(
        2, ge=0, description="K: critic steps on each batch before its policy step (SAO)."
    )
    value_clip: float | None = Field(
        None, gt=0, description="Clip range of the value loss around the pre-step values; None: plain MSE."
    )
    value_pretrain_steps: int = Field(
        0, ge=0, description="Critic-only steps on the first batches before the first policy step."
    )
    token_budget: int = Field(8192, ge=1, description="Tokens (sum of sequence lengths) per optimizer step.")
    micro_token_budget: int = Field(
        8192, ge=1, description="Padded tokens (rows × longest row) per forward pass; gradients accumulate."
    )
    mixed_precision: Literal["no", "bf16"] = Field(
        "no",
        description="'bf16': the policy's and the value model's forward passes run their matmuls in "
        "bfloat16 (torch.autocast), the LM head's included, as a bfloat16 engine computes its logits; "
        "weights, gradients and optimizer state stay float32, log-probs and losses are float32 from "
        "the bfloat16 logits.",
    )
    activation_checkpointing: bool = Field(
        False,
        description="Gradient checkpointing: keep only each decoder block's input for the backward "
        "pass and recompute the rest there (policy and value model): activation memory of one block "
        "instead of every block, for about one more forward pass of compute.",
    )
    max_staleness: int = Field(
        4, ge=0, description="Drop a sample whose oldest action token is more than this many versions old."
    )
    publish_every: int | None = Field(
        4,
        ge=1,
        description="Publish a weight version every N policy steps. None: only when the trainer stops "
        "(publish_on_stop), as a batch run on what arrived since the last (train/nightly) does: its own "
        "versions would age that backlog past max_staleness within a few publishes.",
    )
    publish_dtype: TorchDtype | None = Field(
        None,
        description="Dtype of the policy weights the engines load ('bfloat16' halves what each fetches "
        "against float32); the weights as trained travel beside them for a trainer that resumes. "
        "None: as trained.",
    )
    publish_on_stop: bool = Field(
        True, description="Publish the steps since the last version on a clean stop."
    )
    keep_versions: int | None = Field(
        None,
        ge=2,
        description="After each publish, delete all but the newest N weight versions (tagged ones and "
        "LATEST stay); None keeps every version.",
    )
    poll_seconds: float = Field(
        1.0, gt=0, le=60, description="Wait between polls of the shard log when idle (at most 60 s)."
    )
    read_ahead_batches: int = Field(
        8,
        ge=1,
        description="Steps' worth of tokens (token_budget each) the trainer reads ahead into memory; the "
        "shards past it wait in storage until its buffer drains below it, so a large backlog (a nightly "
        "run's, a restart's) costs storage, not memory.",
    )
    seed: TorchSeed = Field(0, description="Torch seed of the trainer.")

    @model_validator(mode="after")
    def _publishes(self) -> SAOConfig:
        if self.publish_every is None and not self.publish_on_stop:
            raise ValueError(
                "publish_every null publishes only at the stop: it needs publish_on_stop true (else the "
                "trainer never publishes)"
            )
        return self
