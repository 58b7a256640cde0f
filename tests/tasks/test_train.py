"""The train task builds its trainer from the run config."""

from __future__ import annotations

import json
import logging
import os
import time

import pytest

from flows.config import RunConfig
from rl.models import ensure_base_version, load_policy, publish_policy
from rl.trainer import Trainer
from storage.config import RunStore, StorageConfig
from storage.status import ElasticPlanBoard, RolloutStatusBoard, TrainerStatusBoard
from storage.tables import Tables
from storage.weights import WeightStore
from tasks.train import run_trainer
from tests.rl.test_trainer import TINY, config, make_trajectories, write_shards


def test_the_trainer_takes_log_probs_at_the_runs_sampling_temperature(tmp_path):
    """The run's rollouts sample at service.temperature; its trainer is told it with no second
    setting, so the ratios of an on-policy step are 1."""
    run = RunConfig(
        run_id="temperature",
        storage=StorageConfig(root=str(tmp_path / "runs")),
        service={"temperature": 0.7},
        sao=config(),
    )
    store = RunStore(run.storage, run.run_id)
    ensure_base_version(WeightStore(store), TINY)
    write_shards(store, make_trajectories(store, 4, seed=1, temperature=0.7), per_shard=4)

    assert run_trainer(run, time.time() + 600, drain=True)["steps"] == 1
    (row,) = Tables(store).read("train_steps").to_pylist()
    assert row["mean_ratio"] == pytest.approx(1.0, abs=1e-4)
    assert row["masked_fraction"] == 0.0


def test_a_version_the_trainer_resumed_below_is_not_announced_again(tmp_path):
    """Version 1 does not verify: the trainer resumes from version 0 and announces only the
    version it publishes, not version 1 between them."""
    run = RunConfig(run_id="passed", storage=StorageConfig(root=str(tmp_path / "runs")), sao=config())
    store = RunStore(run.storage, run.run_id)
    weights = WeightStore(store)
    ensure_base_version(weights, TINY)
    model, tokenizer = load_policy(weights.load(0))
    publish_policy(weights, model, tokenizer, step=1, parent=0)
    os.truncate(os.path.join(weights.version_path(1), "model.safetensors"), 10)
    write_shards(store, make_trajectories(store, 4, seed=1), per_shard=4)
    announced: list[int] = []

    assert run_trainer(run, time.time() + 600, drain=True, on_publish=announced.append)["versions"] == [2]
    assert announced == [0, 2]  # version 0 had no row: the trainer recorded it


def test_a_version_is_announced_when_published_not_at_the_next_step(tmp_path, monkeypatch):
    """The trainer publishes version 1 and then fails at its next poll of the shard log: the
    version was announced already. Its retry resumes from version 1, whose row is written,
    and announces nothing, so an announcement left for a later step would never be made."""
    run = RunConfig(
        run_id="announce", storage=StorageConfig(root=str(tmp_path / "runs")), sao=config(publish_every=1)
    )
    store = RunStore(run.storage, run.run_id)
    ensure_base_version(WeightStore(store), TINY)
    write_shards(store, make_trajectories(store, 4, seed=1), per_shard=4)  # one step's rows
    real_ingest = Trainer.ingest
    polls: list[int] = []

    def failing_after_the_first_poll(trainer: Trainer) -> int:
        polls.append(trainer.version)
        if len(polls) > 1:
            raise OSError("connection reset while polling the shard log")
        return real_ingest(trainer)

    monkeypatch.setattr(Trainer, "ingest", failing_after_the_first_poll)
    announced: list[int] = []
    with pytest.raises(OSError, match="connection reset"):
        run_trainer(run, time.time() + 600, drain=True, on_publish=announced.append)
    assert polls == [0, 1]
    monkeypatch.setattr(Trainer, "ingest", real_ingest)
    assert run_trainer(run, time.time() + 600, drain=True, on_publish=announced.append)["versions"] == []
    assert announced == [0, 1]


