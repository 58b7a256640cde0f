"""Rollout status objects in the run's storage: atomic replace, sums, staleness, corrupt files."""

from __future__ import annotations

import json
import logging
import posixpath
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from storage.status import (
    ROLLOUT_STATUS_PREFIX,
    ElasticPlanBoard,
    HeldRole,
    InUse,
    RolloutStatus,
    RolloutStatusBoard,
    TrainerStatus,
    TrainerStatusBoard,
    wait_until_free,
)
from tests.conftest import kept_fresh

NOW = 1_000_000.0


def status(
    worker: str, depth: int, sessions: int = 0, age: float = 0.0, running: bool = True
) -> RolloutStatus:
    return RolloutStatus(
        worker=worker, time=NOW - age, engine_queue_depth=depth, live_sessions=sessions, running=running
    )


def test_no_worker_yet_sums_to_nothing(store):
    summary = RolloutStatusBoard(store).summary(now=NOW)
    assert summary.as_dict() == {
        "workers": 0,
        "stopped": 0,
        "stale": 0,
        "corrupt": 0,
        "engine_queue_depth": 0,
        "live_sessions": 0,
    }


def test_fresh_running_workers_are_summed_stale_and_stopped_ones_counted_apart(store):
    writer = RolloutStatusBoard(store)
    writer.publish(status("w0", depth=3, sessions=5, age=1.0))
    writer.publish(status("w1", depth=4, sessions=2, age=30.0))  # exactly max_age_s old: still counts
    writer.publish(status("w2", depth=50, sessions=50, age=31.0))
    writer.publish(status("w3", depth=0, sessions=0, age=500.0, running=False))
    writer.publish(status("w4", depth=9, sessions=9, age=2.0, running=False))  # stopped just now
    reader = RolloutStatusBoard(store)  # another process would open its own board
    summary = reader.summary(now=NOW, max_age_s=30.0)
    assert summary.as_dict() == {
        "workers": 2,
        "stopped": 2,
        "stale": 1,
        "corrupt": 0,
        "engine_queue_depth": 7,
        "live_sessions": 7,
    }
    assert reader.summary(now=NOW, max_age_s=100.0).engine_queue_depth == 57


def test_a_status_dated_ahead_counts_within_the_age_limit_and_is_stale_beyond_it(store):
    """Two machines' clocks differ a little; a writer whose clock is far ahead must not
    count as alive for ever."""
    writer = RolloutStatusBoard(store)
    writer.publish(status("w0", depth=3, age=-5.0))
    writer.publish(status("w1", depth=4, age=-31.0))
    summary = RolloutStatusBoard(store).summary(now=NOW, max_age_s=30.0)
    assert (summary.workers, summary.stale, summary.engine_queue_depth) == (1, 1, 3)


def test_a_worker_replaces_its_own_status(store):
    board = RolloutStatusBoard(store)
    board.publish(status("w0", depth=9, age=5.0))
    board.publish(status("w0", depth=2))
    statuses, corrupt = board.read()
    assert (statuses, corrupt) == ([status("w0", depth=2)], 0)
    names = store.fs.ls(store.path(ROLLOUT_STATUS_PREFIX), detail=False)
    assert [posixpath.basename(n) for n in names] == ["w0.json"], "a temp file was left behind"
    stored = json.loads(store.fs.cat_file(store.path(ROLLOUT_STATUS_PREFIX, "w0.json")))
    assert stored["engine_queue_depth"] == 2 and stored["worker"] == "w0"


