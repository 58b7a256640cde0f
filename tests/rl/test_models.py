"""The tiny default policy, its tokenizer, loading through the weight store, the value model."""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import os
import re
import shutil
import threading

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

from rl.models import (
    MASTER_WEIGHTS_FILE,
    TinyModelConfig,
    ValueModel,
    build_tiny_model,
    converts_checkpoint_layout,
    disable_dropout,
    ensure_base_version,
    load_policy,
    load_tokenizer,
    load_trained_policy,
    padding_id,
    placed,
    publish_policy,
    restore_master_weights,
)
from rl.tokenizer import IM_END, IM_START
from rollout.config import RewardModelConfig
from rollout.engines.base import SamplingParams
from rollout.engines.torch_engine import TorchEngine
from rollout.reward_models import RewardModels
from storage.weights import MODEL_FILE, WeightStore
from tests.rl.architectures import ARCHITECTURES, tiny_causal_lm, tiny_gemma3_with_vision
from tests.rl.moe import tiny_glm4_moe, tiny_mixture_of_experts

SMALL = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64)


@pytest.fixture(scope="module")
def tiny():
    return build_tiny_model(SMALL)


@pytest.fixture
def weights(local_store, tmp_path) -> WeightStore:
    return WeightStore(local_store, cache_dir=tmp_path / "cache")


def test_default_config_is_in_the_calibrated_size_range():
    model, tokenizer = build_tiny_model(TinyModelConfig())
    parameters = sum(p.numel() for p in model.parameters())
    assert 300_000 <= parameters <= 2_000_000
    assert model.config.vocab_size == len(tokenizer) <= 512


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_each_architecture_builds_and_runs(arch):
    model, tokenizer = build_tiny_model(SMALL.model_copy(update={"arch": arch}))
    assert model.config.model_type == arch
    ids = torch.tensor([tokenizer.encode("12+7=19", add_special_tokens=False)])
    assert model(ids).logits.shape == (1, ids.shape[1], len(tokenizer))


def test_build_is_deterministic_in_the_seed():
    first, _ = build_tiny_model(SMALL)
    second, _ = build_tiny_model(SMALL)
    third, _ = build_tiny_model(SMALL.model_copy(update={"seed": 1}))
    for (name, a), b in zip(first.state_dict().items(), second.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert any(not torch.equal(a, c) for a, c in zip(first.parameters(), third.parameters(), strict=True))


def test_every_digit_is_its_own_token(tiny):
    _, tokenizer = tiny
    digit_ids = [tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)]
    assert tokenizer.unk_token_id not in digit_ids and len(set(digit_ids)) == 10
    for text in ["1234567890", "x 42+58=100", "What is 999*999? 998001", "guess: 50"]:
        tokens = tokenizer.convert_ids_to_tokens(tokenizer.encode(text, add_special_tokens=False))
        digits_in_tokens = [t for t in tokens if any(ch.isdigit() for ch in t)]
        assert all(len(t) == 1 for t in digits_in_tokens), tokens
        assert "".join(digits_in_tokens) == "".join(ch for ch in text if ch.isdigit())


def test_any_text_round_trips(tiny):
    _, tokenizer = tiny
    for text in ["Too high, go lower.", "$ ls -la | wc -l\n  3", "def f(x):\n\treturn x", "ünïcødé ✓ 日本"]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == text


def test_special_tokens_and_chat_template(tiny):
    model, tokenizer = tiny
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id) == (0, 1)
    assert tokenizer.eos_token == IM_END and model.config.eos_token_id == tokenizer.eos_token_id
    messages = [{"role": "user", "content": "What is 2+3?"}]
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert ids[0] == tokenizer.convert_tokens_to_ids(IM_START)
    assert tokenizer.decode(ids) == f"{IM_START}user\nWhat is 2+3?{IM_END}\n{IM_START}assistant\n"
    assert tokenizer.convert_tokens_to_ids(IM_END) in ids


def test_the_padding_id_is_a_row_of_the_models_embedding_whatever_pad_token_the_tokenizer_names(tiny):
    """A tokenizer given a pad token of its own without the model's embedding resized names an
    id past the embedding's last row: every padded batch then indexed past it, an IndexError on
    a CPU and a device-side assert on a GPU. Padded positions are masked out of every loss, so
    any row does: the EOS pads instead, else id 0."""
    model, tokenizer = tiny
    rows = model.get_input_embeddings().num_embeddings
    assert padding_id(tokenizer, model) == tokenizer.pad_token_id == 0
    own = copy.deepcopy(tokenizer)
    own.add_special_tokens({"pad_token": "<|own_pad|>"})
    assert own.pad_token_id >= rows
    assert padding_id(own, model) == own.eos_token_id
    eos_id = own.eos_token_id
    own.add_special_tokens({"eos_token": "<|own_eos|>"})
    assert own.eos_token_id >= rows and own.eos_token_id != eos_id
    assert padding_id(own, model) == 0
    with torch.no_grad():
        model(input_ids=torch.tensor([[eos_id, padding_id(own, model)]]))


