"""Action-level scheduling vs static per-trajectory reservation (ARL-Tangram's claim).

Three measurements, side by side in one run:

1. decision time of ``rollout.scheduler.decide`` on 300 queued actions, the rest of the
   512-core pool held by running actions;
2. a replayed bursty agent workload (``rollout.simcluster.ActionWorkload`` defaults: 4 RL
   steps of 128 trajectories, 4-24 turns of ~8 s LLM generation each followed by a tool call
   (70 %, ~1 s on one core) or a test run (30 %, T_1 ~40 s, Amdahl serial fraction 0.05-0.3,
   up to 16 cores), then a reward call on one of 10 reward services (Zipf popularity, ~3 s,
   4 s to load a parked service)) on a simulated cluster of 256 cores and 10 reward GPUs.
   Static: 4 cores reserved per trajectory for its life (the knee of a median test run:
   E(4) = 0.66 at serial fraction 0.175), one GPU pinned per service; the same baseline
   with 1, 2, 8 and 16 cores is printed beside it, and ``ratio_vs_best_static`` compares
   ours with the best of those sizes chosen in hindsight.
   Ours: one pool, per-action grants, elastic test runs, pooled GPUs with LRU residency.
   Then the smallest share (bisected, in percent) of those resources on which ours still
   matches the baseline's average action completion time, beside the smallest share on
   which the best static size matches it (the saving against a baseline that was also
   allowed to shrink). At 128, 256 and 512 cores it prints a lower bound on any policy's
   average: every action starting on arrival at its best parallelism with its service
   resident. ``static / bound`` is the most any scheduler could reach against the
   baseline at that size;
3. the same two policies on this machine's real cores, with real processes pinned by
   ``CpuManager`` (a short run; on a shared 2-core machine it measures process start-up and
   the neighbours' load as much as the policy).

Worst single ``decide`` times include the process being preempted by other work on the
machine; the medians are the decision's own cost.

Last line: JSON with "ratio" = static average action completion time / ours (simulated).
"""

import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time

from rollout.resources import CpuManager
from rollout.scheduler import (
    ActionPolicy,
    ActionScheduler,
    ResourceRequest,
    Running,
    StaticReservation,
    amdahl_efficiency,
    decide,
)
from rollout.simcluster import ActionWorkload, action_trajectories, run_ours, run_static

CORES = 256
GPUS_PER_SERVICE = 1
CORES_PER_TRAJECTORY = 4
STATIC_SIZES = (1, 2, 4, 8, 16)
POOL_SIZES = (128, 256, 512)


def decision_time_us(free_cores: float, n_queue: int = 300, repeats: int = 200) -> tuple[float, float]:
    """Median and worst ``decide`` time (microseconds) on ``n_queue`` queued actions, on a
    512-core pool whose other cores are held by running actions (tool calls on 1 core, test
    runs on 4 or 8): the prices and the timeline read every one of them."""
    rng = random.Random(0)
    policy = ActionPolicy({"cpu": 512, "gpu": 10})
    queue = []
    for _ in range(n_queue):
        if rng.random() < 0.3:
            req = ResourceRequest(
                elastic="cpu",
                max_units=16,
                duration=rng.lognormvariate(3.7, 0.8),
                efficiency=amdahl_efficiency(rng.uniform(0.05, 0.3), 16),
            )
        elif rng.random() < 0.9:
            req = ResourceRequest(demand={"cpu": 1}, duration=rng.lognormvariate(0, 0.8))
        else:
            req = ResourceRequest(demand={"gpu": 1}, duration=3.0)
        queue.append(policy._pending(req, 0.0))
    running, held = [], 0.0
    while held < 512 - free_cores:
        cores = min(rng.choices([1.0, 4.0, 8.0], weights=[7, 2, 1])[0], 512 - free_cores - held)
        running.append(Running(rng.uniform(0, 30), [cores, 0.0]))
        held += cores
    reserve = [free_cores / 2, 0.0]  # half the free cores surplus: both spread passes run
    samples = []
    for _ in range(repeats):
        t = time.perf_counter()
        decide(queue, [free_cores, 1.0], running, 0.0, reserve=reserve)
        samples.append(time.perf_counter() - t)
    return statistics.median(samples) * 1e6, max(samples) * 1e6


def _kinds(run) -> str:
    """Mean completion time of each action kind, split into queueing + execution."""
    parts = []
    for kind, acts in run.by_kind.items():
        wait = statistics.mean(run.waits_by_kind[kind])
        parts.append(f"{kind} {statistics.mean(acts):.2f} ({wait:.2f} queued)")
    return ", ".join(parts)