@pytest.mark.parametrize(
    "payload, problem",
    [
        (b'{"worker": "w9", "time": 1.0, "engine_q', "Invalid JSON"),
        (b"", "Invalid JSON"),
        (b'{"worker": "w9", "time": 1.0, "live_sessions": 0, "running": true}', "engine_queue_depth"),
        (
            b'{"worker": "w9", "time": 1.0, "engine_queue_depth": -1, "live_sessions": 0, "running": true}',
            "engine_queue_depth",
        ),
        (b"[1, 2]", "object"),
        (
            b'{"worker": "w9", "time": Infinity, "engine_queue_depth": 0, "live_sessions": 0, "running": true}',
            "time",
        ),
        (
            b'{"worker": "w9", "time": NaN, "engine_queue_depth": 0, "live_sessions": 0, "running": true}',
            "time",
        ),
        # counts the elastic planner feeds its controller, which refuses them (a session of 0 contexts)
        (
            b'{"worker": "w9", "time": 1.0, "engine_queue_depth": 0, "live_sessions": 0, "running": true, '
            b'"session_lengths": [2.0], "session_contexts": [0]}',
            "session_contexts",
        ),
        *(
            (
                b'{"worker": "w9", "time": 1.0, "engine_queue_depth": 0, "live_sessions": 0, "running": true, '
                + field
                + b"}",
                name,
            )
            for field, name in [
                (b'"session_lengths": [2.0, NaN]', "session_lengths"),
                (b'"session_lengths": [-1.0]', "session_lengths"),
                (b'"session_ages": {"torch-0": [Infinity]}', "session_ages"),
                (b'"plan_time": NaN', "plan_time"),
            ]
        ),
        (
            b'{"worker": "w9", "time": 1.0, "engine_queue_depth": 0, "live_sessions": 0, "running": true, '
            b'"finished_rows": -1}',
            "finished_rows",
        ),
        (
            b'{"worker": "w9", "time": 1.0, "engine_queue_depth": 0, "live_sessions": 0, "running": true, '
            b'"sessions_expired": -1}',
            "sessions_expired",
        ),
    ],
)
def test_a_corrupt_status_is_skipped_with_a_warning(store, caplog, payload, problem):
    board = RolloutStatusBoard(store)
    board.publish(status("w0", depth=4, sessions=1))
    store.fs.pipe_file(store.path(ROLLOUT_STATUS_PREFIX, "w9.json"), payload)
    with caplog.at_level(logging.WARNING, logger="storage.status"):
        summary = board.summary(now=NOW)
        again = board.summary(now=NOW)
    assert summary == again
    assert (summary.workers, summary.corrupt, summary.engine_queue_depth) == (1, 1, 4)
    (record,) = caplog.records  # warned once for the same content
    message = record.getMessage()
    assert "w9.json" in message and problem in message


def test_files_that_are_not_status_objects_are_ignored(local_store, monkeypatch):
    board = RolloutStatusBoard(local_store)
    board.publish(status("w0", depth=1))
    root = local_store.path(ROLLOUT_STATUS_PREFIX)
    local_store.fs.pipe_file(posixpath.join(root, ".w1.json.tmp-abc"), b"{half")  # a crashed writer's temp
    local_store.fs.pipe_file(posixpath.join(root, ".w2.json"), b"{half")  # hidden: no worker's name
    local_store.fs.pipe_file(posixpath.join(root, "notes.txt"), b"hello")
    listed = board.fs.ls
    # a status listed, then deleted before it is read (its run's folder cleaned up meanwhile)
    monkeypatch.setattr(board.fs, "ls", lambda *a, **k: [*listed(*a, **k), posixpath.join(root, "gone.json")])
    statuses, corrupt = board.read()
    assert [s.worker for s in statuses] == ["w0"] and corrupt == 0


def test_readers_never_see_a_half_written_status(local_store):
    board = RolloutStatusBoard(local_store)
    board.publish(status("w0", depth=0))
    done = threading.Event()

    def write() -> None:
        for depth in range(300):
            board.publish(status("w0", depth=depth, sessions=depth))
        done.set()

    writer = threading.Thread(target=write)
    writer.start()
    reader = RolloutStatusBoard(local_store)
    reads = 0
    while not done.is_set() or reads == 0:
        statuses, corrupt = reader.read()
        assert corrupt == 0
        (only,) = statuses
        assert only.engine_queue_depth == only.live_sessions
        reads += 1
    writer.join()
    assert reader.read()[0][0].engine_queue_depth == 299


