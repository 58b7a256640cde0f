"""The trainer's queue as the rollout workers see it: what the trainer publishes in the
run's storage, read back by a worker, and what a missing, stale or stopped trainer means;
and whether the worker's shards have reached the trainer through the processor."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time

import pytest

from flows.config import RunConfig
from rl.models import ensure_base_version, load_policy, publish_policy
from rl.process_loop import ShardProcessor
from rl.trainer import Trainer
from rollout.worker import RolloutWorker
from storage.config import RunStore, StorageConfig
from storage.shards import ShardReader, ShardWriter
from storage.status import TRAINER_STATUS_NAME, TRAINER_STATUS_PREFIX, TrainerStatus, TrainerStatusBoard
from storage.weights import WeightStore
from tasks.rollout import rollout_detail, run_rollouts
from tasks.train import run_trainer
from tests.rl.test_processor import record
from tests.rl.test_trainer import TINY, config
from tests.tasks.test_elastic_plan import make_worker, until

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


def test_a_trainer_status_that_cannot_be_read_is_warned_of_once_while_it_lasts(tmp_path, caplog):
    """The worker reads the trainer's status four times a second: one that cannot be read
    (storage down, credentials refused) was warned of at every read, 345,600 lines a day for
    one lasting that long. It is warned of once per distinct error, and its end is logged."""
    run = RunConfig(run_id="queue", storage=StorageConfig(root=str(tmp_path / "runs")))
    worker = make_worker(RunStore(run.storage, run.run_id), run, trainer_poll_s=0.01)
    path = worker.store.path(TRAINER_STATUS_PREFIX, TRAINER_STATUS_NAME)
    os.makedirs(path)  # reading it raises IsADirectoryError at every poll

    async def follow(seconds: float) -> None:
        reader = asyncio.create_task(worker.follow_trainer())
        await asyncio.sleep(seconds)
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)

    with caplog.at_level(logging.INFO, logger="rollout.worker"):
        asyncio.run(follow(0.5))
        failed = [r for r in caplog.records if "could not read the trainer's status" in r.getMessage()]
        assert len(failed) == 1 and worker.trainer_queue() is None
        os.rmdir(path)
        TrainerStatusBoard(worker.store).publish(
            TrainerStatus(time=time.time(), buffered_tokens=2000, token_budget=1000)
        )
        asyncio.run(follow(0.2))
    assert worker.trainer_queue() == 2.0
    assert [r.getMessage() for r in caplog.records if "trainer's status again" in r.getMessage()] == [
        "worker w0 reads the trainer's status again"
    ]


def commit_raw(worker: RolloutWorker, count: int) -> None:
    """``count`` raw shards of one trajectory each, through the worker's own writer."""
    for i in range(count):
        worker.writer.write(record(f"t{i}", f"e{i}", [1, 2, 3, 4], [False, False, True, True]))
        worker.writer.flush()
    worker.writer.close()


def starved_by(worker: RolloutWorker, newest_read: dict[str, int], buffered_tokens: int = 0) -> bool:
    """Whether ``worker`` sees the trainer starved once the trainer says it read ``newest_read``
    and holds ``buffered_tokens`` (a batch is 1000)."""
    status = TrainerStatus(
        time=NOW, buffered_tokens=buffered_tokens, token_budget=1000, newest_read=newest_read
    )
    TrainerStatusBoard(worker.store).publish(status)
    worker.refresh_trainer_queue(NOW)
    return worker.trainer_starved()


def test_a_trainer_short_of_a_batch_is_starved_only_once_it_has_read_the_workers_newest_shard(worker):
    assert not worker.trainer_starved()  # no trainer status: the backlog is in charge
    assert starved_by(worker, {})  # this worker committed nothing: nothing is on its way
    commit_raw(worker, 3)
    assert worker.writer.last_seq == 2
    assert not starved_by(worker, {})  # its shards have not reached the trainer: the processor lags
    assert not starved_by(worker, {"w0": 1, "w1": 7})
    assert starved_by(worker, {"w0": 2})
    assert not starved_by(worker, {"w0": 2}, buffered_tokens=1000)  # a full batch: it can step
    TrainerStatusBoard(worker.store).publish(
        TrainerStatus(time=NOW, buffered_tokens=0, token_budget=1000, running=False, newest_read={"w0": 2})
    )
    worker.refresh_trainer_queue(NOW)
    assert not worker.trainer_starved()  # a stopped trainer says nothing about starving


