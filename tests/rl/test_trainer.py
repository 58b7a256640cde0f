"""The continuous trainer on a real tiny model, a local run store, real shards and Delta tables."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save as save_file
from transformers import GPT2Config, GPT2LMHeadModel, MambaConfig, MambaForCausalLM

from flows.cli import passed_over
from flows.sql import connect
from rl.advantages import skip_observation_gae
from rl.batching import micro_batches, pad_batch, samples_from_table, take_batch
from rl.config import SAOConfig
from rl.logprobs import token_logprobs
from rl.models import (
    MASTER_WEIGHTS_FILE,
    build_tiny_model,
    ensure_base_version,
    load_policy,
    publish_policy,
    restore_master_weights,
)
from rl.process_loop import ShardProcessor
from rl.processor import ProcessorConfig, process_shard
from rl.trainer import (
    POLICY_OPTIMIZER_FILE,
    STATE_FILE,
    VALUE_MODEL_FILE,
    NonFinitePolicy,
    Trainer,
    _Consumption,
    resume_optimizer,
    token_values,
)
from storage.config import RunStore, StorageConfig
from storage.schema import PROCESSED_SCHEMA, TRAJECTORY_SCHEMA, NewerSchemaError, to_table
from storage.shards import ShardInfo, ShardReader, ShardWriter
from storage.status import HeldRole, TrainerStatus, TrainerStatusBoard
from storage.tables import StaleOffsetError, Tables, one_row_per_step
from storage.weights import CLAIM_FILE, WeightStore
from tests.conftest import readme_query
from tests.rl.synthetic import TINY, config, make_trajectories, write_shards
from tests.storage.foreign_shards import commit_foreign_file, ipc_bytes
from tests.storage.test_crash import stopped
from tests.storage.test_weights import readme_totals

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def store(tmp_path) -> RunStore:
    run = RunStore(StorageConfig(root=str(tmp_path / "runs")), "trainer-test")
    ensure_base_version(WeightStore(run), TINY)
    return run


def version_chain(weights: WeightStore) -> list[dict]:
    """Manifests from LATEST back to the base version, oldest first."""
    chain = []
    version = weights.latest()
    while version is not None:
        manifest = weights.manifest(version)
        chain.append(manifest)
        version = manifest["parent"]
    return chain[::-1]


def read_steps(store: RunStore) -> list[dict]:
    return sorted(Tables(store).read("train_steps").to_pylist(), key=lambda row: row["step"])


def trainer_status(owner: str = "") -> TrainerStatus:
    return TrainerStatus(time=time.time(), buffered_tokens=0, token_budget=44, owner=owner)


def held_trainer_role(store: RunStore) -> tuple[TrainerStatusBoard, HeldRole]:
    """The run's trainer status board, and its trainer role held by this process."""
    board = TrainerStatusBoard(store)
    role = HeldRole(board.read, board.publish, "the trainer role")
    assert role.publish(trainer_status())
    return board, role


@pytest.mark.parametrize("publish_every", [1, 100])
def test_a_trainer_whose_role_was_taken_before_it_publishes_publishes_nothing(store, publish_every):
    """Another trainer took the run while this one trained, with no status renewal between:
    the read-back before the publish (a step's, or the one on stop) finds it, and the
    trainer stops with nothing published."""
    write_shards(store, make_trajectories(store, 12, seed=1), per_shard=3)
    board, role = held_trainer_role(store)
    trainer = Trainer(store, config(publish_every=publish_every))
    board.publish(trainer_status(owner="the-new-one"))
    summary = trainer.run(drain=True, role=role)
    assert (summary.stop_reason, summary.versions, summary.steps) == ("abandoned", [], trainer.step)
    assert summary.steps >= 1 and WeightStore(store).list() == [0] and role.lost.is_set()
    # found before the upload: not a file of a version was written
    assert not trainer.weights.fs.exists(trainer.weights.version_path(1))


@pytest.mark.parametrize("publish_every", [1, 100])
def test_a_trainer_whose_role_is_taken_while_it_uploads_a_version_leaves_it_incomplete(
    store, publish_every, monkeypatch
):
    """Another trainer takes the run after the read-back before a publish, while the version's
    files upload (a step's publish, or the one on stop): the read-back before its manifest
    finds it, and the version never becomes complete, so ``LATEST`` stays where the new
    trainer resumed from."""
    write_shards(store, make_trajectories(store, 12, seed=1), per_shard=3)
    board, role = held_trainer_role(store)
    trainer = Trainer(store, config(publish_every=publish_every))
    upload = trainer.weights.fs.put_file
    uploads = []

    def put_file(local, stored, *args, **kwargs):
        if not uploads:  # the new trainer's status lands as the first file uploads
            board.publish(trainer_status(owner="the-new-one"))
        uploads.append(stored)
        return upload(local, stored, *args, **kwargs)

    monkeypatch.setattr(trainer.weights.fs, "put_file", put_file)
    summary = trainer.run(drain=True, role=role)
    assert (summary.stop_reason, summary.versions) == ("abandoned", [])
    assert uploads and role.lost.is_set()
    weights = WeightStore(store)
    assert weights.list() == [0] and weights.latest() == 0


def test_trains_every_row_once_and_logs_each_step(store):
    records = make_trajectories(store, 12, seed=1)
    infos = write_shards(store, records, per_shard=3)
    trainer = Trainer(store, config())
    seen = []
    summary = trainer.run(drain=True, progress=seen.append)

    assert summary.stop_reason == "drained"
    assert summary.steps == 3 == len(seen)  # 12 rows × 11 tokens, 4 rows per 44-token budget
    steps = read_steps(store)
    assert [row["step"] for row in steps] == [1, 2, 3]
    first = steps[0]
    assert first["num_samples"] == 4 and first["num_tokens"] == 44
    # rollout log-probs came from this very policy: ratios start at 1, nothing masked
    assert first["mean_ratio"] == pytest.approx(1.0, abs=1e-4)
    assert first["kl"] == pytest.approx(0.0, abs=1e-6)
    assert first["masked_fraction"] == 0.0
    assert first["staleness_max"] == 0 and json.loads(first["extra"])["staleness_hist"] == {"0": 4}
    assert len(json.loads(first["extra"])["value_losses"]) == 2
    assert np.isfinite(first["policy_loss"]) and first["value_loss"] > 0
    # each step names the trajectories it trained on: every one once over the run
    assert [len(row["trajectory_ids"]) for row in steps] == [row["num_samples"] for row in steps]
    trained = [trajectory for row in steps for trajectory in row["trajectory_ids"]]
    assert sorted(trained) == sorted(record["trajectory_id"] for record in records)

    chain = version_chain(trainer.weights)
    consumed = [shard for manifest in chain for shard in manifest["metadata"].get("consumed_shards", [])]
    assert sorted(consumed) == sorted(info.shard_id for info in infos)
    assert chain[-1]["step"] == 3
    # version 0 (published with no row) is recorded when the trainer resumes from it
    assert sorted(row["version"] for row in Tables(store).read("weights").to_pylist()) == [
        0,
        *summary.versions,
    ]


def test_an_execution_split_between_two_steps_trains_each_of_its_action_tokens_once(store):
    """SAO batches by tokens alone, so a batch can end between the rows of one execution.
    Nothing per-execution is taken over a batch: the processor fixed each token's loss weight
    and which row trains a shared prefix, and a row's advantages are its own
    (test_the_policy_gradient_over_micro_batches_is_the_whole_batchs). A split moves only the
    normaliser Σ w, as any other batch composition does, and loses nothing: here the owner of
    the shared prompt + first action trains it in step 1, the branch its own action in step 2."""
    owner, branch = make_trajectories(store, 2, seed=9)
    branch["execution_id"] = owner["execution_id"]
    for column in ("tokens", "logprobs", "versions"):
        branch[column][:7] = owner[column][:7]
    branch["train_mask"] = [False] * 9 + [True] * 2
    for record in (owner, branch):
        record["loss_weight"] = [1 / 7 if trained else 0.0 for trained in record["train_mask"]]
    write_shards(store, [owner, branch], per_shard=2)
    trainer = Trainer(store, config(token_budget=11))
    assert trainer.run(drain=True).steps == 2

    steps = read_steps(store)
    assert [row["trajectory_ids"] for row in steps] == [[owner["trajectory_id"]], [branch["trajectory_id"]]]
    assert [json.loads(row["extra"])["train_tokens"] for row in steps] == [5, 2]
    assert (
        sum(manifest["metadata"].get("trained_samples", 0) for manifest in version_chain(trainer.weights))
        == 2
    )


def test_a_steps_reward_counts_each_execution_once_however_many_of_its_rows_it_trains(store):
    """Three rows of one execution (a compacted rollout's contexts) with reward 0 and one of
    another with reward 1 in a step: its reward is 0.5, not 0.25."""
    records = make_trajectories(store, 4, seed=1)
    for i, record in enumerate(records):
        record["execution_id"], record["reward"] = ("failed", 0.0) if i < 3 else ("solved", 1.0)
    write_shards(store, records, per_shard=4)
    Trainer(store, config()).run(drain=True)
    (step,) = read_steps(store)
    assert step["num_samples"] == 4 and step["reward_mean"] == 0.5


def test_a_backlog_past_the_read_ahead_waits_in_storage_and_each_row_is_trained_once(store):
    """A trainer that finds more shards than ``read_ahead_batches`` steps' worth (a nightly
    run's backlog, a restart's) reads only that far into memory and the rest as its buffer
    drains; the workers' backpressure and the elastic controller still see the whole queue."""
    records = make_trajectories(store, 36, seed=7)
    infos = write_shards(store, records, per_shard=3)  # 12 shards of 33 tokens
    trainer = Trainer(store, config(read_ahead_batches=1, max_staleness=20))

    assert trainer.ingest() == 2  # 66 tokens buffered reach the 44 of one step
    assert trainer.buffered_samples() == 6 and [info.shard_id for info in trainer.unread] == [
        info.shard_id for info in infos[2:]
    ]
    assert trainer.queued_tokens() == 36 * 11 and trainer.queued_samples() == 36
    assert trainer.unconsumed_shards() == 12
    assert trainer.newest_read == {"proc": infos[1].seq}
    assert trainer.ingest() == 0  # nothing more while the buffer holds a step's worth

    buffered = []
    ingest = trainer.ingest

    def counted() -> int:
        read = ingest()
        buffered.append(trainer.buffered_tokens())
        return read

    trainer.ingest = counted
    trainer.run(drain=True)
    assert max(buffered) <= 44 + 33  # the read-ahead and one shard past it
    trained = [trajectory for row in read_steps(store) for trajectory in row["trajectory_ids"]]
    assert sorted(trained) == sorted(record["trajectory_id"] for record in records)
    assert consumed_rows(trainer.weights) == {info.shard_id: 3 for info in infos}
    assert trainer.newest_read == {"proc": infos[-1].seq} and not trainer.unread


def test_a_restarted_trainer_counts_no_consumed_shard_as_waiting(store):
    """Restarted, the trainer polls the whole log: one worker's shards are consumed, a newer
    worker's (numbered from 0 again) are not. Shards wait in order of number, so those of the
    first past the read-ahead were counted as queued though consumed: the rollout workers'
    backpressure and the elastic controller saw a backlog that was not there."""
    write_shards(store, make_trajectories(store, 24, seed=7), per_shard=4, worker="a")
    Trainer(store, config()).run(drain=True)
    write_shards(store, make_trajectories(store, 16, seed=8), per_shard=4, worker="b")
    trainer = Trainer(store, config(read_ahead_batches=1))
    assert trainer.ingest() == 1 and trainer.buffered_samples() == 4
    assert (trainer.queued_samples(), trainer.queued_tokens(), trainer.unconsumed_shards()) == (
        16,
        16 * 11,
        4,
    )


def test_the_read_ahead_stops_once_the_buffer_holds_exactly_its_tokens(store):
    write_shards(store, make_trajectories(store, 6, seed=7), per_shard=2)  # 3 shards of 22 tokens
    trainer = Trainer(store, config(read_ahead_batches=1))
    assert trainer.ingest() == 2 and trainer.buffered_tokens() == 44 and len(trainer.unread) == 1


def test_a_drain_reads_the_shards_held_back_after_the_buffer_goes_stale(store):
    """Shards bigger than the read-ahead leave the buffer past it after a step, so the next
    poll reads nothing; when that buffer is then dropped as stale, the shards still held back
    are data, not a drained log: the trainer reads them before it stops or waits idle."""
    records = make_trajectories(store, 36, seed=7)
    infos = write_shards(store, records, per_shard=12)  # 3 shards of 132 tokens, 3 steps' worth each
    trainer = Trainer(store, config(read_ahead_batches=1, max_staleness=0, publish_every=1))
    summary = trainer.run(drain=True)
    assert summary.stop_reason == "drained" and not trainer.unread
    assert consumed_rows(trainer.weights) == {info.shard_id: 12 for info in infos}


def test_on_policy_ratios_are_1_at_the_temperature_the_rollouts_sampled_at(store):
    """Rollout log-probs are of softmax(logits / T): a trainer told the rollouts' temperature
    takes the policy's at it too, so the ratios of its first (on-policy) step are 1."""
    write_shards(store, make_trajectories(store, 4, seed=1, temperature=0.7), per_shard=4)
    trainer = Trainer(store, config(), temperature=0.7)
    trainer.run(drain=True)

    (first,) = read_steps(store)
    assert first["mean_ratio"] == pytest.approx(1.0, abs=1e-4)
    assert first["kl"] == pytest.approx(0.0, abs=1e-6)
    assert first["masked_fraction"] == 0.0


def test_value_model_attention_stays_frozen_while_the_rest_trains(store):
    write_shards(store, make_trajectories(store, 8, seed=2), per_shard=4)
    trainer = Trainer(store, config())
    before = {name: p.detach().clone() for name, p in trainer.value_model.named_parameters()}
    policy_before = {name: p.detach().clone() for name, p in trainer.policy.named_parameters()}
    trainer.run(drain=True)
    after = dict(trainer.value_model.named_parameters())
    attention = [n for n in before if "self_attn" in n.split(".")]
    others = [n for n in before if n not in attention]
    assert attention and others
    for name in attention:
        assert torch.equal(before[name], after[name]), name
    changed = [n for n in others if not torch.equal(before[n], after[n])]
    assert "head.weight" in changed and any(".mlp." in n for n in changed)
    assert any(not torch.equal(policy_before[n], p) for n, p in trainer.policy.named_parameters())
    assert VALUE_MODEL_FILE in trainer.weights.manifest(trainer.weights.latest())["files"]


def test_drops_samples_older_than_max_staleness(store):
    weights = WeightStore(store)
    policy, tokenizer = load_policy(weights.load(0))
    for _ in range(3):  # versions 1..3, the trainer starts at 3
        publish_policy(weights, policy, tokenizer, parent=weights.latest())
    records = []
    for version in range(4):
        records += make_trajectories(store, 2, seed=10 + version, version=version)
    write_shards(store, records, per_shard=8)
    fresh = sorted(record["trajectory_id"] for record in records[4:])

    trainer = Trainer(store, config(max_staleness=1, token_budget=1000))
    assert trainer.version == 3
    trainer.run(drain=True)
    steps = read_steps(store)
    assert len(steps) == 1
    assert steps[0]["dropped_stale"] == 4  # versions 0 and 1 are 3 and 2 behind
    assert steps[0]["num_samples"] == 4 and sorted(steps[0]["trajectory_ids"]) == fresh
    assert steps[0]["staleness_max"] == 1 and json.loads(steps[0]["extra"])["staleness_hist"] == {
        "0": 2,
        "1": 2,
    }
    metadata = weights.manifest(weights.latest())["metadata"]
    assert metadata["dropped_stale"] == 4 and metadata["trained_samples"] == 4


