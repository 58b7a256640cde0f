"""The trainer-side elastic planner over real unit names: the controller's decisions as plans,
handover only once a worker confirms its drained replica empty, never a worker's last
accepting replica."""

from __future__ import annotations

import pytest

import rollout.elastic as elastic_module
from rollout.elastic import ElasticConfig, PolicyInputs
from rollout.elastic_plan import TRAINER_UNIT, ElasticPlanner
from storage.status import RolloutStatus

SATURATED = PolicyInputs(unconsumed_shards=5, engine_queue_depth=0, trainer_idle=0.0)
DRY = PolicyInputs(unconsumed_shards=0, engine_queue_depth=8, trainer_idle=1.0)
CONFIG = ElasticConfig(sessions_per_replica=8, headroom_slots=2, cooldown_s=0)


def status(worker, sessions, draining=(), plan_time=None, running=True):
    return RolloutStatus(
        worker=worker,
        time=0.0,
        engine_queue_depth=0,
        live_sessions=sum(sessions.values()),
        running=running,
        replica_sessions=sessions,
        draining=list(draining),
        plan_time=plan_time,
    )


def roles(plan):
    return plan.accepting, plan.draining, plan.train


def test_a_saturated_trainer_drains_the_least_loaded_replica_and_takes_it_once_confirmed_empty():
    planner = ElasticPlanner(CONFIG)
    record = planner.decide([status("w0", {"r0": 5, "r1": 1})], SATURATED, now=10.0)
    assert roles(planner.last_plan) == (["w0/r0"], ["w0/r1"], [])
    assert [(m["unit"], m["target"]) for m in record["elastic"]["decided"]] == [("w0/r1", "draining")]
    assert record["elastic"]["roles"] == {TRAINER_UNIT: "train", "w0/r0": "rollout", "w0/r1": "draining"}
    # empty, but the worker has not applied the drain yet: not handed over
    planner.decide([status("w0", {"r0": 6, "r1": 0})], SATURATED, now=11.0)
    assert roles(planner.last_plan) == (["w0/r0"], ["w0/r1"], [])
    # applied an older plan only: still not
    planner.decide([status("w0", {"r0": 6, "r1": 0}, draining=["r1"], plan_time=9.0)], SATURATED, now=12.0)
    assert planner.last_plan.train == []
    # applied, draining, but a session is still pinned (a generation in flight)
    planner.decide([status("w0", {"r0": 6, "r1": 1}, draining=["r1"], plan_time=10.0)], SATURATED, now=13.0)
    assert planner.last_plan.train == []
    record = planner.decide(
        [status("w0", {"r0": 7, "r1": 0}, draining=["r1"], plan_time=11.0)], SATURATED, 14.0
    )
    assert roles(planner.last_plan) == (["w0/r0"], [], ["w0/r1"])
    assert [(m["unit"], m["source"], m["target"]) for m in record["elastic"]["decided"]] == [
        ("w0/r1", "draining", "train")
    ]


def test_an_idle_replica_drains_too_and_goes_to_training_only_once_its_worker_confirms():
    """A status seconds old shows r1 empty, but the worker's router pins new sessions to it
    until it applies the plan: r1 drains, and is not training's while sessions are on it."""
    planner = ElasticPlanner(CONFIG)
    record = planner.decide([status("w0", {"r0": 5, "r1": 0})], SATURATED, now=10.0)
    assert roles(planner.last_plan) == (["w0/r0"], ["w0/r1"], [])
    assert [(m["unit"], m["target"]) for m in record["elastic"]["decided"]] == [("w0/r1", "draining")]
    planner.decide([status("w0", {"r0": 5, "r1": 3})], SATURATED, now=11.0)
    assert roles(planner.last_plan) == (["w0/r0"], ["w0/r1"], [])
    assert planner.controller.units["w0/r1"].live_sessions == 3
    planner.decide([status("w0", {"r0": 8, "r1": 0}, draining=["r1"], plan_time=10.0)], SATURATED, now=12.0)
    assert roles(planner.last_plan) == (["w0/r0"], [], ["w0/r1"])


