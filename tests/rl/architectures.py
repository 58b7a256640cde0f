"""Tiny causal LMs of the common decoder-only architectures, built from their config classes."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

COMMON = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
"""Config fields of every architecture, small and with special tokens inside any vocabulary
(Phi-3's default pad id is 32000); an override of None leaves the config's own default."""

ARCHITECTURES: dict[str, tuple[dict, str]] = {
    "llama": ({}, "self_attn"),
    "qwen2": ({}, "self_attn"),
    "qwen3": ({}, "self_attn"),
    "mistral": ({}, "self_attn"),
    "gemma2": ({}, "self_attn"),
    "gemma3_text": ({"sliding_window": 4}, "self_attn"),
    "phi3": ({}, "self_attn"),
    "mixtral": ({"num_local_experts": 4, "num_experts_per_tok": 2}, "self_attn"),
    "qwen2_moe": (
        {"moe_intermediate_size": 16, "shared_expert_intermediate_size": 32, "num_experts": 4},
        "self_attn",
    ),
    "gpt2": ({"n_embd": 32, "n_layer": 2, "n_head": 4}, "attn"),
    "gpt_neox": ({"num_key_value_heads": None, "head_dim": None}, "attention"),
    "gpt_neo": ({"num_layers": 2, "num_heads": 4, "attention_types": [[["global", "local"], 1]]}, "attn"),
    "bloom": ({"n_layer": 2, "n_head": 4}, "self_attention"),
    "falcon": ({"new_decoder_architecture": True, "num_kv_heads": 2, "head_dim": None}, "self_attention"),
}
"""model_type: (config overrides of ``COMMON``, the attribute of a layer's attention block)."""


def tiny_causal_lm(model_type: str, vocab_size: int, seed: int = 0) -> PreTrainedModel:
    """A randomly initialised two-layer ``model_type`` LM (one of ``ARCHITECTURES``), in eval mode."""
    overrides, _ = ARCHITECTURES[model_type]
    fields = {name: value for name, value in (COMMON | overrides).items() if value is not None}
    config = AutoConfig.for_model(model_type, vocab_size=vocab_size, **fields)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).eval()


def tiny_gemma3_with_vision(vocab_size: int, seed: int = 0) -> PreTrainedModel:
    """A Gemma 3 with its vision tower, as the 4B and larger checkpoints load
    (``Gemma3ForConditionalGeneration``: its config keeps the decoder's sizes in ``text_config``)."""
    text = dict(COMMON, vocab_size=vocab_size, sliding_window=4)
    vision = dict(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
    )
    config = AutoConfig.for_model(
        "gemma3",
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=4,
        image_token_index=vocab_size - 1,
        boi_token_index=vocab_size - 2,
        eoi_token_index=vocab_size - 3,
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).eval()