def test_each_steps_row_and_version_count_the_drops_and_rejections_since_the_one_before(store):
    """A row's ``dropped_stale`` and its extra's ``rejected``, and a version's ``dropped_stale``,
    ``rejected_rows`` and ``trained_samples``, are its own, not the run's totals: every drop
    and rejection here happens before the first of two steps, each published."""
    weights = WeightStore(store)
    policy, tokenizer = load_policy(weights.load(0))
    for parent in range(2):  # the trainer starts at version 2
        publish_policy(weights, policy, tokenizer, parent=parent)
    stale = make_trajectories(store, 2, seed=60, version=0)
    fresh = make_trajectories(store, 9, seed=61, version=2)
    fresh[0]["reward"] = None
    write_shards(store, stale + fresh, per_shard=11)

    summary = Trainer(store, config(max_staleness=1, publish_every=1)).run(drain=True)
    steps = read_steps(store)
    assert [row["num_samples"] for row in steps] == [4, 4]
    assert [row["dropped_stale"] for row in steps] == [2, 0]
    assert [json.loads(row["extra"])["rejected"] for row in steps] == [
        {"reward is missing or not finite": 1},
        {},
    ]
    metadata = [weights.manifest(version)["metadata"] for version in summary.versions]
    assert [(m["dropped_stale"], m["rejected_rows"], m["trained_samples"]) for m in metadata] == [
        (2, 1, 4),
        (0, 0, 4),
    ]


def test_a_resumed_trainer_counts_staleness_along_max_staleness_versions_of_its_chain(store):
    """Resumed at version 3, whose chain is 0 → 2 → 3 (number 1 claimed by a killed publish):
    samples of version 0 are two updates behind, and max_staleness 2 trains them."""
    weights = WeightStore(store)
    os.makedirs(weights.version_path(1))
    weights.fs.pipe_file(f"{weights.version_path(1)}/{CLAIM_FILE}", b"2026-01-01T00:00:00+00:00 pid 1\n")
    policy, tokenizer = load_policy(weights.load(0))
    assert [publish_policy(weights, policy, tokenizer, parent=parent) for parent in (0, 2)] == [2, 3]
    write_shards(store, make_trajectories(store, 4, seed=62, version=0), per_shard=4)

    trainer = Trainer(store, config(max_staleness=2))
    assert [trainer.staleness(version) for version in (0, 2, 3)] == [2, 1, 0]
    trainer.run(drain=True)
    (step,) = read_steps(store)
    assert (step["num_samples"], step["staleness_max"], step["dropped_stale"]) == (4, 2, 0)


@pytest.mark.parametrize("publish_every", [1, None])
def test_a_drained_backlog_of_one_version_is_trained_whole_only_when_publishing_at_the_stop(
    store, publish_every
):
    """A nightly run: a day of rollouts, all made by the version it starts from. Publishing as
    it goes ages the backlog past ``max_staleness`` within a few steps; publishing only when it
    stops keeps every sample as fresh as that version."""
    records = make_trajectories(store, 24, seed=3, version=0)
    write_shards(store, records, per_shard=4)
    trainer = Trainer(store, config(max_staleness=1, token_budget=44, publish_every=publish_every))
    summary = trainer.run(drain=True)
    weights = WeightStore(store)
    trained = sum(row["num_samples"] for row in read_steps(store))
    stale = sum(weights.manifest(v)["metadata"]["dropped_stale"] for v in summary.versions)
    assert trained + stale == len(records)
    if publish_every is None:
        assert (trained, len(summary.versions)) == (len(records), 1)
    else:
        assert stale > 0


def test_rows_dropped_before_a_stop_with_no_step_since_are_published(store):
    """The pipeline stops the trainer while it waits for a batch, after it dropped rows of a
    shard as stale: the version it publishes as it stops lists them, so a resumed trainer
    reads only the shard's rows still to train."""
    weights = WeightStore(store)
    policy, tokenizer = load_policy(weights.load(0))
    for parent in range(2):  # the trainer starts at version 2
        publish_policy(weights, policy, tokenizer, parent=parent)
    records = make_trajectories(store, 2, seed=63, version=0) + make_trajectories(
        store, 2, seed=64, version=2
    )
    (info,) = write_shards(store, records, per_shard=4)
    trainer = Trainer(store, config(max_staleness=1))
    assert trainer.ingest() == 1 and trainer.drop_stale() == 2
    stop = threading.Event()
    stop.set()

    summary = trainer.run(stop_event=stop)
    assert (summary.stop_reason, summary.steps, summary.versions) == ("stop_event", 0, [3])
    metadata = weights.manifest(3)["metadata"]
    assert (metadata["consumed_rows"], metadata["dropped_stale"]) == ({info.shard_id: 2}, 2)
    resumed = Trainer(store, config(max_staleness=1))
    assert resumed.ingest() == 1 and sorted(s.trajectory_id for s in resumed.buffer) == [
        record["trajectory_id"] for record in records[2:]
    ]


def test_a_processed_shard_of_a_newer_treadle_stops_the_trainer_once_it_published_what_it_trained(store):
    """The trainer failed at the shard, naming it, and what it had trained since its last
    version was lost with the run: all of it for a run that publishes only at its stop."""
    records = make_trajectories(store, 4, seed=7)
    write_shards(store, records, per_shard=4)
    newer = to_table(records[:2], PROCESSED_SCHEMA).replace_schema_metadata({"treadle.schema": "processed/3"})

    def a_newer_shard_lands(row):
        commit_foreign_file(store, 9, ipc_bytes(newer), kind="processed")

    trainer = Trainer(store, config(publish_every=None))
    with pytest.raises(NewerSchemaError, match="processed/w9/00000009"):
        trainer.run(drain=True, progress=a_newer_shard_lands)
    assert trainer.version == 1 and version_chain(trainer.weights)[-1]["step"] == 1


def test_a_storage_error_reading_the_shards_fails_the_trainer_once_it_published_what_it_trained(
    store, monkeypatch
):
    """A transient error fetching a shard (or polling the log) fails the run, whose task
    retries from LATEST: without a publish first, every step since the last version was lost
    with it, all of a night's for a run that publishes only at its stop."""
    infos = write_shards(store, make_trajectories(store, 8, seed=45), per_shard=4)  # 44 tokens each
    trainer = Trainer(store, config(publish_every=None, read_ahead_batches=1))
    real = trainer.reader.read

    def flaky(info):
        if info.seq == 1:
            raise OSError("connection reset while fetching the shard")
        return real(info)

    monkeypatch.setattr(trainer.reader, "read", flaky)
    with pytest.raises(OSError, match="connection reset"):
        trainer.run(drain=True)
    assert trainer.version == 1 and version_chain(trainer.weights)[-1]["step"] == 1
    assert consumed_rows(trainer.weights) == {infos[0].shard_id: 4}
    resumed = Trainer(store, config(publish_every=None))
    assert resumed.run(drain=True).steps == 2
    assert consumed_rows(resumed.weights) == {info.shard_id: 4 for info in infos}


def test_publishing_only_at_the_stop_needs_publish_on_stop():
    with pytest.raises(
        ValueError, match="publish_every null publishes only at the stop: it needs publish_on_stop"
    ):
        config(publish_every=None, publish_on_stop=False)


def test_grpo_drops_a_group_whole_when_one_member_is_stale(store):
    weights = WeightStore(store)
    policy, tokenizer = load_policy(weights.load(0))
    for _ in range(2):  # the trainer starts at version 2
        publish_policy(weights, policy, tokenizer, parent=weights.latest())
    stale, fresh = (
        make_trajectories(store, 2, seed=20, version=0),
        make_trajectories(store, 4, seed=21, version=2),
    )
    stale[1]["group_id"] = fresh[0]["group_id"] = fresh[1]["group_id"] = "mixed"
    write_shards(store, stale + fresh, per_shard=6)

    trainer = Trainer(store, config(mode="grpo", max_staleness=1, token_budget=1000))
    trainer.run(drain=True)
    (step,) = read_steps(store)
    assert step["dropped_stale"] == 4 and step["num_samples"] == 2  # only the last pair is whole and fresh
    assert sorted(step["trajectory_ids"]) == [record["trajectory_id"] for record in fresh[2:]]


@pytest.mark.parametrize("skipped", ["claimed by a killed publish", "passed over"])
def test_staleness_counts_the_versions_on_the_chain_not_the_numbers_it_skips(store, skipped):
    """Version 1 never became a policy the trainer trained from (a publish killed after it
    claimed the number, or a version that does not verify): the trainer's first version is
    2, one update after 0, so samples of version 0 trained after it are 1 version behind and
    are trained under max_staleness 1, not dropped as 2 behind."""
    weights = WeightStore(store)
    if skipped == "passed over":
        policy, tokenizer = load_policy(weights.load(0))
        publish_policy(weights, policy, tokenizer, parent=0)
        os.truncate(os.path.join(weights.version_path(1), "config.json"), 0)
    else:
        os.makedirs(weights.version_path(1))
        weights.fs.pipe_file(f"{weights.version_path(1)}/{CLAIM_FILE}", b"2026-01-01T00:00:00+00:00 pid 1\n")
    write_shards(store, make_trajectories(store, 8, seed=22, version=0), per_shard=4)

    trainer = Trainer(store, config(max_staleness=1, publish_every=1))
    assert trainer.version == 0
    trainer.run(drain=True)
    steps = read_steps(store)
    assert [(row["version"], row["staleness_max"], row["dropped_stale"]) for row in steps] == [
        (0, 0, 0),
        (2, 1, 0),
    ]
    assert [manifest["version"] for manifest in version_chain(weights)] == [0, 2, 3]


def test_staleness_past_a_chain_cut_by_retention_counts_each_version_once(store):
    """Retention deleted versions 1 and 2, so the chain the trainer knows of its version 3 is
    [2, 3] (2 named by 3's manifest, whose own is gone): samples of version 1 are two updates
    behind (2 → 3 on the chain, 1 → 2 past it) and are trained under max_staleness 2, not
    counted three behind and dropped."""
    weights = WeightStore(store)
    policy, tokenizer = load_policy(weights.load(0))
    for parent in range(3):
        publish_policy(weights, policy, tokenizer, parent=parent)
    weights.retain(1)
    assert weights.list() == [0, 3]  # the base version stays
    write_shards(store, make_trajectories(store, 4, seed=23, version=1), per_shard=4)
    trainer = Trainer(store, config(max_staleness=2, publish_every=1))
    assert trainer.version == 3 and trainer.staleness(1) == 2
    trainer.run(drain=True)
    (step,) = read_steps(store)
    assert (step["staleness_max"], step["dropped_stale"], step["num_samples"]) == (2, 0, 4)


def commit_raw_shard(store: RunStore, table: pa.Table, name: str) -> str:
    """Write an Arrow file and commit it without the writer's validation (bad data on purpose)."""
    path = f"shards/processed/bad/{name}.arrow"
    full = store.path(path)
    os.makedirs(os.path.dirname(full), exist_ok=True)
    with pa.OSFile(full, "wb") as sink, pa.ipc.new_file(sink, table.schema) as out:
        out.write_table(table)
    shard_id = f"processed/bad/{name}"
    Tables(store).append(
        "shards",
        [
            {
                "shard_id": shard_id,
                "kind": "processed",
                "path": path,
                "worker": "bad",
                "seq": int(name[-1]),
                "num_rows": table.num_rows,
                "num_tokens": 11 * table.num_rows,
                "min_version": 0,
                "max_version": 0,
                "committed_at": datetime.now(UTC),
            }
        ],
    )
    return shard_id


def test_float16_parameters_are_refused_at_once(store):
    """AdamW's eps underflows in float16: the first step would make every parameter NaN and
    every later batch be rejected."""
    with pytest.raises(ValueError, match="float16 parameters cannot be trained with AdamW"):
        Trainer(store, config(), dtype=torch.float16)


def test_bfloat16_parameters_are_refused_at_once(store):
    """AdamW moves each parameter by about ``lr`` a step (exactly ``lr`` at the first), which
    rounds away in bfloat16 for every weight above about 256·lr: at the default lr of 1e-5 one step left
    over 80% of the tiny policy's parameters as they were, and a larger model's ~0.02 weights
    would never move; the trainer would go on publishing versions that learned nothing."""
    weight = torch.tensor(0.02, dtype=torch.bfloat16)
    assert weight - SAOConfig().lr == weight  # the update is lost
    with pytest.raises(ValueError, match="bfloat16 parameters cannot be trained with AdamW"):
        Trainer(store, config(), dtype=torch.bfloat16)


@pytest.mark.parametrize("temperature", [0.0, -1.0])
def test_a_sampling_temperature_that_is_not_a_positive_number_is_refused_at_once(store, temperature):
    """At 0 every policy log-prob was NaN: the first batch's critic steps were taken, then the
    trainer stopped blaming the batch's rewards; at −1 it trained on reversed logits."""
    with pytest.raises(ValueError, match=f"temperature must be a finite number above 0, got {temperature}"):
        Trainer(store, config(), temperature=temperature)


def test_rejects_bad_data_with_reasons_and_keeps_training(store, caplog):
    good = make_trajectories(store, 4, seed=3)
    bad_rows = make_trajectories(store, 4, seed=4)
    bad_rows[0]["train_mask"] = [False] * 11  # nothing to train
    bad_rows[1]["status"] = "env_error"
    bad_rows[2]["reward"] = None
    out_of_vocab = make_trajectories(store, 2, seed=5)
    out_of_vocab[1]["tokens"][5] = 5000
    nan_rows = make_trajectories(store, 2, seed=6)
    nan_rows[0]["logprobs"][5] = float("nan")

    infos = write_shards(store, bad_rows, per_shard=4, worker="a")
    infos += write_shards(store, out_of_vocab, per_shard=2, worker="b")
    nan_id = commit_raw_shard(store, to_table(nan_rows, PROCESSED_SCHEMA), "nan0")
    (lost,) = write_shards(store, make_trajectories(store, 2, seed=7), per_shard=2, worker="d")
    os.remove(store.path(lost.path))  # committed, then its file deleted
    infos += [lost, *write_shards(store, good, per_shard=4, worker="c")]

    trainer = Trainer(store, config(token_budget=1000))
    with caplog.at_level("WARNING"):
        summary = trainer.run(drain=True)
    assert summary.stop_reason == "drained"
    steps = read_steps(store)
    assert len(steps) == 1 and steps[0]["num_samples"] == 5  # 4 good + the one clean bad row
    rejected = json.loads(steps[0]["extra"])["rejected"]
    assert rejected["no trainable tokens (train_mask empty)"] == 1
    assert rejected["status 'env_error' is excluded from the loss"] == 1
    assert rejected["reward is missing or not finite"] == 1
    assert rejected["shard quarantined"] == 2
    assert rejected["shard file missing"] == 2
    assert sum(v for k, v in rejected.items() if "outside the policy's vocabulary of 300" in k) == 2
    assert "token id 5000 outside" in caplog.text
    consumed = [s for m in version_chain(trainer.weights) for s in m["metadata"].get("consumed_shards", [])]
    assert sorted(consumed) == sorted([info.shard_id for info in infos] + [nan_id])


def fail_train_steps_appends(tables: Tables, monkeypatch, after: int = 0, count: int = 1) -> None:
    """The ``count`` appends to ``train_steps`` through ``tables`` after the first ``after``
    (which land) time out; the later ones land."""
    append = tables.append
    failures = iter([None] * after + [OSError("timed out (injected)")] * count)

    def flaky(name, rows, *args, **kwargs):
        failure = next(failures, None) if name == "train_steps" else None
        if failure is not None:
            raise failure
        return append(name, rows, *args, **kwargs)

    monkeypatch.setattr(tables, "append", flaky)