def test_base_version_is_published_once_and_loads_like_a_checkpoint(tiny, weights):
    model, tokenizer = build_tiny_model(SMALL)
    assert ensure_base_version(weights, SMALL) == 0
    assert ensure_base_version(weights, SMALL) == 0
    assert weights.list() == [0] and weights.manifest(0)["tag"] == "base"

    loaded, loaded_tokenizer = load_policy(weights.load(0))
    ids = torch.tensor([tokenizer.encode("What is 12+30? 42", add_special_tokens=False)])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)
    text = "guess: 17 higher"
    assert loaded_tokenizer.encode(text, add_special_tokens=False) == tokenizer.encode(
        text, add_special_tokens=False
    )
    assert loaded_tokenizer.chat_template == tokenizer.chat_template
    assert load_tokenizer(weights.load(0)).eos_token == IM_END
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()


def test_every_load_of_a_checkpoint_runs_transformers_own_layers_not_hub_kernels(tiny, weights, tmp_path):
    """With the ``kernels`` package installed, ``from_pretrained`` (transformers 5) swaps in
    kernels from the Hugging Face Hub by default, per train or eval mode: the policy a trainer
    loads, the engine's and a reward model each ran code fetched at load, not the layers tested."""
    ensure_base_version(weights, SMALL)
    path = weights.load(0)
    policy, tokenizer = load_policy(path)
    engine = TorchEngine(path, device="cpu")
    judge = tmp_path / "judge"
    AutoModelForSequenceClassification.from_config(
        AutoConfig.from_pretrained(path, num_labels=1)
    ).save_pretrained(judge)
    tokenizer.save_pretrained(judge)
    models = RewardModels({"judge": RewardModelConfig(path=str(judge))}, device="cpu")
    try:
        assert not policy.use_kernels and not policy.train().use_kernels
        assert not engine.model.use_kernels
        assert not models.manager._modules["judge"].use_kernels
    finally:
        asyncio.run(engine.close())


def test_placed_in_bfloat16_computes_what_a_bfloat16_checkpoint_load_computes(weights):
    """Cast in place, a model's RoPE frequencies stay float32 as ``from_pretrained`` leaves
    them: rounded to bfloat16 they shift every position's rotation, and an engine cast this
    way would sample from another model than the one loaded from the same weights."""
    ensure_base_version(weights, SMALL)
    path = weights.load(0)
    model, tokenizer = load_policy(path)
    computed = {name: b.clone() for name, b in model.named_buffers() if name not in model.state_dict()}
    assert computed and all(b.dtype == torch.float32 for b in computed.values())

    placed(model, "cpu", torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    for name, buffer in model.named_buffers():
        if name in computed:
            torch.testing.assert_close(buffer, computed[name], rtol=0, atol=0)
    reference, _ = load_policy(path, dtype=torch.bfloat16)
    ids = torch.tensor([tokenizer.encode("What is 12+30? 42 " * 40, add_special_tokens=False)])
    assert ids.shape[1] > 300
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=0, atol=0)


def test_placed_in_bfloat16_keeps_the_routers_a_bfloat16_checkpoint_load_keeps_in_float32(tiny, tmp_path):
    """GLM-4.5 and DeepSeek-V3 keep their routers (``gate.weight``, ``e_score_correction_bias``)
    in float32 whatever dtype they are loaded in (``_keep_in_fp32_modules_strict``): cast in
    place they were rounded to bfloat16, the torch engine's too, so its experts were picked
    otherwise than from the same weights loaded."""
    _, tokenizer = tiny
    model = tiny_glm4_moe(len(tokenizer))
    path = _checkpoint((model, tokenizer), tmp_path / "checkpoint")
    reference, _ = load_policy(path, dtype=torch.bfloat16)
    cast = placed(load_policy(path)[0], "cpu", torch.bfloat16)
    routers = {name for name, t in reference.state_dict().items() if t.dtype == torch.float32}
    assert routers and all(".mlp.gate." in name for name in routers)
    assert {name for name, t in cast.state_dict().items() if t.dtype == torch.float32} == routers
    engine = TorchEngine(path, device="cpu", dtype="bfloat16")
    asyncio.run(engine.close())
    assert {name for name, t in engine.model.state_dict().items() if t.dtype == torch.float32} == routers
    ids = torch.tensor([tokenizer.encode("What is 12+30? 42 " * 4, add_special_tokens=False)])
    with torch.no_grad():
        torch.testing.assert_close(cast(ids).logits, reference(ids).logits, rtol=0, atol=0)


