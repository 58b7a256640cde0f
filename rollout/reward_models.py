"""Reward-model services: learned scorers of finished rollouts, each call an action.

An environment whose config names a ``reward_model`` is scored in EVAL by that model
instead of its own ``evaluate()``. The call is scheduled like a tool call: it asks the
rollout service's scheduler for one unit of the ``reward`` resource (the reward-call
slots, ARL-Tangram's reward GPUs), and the :class:`~rollout.resources.ServiceManager`
puts the model on the device for the call, parking it in CPU memory otherwise and
evicting the least recently used idle model when the device-memory budget is full.

A reward model is a Hugging Face sequence-classification checkpoint with one label and
its tokenizer in one directory; it reads the rollout's conversation (rendered with its
own chat template, or as ``role: content`` lines without one) and its logit is the reward.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from transformers import AutoModelForSequenceClassification, PreTrainedTokenizerBase

from envs.threads import to_thread_to_the_end
from rl.models import load_checked, load_tokenizer
from rollout.config import RewardModelConfig
from rollout.resources import ServiceManager, state_bytes

REWARD_RESOURCE = "reward"
"""Scheduler resource of reward calls: one unit per call."""


class RewardModelError(RuntimeError):
    """A reward model failed to score a conversation (to read it, to load onto its device, to
    run, or it gave no finite logit): a failure of the reward service, not of the env."""


class RewardModels:
    """The reward models of one rollout service, parked and loaded by a ``ServiceManager``.

    Args:
        configs: service name -> its checkpoint.
        device: where a model runs for a call (default: CUDA when available, else CPU).
        budget_bytes: device memory the resident models may hold (default: all of them on
            CPU, the free GPU memory on CUDA).
    """

    def __init__(
        self,
        configs: Mapping[str, RewardModelConfig],
        device: str | None = None,
        budget_bytes: int | None = None,
    ):
        models, self.tokenizers, self.configs = {}, {}, dict(configs)
        self.max_tokens: dict[str, int] = {}
        for name, config in self.configs.items():
            model = load_checked(AutoModelForSequenceClassification, config.path, torch.float32)
            if model.config.num_labels != 1:
                raise ValueError(
                    f"reward model {name!r} at {config.path} has {model.config.num_labels} labels; a reward "
                    "model has one (its logit is the reward)"
                )
            models[name] = model
            self.tokenizers[name] = load_tokenizer(config.path)
            # a model with learned positions (GPT-2, BERT) fails on a longer input; RoBERTa's
            # start after its padding id, so that its 514 hold 512 tokens
            positions = getattr(model.config, "max_position_embeddings", None)
            padding_id = getattr(getattr(model.base_model, "embeddings", None), "padding_idx", None)
            if positions and padding_id is not None:
                positions -= padding_id + 1
            self.max_tokens[name] = min(config.max_tokens, positions or config.max_tokens)
        on_cpu = (device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cpu"
        if budget_bytes is None and on_cpu:
            budget_bytes = max(sum(state_bytes(m) for m in models.values()), 1)
        for name, model in models.items():
            if budget_bytes is not None and (size := state_bytes(model)) > budget_bytes:
                raise ValueError(
                    f"reward model {name!r} needs {size / 2**20:.2f} MB on its device, more than "
                    f"service.reward_budget_mb ({budget_bytes / 2**20:.3g})"
                )
        self.manager = ServiceManager(device=device, budget_bytes=budget_bytes)
        for name, model in models.items():
            self.manager.register(name, model)

    def check(self, name: str) -> None:
        """Raise ``KeyError`` naming the configured services when ``name`` is not one."""
        if name not in self.configs:
            raise KeyError(f"unknown reward model {name!r}; configured: {sorted(self.configs)}")

    def input_ids(self, name: str, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """The tokens reward model ``name`` reads for a conversation: its last ``max_tokens``,
        or fewer where the model has fewer positions (``max_position_embeddings``), after the
        leading [CLS] of an encoder (BERT, RoBERTa), which classifies from its state, or the
        leading BOS of a decoder (Llama 3's, Gemma's templates), which began every text it
        learned on."""
        self.check(name)
        tokenizer = self.tokenizers[name]
        ids = _render(tokenizer, messages)
        limit = self.max_tokens[name]
        if len(ids) <= limit:
            return ids
        leading = {tokenizer.cls_token_id, tokenizer.bos_token_id} - {None}
        head = ids[:1] if ids[0] in leading else []
        return head + ids[len(ids) - limit + len(head) :]

    async def score(
        self,
        name: str,
        messages: Sequence[Mapping[str, Any]],
        waiting: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    ) -> float:
        """Reward model ``name``'s score of a conversation (loaded on the device for the call;
        ``waiting()`` scopes each wait for the device, see ``ServiceManager.use``); raises
        :class:`RewardModelError` when the model fails to score it."""
        self.check(name)
        try:
            ids = self.input_ids(name, messages)
            async with self.manager.use(name, waiting) as model:
                # a cancelled caller keeps the model in use, so not evicted, under its forward
                score = await to_thread_to_the_end(_forward, model, ids)
        except Exception as exc:
            raise RewardModelError(f"reward model {name!r}: {type(exc).__name__}: {exc}") from exc
        if not math.isfinite(score):
            raise RewardModelError(f"reward model {name!r} scored {score!r}")
        return score


def _render(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Mapping[str, Any]]) -> list[int]:
    # a tool-calling reply has its calls beside its content (often none): both are kept
    conversation = [
        {"role": m["role"], "content": m.get("content") or ""}
        | ({"tool_calls": _with_parsed_arguments(m["tool_calls"])} if m.get("tool_calls") else {})
        for m in messages
    ]
    if tokenizer.chat_template:
        rendered = tokenizer.apply_chat_template(conversation, tokenize=True)
        return list(rendered["input_ids"] if isinstance(rendered, Mapping) else rendered)
    return tokenizer("\n".join(map(_plain_turn, conversation)))["input_ids"]


def _plain_turn(message: Mapping[str, Any]) -> str:
    """A turn for a tokenizer without a chat template: ``role: content``, then each tool
    call as a JSON line ``tool_call: {"name": …, "arguments": …}``."""
    lines = [f"{message['role']}: {message['content']}"]
    for call in message.get("tool_calls", ()):
        function = call.get("function", call) if isinstance(call, Mapping) else call
        lines.append(f"tool_call: {json.dumps(function, ensure_ascii=False, default=str)}")
    return "\n".join(lines)


def _with_parsed_arguments(calls: list[Any]) -> list[Any]:
    """OpenAI tool calls with their arguments as objects, not JSON strings: templates such as
    Qwen2.5's write them through ``tojson``, which would quote a string a second time."""
    parsed = []
    for call in calls:
        function = call.get("function") if isinstance(call, Mapping) else None
        if isinstance(function, Mapping) and isinstance(function.get("arguments"), str):
            # a client's own assistant message may carry any string: it stays as sent
            with contextlib.suppress(ValueError, RecursionError):
                call = {**call, "function": {**function, "arguments": json.loads(function["arguments"])}}
        parsed.append(call)
    return parsed


def _forward(model: torch.nn.Module, ids: list[int]) -> float:
    device = next(model.parameters()).device
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids], device=device)).logits
    return float(logits[0, 0])