def lower_bound_act(w: ActionWorkload) -> float:
    """Mean action completion time if every action started on arrival at its best parallelism.

    No policy beats it on any pool: nothing queues, a test run takes its fastest ``T(m)``
    (true ``T_1``), and a reward call finds its service resident.
    """
    best = []
    for trajectory in action_trajectories(w):
        for action in trajectory.actions:
            request = action.request
            units = range(1, request.max_units + 1) if request.elastic else (1,)
            best.append(min(request.duration_on(m, action.true_t1) for m in units))
    return statistics.mean(best)


def _equal_act_share(w: ActionWorkload, target_act: float) -> tuple[int, int, int] | None:
    """Smallest share (percent) of the cluster's cores and GPUs on which ours matches ``target_act``."""

    def fits(pct: int) -> tuple[bool, int, int]:
        cores = max(CORES * pct // 100, w.test_max_units)
        gpus = max(round(GPUS_PER_SERVICE * w.services * pct / 100), 1)
        return run_ours(w, cores, gpus).mean_act <= target_act, cores, gpus

    return _bisect_share(fits)


def _static_equal_act_share(w: ActionWorkload, target_act: float) -> tuple[int, int, int] | None:
    """Smallest share (percent) of the cores on which some static size matches ``target_act``.

    Static pins one GPU per service, so its GPUs stay; (percent, cores, cores per trajectory).
    """
    best = None
    for size in STATIC_SIZES:

        def fits(pct: int, size: int = size) -> tuple[bool, int, int]:
            cores = max(CORES * pct // 100, size)
            return run_static(w, cores, size, GPUS_PER_SERVICE).mean_act <= target_act, cores, size

        share = _bisect_share(fits)
        if share is not None and (best is None or share[0] < best[0]):
            best = share
    return best


def _bisect_share(fits) -> tuple[int, int, int] | None:
    """Smallest percent in 1..100 where ``fits(percent)[0]`` holds (assumed monotone), with its figures."""
    if not fits(100)[0]:
        return None
    lo, hi = 0, 100  # fits(hi) holds; fits(lo) is assumed not to
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid)[0]:
            hi = mid
        else:
            lo = mid
    _, a, b = fits(hi)
    return hi, a, b


def simulated() -> dict:
    w = ActionWorkload()
    gpus_full = GPUS_PER_SERVICE * w.services
    statics = {c: run_static(w, CORES, c, GPUS_PER_SERVICE) for c in STATIC_SIZES}
    static = statics[CORES_PER_TRAJECTORY]
    best_size = min(statics, key=lambda c: statics[c].mean_act)
    ours = run_ours(w, CORES, gpus_full)
    equal_share = _equal_act_share(w, static.mean_act)
    static_share = _static_equal_act_share(w, static.mean_act)
    bound = lower_bound_act(w)
    sweep = {}
    for cores in POOL_SIZES:
        s = {c: run_static(w, cores, c, GPUS_PER_SERVICE).mean_act for c in STATIC_SIZES}
        o = run_ours(w, cores, gpus_full).mean_act
        sweep[cores] = (s[CORES_PER_TRAJECTORY], min(s.values()), o)

    print(f"simulated cluster: {CORES} cores, {gpus_full} GPUs, {len(static.completion_times)} actions")
    print("  mean action completion time (s) by kind: total (queueing part)")
    for c, run in statics.items():
        mark = "  <- baseline" if c == CORES_PER_TRAJECTORY else ""
        print(f"  static {c:2d} cores/trajectory  {run.mean_act:7.2f}  {_kinds(run)}{mark}")
    print(
        f"  ours (per action)          {ours.mean_act:7.2f}  {_kinds(ours)}; service loads {ours.service_loads}"
    )
    print(
        f"  ratio static/ours: {static.mean_act / ours.mean_act:.2f} "
        f"(vs the best static size in hindsight, {best_size} cores: {statics[best_size].mean_act / ours.mean_act:.2f})"
    )
    print(
        f"  by pool size, lower bound on any policy {bound:.2f} s (no queueing, best parallelism, resident):"
    )
    for cores, (base, best_static, o) in sweep.items():
        print(
            f"  {cores:4d} cores: static {base:6.2f}  best static {best_static:6.2f}  ours {o:5.2f}  "
            f"static/ours {base / o:.2f}  static/bound {base / bound:.2f} (the most any policy reaches)  "
            f"ours/bound {o / bound:.2f}"
        )
    if equal_share:
        print(
            f"  ours matches the baseline's ACT on {equal_share[0]}% of the resources: "
            f"{equal_share[1]} cores, {equal_share[2]} GPUs"
        )
    if static_share:
        print(
            f"  the best static size matches it on {static_share[0]}% of the cores: "
            f"{static_share[1]} cores at {static_share[2]} per trajectory (and its {gpus_full} pinned GPUs)"
        )
    return {
        "static_act_s": round(static.mean_act, 3),
        "ours_act_s": round(ours.mean_act, 3),
        "ratio": round(static.mean_act / ours.mean_act, 3),
        "best_static_cores_per_trajectory": best_size,
        "ratio_vs_best_static": round(statics[best_size].mean_act / ours.mean_act, 3),
        "resources_at_equal_act_pct": equal_share[0] if equal_share else None,
        "resource_saving_pct": 100 - equal_share[0] if equal_share else None,
        "static_best_size_cores_at_equal_act_pct": static_share[0] if static_share else None,
        "lower_bound_act_s": round(bound, 3),
        "ratio_by_pool_cores": {c: round(base / o, 3) for c, (base, _, o) in sweep.items()},
        "ratio_ceiling_by_pool_cores": {c: round(base / bound, 3) for c, (base, _, _) in sweep.items()},
        "ours_over_bound_by_pool_cores": {c: round(o / bound, 3) for c, (_, _, o) in sweep.items()},
    }


WORK = "import sys\nn=int(sys.argv[1])\ns=0\nfor i in range(n): s+=i*i\n"


async def real_action(sched, cpu, request: ResourceRequest, work: int) -> float:
    """Run ``work`` loop iterations split over the granted cores, each worker pinned to its core."""
    t0 = time.monotonic()
    async with sched.run(request) as grant:
        procs = []
        for core in sorted(grant.cores):
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-c", WORK, str(work // len(grant.cores))
            )
            cpu.bind(proc.pid, {core})
            procs.append(proc)
        await asyncio.gather(*(p.wait() for p in procs))
    return time.monotonic() - t0