def test_bad_tiny_config_names_the_field():
    with pytest.raises(ValidationError, match=r"num_heads \(5\) must divide hidden_size \(32\)"):
        TinyModelConfig(hidden_size=32, num_heads=5)
    with pytest.raises(ValidationError, match=r"hidden_size / num_heads \(36 / 4\) must be even"):
        TinyModelConfig(hidden_size=36, num_heads=4)
    with pytest.raises(ValidationError, match="arch"):
        TinyModelConfig(arch="gpt2")
    with pytest.raises(ValidationError, match="vocab_size"):
        TinyModelConfig(vocab_size=10)


def test_value_model_copies_the_policy_backbone_independently(tiny):
    policy, tokenizer = tiny
    value = ValueModel.from_policy(policy)
    for name, tensor in policy.model.state_dict().items():
        assert torch.equal(value.backbone.state_dict()[name], tensor), name
    with torch.no_grad():
        value.backbone.embed_tokens.weight.add_(1.0)
    assert not torch.equal(value.backbone.embed_tokens.weight, policy.model.embed_tokens.weight)

    ids = torch.tensor([tokenizer.encode("What is 1+1? 2", add_special_tokens=False)])
    assert value(ids).shape == ids.shape
    assert torch.equal(value(ids), torch.zeros(ids.shape))  # the head starts at zero


def test_value_model_of_a_bfloat16_policy_runs_in_bfloat16(tiny):
    """The head was built in float32 whatever the backbone's dtype: the value model of a
    bfloat16 policy failed its first forward on a dtype mismatch."""
    policy, _ = tiny
    value = ValueModel.from_policy(copy.deepcopy(policy).to(torch.bfloat16))
    assert value.head.weight.dtype == torch.bfloat16
    with torch.no_grad():
        values = value(torch.tensor([[5, 6, 7]]))
    assert values.dtype == torch.bfloat16 and torch.equal(values, torch.zeros(1, 3, dtype=torch.bfloat16))