@pytest.mark.parametrize("name", ["", "a/b", ".hidden"])
def test_bad_worker_names_are_refused(local_store, name):
    with pytest.raises(ValueError, match="worker name"):
        RolloutStatusBoard(local_store).publish(
            RolloutStatus.model_construct(
                worker=name, time=NOW, engine_queue_depth=0, live_sessions=0, running=True
            )
        )


def test_max_age_must_be_positive(local_store):
    with pytest.raises(ValueError, match="max_age_s"):
        RolloutStatusBoard(local_store).summary(max_age_s=0)


def test_the_elastic_plan_round_trips_and_says_which_replicas_each_worker_drains(store):
    from storage.status import ElasticPlan

    board = ElasticPlanBoard(store)
    assert board.read() is None
    plan = ElasticPlan(
        time=NOW, accepting=["w0/torch-0", "w1/torch-0"], draining=["w0/torch-1"], train=["w1/torch-1"]
    )
    board.publish(plan)
    board.publish(plan.model_copy(update={"time": NOW + 1}))  # replaced, not appended
    read = ElasticPlanBoard(store).read()
    assert read == plan.model_copy(update={"time": NOW + 1})
    assert (read.drained("w0"), read.drained("w1"), read.drained("w2")) == ({"torch-1"}, {"torch-1"}, set())
    assert read.drained("w") == set(), "w0's replicas are not those of a worker named w"
    released = ElasticPlan(time=NOW, draining=["w0/torch-1"], running=False)
    assert released.drained("w0") == set(), "a stopped trainer's plan drains nothing"


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"accepting": ["w0/r0"], "draining": ["w0/r0"]}, "named more than once"),
        ({"draining": ["r0"]}, "'<worker>/<replica>'"),
        ({"train": ["w0/r0/x"]}, "'<worker>/<replica>'"),
        ({"train": ["/r0"]}, "'<worker>/<replica>'"),
    ],
)
def test_a_plan_naming_a_replica_twice_or_badly_is_refused(fields, problem):
    from storage.status import ElasticPlan

    with pytest.raises(ValueError, match=problem):
        ElasticPlan(time=NOW, **fields)


@pytest.mark.parametrize(
    ("board_class", "payload", "problem", "consequence"),
    [
        (
            ElasticPlanBoard,
            '{"time": 1, "draining": ["w0/r0"], "train": ["w0/r0"]}',
            "named more than once",
            "stay as they are",
        ),
        (
            TrainerStatusBoard,
            '{"time": 1, "buffered_tokens": -5, "token_budget": 100}',
            "buffered_tokens",
            "not held back",
        ),
    ],
)
def test_a_corrupt_status_object_reads_as_none_with_one_warning(
    local_store, caplog, board_class, payload, problem, consequence
):
    board = board_class(local_store)
    local_store.fs.makedirs(board.root, exist_ok=True)
    with open(board.path, "w") as handle:
        handle.write(payload)
    with caplog.at_level(logging.WARNING, logger="storage.status"):
        assert board.read() is None
        assert board.read() is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and problem in warnings[0] and consequence in warnings[0]


def test_an_old_status_without_replica_fields_still_reads():
    old = json.dumps(
        {"worker": "w0", "time": NOW, "engine_queue_depth": 1, "live_sessions": 2, "running": True}
    )
    read = RolloutStatus.model_validate_json(old)
    assert (read.replica_sessions, read.draining, read.plan_time) == ({}, [], None)


def test_the_trainer_status_round_trips_and_reports_its_queue_in_batches(store):

    board = TrainerStatusBoard(store)
    assert board.read() is None
    board.publish(TrainerStatus(time=NOW, buffered_tokens=3000, token_budget=1200))
    board.publish(TrainerStatus(time=NOW + 1, buffered_tokens=600, token_budget=1200, running=False))
    read = board.read()
    assert (read.time, read.buffered_tokens, read.running) == (NOW + 1, 600, False)
    assert read.queued_batches == 0.5