def test_a_failed_train_steps_append_keeps_training_and_its_row_goes_with_the_next(
    store, monkeypatch, caplog
):
    """The append of step 1's row fails after its optimizer step: the trainer goes on, every
    row is consumed once in the published versions, and step 1's row lands with step 2's."""
    infos = write_shards(store, make_trajectories(store, 12, seed=1), per_shard=3)
    trainer = Trainer(store, config())
    fail_train_steps_appends(trainer.tables, monkeypatch)
    with caplog.at_level("WARNING"):
        summary = trainer.run(drain=True)

    assert (summary.stop_reason, summary.steps) == ("drained", 3)
    assert "could not append 1 train_steps rows (steps 1 to 1)" in caplog.text
    assert "timed out (injected)" in caplog.text
    assert [row["step"] for row in read_steps(store)] == [1, 2, 3]
    chain = version_chain(trainer.weights)
    consumed = [shard for manifest in chain for shard in manifest["metadata"].get("consumed_shards", [])]
    assert sorted(consumed) == sorted(info.shard_id for info in infos)
    assert sum(manifest["metadata"].get("trained_samples", 0) for manifest in chain) == 12
    assert chain[-1]["step"] == 3


def test_a_failed_train_steps_append_of_the_last_step_is_appended_as_the_trainer_stops(
    store, monkeypatch, caplog
):
    """No step follows the last one to take its row along: the trainer appends it as it stops."""
    write_shards(store, make_trajectories(store, 12, seed=1), per_shard=3)
    trainer = Trainer(store, config())
    fail_train_steps_appends(trainer.tables, monkeypatch, after=2)
    with caplog.at_level("WARNING"):
        summary = trainer.run(drain=True)

    assert (summary.stop_reason, summary.steps) == ("drained", 3)
    assert "could not append 1 train_steps rows (steps 3 to 3)" in caplog.text
    assert [row["step"] for row in read_steps(store)] == [1, 2, 3]


def test_rows_of_failed_train_steps_appends_past_the_limit_keep_the_newest(store, monkeypatch, caplog):
    """Appends that keep failing hold at most ``MAX_UNWRITTEN_ROWS`` rows: the oldest go, and
    the newest land with the next append that does."""
    monkeypatch.setattr("rl.trainer.MAX_UNWRITTEN_ROWS", 1)
    write_shards(store, make_trajectories(store, 12, seed=1), per_shard=3)
    trainer = Trainer(store, config())
    fail_train_steps_appends(trainer.tables, monkeypatch, count=2)
    with caplog.at_level("WARNING"):
        assert trainer.run(drain=True).steps == 3

    assert (
        "could not append 2 train_steps rows (steps 1 to 2), kept for the next step's append (1 dropped)"
        in (caplog.text)
    )
    assert [row["step"] for row in read_steps(store)] == [2, 3]


def test_a_train_steps_row_the_schema_refuses_is_dropped_and_the_rows_kept_before_it_land(
    store, monkeypatch, caplog
):
    """A row that cannot be cast to the table's schema (here a null version) would fail every
    append it went with: it is dropped alone, and the rows an earlier failed append kept land."""
    metrics, trainer = one_step(store, make_trajectories(store, 4, seed=1))
    fail_train_steps_appends(trainer.tables, monkeypatch)
    trainer._log_step({**metrics.row, "step": 2})
    with caplog.at_level("WARNING"):
        trainer._log_step({**metrics.row, "step": 3, "version": None})

    assert "step 3: its train_steps row is dropped" in caplog.text
    assert [row["step"] for row in read_steps(store)] == [1, 2]
    assert trainer._unwritten_rows == []


@pytest.mark.parametrize(("failures", "landed"), [(1, [1]), (2, [])])
def test_rows_kept_from_a_failed_train_steps_append_land_when_a_non_finite_policy_stops_the_trainer(
    store, monkeypatch, failures, landed
):
    """Step 1's append fails and its row is kept for the next append; the policy then turns
    NaN, and no later step takes the row along: it is appended as the trainer stops. The
    stop is the NonFinitePolicy error, also when that append fails too."""
    write_shards(store, make_trajectories(store, 12, seed=1), per_shard=4)
    trainer = Trainer(store, config(publish_every=None))
    fail_train_steps_appends(trainer.tables, monkeypatch, count=failures)
    trainer._train_step(open_batch(trainer, make_trajectories(store, 4, seed=2)))
    assert [row["step"] for row in trainer._unwritten_rows] == [1] and read_steps(store) == []
    with torch.no_grad():
        trainer.policy.get_output_embeddings().weight[0, 0] = float("nan")

    with pytest.raises(NonFinitePolicy, match="holds a NaN or an infinity at step 1"):
        trainer.run(drain=True)
    assert [row["step"] for row in read_steps(store)] == landed and trainer._unwritten_rows == []


def raising() -> dict:
    raise RuntimeError("bad decision (injected)")


@pytest.mark.parametrize(
    ("first", "said"),
    [
        (raising, "bad decision (injected)"),
        (lambda: {"elastic": {"moves": {1, 2}}}, "set is not JSON serializable"),
        (lambda: [("elastic", 1)], "it returned a list, not a dict"),
    ],
    ids=["raises", "not-json", "not-a-dict"],
)
def test_a_failing_step_extra_leaves_its_row_without_it_and_training_goes_on(store, caplog, first, said):
    """What ``step_extra`` gives is checked before the step's row takes it: one that raises,
    or returns what ``train_steps``' JSON cannot hold, leaves that row without it."""
    infos = write_shards(store, make_trajectories(store, 12, seed=1), per_shard=3)
    trainer = Trainer(store, config())
    calls = iter([first])

    def step_extra() -> dict:
        return next(calls, lambda: {"elastic": {"moves": []}})()

    with caplog.at_level("WARNING"):
        summary = trainer.run(drain=True, step_extra=step_extra)

    assert (summary.stop_reason, summary.steps) == ("drained", 3)
    assert "step 1: step_extra failed" in caplog.text and said in caplog.text
    extras = [json.loads(row["extra"]) for row in read_steps(store)]
    assert ["elastic" in extra for extra in extras] == [False, True, True]
    consumed = [s for m in version_chain(trainer.weights) for s in m["metadata"].get("consumed_shards", [])]
    assert sorted(consumed) == sorted(info.shard_id for info in infos)


