"""Elastic rollout/training controller: drains at session boundaries, never interrupts a rollout."""

import itertools
import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import rollout.elastic as elastic_module
from rollout.elastic import ElasticConfig, ElasticController, PolicyInputs, SessionLengths
from rollout.elastic_sim import (
    IDLE_CAUSES,
    ElasticWorkload,
    continuous_lower_bound,
    makespan_lower_bound,
    pending_limit,
    prompt_stream,
    simulate_elastic,
    workload_prompts,
)

BEHIND = PolicyInputs(unconsumed_shards=20, engine_queue_depth=0, trainer_idle=0.0)
DRY = PolicyInputs(unconsumed_shards=0, engine_queue_depth=5, trainer_idle=1.0)


def test_drain_waits_for_live_sessions_then_hands_unit_to_trainer():
    ctl = ElasticController.create(["r0", "r1"], ["t0"], ElasticConfig(cooldown_s=0))
    ctl.begin_session("r0")
    ctl.begin_session("r0")
    ctl.begin_session("r1")
    (move,) = ctl.step(BEHIND, now=1.0)
    assert move.unit == "r1" and move.target == "draining"  # fewest live sessions
    assert ctl.routable() == ["r0"]
    with pytest.raises(ValueError, match="takes no new sessions"):
        ctl.begin_session("r1")
    assert ctl.step(BEHIND, now=2.0) == []  # r0 is the last accepting replica (min_rollout=1)
    assert ctl.units["r1"].role == "draining"
    move = ctl.end_session("r1", now=3.0)
    assert (move.unit, move.source, move.target) == ("r1", "draining", "train")
    assert sorted(ctl.units_in("train")) == ["r1", "t0"]
    # min_rollout=1: the last rollout replica is never lent
    assert ctl.step(BEHIND, now=4.0) == []
    # the trainer runs dry: the borrowed unit comes back
    (back,) = ctl.step(DRY, now=5.0)
    assert (back.unit, back.target) == ("r1", "rollout")
    record = ctl.log_record()["elastic"]
    assert record["inputs"] == {
        "unconsumed_shards": 0,
        "engine_queue_depth": 5,
        "trainer_idle": 1.0,
        "train_unit_s_per_trajectory": None,
        "unconsumed_trajectories": None,
    }
    assert record["roles"]["r1"] == "rollout"


def live(ctl, name, sessions):
    for _ in range(sessions):
        ctl.begin_session(name)


def test_saturated_trainer_gets_the_replicas_whose_slots_the_others_can_spare():
    # 8 slots a replica, 4 kept free, sessions migrate: draining r2 (1 live) takes its 7 free
    # slots and, for its session, 1 of r1's: 4 of the 12 free stay; r1 would take the rest
    ctl = ElasticController.create(["r0", "r1", "r2"], ["t0"], ElasticConfig(cooldown_s=0))
    live(ctl, "r0", 8)
    live(ctl, "r1", 3)
    live(ctl, "r2", 1)
    assert ctl.routable() == ["r0", "r1", "r2"]  # most loaded first: sessions pack
    (move,) = ctl.step(BEHIND, now=0.0)
    assert (move.unit, move.target) == ("r2", "draining")

    def no_headroom(migrate: bool) -> list[str]:
        config = ElasticConfig(cooldown_s=0, headroom_slots=0, migrate_at_turns=migrate)
        ctl = ElasticController.create(["r0", "r1", "r2"], ["t0"], config)
        live(ctl, "r0", 8)
        live(ctl, "r1", 3)
        live(ctl, "r2", 1)
        return [m.unit for m in ctl.step(BEHIND, now=0.0)]

    # migrating, r1's 3 sessions would find 12 - 8 = 4 free slots minus 4 of its own: none
    assert no_headroom(migrate=True) == ["r2"]
    # sessions that stay need no slot elsewhere: r1 drains too (r0 is the last)
    assert no_headroom(migrate=False) == ["r2", "r1"]


def test_queued_sessions_borrow_idle_training_units_but_keep_what_training_needs():
    ctl = ElasticController.create(["r0"], ["t0", "t1", "t2", "t3"], ElasticConfig(cooldown_s=0))
    assert ctl.step(PolicyInputs(0, 0, 0.0), now=0.0) == []  # nothing queued, trainer not dry
    for t in range(12):  # 12 sessions finish in the first 600 s: 0.02 trajectories/s
        ctl.begin_session("r0")
        ctl.end_session("r0", now=50.0 * t)
    # 40 queued sessions want 5 replicas; 4 training units idle; at 100 unit-s a trajectory
    # the trainer needs ceil(0.02 * 100) = 2 of them: 2 are lent
    moves = ctl.step(PolicyInputs(3, 40, 1.0, train_unit_s_per_trajectory=100.0), now=600.0)
    assert [(m.unit, m.target) for m in moves] == [("t3", "rollout"), ("t2", "rollout")]
    # half the trainer idle (round(0.5 * 2) = 1 unit) but it needs both: nothing more is lent
    assert ctl.step(PolicyInputs(3, 40, 0.5, train_unit_s_per_trajectory=100.0), now=700.0) == []


def test_rollout_above_its_balanced_share_drains_even_when_full():
    ctl = ElasticController.create([f"r{i}" for i in range(6)], ["t0", "t1"], ElasticConfig(cooldown_s=0))
    for t in range(120):  # 0.2 sessions finish a second
        ctl.begin_session("r0")
        ctl.end_session("r0", now=5.0 * t)
    for i in range(6):
        live(ctl, f"r{i}", 8)
    # Little's law: 48 live at 0.2/s last 240 s each, 30 replica-seconds a trajectory on
    # 8 slots; training costs 30 unit-seconds: 8 * 30 / (30 + 30) = 4 rollout replicas
    assert ctl.balanced_rollout_units(0.2, 30.0) == 4
    assert ctl.balanced_rollout_units(0.2, None) is None
    moves = ctl.step(PolicyInputs(10, 0, 0.0, train_unit_s_per_trajectory=30.0), now=599.0)
    assert [(m.unit, m.target) for m in moves] == [("r0", "draining"), ("r1", "draining")]
    assert len(ctl.routable()) == 4