def test_value_model_handles_padding_on_either_side(tiny):
    policy, _ = tiny
    value = ValueModel.from_policy(policy)
    torch.nn.init.normal_(value.head.weight)
    short, long = [5, 6, 7], [8, 9, 10, 11, 12]
    with torch.no_grad():
        alone = [value(torch.tensor([row]))[0] for row in (short, long)]
        right = value(torch.tensor([short + [0, 0], long]), torch.tensor([[1, 1, 1, 0, 0], [1] * 5]))
        left = value(torch.tensor([[0, 0] + short, long]), torch.tensor([[0, 0, 1, 1, 1], [1] * 5]))
    torch.testing.assert_close(right[0, :3], alone[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(left[0, 2:], alone[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(right[1], alone[1], rtol=0, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_freeze_attention_trains_only_mlp_norms_and_head(arch):
    policy, _ = build_tiny_model(SMALL.model_copy(update={"arch": arch}))
    value = ValueModel.from_policy(policy)
    frozen = value.freeze_attention()
    trainable = {name for name, p in value.named_parameters() if p.requires_grad}
    assert frozen and all(".self_attn." in name for name in frozen)
    assert {name for name, _ in value.named_parameters()} == trainable | set(frozen)
    assert all(".self_attn." not in name for name in trainable)
    assert {"head.weight", "head.bias", "backbone.norm.weight"} <= trainable
    assert any(".mlp." in name for name in trainable)
    if arch == "qwen3":
        assert any("q_norm" in name for name in frozen)

    torch.nn.init.normal_(value.head.weight)  # a zero head would pass no gradient to the backbone
    before = {name: p.detach().clone() for name, p in value.named_parameters()}
    optimizer = torch.optim.SGD([p for p in value.parameters() if p.requires_grad], lr=0.1)
    ids = torch.randint(4, 100, (2, 6))
    (value(ids) - 1.0).pow(2).sum().backward()
    optimizer.step()
    changed = {name for name, p in value.named_parameters() if not torch.equal(p, before[name])}
    assert changed and changed <= trainable
    assert "head.weight" in changed and any(".mlp." in name for name in changed)


@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_freeze_attention_freezes_exactly_the_attention_blocks_of_each_architecture(model_type):
    """Their attribute is ``self_attn``, ``attn``, ``attention`` or ``self_attention``, and
    Bloom, Falcon and GPT-Neo do not mark them for transformers' output recording."""
    value = ValueModel.from_policy(tiny_causal_lm(model_type, vocab_size=64))
    block = f".{ARCHITECTURES[model_type][1]}."
    frozen = value.freeze_attention()
    assert frozen and set(frozen) == {name for name, _ in value.named_parameters() if block in name}
    trainable = {name for name, p in value.named_parameters() if p.requires_grad}

    torch.nn.init.normal_(value.head.weight)  # a zero head would pass no gradient to the backbone
    before = {name: p.detach().clone() for name, p in value.named_parameters()}
    optimizer = torch.optim.SGD([p for p in value.parameters() if p.requires_grad], lr=0.1)
    (value(torch.randint(4, 64, (2, 6))) - 1.0).pow(2).sum().backward()
    optimizer.step()
    changed = {name for name, p in value.named_parameters() if not torch.equal(p, before[name])}
    assert changed <= trainable and "head.weight" in changed
    assert any(name.startswith("backbone.") for name in changed)


def test_freeze_attention_freezes_the_linear_attention_of_a_hybrid_model():
    """Qwen3-Next (and Qwen3.5) mix a full attention block every fourth layer (``self_attn``)
    with linear attention in the others (``linear_attn``), which transformers does not mark
    as attention: three of every four layers' attention stayed trainable."""
    config = AutoConfig.for_model(
        "qwen3_next",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
        num_experts=4,
        num_experts_per_tok=2,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
    )
    torch.manual_seed(0)
    value = ValueModel.from_policy(AutoModelForCausalLM.from_config(config))
    frozen = set(value.freeze_attention())
    blocks = {name for name, _ in value.named_parameters() if re.search(r"\.(self_attn|linear_attn)\.", name)}
    assert frozen == blocks
    assert {name.split(".")[3] for name in frozen} == {"self_attn", "linear_attn"}


def test_disable_dropout_switches_off_the_dropout_a_model_reads_from_its_config():
    """Falcon's layers read ``hidden_dropout`` and ``attention_dropout`` from the config on
    every forward pass instead of copying them at construction."""
    policy = tiny_causal_lm("falcon", vocab_size=64)
    policy.config.hidden_dropout = policy.config.attention_dropout = 0.5
    policy.train()
    disable_dropout(policy)
    ids = torch.randint(4, 64, (2, 6))
    with torch.no_grad():
        torch.testing.assert_close(policy(ids).logits, policy(ids).logits, rtol=0, atol=0)


def test_disable_dropout_switches_off_every_dropout_module():
    """GPT-2 applies ``nn.Dropout`` modules built from its config: zeroing the config after
    construction leaves their ``p`` as it was."""
    policy = tiny_causal_lm("gpt2", vocab_size=64)
    dropouts = [module for module in policy.modules() if isinstance(module, torch.nn.Dropout)]
    assert dropouts
    for module in dropouts:
        module.p = 0.5
    policy.train()
    disable_dropout(policy)
    assert [module.p for module in dropouts] == [0.0] * len(dropouts)
    ids = torch.randint(4, 64, (2, 6))
    with torch.no_grad():
        torch.testing.assert_close(policy(ids).logits, policy(ids).logits, rtol=0, atol=0)


def test_value_model_round_trips_through_its_own_weight_store(tiny, store, tmp_path):
    policy, tokenizer = tiny
    policy_weights = WeightStore(store, cache_dir=tmp_path / "cache")
    value_weights = WeightStore(store, cache_dir=tmp_path / "cache", prefix="value")
    value = ValueModel.from_policy(policy)
    torch.nn.init.normal_(value.head.weight)
    assert value.publish(value_weights, step=3) == 0
    assert policy_weights.latest() is None and value_weights.latest() == 0

    loaded = ValueModel.load(value_weights.load())
    ids = torch.tensor([tokenizer.encode("Too low, go higher.", add_special_tokens=False)])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids), value(ids), rtol=0, atol=0)


def test_a_loaded_value_model_computes_the_values_it_was_published_with(local_store, tmp_path):
    """``ValueModel.load`` built its backbone with ``from_config``, which leaves it in train
    mode: GPT-2's dropout (0.1 by default) made the loaded model's values random, where
    ``load_policy`` gives a model in eval mode."""
    value = ValueModel.from_policy(tiny_causal_lm("gpt2", vocab_size=64))
    torch.nn.init.normal_(value.head.weight)
    value_weights = WeightStore(local_store, cache_dir=tmp_path / "cache", prefix="value")
    loaded = ValueModel.load(value_weights.load(value.publish(value_weights, step=1)))
    assert not any(module.training for module in loaded.modules())
    ids = torch.randint(4, 64, (2, 6))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids), value(ids), rtol=0, atol=0)


def test_the_torch_engine_serves_a_checkpoint_with_a_vision_tower_by_its_text_config(tiny):
    """``Gemma3ForConditionalGeneration``'s config keeps the vocabulary and positions in its
    ``text_config``: the engine failed to start (no ``vocab_size``), and would have taken the
    positions as unbounded."""
    _, tokenizer = tiny
    model = tiny_gemma3_with_vision(len(tokenizer))
    engine = TorchEngine(model, tokenizer)

    async def generate():
        try:
            return await engine.generate("s", [1, 2, 3], SamplingParams(max_new_tokens=4, seed=1))
        finally:
            await engine.close()

    text = model.config.get_text_config()
    assert (engine.vocab_size, engine.max_positions) == (text.vocab_size, text.max_position_embeddings)
    assert len(asyncio.run(generate()).token_ids) == 4


def test_value_model_of_a_checkpoint_with_a_vision_tower_sizes_its_head_from_the_text_config(
    tiny, local_store, tmp_path
):
    """A Gemma 3 of 4B parameters and up loads as ``Gemma3ForConditionalGeneration``, whose
    config has no ``hidden_size`` of its own; the value model reads text tokens only."""
    _, tokenizer = tiny
    value = ValueModel.from_policy(tiny_gemma3_with_vision(len(tokenizer)))
    assert value.head.in_features == 32
    assert all(".language_model." in name for name in value.freeze_attention())
    torch.nn.init.normal_(value.head.weight)
    value_weights = WeightStore(local_store, cache_dir=tmp_path / "cache", prefix="value")
    value.publish(value_weights, step=1)

    loaded = ValueModel.load(value_weights.load())
    ids = torch.tensor([tokenizer.encode("12+7=19", add_special_tokens=False)])
    with torch.no_grad():
        assert value(ids).shape == ids.shape
        torch.testing.assert_close(loaded(ids), value(ids), rtol=0, atol=0)


def test_concurrent_loads_in_threads_get_real_weights(weights):
    """An engine and a trainer load versions in threads of one flow; transformers' loading is
    not thread-safe on its own (parameters were left on the meta device)."""
    ensure_base_version(weights, SMALL)
    path = weights.load(0)
    loaded: list = []

    def load() -> None:
        for _ in range(3):
            loaded.append(load_policy(path)[0])

    threads = [threading.Thread(target=load) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(loaded) == 9
    assert not any(p.is_meta for model in loaded for p in model.parameters())


def test_a_tied_policy_is_published_with_the_names_save_pretrained_writes(tiny, weights, tmp_path):
    """The input embedding, not ``lm_head.weight``: vLLM skips the tied head's name. A model
    loaded by ``from_pretrained`` carries the conversions of its load, which reorder names."""
    built, tokenizer = tiny
    model, _ = load_policy(weights.load(publish_policy(weights, built, tokenizer)))
    assert not converts_checkpoint_layout(model)
    path = weights.load(publish_policy(weights, model, tokenizer))
    model.save_pretrained(tmp_path / "saved")
    saved = load_file(tmp_path / "saved" / "model.safetensors")
    assert set(load_file(os.path.join(path, MODEL_FILE))) == set(saved)
    assert "model.embed_tokens.weight" in saved and "lm_head.weight" not in saved


@pytest.mark.parametrize("tied", [False, True])
def test_mixture_of_experts_policy_is_published_in_its_checkpoint_layout(tiny, weights, tmp_path, tied):
    _, tokenizer = tiny
    model = tiny_mixture_of_experts(len(tokenizer), seed=0, tie_word_embeddings=tied)
    assert converts_checkpoint_layout(model)

    version = publish_policy(weights, model, tokenizer, dtype="bfloat16")
    path = weights.load(version)
    model.save_pretrained(tmp_path / "saved")
    published = load_file(os.path.join(path, MODEL_FILE))
    saved = load_file(tmp_path / "saved" / "model.safetensors")
    assert set(published) == set(saved)
    assert "model.layers.1.mlp.experts.3.gate_proj.weight" in published
    assert ("lm_head.weight" in published) is not tied
    for name, tensor in saved.items():
        assert torch.equal(published[name], tensor.to(torch.bfloat16)), name

    ids = torch.tensor([tokenizer.encode("12+7=19", add_special_tokens=False)])
    trained, _ = load_trained_policy(path)
    with torch.no_grad():
        assert torch.equal(trained(ids).logits, model(ids).logits)
    for name, parameter in model.state_dict().items():
        assert torch.equal(trained.state_dict()[name], parameter), name


def test_a_master_file_whose_tensor_has_another_shape_is_refused_before_anything_is_copied(tmp_path):
    """``copy_`` broadcast a (1,) tensor into the final norm's (H,) weight, so a master file
    that does not fit the policy was restored without a word."""
    model, _ = build_tiny_model(SMALL)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    master = {name: p + 1 for name, p in before.items()} | {"model.norm.weight": torch.full((1,), 7.0)}
    save_file(master, tmp_path / MASTER_WEIGHTS_FILE)
    with pytest.raises(ValueError, match=r"of another shape \['model.norm.weight'\]"):
        restore_master_weights(model, tmp_path)
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name


def test_a_version_whose_master_file_is_cut_short_is_refused_naming_the_file(tiny, weights, tmp_path):
    """A version folder copied by hand (``model.path``) whose ``policy_master.safetensors`` a
    copy cut short: safetensors said 'incomplete metadata, file not fully covered', naming
    neither the file nor the folder, where a weights file cut short is named."""
    model, tokenizer = tiny
    copy_dir = tmp_path / "copy"
    shutil.copytree(weights.load(publish_policy(weights, model, tokenizer, dtype="bfloat16")), copy_dir)
    master = copy_dir / MASTER_WEIGHTS_FILE
    master.write_bytes(master.read_bytes()[: master.stat().st_size // 2])
    with pytest.raises(ValueError, match=rf"{re.escape(str(master))} does not read"):
        load_trained_policy(copy_dir)


def test_value_model_round_trips_whatever_dtype_its_config_names(tiny, weights, local_store, tmp_path):
    """A policy loaded in bfloat16 leaves ``dtype: bfloat16`` in the config the value model
    copies: built from it, the backbone was bfloat16 under a float32 head (its forward pass
    raised), and a float32 value model loaded from its own version came back rounded."""
    built, tokenizer = tiny
    policy, _ = load_policy(weights.load(publish_policy(weights, built, tokenizer)), dtype=torch.bfloat16)
    assert policy.config.dtype == torch.bfloat16
    value = placed(ValueModel.from_policy(policy), "cpu", torch.float32)
    with torch.no_grad():
        for parameter in value.parameters():
            parameter.add_(torch.randn_like(parameter) * 1e-3)
    value_weights = WeightStore(local_store, cache_dir=tmp_path / "cache", prefix="value")
    loaded = ValueModel.load(value_weights.load(value.publish(value_weights, step=1)))
    for name, tensor in value.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name

    fresh = ValueModel.from_config(policy.config)
    assert policy.config.dtype == torch.bfloat16
    ids = torch.tensor([tokenizer.encode("12+7=19", add_special_tokens=False)])
    assert {p.dtype for p in fresh.parameters()} == {torch.float32}
    assert fresh(ids).shape == ids.shape


def test_a_policy_built_from_a_config_is_published_with_the_architecture_and_dtype_save_pretrained_names(
    tiny, weights, tmp_path
):
    """vLLM picks its model class by ``architectures`` and serves in the config's ``dtype``
    ('auto'): a config built rather than loaded has neither, and a model cast after its
    config was made still names its old dtype."""
    _, tokenizer = tiny
    model = placed(tiny_causal_lm("qwen3", vocab_size=len(tokenizer)), "cpu", torch.bfloat16)
    assert model.config.architectures is None
    path = weights.load(publish_policy(weights, model, tokenizer))
    model.save_pretrained(tmp_path / "saved")
    with open(os.path.join(path, "config.json")) as handle:
        published = json.load(handle)
    with open(tmp_path / "saved" / "config.json") as handle:
        saved = json.load(handle)
    assert published["architectures"] == saved["architectures"] == ["Qwen3ForCausalLM"]
    assert published["dtype"] == saved["dtype"] == "bfloat16"


def _checkpoint(tiny, path) -> str:
    model, tokenizer = tiny
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def _edit_config(path, **fields) -> None:
    config_file = os.path.join(path, "config.json")
    with open(config_file) as handle:
        config = json.load(handle)
    with open(config_file, "w") as handle:
        json.dump(config | fields, handle)


def _drop_tensor(path, name) -> None:
    tensors = load_file(os.path.join(path, MODEL_FILE))
    del tensors[name]
    save_file(tensors, os.path.join(path, MODEL_FILE), metadata={"format": "pt"})


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (
            lambda path: _drop_tensor(path, "model.layers.1.mlp.down_proj.weight"),
            "lacks.*layers.1.mlp.down_proj",
        ),
        (lambda path: _edit_config(path, num_hidden_layers=3), "lacks.*layers.2"),
        (
            lambda path: _edit_config(path, model_type="qwen3", architectures=["Qwen3ForCausalLM"]),
            "lacks.*q_norm",
        ),
        (lambda path: _edit_config(path, model_type="bert", architectures=["BertModel"]), "lacks.*bert"),
    ],
    ids=["tensor-dropped", "more-layers", "qwen3-config", "bert-config"],
)
def test_a_checkpoint_whose_weights_do_not_fill_its_model_is_refused_naming_the_tensors(
    tiny, tmp_path, corrupt, message
):
    """``from_pretrained`` only logged the tensors the checkpoint lacked and initialised them
    at random (a whole BertLMHeadModel from a Llama checkpoint whose config says bert), and
    dropped those the model has no place for: a warm start trained and published that."""
    path = _checkpoint(tiny, tmp_path / "checkpoint")
    corrupt(path)
    with pytest.raises(ValueError, match=message) as raised:
        load_policy(path)
    assert path in str(raised.value)
    with pytest.raises(ValueError, match=message):
        load_trained_policy(path)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"vocab_size": 576},
            r"model\.embed_tokens\.weight: \(512, 32\) in the checkpoint, \(576, 32\) in the model",
        ),
        (
            {"intermediate_size": 48},
            r"model\.layers\.0\.mlp\.down_proj\.weight: \(32, 64\) in the checkpoint",
        ),
    ],
    ids=["padded-vocab", "narrower-mlp"],
)
def test_a_checkpoint_whose_tensors_have_other_shapes_than_its_config_is_refused_naming_them(
    tiny, tmp_path, fields, message
):
    """A config.json padded to a larger vocabulary than its weights (or of another width):
    ``from_pretrained`` raised a RuntimeError saying only to look at a report it had logged,
    naming neither the checkpoint nor a tensor."""
    path = _checkpoint(tiny, tmp_path / "checkpoint")
    _edit_config(path, **fields)
    with pytest.raises(ValueError, match=message) as raised:
        load_policy(path)
    assert path in str(raised.value)


