"""The token path end to end: what a real TorchEngine samples through the gateway, turn after
turn, is what the trainer scores. A tiny model's rollouts go through the gateway's records, a
raw and a processed Arrow shard, the processor's prefix tree, batching and padding; the
trainer's log-probs at the version that sampled them equal the engine's on exactly the
action tokens, each distinct one trained once."""

from __future__ import annotations

import asyncio

import pytest
import torch

from rl.batching import micro_batches, pad_batch, samples_from_table
from rl.logprobs import token_logprobs
from rl.models import TinyModelConfig, build_tiny_model
from rl.processor import ProcessorConfig, process_shard
from rollout.engines.base import ContextLimit, SamplingParams
from rollout.engines.torch_engine import TorchEngine
from rollout.gateway import Gateway, GatewayConfig
from rollout.router import Router
from storage.schema import PROCESSED_SCHEMA
from storage.shards import ShardReader, ShardWriter

POSITIONS = 160
TINY = TinyModelConfig(
    hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, max_position_embeddings=POSITIONS
)
USER = [{"role": "system", "content": "reply only digits"}, {"role": "user", "content": "What is 2 + 3?"}]
TEMPERATURE = 0.8


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return build_tiny_model(TINY)


def params(max_new_tokens: int, seed: int, stop_ids: tuple[int, ...] = ()) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=max_new_tokens, temperature=TEMPERATURE, stop_ids=stop_ids, seed=seed
    )


async def rollouts(model, tokenizer) -> tuple[list[dict], dict[str, list[tuple[int, float]]]]:
    """Records of one branching execution and of two rollouts of others sampled beside it, and
    for each trajectory the (position, engine log-prob) of every token the engine sampled for
    it (a fork's copy of its parent's action counts as sampled for both)."""
    engine = TorchEngine(model, tokenizer, name="engine-0")
    gateway = Gateway(Router([engine]), tokenizer, GatewayConfig(max_context_tokens=512))
    closing = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert closing in gateway.stop_ids
    sampled: dict[str, list[tuple[int, float]]] = {}

    def note(tid: str, session, turn) -> None:
        start = len(session.tokens) - len(turn.token_ids)
        sampled.setdefault(tid, []).extend((start + k, lp) for k, lp in enumerate(turn.logprobs))

    async def execution() -> list[dict]:
        # a first turn that ends on the template's closing token, not cut at its budget
        for seed in range(200):
            main = gateway.open(task="t", prompt_id="p", trajectory_id="main", execution_id="e1")
            main.add_messages(USER)
            first = await main.generate(params(60, seed, gateway.stop_ids))
            if first.finish_reason == "stop" and first.token_ids[-1] == closing:
                break
            gateway.close(main.session_id)
        else:
            pytest.fail("precondition: no seed ends the first turn on <|im_end|>")
        note("main", main, first)
        forked_at = len(main.tokens)
        fork_prefix = {k: list(getattr(main, k)) for k in ("tokens", "logprobs", "action_mask", "versions")}
        main.add_messages([{"role": "user", "content": "again"}])
        cut = await main.generate(params(3, 11))  # cut at its budget
        assert cut.finish_reason == "length"
        note("main", main, cut)
        main.add_tokens([])  # an observation of zero tokens: two actions side by side
        adjacent = await main.generate(params(2, 12))
        note("main", main, adjacent)
        main.add_messages([{"role": "user", "content": "go on"}])
        last = await main.generate(params(500, 13))  # cut at the model's positions
        assert last.finish_reason == "length" and len(main.tokens) == POSITIONS
        note("main", main, last)
        main.add_tokens([5, 6, 7])  # the observation that took it past the engine's positions
        with pytest.raises(ContextLimit):
            await main.generate(params(4, 14))
        records = [main.record(reward=1.0)]

        # a branch that replays the conversation: its copy of the reply is context, not action
        replay = gateway.open(task="t", prompt_id="p", trajectory_id="replay", parent_id="main")
        replay.add_messages([*USER, first.message, {"role": "user", "content": "once more"}])
        again = await replay.generate(params(6, 21))
        note("replay", replay, again)
        records.append(replay.record(reward=0.0))

        # a branch that keeps the parent's first action as sampled and goes on from there
        fork = gateway.open(
            task="t", prompt_id="p", trajectory_id="fork", parent_id="main", branch_at=forked_at
        )
        fork.add_tokens(fork_prefix["tokens"])
        fork.add_messages([{"role": "user", "content": "other"}])
        other = await fork.generate(params(5, 31))
        note("fork", fork, other)
        record = fork.record(reward=0.5)
        for name, values in fork_prefix.items():
            record[name][:forked_at] = values
        sampled["fork"] = [(k, lp) for k, lp in sampled["main"] if k < forked_at] + sampled["fork"]
        records.append(record)

        return records

    async def beside(tid: str, gateway: Gateway, prompt: list[int], seed: int) -> dict:
        """A rollout of another execution, sampled in the engine's batches beside the others
        and packed into the same micro-batch; it ends after 3 turns or at its gateway's
        context limit."""
        session = gateway.open(task="t", prompt_id="q", trajectory_id=tid)
        session.add_tokens(prompt)
        for turn_seed in (seed, seed + 1, seed + 2):
            turn = await session.generate(params(7, turn_seed))
            note(tid, session, turn)
            try:
                session.add_tokens(prompt[: turn_seed % 3])
            except ContextLimit:
                break
        return session.record(reward=1.0)

    small = Gateway(Router([engine]), tokenizer, GatewayConfig(max_context_tokens=62))
    try:
        records, *others = await asyncio.gather(
            execution(),
            beside("lone", gateway, [20, 21, 22], 41),
            beside("long", small, list(range(30, 80)), 51),
        )
        records += others
        assert engine.stats().extra["max_batch_seen"] > 1, "precondition: rollouts decoded side by side"
        long = others[1]
        assert len(long["tokens"]) == 62 and long["action_mask"][-1], (
            "precondition: cut at the gateway's limit"
        )
    finally:
        await engine.close()
    return records, sampled