def test_dry_trainer_cancels_drains_but_lends_nothing_the_engines_do_not_want():
    ctl = ElasticController.create(["r0", "r1", "r2"], ["t0"], ElasticConfig(cooldown_s=0, headroom_slots=1))
    live(ctl, "r0", 8)
    live(ctl, "r1", 6)
    live(ctl, "r2", 1)
    # 9 free slots: lending r2 (its session moving to r1) leaves 1 (the headroom), r1 too none
    (drain,) = ctl.step(BEHIND, now=0.0)
    assert (drain.unit, drain.source, drain.target) == ("r2", "rollout", "draining")
    (cancel,) = ctl.step(PolicyInputs(0, 0, 1.0), now=1.0)
    assert (cancel.unit, cancel.source, cancel.target) == ("r2", "draining", "rollout")
    assert ctl.units_in("train") == ["t0"]  # nothing queued: the training unit stays


def test_dry_trainer_keeps_the_drain_the_forecast_completions_need():
    """Every session seen lasted 50 s; the 15 live ones are 10 s old at 1000, so all end
    within the 400 s horizon: 15 trajectories at 100 unit-s keep ceil(3.75) = 4 units busy,
    capped at 3 (one rollout replica stays). The trainer has one and r2 drains towards it: a
    queue that runs dry now does not cancel that drain. At 1100 the sessions are older than
    any seen (nothing forecast), and at 1000 sessions queue: then it is cancelled."""

    def draining_r2() -> ElasticController:
        config = ElasticConfig(cooldown_s=0, headroom_slots=1, forecast_horizon_s=400.0)
        ctl = ElasticController.create(["r0", "r1", "r2"], ["t0"], config)
        for _ in range(4):
            ctl.begin_session("r0", 0.0)
            ctl.end_session("r0", 50.0, started=0.0)
        for name, sessions in (("r0", 8), ("r1", 6), ("r2", 1)):
            for _ in range(sessions):
                ctl.begin_session(name, 990.0)
        (drain,) = ctl.step(BEHIND, now=990.0)
        assert (drain.unit, drain.target) == ("r2", "draining")
        return ctl

    ctl = draining_r2()
    assert ctl.step(PolicyInputs(0, 0, 1.0, train_unit_s_per_trajectory=100.0), now=1000.0) == []
    assert ctl.last_forecast == pytest.approx(15.0) and ctl.units_in("draining") == ["r2"]
    ctl = draining_r2()
    (cancel,) = ctl.step(PolicyInputs(0, 0, 1.0, train_unit_s_per_trajectory=100.0), now=1100.0)
    assert ctl.last_forecast == 0.0 and (cancel.unit, cancel.target) == ("r2", "rollout")
    ctl = draining_r2()
    (cancel,) = ctl.step(PolicyInputs(0, 8, 1.0, train_unit_s_per_trajectory=100.0), now=1000.0)
    assert (cancel.unit, cancel.target) == ("r2", "rollout")


def test_lower_bound_is_hand_worked_and_never_beaten():
    # two 100 s sessions one at a time (staleness bound 1), 10 s training each: the second
    # starts when the first is trained away, ends at 200 and is trained by 210
    tiny = ElasticWorkload(
        units=2,
        long_sessions=2,
        long_sigma=0,
        long_median_s=100,
        long_train_s=10,
        short_sessions=0,
        max_ahead=1,
    )
    assert makespan_lower_bound(tiny) == pytest.approx(210.0)
    assert simulate_elastic(tiny, 1).makespan == pytest.approx(210.0)
    w = ElasticWorkload(units=6, long_sessions=24, short_sessions=120, long_median_s=300, max_ahead=48)
    bound = makespan_lower_bound(w)
    for split in range(1, 6):
        assert simulate_elastic(w, split).makespan >= bound - 1e-9
    names = [f"u{i}" for i in range(6)]
    elastic = simulate_elastic(w, 3, ElasticController.create(names[:3], names[3:]))
    assert elastic.makespan >= bound - 1e-9


def test_idle_replica_moves_immediately():
    ctl = ElasticController.create(["r0", "r1"], ["t0"])
    (move,) = ctl.step(BEHIND, now=0.0)
    assert move.target == "train"


def test_a_controller_keeps_a_bounded_history_of_its_moves(monkeypatch):
    monkeypatch.setattr(elastic_module, "MOVE_HISTORY", 3)
    ctl = ElasticController.create(["r0", "r1"], ["t0"], ElasticConfig(cooldown_s=0))
    dry_and_queued = PolicyInputs(0, 40, 1.0)
    for t in range(20):
        moved = ctl.step(BEHIND if t % 2 == 0 else dry_and_queued, now=float(t))
        assert [m.target for m in moved] == ["train" if t % 2 == 0 else "rollout"]
    assert ctl.moves_made == 20
    assert 3 <= len(ctl.moves) <= 6 and ctl.moves[-1].time == 19.0


def test_config_validation():
    with pytest.raises(ValueError, match="both rollout and train"):
        ElasticController.create(["a"], ["a"])
    # two names for one unit would pass min_rollout=2 with a single rollout unit
    with pytest.raises(ValueError, match="unit names must differ"):
        ElasticController.create(["a", "a"], ["t"], ElasticConfig(min_rollout=2))
    with pytest.raises(ValueError):
        ElasticConfig(high_backlog=0)
    # at 2 shards and 2% idle a trainer would be dry and saturated at once: its drains were
    # cancelled and made again at every decision
    with pytest.raises(ValueError, match=r"low_backlog \(2\) must be below high_backlog \(2\)"):
        ElasticConfig(low_backlog=2)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["begin", "end", "step"]),
            st.integers(0, 3),
            st.integers(0, 30),
            st.booleans(),
            st.one_of(st.none(), st.floats(1, 500)),
        ),
        max_size=80,
    )
)
def test_never_a_live_session_on_a_training_unit(ops):
    ctl = ElasticController.create(
        ["r0", "r1", "r2"], ["t0"], ElasticConfig(high_backlog=5, low_backlog=1, cooldown_s=0)
    )

    def check():
        for unit in ctl.units.values():
            assert not (unit.role == "train" and unit.live_sessions), unit
        assert len(ctl.units_in("rollout")) + len(ctl.units_in("draining")) >= 1
        assert len(ctl.units_in("train")) >= 1

    # every run starts with a saturated trainer draining a replica that holds two sessions,
    # one of which then ends: the drain must wait for the other
    for name in ["r0", "r1", "r2"] * 2:
        ctl.begin_session(name)
    ctl.step(PolicyInputs(30, 0, 0.0), 0.0)
    check()
    (draining,) = ctl.units_in("draining")
    ctl.end_session(draining, 0.0)
    check()
    for t, (op, idx, shards, idle, train_s) in enumerate(ops, start=1):
        if op == "begin" and ctl.routable():
            ctl.begin_session(ctl.routable()[idx % len(ctl.routable())])
        elif op == "end":
            live = [n for n, u in ctl.units.items() if u.live_sessions]
            if live:
                ctl.end_session(live[idx % len(live)], float(t))
        else:
            ctl.step(PolicyInputs(shards, 8 * idx, 1.0 if idle else 0.0, train_s), float(t))
        check()


