"""Asynchronous pipeline vs the synchronous baseline, same model, envs and trained trajectories.

The environment is ``arith`` behind a simulated tool call with heavy-tailed latency
(lognormal per step, plus rare long stragglers), so the model's real tokens are generated,
processed and trained on. Four measurements, each on a fresh run with the same tiny model:

- **generation alone**: ``run_rollouts`` for N rollouts, at least ``STEADY_ROLLOUTS`` (no
  trainer, no backpressure);
- **training alone**: a ``Trainer`` draining the processed trajectories of generation alone;
- **sync**: generate a batch (``Orchestrator`` with ``max_rollouts``), wait for the slowest,
  process it, train on it (``Trainer.run(drain=True)``), publish, load the new version into
  the engine, repeat until N trajectories are trained;
- **async**: ``run_rollouts``, ``run_processor`` and ``run_trainer`` in three threads, as
  ``flows/pipeline.py`` runs them, until N trajectories are trained.

Trained trajectories per second of each, the trainer's idle fraction (wall time not spent
in a policy step, over wall time) and the bound of perfect overlap are printed; the last
line is a JSON object. The bound is the slower of generation in steady state (rollouts
finished per second once a batch has finished and before the last one started: no engine
load, no wait for the slowest last rollouts) and training in its steps (trajectories per
second of policy-step time): start-up and tails left out, no overlap of the two, which
pays for them, can train faster.

``python benchmarks/bench_async.py`` (``--trajectories`` to change N).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import random
import tempfile
import threading
import time
from collections.abc import Callable

import torch

from envs import registry
from envs.arith import ArithEnv
from envs.base import StepResult
from flows.config import RunConfig
from rl.models import TinyModelConfig, build_tiny_model, publish_policy
from rl.process_loop import ShardProcessor
from rl.trainer import Trainer
from rollout.engines.torch_engine import TorchEngine
from rollout.gateway import Gateway
from rollout.orchestrator import Orchestrator
from rollout.router import Router
from rollout.service import RolloutService
from rollout.worker import task_streams
from storage.config import RunStore, StorageConfig
from storage.shards import ShardReader, ShardWriter
from storage.weights import WeightStore
from tasks.process import run_processor
from tasks.rollout import run_rollouts
from tasks.train import run_trainer

TINY = TinyModelConfig(hidden_size=128, num_layers=4, num_heads=4, intermediate_size=256)
BATCH = 32
"""Rollouts per synchronous batch, and rollouts in flight in every mode."""
STEADY_ROLLOUTS = 4 * BATCH
"""Rollouts generation alone runs at least: its steady state spans the two batches between
the first finished and the last started."""

LATENCY_MEDIAN_S = 0.25
LATENCY_SIGMA = 1.0
STRAGGLER_P = 0.02
STRAGGLER_S = (3.0, 6.0)


class LatencyModel:
    """Seconds each simulated tool call takes: lognormal, and now and then a long straggler."""

    def __init__(self, seed: int = 0):
        self.rng = random.Random(seed)

    def draw(self) -> float:
        if self.rng.random() < STRAGGLER_P:
            return self.rng.uniform(*STRAGGLER_S)
        return self.rng.lognormvariate(math.log(LATENCY_MEDIAN_S), LATENCY_SIGMA)


LATENCY = LatencyModel()


@registry.register
class SlowArithEnv(ArithEnv):
    """``arith`` whose every step waits for a simulated tool call first."""

    name = "slow_arith"

    async def step(self, action: str) -> StepResult:
        await asyncio.sleep(LATENCY.draw())
        return await super().step(action)


def run_config(root: str, run_id: str, token_budget: int, max_backlog: int = 8) -> RunConfig:
    return RunConfig(
        run_id=run_id,
        storage=StorageConfig(root=root),
        warm_start={"enabled": False},
        orchestrator={"mix": {"slow_arith": 1.0}, "concurrency": BATCH, "max_backlog": max_backlog},
        service={"max_new_tokens": 8},
        sao={
            "token_budget": token_budget,
            "micro_token_budget": 4 * token_budget,
            "publish_every": 1,
            "poll_seconds": 0.05,
            "max_staleness": 8,
        },
    )


def new_run(root: str, run_id: str, token_budget: int, **kwargs) -> RunConfig:
    """A run config whose store holds the tiny model as version 0; resets the latency draws."""
    config = run_config(root, run_id, token_budget, **kwargs)
    model, tokenizer = build_tiny_model(TINY)
    publish_policy(WeightStore(RunStore(config.storage, run_id)), model, tokenizer, step=0, tag="base")
    LATENCY.rng.seed(0)
    return config


class TrainCounter:
    """Counts trained trajectories and step time; sets ``done`` once ``target`` are trained."""

    def __init__(self, target: int):
        self.target = target
        self.trained = 0
        self.step_seconds = 0.0
        self.steps = 0
        self.started = time.perf_counter()
        self.finished: float | None = None
        self.done = threading.Event()

    def __call__(self, row: dict) -> None:
        self.trained += int(row["num_samples"])
        self.step_seconds += float(row["step_seconds"])
        self.steps += 1
        if self.trained >= self.target and self.finished is None:
            self.finished = time.perf_counter()
            self.done.set()

    def result(self) -> dict:
        wall = (self.finished or time.perf_counter()) - self.started
        return {
            "trained": self.trained,
            "steps": self.steps,
            "wall_s": wall,
            "tps": self.trained / wall,
            "step_tps": self.trained / self.step_seconds if self.step_seconds else math.inf,
            "trainer_idle": 1.0 - self.step_seconds / wall,
        }


def steady_rate(marks: list[tuple[float, int, int]], total: int) -> float:
    """Rollouts finished per second between the first progress mark with a batch finished
    (the engine loaded and warm) and the last with fewer than ``total`` started (after it,
    nothing replaces a finished rollout: the run waits for its slowest).

    Args:
        marks: ``(seconds, finished, started)`` of each progress report, in time order.
        total: rollouts the run starts in all.
    """
    first = next((m for m in marks if m[1] >= BATCH), None)
    last = next((m for m in reversed(marks) if m[2] < total), None)
    if first is None or last is None or last[0] <= first[0]:
        raise ValueError(f"no steady state in {len(marks)} progress marks of {total} rollouts")
    return (last[1] - first[1]) / (last[0] - first[0])


def generation_alone(root: str, rollouts: int, token_budget: int) -> tuple[RunConfig, float, float]:
    """``rollouts`` rollouts with nothing else running; returns the run, its rollouts per
    second over the whole run and in steady state (:func:`steady_rate`)."""
    config = new_run(root, "gen-alone", token_budget, max_backlog=10**6)
    config = config.model_copy(update={"stop": config.stop.model_copy(update={"max_rollouts": rollouts})})
    marks: list[tuple[float, int, int]] = []

    def mark(status: dict) -> None:
        stats = status["orchestrator"]
        if stats is not None:
            started = sum(task["started"] for task in stats["tasks"].values())
            marks.append((time.perf_counter(), stats["finished"], started))

    started = time.perf_counter()
    result = run_rollouts(
        config, math.inf, on_progress=mark, progress_every_s=0.1, flush_records=8, flush_seconds=0.5
    )
    wall = time.perf_counter() - started
    return config, result["orchestrator"]["finished"] / wall, steady_rate(marks, rollouts)


def mean_tokens(config: RunConfig) -> float:
    reader = ShardReader(RunStore(config.storage, config.run_id))
    shards, _ = reader.poll()
    lengths = [len(t) for shard in shards for t in reader.read(shard).column("tokens").to_pylist()]
    return sum(lengths) / len(lengths)


def training_alone(config: RunConfig, n: int) -> dict:
    """Train on the processed trajectories of ``config``'s run (nothing dropped as stale)."""
    store = RunStore(config.storage, config.run_id)
    ShardProcessor(store, config.processor).poll()
    counter = TrainCounter(n)
    trainer = Trainer(
        store,
        config.sao.model_copy(update={"max_staleness": 10**6}),
        temperature=config.service.temperature,
    )
    trainer.run(drain=True, progress=counter)
    return counter.result()