def test_an_engine_built_from_a_checkpoint_missing_a_tensor_is_refused_naming_it(tiny, tmp_path):
    """The torch engine loads a path as the trainer does (``load_checked``): a tensor the
    checkpoint lacks is not served at random."""
    path = _checkpoint(tiny, tmp_path / "checkpoint")
    _drop_tensor(path, "model.layers.0.mlp.up_proj.weight")
    with pytest.raises(ValueError, match=r"lacks \['model\.layers\.0\.mlp\.up_proj\.weight'\]"):
        TorchEngine(path)


def test_a_checkpoint_holding_tensors_its_model_has_no_place_for_loads_with_a_warning(tiny, tmp_path, caplog):
    """A config of fewer layers than the checkpoint's (or a checkpoint's extra head): what the
    model has a place for loads as saved, and the tensors left out are named in a warning."""
    path = _checkpoint(tiny, tmp_path / "checkpoint")
    _edit_config(path, num_hidden_layers=1)
    with caplog.at_level(logging.WARNING, logger="rl.models"):
        loaded, _ = load_policy(path)
    saved = dict(tiny[0].named_parameters())
    assert all(torch.equal(p, saved[n]) for n, p in loaded.named_parameters())
    assert re.search(r"holds 9 tensor\(s\) .* left out: \['model\.layers\.1\.", caplog.text), caplog.text