def swapped_tokenizer(tokenizer, folder):
    """``tokenizer`` saved in ``folder`` with two ids swapped: a vocabulary of the same size
    that is another's."""
    tokenizer.save_pretrained(folder)
    data = json.loads((folder / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    first, second = sorted(vocab)[:2]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (folder / "tokenizer.json").write_text(json.dumps(data))
    return folder


def test_rejects_a_shard_generated_with_another_tokenizer(store, tmp_path, caplog):
    weights = WeightStore(store)
    trainer = Trainer(store, config(token_budget=1000))
    policy, tokenizer = load_policy(weights.load(0))
    foreign = swapped_tokenizer(tokenizer, tmp_path / "foreign-tokenizer")
    version = weights.publish(policy.state_dict(), policy.config.to_dict(), foreign)

    infos = write_shards(store, make_trajectories(store, 2, seed=7, version=version), per_shard=2, worker="f")
    infos += write_shards(store, make_trajectories(store, 4, seed=8), per_shard=4, worker="c")
    with caplog.at_level("WARNING"):
        trainer.run(drain=True)
    (step,) = read_steps(store)
    assert step["num_samples"] == 4
    reason = (
        f"generated by weight version {version}, whose tokenizer's vocabulary differs from the policy's: "
        "shard from another tokenizer"
    )
    assert json.loads(step["extra"])["rejected"] == {reason: 2}
    assert f"rejected shard {infos[0].shard_id}" in caplog.text


def test_rejects_a_shard_with_a_version_of_another_tokenizer_between_two_of_its_own(store, tmp_path, caplog):
    """Versions 0 and 2 have the policy's tokenizer, version 1 another: a shard generated
    by all three spans 0 to 2, and its rows of version 1 are in ids of the other vocabulary."""
    weights = WeightStore(store)
    trainer = Trainer(store, config(token_budget=1000))
    policy, tokenizer = load_policy(weights.load(0))
    own = tmp_path / "own-tokenizer"
    tokenizer.save_pretrained(own)
    foreign = swapped_tokenizer(tokenizer, tmp_path / "foreign-tokenizer")
    other = weights.publish(policy.state_dict(), policy.config.to_dict(), foreign)
    back = weights.publish(policy.state_dict(), policy.config.to_dict(), own)
    assert (other, back) == (1, 2)

    mixed = [
        record
        for seed, version in ((7, 0), (8, other), (9, back))
        for record in make_trajectories(store, 1, seed=seed, version=version)
    ]
    infos = write_shards(store, mixed, per_shard=3, worker="f")
    assert (infos[0].min_version, infos[0].max_version) == (0, back)
    write_shards(store, make_trajectories(store, 4, seed=10), per_shard=4, worker="c")
    with caplog.at_level("WARNING"):
        trainer.run(drain=True)
    (step,) = read_steps(store)
    assert step["num_samples"] == 4
    reason = (
        f"generated by weight version {other}, whose tokenizer's vocabulary differs from the policy's: "
        "shard from another tokenizer"
    )
    assert json.loads(step["extra"])["rejected"] == {reason: 3}
    assert f"rejected shard {infos[0].shard_id}" in caplog.text


def test_batching_budget_groups_micro_batches_and_padding(store):
    records = make_trajectories(store, 6, seed=14)
    records[5]["tokens"] = records[5]["tokens"][:10]  # its last action one token short
    for column in ("logprobs", "action_mask", "turn", "versions", "train_mask", "loss_weight"):
        records[5][column] = records[5][column][:10]
    samples, rejected = samples_from_table(
        to_table(records, PROCESSED_SCHEMA), "processed/w/0", vocab_size=300
    )
    assert rejected == [] and [s.num_tokens for s in samples] == [11] * 5 + [10]

    buffer = deque(samples)
    assert [s.row for s in take_batch(buffer, 30)] == [0, 1]  # a third row would make 33
    assert [s.row for s in take_batch(buffer, 5)] == [2]  # at least one row, even over budget
    assert [s.row for s in take_batch(buffer, 11, keep_groups=True)] == [
        3
    ]  # rows 3 and 4 are different pairs
    buffer = deque(samples)
    assert [s.row for s in take_batch(buffer, 11, keep_groups=True)] == [0, 1]  # rows 0 and 1 share a group

    parts = micro_batches(samples, micro_token_budget=30)
    assert [[s.row for s in part] for part in parts] == [[0, 1], [2, 3], [4, 5]]

    batch = pad_batch(samples[4:], pad_id=0)
    assert batch.input_ids.shape == (2, 11)
    assert batch.attention_mask[1].tolist() == [True] * 10 + [False]
    assert batch.input_ids[1, 10:].tolist() == [0]
    assert batch.rewards[1].nonzero().flatten().tolist() in (
        [9],
        [],
    )  # the reward sits on the last real token
    assert batch.rewards[1, 9] == records[5]["reward"] and batch.rewards[0, 10] == records[4]["reward"]
    assert not batch.action_mask[1, 10:].any() and batch.loss_weight[1, 10:].sum() == 0


def test_all_masked_batch_is_rejected_not_trained(store):
    records = make_trajectories(store, 2, seed=7)
    trainer = Trainer(store, config())
    samples, _ = samples_from_table(to_table(records, PROCESSED_SCHEMA), "processed/x/0", trainer.vocab_size)
    info = unlogged_shard("processed/x/0", 2)
    trainer.consumption.open(info)
    for sample in samples:
        sample.train_mask[:] = False
    assert trainer._train_step(samples) is None
    assert trainer.step == 0
    assert trainer._rejected["all-masked batch: no trainable tokens"] == 2
    assert trainer.consumption.consumed(info)


def unlogged_shard(shard_id: str, num_rows: int) -> ShardInfo:
    """A shard ``kind/worker/seq`` of ``num_rows`` rows that is in no log."""
    kind, worker, seq = shard_id.split("/")
    return ShardInfo(shard_id, kind, f"shards/{shard_id}.arrow", worker, int(seq), num_rows, 0, -1, -1)


def test_consumption_marks_agree_with_a_reference_of_every_consumed_row():
    """Shards opened in each worker's number order (as ``ingest`` reads them), rows consumed in
    any order, and restarts from the saved state replayed as ``ingest`` does: a shard counts
    as consumed exactly when every row of it is, a restart hands back each shard's rows
    consumed before it, and the state keeps a mark per worker over its run of consumed
    shards with only what lies above it listed (checked against a slow reference)."""
    rng = random.Random(11)
    for _ in range(300):
        infos = [
            unlogged_shard(f"processed/{worker}/{seq}", rng.randint(0, 3))
            for worker, count in (("a", rng.randint(1, 5)), ("b", rng.randint(1, 5)))
            for seq in range(count)
        ]
        unopened = {worker: [i for i in infos if i.worker == worker] for worker in ("a", "b")}
        reference: dict[str, set[int]] = {}
        opened: list[ShardInfo] = []
        consumption = _Consumption()
        marked = {"shards": [], "rows": 0}
        while any(unopened.values()) or any(len(reference[i.shard_id]) < i.num_rows for i in opened):
            action = rng.random()
            open_rows = [
                (i.shard_id, row)
                for i in opened
                for row in range(i.num_rows)
                if row not in reference[i.shard_id]
            ]
            if action < 0.1:  # a restart from the state a version saves; the log read again
                consumption = _Consumption(
                    through=dict(consumption.through),
                    done=set(consumption.done),
                    rows={shard: set(rows) for shard, rows in consumption.rows.items()},
                )
                marked = {"shards": [], "rows": 0}
                for info in opened:
                    if consumption.consumed(info):
                        consumption.saw(info)
                    else:
                        assert consumption.open(info) == reference[info.shard_id]
            elif action < 0.4 and any(unopened.values()):
                info = unopened[rng.choice([w for w, left in unopened.items() if left])].pop(0)
                assert not consumption.consumed(info)
                assert consumption.open(info) == set()
                reference[info.shard_id] = set()
                opened.append(info)
                if info.num_rows == 0:
                    marked["shards"].append(info.shard_id)
            elif open_rows:
                shard_id, row = rng.choice(open_rows)
                consumption.mark(shard_id, [row])
                reference[shard_id].add(row)
                marked["rows"] += 1
                if len(reference[shard_id]) == next(i.num_rows for i in opened if i.shard_id == shard_id):
                    marked["shards"].append(shard_id)
            done = {i.shard_id for i in opened if len(reference[i.shard_id]) == i.num_rows}
            assert {i.shard_id for i in opened if consumption.consumed(i)} == done
            through = {}
            for worker in ("a", "b"):
                run = -1
                for info in (i for i in opened if i.worker == worker):
                    if info.shard_id not in done:
                        break
                    run = info.seq
                if run >= 0:
                    through[worker] = run
            assert consumption.through == through
            assert consumption.done == {
                s for s in done if int(s.rsplit("/", 1)[1]) > through.get(s.split("/")[1], -1)
            }
            assert consumption.rows == {
                i.shard_id: reference[i.shard_id]
                for i in opened
                if i.shard_id not in done and reference[i.shard_id]
            } | {s: r for s, r in consumption.rows.items() if not r}
            assert consumption.since_publish_shards == marked["shards"]
            assert sum(consumption.since_publish_rows.values()) == marked["rows"]


def test_a_row_consumed_twice_is_refused_and_nothing_of_its_mark_is_kept():
    consumption = _Consumption()
    consumption.open(unlogged_shard("processed/a/0", 3))
    consumption.mark("processed/a/0", [0])
    with pytest.raises(RuntimeError, match=r"rows of shard processed/a/0 consumed twice: \[0\]"):
        consumption.mark("processed/a/0", [1, 0])
    assert consumption.rows == {"processed/a/0": {0}} and consumption.since_publish_rows["processed/a/0"] == 1


def open_batch(trainer: Trainer, records: list[dict], shard_id: str = "processed/x/0") -> list:
    """``records`` as one batch for ``trainer._train_step``, without going through the shard log."""
    samples, rejected = samples_from_table(to_table(records, PROCESSED_SCHEMA), shard_id, trainer.vocab_size)
    assert rejected == []
    trainer.consumption.open(unlogged_shard(shard_id, len(samples)))
    return samples


def with_rewards(records: list[dict], rewards: list[float]) -> list[dict]:
    for record, reward in zip(records, rewards, strict=True):
        record["reward"] = reward
    return records


def one_step(store: RunStore, records: list[dict], **overrides):
    """A fresh trainer's first step on ``records``; returns its metrics and the trainer."""
    trainer = Trainer(store, config(**overrides))
    return trainer._train_step(open_batch(trainer, records)), trainer


def parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def unchanged(model: torch.nn.Module, before: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(p, before[name]) for name, p in model.named_parameters())


def a_restarted_trainer_trains_every_row_once(store: RunStore, records: list[dict], mode: str) -> None:
    """A trainer started after one that stopped drains the log: every row of ``records`` is
    trained once along the chain of versions, none rejected."""
    Trainer(store, config(mode=mode)).run(drain=True)
    chain = [manifest["metadata"] for manifest in version_chain(WeightStore(store))]
    assert sum(metadata.get("trained_samples", 0) for metadata in chain) == len(records)
    assert sum(metadata.get("rejected_rows", 0) + metadata.get("dropped_stale", 0) for metadata in chain) == 0


@pytest.mark.parametrize("mode", ["sao", "grpo"])
def test_a_policy_with_non_finite_weights_stops_the_trainer_before_it_consumes_or_publishes(store, mode):
    """Refused batch by batch, the whole backlog was consumed as rejected and published so at
    the stop (with the NaN weights): lost for training."""
    records = make_trajectories(store, 12, seed=20)
    write_shards(store, records, per_shard=4)
    trainer = Trainer(store, config(mode=mode))
    critic = None if trainer.value_model is None else parameters(trainer.value_model)
    with torch.no_grad():
        trainer.policy.get_output_embeddings().weight[0, 0] = float("nan")

    with pytest.raises(
        NonFinitePolicy,
        match=r"embed_tokens.weight holds a NaN or an infinity at step 0.*resumes from version 0",
    ):
        trainer.run(drain=True)
    assert WeightStore(store).latest() == 0 and trainer.step == 0 and read_steps(store) == []
    assert critic is None or unchanged(trainer.value_model, critic)
    with pytest.raises(NonFinitePolicy):  # the trainer stays stopped
        trainer.publish()

    a_restarted_trainer_trains_every_row_once(store, records, mode)


def test_a_step_that_makes_the_weights_non_finite_is_never_published(store):
    """A NaN in the optimizer's moments (say, of a resumed optimizer file) turns a step with a
    finite gradient into NaN weights: the publish after it refuses, so the rows that step
    consumed stay in no version."""
    records = make_trajectories(store, 12, seed=20)
    write_shards(store, records, per_shard=4)
    trainer = Trainer(store, config(publish_every=1))
    assert trainer.run(max_steps=1).versions == [1]
    for state in trainer.policy_optimizer.state.values():
        state["exp_avg_sq"].fill_(float("nan"))

    with pytest.raises(
        NonFinitePolicy,
        match=r"at step 2, 1 steps after weight version 1: the trainer stops and publishes nothing",
    ):
        trainer.run(drain=True)
    assert WeightStore(store).latest() == 1

    a_restarted_trainer_trains_every_row_once(store, records, "sao")


def test_a_policy_loss_that_overflows_after_the_critics_steps_stops_the_trainer(store):
    """Finite weights large enough that the policy's logits overflow: the batch was refused
    after the critic had taken its K steps on it (the critic learning from a batch the trainer
    refused), and so was every batch after it, each consumed."""
    records = make_trajectories(store, 12, seed=20)
    write_shards(store, records, per_shard=4)
    trainer = Trainer(store, config())
    with torch.no_grad():
        trainer.policy.get_output_embeddings().weight.mul_(1e38)

    with pytest.raises(
        NonFinitePolicy, match=r"non-finite policy loss .* at step 1, 0 steps after weight version 0"
    ):
        trainer.run(drain=True)
    assert WeightStore(store).latest() == 0 and read_steps(store) == []
    with pytest.raises(NonFinitePolicy):  # its critic holds the batch's steps: it stays stopped
        trainer.run(drain=True)

    a_restarted_trainer_trains_every_row_once(store, records, "sao")


def test_grpo_rejects_a_batch_whose_policy_loss_overflows_and_trains_on(store):
    """No critic moves before the policy step in GRPO: a batch whose advantages overflow the
    loss (rewards ±3e38 in a group) is refused, not a reason to stop."""
    trainer = Trainer(store, config(mode="grpo"))
    bad = open_batch(
        trainer, with_rewards(make_trajectories(store, 4, seed=20), [3e38, -3e38, 0.0, 1.0]), "processed/x/0"
    )
    good = open_batch(trainer, make_trajectories(store, 4, seed=21), "processed/x/1")
    policy = parameters(trainer.policy)

    assert trainer._train_step(bad) is None
    assert unchanged(trainer.policy, policy) and trainer.step == 0
    metrics = trainer._train_step(good)
    assert metrics is not None and sum(metrics.extra["rejected"].values()) == 4


def test_a_reward_that_overflows_the_critics_loss_is_rejected_and_leaves_the_critic_finite(store):
    """3e38 is a finite float32 reward (the schema takes it), but its squared error and the
    gradient overflow: a critic step on it would make every later batch's advantages NaN."""
    trainer = Trainer(store, config())
    bad = open_batch(
        trainer, with_rewards(make_trajectories(store, 4, seed=20), [3e38, 0.0, 1.0, 0.0]), "processed/x/0"
    )
    good = open_batch(trainer, make_trajectories(store, 4, seed=21), "processed/x/1")
    critic = parameters(trainer.value_model)

    assert trainer._train_step(bad) is None
    assert trainer._rejected == {"non-finite critic loss or gradient norm": 4}
    assert unchanged(trainer.value_model, critic) and trainer.step == 0

    metrics = trainer._train_step(good)
    assert metrics is not None and math.isfinite(metrics.row["policy_loss"])
    assert not unchanged(trainer.value_model, critic)
    assert all(torch.isfinite(p).all() for p in trainer.value_model.parameters())


def test_policy_step_uses_advantages_of_the_critic_after_its_k_steps(store):
    records = with_rewards(make_trajectories(store, 4, seed=22), [1.0, 0.0, 0.0, 1.0])
    trainer = Trainer(store, config(value_lr=0.05))
    samples = open_batch(trainer, records)
    calls = []
    # the policy's log-probs run its decoder and, apart, its head
    for name, model in (("critic", trainer.value_model), ("policy", trainer.policy.get_decoder())):
        model.register_forward_hook(lambda *_, name=name: calls.append((name, torch.is_grad_enabled())))
    metrics = trainer._train_step(samples)

    # two micro-batches of 2 rows: K = 2 critic steps, the advantages' values, the policy step
    trained = [call for call in calls if call != ("policy", False)]
    assert trained == [("critic", True)] * 4 + [("critic", False)] * 2 + [("policy", True)] * 2
    batch = pad_batch(samples, trainer.pad_id)
    with torch.no_grad():  # the policy step does not touch the critic: this is its state after K steps
        values = token_values(trainer.value_model, batch.input_ids, batch.attention_mask)

    def advantage_stats(critic_values: torch.Tensor):
        advantages = skip_observation_gae(batch.rewards, critic_values, batch.action_mask, 1.0, 0.95)[0]
        used = advantages[batch.train_mask]
        return pytest.approx([float(used.mean()), float(used.std())], abs=1e-5)

    reported = [metrics.extra["advantage_mean"], metrics.extra["advantage_std"]]
    assert reported == advantage_stats(values)
    assert reported != advantage_stats(torch.zeros_like(values))  # the critic before its steps (head at 0)


def test_adaptive_lambda_is_one_minus_one_over_alpha_times_the_action_length(store):
    records = with_rewards(make_trajectories(store, 4, seed=23), [1.0, 0.0, 1.0, 1.0])
    # every row has 5 action tokens: λ = 1 − 1/(0.5·5) = 0.6 instead of lam = 0.95
    adaptive, adaptive_trainer = one_step(store, records, adaptive_lambda=True, lambda_alpha=0.5)
    fixed, fixed_trainer = one_step(store, records, lam=0.6)
    default, _ = one_step(store, records)

    for key in ("advantage_mean", "advantage_std"):
        assert adaptive.extra[key] == pytest.approx(fixed.extra[key], abs=1e-6)
        assert abs(adaptive.extra[key] - default.extra[key]) > 1e-2
    for name, p in adaptive_trainer.policy.named_parameters():
        torch.testing.assert_close(p, dict(fixed_trainer.policy.named_parameters())[name])


def test_value_clip_scores_the_second_critic_step_against_the_pre_step_values(store):
    records = with_rewards(make_trajectories(store, 4, seed=24), [1.0, 0.0, 1.0, 1.0])
    plain, plain_trainer = one_step(store, records, value_lr=1e-2)
    clipped, clipped_trainer = one_step(store, records, value_lr=1e-2, value_clip=1e-4)

    plain_losses, clipped_losses = plain.extra["value_losses"], clipped.extra["value_losses"]
    assert clipped_losses[0] == pytest.approx(plain_losses[0])  # the first step starts at the old values
    # the second: values held within 1e-4 of the old ones count the error the first step removed
    assert plain_losses[1] < 0.9 * plain_losses[0]
    assert clipped_losses[1] == pytest.approx(plain_losses[0], rel=2e-2)
    assert not unchanged(clipped_trainer.value_model, parameters(plain_trainer.value_model))


@pytest.mark.parametrize("micro_token_budget", [11, 1000])
def test_the_critics_gradient_over_micro_batches_is_the_whole_batchs(store, micro_token_budget):
    """Accumulated over micro-batches (one row each, all at once) the critic step's loss and
    gradient are ½·mean (V − R)² over every action token of the batch, the targets R from
    observation-skip GAE on the detached pre-step values, as a slow reference computes it row
    by row; rows of unequal length, and loss weights the critic does not use (it fits every
    action token, a shared prefix to each branch's return)."""
    gamma, lam = 0.97, 0.9
    records = with_rewards(make_trajectories(store, 4, seed=33), [1.0, 0.0, 2.0, -1.0])
    for column in ("tokens", "logprobs", "action_mask", "turn", "versions", "train_mask", "loss_weight"):
        records[3][column] = records[3][column][:9]
    for i, record in enumerate(records):
        record["loss_weight"] = [0.5 + (i + t) % 3 for t in range(len(record["tokens"]))]
    trainer = Trainer(
        store, config(micro_token_budget=micro_token_budget, gamma=gamma, value_lam=lam, max_grad_norm=1e9)
    )
    with torch.no_grad():  # a critic whose values are not all 0 (its head starts at zero)
        head = trainer.value_model.head.weight
        head.copy_(torch.randn(head.shape, generator=torch.Generator().manual_seed(0)))
    samples = open_batch(trainer, records)

    loss, count = torch.zeros(()), 0
    for record in records:
        tokens = torch.tensor([record["tokens"]])
        values = token_values(trainer.value_model, tokens, torch.ones_like(tokens, dtype=torch.bool))[0]
        held = values.detach()
        actions = [t for t, m in enumerate(record["action_mask"]) if m]
        advantage, after = 0.0, 0.0  # the next action token's advantage and value (0 past the last)
        for t in reversed(actions):
            reward = record["reward"] if t == actions[-1] else 0.0
            advantage = reward + gamma * after - float(held[t]) + gamma * lam * advantage
            after = float(held[t])
            loss = loss + 0.5 * (values[t] - (advantage + after)) ** 2
            count += 1
    (loss / count).backward()
    want = {name: p.grad.clone() for name, p in trainer.value_model.named_parameters() if p.grad is not None}

    stats = trainer._value_step(trainer._parts(samples), None)
    assert stats["value_loss"] == pytest.approx(float(loss.detach()) / count, rel=1e-5)
    assert want.keys() == {name for name, p in trainer.value_model.named_parameters() if p.grad is not None}
    for name, p in trainer.value_model.named_parameters():
        if name in want:
            torch.testing.assert_close(
                p.grad, want[name], rtol=1e-4, atol=1e-6 * float(want[name].abs().max())
            )


@pytest.mark.parametrize("micro_token_budget", [11, 22, 1000])
def test_the_critics_explained_variance_is_over_the_whole_batch_however_it_is_split(
    store, micro_token_budget
):
    records = with_rewards(make_trajectories(store, 4, seed=28), [1.0, 0.0, 0.0, 1.0])
    trainer = Trainer(store, config(micro_token_budget=micro_token_budget))
    with torch.no_grad():  # a critic whose values are not all 0 (its head starts at zero)
        head = trainer.value_model.head.weight
        head.copy_(torch.randn(head.shape, generator=torch.Generator().manual_seed(0)))
    samples = open_batch(trainer, records)
    batch = pad_batch(samples, trainer.pad_id)
    with torch.no_grad():
        values = token_values(trainer.value_model, batch.input_ids, batch.attention_mask)
    # γ = 1 and value_lam = 1: every action token's target is its row's reward
    pairs = [
        (float(values[b, t]), float(batch.sequence_rewards[b]))
        for b in range(len(samples))
        for t in range(batch.input_ids.shape[1])
        if batch.action_mask[b, t]
    ]

    def variance(xs: list[float]) -> float:
        mean = sum(xs) / len(xs)
        return sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)

    want = 1.0 - variance([r - v for v, r in pairs]) / variance([r for _, r in pairs])
    stats = trainer._value_step(trainer._parts(samples), None)
    assert stats["explained_variance"] == pytest.approx(want, rel=1e-4)


def test_normalize_advantages_whitens_the_advantages_of_the_policy_step(store):
    records = with_rewards(make_trajectories(store, 4, seed=25), [1.0, 0.0, 1.0, 1.0])
    plain, _ = one_step(store, records)
    normalized, _ = one_step(store, records, normalize_advantages=True)

    assert plain.extra["advantage_mean"] > 0.3
    assert normalized.extra["advantage_mean"] == pytest.approx(0.0, abs=1e-6)
    assert normalized.extra["advantage_std"] == pytest.approx(1.0, abs=1e-5)


def test_normalize_advantages_leaves_a_batch_of_equal_advantages_at_zero_not_at_float_noise(store):
    """Every trained token's advantage 0.1 (a critic still at 0, λ = γ = 1, equal rewards):
    the float mean misses 0.1 by an ulp, and divided by a std of about that ulp every advantage
    read −0.42, a step lowering every sampled token's probability on a batch with no signal."""
    records = with_rewards(make_trajectories(store, 4, seed=25), [0.1] * 4)
    metrics, _ = one_step(store, records, value_steps=0, lam=1.0, normalize_advantages=True)

    assert metrics.extra["advantage_mean"] == 0.0
    assert metrics.extra["grad_norm"] == 0.0


@pytest.mark.parametrize("mode", ["sao", "grpo"])
def test_a_batch_whose_every_trained_token_dis_masks_leaves_the_policy_as_it_is(store, mode):
    """After a step with a gradient, a batch whose every ratio is below 1 − ε_low gives a zero
    gradient; AdamW stepped on it anyway and moved every weight by its momentum (about 0.9 of
    the step before) and its weight decay, on a batch the DIS loss masks whole."""
    trainer = Trainer(store, config(mode=mode, weight_decay=0.1))
    first = with_rewards(make_trajectories(store, 4, seed=3), [1.0, 0.0, 2.0, -1.0])
    assert trainer._train_step(open_batch(trainer, first)).extra["grad_norm"] > 0
    masked = with_rewards(make_trajectories(store, 4, seed=4), [1.0, 0.0, 2.0, -1.0])
    for record in masked:
        record["logprobs"] = [
            lp + 1.0 if m else lp for lp, m in zip(record["logprobs"], record["action_mask"], strict=True)
        ]
    before = parameters(trainer.policy)

    metrics = trainer._train_step(open_batch(trainer, masked, "processed/x/1"))
    assert metrics.row["masked_fraction"] == 1.0 and metrics.extra["grad_norm"] == 0.0
    assert unchanged(trainer.policy, before)
    assert trainer.step == 2


def test_grpo_normalize_std_divides_each_advantage_by_its_group_std(store):
    # groups are rows (0, 1) and (2, 3): advantages ±0.5, group std 1/√2
    records = with_rewards(make_trajectories(store, 4, seed=26), [0.0, 1.0, 1.0, 0.0])
    plain, _ = one_step(store, records, mode="grpo")
    normalized, _ = one_step(store, records, mode="grpo", grpo_normalize_std=True)

    tokens = 4 * 5  # every token of a row carries its row's advantage
    assert plain.extra["advantage_std"] == pytest.approx(0.5 * math.sqrt(tokens / (tokens - 1)))
    assert normalized.extra["advantage_std"] == pytest.approx(
        math.sqrt(2) * plain.extra["advantage_std"], rel=1e-5
    )
    # the policy loss is linear in the advantages (ratios are 1 on the first step)
    assert normalized.row["policy_loss"] == pytest.approx(math.sqrt(2) * plain.row["policy_loss"], rel=1e-4)


def branching_group_shard(store: RunStore) -> dict[str, str]:
    """One GRPO group of two executions, processed by the real processor into one shard:
    ``a`` (reward 1) branches after its observation into two trained leaves, ``b`` (reward 0)
    is one row. Returns each trajectory's execution, in shard order."""
    root, single = with_rewards(make_trajectories(store, 2, seed=40), [1.0, 0.0])
    branch = {name: list(value) if isinstance(value, list) else value for name, value in root.items()}
    branch |= {"trajectory_id": "a-branch", "parent_id": root["trajectory_id"], "branch_at": 9}
    branch["tokens"] = root["tokens"][:9] + [201, 202]  # another second action
    branch["logprobs"] = root["logprobs"][:9] + [-1.0, -1.0]
    for record, execution in ((root, "a"), (branch, "a"), (single, "b")):
        record |= {"execution_id": execution, "group_id": "g", "progress": None}
    result = process_shard(
        to_table([root, branch, single], TRAJECTORY_SCHEMA), ProcessorConfig(j_max=None), shard_id="raw/w/0"
    )
    writer = ShardWriter(store, "proc", kind="processed", schema=PROCESSED_SCHEMA)
    writer.write_table(result.processed)
    writer.flush()
    writer.close()
    rows = result.processed.select(["trajectory_id", "execution_id"]).to_pylist()
    return {row["trajectory_id"]: row["execution_id"] for row in rows}


def raw_lineage_shards(store: RunStore) -> None:
    """Two raw shards of the run: the first holds a branching execution (a root and its
    branch after the observation), an exact retry of another root, a second row under an
    id already there and an ``env_error`` row; the second a row with an action at position 0
    (the processor drops it) and one whose reward 3e38 overflows the critic's loss in SAO mode, the
    policy loss in GRPO mode (its batch is rejected)."""
    records = make_trajectories(store, 8, seed=50)
    root, other = records[0], records[1]
    branch = {name: list(value) if isinstance(value, list) else value for name, value in root.items()}
    branch |= {"trajectory_id": "branch", "parent_id": root["trajectory_id"], "branch_at": 9}
    branch["tokens"] = root["tokens"][:9] + [201, 202]
    branch["logprobs"] = root["logprobs"][:9] + [-1.0, -1.0]
    retry = dict(other) | {"trajectory_id": "retry", "parent_id": other["trajectory_id"]}
    again = dict(records[2]) | {"execution_id": "again", "tokens": records[3]["tokens"]}
    failed = dict(records[3]) | {"trajectory_id": "failed", "execution_id": "failed", "status": "env_error"}
    records[5]["action_mask"][0], records[5]["versions"][0] = True, 0
    records[6]["reward"] = 3e38
    writer = ShardWriter(store, "w0")
    for shard in ([root, branch, *records[1:4], retry, again, failed], records[4:]):
        writer.write_table(to_table(shard, TRAJECTORY_SCHEMA))
        writer.flush()
    writer.close()


def test_steps_a_trainer_left_unpublished_are_not_kept_when_the_trainer_after_it_takes_none(store):
    """A trainer publishes version 1 at step 2, takes step 3 and is gone without publishing
    it; the next resumes from version 1 and stops before a step (its deadline
    had passed). The kept rows, and ``treadle sql``'s ``kept_steps``, are those of steps 1 and 2 only."""
    write_shards(store, make_trajectories(store, 16, seed=3), per_shard=4)
    Trainer(store, config(publish_every=2, publish_on_stop=False)).run(max_steps=3, drain=True)
    assert [row["step"] for row in read_steps(store)] == [1, 2, 3]
    assert WeightStore(store).list() == [0, 1]
    resumed = Trainer(store, config())
    summary = resumed.run(max_seconds=0)
    assert (summary.steps, summary.versions, summary.stop_reason) == (2, [], "max_seconds")

    tables = Tables(store)
    kept = one_row_per_step(tables.read("train_steps"), tables.read("weights"))
    assert kept.column("step").to_pylist() == [1, 2]
    viewed = connect(store).execute("SELECT step FROM kept_steps ORDER BY step")
    assert viewed.fetchall() == [(1,), (2,)]


@pytest.mark.parametrize("mode", ["sao", "grpo"])
def test_the_steps_that_went_into_the_weights_name_each_selected_trajectory_they_trained_once(
    store, mode, monkeypatch
):
    """From raw shards through the processor to a trainer that trains every row and is then
    restarted from the base version (it published nothing): the kept ``train_steps`` rows,
    and the README's query over ``trained``, name each trajectory trained into the weights once, each a
    selected row of ``trajectories`` under its own id (a branch's and its parent's both), and
    none that the trainer rejected, alone or in a batch."""
    raw_lineage_shards(store)
    ShardProcessor(store, ProcessorConfig(j_max=None)).poll()
    trajectories = Tables(store).read("trajectories").to_pylist()
    selected = {row["trajectory_id"] for row in trajectories if row["selected"]}
    assert {"t50-0", "branch", "t50-1", "t50-2"} <= selected and not {"retry", "failed", "t50-5"} & selected
    assert [row["selected"] for row in trajectories if row["trajectory_id"] == "t50-2"] == [True, False]

    overrides = {"mode": mode, "token_budget": 33, "micro_token_budget": 33, "publish_every": 100}
    Trainer(store, config(**overrides, publish_on_stop=False)).run(drain=True)
    trainer = Trainer(store, config(**overrides))
    rejected = []
    reject_batch = trainer._reject_batch
    monkeypatch.setattr(
        trainer,
        "_reject_batch",
        lambda samples, reason: [rejected.extend(samples), reject_batch(samples, reason)],
    )
    trainer.run(drain=True)

    steps = one_row_per_step(Tables(store).read("train_steps"), Tables(store).read("weights")).to_pylist()
    assert [row["step"] for row in steps] == list(range(1, trainer.step + 1))
    named = [trajectory for row in steps for trajectory in row["trajectory_ids"]]
    assert len(named) == len(set(named)) and set(named) <= selected
    assert {"t50-0", "branch"} <= set(named)
    assert not {s.trajectory_id for s in rejected} & set(named)
    assert set(named) | {s.trajectory_id for s in rejected} == selected
    assert "t50-6" in {s.trajectory_id for s in rejected}  # its batch overflows, in either mode
    if mode == "grpo":  # a GRPO step names every member of the groups it trained, the branch with its root
        group_of = {row["trajectory_id"]: row["group_id"] for row in trajectories if row["selected"]}
        for row in steps:
            groups = {group_of[trajectory] for trajectory in row["trajectory_ids"]}
            assert {trajectory for trajectory in named if group_of[trajectory] in groups} == set(
                row["trajectory_ids"]
            )
    joined = connect(store).execute(
        f"SELECT step, count(*) FROM ({readme_query('text FROM trained')}) GROUP BY step ORDER BY step"
    )
    assert joined.fetchall() == [(row["step"], len(row["trajectory_ids"])) for row in steps]


def test_the_sql_views_read_a_restarted_trainers_tables_as_inspect_does(store, monkeypatch):
    """A trainer whose append of step 1's ``train_steps`` row raised although its commit
    landed (the row lands again with step 2's) publishes versions 1 and 2 at steps 1 and 2.
    Version 2's files do not verify: the trainer resumed from version 1 logs step 2 and on
    again, into version 3 and on. ``treadle sql``'s ``kept_steps`` are the rows
    ``one_row_per_step`` keeps, ``trained`` joins each to the selected ``trajectories`` rows it
    names, and ``versions`` marks version 2 passed over, as ``passed_over`` does."""
    raw_lineage_shards(store)
    ShardProcessor(store, ProcessorConfig(j_max=None)).poll()
    overrides = {"token_budget": 33, "micro_token_budget": 33, "publish_every": 1}
    first = Trainer(store, config(**overrides))
    append = first.tables.append
    raises_once = iter([OSError("timed out after its commit (injected)")])

    def landed_then_raised(name, rows, *args, **kwargs):
        append(name, rows, *args, **kwargs)
        if name == "train_steps" and (failure := next(raises_once, None)):
            raise failure

    monkeypatch.setattr(first.tables, "append", landed_then_raised)
    first.run(max_steps=2)
    os.truncate(os.path.join(WeightStore(store).version_path(2), STATE_FILE), 0)
    resumed = Trainer(store, config(**overrides))
    assert (resumed.step, resumed.passed_over) == (1, [2])
    resumed.run(drain=True)

    tables = Tables(store)
    steps, weights, trajectories = (tables.read(name) for name in ("train_steps", "weights", "trajectories"))
    assert sorted(steps.column("step").to_pylist())[:4] == [1, 1, 2, 2]  # step 1 twice, step 2 twice
    kept = one_row_per_step(steps, weights).to_pylist()
    assert [row["step"] for row in kept] == list(range(1, resumed.step + 1))
    db = connect(store)

    def viewed(query: str) -> list[dict]:
        return db.execute(query).to_arrow_table().to_pylist()

    assert viewed("SELECT * EXCLUDE (published_in) FROM kept_steps ORDER BY step") == kept
    # a step's update is in the next version published: step 1's in version 1, the rest in the
    # resumed trainer's versions from 3 on, none in version 2 that it passed over
    published_in = {row["step"]: row["published_in"] for row in viewed("SELECT * FROM kept_steps")}
    assert published_in == {1: 1} | {step: step + 1 for step in range(2, resumed.step + 1)}

    selected = {row["trajectory_id"]: row for row in trajectories.to_pylist() if row["selected"]}
    joined = [
        {"step": row["step"], "version": row["version"], "published_in": published_in[row["step"]]}
        | selected[trajectory_id]
        for row in kept
        for trajectory_id in row["trajectory_ids"]
    ]
    assert len(joined) == sum(row["num_samples"] for row in kept) > 0
    joined.sort(key=lambda row: (row["step"], row["trajectory_id"]))
    assert viewed("SELECT * FROM trained ORDER BY step, trajectory_id") == joined
    into_3 = readme_query("WHERE published_in").replace("= 12", "= 3")
    assert (
        sorted(viewed(into_3), key=lambda row: row["step"])
        == [
            {"step": row["step"], "task": row["task"], "reward": row["reward"]}
            for row in joined
            if row["published_in"] == 3
        ]
        != []
    )

    skipped = passed_over(weights.to_pylist())
    assert skipped == {2}
    assert viewed("SELECT * FROM versions ORDER BY version") == [
        row | {"passed_over": row["version"] in skipped} for row in weights.sort_by("version").to_pylist()
    ]


@pytest.mark.parametrize("normalize_std", [False, True])
def test_grpo_counts_a_branching_execution_once_in_its_groups_mean_and_std(store, normalize_std):
    # executions a (1) and b (0): mean 0.5 and std 1/√2 over the two rollouts, however many
    # leaves a has; counted by rows the mean would be 2/3 and b's advantage −2/3
    execution_of = branching_group_shard(store)
    trainer = Trainer(store, config(mode="grpo", token_budget=1000, grpo_normalize_std=normalize_std))
    trainer.ingest()
    samples = take_batch(trainer.buffer, trainer.config.token_budget, keep_groups=True)
    assert [s.trajectory_id for s in samples] == list(execution_of) and len(samples) == 3
    a_weight = sum(float(s.loss_weight.sum()) for s in samples if execution_of[s.trajectory_id] == "a")
    assert a_weight == pytest.approx(1.0)  # the processor's execution weighting
    parts = trainer._parts(samples)
    got = []
    for part, part_advantages in zip(parts, trainer._advantages(parts, samples), strict=True):
        for row_advantages, action in zip(part_advantages, part.action_mask, strict=True):
            (value,) = row_advantages[action].unique().tolist()
            got.append(value)
    scale = math.sqrt(2) if normalize_std else 1.0
    want = [(0.5 if execution_of[s.trajectory_id] == "a" else -0.5) * scale for s in samples]
    assert got == pytest.approx(want, rel=1e-5)


def test_value_pretraining_steps_only_the_critic_before_the_first_policy_step(store):
    write_shards(store, make_trajectories(store, 8, seed=27), per_shard=8)
    trainer = Trainer(store, config(value_pretrain_steps=3))
    policy, critic = parameters(trainer.policy), parameters(trainer.value_model)
    critic_steps = []  # per critic step: (policy steps so far, policy unchanged, critic changed)
    trainer.value_optimizer.register_step_post_hook(
        lambda *_: critic_steps.append(
            (trainer.step, unchanged(trainer.policy, policy), not unchanged(trainer.value_model, critic))
        )
    )
    trainer.run(drain=True)

    # 3 pretraining steps, then K = 2 before each of the 2 policy steps (4 rows each)
    assert critic_steps == [(0, True, True)] * 5 + [(1, False, True)] * 2
    assert trainer.step == 2 and trainer.value_pretrain_done == 3
    assert Trainer(store, config(value_pretrain_steps=3)).value_pretrain_done == 3  # not redone on resume


def test_a_stop_during_value_pretraining_ends_it_and_publishes_the_critics_steps(store):
    """A stop raised while the critic pretrains (50 steps of a large critic take minutes) is
    heeded at its next step, not after all of them and a policy step; the critic's steps so
    far are published, so a resumed trainer does not take them again."""
    write_shards(store, make_trajectories(store, 8, seed=27), per_shard=8)
    trainer = Trainer(store, config(value_pretrain_steps=50))
    stop = threading.Event()
    critic_steps = []

    def step_taken(*_) -> None:
        critic_steps.append(1)
        if len(critic_steps) == 2:
            stop.set()

    trainer.value_optimizer.register_step_post_hook(step_taken)
    summary = trainer.run(stop_event=stop)
    assert (summary.stop_reason, summary.steps, len(critic_steps)) == ("stop_event", 0, 2)
    assert len(summary.versions) == 1
    assert Trainer(store, config(value_pretrain_steps=50)).value_pretrain_done == 2


@pytest.mark.parametrize(("good_batches", "done"), [(1, 3), (0, 0)])
def test_a_value_pretraining_step_the_critic_skips_does_not_count(store, good_batches, done):
    """A buffered batch whose reward overflows the critic's loss takes no critic step: it
    does not count toward ``value_pretrain_steps``, which the batches that do train reach;
    with no such batch nothing counts, and pretraining is tried again before the next step."""
    trainer = Trainer(store, config(value_pretrain_steps=3))
    bad = with_rewards(make_trajectories(store, 4, seed=20), [3e38, 0.0, 1.0, 0.0])
    trainer.buffer.extend(open_batch(trainer, bad, "processed/x/0"))
    for i in range(good_batches):
        trainer.buffer.extend(
            open_batch(trainer, make_trajectories(store, 4, seed=21 + i), f"processed/x/{i + 1}")
        )
    critic_steps = []
    trainer.value_optimizer.register_step_post_hook(lambda *_: critic_steps.append(1))

    trainer._pretrain_value()
    assert (len(critic_steps), trainer.value_pretrain_done) == (done, done)
    assert all(torch.isfinite(p).all() for p in trainer.value_model.parameters())


def test_a_resumed_version_missing_from_the_weights_table_gets_its_row_once(store):
    # version 0 was published without a row (as by a trainer killed between the two)
    assert Tables(store).read("weights").num_rows == 0
    Trainer(store, config())
    Trainer(store, config())
    (row,) = Tables(store).read("weights").to_pylist()
    assert (row["version"], row["step"], row["parent"], row["tag"]) == (0, 0, None, "base")
    assert row["path"] == WeightStore(store).version_url(0)


def test_resume_restores_step_optimizer_value_model_and_consumption(store):
    write_shards(store, make_trajectories(store, 12, seed=8), per_shard=3)
    first = Trainer(store, config(publish_every=1, publish_on_stop=False))
    first.run(max_steps=2)
    assert first.step == 2
    second = Trainer(store, config(publish_every=1))
    assert second.step == 2 and second.version == first.version
    for group_a, group_b in zip(
        first.policy_optimizer.state_dict()["state"].values(),
        second.policy_optimizer.state_dict()["state"].values(),
        strict=True,
    ):
        torch.testing.assert_close(group_a["exp_avg"], group_b["exp_avg"])
    for (name, a), b in zip(
        first.value_model.state_dict().items(), second.value_model.state_dict().values(), strict=True
    ):
        torch.testing.assert_close(a, b, msg=name)
    second.run(drain=True)
    assert second.step == 3
    chain = version_chain(second.weights)
    rows = {}
    for manifest in chain:
        for shard, count in manifest["metadata"].get("consumed_rows", {}).items():
            rows[shard] = rows.get(shard, 0) + count
    assert sorted(rows.values()) == [3, 3, 3, 3]


def test_a_rejected_row_of_a_shard_half_trained_before_a_restart_is_not_rejected_again(store):
    """A shard's rejected row is consumed with the rows trained before the restart: the resumed
    trainer trains the shard's last row and consumes each once."""
    records = make_trajectories(store, 6, seed=65)
    records[0]["reward"] = None
    (info,) = write_shards(store, records, per_shard=6)
    Trainer(store, config(publish_every=1, publish_on_stop=False)).run(max_steps=1)
    resumed = Trainer(store, config(publish_every=1))
    assert resumed.ingest() == 1 and [s.row for s in resumed.buffer] == [5]
    resumed.run(drain=True)
    assert resumed.step == 2 and consumed_rows(resumed.weights) == {info.shard_id: 6}


def test_a_resumed_trainer_leaves_no_copy_of_its_version_in_the_weight_cache(store):
    """A trainer reads the version it resumes from (policy, value model, both optimizers'
    moments) once, as it starts: that copy stayed in the weight cache for good, a whole version
    with its optimizer state on the trainer's disk per restart (each nightly run)."""
    write_shards(store, make_trajectories(store, 6, seed=8), per_shard=3)
    Trainer(store, config(publish_every=1, publish_on_stop=False)).run(max_steps=1)
    resumed = Trainer(store, config())
    assert resumed.version == 1 and resumed.step == 1
    assert not [path for path in resumed.weights.cache_dir.rglob("v0*") if path.is_dir()]


def same_state(a: dict, b: dict) -> bool:
    """Whether two (possibly nested) state dicts hold bit-identical tensors and equal values."""
    if a.keys() != b.keys():
        return False
    for key, value in a.items():
        other = b[key]
        if isinstance(value, dict):
            if not (isinstance(other, dict) and same_state(value, other)):
                return False
        elif isinstance(value, torch.Tensor):
            if not (isinstance(other, torch.Tensor) and torch.equal(value, other)):
                return False
        elif value != other:
            return False
    return True


def test_a_resumed_trainer_ends_bit_for_bit_where_one_never_stopped_ends(tmp_path):
    """Killed after a step it had not published, then resumed from LATEST: it trains that
    step's rows again and ends with the very weights, moments and step counts (policy and
    critic, value pretraining included) of a trainer that ran straight through."""
    runs = []
    records: list[dict] = []
    for name in ("straight", "resumed"):
        run = RunStore(StorageConfig(root=str(tmp_path / name)), "trainer-test")
        ensure_base_version(WeightStore(run), TINY)
        records = records or make_trajectories(run, 20, seed=31)
        write_shards(run, records, per_shard=3)
        runs.append(run)
    settings = dict(publish_every=2, value_pretrain_steps=2, value_clip=0.5)  # 5 steps of 4 rows
    straight = Trainer(runs[0], config(**settings))
    straight.run(drain=True)
    killed = Trainer(runs[1], config(**settings, publish_on_stop=False))
    killed.run(max_steps=3)
    resumed = Trainer(runs[1], config(**settings))
    assert (resumed.step, resumed.value_pretrain_done) == (2, 2)
    resumed.run(drain=True)

    assert resumed.step == straight.step == 5
    assert same_state(resumed.policy.state_dict(), straight.policy.state_dict())
    assert same_state(resumed.value_model.state_dict(), straight.value_model.state_dict())
    for name in ("policy_optimizer", "value_optimizer"):
        ours, theirs = getattr(resumed, name).state_dict(), getattr(straight, name).state_dict()
        assert ours["state"] and same_state(ours, theirs), name
    assert consumed_rows(resumed.weights) == consumed_rows(straight.weights)


@pytest.mark.parametrize("micro_token_budget", [11, 22, 1000])
def test_the_policy_gradient_over_micro_batches_is_the_whole_batchs(store, micro_token_budget):
    """Accumulated over micro-batches (one row each, pairs, all at once) the policy step's
    gradient is −Σ w·f(r)·Â·∇logπ over the batch's trained tokens divided by their Σ w, as a
    slow reference computes it row by row; rows of unequal length, uneven loss weights and
    ratios on both sides of the DIS interval."""
    records = with_rewards(make_trajectories(store, 4, seed=33), [1.0, 0.0, 2.0, -1.0])
    for column in ("tokens", "logprobs", "action_mask", "turn", "versions", "train_mask", "loss_weight"):
        records[3][column] = records[3][column][:9]
    for i, record in enumerate(records):
        record["loss_weight"] = [0.5 + (i + t) % 3 for t in range(len(record["tokens"]))]
    records[0]["logprobs"][5] -= 1.0  # ratio e ≈ 2.7: kept
    records[1]["logprobs"][4] += 1.0  # ratio 1/e ≤ 1 − 0.3: masked
    records[2]["logprobs"][10] -= 2.0  # ratio e² ≥ 1 + 5: masked
    trainer = Trainer(store, config(micro_token_budget=micro_token_budget, value_steps=0, max_grad_norm=1e9))
    samples = open_batch(trainer, records)

    # the critic's head starts at 0: every value is 0, so with γ = 1 the k-th of a row's n
    # action tokens has advantage λ^(n−1−k)·R
    loss, weight_sum = torch.zeros(()), 0.0
    for record in records:
        tokens = torch.tensor([record["tokens"]])
        logits = trainer.policy(input_ids=tokens).logits[0, :-1].float()
        logprobs = torch.log_softmax(logits, -1).gather(-1, tokens[0, 1:, None])[:, 0]
        actions = [t for t, m in enumerate(record["action_mask"]) if m]
        for k, t in enumerate(actions):
            ratio = math.exp(float(logprobs[t - 1].detach()) - record["logprobs"][t])
            kept = ratio if 1 - 0.3 < ratio < 1 + 5.0 else 0.0
            advantage = 0.95 ** (len(actions) - 1 - k) * record["reward"]
            loss = loss - record["loss_weight"][t] * kept * advantage * logprobs[t - 1]
            weight_sum += record["loss_weight"][t]
    (loss / weight_sum).backward()
    want = {name: p.grad.clone() for name, p in trainer.policy.named_parameters()}

    metrics = trainer._train_step(samples)
    assert metrics.row["masked_fraction"] == pytest.approx(2 / sum(sum(r["train_mask"]) for r in records))
    for name, p in trainer.policy.named_parameters():
        torch.testing.assert_close(p.grad, want[name], rtol=1e-4, atol=1e-7, msg=name)


def consumed_rows(weights: WeightStore) -> dict[str, int]:
    rows: dict[str, int] = {}
    for manifest in version_chain(weights):
        for shard, count in manifest["metadata"].get("consumed_rows", {}).items():
            rows[shard] = rows.get(shard, 0) + count
    return rows


def test_the_saved_state_keeps_a_mark_per_worker_not_every_consumed_shard(store):
    """Three batches of shards, each trained in turn: the state a version saves says up to
    which number each worker's shards are consumed, and a trainer resumed from it (even
    after the log's old change files were compacted and vacuumed away) reads none again."""
    trainer = Trainer(store, config(publish_every=1))
    for batch in range(3):
        write_shards(store, make_trajectories(store, 6, seed=20 + batch), per_shard=3)
        trainer.run(drain=True)
    state_file = os.path.join(trainer.weights.load(trainer.version), STATE_FILE)
    with open(state_file) as handle:
        state = json.load(handle)
    assert state["consumed_through"] == {"proc": 5}
    assert state["consumed_shards"] == [] and state["partial_rows"] == {}
    tables = Tables(store)
    tables.optimize("shards")
    tables.vacuum("shards", retention_hours=0)
    write_shards(store, make_trajectories(store, 3, seed=30), per_shard=3)
    resumed = Trainer(store, config(publish_every=1))
    assert resumed.ingest() == 1 and len(resumed.buffer) == 3
    resumed.run(drain=True)
    assert sorted(consumed_rows(resumed.weights).values()) == [3] * 7


def test_shards_read_in_any_order_are_each_trained_once(store, monkeypatch):
    """The log's snapshot comes in no particular order: an empty shard numbered after a
    full one, met first, must not move its worker's mark past the full one."""
    write_shards(store, make_trajectories(store, 3, seed=50), per_shard=3)
    ShardWriter(store, "proc", kind="processed", schema=PROCESSED_SCHEMA).commit(
        PROCESSED_SCHEMA.empty_table(), seq=1
    )
    trainer = Trainer(store, config(publish_every=1))
    real = trainer.reader.poll
    monkeypatch.setattr(
        trainer.reader,
        "poll",
        lambda after=-1, identity=None: (list(reversed(real(after, identity)[0])), real(after, identity)[1]),
    )
    assert trainer.ingest() == 2 and len(trainer.buffer) == 3
    trainer.run(drain=True)
    assert consumed_rows(trainer.weights) == {"processed/proc/00000000": 3}


def test_consumed_shards_listed_by_an_older_state_are_folded_into_the_workers_mark(store):
    """A state of the older format lists every consumed shard and has no mark: meeting those
    shards in the log moves the mark over them and empties the list, so it is not saved again."""
    write_shards(store, make_trajectories(store, 6, seed=60), per_shard=3)
    trainer = Trainer(store, config(publish_every=1))
    trainer.consumption.done.update({"processed/proc/00000000", "processed/proc/00000001"})
    assert trainer.ingest() == 0 and not trainer.buffer
    assert trainer.consumption.through == {"proc": 1} and trainer.consumption.done == set()


def test_a_second_commit_row_of_a_consumed_shard_is_not_trained_again(store):
    """Two processors racing on one raw shard commit its twin twice (``commit`` with a
    number does not refuse one that exists): the trainer trains it once."""
    infos = write_shards(store, make_trajectories(store, 6, seed=40), per_shard=3)
    trainer = Trainer(store, config(publish_every=1))
    trainer.run(drain=True)
    first = infos[0]
    writer = ShardWriter(store, first.worker, kind="processed", schema=PROCESSED_SCHEMA)
    reader = ShardReader(store, kind="processed")
    writer.commit(reader.read(first), seq=first.seq)
    assert trainer.ingest() == 0
    trainer.run(drain=True)
    resumed = Trainer(store, config(publish_every=1))
    assert resumed.ingest() == 0
    assert sorted(consumed_rows(resumed.weights).values()) == [3, 3]


def test_a_shard_whose_read_failed_is_read_again_with_the_rest_of_its_poll(store, monkeypatch):
    """A read that raises (a transient storage error) leaves the poll's offset where it was:
    a trainer that goes on reads that shard and those after it, each once."""
    infos = write_shards(store, make_trajectories(store, 9, seed=45), per_shard=3)
    trainer = Trainer(store, config(publish_every=1))
    real = trainer.reader.read
    failed: list[str] = []

    def flaky(info):
        if info.seq == 1 and not failed:
            failed.append(info.shard_id)
            raise OSError("connection reset while fetching the shard")
        return real(info)

    monkeypatch.setattr(trainer.reader, "read", flaky)
    with pytest.raises(OSError, match="connection reset"):
        trainer.run(drain=True)
    trainer.run(drain=True)
    assert failed == [infos[1].shard_id]
    assert consumed_rows(trainer.weights) == {info.shard_id: 3 for info in infos}
    resumed = Trainer(store, config(publish_every=1))
    assert resumed.ingest() == 0 and not resumed.buffer


def test_keep_versions_deletes_all_but_the_newest_versions_after_each_publish(store):
    write_shards(store, make_trajectories(store, 12, seed=9), per_shard=3)
    trainer = Trainer(store, config(publish_every=1, keep_versions=2))
    trainer.run(drain=True)
    assert trainer.version >= 3
    assert trainer.weights.list() == [0, trainer.version - 1, trainer.version]  # 0 is tagged base
    assert Trainer(store, config()).version == trainer.version


def test_a_failed_deletion_of_old_versions_is_logged_and_the_next_publish_deletes_them(
    store, monkeypatch, caplog
):
    """The version is published when its retention fails: the trainer goes on, and the next
    publish's retention deletes what this one left."""
    write_shards(store, make_trajectories(store, 12, seed=9), per_shard=3)
    trainer = Trainer(store, config(publish_every=1, keep_versions=2))
    retain = trainer.weights.retain
    failures = iter([None, OSError("delete refused (injected)")])

    def flaky(*args, **kwargs):
        failure = next(failures, None)
        if failure is not None:
            raise failure
        return retain(*args, **kwargs)

    monkeypatch.setattr(trainer.weights, "retain", flaky)
    with caplog.at_level("WARNING"):
        summary = trainer.run(drain=True)
    assert (summary.stop_reason, summary.versions) == ("drained", [1, 2, 3])
    assert "could not delete old weight versions after version 2: delete refused (injected)" in caplog.text
    assert trainer.weights.list() == [0, 2, 3]


def test_a_version_whose_weights_row_failed_is_the_parent_of_the_next_one(store, monkeypatch):
    """The weights table's append fails after a version is complete (a transient store
    error): the call raises, and a trainer that goes on trains on from that version, its
    next version listing only what it consumed since, so each row is in the chain once."""
    infos = write_shards(store, make_trajectories(store, 12, seed=9), per_shard=3)
    trainer = Trainer(store, config(publish_every=1))
    record = trainer.weights.record
    failures = [OSError("weights table append refused (injected)")]

    def flaky(tables, version):
        if failures:
            raise failures.pop()
        return record(tables, version)

    monkeypatch.setattr(trainer.weights, "record", flaky)
    with pytest.raises(OSError, match="weights table append refused"):
        trainer.run(drain=True)
    assert trainer.version == trainer.weights.latest() == 1
    trainer.run(drain=True)
    chain = [manifest["version"] for manifest in version_chain(trainer.weights)]
    assert chain == trainer.weights.list() == list(range(trainer.version + 1))
    assert consumed_rows(trainer.weights) == {info.shard_id: 3 for info in infos}


def test_a_resumed_trainer_keeps_its_saved_moments_but_takes_the_configs_learning_rates(store):
    write_shards(store, make_trajectories(store, 8, seed=8), per_shard=4)
    first = Trainer(store, config(publish_every=1, publish_on_stop=False))
    first.run(max_steps=1)
    second = Trainer(store, config(lr=1e-6, value_lr=2e-6, weight_decay=0.1))
    for optimizer, lr in ((second.policy_optimizer, 1e-6), (second.value_optimizer, 2e-6)):
        assert [(g["lr"], g["weight_decay"]) for g in optimizer.param_groups] == [(lr, 0.1)]
    saved = next(iter(first.policy_optimizer.state_dict()["state"].values()))
    resumed = next(iter(second.policy_optimizer.state_dict()["state"].values()))
    assert float(resumed["step"]) == 1.0
    torch.testing.assert_close(saved["exp_avg"], resumed["exp_avg"])


def test_a_resumed_optimizer_keeps_its_step_counts_on_the_cpu_with_parameters_on_another_device(store):
    """AdamW keeps its step counts on the CPU and reads each with ``.item()`` at every step:
    read back onto the parameters' device (the trainer's GPU), each step synced once per
    parameter. The meta device stands in for a GPU here: ``.item()`` raises on it."""
    write_shards(store, make_trajectories(store, 8, seed=8), per_shard=4)
    first = Trainer(store, config(publish_every=1, publish_on_stop=False))
    first.run(max_steps=1)
    saved = Path(first.weights.load(first.version, "all")) / POLICY_OPTIMIZER_FILE
    params = [torch.nn.Parameter(p.detach().to("meta")) for p in first.policy.parameters()]
    optimizer = torch.optim.AdamW(params)
    resume_optimizer(optimizer, saved, lr=1e-3, weight_decay=0.0)
    states = [optimizer.state[p] for p in params]
    assert {s["step"].device.type for s in states} == {"cpu"}
    assert {s["exp_avg"].device.type for s in states} == {"meta"}
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    assert [float(s["step"]) for s in states] == [2.0] * len(params)


def test_sao_raises_the_probability_of_the_rewarded_action(store):
    reward_token = 40
    write_shards(store, make_trajectories(store, 96, seed=9, reward_token=reward_token), per_shard=16)
    trainer = Trainer(
        store,
        config(token_budget=88, micro_token_budget=88, lr=1e-2, value_pretrain_steps=4, max_staleness=100),
    )

    def rewarded_logprob() -> float:
        prompts = torch.tensor([[11, 12, 13, 14], [50, 60, 70, 80], [101, 7, 99, 150]])
        with torch.no_grad():
            logits = trainer.policy(input_ids=prompts).logits[:, -1]
        return float(torch.log_softmax(logits, -1)[:, reward_token].mean())

    before = rewarded_logprob()
    trainer.run(drain=True)
    assert trainer.step == 12
    after = rewarded_logprob()
    assert after > before + 0.5


def test_grpo_mode_trains_without_a_critic(store):
    write_shards(store, make_trajectories(store, 8, seed=11), per_shard=8)
    trainer = Trainer(store, config(mode="grpo", token_budget=40))
    assert trainer.value_model is None
    trainer.run(drain=True)
    steps = read_steps(store)
    # a 40-token budget fits 3 rows; the batch grows to 4 to keep the pair (group) whole
    assert [row["num_samples"] for row in steps] == [4, 4]
    assert [row["value_loss"] for row in steps] == [None, None]  # no critic: null, not NaN
    assert VALUE_MODEL_FILE not in trainer.weights.manifest(trainer.weights.latest())["files"]


def test_stop_event_and_max_steps_stop_the_loop(store):
    write_shards(store, make_trajectories(store, 4, seed=12), per_shard=4)
    trainer = Trainer(store, config(token_budget=10_000))
    stop = threading.Event()
    stop.set()
    assert trainer.run(stop_event=stop).stop_reason == "stop_event"
    assert trainer.run(max_steps=0).stop_reason == "max_steps"
    # a deadline that passed is why the run ends, even with a stop raised meanwhile (in the
    # pipeline the processor ends at the same deadline and its end raises the stop)
    assert trainer.run(stop_event=stop, max_seconds=0).stop_reason == "max_seconds"
    assert trainer.step == 0


def test_a_buffer_of_exactly_the_token_budget_is_trained_without_waiting_for_more(store):
    """Not draining, a trainer trains as soon as its buffer holds ``token_budget`` tokens (the
    deadline is there only to end the run if it waited instead)."""
    write_shards(store, make_trajectories(store, 4, seed=12), per_shard=4)  # 44 tokens
    trainer = Trainer(store, config(token_budget=44))
    assert trainer.run(max_steps=1, max_seconds=120).stop_reason == "max_steps"
    assert [row["num_tokens"] for row in read_steps(store)] == [44]


def test_a_step_limit_the_resumed_run_has_reached_already_is_said_out_loud(store, caplog):
    write_shards(store, make_trajectories(store, 4, seed=12), per_shard=4)
    first = Trainer(store, config(token_budget=10_000))
    assert first.run(drain=True).steps == 1
    resumed = Trainer(store, config(token_budget=10_000))
    with caplog.at_level(logging.WARNING, logger="rl.trainer"):
        assert resumed.run(max_steps=1).stop_reason == "max_steps"
    assert "already at policy step 1, at or past max_steps=1" in caplog.text


def test_an_idle_trainer_wakes_at_its_deadline_not_at_its_next_poll(store):
    """No data comes: the wait between polls is cut at the deadline (a 60 s poll must not
    hold a trainer whose budget ends in half a second)."""
    trainer = Trainer(store, config(poll_seconds=60))
    summary = trainer.run(max_seconds=0.5)
    assert summary.stop_reason == "max_seconds"
    assert trainer.idle_seconds < 30


def test_the_idle_seconds_count_the_wait_in_progress(store):
    """The elastic controller reads the trainer's idle time while it waits for data: the wait
    in progress counts up to the time it asks about."""
    trainer = Trainer(store, config(poll_seconds=60))
    stop = threading.Event()
    runner = threading.Thread(target=trainer.run, kwargs={"stop_event": stop})
    runner.start()
    try:
        deadline = time.monotonic() + 60
        while trainer.waiting_since is None and time.monotonic() < deadline:
            time.sleep(0.01)
        began = trainer.waiting_since
        assert began is not None and trainer.idle_seconds == 0
        assert trainer.idle_seconds_at(began + 5) == 5 and trainer.idle_seconds_at(began - 1) == 0
    finally:
        stop.set()
        runner.join()
    assert (
        trainer.waiting_since is None
        and trainer.idle_seconds_at(time.monotonic()) == trainer.idle_seconds > 0
    )


FORKER = """
import os, sys, traceback
from rl.config import SAOConfig
from rl.trainer import Trainer
from storage.config import RunStore, StorageConfig

def say(line):
    # one write, so that the forker's lines and its trainer's never interleave
    os.write(1, f"{line}\\n".encode())

def train(publish_every):
    store = RunStore(StorageConfig(root=sys.argv[1]), sys.argv[2])
    config = SAOConfig(lr=1e-3, value_lr=1e-3, token_budget=33, micro_token_budget=33, max_staleness=1000,
                       publish_every=publish_every)
    Trainer(store, config).run(drain=True, progress=lambda row: say(f"step {row['step']}"))

for line in sys.stdin:
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            train(int(line))
            code = 0
        except BaseException:
            traceback.print_exc()
            sys.stderr.flush()
        finally:
            os._exit(code)
    say(f"trainer {pid}")
    _, status = os.waitpid(pid, 0)
    say(f"ended {os.waitstatus_to_exitcode(status)}")
"""
"""Forks one trainer per line of stdin (its ``publish_every``) from a process that imported
torch and the trainer once (a fresh interpreter per trainer spent most of the test importing
them): each trainer is still a process of its own, building its trainer from the store,
draining it unless killed with SIGKILL."""


def killed_child_env(tmp_path) -> dict[str, str]:
    """The environment of a child the test kills: its temporary folders (a publish's staging),
    which only a child that ends runs the cleanup of, under ``tmp_path`` rather than /tmp."""
    (tmp_path / "child-tmp").mkdir(exist_ok=True)
    return dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", TMPDIR=str(tmp_path / "child-tmp"))


@pytest.mark.slow
def test_exactly_once_across_sigkill_restarts(store, tmp_path):
    records = make_trajectories(store, 40, seed=13)
    infos = write_shards(store, records, per_shard=4)
    num_rows = {info.shard_id: info.num_rows for info in infos}
    rng = random.Random()
    seed = rng.randrange(1 << 30)
    rng.seed(seed)
    forker = subprocess.Popen(
        [sys.executable, "-c", FORKER, store.config.root, store.run_id],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=killed_child_env(tmp_path),
        cwd=REPO,
        start_new_session=True,  # its own process group, with its trainer: stopped() kills them all
    )
    kills = 0
    try:
        for attempt in range(4):
            forker.stdin.write(f"{rng.choice([1, 2])}\n")
            forker.stdin.flush()
            kill_after = rng.randint(1, 4) if attempt < 3 else None
            pid, steps_seen = None, 0
            # the forker names the trainer while it runs: some of its steps may come first
            while not (line := forker.stdout.readline().strip()).startswith("ended"):
                assert line, stopped(forker)  # the forker died
                if line.startswith("trainer "):
                    pid = int(line.split()[1])
                elif line.startswith("step"):
                    steps_seen += 1
                if pid is not None and kill_after is not None and steps_seen >= kill_after:
                    # let it run a random little further: mid-step, mid-publish or between steps
                    threading.Event().wait(rng.uniform(0, 0.4))
                    with contextlib.suppress(ProcessLookupError):  # it drained first
                        os.kill(pid, signal.SIGKILL)
                    kills += 1
                    kill_after = None
            returncode = int(line.split()[1])
            if returncode == 0:
                break
            assert returncode == -signal.SIGKILL, f"trainer failed (seed {seed}): {stopped(forker)}"
    finally:
        stopped(forker)
    assert returncode == 0, f"the last trainer did not drain (seed {seed})"
    assert kills >= 1

    weights = WeightStore(store)
    chain = version_chain(weights)
    completed = [s for m in chain for s in m["metadata"].get("consumed_shards", [])]
    assert sorted(completed) == sorted(num_rows), f"seed {seed}"
    rows: dict[str, int] = {}
    trained = 0
    for manifest in chain[1:]:
        trained += manifest["metadata"]["trained_samples"]
        for shard, count in manifest["metadata"]["consumed_rows"].items():
            rows[shard] = rows.get(shard, 0) + count
    assert rows == num_rows, f"seed {seed}"
    assert trained == 40, f"seed {seed}"
    # the final state agrees with the chain: one step per 3 rows, counting every restart
    assert chain[-1]["step"] == 14, f"seed {seed}"
    # the steps whose rows the README keeps (those that went into the weights) name every
    # trajectory once, though killed trainers logged some steps that a restart took again
    steps = one_row_per_step(Tables(store).read("train_steps"), Tables(store).read("weights")).to_pylist()
    assert [row["step"] for row in steps] == list(range(1, 15)), f"seed {seed}"
    trained_ids = [trajectory for row in steps for trajectory in row["trajectory_ids"]]
    assert sorted(trained_ids) == sorted(record["trajectory_id"] for record in records), f"seed {seed}"


KILLED_BEFORE_LATEST = """
import os, signal, sys
from rl.config import SAOConfig
from rl.trainer import Trainer
from storage.config import RunStore, StorageConfig
from storage.weights import WeightStore
store = RunStore(StorageConfig(root=sys.argv[1]), sys.argv[2])
advance_latest = WeightStore._advance_latest
def killed_before_latest(self, version):  # once its first version's manifest is written
    if version > 0:
        os.kill(os.getpid(), signal.SIGKILL)
    advance_latest(self, version)
WeightStore._advance_latest = killed_before_latest
config = SAOConfig(lr=1e-3, value_lr=1e-3, token_budget=33, micro_token_budget=33, publish_every=1)
Trainer(store, config).run(drain=True)
"""


def test_a_trainer_killed_between_a_versions_manifest_and_latest_resumes_from_that_version(store, tmp_path):
    """The killed trainer's version is complete (LATEST still names its parent): the next
    trainer resumes from it, so no other version trains its rows again."""
    infos = write_shards(store, make_trajectories(store, 12, seed=5), per_shard=3)
    child = subprocess.run(
        [sys.executable, "-c", KILLED_BEFORE_LATEST, store.config.root, store.run_id],
        env=killed_child_env(tmp_path),
        cwd=REPO,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr[-3000:]
    weights = WeightStore(store)
    assert (weights.list(), weights.latest()) == ([0, 1], 0)

    trainer = Trainer(store, config(token_budget=33, micro_token_budget=33))
    assert (trainer.version, trainer.step, weights.latest()) == (1, 1, 1)
    trainer.run(drain=True)
    assert [manifest["version"] for manifest in version_chain(weights)] == weights.list()
    assert consumed_rows(weights) == {info.shard_id: 3 for info in infos}


def test_the_policy_loss_is_normalised_by_the_batchs_total_loss_weight(store):
    # only the weights' ratios matter (an execution's weights sum to 1, whatever its length):
    # uniform weights of 2 must train exactly like weights of 1
    records = make_trajectories(store, 4, seed=3)
    unit, _ = one_step(store, records)
    for record in records:
        record["loss_weight"] = [2.0] * len(record["tokens"])
    doubled, _ = one_step(store, records)
    assert doubled.row["policy_loss"] == pytest.approx(unit.row["policy_loss"], rel=1e-5)
    assert doubled.extra["grad_norm"] == pytest.approx(unit.extra["grad_norm"], rel=1e-5)
    assert unit.extra["grad_norm"] > 0


def test_a_step_reports_the_critics_gradient_norm_beside_the_policys(store):
    """The step's ``extra`` held the policy's gradient norm but not the critic's: a critic
    whose gradients blow up (or vanish) showed only in its losses. One norm per critic step,
    before clipping, as the policy's; none in GRPO."""
    records = with_rewards(make_trajectories(store, 4, seed=3), [1.0, 0.0, 2.0, -1.0])
    metrics, trainer = one_step(store, records, value_steps=3, max_grad_norm=1e9)
    norms = metrics.extra["value_grad_norms"]
    # the last critic step's gradient is left on the critic (unclipped, under this max_grad_norm)
    left = torch.cat([p.grad.flatten() for p in trainer.value_model.parameters() if p.grad is not None])
    assert len(norms) == 3 and all(norm > 0 for norm in norms)
    assert norms[-1] == pytest.approx(float(left.norm()), rel=1e-5)
    assert json.loads(metrics.row["extra"])["value_grad_norms"] == norms
    grpo, _ = one_step(store, records, mode="grpo")
    assert grpo.extra["value_grad_norms"] == [] and grpo.extra["grad_norm"] > 0


def test_a_batch_whose_trainable_tokens_all_weigh_zero_is_rejected(store):
    records = make_trajectories(store, 2, seed=3)
    for record in records:
        record["loss_weight"] = [0.0] * len(record["tokens"])
    trainer = Trainer(store, config())
    assert trainer._train_step(open_batch(trainer, records)) is None
    assert trainer._rejected == {"every trainable token has loss weight 0": 2}


def test_activation_checkpointing_trains_the_same_and_saves_fewer_activations(store):
    records = with_rewards(make_trajectories(store, 4, seed=23), [1.0, 0.0, 0.0, 1.0])
    results = {}
    for checkpointing in (False, True):
        trainer = Trainer(store, config(activation_checkpointing=checkpointing))
        samples = open_batch(trainer, records)
        saved = []

        def pack(tensor: torch.Tensor, saved: list[int] = saved) -> torch.Tensor:
            saved.append(tensor.numel() * tensor.element_size())
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            metrics = trainer._train_step(samples)
        results[checkpointing] = (
            metrics,
            parameters(trainer.policy),
            parameters(trainer.value_model),
            sum(saved),
        )

    (plain, policy, critic, plain_bytes), (ours, policy_ckpt, critic_ckpt, ours_bytes) = (
        results[False],
        results[True],
    )
    assert ours.row["policy_loss"] == pytest.approx(plain.row["policy_loss"], rel=1e-5, abs=1e-7)
    for name, tensor in policy.items():
        torch.testing.assert_close(policy_ckpt[name], tensor, msg=name)
    for name, tensor in critic.items():
        torch.testing.assert_close(critic_ckpt[name], tensor, msg=name)
    # what the backward pass keeps of both models' blocks: only their inputs
    assert ours_bytes < plain_bytes / 3, (ours_bytes, plain_bytes)


def test_activation_checkpointing_works_where_transformers_has_only_its_old_name(store, monkeypatch):
    """transformers 5.17 (a GPU image's) names it ``gradient_checkpointing_enable`` alone: the
    trainer raised AttributeError there for ``activation_checkpointing: true``."""
    from transformers import PreTrainedModel

    enable = getattr(
        PreTrainedModel, "activation_checkpointing_enable", PreTrainedModel.gradient_checkpointing_enable
    )
    monkeypatch.delattr(PreTrainedModel, "activation_checkpointing_enable", raising=False)
    monkeypatch.setattr(PreTrainedModel, "gradient_checkpointing_enable", enable)
    trainer = Trainer(store, config(activation_checkpointing=True))
    # the property was renamed with the method (is_gradient_checkpointing before)
    name = next(
        n for n in ("is_activation_checkpointing", "is_gradient_checkpointing") if hasattr(PreTrainedModel, n)
    )
    assert getattr(trainer.policy, name) and getattr(trainer.value_model.backbone, name)


def test_bf16_mixed_precision_runs_the_matmuls_in_bfloat16_and_keeps_float32_state(store):
    records = with_rewards(make_trajectories(store, 4, seed=24), [1.0, 0.0, 0.0, 1.0])
    results = {}
    for precision in ("no", "bf16"):
        trainer = Trainer(store, config(mixed_precision=precision))
        samples = open_batch(trainer, records)
        matmuls = set()
        for model in (trainer.policy, trainer.value_model):
            for module in model.modules():
                if isinstance(module, torch.nn.Linear):
                    module.register_forward_hook(lambda _m, _i, out, seen=matmuls: seen.add(out.dtype))
        metrics = trainer._train_step(samples)
        assert {p.dtype for p in trainer.policy.parameters()} == {torch.float32}
        assert {p.dtype for p in trainer.value_model.parameters()} == {torch.float32}
        assert all(s["exp_avg"].dtype == torch.float32 for s in trainer.policy_optimizer.state.values())
        results[precision] = (metrics, matmuls)

    (plain, plain_matmuls), (mixed, mixed_matmuls) = results["no"], results["bf16"]
    assert plain_matmuls == {torch.float32} and mixed_matmuls == {torch.bfloat16}
    assert math.isfinite(mixed.row["policy_loss"]) and math.isfinite(mixed.row["value_loss"])
    assert mixed.row["policy_loss"] == pytest.approx(plain.row["policy_loss"], rel=0.1, abs=1e-3)


def test_a_bfloat16_version_serves_the_engines_and_a_resumed_trainer_gets_its_float32_weights(store):
    write_shards(store, make_trajectories(store, 6, seed=31), per_shard=3)
    first = Trainer(store, config(publish_every=1, publish_on_stop=False, publish_dtype="bfloat16"))
    first.run(max_steps=1)
    trained = {name: p.detach().clone() for name, p in first.policy.named_parameters()}
    weights = WeightStore(store)
    served = Path(weights.load(first.version, "serving"))
    with safe_open(served / "model.safetensors", "pt") as stored:
        names = stored.keys()
        assert {stored.get_tensor(name).dtype for name in names} == {torch.bfloat16}
    assert json.loads((served / "config.json").read_text())["dtype"] == "bfloat16"
    assert MASTER_WEIGHTS_FILE in weights.manifest(first.version)["extra_files"]
    engine_policy, _ = load_policy(served)  # what a float32 engine serves: the rounded weights
    rounded = dict(engine_policy.named_parameters())
    assert any(not torch.equal(rounded[name], p) for name, p in trained.items())
    for name, p in trained.items():
        torch.testing.assert_close(rounded[name], p.to(torch.bfloat16).float(), rtol=0, atol=0)

    second = Trainer(store, config(publish_every=1, publish_dtype="bfloat16"))
    assert second.version == first.version
    for name, p in second.policy.named_parameters():
        assert torch.equal(p, trained[name]), name  # resumed from the weights as trained, not rounded
    for (name, a), b in zip(
        first.value_model.state_dict().items(), second.value_model.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name


def test_a_policy_the_cast_does_not_round_keeps_no_second_copy(store):
    weights = WeightStore(store)
    policy, tokenizer = load_policy(weights.load(0))
    version = publish_policy(weights, policy, tokenizer, "float32", parent=0)
    assert weights.manifest(version)["extra_files"] == []
    assert not restore_master_weights(policy, weights.load(version))
    with torch.no_grad():  # float32 weights that hold bfloat16 values, as a bfloat16 checkpoint's
        for p in policy.parameters():
            p.copy_(p.to(torch.bfloat16))
    exact = publish_policy(weights, policy, tokenizer, "bfloat16", parent=version)
    assert weights.manifest(exact)["extra_files"] == []
    served, _ = load_policy(weights.load(exact, "serving"))
    for a, b in zip(policy.parameters(), served.parameters(), strict=True):
        assert torch.equal(a, b)
    path = Path(weights.load(version))
    (path / MASTER_WEIGHTS_FILE).write_bytes(save_file({"not.a.parameter": torch.zeros(1)}))
    with pytest.raises(ValueError, match="does not hold this policy's parameters"):
        restore_master_weights(policy, path)


def tiny_llama_with_attention_dropout():
    """The tiny policy with attention dropout in its config (only attention reads it, as a
    float it passes to the attention kernel while training)."""
    model, tokenizer = build_tiny_model(TINY)
    model.config.attention_dropout = 0.5
    return model, tokenizer


def tiny_gpt2_with_dropout():
    """A GPT-2 policy whose dropouts are ``nn.Dropout`` modules, at GPT-2's own 0.1."""
    _, tokenizer = build_tiny_model(TINY)
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_embd=32,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.1,
        embd_pdrop=0.1,
        attn_pdrop=0.1,
    )
    return GPT2LMHeadModel(config).eval(), tokenizer


@pytest.mark.parametrize(
    "mode, build",
    [
        ("sao", tiny_llama_with_attention_dropout),
        ("sao", tiny_gpt2_with_dropout),
        ("grpo", tiny_gpt2_with_dropout),
    ],
)
def test_a_policy_with_dropout_in_its_config_trains_without_it(tmp_path, mode, build):
    """The engines sample in eval mode: the trainer's forward passes, in train mode for
    activation checkpointing, must not drop anything either, or on-policy ratios are not 1."""
    store = RunStore(StorageConfig(root=str(tmp_path / "runs")), "dropout-test")
    publish_policy(WeightStore(store), *build(), step=0)
    trainer = Trainer(store, config(mode=mode))
    samples = open_batch(trainer, make_trajectories(store, 4, seed=30))
    batch = pad_batch(samples, trainer.pad_id)
    with torch.no_grad():
        first, second = (
            token_logprobs(trainer.policy, batch.input_ids, batch.attention_mask) for _ in range(2)
        )
    assert trainer.policy.training and torch.equal(first, second)
    if mode == "sao":
        # the critic's head starts at zero: its backbone's output is where noise would show
        with torch.no_grad():
            first, second = (
                trainer.value_model.backbone(
                    input_ids=batch.input_ids, attention_mask=batch.attention_mask.long()
                ).last_hidden_state
                for _ in range(2)
            )
        assert trainer.value_model.training and torch.equal(first, second)

    metrics = trainer._train_step(samples)
    assert metrics.row["mean_ratio"] == pytest.approx(1.0, abs=1e-4)
    assert metrics.extra["max_ratio"] == pytest.approx(1.0, abs=1e-4)
    assert metrics.row["kl"] == pytest.approx(0.0, abs=1e-6)
    assert metrics.row["masked_fraction"] == 0.0


@pytest.mark.parametrize("mode", ["sao", "grpo"])
def test_the_tokens_after_a_rows_last_action_are_not_fed_to_the_models(tmp_path, mode):
    """A rollout whose last observation took it past the engine's positions (the engine
    refused the next turn: status truncated) keeps that observation. It enters no loss: the
    step on such rows is the step on them without it, also for a policy with learned
    positions (GPT-2), whose position table those tokens would index past."""
    store = RunStore(StorageConfig(root=str(tmp_path / "runs")), "positions-test")
    _, tokenizer = build_tiny_model(TINY)
    gpt2 = GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=2, n_positions=12)
    publish_policy(WeightStore(store), GPT2LMHeadModel(gpt2).eval(), tokenizer, step=0)
    records = with_rewards(make_trajectories(store, 4, seed=34), [1.0, 0.0, 2.0, -1.0])  # 11 tokens each
    overflowed = []
    for record in records:
        tail = {"tokens": 50, "logprobs": 0.0, "action_mask": False, "turn": 2, "versions": -1}
        tail |= {"train_mask": False, "loss_weight": 1.0}
        overflowed.append(record | {column: record[column] + [fill] * 5 for column, fill in tail.items()})

    settings = dict(mode=mode, token_budget=100, micro_token_budget=100)
    want, _ = one_step(store, records, **settings)
    got, _ = one_step(store, overflowed, **settings)
    for name in ("policy_loss", "mean_ratio", "num_tokens", *(["value_loss"] if mode == "sao" else [])):
        assert got.row[name] == pytest.approx(want.row[name], rel=1e-6), name
    assert got.extra["grad_norm"] == pytest.approx(want.extra["grad_norm"], rel=1e-5)
    assert got.extra["grad_norm"] > 0


def test_sao_on_a_policy_without_attention_fails_at_start_naming_its_architecture(tmp_path):
    """SAO trains the value model with its attention frozen; a Mamba has none to freeze."""
    store = RunStore(StorageConfig(root=str(tmp_path / "runs")), "mamba-test")
    _, tokenizer = build_tiny_model(TINY)
    mamba = MambaConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, state_size=4)
    publish_policy(WeightStore(store), MambaForCausalLM(mamba).eval(), tokenizer, step=0)
    with pytest.raises(ValueError, match=r"^mamba \(MambaModel\) has no attention parameters to freeze"):
        Trainer(store, config(mode="sao"))


