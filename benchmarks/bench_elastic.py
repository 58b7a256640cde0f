"""Elastic rollout/training capacity vs the best fixed split (QwenGyre's claim), simulated.

Workload (``rollout.elastic_sim.ElasticWorkload`` defaults): 16 capacity units, 8 sessions
per rollout replica, a staleness bound of 64 trajectories generated-or-in-flight but not
trained; phase 1: 320 long-horizon sessions (median 900 s, lognormal sigma 0.7: long
stragglers), 40 unit-seconds of training each; phase 2: 1600 short sessions (median 60 s),
20 unit-seconds each (a training burst). A unit changing sides costs 60 s. Every fixed split
1..15 is run; the elastic controller starts from the best one. Also printed: the same at
looser staleness bounds.

For each run: the ceiling (best fixed makespan / ``makespan_lower_bound``, the most any
allocation could gain) and the unit-seconds left idle by cause, fixed vs elastic.

Last line: JSON with "ratio" = elastic trained trajectories/s / best fixed split's.
"""

import json

from rollout.elastic import ElasticController
from rollout.elastic_sim import ElasticWorkload, makespan_lower_bound, simulate_elastic


def compare(w: ElasticWorkload) -> dict:
    fixed = {r: simulate_elastic(w, r) for r in range(1, w.units)}
    best_split = max(fixed, key=lambda r: fixed[r].throughput)
    best = fixed[best_split]
    names = [f"u{i}" for i in range(w.units)]
    controller = ElasticController.create(names[:best_split], names[best_split:])
    run = simulate_elastic(w, best_split, controller)
    bound = makespan_lower_bound(w)
    return {
        "best_fixed_rollout_units": best_split,
        "best_fixed_traj_per_s": round(best.throughput, 4),
        "elastic_traj_per_s": round(run.throughput, 4),
        "ratio": round(run.throughput / best.throughput, 3),
        "ceiling": round(best.makespan / bound, 3),
        "best_fixed_makespan_s": round(best.makespan),
        "elastic_makespan_s": round(run.makespan),
        "lower_bound_makespan_s": round(bound),
        "moves": run.moves,
        "interrupted_sessions": run.interrupted_sessions,
        "idle_unit_s_fixed": {k: round(v) for k, v in best.idle_unit_seconds().items()},
        "idle_unit_s_elastic": {k: round(v) for k, v in run.idle_unit_seconds().items()},
    }


def main() -> None:
    w = ElasticWorkload()
    headline = compare(w)
    print(f"staleness bound {w.max_ahead}: {headline}")
    looser = {}
    for bound in (128, 256):
        result = compare(w.model_copy(update={"max_ahead": bound}))
        looser[bound] = {"ratio": result["ratio"], "ceiling": result["ceiling"]}
        print(f"staleness bound {bound}: {result}")
    print(json.dumps({"bench": "elastic", **headline, "by_staleness_bound": looser}))


if __name__ == "__main__":
    main()
