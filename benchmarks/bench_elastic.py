"""Elastic rollout/training capacity vs the best fixed split (QwenGyre's claim), simulated.

Headline: the continuous pipeline (``CONTINUOUS``). The rollout flow is long-lived and the
trainer consumes continuously, so the run is not one batch: prompts keep coming and the
task mix cycles. Each parameter and why:

- 16 capacity units, 8 concurrent sessions per rollout replica: a 16-replica cluster
  whose engines hold 8 long-context agent sessions each (KV-cache bound).
- A cycle = a long-horizon phase, then a short-task phase, in prompt order (the dataset /
  curriculum order the orchestrator launches in), repeated. Long phase: 320 prompts,
  session median 900 s, lognormal sigma 0.7 (p99 about 4,600 s: stragglers 5x the median),
  40 unit-seconds of training each (long contexts). Short phase: 1,600 prompts, median
  60 s, sigma 0.5, 20 unit-seconds each: the rollout side finishes fast, the trainer is
  the bottleneck (the training burst). Each phase takes roughly an hour of the cluster, so a
  long phase's straggler tail (thousands of seconds) overlaps the short phase's work.
- 4 cycles: the run lasts until 4 cycles' worth of trajectories (7,680) are trained, while
  prompts keep coming, so no end-of-batch straggler fixes the time; throughput is
  trained trajectories per second over that horizon.
- Staleness as our trainer defines it (``rl.config.SAOConfig`` defaults): 64 trajectories
  per optimizer step, a weight version every ``publish_every=4`` steps (256 trajectories),
  and a trajectory dropped when its first token is more than ``max_staleness=4`` versions
  older than the trainer (1,024 trajectories trained meanwhile). Dropped trajectories
  count for nothing.
- Backpressure as the orchestrator does it: launching stops while 256 trajectories (one
  version, 64 shards of 4) wait for the trainer, which leaves 3 versions (768 trained
  trajectories) of the staleness budget for a session's own run time. The orchestrator
  keeps 128 sessions launched (its ``concurrency``: every session slot of the cluster),
  those without a slot waiting in the engine queue the controller reads.
- 60 s for a unit to change sides (load weights, rebuild engine or optimizer state); a
  controller decision every 30 s.
- Sessions are turns of 30 s (a generation and its tool step). A draining replica's
  sessions move at their next turn boundary to accepting replicas with a free slot
  (``ElasticConfig.migrate_at_turns``, the router's ``migrate_on_drain``); the new replica
  re-prefills the session's history (2,000 prompt tokens plus 100 tokens per second of
  turns: about 92k tokens for a 900 s session) at 10,000 tokens/s, holding up every session
  on it meanwhile. Printed: migrations, replica-seconds of re-prefill and the session-seconds
  of holdup they caused, and the controller without migration (sessions run to their end on
  a draining replica) for comparison. A fixed split never drains, so it never migrates
  (``migrations_fixed``, checked): migration cannot help it.

Second figure, a stress case: the same two phases as one finite batch (320 long, then
1,600 short) run to its makespan, with an admission bound of 64 trajectories in flight or
waiting for the trainer (the previous headline). There no policy can beat 1.026: the bound caps rollout
at 8 of 16 units and the last straggler fixes the end.

For each: every fixed split 1..15 is run and the elastic controller starts from the best
one. The ceiling is the best fixed split's time over a lower bound no split can beat
(continuous: ``continuous_lower_bound``, total work over capacity; finite:
``makespan_lower_bound``). Unit-seconds left idle by cause, fixed vs elastic, and where all
of the elastic run's unit-seconds went (``unit_s_elastic``, summing to units x its time);
``dropped_rollout_replica_s_*``: replica-seconds of rollout spent on the sessions whose
trajectories were then dropped as stale (full slots: session-seconds over
``sessions_per_replica``).

Last line: JSON with "ratio" = elastic trained trajectories/s / best fixed split's, on the
continuous pipeline; the finite batch's figures under "finite_batch". ``--seed N`` draws the
same workloads' session lengths from another seed.
"""

import argparse
import json

