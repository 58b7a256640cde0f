"""Elastic rollout/training capacity vs the best fixed split (QwenGyre's claim), simulated.

Workload (``rollout.elastic_sim.ElasticWorkload`` defaults): 16 capacity units, 8 sessions
per rollout replica, a staleness bound of 64 trajectories generated-or-in-flight but not
trained; phase 1: 320 long-horizon sessions (median 900 s, lognormal sigma 0.7: long
stragglers), 40 unit-seconds of training each; phase 2: 1600 short sessions (median 60 s),
20 unit-seconds each (a training burst). A unit changing sides costs 60 s. Every fixed split
1..15 is run; the elastic controller starts from the best one. Also printed: the same at
looser staleness bounds.

Last line: JSON with "ratio" = elastic trained trajectories/s / best fixed split's.
"""

import json

from rollout.elastic import ElasticController
from rollout.elastic_sim import ElasticWorkload, simulate_elastic


def compare(w: ElasticWorkload) -> dict:
    fixed = {r: simulate_elastic(w, r).throughput for r in range(1, w.units)}
    best_split = max(fixed, key=fixed.get)
    names = [f"u{i}" for i in range(w.units)]
    controller = ElasticController.create(names[:best_split], names[best_split:])
    run = simulate_elastic(w, best_split, controller)
    return {
        "best_fixed_rollout_units": best_split,
        "best_fixed_traj_per_s": round(fixed[best_split], 4),
        "elastic_traj_per_s": round(run.throughput, 4),
        "ratio": round(run.throughput / fixed[best_split], 3),
        "moves": run.moves,
        "interrupted_sessions": run.interrupted_sessions,
    }


def main() -> None:
    w = ElasticWorkload()
    headline = compare(w)
    print(f"staleness bound {w.max_ahead}: {headline}")
    looser = {}
    for bound in (128, 256):
        looser[bound] = compare(w.model_copy(update={"max_ahead": bound}))["ratio"]
        print(f"staleness bound {bound}: ratio {looser[bound]}")
    print(json.dumps({"bench": "elastic", **headline, "ratio_by_staleness_bound": looser}))


if __name__ == "__main__":
    main()