def test_simulated_pipeline_drains_without_interrupting_rollouts():
    w = ElasticWorkload(
        units=6, long_sessions=24, short_sessions=120, long_median_s=300, short_train_s=60, max_ahead=48
    )
    ctl = ElasticController.create([f"u{i}" for i in range(3)], [f"u{i}" for i in range(3, 6)])
    run = simulate_elastic(w, 3, ctl)
    assert run.trained == 144
    assert any(m.source == "draining" and m.target == "train" for m in ctl.moves)
    assert run.interrupted_sessions == 0
    fixed = simulate_elastic(w, 3)
    assert fixed.trained == 144 and fixed.moves == 0
    idle = fixed.idle_unit_seconds()
    assert idle["idle_draining"] == idle["moving_units"] == 0  # a fixed split never moves
    assert sum(run.idle_unit_seconds().values()) > 0


def test_train_task_logs_the_engine_queue_depth_it_is_given(tmp_path):
    import time

    from flows.config import RunConfig
    from rl.models import ensure_base_version
    from storage.config import RunStore, StorageConfig
    from storage.tables import Tables
    from storage.weights import WeightStore
    from tasks.train import run_trainer
    from tests.rl.test_trainer import TINY, config, make_trajectories, write_shards

    run = RunConfig(run_id="elastic-queue", storage=StorageConfig(root=str(tmp_path / "runs")), sao=config())
    store = RunStore(run.storage, run.run_id)
    ensure_base_version(WeightStore(store), TINY)
    write_shards(store, make_trajectories(store, 8, seed=5), per_shard=2)
    depths = iter([7, 3])
    run_trainer(run, time.time() + 600, drain=True, engine_queue_depth=lambda: next(depths))
    rows = sorted(Tables(store).read("train_steps").to_pylist(), key=lambda row: row["step"])
    inputs = [json.loads(row["extra"])["elastic"]["inputs"] for row in rows]
    assert [i["engine_queue_depth"] for i in inputs] == [7, 3]
    assert [i["unconsumed_shards"] for i in inputs] == [2, 0]
    assert all(0.0 <= i["trainer_idle"] <= 1.0 for i in inputs)


def test_prompts_keep_coming_cycle_after_cycle():
    w = ElasticWorkload(long_sessions=3, short_sessions=5, cycles=2, concurrency=16)
    two = workload_prompts(w, 2)
    assert len(two) == 16 and two[:8] == workload_prompts(w)  # the finite batch is the first cycle
    # each cycle: its long-phase prompts, then its short-phase ones, drawn afresh
    assert [t for _, t in two] == [w.long_train_s] * 3 + [w.short_train_s] * 5 + [w.long_train_s] * 3 + [
        w.short_train_s
    ] * 5
    assert two[8:] != two[:8]
    assert list(itertools.islice(prompt_stream(w), 20))[:16] == two
    with pytest.raises(ValueError, match="no prompts"):
        next(prompt_stream(ElasticWorkload(long_sessions=0, short_sessions=0)))
    with pytest.raises(ValueError, match="concurrency or max_ahead"):
        simulate_elastic(w.model_copy(update={"concurrency": None, "max_ahead": None}), 1)


TINY_CONTINUOUS = ElasticWorkload(
    units=2,
    sessions_per_replica=1,
    long_sessions=1,
    long_median_s=100,
    long_sigma=0,
    long_train_s=10,
    short_sessions=1,
    short_median_s=20,
    short_sigma=0,
    short_train_s=10,
    cycles=2,
    max_ahead=None,
    max_backlog=1,
    concurrency=2,
)


def test_continuous_run_and_its_throughput_bound_hand_worked():
    w = TINY_CONTINUOUS
    # one slot, one trainer, prompts L S L S ...: L runs 0-100 and trains 100-110, S runs
    # 100-120 and trains 120-130, L 120-220 / 220-230, S 220-240 / 240-250: 2 cycles by 250
    run = simulate_elastic(w, 1)
    assert run.trained == 4 and run.makespan == pytest.approx(250.0) and run.dropped == 0
    # at most 1 session live and 1 + 1 waiting when the 4th trains: the 4 trained are among
    # the first 7 prompts; cheapest 4 at session/1 + 10 each: S, S, S (30) and L (110) on 2 units
    assert pending_limit(w) == 3
    assert continuous_lower_bound(w) == pytest.approx((3 * 30 + 110) / 2)
    assert run.throughput <= 4 / continuous_lower_bound(w)
    with pytest.raises(ValueError, match="finite batch"):
        makespan_lower_bound(w)


def test_trainer_drops_a_trajectory_more_versions_old_than_max_staleness():
    # a version per trained trajectory, no staleness allowed: both sessions start at
    # version 0 on one 2-slot replica; the short one trains first (version 1), so the long
    # one arrives one version old and is dropped
    w = ElasticWorkload(
        units=2,
        sessions_per_replica=2,
        long_sessions=1,
        long_median_s=100,
        long_sigma=0,
        short_sessions=1,
        short_median_s=20,
        short_sigma=0,
        short_train_s=10,
        max_ahead=None,
        batch_size=1,
        publish_every=1,
        max_staleness=0,
    )
    run = simulate_elastic(w, 1)
    assert (run.trained, run.dropped) == (1, 1)
    assert run.makespan == pytest.approx(100.0)  # dropped on arrival: nothing trains it
    kept = simulate_elastic(w.model_copy(update={"max_staleness": 1}), 1)
    assert (kept.trained, kept.dropped) == (2, 0) and kept.makespan == pytest.approx(140.0)


