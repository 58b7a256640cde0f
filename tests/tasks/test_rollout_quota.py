"""``max_rollouts`` is the run's: the workers of a run, running at once and restarted, together
finish no more rollouts than it (``storage.quota.RunQuota``)."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from flows.config import RunConfig
from rl.models import ensure_base_version
from rollout.worker import RolloutWorker
from storage.config import RunStore, StorageConfig
from storage.quota import RunQuota
from storage.shards import ShardReader
from storage.weights import WeightStore
from tasks.rollout import max_rollouts, run_rollouts
from tests.rl.test_trainer import TINY


def worker(store: RunStore, run: RunConfig, name: str) -> RolloutWorker:
    return RolloutWorker(
        store,
        name,
        engine=run.engine,
        gateway=run.gateway,
        service=run.service,
        orchestrator=run.orchestrator,
        env_configs={n: run.env_config(n) for n in run.orchestrator.mix},
        flush_seconds=600,
    )


def run_worker(store: RunStore, run: RunConfig, name: str) -> int:
    """Start, run and close worker ``name``; returns the rollouts it finished."""

    async def body() -> int:
        one = worker(store, run, name)
        await one.start()
        try:
            stats = await one.run(max_seconds=600)
        finally:
            await one.close()
        return stats.finished

    return asyncio.run(body())


def committed_rows(store: RunStore) -> int:
    reader = ShardReader(store)
    return sum(reader.read(shard).num_rows for shard in reader.poll()[0])


def test_two_workers_and_a_restart_finish_max_rollouts_in_all(store):
    run = RunConfig(orchestrator={"mix": {"arith": 1.0}, "concurrency": 2, "max_rollouts": 6})
    ensure_base_version(WeightStore(store), TINY)
    with ThreadPoolExecutor(2) as pool:
        finished = list(pool.map(lambda name: run_worker(store, run, name), ["w0", "w1"]))
    assert sum(finished) == committed_rows(store) == 6
    assert run_worker(store, run, "w0") == 0
    assert committed_rows(store) == 6
    assert RunQuota(store, "rollouts", 6).claimed() == 6


def test_a_quota_gives_back_what_was_not_used_and_never_passes_its_limit(local_store):
    quota = RunQuota(local_store, "rollouts", 10)
    assert quota.claim(4, step=2) == 4
    assert quota.claim(7, step=2) == 6
    assert quota.claim(2) == 0
    quota.release(3)
    assert quota.claimed() == 7
    assert quota.claim(4, step=2) == 2
    assert quota.claimed() == 9


@pytest.mark.parametrize(
    ("stop", "orchestrator", "limit"),
    [(8, 12, 8), (12, 8, 8), (None, 12, 12), (8, None, 8), (None, None, None)],
)
def test_a_runs_rollout_limit_is_the_smaller_of_its_two_limits(stop, orchestrator, limit):
    """``stop.max_rollouts`` and ``orchestrator.max_rollouts`` each say "at most": the quota is
    the smaller, and with neither there is none."""
    run = RunConfig(stop={"max_rollouts": stop}, orchestrator={"max_rollouts": orchestrator})
    assert max_rollouts(run) == limit


def test_a_worker_finishes_no_more_rollouts_than_the_runs_stop_max_rollouts(tmp_path):
    """Only ``stop.max_rollouts`` limits the run: the worker's orchestrator counts to it."""
    run = RunConfig(
        run_id="stop-limit",
        storage=StorageConfig(root=str(tmp_path / "runs")),
        orchestrator={"mix": {"arith": 1.0}, "concurrency": 2, "group_size": 2},
        service={"max_new_tokens": 4},
        stop={"max_rollouts": 2},
    )
    ensure_base_version(WeightStore(RunStore(run.storage, run.run_id)), TINY)
    result = run_rollouts(run, time.time() + 300, "w0", flush_records=1)
    assert result["orchestrator"]["finished"] == 2


@pytest.mark.parametrize(
    ("stop", "orchestrator", "limit"), [(10, None, 8), (None, 11, 8), (10, 13, 8), (12, None, 12)]
)
def test_a_runs_rollout_limit_in_group_mode_is_the_whole_groups_it_can_finish(stop, orchestrator, limit):
    """Groups launch whole: with groups of 4 a limit of 10 finishes 8, so the quota and the
    progress bar's total are 8, not a 10 the run never reaches."""
    run = RunConfig(
        stop={"max_rollouts": stop},
        orchestrator={"group_size": 4, "concurrency": 4, "max_rollouts": orchestrator},
        sao={"mode": "grpo"},
    )
    assert max_rollouts(run) == limit