def test_the_trainers_log_probs_equal_the_engines_on_exactly_the_sampled_tokens(tiny, local_store):
    """Turns ending on <|im_end|> and at their budget, an observation of zero tokens, a
    rollout cut at the model's positions (then an observation past them) and one at the
    gateway's limit, a branch that replays the conversation and one that keeps its parent's
    first action, all packed into one padded micro-batch."""
    model, tokenizer = tiny
    records, sampled = asyncio.run(rollouts(model, tokenizer))
    by_id = {r["trajectory_id"]: r for r in records}
    for tid, positions in sampled.items():  # the records hold every sampled token as an action
        record = by_id[tid]
        assert [k for k, m in enumerate(record["action_mask"]) if m] == [k for k, _ in positions], tid
        assert [record["logprobs"][k] for k, _ in positions] == [lp for _, lp in positions], tid

    raw = ShardWriter(local_store, "w0")
    raw.write_many(records)
    raw_info = raw.flush()
    raw.close()
    table = ShardReader(local_store).read(raw_info)
    result = process_shard(table, ProcessorConfig(j_max=None), shard_id=raw_info.shard_id)
    assert result.counters.errors == [] and result.processed.num_rows == 5
    processed = ShardWriter(local_store, "proc", kind="processed", schema=PROCESSED_SCHEMA)
    processed.write_table(result.processed)
    info = processed.flush()
    processed.close()
    samples, rejected = samples_from_table(
        ShardReader(local_store, "processed").read(info), info.shard_id, model.config.vocab_size
    )
    assert rejected == []
    longest = max(s.num_tokens for s in samples)
    (part,) = micro_batches(samples, len(samples) * longest)
    batch = pad_batch(part, tokenizer.pad_token_id)
    with torch.no_grad():
        logprobs = token_logprobs(
            model, batch.input_ids, batch.attention_mask, where=batch.train_mask, temperature=TEMPERATURE
        )

    trained: set[tuple[int, ...]] = set()
    for row, sample in enumerate(part):
        engine = dict(sampled[sample.trajectory_id])
        record = by_id[sample.trajectory_id]
        assert sample.num_tokens == max(engine) + 1, "the sample ends at its last sampled token"
        assert sample.tokens.tolist() == record["tokens"][: sample.num_tokens]
        assert batch.action_mask[row].nonzero()[:, 0].tolist() == sorted(engine)
        for k in batch.train_mask[row].nonzero()[:, 0].tolist():
            node = (sample.execution_id, *record["tokens"][: k + 1])
            assert node not in trained, f"{sample.trajectory_id} trains token {k} a second time"
            trained.add(node)
            assert float(batch.rollout_logprobs[row, k]) == pytest.approx(engine[k], abs=1e-6)
            assert float(logprobs[row, k]) == pytest.approx(engine[k], abs=1e-4), (sample.trajectory_id, k)
        assert not logprobs[row][~batch.train_mask[row]].any()
    every_sampled = {
        (by_id[tid]["execution_id"], *by_id[tid]["tokens"][: k + 1])
        for tid, ks in sampled.items()
        for k, _ in ks
    }
    assert trained == every_sampled, "every distinct sampled token is trained exactly once"