def test_a_replica_in_training_whose_worker_reports_sessions_drains_again():
    planner = ElasticPlanner(CONFIG)
    planner.decide([status("w0", {"r0": 5, "r1": 1})], SATURATED, now=10.0)
    planner.decide([status("w0", {"r0": 6, "r1": 0}, draining=["r1"], plan_time=10.0)], SATURATED, now=11.0)
    assert planner.last_plan.train == ["w0/r1"]
    # the worker took sessions on it (it ignored a stale plan): not training's until empty again
    record = planner.decide([status("w0", {"r0": 6, "r1": 2})], SATURATED, now=12.0)
    assert roles(planner.last_plan) == (["w0/r0"], ["w0/r1"], [])
    assert [(m["unit"], m["source"], m["target"]) for m in record["elastic"]["decided"]] == [
        ("w0/r1", "train", "draining")
    ]
    # empty under the plan it drained by before: not confirmed; under the new one: handed over
    planner.decide([status("w0", {"r0": 8, "r1": 0}, draining=["r1"], plan_time=11.0)], SATURATED, now=13.0)
    assert planner.last_plan.train == []
    planner.decide([status("w0", {"r0": 8, "r1": 0}, draining=["r1"], plan_time=12.0)], SATURATED, now=14.0)
    assert roles(planner.last_plan) == (["w0/r0"], [], ["w0/r1"])


def test_a_replica_in_training_whose_worker_takes_sessions_on_it_again_drains_again():
    """r0 goes down and the worker's router reopens r1, its last replica in service: new
    sessions go to r1, so it is not training's, though none is pinned there yet."""
    planner = ElasticPlanner(CONFIG)
    planner.decide([status("w0", {"r0": 5, "r1": 1})], SATURATED, now=10.0)
    planner.decide([status("w0", {"r0": 6, "r1": 0}, draining=["r1"], plan_time=10.0)], SATURATED, now=11.0)
    assert planner.last_plan.train == ["w0/r1"]
    record = planner.decide([status("w0", {"r1": 0}, plan_time=11.0)], SATURATED, now=12.0)
    assert roles(planner.last_plan) == ([], ["w0/r1"], [])
    assert [(m["unit"], m["source"], m["target"]) for m in record["elastic"]["decided"]] == [
        ("w0/r1", "train", "draining")
    ]


def test_a_drain_is_confirmed_after_its_move_left_the_bounded_history(monkeypatch):
    monkeypatch.setattr(elastic_module, "MOVE_HISTORY", 1)
    planner = ElasticPlanner(CONFIG)
    statuses = [status(w, {"r0": 5, "r1": 0}) for w in ("w0", "w1", "w2")]
    planner.decide(statuses, SATURATED, now=10.0)
    assert planner.last_plan.draining == ["w0/r1", "w1/r1", "w2/r1"]
    assert "w0/r1" not in [move.unit for move in planner.controller.moves]
    confirmed = [status("w0", {"r0": 5, "r1": 0}, draining=["r1"], plan_time=10.0)] + statuses[1:]
    planner.decide(confirmed, SATURATED, now=11.0)
    assert planner.last_plan.train == ["w0/r1"]


def test_a_drain_under_way_when_the_clock_steps_back_is_confirmed_by_the_plans_after_it():
    """The trainer stamps its plans with its wall clock: a replica that began to drain at 1000 s,
    its sessions still finishing when an NTP step took the clock back to 400 s, was confirmed
    only by a plan stamped 1000 s or later, so it stayed draining, lent to nobody, until the
    clock caught up, however many plans its worker applied with it empty meanwhile."""
    planner = ElasticPlanner(CONFIG)
    planner.decide([status("w0", {"r0": 5, "r1": 1})], SATURATED, now=1000.0)
    assert planner.last_plan.draining == ["w0/r1"]
    still_busy = status("w0", {"r0": 6, "r1": 1}, draining=["r1"], plan_time=1000.0)
    planner.decide([still_busy], SATURATED, now=400.0)
    assert planner.last_plan.train == []
    # applied a plan made after the step back, and empty now
    planner.decide([status("w0", {"r0": 7, "r1": 0}, draining=["r1"], plan_time=400.0)], SATURATED, now=410.0)
    assert roles(planner.last_plan) == (["w0/r0"], [], ["w0/r1"])


def test_a_dry_trainer_with_queued_sessions_hands_the_replica_back():
    planner = ElasticPlanner(CONFIG)
    planner.decide([status("w0", {"r0": 5, "r1": 0})], SATURATED, now=10.0)
    planner.decide([status("w0", {"r0": 5, "r1": 0}, draining=["r1"], plan_time=10.0)], SATURATED, now=11.0)
    assert planner.last_plan.train == ["w0/r1"]
    planner.decide([status("w0", {"r0": 8, "r1": 0}, draining=["r1"], plan_time=11.0)], DRY, now=20.0)
    assert roles(planner.last_plan) == (["w0/r0", "w0/r1"], [], [])
    assert planner.controller.units_in("train") == [TRAINER_UNIT], "the trainer's own unit stays"


