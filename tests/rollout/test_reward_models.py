"""Reward-model services: an env that names a reward model is scored by that checkpoint in
EVAL, each call inside a grant of a reward slot, the models loaded on the device for the
call and evicted least recently used under the device budget."""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
import time

import pytest
import torch
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    BertConfig,
    BertForSequenceClassification,
    BertTokenizerFast,
    GPT2Config,
    GPT2ForSequenceClassification,
    LlamaConfig,
    LlamaForSequenceClassification,
    RobertaConfig,
    RobertaForSequenceClassification,
)

from envs import registry
from flows.config import RunConfig
from rl.models import TinyModelConfig, build_tiny_model
from rollout import reward_models
from rollout.engines.torch_engine import TorchEngine
from rollout.evaluate import evaluate
from rollout.gateway import Gateway, GatewayConfig
from rollout.resources import state_bytes
from rollout.reward_models import REWARD_RESOURCE, RewardModelConfig, RewardModels
from rollout.router import Router
from rollout.service import RolloutRequest, RolloutService, ServiceConfig, make_reward_models
from storage.weights import MODEL_FILE

TINY = TinyModelConfig(
    hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, max_position_embeddings=1024
)
JUDGES = {"arith": "judge-a", "guess": "judge-b"}


def judged_env(task):
    """An env of ``task`` scored by its judge of :data:`JUDGES`."""
    return registry.make(task.env, registry.make_config(task.env, {"reward_model": JUDGES[task.env]}))


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return build_tiny_model(TINY)


@pytest.fixture(scope="module")
def judges(tiny, tmp_path_factory) -> dict[str, str]:
    """Two reward-model checkpoints (one label, the policy's tokenizer and chat template)."""
    _, tokenizer = tiny
    paths = {}
    for seed, name in enumerate(sorted(JUDGES.values())):
        config = LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=1024,
            num_labels=1,
            pad_token_id=tokenizer.pad_token_id,
        )
        torch.manual_seed(seed + 1)
        path = tmp_path_factory.mktemp(name)
        LlamaForSequenceClassification(config).save_pretrained(path)
        tokenizer.save_pretrained(path)
        paths[name] = str(path)
    return paths


