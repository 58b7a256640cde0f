"""A tiny mixture-of-experts policy: an architecture whose checkpoint layout differs from
the layout transformers loads it in."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel, Qwen3MoeConfig


def tiny_mixture_of_experts(vocab_size: int, seed: int, tie_word_embeddings: bool = False) -> PreTrainedModel:
    """A Qwen3-MoE model (4 experts, 2 per token), whose experts transformers fuses on load."""
    config = Qwen3MoeConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        tie_word_embeddings=tie_word_embeddings,
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).eval()