CONTINUOUS = ElasticWorkload(
    units=6,
    long_sessions=24,
    short_sessions=120,
    long_median_s=300,
    cycles=3,
    max_ahead=None,
    batch_size=8,
    max_staleness=4,
    max_backlog=32,
    concurrency=48,
)


def test_continuous_elastic_run_never_interrupts_a_rollout():
    w = CONTINUOUS
    ctl = ElasticController.create([f"u{i}" for i in range(3)], [f"u{i}" for i in range(3, 6)])
    run = simulate_elastic(w, 3, ctl)
    assert run.trained == 3 * 144 and run.interrupted_sessions == 0
    assert any(m.source == "draining" and m.target == "train" for m in ctl.moves)
    # the bound holds for every run that drops nothing: each fixed split and the controller
    no_drops = w.model_copy(update={"max_staleness": None})
    bound = continuous_lower_bound(no_drops)
    for split in range(1, 6):
        assert simulate_elastic(no_drops, split).makespan >= bound - 1e-9
    ctl = ElasticController.create([f"u{i}" for i in range(3)], [f"u{i}" for i in range(3, 6)])
    assert simulate_elastic(no_drops, 3, ctl).makespan >= bound - 1e-9
    assert all(s.prompts_left is None and s.idle_rollout_no_prompts == 0 for s in run.trace)


def test_session_length_model_and_forecast_hand_worked():
    model = SessionLengths(window=4)
    for length in (10.0, 20.0, 30.0, 40.0):
        model.record(length)
    assert model.ends_within(0.0, 15.0) == pytest.approx(1 / 4)  # only 10 ends by 15
    assert model.ends_within(15.0, 10.0) == pytest.approx(1 / 3)  # of 20, 30, 40: 20 ends by 25
    assert model.ends_within(50.0, 100.0) == 0.0  # older than any seen
    model.record(50.0)  # window 4: 10 is forgotten
    assert model.ordered == [20.0, 30.0, 40.0, 50.0]
    ctl = ElasticController.create(["r0"], ["t0"], ElasticConfig(forecast_horizon_s=15.0))
    assert ctl.forecast_completions(0.0) is None  # no finished session yet
    for length in (10.0, 20.0, 30.0, 40.0):
        ctl.begin_session("r0", 0.0)
        ctl.end_session("r0", length, started=0.0)
    ctl.begin_session("r0", 100.0)
    ctl.begin_session("r0", 115.0)
    # at 115: age 15 ends by 30 with P(15 < L <= 30 | L > 15) = 2/3; age 0 by 15 with 1/4
    assert ctl.forecast_completions(115.0) == pytest.approx(2 / 3 + 1 / 4)
    with pytest.raises(ValueError, match="no live session started at 7"):
        ctl.end_session("r0", 120.0, started=7.0)


def test_lending_keeps_the_trainers_the_forecast_completions_need():
    # four 50 s sessions finished long ago (rate window empty: the measured rate says 0/s);
    # 8 sessions started 10 s ago will all end within the 400 s horizon (all seen were 50 s):
    # 8 trajectories at 100 unit-s over 400 s keep 2 trainers busy, so 2 of 4 are lent
    ctl = ElasticController.create(["r0"], ["t0", "t1", "t2", "t3"], ElasticConfig(forecast_horizon_s=400.0))
    for _ in range(4):
        ctl.begin_session("r0", 0.0)
        ctl.end_session("r0", 50.0, started=0.0)
    live_starts = [990.0] * 8
    for start in live_starts:
        ctl.begin_session("r0", start)
    dry = PolicyInputs(0, 40, 1.0, train_unit_s_per_trajectory=100.0)
    moves = ctl.step(dry, now=1000.0)
    assert ctl.last_rollout_rate == 0.0 and ctl.last_forecast == pytest.approx(8.0)
    assert [(m.unit, m.target) for m in moves] == [("t3", "rollout"), ("t2", "rollout")]
    # train_steps shows the number of trainers the decision kept, beside its inputs
    assert ctl.log_record()["elastic"]["training_demand"] == pytest.approx(2.0)
    # the same queues with no session ages known: only min_train=1 is kept, 3 are lent
    blind = ElasticController.create(
        ["r0"], ["t0", "t1", "t2", "t3"], ElasticConfig(forecast_horizon_s=400.0)
    )
    for _ in range(8):
        blind.begin_session("r0")
    assert len(blind.step(dry, now=1000.0)) == 3
    assert blind.log_record()["elastic"]["training_demand"] is None


def test_migrating_the_last_session_off_a_draining_replica_hands_it_to_training():
    ctl = ElasticController.create(["r0", "r1"], ["t0"], ElasticConfig(cooldown_s=0))
    ctl.begin_session("r0", 0.0)
    ctl.begin_session("r1", 5.0)
    ctl.begin_session("r1", 9.0)
    with pytest.raises(ValueError, match="only a draining replica's sessions migrate"):
        ctl.migrate_session("r1", "r0", 10.0, started=5.0)
    ctl.units["r1"].role = "draining"
    with pytest.raises(ValueError, match="no live session started at 7"):
        ctl.migrate_session("r1", "r0", 10.0, started=7.0)
    with pytest.raises(ValueError, match="t0 is train|'t0' is train"):
        ctl.migrate_session("r1", "t0", 10.0, started=5.0)
    assert ctl.migrate_session("r1", "r0", 30.0, started=5.0) is None
    assert (ctl.units["r0"].live_sessions, ctl.units["r1"].live_sessions) == (2, 1)
    assert sorted(ctl.units["r0"].session_starts) == [0.0, 5.0]  # it keeps its age for the forecast
    move = ctl.migrate_session("r1", "r0", 40.0, started=9.0)
    assert (move.unit, move.source, move.target, move.time) == ("r1", "draining", "train", 40.0)
    assert ctl.units_in("train") == ["r1", "t0"] and ctl.units["r0"].live_sessions == 3
    off = ElasticController.create(["r0", "r1"], ["t0"], ElasticConfig(migrate_at_turns=False))
    with pytest.raises(ValueError, match="migrate_at_turns is off"):
        off.migrate_session("r1", "r0", 1.0)