def reference_score(path: str, messages: list[dict]) -> float:
    """The checkpoint's logit on the conversation, loaded and run the plain Hugging Face way."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    with torch.no_grad():
        return float(model(input_ids=torch.tensor([ids])).logits[0, 0])


def test_rollouts_are_scored_by_their_envs_reward_model_in_a_reward_slot(tiny, judges):
    model, tokenizer = tiny
    one_model_mb = max(
        state_bytes(AutoModelForSequenceClassification.from_pretrained(p)) for p in judges.values()
    )
    config = ServiceConfig(
        max_new_tokens=8,
        timeout_s=120,
        reward_models={name: RewardModelConfig(path=path) for name, path in judges.items()},
        reward_budget_mb=1.5 * one_model_mb / 2**20,  # room for one model at a time
    )
    calls: list[tuple[str, list[dict], float, float]] = []

    async def body():
        engine = TorchEngine(model, tokenizer)
        gateway = Gateway(Router([engine]), tokenizer, GatewayConfig(max_context_tokens=1024))
        service = RolloutService(gateway, judged_env, config)
        policy = service.scheduler.policy
        score = service.rewards.score

        async def watched(name, messages, waiting):
            held = policy.capacity[REWARD_RESOURCE] - policy.free[policy.names.index(REWARD_RESOURCE)]
            value = await score(name, messages, waiting)
            calls.append((name, [dict(m) for m in messages], value, held))
            return value

        service.rewards.score = watched
        results = []
        try:
            for env_name in ("arith", "guess", "arith"):
                task = registry.task_set(env_name, "train", seed=0, n=1)[0]
                results.append(await service.process(RolloutRequest(task=task, seed=1)))
        finally:
            await engine.close()
        return service, results

    service, results = asyncio.run(body())
    assert all(r.status in ("ok", "truncated") for r in results), [r.error for r in results]
    assert [name for name, *_ in calls] == ["judge-a", "judge-b", "judge-a"]
    for result, (name, messages, value, held) in zip(results, calls, strict=True):
        assert held == 1  # the call ran inside a grant of one reward slot
        assert result.reward == value
        assert messages[-1]["role"] == "assistant"
        assert value == pytest.approx(reference_score(judges[name], messages), abs=1e-5)
    manager = service.rewards.manager
    assert manager.loads == ["judge-a", "judge-b", "judge-a"]
    assert manager.evictions == ["judge-a", "judge-b"]
    assert manager.reloads == 1
    policy = service.scheduler.policy
    assert policy.free == [float(policy.capacity[name]) for name in policy.names]  # all given back


def test_a_compacted_rollouts_reward_model_reads_its_whole_conversation_not_its_last_context(tiny, judges):
    model, tokenizer = tiny
    task = registry.task_set("guess", "train", seed=0, n=1)[0]
    first = Gateway(Router([]), tokenizer).renderer.first(asyncio.run(judged_env(task).reset(task)))
    config = ServiceConfig(
        max_new_tokens=4,
        compact_at=len(first) + 24,
        reward_models={name: RewardModelConfig(path=path) for name, path in judges.items()},
    )
    read: list[list[dict]] = []

    async def body():
        engine = TorchEngine(model, tokenizer)
        service = RolloutService(Gateway(Router([engine]), tokenizer), judged_env, config)
        score = service.rewards.score

        async def watched(name, messages, waiting):
            read.append([dict(m) for m in messages])
            return await score(name, messages, waiting)

        service.rewards.score = watched
        try:
            return await service.process(RolloutRequest(task=task, seed=1))
        finally:
            await engine.close()

    result = asyncio.run(body())
    assert result.status in ("ok", "truncated"), result.error
    assert result.branches and result.turns > 1
    (messages,) = read
    assert sum(m["role"] == "assistant" for m in messages) == result.turns
    assert messages[0]["content"] == task.prompt
    assert result.reward == pytest.approx(reference_score(judges["judge-b"], messages), abs=1e-5)


@pytest.mark.parametrize("fails", ["raises", "nan"])
def test_a_reward_model_that_fails_to_score_is_an_infra_error_and_the_service_keeps_scoring(
    tiny, judges, monkeypatch, fails
):
    """The reward model is the service's, not the env's: its failure (a forward that raises,
    out of device memory say, or a logit that is not finite) fails that rollout as an
    infra_error, and the next rollout is scored by it."""
    model, tokenizer = tiny
    forward, failures = reward_models._forward, []

    def failing_once(module, ids):
        if failures:
            return forward(module, ids)
        failures.append(fails)
        if fails == "raises":
            raise RuntimeError("CUDA out of memory")
        return float("nan")

    monkeypatch.setattr(reward_models, "_forward", failing_once)
    config = ServiceConfig(
        max_new_tokens=8,
        timeout_s=120,
        reward_models={name: RewardModelConfig(path=path) for name, path in judges.items()},
    )

    async def body():
        engine = TorchEngine(model, tokenizer)
        gateway = Gateway(Router([engine]), tokenizer, GatewayConfig(max_context_tokens=1024))
        service = RolloutService(gateway, judged_env, config)
        task = registry.task_set("arith", "train", seed=0, n=1)[0]
        try:
            results = [await service.process(RolloutRequest(task=task, seed=1)) for _ in range(2)]
        finally:
            await engine.close()
        return service, results

    service, (failed, scored) = asyncio.run(body())
    assert failed.status == "infra_error" and failed.reward is None
    assert failed.error.startswith("reward model 'judge-a'")
    assert scored.status in ("ok", "truncated") and scored.reward is not None, scored.error
    policy = service.scheduler.policy
    assert policy.free == [float(policy.capacity[name]) for name in policy.names]


MESSAGES = [{"role": "user", "content": "guess 3-14"}, {"role": "assistant", "content": "8"}]


def one_judge_at_a_time(judges: dict[str, str]) -> RewardModels:
    """Both judges, on a device budget that holds the larger one only."""
    sizes = [state_bytes(AutoModelForSequenceClassification.from_pretrained(p)) for p in judges.values()]
    return RewardModels(
        {name: RewardModelConfig(path=path) for name, path in judges.items()},
        device="cpu",
        budget_bytes=max(sizes),
    )


def test_a_reward_model_scores_the_same_after_eviction_and_reload(judges):
    models = one_judge_at_a_time(judges)

    async def main():
        return [await models.score(name, MESSAGES) for name in ("judge-a", "judge-b", "judge-a")]

    first, other, again = asyncio.run(main())
    assert models.manager.evictions == ["judge-a", "judge-b"]
    assert first == pytest.approx(reference_score(judges["judge-a"], MESSAGES), abs=1e-5)
    assert again == pytest.approx(first, abs=1e-6)  # rotary tables and all come back with the weights
    assert other == pytest.approx(reference_score(judges["judge-b"], MESSAGES), abs=1e-5)


def test_a_reward_model_reads_the_tool_calls_of_a_reply_that_is_only_calls(judges):
    """A gateway session's reply that calls a tool holds no content: the judge must read the
    call as the chat template writes it, not an empty turn."""
    call = {"id": "c", "type": "function", "function": {"name": "probe", "arguments": '{"n": 8}'}}
    messages = [MESSAGES[0], {"role": "assistant", "content": None, "tool_calls": [call]}]
    models = RewardModels({"judge-a": RewardModelConfig(path=judges["judge-a"])}, device="cpu")
    tokenizer = AutoTokenizer.from_pretrained(judges["judge-a"])
    read = tokenizer.decode(models.input_ids("judge-a", messages))
    assert read.endswith(
        '<|im_start|>assistant\n<tool_call>\n{"name": "probe", "arguments": {"n": 8}}\n</tool_call><|im_end|>\n'
    )
    # a template that writes arguments through tojson (Qwen2.5's) reads them as an object
    models.tokenizers["judge-a"].chat_template = (
        "{% for m in messages %}{{ m.role }}: {{ m.content }}"
        "{% for c in m.tool_calls or [] %}{{ c.function.arguments | tojson }}{% endfor %} {% endfor %}"
    )
    assert tokenizer.decode(models.input_ids("judge-a", messages)).endswith('assistant: {"n": 8} ')
    models.tokenizers["judge-a"] = tokenizer
    with_tools = [*messages, {"role": "tool", "content": "too low"}, {"role": "assistant", "content": "9"}]
    assert (
        models.input_ids("judge-a", with_tools)
        == tokenizer.apply_chat_template(with_tools, tokenize=True, return_dict=True)["input_ids"]
    )


def test_a_cancelled_call_keeps_its_model_resident_until_its_forward_is_done(judges, monkeypatch):
    """The caller of ``score`` is cancelled mid-forward and a call to the other model needs
    the room: the first model is evicted only once its forward thread has finished."""
    models = one_judge_at_a_time(judges)
    started, seen = threading.Event(), []
    forward = reward_models._forward

    def slow_forward(model, ids):
        if not started.is_set():
            started.set()
            time.sleep(0.5)
            seen.append((next(model.parameters()).device.type, list(models.manager.evictions)))
        return forward(model, ids)

    monkeypatch.setattr(reward_models, "_forward", slow_forward)

    async def main():
        first = asyncio.create_task(models.score("judge-a", MESSAGES))
        await asyncio.to_thread(started.wait, 30)
        first.cancel()
        other = await asyncio.wait_for(models.score("judge-b", MESSAGES), 60)
        with pytest.raises(asyncio.CancelledError):
            await first
        return other

    other = asyncio.run(main())
    assert seen == [("cpu", [])], "judge-a was evicted under its running forward"
    assert models.manager.evictions == ["judge-a"]
    assert other == pytest.approx(reference_score(judges["judge-b"], MESSAGES), abs=1e-5)


async def until(condition) -> None:
    """Waits until ``condition()`` holds (fails after 60 s)."""
    async with asyncio.timeout(60):
        while not condition():
            await asyncio.sleep(0.01)


def test_a_rollout_waiting_for_device_room_for_its_reward_model_waits_as_queue_time(
    tiny, judges, monkeypatch
):
    """Two reward slots, device room for one judge: a rollout whose judge needs the room
    that another's long forward holds waits for it as queue time, so the wait neither
    counts against its active-time budget nor times it out."""
    model, tokenizer = tiny
    forward, release = reward_models._forward, threading.Event()
    held = []

    def held_forward(module, ids):
        if not held:
            held.append(True)
            release.wait(60)
        return forward(module, ids)

    monkeypatch.setattr(reward_models, "_forward", held_forward)
    one_model = max(
        state_bytes(AutoModelForSequenceClassification.from_pretrained(p)) for p in judges.values()
    )
    # one short turn each: the second rollout's INIT and RUN stay well inside the budget on a
    # loaded machine (three turns there took past 2 s of active time, so it never reached EVAL)
    config = ServiceConfig(
        max_new_tokens=8,
        max_turns=1,
        timeout_s=4,
        reward_slots=2,
        reward_models={name: RewardModelConfig(path=path) for name, path in judges.items()},
        reward_budget_mb=1.5 * one_model / 2**20,
    )

    async def body():
        engine = TorchEngine(model, tokenizer)
        gateway = Gateway(Router([engine]), tokenizer, GatewayConfig(max_context_tokens=1024))
        service = RolloutService(gateway, judged_env, config)
        manager = service.rewards.manager
        tasks = [registry.task_set(name, "train", seed=0, n=1)[0] for name in ("arith", "guess")]
        try:
            first = asyncio.create_task(service.process(RolloutRequest(task=tasks[0], seed=1)))
            await until(lambda: held)
            second = asyncio.create_task(service.process(RolloutRequest(task=tasks[1], seed=1)))
            # judge-b waits for judge-a's room
            await until(lambda: len(manager._arrivals) == 1 or second.done())
            assert not second.done(), f"ended before its reward call: {second.result().summary()}"
            await asyncio.sleep(5)  # past the 4 s budget
            release.set()
            return await first, await second
        finally:
            await engine.close()

    first, second = asyncio.run(body())
    assert second.status in ("ok", "truncated"), second.error
    assert second.timing["queue"] >= 5
    assert first.status == "timeout"  # its own forward is active time


def test_a_rollout_whose_reward_model_loads_slowly_waits_for_the_load_as_queue_time(
    tiny, judges, monkeypatch
):
    """Moving a reward model onto the device (its first call, or one evicted since for
    another's) counted against the rollout's budget: a load longer than the time left ended an
    episode the policy finished as a timeout, never scored. The load is queue time now, as the
    waits for the device before it are, and the episode is scored."""
    model, tokenizer = tiny
    config = ServiceConfig(
        max_new_tokens=8,
        max_turns=1,
        timeout_s=5,
        reward_models={"judge-a": RewardModelConfig(path=judges["judge-a"])},
    )

    async def body():
        engine = TorchEngine(model, tokenizer)
        gateway = Gateway(Router([engine]), tokenizer, GatewayConfig(max_context_tokens=1024))
        service = RolloutService(gateway, judged_env, config)
        manager = service.rewards.manager
        copy_in = manager._copy_in

        def slow_copy_in(*args):
            time.sleep(config.timeout_s + 0.5)  # longer than the whole budget, as a large model's copy is
            copy_in(*args)

        monkeypatch.setattr(manager, "_copy_in", slow_copy_in)
        task = registry.task_set("arith", "train", seed=0, n=1)[0]
        try:
            return await service.process(RolloutRequest(task=task, seed=1))
        finally:
            await engine.close()

    result = asyncio.run(body())
    assert result.status in ("ok", "truncated"), result.error
    assert result.reward is not None and result.timing["queue"] >= config.timeout_s


def test_an_env_naming_an_unconfigured_reward_model_is_a_config_error():
    with pytest.raises(
        ValueError, match=r"envs.arith.reward_model: 'judge' is not one of service.reward_models"
    ):
        RunConfig.model_validate({"envs": {"arith": {"reward_model": "judge"}}})


def test_a_reward_budget_no_model_fits_is_refused_naming_the_setting(judges):
    """``reward_budget_mb: 0.01`` failed a run with "service 'judge_a' needs 107072 bytes, more
    than the budget 10485": neither the setting nor its unit was named."""
    config = ServiceConfig(
        reward_models={name: RewardModelConfig(path=path) for name, path in judges.items()},
        reward_budget_mb=0.01,
    )
    with pytest.raises(
        ValueError,
        match=r"^reward model '[\w-]+' needs 0\.\d+ MB on its device, more than service\.reward_budget_mb \(0\.01\)$",
    ):
        make_reward_models(config)


def test_held_out_evaluation_scores_with_the_run_s_reward_models(tiny, judges):
    """Evaluation runs under the run's service config: an env scored by a reward model is
    scored by it there too (with the service's defaults, which name no reward model, every
    episode was an env_error scored 0)."""
    model, tokenizer = tiny
    config = ServiceConfig(
        max_new_tokens=8,
        timeout_s=120,
        reward_models={name: RewardModelConfig(path=path) for name, path in judges.items()},
    )
    tasks = registry.task_set("arith", "eval", seed=0, n=2)

    async def body():
        engine = TorchEngine(model, tokenizer)
        try:
            return await evaluate(
                engine, tokenizer, tasks, judged_env, service_config=config, temperature=1.0
            )
        finally:
            await engine.close()

    result = asyncio.run(body())
    assert "env_error" not in result.statuses["arith"] and result.count == {"arith": 2}
    assert result.reward["arith"] != 0.0  # the judge's logits, not failures scored 0


def test_arguments_nested_past_the_json_decoders_limit_stay_a_string():
    """A client's own assistant message may carry any arguments string: one nested deeper
    than the JSON decoder recurses is kept as written (it raised RecursionError, losing the
    score)."""
    deep = "[" * 100_000
    calls = [{"function": {"name": "f", "arguments": deep}}, {"function": {"name": "g", "arguments": "[1]"}}]
    assert reward_models._with_parsed_arguments(calls) == [
        calls[0],
        {"function": {"name": "g", "arguments": [1]}},
    ]


def test_a_reward_model_without_a_chat_template_reads_the_calls_as_json_lines(judges):
    call = {"id": "c", "type": "function", "function": {"name": "probe", "arguments": '{"n": 8, "é": 1}'}}
    messages = [MESSAGES[0], {"role": "assistant", "content": None, "tool_calls": [call]}]
    models = RewardModels({"judge-a": RewardModelConfig(path=judges["judge-a"])}, device="cpu")
    tokenizer = models.tokenizers["judge-a"]
    tokenizer.chat_template = None
    expected = (
        f"user: {MESSAGES[0]['content']}\nassistant: \n"
        'tool_call: {"name": "probe", "arguments": {"n": 8, "é": 1}}'
    )
    assert models.input_ids("judge-a", messages) == tokenizer(expected)["input_ids"]


def test_a_conversation_longer_than_max_tokens_is_read_by_its_last_tokens(judges):
    models = RewardModels({"judge-a": RewardModelConfig(path=judges["judge-a"], max_tokens=5)}, device="cpu")
    tokenizer = AutoTokenizer.from_pretrained(judges["judge-a"])
    full = tokenizer.apply_chat_template(MESSAGES, tokenize=True, return_dict=True)["input_ids"]
    assert len(full) > 5
    assert models.input_ids("judge-a", MESSAGES) == full[-5:]


def assert_reads_and_scores(path, messages: list[dict], read: list[int]) -> None:
    """The checkpoint at ``path``, loaded as a reward model, reads ``read`` of ``messages`` and
    scores it as the plain Hugging Face load of the checkpoint scores ``read``."""
    models = RewardModels({"judge": RewardModelConfig(path=str(path))}, device="cpu")
    assert models.input_ids("judge", messages) == read
    reference = AutoModelForSequenceClassification.from_pretrained(path).eval()
    with torch.no_grad():
        expected = float(reference(input_ids=torch.tensor([read])).logits[0, 0])
    assert asyncio.run(models.score("judge", messages)) == pytest.approx(expected, abs=1e-5)


def test_a_conversation_longer_than_the_models_positions_is_read_by_its_last_tokens_that_fit(tiny, tmp_path):
    """A checkpoint with learned positions (GPT-2's 16 here) reads no more tokens than it has
    positions for, whatever max_tokens says (the default 2048 failed every longer conversation,
    each an infra error)."""
    _, tokenizer = tiny
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=16,
        n_embd=32,
        n_layer=1,
        n_head=2,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(3)
    GPT2ForSequenceClassification(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    messages = [{"role": "user", "content": "guess " + " ".join(map(str, range(3, 15)))}, MESSAGES[1]]
    full = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    assert len(full) > 16
    assert_reads_and_scores(tmp_path, messages, full[-16:])


def test_a_roberta_checkpoint_reads_no_more_tokens_than_its_positions_after_its_padding_id(tiny, tmp_path):
    """RoBERTa numbers its positions from its padding id + 1: of its max_position_embeddings
    (17 here, padding id 0) it uses 16, and a conversation cut to 17 tokens failed its forward
    ('IndexError: index out of range in self'), as RoBERTa's 514 hold 512 tokens."""
    _, tokenizer = tiny
    config = RobertaConfig(
        vocab_size=len(tokenizer),
        max_position_embeddings=tokenizer.pad_token_id + 1 + 16,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(4)
    RobertaForSequenceClassification(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    messages = [{"role": "user", "content": "guess " + " ".join(map(str, range(3, 15)))}, MESSAGES[1]]
    full = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    assert len(full) > 17
    assert_reads_and_scores(tmp_path, messages, full[-16:])


def test_an_encoder_checkpoint_cut_to_its_positions_keeps_the_cls_token_it_classifies_from(tmp_path):
    """BERT (and RoBERTa, DeBERTa) classify from the state of their leading [CLS]: a conversation
    cut to its last tokens lost it, and the model scored the state of a token in the middle of
    the text (without an error: every conversation past 512 tokens scored so)."""
    words = [f"w{i}" for i in range(20)]
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ":", "user", "assistant", *words]
    tokenizer = BertTokenizerFast(vocab={word: i for i, word in enumerate(vocab)}, do_lower_case=False)
    config = BertConfig(
        vocab_size=tokenizer.vocab_size,
        max_position_embeddings=16,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_labels=1,
    )
    torch.manual_seed(5)
    BertForSequenceClassification(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    messages = [{"role": "user", "content": " ".join(words)}, {"role": "assistant", "content": "w3"}]
    full = tokenizer("user: " + " ".join(words) + "\nassistant: w3")["input_ids"]
    assert len(full) > 16 and full[0] == tokenizer.cls_token_id
    assert_reads_and_scores(tmp_path, messages, [tokenizer.cls_token_id, *full[-15:]])


def test_a_decoder_checkpoint_cut_to_its_last_tokens_keeps_the_bos_its_template_starts_with(tiny, tmp_path):
    """Llama 3's, Gemma's and Mistral's chat templates (those of their reward models, Skywork's
    among them) start with the BOS, which the model has seen first in every text it learned on:
    a conversation cut to its last tokens lost it, and was scored without it, silently."""
    tiny[1].save_pretrained(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)  # a copy: the module's stays as it is
    tokenizer.chat_template = "{{ bos_token }}" + tokenizer.chat_template
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=16,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(6)
    LlamaForSequenceClassification(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    messages = [{"role": "user", "content": "guess " + " ".join(map(str, range(3, 15)))}, MESSAGES[1]]
    full = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    assert len(full) > 16 and full[0] == tokenizer.bos_token_id
    assert_reads_and_scores(tmp_path, messages, [tokenizer.bos_token_id, *full[-15:]])


def test_a_causal_lm_given_as_a_reward_model_is_refused_naming_the_head_it_lacks(tiny, tmp_path):
    """A policy checkpoint (no score head) loaded as a reward model got a head initialised at
    random, with a log line: every rollout of its env was scored by noise."""
    model, tokenizer = tiny
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    config = RewardModelConfig(path=str(tmp_path))
    with pytest.raises(ValueError, match=r"lacks \['score\.weight'\]") as raised:
        RewardModels({"judge": config})
    assert str(tmp_path) in str(raised.value)


def test_a_reward_model_without_a_tokenizer_is_refused_naming_its_directory(judges, tmp_path):
    """Its tokenizer was loaded with transformers' own call, whose error names no directory and
    tells one without tokenizer files to install sentencepiece or tiktoken; it is loaded as the
    engine's is (``rl.models.load_tokenizer``)."""
    judge = next(iter(judges.values()))
    for name in ("config.json", MODEL_FILE):
        shutil.copy(os.path.join(judge, name), tmp_path)
    with pytest.raises(ValueError, match="it has no tokenizer.json") as raised:
        RewardModels({"judge": RewardModelConfig(path=str(tmp_path))})
    assert str(tmp_path) in str(raised.value)


def test_a_workers_status_counts_the_reward_models_loaded_again_after_an_eviction(judges, tmp_path):
    """Two judges under a budget that holds one swap on the device as arith and guess rollouts
    alternate: the worker's status (and its progress line) counts the reloads."""
    from rl.models import ensure_base_version
    from storage.config import RunStore, StorageConfig
    from storage.weights import WeightStore
    from tasks.rollout import rollout_detail, run_rollouts
    from tests.rl.test_trainer import TINY as POLICY

    one_model = max(
        state_bytes(AutoModelForSequenceClassification.from_pretrained(path)) for path in judges.values()
    )
    run = RunConfig(
        run_id="reward-reloads",
        storage=StorageConfig(root=str(tmp_path / "runs")),
        orchestrator={"mix": {"arith": 0.5, "guess": 0.5}, "concurrency": 2},
        envs={name: {"reward_model": judge} for name, judge in JUDGES.items()},
        service={
            "max_new_tokens": 4,
            "reward_models": {name: {"path": path} for name, path in judges.items()},
            "reward_budget_mb": 1.5 * one_model / 2**20,
        },
    )
    ensure_base_version(WeightStore(RunStore(run.storage, run.run_id)), POLICY)
    stop = threading.Event()
    seen: list[dict] = []

    def on_progress(status: dict) -> None:
        seen.append(status)
        if status["reward_reloads"] >= 2 or status["orchestrator"]["finished"] >= 60:
            stop.set()

    run_rollouts(run, time.time() + 600, "w0", on_progress=on_progress, progress_every_s=0.1, stop=stop)
    assert seen[-1]["reward_reloads"] >= 2, seen[-1]["orchestrator"]
    assert "reward models reloaded" in rollout_detail(seen[-1])


@pytest.mark.parametrize("flow", ["rollouts", "evaluation"])
def test_a_run_loads_only_the_reward_models_the_envs_of_its_mix_name(judges, tmp_path, monkeypatch, flow):
    """Every configured reward model was loaded, by a rollout worker and by an evaluation,
    those of no env of the mix too: guess's judge (guess is out of the mix) cost its memory
    and load for nothing, and one that does not load (a folder holding no checkpoint, named by
    no env) failed the run."""
    from rl.models import ensure_base_version
    from rollout import service as service_module
    from storage.config import RunStore, StorageConfig
    from storage.weights import WeightStore
    from tasks.rollout import run_rollouts
    from tasks.weights import evaluate_weights
    from tests.rl.test_trainer import TINY as POLICY

    loaded: list[list[str]] = []

    class Recorded(RewardModels):
        def __init__(self, configs, **kwargs):
            loaded.append(sorted(configs))
            super().__init__(configs, **kwargs)

    monkeypatch.setattr(service_module, "RewardModels", Recorded)
    (tmp_path / "no-checkpoint").mkdir()
    run = RunConfig(
        run_id="unused-judges",
        storage=StorageConfig(root=str(tmp_path / "runs")),
        orchestrator={"mix": {"arith": 1.0}, "concurrency": 2},
        envs={name: {"reward_model": judge} for name, judge in JUDGES.items()},
        service={
            "max_new_tokens": 4,
            "reward_models": {name: {"path": path} for name, path in judges.items()}
            | {"spare": {"path": str(tmp_path / "no-checkpoint")}},
        },
        eval={"tasks_per_env": 4},
        stop={"max_rollouts": 4},
    )
    assert list(run.mix_service().reward_models) == ["judge-a"]
    ensure_base_version(WeightStore(RunStore(run.storage, run.run_id)), POLICY)
    if flow == "rollouts":
        tasks = run_rollouts(run, time.time() + 600, "w0")["orchestrator"]["tasks"]
        finished, statuses = tasks["arith"]["finished"], tasks["arith"]["statuses"]
    else:
        result = evaluate_weights(run)
        finished, statuses = result.count["arith"], result.statuses["arith"]
    assert loaded == [["judge-a"]]
    assert finished == 4
    assert set(statuses) <= {"ok", "truncated"}, statuses
