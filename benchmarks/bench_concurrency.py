"""Orchestration at scale: 10,000 rollouts in flight at once through the real service stack.

ORCHESTRATION ONLY. The engine here is a scripted stand-in (:class:`ScriptedEngine`) that
returns the same few tokens instantly, and the environment (:class:`LatencyEnv`) does no
work: it sleeps for a heavy-tailed simulated latency (lognormal per step, plus a few long
stragglers) at reset, at each of its turns and at EVAL. Everything between them is real:
the :class:`~rollout.orchestrator.Orchestrator` launching and collecting rollouts, the
:class:`~rollout.service.RolloutService` pools and timing, the TITO
:class:`~rollout.gateway.Gateway` rendering every turn through the real tiny tokenizer's
chat template, the sticky :class:`~rollout.router.Router`, and a sink (records counted,
or ``--sink shards``: a real ``ShardWriter`` on a temp folder).

Printed: rollouts/s, peak RSS and its growth per in-flight rollout, and the orchestration
overhead per action, as CPU time (the process's CPU seconds / actions) and as wall time
(active rollout time minus the simulated latency, per action; this includes waiting for
the event loop). ``concurrent`` is the peak number of rollouts inside INIT/RUN/EVAL at once
(not queued); ``ratio`` = concurrent / 1,000 (GLM-5's reported figure). Target: 10,000
concurrent within 2 GB RSS. Every rollout must end ``ok`` and be written (asserted).

    python benchmarks/bench_concurrency.py [--concurrent 10000] [--rollouts 20000] [--sink count]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import json
import math
import os
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import Any

import psutil

from envs.base import Env, EnvConfig, StepResult, Task, user
from rl.tokenizer import train_tokenizer
from rollout.engines.base import EngineStats, Generation, SamplingParams
from rollout.gateway import ChatRenderer, Gateway, GatewayConfig
from rollout.orchestrator import Orchestrator, OrchestratorConfig
from rollout.router import Router
from rollout.service import RolloutService, ServiceConfig
from storage.schema import to_table, validate


class ScriptedEngine:
    """BENCHMARK STAND-IN for an inference engine (``rollout.engines.base.Engine``): every
    request gets the same tokens back at once, so only orchestration is measured."""

    def __init__(self, token_ids: list[int], name: str = "scripted-0"):
        self.name = name
        self.version = 0
        self._token_ids = list(token_ids)
        self._logprobs = [-0.5] * len(token_ids)
        self._requests = 0

    async def generate(self, session_id: str, prompt_ids: list[int], params: SamplingParams) -> Generation:
        self._requests += 1
        n = min(len(self._token_ids), params.max_new_tokens)
        return Generation(
            token_ids=self._token_ids[:n],
            logprobs=self._logprobs[:n],
            versions=[self.version] * n,
            finish_reason="stop" if n == len(self._token_ids) else "length",
            prompt_tokens=len(prompt_ids),
            engine=self.name,
        )

    async def load_version(self, version: int, path: str) -> None:
        self.version = version

    def end_session(self, session_id: str) -> None:
        """Nothing is cached per session."""

    def stats(self) -> EngineStats:
        return EngineStats(requests=self._requests, decode_tokens=self._requests * len(self._token_ids))

    async def health(self) -> bool:
        return True

    async def close(self) -> None:
        """Nothing to release."""


class Latency:
    """Heavy-tailed simulated latency: lognormal around ``median_s`` (capped at ``cap`` times
    the median), and with probability ``straggler_p`` a straggler of ``straggler_s``.
    Keeps what it handed out per rollout (the asyncio task name is the rollout id)."""

    def __init__(
        self,
        median_s: float,
        sigma: float,
        straggler_p: float,
        straggler_s: float,
        seed: int,
        cap: float = 8.0,
    ):
        self.mu = math.log(median_s)
        self.sigma = sigma
        self.cap_s = cap * median_s
        self.straggler_p = straggler_p
        self.straggler_s = straggler_s
        self.rng = random.Random(seed)
        self.by_rollout: dict[str, float] = {}
        self.total_s = 0.0
        self.steps = 0

    def draw(self, rollout: str) -> float:
        if self.rng.random() < self.straggler_p:
            delay = self.straggler_s
        else:
            delay = min(self.rng.lognormvariate(self.mu, self.sigma), self.cap_s)
        self.total_s += delay
        self.by_rollout[rollout] = self.by_rollout.get(rollout, 0.0) + delay
        return delay


class LatencyEnv(Env):
    """A multi-turn environment that only waits: ``turns_per_episode`` steps, each a simulated
    tool call, plus a simulated sandbox start (reset) and scoring (evaluate)."""

    name = "latency"
    latency: Latency
    turns_per_episode = 3

    def __init__(self, config: EnvConfig | None = None):
        super().__init__(config)
        current = asyncio.current_task()
        self.rollout = current.get_name() if current is not None else ""

    @classmethod
    def tasks(cls, split, seed: int, n: int, config: EnvConfig | None = None) -> list[Task]:
        return [
            Task(env=cls.name, id=f"{split}-{seed}-{i}", prompt=f"Task {i}: wait for the tool.")
            for i in range(n)
        ]

    @classmethod
    def demonstrate(cls, task: Task, flawed: bool = False, seed: int = 0) -> list[str]:
        return ["done"] * cls.turns_per_episode

    async def reset(self, task: Task) -> list[dict[str, str]]:
        self._start(task)
        await asyncio.sleep(self.latency.draw(self.rollout))
        return user(task.prompt)

    async def step(self, action: str) -> StepResult:
        self.turns += 1
        self.latency.steps += 1
        await asyncio.sleep(self.latency.draw(self.rollout))
        done = self.turns >= self.turns_per_episode
        progress = self.turns / self.turns_per_episode
        return StepResult(user(f"tool output {self.turns}"), 0.0, done, progress)

    async def evaluate(self) -> float:
        await asyncio.sleep(self.latency.draw(self.rollout))
        return 1.0


class CountingSink:
    """Counts the records and tokens it is given; validates the first one against the schema."""

    def __init__(self):
        self.records = 0
        self.tokens = 0

    def write_many(self, records: Sequence[Mapping[str, Any]]) -> None:
        if self.records == 0:
            validate(to_table(list(records)))
        self.records += len(records)
        self.tokens += sum(len(record["tokens"]) for record in records)

    def flush(self) -> None:
        """Nothing is buffered."""


def rss_bytes() -> int:
    return psutil.Process().memory_info().rss


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) to the current RSS; False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int | None:
    """VmHWM of this process (kernel-tracked peak RSS) in bytes."""
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


async def watch(service: RolloutService, peak: dict[str, float], period_s: float = 0.05) -> None:
    """Sample the rollouts active in the service's stages and the RSS; keep the peaks."""
    while True:
        status = service.status()
        active = sum(status["active"].values())
        rss = rss_bytes()
        peak["rss"] = max(peak["rss"], rss)
        if active > peak["concurrent"]:
            peak["concurrent"] = active
            peak["rss_at_peak"] = rss
        await asyncio.sleep(period_s)