MIGRATING = CONTINUOUS.model_copy(update={"turn_s": 20.0})


def test_sessions_migrate_only_at_turn_boundaries_and_lose_no_work():
    w = MIGRATING
    names = [f"u{i}" for i in range(6)]
    run = simulate_elastic(w, 3, ElasticController.create(names[:3], names[3:]))
    assert run.trained == 3 * 144 and run.interrupted_sessions == 0
    assert len(run.migrations) > 0 and run.reprefill_replica_s > 0
    held = dict.fromkeys(range(len(run.sessions)), 0.0)
    for m in run.migrations:
        session = run.sessions[m.session]
        assert m.source != m.target and m.started == session.started
        # the boundary after turn m.turn, never mid-turn, and before the session's last turn ends
        assert m.time == pytest.approx(session.started + m.held_s + m.turn * w.turn_s)
        assert 0 < m.turn * w.turn_s < session.turns_s
        history = w.prompt_tokens + w.context_tokens_per_s * m.turn * w.turn_s
        assert m.reprefill_s == pytest.approx(history / w.prefill_tokens_per_s)
        assert 1 <= m.held <= w.sessions_per_replica
        held[m.session] += m.reprefill_s
    # every session runs all its turns; the only extra time is re-prefill holdups on its replica
    ended = [s for s in run.sessions if s.ended is not None]
    for session in ended:
        assert session.ended == pytest.approx(session.started + session.turns_s + session.held_s)
        assert session.held_s >= held[session.id] - 1e-9
    assert sum(s.held_s for s in run.sessions) == pytest.approx(run.reprefill_slot_s)
    # a fixed split never drains, so nothing migrates
    assert all(not simulate_elastic(w, split).migrations for split in range(1, 6))


def test_without_migration_a_draining_replica_waits_for_its_sessions():
    names = [f"u{i}" for i in range(6)]
    ctl = ElasticController.create(names[:3], names[3:], ElasticConfig(migrate_at_turns=False))
    run = simulate_elastic(MIGRATING, 3, ctl)
    assert run.trained == 3 * 144 and run.interrupted_sessions == 0 and run.migrations == []
    assert all(s.held_s == 0 for s in run.sessions)
    assert any(m.source == "draining" and m.target == "train" for m in ctl.moves)
    migrating = simulate_elastic(MIGRATING, 3, ElasticController.create(names[:3], names[3:]))
    idle_off, idle_on = run.idle_unit_seconds(), migrating.idle_unit_seconds()
    assert idle_on["idle_draining"] < idle_off["idle_draining"]


def test_unit_seconds_account_for_every_unit_over_the_whole_run():
    w = MIGRATING
    names = [f"u{i}" for i in range(6)]
    ctl = ElasticController.create(names[:3], names[3:])
    elastic = simulate_elastic(w, 3, ctl)
    for run in (elastic, simulate_elastic(w, 3)):
        use = run.unit_seconds
        assert sum(use.values()) == pytest.approx(w.units * run.makespan)
        # filled slots are exactly the sessions' time on their replicas, holdups included
        slot_s = sum(min(s.ended or run.makespan, run.makespan) - s.started for s in run.sessions)
        assert use["rollout_sessions"] + use["draining_sessions"] == pytest.approx(
            slot_s / w.sessions_per_replica
        )
        assert run.idle_unit_seconds() == {cause: use[cause] for cause in IDLE_CAUSES}
    # each change of sides costs its unit switch_s of loading, however it falls between the
    # ticks (a tick sample counted a 60 s move begun just after a tick as 30 s)
    switches = sum(1 for m in ctl.moves if "train" in (m.source, m.target))
    assert switches > w.units
    moving = elastic.unit_seconds["moving_units"]
    assert (switches - w.units) * w.switch_s - 1e-6 <= moving <= switches * w.switch_s + 1e-6


def test_dropped_sessions_are_marked_and_their_rollout_counted():
    w = CONTINUOUS.model_copy(update={"max_staleness": 0})
    run = simulate_elastic(w, 3)
    marked = [s for s in run.sessions if s.dropped]
    assert run.dropped == len(marked) > 0
    assert all(s.ended is not None for s in marked)
    assert run.dropped_session_s == pytest.approx(sum(s.turns_s + s.held_s for s in marked))


def test_pending_limit_bounds_the_launched_untrained_trajectories_of_a_run():
    # 10 s sessions on 2 slots, 100 s of training each: the backlog fills to max_ahead,
    # far past 2 slots' worth, and the trainer holds one more
    w = ElasticWorkload(
        units=2,
        sessions_per_replica=2,
        long_sessions=0,
        short_sessions=40,
        short_median_s=10,
        short_sigma=0,
        short_train_s=100,
        max_ahead=12,
    )
    run = simulate_elastic(w, 1)
    pending = [s.live_sessions + s.backlog + s.train_units - s.idle_training for s in run.trace]
    assert max(pending) == pytest.approx(13)
    assert pending_limit(w) == 13
    with pytest.raises(ValueError, match="unbounded"):
        pending_limit(w.model_copy(update={"max_ahead": None, "concurrency": 2}))


