"""The trainer's queue as the rollout workers see it: what the trainer publishes in the
run's storage, read back by a worker, and what a missing, stale or stopped trainer means."""

from __future__ import annotations

import logging

import pytest

from flows.config import RunConfig
from rollout.worker import RolloutWorker
from storage.config import RunStore, StorageConfig
from storage.status import TRAINER_STATUS_NAME, TRAINER_STATUS_PREFIX, TrainerStatus, TrainerStatusBoard
from tests.tasks.test_elastic_plan import make_worker

NOW = 1_000_000.0


@pytest.fixture
def worker(tmp_path) -> RolloutWorker:
    run = RunConfig(run_id="queue", storage=StorageConfig(root=str(tmp_path / "runs")))
    return make_worker(RunStore(run.storage, run.run_id), run, plan_max_age_s=30)


@pytest.mark.parametrize(
    ("age", "running", "expected"),
    [(0.0, True, 2.5), (29.0, True, 2.5), (31.0, True, None), (0.0, False, None)],
)
def test_a_worker_sees_a_fresh_running_trainer_queue_and_nothing_else(worker, age, running, expected):
    assert worker.trainer_queue() is None  # no trainer status yet
    status = TrainerStatus(time=NOW - age, buffered_tokens=2500, token_budget=1000, running=running)
    TrainerStatusBoard(worker.store).publish(status)
    worker.refresh_trainer_queue(NOW)
    assert worker.trainer_queue() == expected


def test_a_corrupt_trainer_status_leaves_the_queue_unknown(worker, caplog):
    board = TrainerStatusBoard(worker.store)
    board.publish(TrainerStatus(time=NOW, buffered_tokens=5000, token_budget=1000))
    worker.refresh_trainer_queue(NOW)
    assert worker.trainer_queue() == 5.0
    with open(worker.store.path(TRAINER_STATUS_PREFIX, TRAINER_STATUS_NAME), "w") as handle:
        handle.write("{truncated")
    with caplog.at_level(logging.WARNING, logger="storage.status"):
        worker.refresh_trainer_queue(NOW)
    assert worker.trainer_queue() is None and "not a valid status" in caplog.text