def synchronous(root: str, n: int, token_budget: int) -> dict:
    """Generate a batch, wait for its slowest rollout, process, train, publish, reload."""
    config = new_run(root, "sync", token_budget)
    store = RunStore(config.storage, config.run_id)
    weights = WeightStore(store)
    counter = TrainCounter(n)
    env_configs = {name: config.env_config(name) for name in config.orchestrator.mix}
    batch_config = config.orchestrator.model_copy(update={"max_rollouts": BATCH})

    async def loop() -> None:
        engine = TorchEngine.from_config(
            config.engine.torch, weights.load(0, "serving"), name="sync", version=0
        )
        gateway = Gateway(Router([engine]), engine.tokenizer, config.gateway)
        service = RolloutService(
            gateway, lambda task: registry.make(task.env, env_configs[task.env]), config.service
        )
        writer = ShardWriter(store, "sync", flush_records=10**6, flush_seconds=math.inf)
        streams = task_streams(list(config.orchestrator.mix), env_configs, config.seed)
        processor = ShardProcessor(store, config.processor)
        trainer = await asyncio.to_thread(Trainer, store, config.sao, temperature=config.service.temperature)
        try:
            while not counter.done.is_set():
                await Orchestrator(service, streams, writer, batch_config).run()
                await asyncio.to_thread(processor.poll)
                await asyncio.to_thread(trainer.run, drain=True, progress=counter)
                await engine.load_version(
                    trainer.version, await asyncio.to_thread(weights.load, trainer.version, "serving")
                )
        finally:
            writer.close()
            await engine.close()

    asyncio.run(loop())
    return counter.result()