from rollout.elastic import ElasticConfig, ElasticController
from rollout.elastic_sim import (
    ElasticWorkload,
    continuous_lower_bound,
    makespan_lower_bound,
    simulate_elastic,
)

CONTINUOUS = ElasticWorkload(
    units=16,
    sessions_per_replica=8,
    long_sessions=320,
    long_median_s=900.0,
    long_sigma=0.7,
    long_train_s=40.0,
    short_sessions=1600,
    short_median_s=60.0,
    short_sigma=0.5,
    short_train_s=20.0,
    cycles=4,
    max_ahead=None,
    batch_size=64,
    publish_every=4,
    max_staleness=4,
    max_backlog=256,
    concurrency=128,
    switch_s=60.0,
    tick_s=30.0,
    seed=0,
)
FINITE = ElasticWorkload(max_ahead=64)


def compare(w: ElasticWorkload) -> dict:
    fixed = {r: simulate_elastic(w, r) for r in range(1, w.units)}
    migrations_fixed = sum(len(run.migrations) for run in fixed.values())
    if migrations_fixed:
        raise AssertionError(f"a fixed split migrated {migrations_fixed} sessions: it never drains")
    best_split = max(fixed, key=lambda r: fixed[r].throughput)
    best = fixed[best_split]
    names = [f"u{i}" for i in range(w.units)]
    controller = ElasticController.create(names[:best_split], names[best_split:])
    run = simulate_elastic(w, best_split, controller)
    staying = ElasticController.create(
        names[:best_split], names[best_split:], ElasticConfig(migrate_at_turns=False)
    )
    no_migration = simulate_elastic(w, best_split, staying)
    bound = continuous_lower_bound(w) if w.cycles else makespan_lower_bound(w)
    return {
        "best_fixed_rollout_units": best_split,
        "best_fixed_traj_per_s": round(best.throughput, 4),
        "elastic_traj_per_s": round(run.throughput, 4),
        "ratio": round(run.throughput / best.throughput, 3),
        "ceiling": round(best.makespan / bound, 3),
        "best_fixed_s": round(best.makespan),
        "elastic_s": round(run.makespan),
        "lower_bound_s": round(bound),
        "dropped_stale_fixed": best.dropped,
        "dropped_stale_elastic": run.dropped,
        "dropped_rollout_replica_s_fixed": round(best.dropped_session_s / w.sessions_per_replica),
        "dropped_rollout_replica_s_elastic": round(run.dropped_session_s / w.sessions_per_replica),
        "moves": run.moves,
        "migrations": len(run.migrations),
        "migrations_fixed": migrations_fixed,
        "reprefill_replica_s": round(run.reprefill_replica_s),
        "reprefill_holdup_session_s": round(run.reprefill_slot_s),
        "interrupted_sessions": run.interrupted_sessions + no_migration.interrupted_sessions,
        "no_migration_traj_per_s": round(no_migration.throughput, 4),
        "no_migration_ratio": round(no_migration.throughput / best.throughput, 3),
        "idle_unit_s_fixed": {k: round(v) for k, v in best.idle_unit_seconds().items()},
        "idle_unit_s_elastic": {k: round(v) for k, v in run.idle_unit_seconds().items()},
        "idle_unit_s_no_migration": {k: round(v) for k, v in no_migration.idle_unit_seconds().items()},
        "unit_s_elastic": {k: round(v) for k, v in run.unit_seconds.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0, help="Seed of the workloads' session lengths.")
    seed = parser.parse_args().seed
    continuous = CONTINUOUS.model_copy(update={"seed": seed})
    finite_w = FINITE.model_copy(update={"seed": seed})
    headline = compare(continuous)
    print(f"continuous, {continuous.cycles} cycles, seed {seed}: {headline}")
    finite = compare(finite_w)
    print(f"finite batch, admission bound {finite_w.max_ahead}, seed {seed}: {finite}")
    print(
        json.dumps(
            {"bench": "elastic", "workload": "continuous", "seed": seed, **headline, "finite_batch": finite}
        )
    )


if __name__ == "__main__":
    main()