def test_a_dry_trainer_hands_the_replica_back_though_its_engines_queue_nothing():
    """The worker's engines batch every session it runs (no queue): the replica lent to
    training still comes back once the trainer runs dry, not only at the trainer's stop."""
    planner = ElasticPlanner(CONFIG)
    planner.decide([status("w0", {"r0": 5, "r1": 0})], SATURATED, now=10.0)
    planner.decide([status("w0", {"r0": 5, "r1": 0}, draining=["r1"], plan_time=10.0)], SATURATED, now=11.0)
    assert planner.last_plan.train == ["w0/r1"]
    dry = PolicyInputs(unconsumed_shards=0, engine_queue_depth=0, trainer_idle=1.0)
    record = planner.decide(
        [status("w0", {"r0": 8, "r1": 0}, draining=["r1"], plan_time=11.0)], dry, now=20.0
    )
    assert [(m["unit"], m["target"]) for m in record["elastic"]["decided"]] == [("w0/r1", "rollout")]
    assert roles(planner.last_plan) == (["w0/r0", "w0/r1"], [], [])


def test_a_dry_trainer_hands_back_replicas_only_never_a_trainer_unit():
    """Two trainer units, min_train 1: queued sessions and a dry trainer would lend t1, but no
    worker serves it; a phantom accepting unit would never come back (each worker's last
    accepting unit is never drained)."""
    planner = ElasticPlanner(CONFIG, trainer_units=("t0", "t1"))
    record = planner.decide([status("w0", {"r0": 5, "r1": 0})], DRY, now=10.0)
    assert record["elastic"]["decided"] == []
    assert planner.controller.units_in("train") == ["t0", "t1"]
    planner.decide([status("w0", {"r0": 5, "r1": 0})], SATURATED, now=11.0)
    planner.decide([status("w0", {"r0": 5, "r1": 0}, draining=["r1"], plan_time=11.0)], SATURATED, now=12.0)
    assert planner.last_plan.train == ["w0/r1"]
    record = planner.decide(
        [status("w0", {"r0": 8, "r1": 0}, draining=["r1"], plan_time=12.0)], DRY, now=20.0
    )
    assert [(m["unit"], m["target"]) for m in record["elastic"]["decided"]] == [("w0/r1", "rollout")]
    assert planner.controller.units_in("train") == ["t0", "t1"]


@pytest.mark.parametrize("seed", range(5))
def test_the_last_accepting_replica_of_a_worker_is_never_drained(seed):
    import random

    rng = random.Random(seed)
    planner = ElasticPlanner(CONFIG)
    workers = {"w0": ["r0", "r1", "r2"], "w1": ["r0"], "w2": ["r0", "r1"]}
    for tick in range(40):
        plan = planner.last_plan
        statuses = []
        for worker, replicas in workers.items():
            drained = plan.drained(worker) if plan else set()
            sessions = {r: 0 if r in drained else rng.randrange(0, 3) for r in replicas}
            statuses.append(status(worker, sessions, draining=sorted(drained), plan_time=plan and plan.time))
        inputs = SATURATED if rng.random() < 0.8 else DRY
        planner.decide(statuses, inputs, now=float(tick))
        for worker in workers:
            accepting = [u for u in planner.last_plan.accepting if u.startswith(f"{worker}/")]
            assert accepting, f"tick {tick}: every replica of {worker} drained: {planner.last_plan}"
    assert planner.controller.moves, "the saturated trainer drained something"


def test_a_worker_that_stops_reporting_takes_its_replicas_along():
    planner = ElasticPlanner(CONFIG)
    planner.decide([status("w0", {"r0": 5, "r1": 0}), status("w1", {"r0": 3})], SATURATED, now=1.0)
    assert planner.last_plan.draining == ["w0/r1"]
    planner.decide([status("w1", {"r0": 3}), status("w0", {}, running=False)], SATURATED, now=2.0)
    assert roles(planner.last_plan) == (["w1/r0"], [], [])
    released = planner.release(now=3.0)
    assert (released.running, released.accepting, released.drained("w1")) == (False, ["w1/r0"], set())


def test_trainer_units_are_checked():
    with pytest.raises(ValueError, match="min_train=2"):
        ElasticPlanner(ElasticConfig(min_train=2))
    with pytest.raises(ValueError, match="may not contain '/'"):
        ElasticPlanner(trainer_units=("t/0",))
    # one unit named twice would pass min_train=2 and count twice in the training cost
    with pytest.raises(ValueError, match="must differ"):
        ElasticPlanner(ElasticConfig(min_train=2), trainer_units=("t0", "t0"))