def test_a_held_role_is_lost_to_another_holders_fresh_running_status_only(store):
    board = TrainerStatusBoard(store)

    def trainer_status(running: bool = True, age: float = 0.0) -> TrainerStatus:
        return TrainerStatus(time=time.time() - age, buffered_tokens=0, token_budget=8, running=running)

    first, second = (HeldRole(board.read, board.publish, name) for name in ("first", "second"))
    assert first.publish(trainer_status()) and first.publish(trainer_status())  # its own status
    assert board.read().owner == first.owner
    assert not second.publish(trainer_status())  # started at once: refused, nothing written
    assert second.lost.is_set() and board.read().owner == first.owner
    assert first.publish(trainer_status(age=60.0))  # its status goes stale...
    third = HeldRole(board.read, board.publish, "third")
    assert third.publish(trainer_status())  # ...and a stale one is no holder
    assert not first.publish(trainer_status()) and first.lost.is_set()
    assert not first.publish(trainer_status(running=False))  # it never frees the new holder's role
    with pytest.raises(InUse, match="first was taken over by another process"):
        first.require()
    third.require()  # still third's: nothing raised
    assert board.read().owner == third.owner and board.read().running
    assert third.publish(trainer_status(running=False))
    # a role once lost stays lost, though its taker stopped: the first has not checked it since
    assert not first.holds() and not first.publish(trainer_status())
    fourth = HeldRole(board.read, board.publish, "fourth")
    assert fourth.publish(trainer_status()) and board.read().owner == fourth.owner  # a stopped one neither


@pytest.mark.parametrize("skew_s", [-60.0, 60.0])
def test_a_holder_whose_clock_is_off_yields_the_role_another_took_from_it(local_store, monkeypatch, skew_s):
    """Machines whose clocks differ by more than the age limit: the newcomer takes the role
    (the holder's status reads stale to it), and the holder, to which the newcomer's status
    read stale as well, kept publishing; both held it (two workers under one name)."""
    board = TrainerStatusBoard(local_store)
    real_time = time.time

    def trainer_status() -> TrainerStatus:
        return TrainerStatus(time=time.time(), buffered_tokens=0, token_budget=8)

    def off_clock() -> float:
        return real_time() + skew_s

    holder, newcomer = (HeldRole(board.read, board.publish, name, max_age_s=30.0) for name in ("a", "b"))
    monkeypatch.setattr(time, "time", off_clock)
    assert holder.publish(trainer_status())
    monkeypatch.setattr(time, "time", real_time)
    assert newcomer.publish(trainer_status())  # the holder's status reads 60 s off: no holder
    monkeypatch.setattr(time, "time", off_clock)
    assert not holder.publish(trainer_status()) and holder.lost.is_set()
    monkeypatch.setattr(time, "time", real_time)
    assert newcomer.holds() and board.read().owner == newcomer.owner


def test_of_two_holders_started_at_once_one_keeps_the_claim(store):
    """Both read no holder before either writes: each claim's read-back after the settle
    finds the later write, so exactly one of them holds the role."""
    board = TrainerStatusBoard(store)
    both_read = threading.Barrier(2)

    def read_together():
        status = board.read()
        both_read.wait(timeout=30)
        return status

    def claimed(role: HeldRole) -> bool:
        try:
            role.claim(TrainerStatus(time=time.time(), buffered_tokens=0, token_budget=8), settle_s=0.3)
        except InUse as exc:
            assert "role is in use: another process took it at the same time" in str(exc)
            return False
        return True

    roles = [HeldRole(read_together, board.publish, "role") for _ in range(2)]
    with ThreadPoolExecutor(2) as pool:
        claims = list(pool.map(claimed, roles))
    assert sorted(claims) == [False, True]
    assert board.read().owner == roles[claims.index(True)].owner