def asynchronous(root: str, n: int, token_budget: int) -> dict:
    """Rollout, process and train side by side in threads, as ``flows/pipeline.py`` does."""
    config = new_run(root, "async", token_budget)
    counter = TrainCounter(n)
    deadline = time.time() + 600
    jobs: list[Callable[[], object]] = [
        lambda: run_rollouts(
            config, deadline, progress_every_s=0.1, stop=counter.done, flush_records=8, flush_seconds=0.5
        ),
        lambda: run_processor(config, deadline, poll_s=0.05, stop=counter.done),
        lambda: run_trainer(config, deadline, on_step=counter, stop=counter.done),
    ]
    errors: list[BaseException] = []

    def guarded(job: Callable[[], object]) -> None:
        try:
            job()
        except BaseException as exc:
            errors.append(exc)
            counter.done.set()

    threads = [threading.Thread(target=guarded, args=(job,)) for job in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return counter.result()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trajectories", type=int, default=384, help="trained trajectories per mode")
    args = parser.parse_args()
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    n = args.trajectories
    with tempfile.TemporaryDirectory(prefix="treadle-bench-async-") as root:
        gen_rollouts = max(n, STEADY_ROLLOUTS)
        gen_config, gen_tps, gen_steady_tps = generation_alone(root, gen_rollouts, token_budget=1)
        budget = int(1.15 * BATCH * mean_tokens(gen_config))
        gen_config = gen_config.model_copy(update={"sao": run_config(root, "gen-alone", budget).sao})
        train = training_alone(gen_config, gen_rollouts)
        print(
            f"generation alone: {gen_tps:.1f} rollouts/s ({gen_rollouts} rollouts), "
            f"{gen_steady_tps:.1f} in steady state"
        )
        print(
            f"training alone:   {train['tps']:.1f} trajectories/s ({train['steps']} steps of "
            f"{budget} tokens, {1 - train['trainer_idle']:.0%} of the time in steps), "
            f"{train['step_tps']:.1f} in its steps"
        )
        sync = synchronous(root, n, budget)
        print(
            f"sync:  {sync['tps']:.1f} trained trajectories/s ({sync['trained']} in {sync['wall_s']:.1f} s), "
            f"trainer idle {sync['trainer_idle']:.0%}"
        )
        async_ = asynchronous(root, n, budget)
        print(
            f"async: {async_['tps']:.1f} trained trajectories/s ({async_['trained']} in {async_['wall_s']:.1f} s), "
            f"trainer idle {async_['trainer_idle']:.0%}"
        )
    bound = min(gen_steady_tps, train["step_tps"])
    print(f"perfect-overlap bound: {bound:.1f} trajectories/s")
    print(
        json.dumps(
            {
                "bench": "async",
                "ratio": round(async_["tps"] / sync["tps"], 3),
                "async_tps": round(async_["tps"], 2),
                "sync_tps": round(sync["tps"], 2),
                "overlap_bound_tps": round(bound, 2),
                "async_vs_bound": round(async_["tps"] / bound, 3),
                "trainer_idle_async": round(async_["trainer_idle"], 3),
                "trainer_idle_sync": round(sync["trainer_idle"], 3),
                "generation_alone_tps": round(gen_tps, 2),
                "generation_steady_tps": round(gen_steady_tps, 2),
                "training_alone_tps": round(train["tps"], 2),
                "training_step_tps": round(train["step_tps"], 2),
                "trajectories": n,
                "batch": BATCH,
            }
        )
    )


if __name__ == "__main__":
    main()