def test_the_rollout_rate_comes_from_the_workers_finished_counts_and_sets_the_balanced_split():
    """Every slot busy (nothing spare to lend): only the balance of measured rates drains.
    Three replicas finishing 5 rollouts/s over 11 live sessions cost rho = 11 / (5 * 4) =
    0.55 replica-s a trajectory; of the 4 units, round(4 * rho / (rho + tau)) belong to
    rollout: 3 when training costs tau = 0.1 unit-s a trajectory, 2 when it costs 0.6 (the
    least loaded replica drains)."""
    full = {"r0": 4, "r1": 3, "r2": 4}

    def worker(finished):
        return status("w0", full).model_copy(update={"finished": finished})

    for tau, drained in ((0.1, []), (0.6, ["w0/r1"])):
        planner = ElasticPlanner(ElasticConfig(sessions_per_replica=4, headroom_slots=0, cooldown_s=0))
        inputs = PolicyInputs(
            unconsumed_shards=5, engine_queue_depth=0, trainer_idle=0.0, train_unit_s_per_trajectory=tau
        )
        planner.decide([worker(100)], inputs, now=0.0)  # the first count only sets the start
        assert planner.controller.last_rollout_rate == 0.0 and planner.last_plan.draining == []
        planner.decide([worker(150)], inputs, now=10.0)
        assert planner.controller.last_rollout_rate == pytest.approx(5.0)
        assert planner.last_plan.draining == drained, tau

    planner = ElasticPlanner(CONFIG)
    planner.decide([worker(100)], DRY, now=0.0)
    planner.decide([worker(3)], DRY, now=10.0)  # restarted: its count starts again
    planner.decide([worker(13)], DRY, now=20.0)
    assert planner.controller.last_rollout_rate == pytest.approx(10 / 20)


def test_session_ages_and_new_lengths_from_statuses_drive_the_forecast():
    """Lengths 10, 20, 30, 40 s learned; live sessions aged 5 and 25 s; horizon 10 s: the
    first ends within it with P(L <= 15 | L > 5) = 1/4, the second with P(L <= 35 | L > 25)
    = 1/2, so 0.75 sessions are forecast to end."""
    planner = ElasticPlanner(ElasticConfig(forecast_horizon_s=10, cooldown_s=0))

    def worker(ended, lengths):
        return status("w0", {"r0": 2, "r1": 0}).model_copy(
            update={
                "session_ages": {"r0": [5.0, 25.0], "r1": []},
                "sessions_ended": ended,
                "session_lengths": lengths,
            }
        )

    planner.decide([worker(2, [1.0, 2.0])], DRY, now=100.0)  # the first status only sets the count
    assert planner.controller.lengths.ordered == [] and planner.controller.last_forecast is None
    for now in (101.0, 102.0):  # the same status read twice adds its lengths once
        planner.decide([worker(6, [1.0, 2.0, 10.0, 20.0, 30.0, 40.0])], DRY, now=now)
        assert planner.controller.lengths.ordered == [10.0, 20.0, 30.0, 40.0]
    assert sorted(planner.controller.units["w0/r0"].session_starts) == [77.0, 97.0]
    assert planner.controller.last_forecast == pytest.approx(0.75)
    assert planner.controller.lengths.rows == [1, 1, 1, 1]  # a worker that counts no contexts


def test_the_forecast_counts_the_trajectories_of_compacted_rollouts_from_their_contexts():
    """Ended sessions of 10 s (one context) and 30 s (a rollout compacted into 3 contexts);
    live ones aged 5 and 25 s; horizon 10 s: the first ends by 15 with P = 1/2, as the 10 s
    one did, bringing its 1 trajectory; the second, past 10 s, ends by 35 as the 30 s one
    did, bringing 3: 0.5 + 3 trajectories expected (1.5 counting a session as one)."""
    planner = ElasticPlanner(ElasticConfig(forecast_horizon_s=10, cooldown_s=0))

    def worker(ended, lengths, contexts):
        return status("w0", {"r0": 2}).model_copy(
            update={
                "session_ages": {"r0": [5.0, 25.0]},
                "sessions_ended": ended,
                "session_lengths": lengths,
                "session_contexts": contexts,
            }
        )

    planner.decide([worker(0, [], [])], DRY, now=100.0)
    planner.decide([worker(2, [10.0, 30.0], [1, 3])], DRY, now=101.0)
    assert (planner.controller.lengths.ordered, planner.controller.lengths.rows) == ([10.0, 30.0], [1, 3])
    assert planner.controller.last_forecast == pytest.approx(3.5)
    planner.decide([worker(3, [10.0, 30.0, 12.0], [1, 3, 1])], DRY, now=102.0)  # only the new one
    assert planner.controller.lengths.rows == [1, 1, 3]