def test_a_dry_trainer_hands_borrowed_units_back_though_no_session_queues():
    """In the pipeline the engines batch every session the orchestrator runs, so none queue
    and a lent replica would stay in training for good however long the trainer starves.
    Run dry, it comes back; the trainer's own unit stays, and so does a borrowed unit the
    measured training cost still calls for."""
    ctl = ElasticController.create(["r0", "r1"], ["t0"], ElasticConfig(cooldown_s=0))
    live(ctl, "r0", 3)
    (lent,) = ctl.step(BEHIND, now=0.0)
    assert (lent.unit, lent.target) == ("r1", "train")
    dry_unqueued = PolicyInputs(0, 0, 1.0)
    (back,) = ctl.step(dry_unqueued, now=1.0)
    assert (back.unit, back.source, back.target) == ("r1", "train", "rollout")
    assert ctl.step(dry_unqueued, now=2.0) == [] and ctl.units_in("train") == ["t0"]

    ctl = ElasticController.create(["r0", "r1"], ["t0"], ElasticConfig(cooldown_s=0))
    live(ctl, "r0", 1)
    (lent,) = ctl.step(BEHIND, now=0.0)
    assert (lent.unit, lent.target) == ("r1", "train")
    for t in range(10):  # 10 sessions end over 100 s: 0.1 a second
        ctl.begin_session("r0")
        ctl.end_session("r0", now=10.0 * t + 10.0)
    # at 20 unit-s a trajectory the trainer keeps ceil(0.1 * 20) = 2 units busy: r1 stays
    assert ctl.step(PolicyInputs(0, 0, 1.0, train_unit_s_per_trajectory=20.0), now=100.0) == []
    assert sorted(ctl.units_in("train")) == ["r1", "t0"]


def test_a_borrowed_unit_goes_back_first_after_its_move_left_the_bounded_history(monkeypatch):
    monkeypatch.setattr(elastic_module, "MOVE_HISTORY", 1)
    ctl = ElasticController.create(["r0", "r1", "r2"], ["t0", "t1"], ElasticConfig(cooldown_s=0))
    live(ctl, "r0", 8)
    live(ctl, "r2", 1)
    # 15 free slots: idle r1 goes to training at once (7 left), r2 would leave -1
    (lent,) = ctl.step(BEHIND, now=0.0)
    assert (lent.unit, lent.target) == ("r1", "train")
    for _ in range(5):
        ctl.end_session("r0", now=1.0)
    (drain,) = ctl.step(BEHIND, now=2.0)  # 12 free: r2 drains, 4 stay
    (cancel,) = ctl.step(PolicyInputs(1, 8, 0.0), now=3.0)  # sessions queue: the drain is cancelled
    assert (drain.unit, cancel.unit, cancel.target) == ("r2", "r2", "rollout")
    assert "r1" not in [m.unit for m in ctl.moves]
    # the trainer runs dry and a replica's worth of sessions queue: the borrowed r1 comes
    # back, not a training unit of its own
    (back,) = ctl.step(PolicyInputs(0, 8, 1.0), now=4.0)
    assert (back.unit, back.target) == ("r1", "rollout")


def test_a_saturated_trainer_lends_no_unit_to_queued_sessions():
    train = [f"t{i}" for i in range(12)]
    ctl = ElasticController.create(["r0", "r1"], train, ElasticConfig(cooldown_s=0))
    live(ctl, "r0", 8)
    live(ctl, "r1", 8)
    # 5% idle is saturated; over 12 units it rounds to 1 "idle" unit, which the trainer
    # with 20 shards waiting has not: lent, it would be drained back once the queue clears
    saturated_and_queued = PolicyInputs(20, 8, 0.05)
    assert ctl.step(saturated_and_queued, now=0.0) == []
    assert ctl.units_in("train") == train


def test_the_rollout_rate_counts_from_the_first_session_start():
    ctl = ElasticController.create(["r0", "r1"], ["t0"], ElasticConfig(cooldown_s=0))
    ctl.begin_session("r0", now=0.0)
    ctl.begin_session("r1", now=0.0)
    ctl.end_session("r0", now=300.0, started=0.0)
    # one session in 301 s, not one in the 1 s since it ended (at 100 unit-s a trajectory
    # the trainer would keep 100 units busy)
    ctl.step(PolicyInputs(20, 0, 0.0, train_unit_s_per_trajectory=100.0), now=301.0)
    assert ctl.last_rollout_rate == pytest.approx(1 / 301)


def test_a_compacted_rollout_ending_counts_a_trajectory_per_context_in_the_rate_and_lengths():
    """A rollout compacted into 3 contexts writes 3 rows: 3 trajectories in 10 s, at 10 unit-s
    a trajectory, keep ceil(0.3 * 10) = 3 of the 4 idle training units busy; with sessions
    queued for 2 replicas only 1 is lent (2, counting the rollout as 1 trajectory)."""
    ctl = ElasticController.create(["r0"], ["t0", "t1", "t2", "t3"], ElasticConfig(cooldown_s=0))
    ctl.begin_session("r0", now=0.0)
    ctl.end_session("r0", now=10.0, started=0.0, rows=3)
    assert (ctl.lengths.ordered, ctl.lengths.rows) == ([10.0], [3])
    moves = ctl.step(PolicyInputs(2, 16, 1.0, train_unit_s_per_trajectory=10.0), now=10.0)
    assert ctl.last_rollout_rate == pytest.approx(0.3)
    assert [(m.unit, m.target) for m in moves] == [("t3", "rollout")]
    with pytest.raises(ValueError, match="at least one trajectory, got 0"):
        ctl.end_session("r0", now=10.0, rows=0)


def test_a_saturated_trainer_does_not_drain_what_queued_sessions_would_cancel():
    ctl = ElasticController.create(["r0", "r1", "r2"], ["t0"], ElasticConfig(cooldown_s=0))
    for name in ("r0", "r1", "r2"):
        live(ctl, name, 2)
    # a replica's worth of sessions queue while the trainer is saturated: a drain for spare
    # slots would be cancelled at the next decision (the queue wants a replica) and made
    # again at the one after, its sessions moved each time
    saturated_and_queued = PolicyInputs(20, 8, 0.0)
    moves = [m for t in range(4) for m in ctl.step(saturated_and_queued, now=float(t))]
    assert [(m.unit, m.target) for m in moves] == []


@pytest.mark.parametrize(
    "bad",
    [
        {"trainer_idle": float("nan")},
        {"trainer_idle": 1.5},
        {"train_unit_s_per_trajectory": float("inf")},
        {"engine_queue_depth": -1},
        {"engine_queue_depth": float("nan")},
        {"unconsumed_shards": float("nan")},
    ],
)
def test_policy_inputs_refuse_values_no_decision_can_use(bad):
    with pytest.raises(ValueError, match="must be"):
        PolicyInputs(**{"unconsumed_shards": 0, "engine_queue_depth": 8, "trainer_idle": 0.5} | bad)


