"""Policy and value models.

The policy is any Hugging Face causal LM in a local directory (a weight version from the
store, or a real checkpoint such as Qwen3): ``load_policy`` is the one code path for both.
The embedded default is a tiny Llama/Qwen model built from ``TinyModelConfig`` with the
locally trained tokenizer of ``rl.tokenizer``, published as version 0.

The value model (SAO) is the policy's backbone with a scalar head per token; its attention
can be frozen so that the rest (embeddings, MLP blocks, norms and the head) trains; SAO as
PAPERS.md cites it trains only the MLP blocks and the head.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import pathlib
import tempfile
import zipfile
from typing import TypeVar

import torch
from huggingface_hub.utils import HFValidationError, validate_repo_id
from safetensors import SafetensorError, safe_open
from safetensors.torch import load as load_safetensors
from safetensors.torch import load_file
from safetensors.torch import save as save_safetensors
from torch import nn
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen2Config,
    Qwen3Config,
)
from transformers.core_model_loading import build_glob_alternation, revert_weight_conversion
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, WEIGHTS_INDEX_NAME, WEIGHTS_NAME
from transformers.utils.output_capturing import OutputRecorder

from rl.config import TinyModelConfig, TorchDtype
from rl.tokenizer import train_tokenizer
from storage.weights import MODEL_FILE, PRETRAINED_LOAD_LOCK, TOKENIZER_FILE, WeightStore

log = logging.getLogger(__name__)

_CONFIG_CLASSES = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}

OWN_LAYERS = {"use_kernels": False}
"""``from_pretrained`` options of every model load here: transformers' own layers. With the
``kernels`` package installed (a dependency of transformers), transformers 5 swaps in kernels
from the Hugging Face Hub by default, fetched at load (and on a GPU run): downloaded code no test
here ran, failed attempts on an offline cluster, and kernels picked per train or eval mode, so a
trainer's log-probs could differ from an engine's on the same weights."""


ModelT = TypeVar("ModelT", bound=nn.Module)


def placed(model: ModelT, device: str | torch.device, dtype: torch.dtype) -> ModelT:
    """``model`` moved to ``device`` with its weights cast to ``dtype``, in place.

    Buffers computed when the model is built rather than loaded with its weights (RoPE's
    ``inv_freq``) keep their dtype: ``from_pretrained`` leaves them float32 whatever the
    weights' dtype, and rounded to bfloat16 they turn every position by a growing error
    (0.6 rad at position 512 with Qwen3's RoPE settings), so a bfloat16 engine would sample
    from another model than the one the trainer scores. So do the tensors ``from_pretrained``
    in ``dtype`` keeps in float32 (:func:`_kept_float32`: the routers of GLM-4.5 and
    DeepSeek-V3), which rounded would pick other experts.
    """
    persistent = model.state_dict(keep_vars=True)
    computed = {name: buffer for name, buffer in model.named_buffers() if name not in persistent}
    float32 = {name: persistent[name].detach() for name in _kept_float32(model, dtype)}
    model.to(device=device, dtype=dtype)
    for name, buffer in computed.items():
        owner, _, attribute = name.rpartition(".")
        setattr(model.get_submodule(owner), attribute, buffer.to(device))
    state = model.state_dict(keep_vars=True)
    for name, tensor in float32.items():
        state[name].data = tensor.to(device=device, dtype=torch.float32)
    return model


def _kept_float32(model: nn.Module, dtype: torch.dtype) -> set[str]:
    """The names in ``model``'s ``state_dict`` that ``from_pretrained`` in ``dtype`` keeps in
    float32: those its Hugging Face models list in ``_keep_in_fp32_modules_strict`` for
    bfloat16 and float16 (the routers of GLM-4.5 and DeepSeek-V3), and in
    ``_keep_in_fp32_modules`` for float16."""
    kept: set[str] = set()
    for prefix, module in model.named_modules():
        plan = module._get_dtype_plan(dtype) if isinstance(module, PreTrainedModel) else None
        if plan:  # patterns searched in the names, as from_pretrained does
            pattern = build_glob_alternation(list(plan))[0]
            kept |= {f"{prefix}.{name}".lstrip(".") for name in module.state_dict() if pattern.search(name)}
    return kept


def build_tiny_model(config: TinyModelConfig) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A freshly initialised tiny causal LM and its tokenizer (deterministic in ``config.seed``)."""
    tokenizer = train_tokenizer(config.vocab_size, seed=config.seed)
    hf_config = _CONFIG_CLASSES[config.arch](
        vocab_size=len(tokenizer),
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads or config.num_heads,
        head_dim=config.hidden_size // config.num_heads,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=config.tie_word_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    model.config.architectures = [type(model).__name__]
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model.eval(), tokenizer


def model_vocab_size(path: str | os.PathLike) -> int:
    """The token ids the model in local directory ``path`` has rows for (its config's
    ``vocab_size``): often more than its tokenizer's tokens (Qwen3-0.6B pads 151669 to
    151936), and the padding ids are sampled like any other."""
    return int(AutoConfig.from_pretrained(str(path)).get_text_config().vocab_size)


GENERATION_CONFIG_FILE = "generation_config.json"


def model_eos_ids(path: str | os.PathLike) -> list[int]:
    """The token ids the model in local directory ``path`` ends a reply with, as vLLM reads
    them: its ``generation_config.json``'s ``eos_token_id`` (one id or a list: Qwen2.5 and
    Qwen3 instruct list ``<|im_end|>`` and ``<|endoftext|>``), else its config's."""
    generation = os.path.join(path, GENERATION_CONFIG_FILE)
    if os.path.isfile(generation):
        with open(generation) as handle:
            eos = json.load(handle).get("eos_token_id")
    else:
        eos = AutoConfig.from_pretrained(str(path)).get_text_config().eos_token_id
    ids = [] if eos is None else [eos] if isinstance(eos, int) else eos
    return [int(t) for t in ids]


def load_tokenizer(path: str | os.PathLike) -> PreTrainedTokenizerBase:
    """The tokenizer saved in a local model directory; a ``ValueError`` naming the directory
    and its files where none loads (transformers' own error names neither, and one folder
    without tokenizer files is told to install sentencepiece or tiktoken)."""
    check_local_or_hub(path)
    try:
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as error:
        if not os.path.isdir(path):  # a Hub model id
            raise
        files = sorted(os.listdir(path))
        lacks = "" if TOKENIZER_FILE in files else f"it has no {TOKENIZER_FILE}; "
        raise ValueError(
            f"no tokenizer loads from {str(path)!r} ({lacks}its files: {files}): {error}"
        ) from error


def check_local_or_hub(path: str | os.PathLike) -> None:
    """Raise a ``FileNotFoundError`` naming ``path`` unless it is a local directory or could be
    a Hugging Face Hub model id: transformers takes any other path for an id and raises a plain
    ``OSError`` ('Repo id must be in the form …', or for a file, that it is no valid config),
    which says nothing of a missing folder and which the tasks retry as storage's."""
    if os.path.isdir(path):
        return
    try:
        validate_repo_id(str(path))
    except HFValidationError:
        raise FileNotFoundError(
            f"{str(path)!r} is neither a local directory nor a Hugging Face model id"
        ) from None


def padding_id(tokenizer, model: PreTrainedModel) -> int:
    """The id that pads ``model``'s batches: the tokenizer's pad token, else its EOS, else 0,
    the first of them that is a row of the model's input embedding. Many checkpoints define no
    pad token, and a pad token added to a tokenizer without resizing the model lies past its
    embedding; padded positions are masked out of every loss, so any row does."""
    rows = model.get_input_embeddings().num_embeddings
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if candidate is not None and 0 <= candidate < rows:
            return int(candidate)
    return 0


def checkpoint_state_dict(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """``model``'s tensors named and laid out as its Hugging Face checkpoint stores them.

    Transformers loads some architectures in another layout than their checkpoints hold
    (a mixture of experts' experts fused into one tensor per layer, Qwen3-MoE's
    ``experts.gate_up_proj``, where the checkpoint has ``experts.{i}.gate_proj.weight``
    …); ``save_pretrained`` writes the checkpoint's layout back, and vLLM loads only that.
    For every other model this is its ``state_dict``.
    """
    state = model.state_dict()
    reverted = revert_weight_conversion(model, state)
    # the names kept come in the model's order: of a tied pair the store keeps the first, the
    # input embedding, as save_pretrained does (vLLM skips the tied lm_head.weight)
    return {name: reverted[name] for name in state if name in reverted} | reverted


def converts_checkpoint_layout(model: PreTrainedModel) -> bool:
    """Whether ``model``'s ``state_dict`` names differ from its checkpoint's
    (``checkpoint_state_dict``): only ``from_pretrained`` then loads a checkpoint into it."""
    return set(checkpoint_state_dict(model)) != set(model.state_dict())


def load_checked(model_class: type, path: str | os.PathLike, dtype: torch.dtype) -> PreTrainedModel:
    """``model_class.from_pretrained(path)`` (an ``AutoModel…`` class) with transformers' own
    layers (:data:`OWN_LAYERS`), checked.

    A checkpoint whose tensors do not fill the model its config names is a ``ValueError``
    naming them: ``from_pretrained`` only logs the tensors it lacks (a dropped tensor, a config
    of more layers or of another architecture, a causal LM loaded as a reward model without its
    score head) and initialises them at random. Tensors the model has no place for (a config of
    fewer layers, a checkpoint's extra head) are left out with a warning naming them. A tensor
    of another shape than the config gives it (a ``vocab_size`` padded past the checkpoint's
    rows) is a ``ValueError`` naming both shapes, where transformers' error names neither the
    tensor nor the checkpoint and points to a report it logged. A weights file that does not
    read (a download cut short) is a ``ValueError`` naming it, where safetensors or torch names
    none, and so is a weights index cut short, where json names none. A local folder holding
    no weights file is a ``FileNotFoundError`` (transformers raises a plain ``OSError``, which
    the tasks retry as storage's), as is a path that is neither a local folder nor a Hub id
    (:func:`check_local_or_hub`).
    """
    check_local_or_hub(path)
    names = (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_NAME, WEIGHTS_INDEX_NAME)
    if os.path.isdir(path) and not any(os.path.isfile(os.path.join(path, name)) for name in names):
        raise FileNotFoundError(f"{str(path)!r} holds no weights: none of {', '.join(names)}")
    try:
        with PRETRAINED_LOAD_LOCK:
            model, info = model_class.from_pretrained(
                str(path), dtype=dtype, output_loading_info=True, ignore_mismatched_sizes=True, **OWN_LAYERS
            )
    except SafetensorError as error:
        raise ValueError(
            f"the weights files {_unreadable_weights(path)} of {str(path)!r} do not read: {error}"
        ) from error
    except RuntimeError as error:  # torch's, for a pytorch_model.bin cut short, names no file
        unreadable = _unreadable_weights(path)
        if not unreadable:
            raise
        raise ValueError(f"the weights files {unreadable} of {str(path)!r} do not read: {error}") from error
    except json.JSONDecodeError as error:  # an index cut short: json names no file
        raise ValueError(
            f"the weights index {_unreadable_indexes(path)} of {str(path)!r} does not read: {error}"
        ) from error
    missing, unexpected = (sorted(info.get(kind) or ()) for kind in ("missing_keys", "unexpected_keys"))
    if missing:
        raise ValueError(
            f"the checkpoint in {str(path)!r} does not fill the {type(model).__name__} its config.json "
            f"names: it lacks {missing[:5]}{' and more' if len(missing) > 5 else ''} ({len(missing)} in "
            f"all; it holds {len(unexpected)} the model has no place for)"
        )
    mismatched = sorted(info.get("mismatched_keys") or ())
    if mismatched:
        shapes = [
            f"{name}: {tuple(stored)} in the checkpoint, {tuple(wanted)} in the model"
            for name, stored, wanted in mismatched
        ]
        raise ValueError(
            f"the checkpoint in {str(path)!r} holds tensors of other shapes than the {type(model).__name__} its "
            f"config.json names: {'; '.join(shapes[:5])}{' and more' if len(shapes) > 5 else ''} "
            f"({len(shapes)} in all)"
        )
    if unexpected:  # a checkpoint may carry more than its model uses (a head, extra layers)
        log.warning(
            "the checkpoint in %r holds %d tensor(s) the %s its config.json names has no place for, "
            "left out: %s first",
            str(path),
            len(unexpected),
            type(model).__name__,
            unexpected[:5],
        )
    return model


def load_policy(
    path: str | os.PathLike, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Any Hugging Face causal LM and its tokenizer from a local directory, in eval mode,
    checked (:func:`load_checked`)."""
    model = load_checked(AutoModelForCausalLM, path, dtype)
    return model.to(device).eval(), load_tokenizer(path)


def _unreadable_weights(path: str | os.PathLike) -> list[str]:
    """The weights files of the local directory ``path`` that a download cut short: the
    ``*.safetensors`` whose header does not read or places tensors past the file's end, and
    the ``*.bin`` that are neither a whole zip archive (``torch.save``'s format) nor a pickle
    (its format before torch 1.6)."""
    unreadable = []
    for file in sorted(pathlib.Path(path).glob("*.safetensors")):
        try:
            with safe_open(file, "pt"):
                pass
        except SafetensorError:
            unreadable.append(file.name)
    for file in sorted(pathlib.Path(path).glob("*.bin")):
        with open(file, "rb") as handle:
            pickled = handle.read(1) == b"\x80"  # pickle's PROTO opcode
        if not (pickled or zipfile.is_zipfile(file)):
            unreadable.append(file.name)
    return unreadable


def _unreadable_indexes(path: str | os.PathLike) -> list[str]:
    """The weights index files of the local directory ``path`` that are not JSON (cut short)."""
    unreadable = []
    for name in (SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_INDEX_NAME):
        try:
            with open(os.path.join(path, name)) as handle:
                json.load(handle)
        except FileNotFoundError:
            continue
        except ValueError:
            unreadable.append(name)
    return unreadable


def enable_activation_checkpointing(model: PreTrainedModel) -> None:
    """Keep only each decoder block's input for the backward pass and recompute the rest.

    transformers renamed ``gradient_checkpointing_enable`` to ``activation_checkpointing_enable``
    during 5.x (5.17 has only the old name; later releases keep it as a deprecated alias)."""
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()


def disable_dropout(model: nn.Module) -> None:
    """Switch off every dropout of ``model``, in place, whatever its mode.

    RL compares the trainer's log-probs with those the engines recorded in eval mode, so a
    dropout mask would put noise into every ratio (and into the critic's values). The model
    stays in train mode, which activation checkpointing needs; what this zeroes instead is
    every ``nn.Dropout``'s ``p`` and every float attribute whose name holds ``drop``: the
    probabilities Hugging Face modules copy from their config and apply while training
    without an ``nn.Dropout`` (Llama and Qwen's ``attention_dropout``, passed to the
    attention kernel; ``layerdrop``), and those of the modules' configs, which some read
    while training (Falcon's ``hidden_dropout``, Persimmon's ``attention_dropout``): a
    version the trainer publishes has them at 0 in its ``config.json``.
    """
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        config = getattr(module, "config", None)
        for owner in (module, config) if isinstance(config, PretrainedConfig) else (module,):
            for name, value in vars(owner).items():
                if "drop" in name and type(value) is float:
                    setattr(owner, name, 0.0)


MASTER_WEIGHTS_FILE = "policy_master.safetensors"
"""The extra file of a version whose published copy rounds the policy's parameters (see
``publish_policy``): the parameters as trained, which a trainer resumes from
(``load_trained_policy``)."""


def publish_policy(
    weights: WeightStore,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    dtype: TorchDtype | None = None,
    **publish_kwargs,
) -> int:
    """Publish a policy with its tokenizer and generation config (its EOS ids: ``model_eos_ids``);
    ``publish_kwargs`` go to ``WeightStore.publish``.

    The weights are stored in the checkpoint's layout (``checkpoint_state_dict``), so the
    version loads wherever the base checkpoint does: ``from_pretrained``, vLLM.

    ``dtype``: the engines' copy is stored in it (``bfloat16`` halves what every engine
    fetches and loads); when that rounds a parameter, the parameters as trained travel too,
    as the extra file ``MASTER_WEIGHTS_FILE`` (a base loaded from a bfloat16 checkpoint
    rounds nothing and keeps no second copy).
    """
    extra_files = dict(publish_kwargs.pop("extra_files", None) or {})
    target = None if dtype is None else getattr(torch, dtype)
    if target is not None and any(not torch.equal(p, p.to(target).to(p.dtype)) for p in model.parameters()):
        master = {name: p.detach().cpu().contiguous() for name, p in model.named_parameters()}
        extra_files[MASTER_WEIGHTS_FILE] = save_safetensors(master)
    with tempfile.TemporaryDirectory(prefix="treadle-tokenizer-") as tokenizer_dir:
        tokenizer.save_pretrained(tokenizer_dir)
        if model.generation_config is not None:  # served with the tokenizer's files, not as an extra
            with open(os.path.join(tokenizer_dir, GENERATION_CONFIG_FILE), "w") as handle:
                handle.write(model.generation_config.to_json_string())
        # what save_pretrained writes: vLLM picks its class by architectures and serves in dtype
        # ('auto'), which a config built rather than loaded lacks or a cast model has stale
        written = {"architectures": [type(model).__name__], "dtype": str(model.dtype).removeprefix("torch.")}
        config = model.config.to_dict() | written
        if not _head_is_input_embedding(model):
            # a config saying tied over a head of its own (transformers then loads both): vLLM
            # would skip the head and score with the input embedding
            config["tie_word_embeddings"] = False
            if isinstance(config.get("text_config"), dict):
                config["text_config"] = config["text_config"] | {"tie_word_embeddings": False}
        return weights.publish(
            checkpoint_state_dict(model),
            config,
            tokenizer_dir,
            extra_files=extra_files,
            dtype=target,
            **publish_kwargs,
        )


def _head_is_input_embedding(model: PreTrainedModel) -> bool:
    """Whether ``model``'s output head is its input embedding (tied) or it has none."""
    head = model.get_output_embeddings()
    return head is None or getattr(head, "weight", None) is model.get_input_embeddings().weight


def restore_master_weights(model: PreTrainedModel, version_dir: str | os.PathLike) -> bool:
    """Put back the parameters a version kept as trained (``MASTER_WEIGHTS_FILE``) into
    ``model``, loaded from that version; False when it has none (its weights are the
    policy's own). A file that does not read, or does not hold ``model``'s parameters, is a
    ``ValueError`` naming it."""
    path = os.path.join(version_dir, MASTER_WEIGHTS_FILE)
    if not os.path.isfile(path):
        return False
    with open(path, "rb") as handle:
        data = handle.read()
    try:
        master = load_safetensors(data)
    except SafetensorError as error:  # a copy cut short: safetensors names no file
        raise ValueError(f"{path} does not read: {error}") from error
    params = dict(model.named_parameters())
    # copy_ would broadcast a tensor of another shape (a (1,) into a norm's (H,)) without a word
    reshaped = sorted(name for name in set(master) & set(params) if master[name].shape != params[name].shape)
    if set(master) != set(params) or reshaped:
        raise ValueError(
            f"{path} does not hold this policy's parameters: missing {sorted(set(params) - set(master))[:5]}, "
            f"unknown {sorted(set(master) - set(params))[:5]}, of another shape {reshaped[:5]}"
        )
    with torch.no_grad():
        for name, tensor in master.items():
            params[name].copy_(tensor)
    return True


def load_trained_policy(
    path: str | os.PathLike, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """``load_policy`` with the parameters as trained where ``path`` is a version that kept
    them (``restore_master_weights``): the policy to go on training, where ``load_policy``
    gives the one the engines serve."""
    model, tokenizer = load_policy(path, device=device, dtype=dtype)
    restore_master_weights(model, path)
    return model, tokenizer


def ensure_base_version(weights: WeightStore, config: TinyModelConfig) -> int:
    """Publish the tiny model as version 0 (tagged ``base``) when the store is empty.

    Returns the latest version: 0 right after publishing, or whatever a previous run left.
    """
    latest = weights.latest()
    if latest is not None:
        return latest
    model, tokenizer = build_tiny_model(config)
    return publish_policy(
        weights, model, tokenizer, step=0, metadata={"tiny_model": config.model_dump()}, tag="base"
    )


def attention_modules(model: PreTrainedModel) -> list[nn.Module]:
    """The attention blocks of ``model``, whatever their attribute is called (``self_attn`` in
    Llama and Qwen, ``attn`` in GPT-2, ``attention`` in GPT-NeoX, ``self_attention`` in Bloom).

    Transformers marks them as the modules whose outputs it records as a model's
    ``attentions`` (``PreTrainedModel._can_record_outputs``: a class, a class name, an
    ``OutputRecorder`` or a list of these). A model that marks none (Bloom, Falcon, GPT-Neo,
    MPT) names their classes ``…Attention``. The linear attention of the hybrid models
    (Qwen3-Next, Qwen3.5: three layers in four) is marked neither way: it is the block a
    layer holds as ``linear_attn``.
    """
    specs = model.can_record_outputs.get("attentions", [])
    targets = [
        spec.target_class or spec.class_name if isinstance(spec, OutputRecorder) else spec
        for spec in (specs if isinstance(specs, list) else [specs])
    ]

    def is_attention(module: nn.Module) -> bool:
        if not targets:
            return type(module).__name__.endswith("Attention")
        return any(
            type(module).__name__ == target if isinstance(target, str) else isinstance(module, target)
            for target in targets
        )

    return [
        module
        for name, module in model.named_modules()
        if is_attention(module) or name.rpartition(".")[2] == "linear_attn"
    ]


class ValueModel(nn.Module):
    """A decoder backbone with a scalar value head on every token.

    Args:
        backbone: a Hugging Face base model (``AutoModel``: no LM head) returning
            ``last_hidden_state``.
    """

    def __init__(self, backbone: PreTrainedModel):
        super().__init__()
        self.backbone = backbone
        self.head = nn.Linear(
            backbone.config.get_text_config().hidden_size, 1, device=backbone.device, dtype=backbone.dtype
        )
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    @property
    def config(self) -> PretrainedConfig:
        return self.backbone.config

    @classmethod
    def from_config(cls, config: PretrainedConfig) -> ValueModel:
        """A randomly initialised value model with the architecture of ``config``, in float32
        as its head is, whatever dtype ``config`` names (a checkpoint's ``bfloat16``):
        ``placed`` casts it."""
        # from_config builds in the config's dtype and writes the one it used back into it
        return cls(AutoModel.from_config(copy.deepcopy(config), dtype=torch.float32))

    @classmethod
    def from_policy(cls, policy: PreTrainedModel) -> ValueModel:
        """A value model whose backbone is a copy of the policy's (the head starts at zero, on
        the policy's device and in its dtype)."""
        backbone = copy.deepcopy(policy.base_model)
        backbone.config.architectures = [type(backbone).__name__]
        return cls(backbone)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Values of every position.

        Args:
            input_ids: (B, T) token ids; padding may be on either side.
            attention_mask: (B, T) 1 on real tokens, 0 on padding (default: all ones).

        Returns:
            (B, T) values; entries at padding positions are meaningless.
        """
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # (B, T)
        hidden = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids
        ).last_hidden_state  # (B, T, H)
        return self.head(hidden).squeeze(-1)

    def freeze_attention(self) -> list[str]:
        """Stop gradients to every parameter of the backbone's attention blocks
        (``attention_modules``; SAO); returns the names frozen."""
        attention = attention_modules(self.backbone)
        frozen = {
            name: parameter
            for prefix, module in self.named_modules()
            if module in attention
            for name, parameter in module.named_parameters(prefix=prefix)
        }
        if not frozen:
            raise ValueError(
                f"{self.config.model_type} ({type(self.backbone).__name__}) has no attention parameters "
                "to freeze: SAO trains the value model with its attention frozen"
            )
        for parameter in frozen.values():
            parameter.requires_grad_(False)
        return list(frozen)

    def publish(self, weights: WeightStore, **publish_kwargs) -> int:
        """Store this value model as a version of ``weights`` (use a store with its own prefix)."""
        return weights.publish(self.state_dict(), self.config.to_dict(), None, **publish_kwargs)

    @classmethod
    def load(
        cls, path: str | os.PathLike, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
    ) -> ValueModel:
        """A value model from a local version directory written by ``publish``, in eval mode
        (as ``load_policy``'s: ``from_config`` builds its backbone in train mode, dropout on).
        A weights file that does not read, or that holds other tensors than the value model of
        the folder's ``config.json`` (a policy's version), is a ``ValueError`` naming it."""
        with open(os.path.join(path, "config.json")) as handle:
            config_dict = json.load(handle)
        config = AutoConfig.for_model(**config_dict)
        model = cls.from_config(config)
        file = os.path.join(path, MODEL_FILE)
        try:
            state = load_file(file)
        except SafetensorError as error:  # a copy cut short: safetensors names no file
            raise ValueError(f"{file} does not read: {error}") from error
        expected = set(model.state_dict())
        if set(state) != expected:
            raise ValueError(
                f"{str(path)!r} holds no value model of its config.json (a policy's version?): it lacks "
                f"{sorted(expected - set(state))[:5]} and holds {sorted(set(state) - expected)[:5]} unknown to it"
            )
        model.load_state_dict(state)
        return placed(model, device, dtype).eval()
