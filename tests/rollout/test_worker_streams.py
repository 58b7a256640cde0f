"""The rollout worker's endless task streams, and the seeds each worker of a run draws from."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from envs import registry
from envs.base import in_eval_split
from envs.code import split_key
from flows.config import RunConfig
from rl.models import ensure_base_version
from rollout.config import OrchestratorConfig
from rollout.worker import RolloutWorker, task_streams, worker_seed
from storage.config import RunStore, StorageConfig
from storage.shards import ShardWriter
from storage.weights import WeightStore
from tests.rl.test_trainer import TINY
from tests.storage.records import make_record


def test_an_env_with_fewer_train_tasks_than_the_pool_streams_every_one_of_them_cycled():
    # code holds a few hundred train functions, fewer than the worker's pool of 2048 tasks
    config = registry.make_config("code")
    stream = task_streams(["code"], {"code": config}, seed=0)["code"]
    first = list(itertools.islice(stream, 4096))
    count = len({task.id for task in first})
    assert 0 < count < 2048
    assert [t.id for t in first[:count]] == [t.id for t in first[count : 2 * count]]
    assert not any(in_eval_split(split_key(task.data["body"]), config.eval_fraction) for task in first)
    # one with none at all fails at once, rather than handing the orchestrator an empty stream
    empty = registry.make_config("arith", max_operand=1, eval_fraction=0.99)
    with pytest.raises(ValueError, match="only 0 distinct tasks"):
        task_streams(["arith"], {"arith": empty}, seed=0)


def test_two_workers_of_a_run_roll_out_different_tasks_with_different_sampling_seeds(tmp_path):
    run = RunConfig(run_id="seeds", storage=StorageConfig(root=str(tmp_path / "runs")))
    store = RunStore(run.storage, run.run_id)
    ensure_base_version(WeightStore(store), TINY)

    async def first_rollouts(name: str) -> tuple[list[str], int]:
        worker = RolloutWorker(
            store,
            name,
            engine=run.engine,
            gateway=run.gateway,
            service=run.service,
            orchestrator=run.orchestrator,
            env_configs={env: run.env_config(env) for env in run.orchestrator.mix},
            seed=run.seed,
        )
        await worker.start()
        try:
            orchestrator = worker.orchestrator
            tasks = [next(orchestrator.tasks["arith"]).id for _ in range(8)]
            return tasks, orchestrator.config.seed
        finally:
            await worker.close()

    (tasks_0, seed_0), (tasks_1, seed_1) = [asyncio.run(first_rollouts(name)) for name in ("w0", "w1")]
    assert tasks_0 != tasks_1
    assert seed_0 != seed_1
    # a worker's seeds are its own, and the same each time it starts before it commits a shard
    assert asyncio.run(first_rollouts("w0")) == (tasks_0, seed_0)
    # restarted after it committed one (killed, say), it goes on with other tasks and sampling
    # seeds: with the same ones it would roll out the start of its first stream again
    writer = ShardWriter(store, "w0")
    writer.write(make_record(0))
    writer.close()
    tasks_resumed, seed_resumed = asyncio.run(first_rollouts("w0"))
    assert tasks_resumed != tasks_0 and seed_resumed != seed_0
    assert asyncio.run(first_rollouts("w0")) == (tasks_resumed, seed_resumed)


def test_a_workers_seed_is_a_valid_orchestrator_seed():
    seeds = [
        worker_seed(seed, f"w{i}", resumed_at)
        for seed in (0, 2**62)
        for i in range(50)
        for resumed_at in (0, 7)
    ]
    for seed in seeds:
        OrchestratorConfig(mix={"arith": 1.0}, seed=seed)


def test_each_rollouts_env_is_made_with_the_runs_config_of_that_env(tmp_path):
    run = RunConfig(run_id="envs", storage=StorageConfig(root=str(tmp_path / "runs")))
    config = registry.make_config("arith", max_operand=5, ops=["-"])
    worker = RolloutWorker(
        RunStore(run.storage, run.run_id),
        "w0",
        engine=run.engine,
        gateway=run.gateway,
        service=run.service,
        orchestrator=run.orchestrator,
        env_configs={"arith": config},
    )
    task = next(task_streams(["arith"], {"arith": config}, seed=0)["arith"])
    assert worker.make_env(task).config == config
