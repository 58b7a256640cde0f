"""Elastic rollout/training controller: drains at session boundaries, never interrupts a rollout."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout.elastic import ElasticConfig, ElasticController, ElasticLog, PolicyInputs
from rollout.elastic_sim import ElasticWorkload, simulate_elastic

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
    assert record["inputs"] == {"unconsumed_shards": 0, "engine_queue_depth": 5, "trainer_idle": 1.0}
    assert record["roles"]["r1"] == "rollout"


def test_idle_replica_moves_immediately():
    ctl = ElasticController.create(["r0", "r1"], ["t0"])
    (move,) = ctl.step(BEHIND, now=0.0)
    assert move.target == "train"


def test_config_validation():
    with pytest.raises(ValueError, match="both rollout and train"):
        ElasticController.create(["a"], ["a"])
    with pytest.raises(ValueError):
        ElasticConfig(high_backlog=0)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["begin", "end", "step"]), st.integers(0, 3), st.integers(0, 30), st.booleans()
        ),
        max_size=80,
    )
)
def test_never_a_live_session_on_a_training_unit(ops):
    ctl = ElasticController.create(
        ["r0", "r1", "r2"], ["t0"], ElasticConfig(high_backlog=5, low_backlog=1, cooldown_s=0)
    )
    for t, (op, idx, shards, idle) in enumerate(ops):
        if op == "begin" and ctl.routable():
            ctl.begin_session(ctl.routable()[idx % len(ctl.routable())])
        elif op == "end":
            live = [n for n, u in ctl.units.items() if u.live_sessions]
            if live:
                ctl.end_session(live[idx % len(live)], float(t))
        else:
            ctl.step(PolicyInputs(shards, idx, 1.0 if idle else 0.0), float(t))
        for unit in ctl.units.values():
            assert not (unit.role == "train" and unit.live_sessions), unit
        assert len(ctl.units_in("rollout")) + len(ctl.units_in("draining")) >= 1
        assert len(ctl.units_in("train")) >= 1


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


def test_advisory_log_decides_on_a_copy_and_moves_nothing():
    ctl = ElasticController.create(["r0", "r1"], ["t0"], ElasticConfig(cooldown_s=0))
    record = ElasticLog(ctl).record(BEHIND, now=1.0)["elastic"]
    assert record["applied"] is False
    assert [(m["unit"], m["target"]) for m in record["decided"]] == [("r0", "train")]
    assert ctl.units_in("train") == ["t0"] and ctl.moves == [] and record["roles"]["r0"] == "rollout"
    applied = ElasticLog(ctl, apply_moves=True).record(BEHIND, now=2.0)["elastic"]
    assert applied["applied"] is True and ctl.units_in("train") == ["r0", "t0"]


def test_train_steps_rows_carry_the_elastic_inputs_and_decision(tmp_path):
    from rl.models import ensure_base_version
    from rl.trainer import Trainer
    from storage.config import RunStore, StorageConfig
    from storage.tables import Tables
    from storage.weights import WeightStore
    from tests.rl.test_trainer import TINY, config, make_trajectories, write_shards

    store = RunStore(StorageConfig(root=str(tmp_path / "runs")), "elastic-log")
    ensure_base_version(WeightStore(store), TINY)
    write_shards(store, make_trajectories(store, 8, seed=3), per_shard=2)
    trainer = Trainer(store, config())
    log = ElasticLog(
        ElasticController.create(["r0", "r1"], ["t0"], ElasticConfig(high_backlog=1, cooldown_s=0))
    )
    seen = []

    def record():
        inputs = PolicyInputs(trainer.unconsumed_shards(), engine_queue_depth=0, trainer_idle=0.0)
        seen.append(inputs)
        return log.record(inputs, now=float(len(seen)))

    trainer.run(drain=True, step_extra=record)
    trainer.close()
    rows = sorted(Tables(store).read("train_steps").to_pylist(), key=lambda row: row["step"])
    assert len(rows) == len(seen) == 2
    for row, inputs in zip(rows, seen, strict=True):
        elastic = json.loads(row["extra"])["elastic"]
        assert elastic["inputs"] == {
            "unconsumed_shards": inputs.unconsumed_shards,
            "engine_queue_depth": 0,
            "trainer_idle": 0.0,
        }
        assert elastic["roles"] == {"r0": "rollout", "r1": "rollout", "t0": "train"}
        assert elastic["applied"] is False
    # after the first batch (4 rows of 2-row shards) 2 shards wait: behind, the advice is to lend a replica
    assert [inputs.unconsumed_shards for inputs in seen] == [2, 0]
    assert json.loads(rows[0]["extra"])["elastic"]["decided"][0]["target"] == "train"