def test_the_rollout_rate_counts_the_trajectories_of_compacted_rollouts_and_keeps_their_trainer():
    """Each finished rollout was compacted into 3 contexts, 3 rows for the trainer: 10 in 10 s
    are 3 trajectories/s, which at 0.6 unit-s a trajectory keep ceil(1.8) = 2 training units
    busy. The engines queue sessions and half the trainer's 2 units idle: the replica lent to
    training stays (counted as 1 trajectory/s, 1 unit would do and it went back)."""
    planner = ElasticPlanner(CONFIG)

    def worker(sessions, finished, rows, **update):
        return status("w0", sessions, **update).model_copy(
            update={"finished": finished, "finished_rows": rows}
        )

    planner.decide([worker({"r0": 5, "r1": 0}, 0, 0)], SATURATED, now=10.0)
    planner.decide([worker({"r0": 5, "r1": 0}, 0, 0, draining=["r1"], plan_time=10.0)], SATURATED, now=11.0)
    assert planner.last_plan.train == ["w0/r1"]
    queued = PolicyInputs(
        unconsumed_shards=2, engine_queue_depth=8, trainer_idle=0.5, train_unit_s_per_trajectory=0.6
    )
    record = planner.decide(
        [worker({"r0": 8, "r1": 0}, 10, 30, draining=["r1"], plan_time=11.0)], queued, now=20.0
    )
    assert record["elastic"]["decided"] == []
    assert planner.last_plan.train == ["w0/r1"]
    assert planner.controller.last_rollout_rate == pytest.approx(3.0)


def test_the_balanced_split_counts_the_trajectories_of_compacted_rollouts():
    """As in the test above of the balanced split, 5 rollouts/s over 11 live sessions on 3
    replicas, but each rollout wrote 3 rows: a trajectory costs rho = 11 / (15 * 4) = 0.183
    replica-s of rollout, so at tau = 0.3 unit-s of training round(4 * rho / (rho + tau)) =
    2 units belong to rollout (counting rollouts, 3) and the least loaded replica drains."""
    full = {"r0": 4, "r1": 3, "r2": 4}
    planner = ElasticPlanner(ElasticConfig(sessions_per_replica=4, headroom_slots=0, cooldown_s=0))
    inputs = PolicyInputs(
        unconsumed_shards=5, engine_queue_depth=0, trainer_idle=0.0, train_unit_s_per_trajectory=0.3
    )
    for finished, now in ((100, 0.0), (150, 10.0)):
        update = {"finished": finished, "finished_rows": 3 * finished}
        planner.decide([status("w0", full).model_copy(update=update)], inputs, now)
    assert planner.last_plan.draining == ["w0/r1"]
    assert planner.controller.last_rollout_rate == pytest.approx(15.0)


def test_a_restarted_worker_whose_row_count_starts_again_only_sets_where_it_starts():
    """Restarted between statuses, it finished more rollouts than before but wrote fewer rows
    (its counts started again): no negative or mixed count reaches the rate."""
    planner = ElasticPlanner(CONFIG)

    def worker(finished, rows):
        return status("w0", {"r0": 1}).model_copy(update={"finished": finished, "finished_rows": rows})

    planner.decide([worker(5, 15)], DRY, now=0.0)
    planner.decide([worker(6, 6)], DRY, now=10.0)
    assert planner.controller.last_rollout_rate == 0.0
    planner.decide([worker(8, 12)], DRY, now=20.0)
    assert planner.controller.last_rollout_rate == pytest.approx(6 / 20)


def test_a_drain_keeps_the_headroom_on_its_own_worker_whose_replicas_its_sessions_move_to():
    # w0/r1's 2 sessions can move only to w0/r0, which is full: w1's 16 free slots are no
    # room for them, so draining w0/r1 would leave its worker none of the 2 of headroom
    planner = ElasticPlanner(CONFIG)
    statuses = [status("w0", {"r0": 8, "r1": 2}), status("w1", {"r0": 0, "r1": 0})]
    planner.decide(statuses, SATURATED, now=10.0)
    assert roles(planner.last_plan) == (["w0/r0", "w0/r1", "w1/r0"], ["w1/r1"], [])
