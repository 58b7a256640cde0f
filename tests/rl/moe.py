"""A tiny mixture-of-experts policy: an architecture whose checkpoint layout differs from
the layout transformers loads it in."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel, Qwen3MoeConfig


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


def tiny_glm4_moe(vocab_size: int) -> PreTrainedModel:
    """A float32 GLM-4.5-style MoE whose routers (``.mlp.gate.``, which transformers keeps in
    float32 whatever dtype it loads the model in) hold values bfloat16 cannot represent."""
    config = AutoConfig.for_model(
        "glm4_moe",
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        n_routed_experts=4,
        num_experts_per_tok=2,
        first_k_dense_replace=0,
        n_group=1,
        topk_group=1,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.config.architectures = [type(model).__name__]
    with torch.no_grad():
        for name, tensor in model.state_dict(keep_vars=True).items():
            if ".mlp.gate." in name:
                tensor.normal_(0, 0.3)
    return model.eval()