def test_a_whole_checkpoint_tied_or_not_loads(tmp_path):
    for tied in (True, False):
        tiny = build_tiny_model(SMALL.model_copy(update={"tie_word_embeddings": tied}))
        loaded, _ = load_policy(_checkpoint(tiny, tmp_path / f"tied-{tied}"))
        ties = loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
        assert ties == tied
        assert all(torch.equal(p, dict(tiny[0].named_parameters())[n]) for n, p in loaded.named_parameters())


def test_a_checkpoint_without_its_tokenizer_files_is_refused_naming_the_folder(tiny, tmp_path):
    """transformers said it could not instantiate a backend tokenizer and to install
    sentencepiece or tiktoken, naming neither the folder nor the file it lacked."""
    path = _checkpoint(tiny, tmp_path / "checkpoint")
    for name in os.listdir(path):
        if name.startswith("tokenizer") or name == "chat_template.jinja":
            os.remove(os.path.join(path, name))
    with pytest.raises(ValueError, match="no tokenizer loads from .*checkpoint.*no tokenizer.json") as raised:
        load_policy(path)
    assert "config.json" in str(raised.value)
    with pytest.raises(ValueError, match="no tokenizer.json"):
        load_tokenizer(path)


def _shard(path) -> None:
    """Split the checkpoint's weights into two files and an index, as a large checkpoint is."""
    tensors = load_file(os.path.join(path, MODEL_FILE))
    os.remove(os.path.join(path, MODEL_FILE))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[:8], "model-00002-of-00002.safetensors": names[8:]}
    for file, held in shards.items():
        save_file({name: tensors[name] for name in held}, os.path.join(path, file), metadata={"format": "pt"})
    weight_map = {name: file for file, held in shards.items() for name in held}
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as handle:
        json.dump({"metadata": {}, "weight_map": weight_map}, handle)