def test_ending_or_migrating_a_timed_session_without_its_start_is_refused_and_changes_nothing():
    ctl = ElasticController.create(["r0", "r1"], ["t0"], ElasticConfig(cooldown_s=0))
    ctl.begin_session("r0", 0.0)
    ctl.begin_session("r1", 0.0)
    ctl.end_session("r1", 10.0, started=0.0)  # a length for the forecast: 10 s
    with pytest.raises(ValueError, match="pass started to end one"):
        ctl.end_session("r0", 5.0)
    ctl.units["r0"].role = "draining"
    with pytest.raises(ValueError, match="pass started to migrate one"):
        ctl.migrate_session("r0", "r1", 5.0)
    assert (ctl.units["r0"].live_sessions, ctl.units["r0"].session_starts) == (1, [0.0])
    assert ctl.forecast_completions(5.0) == 1.0
    ctl.begin_session("r1")  # one begun without a time ends without one
    ctl.end_session("r1", 6.0)
    ctl.end_session("r0", 8.0, started=0.0)
    assert ctl.forecast_completions(8.0) == 0.0


@settings(max_examples=200, deadline=None)
@given(
    sessions=st.lists(st.tuples(st.integers(0, 8).map(float), st.integers(1, 4)), min_size=1, max_size=30),
    window=st.integers(1, 6),
    age=st.integers(-1, 9).map(float),
    horizon=st.integers(0, 9).map(float),
)
def test_expected_trajectories_within_a_horizon_match_a_count_over_the_window(sessions, window, age, horizon):
    """A compacted rollout's session brings a trajectory per context: ``ends_within`` is the sum
    of the trajectories of the kept sessions that end within the horizon over the count of
    those that outlived ``age``, counted here over the last ``window`` sessions (ties in
    length and forgotten sessions included)."""
    model = SessionLengths(window=window)
    for recorded in range(1, len(sessions) + 1):
        model.record(*sessions[recorded - 1])
        kept = sessions[:recorded][-window:]
        longer = [(length, rows) for length, rows in kept if length > age]
        ending = sum(rows for length, rows in longer if length <= age + horizon)
        assert model.ends_within(age, horizon) == pytest.approx(ending / len(longer) if longer else 0.0)
        assert sorted(zip(model.ordered, model.rows, strict=True)) == sorted(kept)


def test_a_session_must_have_written_a_trajectory():
    with pytest.raises(ValueError, match="at least one trajectory, got 0"):
        SessionLengths(window=4).record(10.0, 0)


def test_a_session_exactly_as_old_as_a_seen_length_is_counted_as_outliving_it():
    # P(L <= a + H | L > a): a length equal to the age has ended, it is no live session's future
    model = SessionLengths(window=4)
    for length in (10.0, 20.0):
        model.record(length)
    assert model.ends_within(10.0, 10.0) == 1.0  # of the lengths above 10 only 20, which ends by 20
    assert model.ends_within(20.0, 100.0) == 0.0


def test_create_refuses_duplicate_training_names_and_too_few_training_units():
    with pytest.raises(ValueError, match="unit names must differ"):
        ElasticController.create(["r0"], ["t", "t"], ElasticConfig(min_train=2))
    with pytest.raises(ValueError, match="min_train=2"):
        ElasticController.create(["r0"], ["t0"], ElasticConfig(min_train=2))


def test_a_free_training_cost_is_a_valid_measurement():
    assert PolicyInputs(0, 0, 0.5, train_unit_s_per_trajectory=0.0).train_unit_s_per_trajectory == 0.0


def test_the_decision_a_cooldown_after_a_move_is_made():
    # the pipeline decides every cooldown_s: the tick exactly one cooldown after a move decides
    config = ElasticConfig(cooldown_s=30.0, max_moves_per_step=1)
    ctl = ElasticController.create(["r0", "r1", "r2"], ["t0"], config)
    (first,) = ctl.step(BEHIND, now=0.0)
    assert ctl.step(BEHIND, now=29.0) == []
    (second,) = ctl.step(BEHIND, now=30.0)
    assert (first.target, second.target) == ("train", "train")


def test_a_backlog_of_exactly_high_backlog_shards_saturates_the_trainer():
    ctl = ElasticController.create(["r0", "r1"], ["t0"], ElasticConfig(cooldown_s=0))
    (move,) = ctl.step(PolicyInputs(unconsumed_shards=2, engine_queue_depth=0, trainer_idle=0.0), now=0.0)
    assert move.target == "train"


def test_fewer_queued_sessions_than_a_replica_holds_still_borrow_an_idle_unit():
    ctl = ElasticController.create(["r0"], ["t0", "t1"], ElasticConfig(cooldown_s=0))
    # 3 shards: not dry; half idle (1 unit); 5 queued sessions want ceil(5 / 8) = 1 replica
    (move,) = ctl.step(PolicyInputs(3, 5, 0.5), now=0.0)
    assert (move.unit, move.target) == ("t1", "rollout")


def test_queued_sessions_cancel_the_drain_farthest_from_done_first():
    ctl = ElasticController.create(["r0", "r1", "r2"], ["t0"], ElasticConfig(cooldown_s=0))
    live(ctl, "r0", 2)
    live(ctl, "r1", 5)
    live(ctl, "r2", 1)
    ctl.units["r1"].role = ctl.units["r2"].role = "draining"
    # 8 queued sessions want one replica back: r1 (5 sessions to move) is cancelled, r2 nearly
    # empty keeps draining
    (cancel,) = ctl.step(PolicyInputs(3, 8, 0.0), now=0.0)
    assert (cancel.unit, cancel.target) == ("r1", "rollout")
    assert ctl.units_in("draining") == ["r2"]


def test_a_dry_trainer_lends_a_unit_to_queued_sessions_however_its_idle_fraction_rounds():
    ctl = ElasticController.create(["r0"], ["t0", "t1"], ElasticConfig(cooldown_s=0))
    # dry at 10% idle: round(0.1 * 2) = 0 idle units, but a dry trainer has one to spare
    (move,) = ctl.step(PolicyInputs(0, 8, 0.1), now=0.0)
    assert (move.unit, move.target) == ("t1", "rollout")