def test_a_trainer_that_has_read_none_of_the_workers_shards_has_not_read_its_first_one(worker):
    """Shard 0 is this worker's newest: a trainer that names no shard of it has not read it."""
    commit_raw(worker, 1)
    assert worker.writer.last_seq == 0
    assert not starved_by(worker, {"w1": 4})
    assert starved_by(worker, {"w0": 0})


def test_a_trainer_status_that_stops_being_readable_leaves_the_queue_unknown(worker):
    """The last status read says the trainer holds little: once storage fails, the worker
    does not go on pausing or running on by that old word."""
    worker.trainer_poll_s = 0.01
    TrainerStatusBoard(worker.store).publish(
        TrainerStatus(time=time.time(), buffered_tokens=0, token_budget=1000)
    )
    worker.refresh_trainer_queue(time.time())
    assert worker.trainer_queue() == 0.0 and worker.trainer_starved()

    path = worker.store.path(TRAINER_STATUS_PREFIX, TRAINER_STATUS_NAME)
    os.remove(path)
    os.makedirs(path)  # reading it raises IsADirectoryError at every poll

    async def follow() -> None:
        reader = asyncio.create_task(worker.follow_trainer())
        await until(lambda: worker.trainer_queue() is None, "a failed read to clear the queue")
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)

    asyncio.run(follow())
    assert worker.trainer_queue() is None and not worker.trainer_starved()


def test_a_new_weight_version_clears_the_backlog(worker):
    """The backlog counts the shards committed since the engines last took a new version:
    the trainer's next version is what lets paused rollouts go on."""
    weights = WeightStore(worker.store)
    ensure_base_version(weights, TINY)
    model, tokenizer = load_policy(weights.load(0))

    async def body() -> tuple[int, int]:
        await worker.start()
        try:
            commit_raw(worker, 2)
            before = worker.backlog()
            publish_policy(weights, model, tokenizer, step=1)
            assert await worker.sync_weights()
            return before, worker.backlog()
        finally:
            await worker.close()

    assert asyncio.run(body()) == (2, 0)


def test_the_workers_shards_reach_the_trainers_status_only_through_the_processor(worker):
    """Real raw shards, processor and trainer: the trainer reads a worker's shard, and says
    so, only once the processor has made it a processed one under the same number."""
    ensure_base_version(WeightStore(worker.store), TINY)
    commit_raw(worker, 2)
    trainer = Trainer(worker.store, config())
    assert trainer.ingest() == 0 and trainer.newest_read == {}
    processor = ShardProcessor(worker.store)
    processor.poll()
    assert trainer.ingest() == 2 and trainer.newest_read == {"w0": 1}
    restarted = ShardWriter(worker.store, "w0")  # the same worker, restarted: numbering resumes
    restarted.write(record("t9", "e9", [1, 2, 3, 4], [False, False, True, True]))
    restarted.close()
    processor.poll()
    trainer.ingest()
    assert trainer.newest_read == {"w0": 2}