def test_a_checkpoint_with_a_weights_file_cut_short_is_refused_naming_the_file(tiny, tmp_path):
    """safetensors said 'Error while deserializing header: incomplete metadata, file not fully
    covered', naming neither the checkpoint nor which of its files a download cut short."""
    path = _checkpoint(tiny, tmp_path / "checkpoint")
    _shard(path)
    assert load_policy(path)[0].num_parameters() == tiny[0].num_parameters()
    cut = os.path.join(path, "model-00002-of-00002.safetensors")
    with open(cut, "rb") as handle:
        data = handle.read()
    with open(cut, "wb") as handle:
        handle.write(data[: len(data) // 2])
    with pytest.raises(
        ValueError, match=r"\['model-00002-of-00002.safetensors'\] of .*checkpoint.* do not read"
    ):
        load_policy(path)


def test_a_checkpoint_folder_without_weights_is_a_file_not_found_not_a_plain_os_error(tiny, tmp_path):
    """transformers raised a plain OSError, which the tasks retried three times as a storage
    blip; a missing file is said the same on every attempt."""
    path = _checkpoint(tiny, tmp_path / "checkpoint")
    os.remove(os.path.join(path, "model.safetensors"))
    with pytest.raises(FileNotFoundError, match=r"checkpoint' holds no weights: none of model.safetensors"):
        load_policy(path)


def test_a_checkpoint_whose_index_names_a_missing_file_is_refused_naming_it(tiny, tmp_path):
    path = _checkpoint(tiny, tmp_path / "checkpoint")
    _shard(path)
    os.remove(os.path.join(path, "model-00001-of-00002.safetensors"))
    with pytest.raises(FileNotFoundError, match="model-00001-of-00002.safetensors"):
        load_policy(path)


def test_a_checkpoint_whose_weights_index_is_cut_short_is_refused_naming_it(tiny, tmp_path):
    """json said 'Unterminated string starting at: line 1 column 760', naming neither the
    checkpoint nor its index, where a weights file cut short is named."""
    path = _checkpoint(tiny, tmp_path / "checkpoint")
    _shard(path)
    index = os.path.join(path, "model.safetensors.index.json")
    with open(index) as handle:
        text = handle.read()
    with open(index, "w") as handle:
        handle.write(text[: len(text) // 2])
    with pytest.raises(
        ValueError, match=r"\['model.safetensors.index.json'\] of .*checkpoint.* does not read"
    ):
        load_policy(path)


@pytest.mark.parametrize("name", ["no-such-checkpoint", "model.safetensors"])
def test_a_checkpoint_path_that_is_no_folder_nor_a_hub_id_is_a_file_not_found_naming_it(tiny, tmp_path, name):
    """transformers took it for a Hub id and raised a plain OSError ('Repo id must be in the
    form ...'; for a weights file given as the path, 'the config file at ... is not a valid JSON
    file'), which the tasks retried as a storage blip and which does not say the folder is not
    there."""
    path = os.path.join(_checkpoint(tiny, tmp_path / "checkpoint"), name)
    message = rf"{re.escape(repr(path))} is neither a local directory nor a Hugging Face model id"
    with pytest.raises(FileNotFoundError, match=message):
        load_policy(path)
    with pytest.raises(FileNotFoundError, match=message):
        load_tokenizer(path)


def test_a_policy_whose_head_is_not_its_embedding_is_published_untied_whatever_its_config_says(
    weights, tmp_path
):
    """A checkpoint whose config says tie_word_embeddings but that holds an lm_head.weight of
    its own (a fine-tune saved untied): transformers loads it untied, the trainer trains both,
    and the version said tie_word_embeddings: true over both tensors, so vLLM, which then skips
    lm_head.weight and scores with the input embedding, served another policy."""
    untied = build_tiny_model(SMALL.model_copy(update={"tie_word_embeddings": False}))
    path = _checkpoint(untied, tmp_path / "checkpoint")
    _edit_config(path, tie_word_embeddings=True)
    policy, tokenizer = load_policy(path)
    assert policy.lm_head.weight is not policy.model.embed_tokens.weight
    version = weights.load(publish_policy(weights, policy, tokenizer))
    with open(os.path.join(version, "config.json")) as handle:
        assert json.load(handle)["tie_word_embeddings"] is False
    assert torch.equal(
        load_file(os.path.join(version, MODEL_FILE))["lm_head.weight"], untied[0].lm_head.weight
    )


def test_a_value_model_loaded_from_a_policy_version_or_a_file_cut_short_is_refused_naming_it(
    tiny, weights, tmp_path
):
    """A policy's version given for the value model's (the store without its value prefix)
    raised torch's RuntimeError listing every key, and a weights file cut short safetensors'
    'incomplete metadata', neither naming the folder nor what it holds."""
    model, tokenizer = tiny
    policy_version = weights.load(publish_policy(weights, model, tokenizer))
    with pytest.raises(ValueError, match=rf"{re.escape(str(policy_version))}.* holds no value model"):
        ValueModel.load(policy_version)
    value_weights = WeightStore(weights.store, cache_dir=tmp_path / "cache", prefix="value")
    copy_dir = tmp_path / "value-copy"
    shutil.copytree(
        value_weights.load(ValueModel.from_policy(model).publish(value_weights, step=1)), copy_dir
    )
    cut = copy_dir / MODEL_FILE
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])
    with pytest.raises(ValueError, match=rf"{re.escape(str(cut))} does not read"):
        ValueModel.load(copy_dir)


def test_a_pytorch_weights_file_cut_short_is_refused_naming_it(tiny, tmp_path):
    """A checkpoint in torch.save's format (pytorch_model.bin, as older ones are) whose file a
    download cut short raised torch's RuntimeError 'PytorchStreamReader failed reading zip
    archive', naming neither the checkpoint nor the file, where a safetensors file is named."""
    path = _checkpoint(tiny, tmp_path / "checkpoint")
    tensors = load_file(os.path.join(path, MODEL_FILE))
    os.remove(os.path.join(path, MODEL_FILE))
    weights_file = os.path.join(path, "pytorch_model.bin")
    torch.save(tensors, weights_file)
    assert load_policy(path)[0].num_parameters() == tiny[0].num_parameters()
    with open(weights_file, "rb") as handle:
        data = handle.read()
    with open(weights_file, "wb") as handle:
        handle.write(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"\['pytorch_model.bin'\] of .*checkpoint.* do not read"):
        load_policy(path)