def test_a_rerun_that_trains_nothing_says_it_took_no_step(tmp_path):
    """``steps`` is the run-wide counter: a second flow run over a run whose data is all
    consumed reported step 1 though it trained nothing, and the pipeline's check for no step
    (``not steps``) never warned."""
    run = RunConfig(run_id="rerun", storage=StorageConfig(root=str(tmp_path / "runs")), sao=config())
    store = RunStore(run.storage, run.run_id)
    ensure_base_version(WeightStore(store), TINY)
    write_shards(store, make_trajectories(store, 4, seed=1), per_shard=4)
    first = run_trainer(run, time.time() + 600, drain=True)
    assert (first["steps"], first["new_steps"], first["versions"]) == (1, 1, [1])

    again = run_trainer(run, time.time() + 600, drain=True)
    assert (again["steps"], again["new_steps"], again["versions"]) == (1, 0, [])


STORE_ERRORS = pytest.mark.parametrize(
    ("error", "shown", "hidden"),
    [
        (TimeoutError(), "TimeoutError", None),
        (
            OSError("AccessDenied: <AWSAccessKeyId>AKIAABCDEFGHIJKLMNOP</AWSAccessKeyId>"),
            "AccessDenied",
            "AKIAABCDEFGHIJKLMNOP",
        ),
    ],
    ids=["bare", "echoed-key-id"],
)
"""A store's errors a warning must say: one without a message (fsspec's bare timeout), and
one whose S3 error body echoes a key id (``shown`` must be in the warning, ``hidden`` not)."""


@STORE_ERRORS
def test_a_skipped_decision_says_what_failed_the_status_read_masked(
    tmp_path, monkeypatch, caplog, error, shown, hidden
):
    """The workers' statuses cannot be read: each ``train_steps`` row (kept for the run's
    life) and the warning say why. A bare ``TimeoutError`` (fsspec's timeout is one) left
    only "could not read the rollout workers' status: ", and a key id an S3 error body
    echoed was recorded and logged as it was."""
    run = RunConfig(run_id="unread", storage=StorageConfig(root=str(tmp_path / "runs")), sao=config())
    store = RunStore(run.storage, run.run_id)
    ensure_base_version(WeightStore(store), TINY)
    write_shards(store, make_trajectories(store, 4, seed=1), per_shard=4)

    def unreadable(self):
        raise error

    monkeypatch.setattr(RolloutStatusBoard, "read", unreadable)
    with caplog.at_level(logging.WARNING, logger="tasks.train"):
        assert run_trainer(run, time.time() + 600, drain=True)["steps"] == 1
    (row,) = Tables(store).read("train_steps").to_pylist()
    skipped = json.loads(row["extra"])["elastic"]["skipped"]
    (warned, *_) = [r.getMessage() for r in caplog.records if "rollout workers' status" in r.getMessage()]
    for said in (skipped, warned):
        assert shown in said, said
        assert hidden is None or hidden not in said, said


@STORE_ERRORS
def test_a_plan_or_status_the_store_refused_is_logged_saying_what_failed_masked(
    tmp_path, monkeypatch, caplog, error, shown, hidden
):
    """The elastic plan and the trainer's last status (``running`` false) cannot be
    published: the warnings said "could not publish the elastic plan: " and nothing more for
    a bare ``TimeoutError``, and logged a key id an S3 error body echoed as it was."""
    run = RunConfig(run_id="refused", storage=StorageConfig(root=str(tmp_path / "runs")), sao=config())
    store = RunStore(run.storage, run.run_id)
    ensure_base_version(WeightStore(store), TINY)
    write_shards(store, make_trajectories(store, 4, seed=1), per_shard=4)
    publish_status = TrainerStatusBoard.publish

    def refused(self, plan):
        raise error

    def refusing_the_last(self, status):
        if not status.running:
            raise error
        publish_status(self, status)

    monkeypatch.setattr(ElasticPlanBoard, "publish", refused)
    monkeypatch.setattr(TrainerStatusBoard, "publish", refusing_the_last)
    with caplog.at_level(logging.WARNING, logger="tasks.train"):
        assert run_trainer(run, time.time() + 600, drain=True)["steps"] == 1
    for opening in ("could not publish the elastic plan", "could not publish the trainer's status"):
        (warned, *_) = [r.getMessage() for r in caplog.records if r.getMessage().startswith(opening)]
        assert shown in warned, warned
        assert hidden is None or hidden not in warned, warned
