"""Does a long pipeline flow grow in memory? RSS of one process running the ``pipeline``
flow (Prefect ephemeral mode, rollout + process + train at once on the tiny model) for
``--minutes``, sampled every few seconds.

Baseline: the RSS once the run has warmed up, the first sample a quarter of the RL time
after RL started. RL starts right after the evaluation of the starting version (the flow
sets its deadline then), so its start is taken from the ``evals`` row that evaluation
writes (the row's time is set just before its commit; warm start and evaluation come
before it). ``ratio`` = RSS at the end / that baseline; a flow whose task states, buffers
or caches grow without bound shows a ratio well above 1 and a positive slope.

    python benchmarks/bench_flow_memory.py --minutes 10
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="RL time of the pipeline run.")
    parser.add_argument("--every", type=float, default=5.0, help="Seconds between RSS samples.")
    args = parser.parse_args()
    # a warm baseline and a later sample need --every at most a quarter of the RL time
    if args.minutes <= 0 or not 0 < args.every <= args.minutes * 15:
        parser.error("--minutes must be above 0 and --every above 0 and at most --minutes * 15 s")
    # the run's data (about a GB for 10 minutes) and Prefect's home go when the run ends
    with (
        tempfile.TemporaryDirectory(prefix="treadle-bench-prefect-", ignore_cleanup_errors=True) as home,
        tempfile.TemporaryDirectory(prefix="treadle-bench-memory-", ignore_cleanup_errors=True) as root,
    ):
        os.environ.setdefault("PREFECT_HOME", home)
        from flows.cli_args import set_prefect_defaults

        set_prefect_defaults()
        measure(args, root)


def measure(args: argparse.Namespace, root: str) -> None:
    """Run the pipeline on ``root`` and print its RSS curve and the JSON line."""
    from flows.config import load_config
    from flows.pipeline import pipeline
    from storage.tables import Tables
    from tasks.common import run_store

    seconds = args.minutes * 60
    config = load_config(
        "configs/tiny.yaml",
        {"run_id": "memory", "storage": {"root": root}, "stop": {"max_seconds": seconds}},
    )
    samples: list[tuple[float, float]] = []
    done = threading.Event()
    started, wall_started = time.monotonic(), time.time()

    def sample() -> None:
        while not done.wait(args.every):
            samples.append((time.monotonic() - started, rss_mb()))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    result = pipeline(config)
    done.set()
    sampler.join()

    evals = Tables(run_store(config)).read("evals").to_pylist()
    before = [row["time"].timestamp() for row in evals if row["version"] == result["before"]["version"]]
    rl_start = max(before) - wall_started
    warm_at = rl_start + seconds / 4
    warm = [r for t, r in samples if t >= warm_at]
    baseline, final, peak = warm[0], warm[-1], max(warm)
    times = [t for t, _ in samples if t >= warm_at]
    mean_t, mean_r = sum(times) / len(times), sum(warm) / len(warm)
    slope = sum((t - mean_t) * (r - mean_r) for t, r in zip(times, warm, strict=True)) / max(
        sum((t - mean_t) ** 2 for t in times), 1e-9
    )
    print("t_s\trss_mb")
    for t, r in samples[:: max(1, len(samples) // 40)]:
        print(f"{t:.0f}\t{r:.0f}")
    print(f"rollouts finished: {result['rollouts']['finished']}, policy steps: {result['trained']['steps']}")
    print(
        json.dumps(
            {
                "bench": "flow_memory",
                "ratio": round(final / baseline, 3),
                "rl_minutes": args.minutes,
                "rl_start_s": round(rl_start, 1),
                "rss_warm_mb": round(baseline, 1),
                "rss_final_mb": round(final, 1),
                "rss_peak_mb": round(peak, 1),
                "slope_mb_per_hour": round(slope * 3600, 1),
                "rollouts": result["rollouts"]["finished"],
                "policy_steps": result["trained"]["steps"],
            }
        )
    )


if __name__ == "__main__":
    main()