def test_a_quarantined_raw_shard_still_gets_its_processed_twin_so_the_trainer_hears_of_it(worker):
    ensure_base_version(WeightStore(worker.store), TINY)
    commit_raw(worker, 2)
    raw, _ = ShardReader(worker.store, kind="raw").poll()
    path = worker.store.path(raw[1].path)
    with open(path, "r+b") as handle:
        handle.truncate(os.path.getsize(path) // 2)
    outcomes = ShardProcessor(worker.store).poll()
    assert [o.skipped for o in outcomes] == [None, "quarantined"]
    assert outcomes[1].processed.seq == 1 and outcomes[1].processed.num_rows == 0
    trainer = Trainer(worker.store, config())
    trainer.ingest()
    assert trainer.newest_read == {"w0": 1}


def test_rollouts_pause_for_the_backlog_while_the_processor_lags_behind_a_starved_trainer(tmp_path):
    """A running trainer that holds nothing, and no processor: the worker's shards never
    reach the trainer, so they bound the rollouts (a starved trainer once let them run on)."""
    run = RunConfig(
        run_id="lagging-processor",
        storage=StorageConfig(root=str(tmp_path / "runs")),
        sao=config(),
        orchestrator={"mix": {"arith": 1.0}, "concurrency": 2, "max_backlog": 2},
    )
    store = RunStore(run.storage, run.run_id)
    ensure_base_version(WeightStore(store), TINY)
    stop = threading.Event()
    trainer = threading.Thread(target=run_trainer, args=(run, time.time() + 300), kwargs={"stop": stop})
    trainer.start()
    try:
        deadline = time.monotonic() + 120
        while (status := TrainerStatusBoard(store).read()) is None or not status.running:
            assert time.monotonic() < deadline, "the trainer never said it runs"
            time.sleep(0.05)
        # past max_backlog: the rollouts in flight finish, and one commit may still be on its way
        most = 2 + 1 + 2 + 1
        rollouts_stop = threading.Event()

        def watch(status: dict) -> None:
            """Stop once the worker has paused a while and says so, or has run past the bound
            (failed)."""
            stats = status["orchestrator"]
            if (stats["paused_s"] > 1.0 and stats["paused"]) or stats["finished"] > most:
                watch.detail = rollout_detail(status)
                rollouts_stop.set()

        result = run_rollouts(
            run,
            time.time() + 300,
            flush_records=1,
            stop=rollouts_stop,
            on_progress=watch,
            progress_every_s=0.2,
        )
    finally:
        stop.set()
        trainer.join()
    raw, _ = ShardReader(store, kind="raw").poll()
    stats = result["orchestrator"]
    assert len(raw) == stats["finished"] <= most, stats
    assert stats["paused_s"] > 1.0, stats
    assert (
        ", paused: backlog " in watch.detail
        and "> max_backlog 2: waits for a new weight version" in watch.detail
    )


def test_a_workers_progress_line_leaves_out_a_task_with_no_reward_yet():
    status = {
        "version": 3,
        "backlog": 1,
        "orchestrator": {
            "tasks": {
                "arith": {"mean_reward": 0.5, "statuses": {"ok": 2}},
                "code": {"mean_reward": None, "statuses": {}},
            },
            "groups_kept": 0,
            "groups_filtered": 0,
            "paused": None,
        },
        "reward_reloads": 0,
    }
    assert rollout_detail(status) == "serving v3, backlog 1 shard, mean reward arith 0.50"
    status["orchestrator"]["tasks"] = {"code": {"mean_reward": None, "statuses": {}}}
    assert rollout_detail(status) == "serving v3, backlog 1 shard, mean reward —"


def test_a_workers_progress_line_counts_the_rollouts_of_each_task_that_failed_outside_the_policy():
    """A run whose code and pytool sandboxes could not start printed "mean reward shell 0.03"
    alone: the tasks whose every rollout failed were left out as tasks with no reward yet."""
    status = {
        "version": 29,
        "backlog": 2,
        "orchestrator": {
            "tasks": {
                "shell": {"mean_reward": 0.03, "statuses": {"ok": 52, "truncated": 59, "timeout": 1}},
                "code": {"mean_reward": None, "statuses": {"env_error": 138}},
                "pytool": {"mean_reward": 0.0, "statuses": {"ok": 3, "infra_error": 115, "env_error": 2}},
            },
            "groups_kept": 0,
            "groups_filtered": 0,
            "paused": None,
        },
        "reward_reloads": 0,
    }
    assert rollout_detail(status) == (
        "serving v29, backlog 2 shards, mean reward pytool 0.00, shell 0.03, "
        "failed outside the policy: code 138, pytool 117"
    )


def test_a_workers_progress_line_counts_the_groups_dropped_for_uniform_rewards():
    """A GRPO run (group_size 4, filter_uniform_groups) printed "Rollouts finished: 8532" while
    its tables held 4820 trajectories: the 928 groups dropped for equal rewards were told nowhere."""
    status = {
        "version": 7,
        "backlog": 0,
        "orchestrator": {
            "tasks": {"dataset": {"mean_reward": 0.25, "statuses": {"ok": 40}}},
            "groups_kept": 6,
            "groups_filtered": 4,
            "paused": None,
        },
        "reward_reloads": 0,
    }
    assert rollout_detail(status) == (
        "serving v7, backlog 0 shards, mean reward dataset 0.25, "
        "4 of 10 groups dropped (every reward in them equal)"
    )
    status["orchestrator"]["groups_filtered"] = 0
    assert rollout_detail(status) == "serving v7, backlog 0 shards, mean reward dataset 0.25"


def test_a_workers_progress_line_counts_the_reward_models_loaded_again_after_an_eviction():
    """Two reward models under a budget that holds one swapped on every call, told nowhere."""
    status = {
        "version": 2,
        "backlog": 0,
        "orchestrator": {
            "tasks": {"arith": {"mean_reward": 0.5, "statuses": {"ok": 9}}},
            "groups_kept": 0,
            "groups_filtered": 0,
            "paused": None,
        },
        "reward_reloads": 7,
    }
    assert rollout_detail(status) == (
        "serving v2, backlog 0 shards, mean reward arith 0.50, "
        "reward models reloaded 7 times (their device budget holds fewer than all)"
    )
    status["reward_reloads"] = 1
    assert rollout_detail(status).endswith(
        ", reward models reloaded 1 time (their device budget holds fewer than all)"
    )