async def real_trajectory(sched, cpu, tid: str, rng: random.Random, work: int, acts: list[float]) -> None:
    for turn in range(3):
        await asyncio.sleep(rng.uniform(0.05, 0.3))
        if turn == 1:
            req = ResourceRequest(
                elastic="cpu",
                max_units=2,
                duration=1.0,
                efficiency=(1.0, 0.95),
                trajectory_id=tid,
                kind="test",
            )
            acts.append(await real_action(sched, cpu, req, work * 4))
        else:
            req = ResourceRequest(demand={"cpu": 1}, duration=0.25, trajectory_id=tid, kind="tool")
            acts.append(await real_action(sched, cpu, req, work))
    sched.end_trajectory(tid)


async def _real_run(sched, cpu, work: int, acts: list[float]) -> None:
    rng = random.Random(1)
    await asyncio.gather(*(real_trajectory(sched, cpu, f"t{i}", rng, work, acts) for i in range(6)))


def real_cores() -> dict:
    cores = sorted(os.sched_getaffinity(0))[:2]
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", WORK, "2000000"], check=True)
    work = int(2_000_000 * 0.25 / (time.perf_counter() - t))
    results = {}
    for name in ("static", "ours"):
        cpu = CpuManager(cores)
        if name == "static":
            sched = StaticReservation({"cpu": len(cores)}, {"cpu": 1}, cpu=cpu)
        else:
            sched = ActionScheduler({"cpu": len(cores)}, cpu=cpu)
        acts: list[float] = []
        asyncio.run(_real_run(sched, cpu, work, acts))
        results[name] = statistics.mean(acts)
    print(f"real cores {cores}: static mean ACT {results['static']:.2f} s, ours {results['ours']:.2f} s")
    return {
        "real_static_act_s": round(results["static"], 3),
        "real_ours_act_s": round(results["ours"], 3),
        "real_ratio": round(results["static"] / results["ours"], 3),
    }


def main() -> None:
    timings = {free: decision_time_us(free_cores=free) for free in (8, 64, 256)}
    for free, (median, worst) in timings.items():
        print(
            f"decide() on 300 queued actions, {free} free cores: median {median:.0f} us, worst {worst:.0f} us"
        )
    worst_median = max(median for median, _ in timings.values())
    sim = simulated()
    real = real_cores()
    print(
        json.dumps(
            {
                "bench": "scheduler",
                **sim,
                **{
                    f"decide_us_300_queued_{free}_free": round(median)
                    for free, (median, _) in timings.items()
                },
                "decide_us_300_queued_worst_case_median": round(worst_median),
                "decide_us_300_queued_worst_single": round(max(worst for _, worst in timings.values())),
                **real,
            }
        )
    )


if __name__ == "__main__":
    main()