def test_the_readme_totals_count_the_rows_of_a_version_passed_over_once(store):
    """Version 1's files do not verify: the trainer resumes from version 0 and rejects the
    rows version 1 rejected again, into version 2 whose parent is 0. Version 1 keeps its
    ``weights`` row, and the README's totals, over the newest version's chain, count each
    rejected row once."""
    records = make_trajectories(store, 6, seed=71)
    for record in records[::3]:
        record["reward"] = None  # rejected: no reward
    write_shards(store, records, per_shard=3)
    Trainer(store, config(publish_every=1)).run(max_steps=1)
    weights = WeightStore(store)
    assert weights.manifest(1)["metadata"]["rejected_rows"] == 2
    os.truncate(os.path.join(weights.version_path(1), STATE_FILE), 0)
    resumed = Trainer(store, config(publish_every=1))
    assert resumed.passed_over == [1]
    resumed.run(drain=True)
    rows = Tables(store).read("weights", columns=["version", "parent", "rejected_rows"]).sort_by("version")
    assert rows.to_pylist() == [
        {"version": 0, "parent": None, "rejected_rows": None},
        {"version": 1, "parent": 0, "rejected_rows": 2},
        {"version": 2, "parent": 0, "rejected_rows": 2},
    ]
    assert readme_totals(store) == (0, 2)