def free_name(board: RolloutStatusBoard, **timing) -> None:
    wait_until_free(lambda: board.read_worker("w0"), "rollout worker name 'w0'", "rename it", **timing)


def test_a_worker_name_is_free_when_its_status_is_missing_stopped_or_stale(local_store):
    board = RolloutStatusBoard(local_store)
    assert board.read_worker("w0") is None
    free_name(board, max_age_s=30)
    for stopped_or_stale in (
        RolloutStatus(worker="w0", time=time.time(), engine_queue_depth=0, live_sessions=0, running=False),
        RolloutStatus(
            worker="w0", time=time.time() - 31, engine_queue_depth=0, live_sessions=0, running=True
        ),
        RolloutStatus(worker="w0", time=1e300, engine_queue_depth=0, live_sessions=0, running=True),
    ):
        board.publish(stopped_or_stale)
        assert board.read_worker("w0") == stopped_or_stale
        reads = []

        def read(reads=reads):
            reads.append(1)
            return board.read_worker("w0")

        wait_until_free(read, "w0", "rename it", max_age_s=30)
        assert len(reads) == 1  # free at the first look: no waiting


@pytest.mark.timeout(180)  # a live worker never refused would be waited on for ever
def test_a_dead_workers_fresh_status_is_waited_out_and_a_live_one_refused(store, caplog):
    board = RolloutStatusBoard(store)
    dead = RolloutStatus(worker="w0", time=time.time(), engine_queue_depth=0, live_sessions=0, running=True)
    board.publish(dead)
    # 5 s: the publish and the first read (on S3, on a loaded machine) must see it still fresh
    with caplog.at_level(logging.WARNING, logger="storage.status"):
        free_name(board, max_age_s=5.0, poll_s=0.1)  # nobody updates it: a dead worker
    assert 5.0 < time.time() - dead.time < 60.0  # returned once its status went stale
    assert "waiting up to 5 s" in caplog.text

    def live_worker() -> None:
        board.publish(
            RolloutStatus(worker="w0", time=time.time(), engine_queue_depth=1, live_sessions=2, running=True)
        )

    with (
        kept_fresh(live_worker),
        pytest.raises(InUse, match="rollout worker name 'w0' is in use: a running process .*; rename it"),
    ):
        free_name(board, max_age_s=30, poll_s=0.2)


def test_a_status_write_that_fails_leaves_no_temp_file(local_store, monkeypatch):
    """A publish that failed (a full disk) left its hidden temp file: a worker publishing every
    few seconds on a full disk added one each time, never deleted."""
    board = RolloutStatusBoard(local_store)
    board.publish(status("w0", depth=1))

    def disk_full(src, dst):
        raise OSError(28, "No space left on device (injected)")

    monkeypatch.setattr("os.replace", disk_full)
    for depth in range(3):
        with pytest.raises(OSError, match="No space left"):
            board.publish(status("w0", depth=depth))
    monkeypatch.undo()
    assert local_store.fs.ls(local_store.path(ROLLOUT_STATUS_PREFIX), detail=False) == [
        local_store.path(ROLLOUT_STATUS_PREFIX, "w0.json")
    ]


def test_a_holder_whose_clock_is_ahead_is_said_to_be_ahead_not_negative_seconds_old(caplog):
    """Its status was said to be published "-10.0 s ago", a clue to nothing."""
    ahead = time.time() + 10
    statuses = iter([ahead, ahead + 2])

    def read() -> RolloutStatus:
        return RolloutStatus(
            worker="w0", time=next(statuses), engine_queue_depth=0, live_sessions=0, running=True
        )

    with caplog.at_level(logging.WARNING, logger="storage.status"), pytest.raises(InUse) as raised:
        wait_until_free(read, "w0", "rename it", max_age_s=30, poll_s=0)
    assert "published its status dated 10 s ahead of this machine's clock;" in caplog.text
    assert "updated its status dated 12 s ahead of this machine's clock;" in str(raised.value)
    assert " s ago" not in caplog.text + str(raised.value)