def test_the_rollout_rate_is_over_its_window_not_the_whole_run():
    ctl = ElasticController.create(["r0"], ["t0"], ElasticConfig(rate_window_s=100.0))
    ctl.record_finished(2, now=0.0)
    ctl.record_finished(5, now=950.0)
    # 5 sessions in the last 100 s, not 5 in the 1000 s since the run began
    assert ctl.rollout_rate(1000.0) == pytest.approx(0.05)
    # a finish exactly one window old is still in it
    assert ctl.rollout_rate(1050.0) == pytest.approx(0.05)


def test_a_cancelled_drain_is_the_replica_the_queue_wanted_no_training_unit_follows():
    ctl = ElasticController.create(["r0", "r1"], ["t0", "t1"], ElasticConfig(cooldown_s=0))
    live(ctl, "r1", 3)
    ctl.units["r1"].role = "draining"
    # 8 queued sessions want one replica: r1 back is that one; the idle trainer lends none
    (cancel,) = ctl.step(PolicyInputs(3, 8, 1.0), now=0.0)
    assert (cancel.unit, cancel.target) == ("r1", "rollout")


def test_cancelled_drains_count_against_the_moves_of_one_decision():
    config = ElasticConfig(cooldown_s=0, max_moves_per_step=2)
    ctl = ElasticController.create(["r0", "r1", "r2"], ["t0", "t1", "t2", "t3"], config)
    for name in ("r1", "r2"):
        live(ctl, name, 3)
        ctl.units[name].role = "draining"
    # 32 queued sessions want 4 replicas and 4 training units sit idle, but one decision
    # moves at most 2 units: the two drains are cancelled and nothing is lent
    moves = ctl.step(PolicyInputs(3, 32, 1.0), now=0.0)
    assert sorted((m.unit, m.target) for m in moves) == [("r1", "rollout"), ("r2", "rollout")]


def test_training_demand_counts_the_backlog_and_the_forecast_hand_worked():
    ctl = ElasticController.create(["r0"], ["t0"], ElasticConfig(forecast_horizon_s=600.0))
    per_shard = PolicyInputs(4, 0, 0.5, train_unit_s_per_trajectory=100.0)
    # (4 shards at one trajectory each + 2 forecast) * 100 unit-s over 600 s
    assert ctl.training_demand(per_shard, 2.0) == pytest.approx(1.0)
    counted = PolicyInputs(4, 0, 0.5, train_unit_s_per_trajectory=100.0, unconsumed_trajectories=16)
    assert ctl.training_demand(counted, 2.0) == pytest.approx(3.0)
    assert ctl.training_demand(counted, None) is None


def test_the_balanced_split_leaves_the_trainer_its_min_train_units():
    ctl = ElasticController.create(["r0"], ["t0"])
    live(ctl, "r0", 8)
    # rho = 8 / (0.01 * 8) = 100 replica-s a trajectory against 1 of training: 2 * 100 / 101
    # rounds to 2 rollout units, but one of the 2 stays in training
    assert ctl.balanced_rollout_units(0.01, 1.0) == 1


def test_a_clock_stepped_back_does_not_hold_decisions_off_until_it_catches_up():
    # the trainer decides on its wall clock: a move dated 600 s ahead of it after an NTP step
    # back is no cooldown of 600 s (sessions queued all that time while the unit stayed lent)
    ctl = ElasticController.create(["r0", "r1"], ["t0"], ElasticConfig(cooldown_s=30.0))
    (lent,) = ctl.step(BEHIND, now=1000.0)
    assert lent.target == "train"
    assert ctl.step(DRY, now=1010.0) == []  # within the cooldown
    (back,) = ctl.step(DRY, now=400.0)
    assert (back.unit, back.target) == (lent.unit, "rollout")
    # the cooldown runs from the move made after the step back
    assert ctl.step(BEHIND, now=410.0) == []


def test_a_session_length_that_is_no_number_is_refused_and_changes_nothing():
    # a worker's status parses NaN lengths: kept, one sorted out of order, the model forgot other
    # sessions than the oldest and then failed on a later record with "1 is not in list"
    model = SessionLengths(window=3)
    model.record(10.0)
    with pytest.raises(ValueError, match="session length must be a number, got nan"):
        model.record(math.nan)
    for length in (5.0, 20.0, 1.0, 2.0, 3.0):
        model.record(length)
    assert model.ordered == [1.0, 2.0, 3.0]
    assert model.ends_within(1.0, 1.0) == 0.5


def test_a_drain_counts_the_slots_the_sessions_still_on_earlier_drains_will_take():
    # r0 drains (its 2 sessions will move); at the next decision, before they have moved,
    # r1 and r2 have 12 free slots but r0's 2 migrants take 2 of them: draining r1 would leave
    # r2 2 free after the migrants of both, below the 4 of headroom
    ctl = ElasticController.create(["r0", "r1", "r2"], ["t0"], ElasticConfig(cooldown_s=0))
    for name in ("r0", "r1", "r2"):
        live(ctl, name, 2)
    assert [(m.unit, m.target) for m in ctl.step(BEHIND, now=0.0)] == [("r0", "draining")]
    assert ctl.step(BEHIND, now=1.0) == []
    assert ctl.units_in("rollout") == ["r1", "r2"]


def test_a_simulation_refuses_a_controller_that_does_not_describe_its_workload():
    w = ElasticWorkload(units=6, long_sessions=24, short_sessions=120, long_median_s=300, max_ahead=48)
    names = [f"u{i}" for i in range(6)]
    mismatched = [
        # 3 of the 6 units: the run would have half the capacity its bounds and fixed splits have
        (ElasticController.create(names[:2], names[2:3]), "units"),
        (ElasticController.create(names[:2], names[2:]), "rollout"),
        (
            ElasticController.create(names[:3], names[3:], ElasticConfig(sessions_per_replica=2)),
            "sessions_per_replica",
        ),
    ]
    for controller, what in mismatched:
        with pytest.raises(ValueError, match=what):
            simulate_elastic(w, 3, controller)