def test_a_trainer_resumes_past_a_garbled_latest_and_below_a_version_that_does_not_verify(store, caplog):
    """Garbled LATEST: it resumes from the newest complete version. That version's files
    corrupt: from the newest below it that verifies, and the rows the corrupt one consumed
    are trained again in a version whose parent skips it, so each is on the chain once."""
    infos = write_shards(store, make_trajectories(store, 6, seed=70), per_shard=3)
    Trainer(store, config(publish_every=1)).run(max_steps=1)
    weights = WeightStore(store)
    assert weights.list() == [0, 1]
    store.fs.pipe_file(f"{weights.root}/LATEST", b"")
    assert (Trainer(store, config()).version, weights.latest()) == (1, 1)

    os.truncate(os.path.join(weights.version_path(1), STATE_FILE), 0)
    resumed = Trainer(store, config(publish_every=1))
    assert (resumed.version, resumed.step, resumed.passed_over) == (0, 0, [1])
    assert "weight version 1: file 'trainer_state.json' is corrupt" in caplog.text
    resumed.run(drain=True)
    assert [manifest["version"] for manifest in version_chain(weights)] == [0, 2, 3]
    assert consumed_rows(weights) == {info.shard_id: 3 for info in infos}


def test_a_resumed_trainer_whose_shards_table_was_recreated_trains_the_new_tables_shards(store, caplog):
    """The run's ``tables/`` and ``shards/`` deleted, its weight versions kept: the new table
    numbers the worker's shards from 0 again, below the saved mark, yet none of them is consumed."""
    write_shards(store, make_trajectories(store, 6, seed=70), per_shard=3)
    Trainer(store, config(publish_every=1)).run(drain=True)
    for folder in ("tables", "shards"):
        store.fs.rm(store.path(folder), recursive=True)
    write_shards(store, make_trajectories(store, 6, seed=71), per_shard=3)
    resumed = Trainer(store, config(publish_every=1))
    assert resumed.ingest() == 2 and len(resumed.buffer) == 6
    assert "recreated" in caplog.text


def test_a_trainer_whose_shards_table_is_recreated_under_it_stops_rather_than_pass_shards_over(store):
    """Recreated under a running trainer and grown past its offset, the new log is refused as
    an offset past the log is; the trainer resumed next trains the new table's shards."""
    write_shards(store, make_trajectories(store, 6, seed=72), per_shard=3)
    trainer = Trainer(store, config(publish_every=1))
    trainer.run(drain=True)
    for folder in ("tables", "shards"):
        store.fs.rm(store.path(folder), recursive=True)
    write_shards(store, make_trajectories(store, 9, seed=73), per_shard=3)
    with pytest.raises(StaleOffsetError, match="recreated"):
        trainer.ingest()
    assert Trainer(store, config(publish_every=1)).ingest() == 3