async def run(args: argparse.Namespace, sink, tokenizer) -> dict[str, Any]:
    stop_id = ChatRenderer(tokenizer).stop_ids()[-1]
    engine = ScriptedEngine([*tokenizer.encode("The answer is 42.", add_special_tokens=False), stop_id])
    gateway = Gateway(Router([engine]), tokenizer, GatewayConfig(max_context_tokens=1024))
    LatencyEnv.latency = Latency(args.median_s, args.sigma, args.straggler_p, args.straggler_s, args.seed)
    LatencyEnv.turns_per_episode = args.turns
    pools = args.concurrent
    service = RolloutService(
        gateway,
        lambda task: LatencyEnv(),
        ServiceConfig(
            init_workers=pools,
            run_workers=pools,
            eval_workers=pools,
            timeout_s=3600,
            max_turns=args.turns + 1,
        ),
    )
    tasks = {"latency": itertools.cycle(LatencyEnv.tasks("train", args.seed, 1000))}
    finished_at: list[float] = []
    overheads: list[
        float
    ] = []  # per finished rollout: active seconds beyond its simulated latency, per action

    def on_result(result) -> None:
        active = result.timing["init"] + result.timing["run"] + result.timing["eval"]
        simulated = LatencyEnv.latency.by_rollout.pop(result.rollout_id)
        finished_at.append(time.perf_counter())
        overheads.append((active - simulated) / max(result.turns, 1))

    orchestrator = Orchestrator(
        service,
        tasks,
        sink,
        OrchestratorConfig(mix={"latency": 1.0}, concurrency=args.concurrent, max_rollouts=args.rollouts),
        on_result=on_result,
    )
    baseline = rss_bytes()
    peak = {"concurrent": 0, "rss": baseline, "rss_at_peak": baseline}
    hwm_reset = reset_peak_rss()
    watcher = asyncio.create_task(watch(service, peak))
    cpu0, wall0 = time.process_time(), time.perf_counter()
    stats = await orchestrator.run()
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    watcher.cancel()
    hwm = peak_rss_bytes() if hwm_reset else None
    peak_rss = max(peak["rss"], hwm or 0)
    latency = LatencyEnv.latency
    actions = latency.steps
    low, high = len(finished_at) // 4, len(finished_at) * 3 // 4
    steady = (high - low) / (finished_at[high] - finished_at[low])
    return {
        "concurrent": int(peak["concurrent"]),
        "orchestrator_peak_in_flight": stats.peak_in_flight,
        "finished": stats.finished,
        "statuses": dict(stats.tasks["latency"].statuses),
        "written": stats.written,
        "actions": actions,
        "engine_requests": engine.stats().requests,
        "seconds": wall,
        "cpu_seconds": cpu,
        "rollouts_per_s": stats.finished / wall,
        "steady_rollouts_per_s": steady,
        "baseline_rss": baseline,
        "peak_rss": peak_rss,
        "rss_at_peak": peak["rss_at_peak"],
        "overhead_mean_ms": statistics.fmean(overheads) * 1000,
        "overhead_median_ms": statistics.median(overheads) * 1000,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrent", type=int, default=10_000, help="rollouts in flight at once")
    parser.add_argument("--rollouts", type=int, default=20_000, help="rollouts to finish in all")
    parser.add_argument("--turns", type=int, default=3, help="actions per rollout")
    parser.add_argument("--median-s", type=float, default=4.0, help="median simulated latency of a step")
    parser.add_argument("--sigma", type=float, default=0.6, help="lognormal sigma of the latency")
    parser.add_argument("--straggler-p", type=float, default=0.002, help="share of steps that straggle")
    parser.add_argument("--straggler-s", type=float, default=30.0, help="seconds a straggler takes")
    parser.add_argument("--sink", choices=["count", "shards"], default="count", help="where records go")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for name, value, least in (
        ("--concurrent", args.concurrent, 1),
        ("--rollouts", args.rollouts, 2),
        ("--turns", args.turns, 1),
    ):
        if value < least:
            parser.error(f"{name} must be at least {least}, not {value}")
    if args.median_s <= 0 or args.sigma < 0 or args.straggler_s < 0 or not 0 <= args.straggler_p <= 1:
        parser.error("--median-s must be > 0, --sigma and --straggler-s >= 0, --straggler-p in [0, 1]")

    tokenizer = train_tokenizer()
    folder = tempfile.mkdtemp(prefix="bench-concurrency-") if args.sink == "shards" else None
    try:
        if folder is not None:
            from storage.config import RunStore, StorageConfig
            from storage.shards import ShardWriter

            sink = ShardWriter(RunStore(StorageConfig(root=folder), "bench"), "worker-0", flush_records=2048)
        else:
            sink = CountingSink()
        gc.collect()
        result = asyncio.run(run(args, sink, tokenizer))
        if folder is not None:
            sink.close()
    finally:
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)

    # failed rollouts end early: counted, they would pass for a higher rate
    assert result["statuses"] == {"ok": args.rollouts} and result["written"] == args.rollouts, (
        f"{args.rollouts} rollouts asked for, statuses {result['statuses']}, {result['written']} records written"
    )
    concurrent = result["concurrent"]
    actions = result["actions"]
    growth = result["peak_rss"] - result["baseline_rss"]
    per_rollout_kb = growth / max(concurrent, 1) / 1024
    cpu_ms = result["cpu_seconds"] / max(actions, 1) * 1000
    print("ORCHESTRATION ONLY: scripted engine (fixed tokens, instant) + simulated-latency env")
    print(
        f"{result['finished']} rollouts ({actions} actions) in {result['seconds']:.1f} s: "
        f"{result['rollouts_per_s']:.0f} rollouts/s overall, {result['steady_rollouts_per_s']:.0f} rollouts/s "
        f"between the 25% and 75% finishes; statuses {result['statuses']}"
    )
    print(
        f"peak in flight: {concurrent} active in the service "
        f"({result['orchestrator_peak_in_flight']} launched by the orchestrator)"
    )
    print(
        f"RSS: {result['baseline_rss'] / 2**30:.3f} GB before, {result['peak_rss'] / 2**30:.3f} GB peak; "
        f"{per_rollout_kb:.1f} KB per in-flight rollout"
    )
    print(
        f"orchestration overhead per action: {cpu_ms:.3f} ms CPU; wall beyond the simulated latency "
        f"(includes event-loop waits) {result['overhead_median_ms']:.2f} ms median, "
        f"{result['overhead_mean_ms']:.2f} ms mean over rollouts"
    )
    print(
        json.dumps(
            {
                "bench": "concurrency",
                "orchestration_only": True,
                "concurrent": concurrent,
                "rss_gb": round(result["peak_rss"] / 2**30, 3),
                "ratio": round(concurrent / 1000, 2),
                "baseline": "GLM-5's reported 1,000 concurrent rollouts",
                "rollouts": result["finished"],
                "rollouts_per_s": round(result["rollouts_per_s"], 1),
                "baseline_rss_gb": round(result["baseline_rss"] / 2**30, 3),
                "rss_kb_per_rollout": round(per_rollout_kb, 2),
                "overhead_cpu_ms_per_action": round(cpu_ms, 3),
                "overhead_wall_ms_per_action_median": round(result["overhead_median_ms"], 3),
                "overhead_wall_ms_per_action_mean": round(result["overhead_mean_ms"], 3),
                "steady_rollouts_per_s": round(result["steady_rollouts_per_s"], 1),
                "seconds": round(result["seconds"], 1),
                "sink": args.sink,
                "cpus": os.cpu_count(),
            }
        )
    )


if __name__ == "__main__":
    main()
