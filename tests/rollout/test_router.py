"""Router: consistent hashing with bounded loads, least-loaded and round-robin policies,
minimal remapping when replicas come and go, failover of a dead replica."""

from __future__ import annotations

import asyncio
import logging
import math
import random

import pytest

from rollout.engines.base import EngineError, Generation, NotServing, SamplingParams
from rollout.router import SESSION_LENGTHS_KEPT, HashRing, NoReplicas, Router, RouterConfig, _hash

SESSIONS = [f"session-{i}" for i in range(4000)]


def test_ring_owner_is_first_point_clockwise():
    ring = HashRing(["a", "b", "c"], virtual_nodes=8)
    points = sorted(ring._points)
    owners = dict(zip(ring._points, ring._owners, strict=True))

    for key in SESSIONS[:200]:
        h = _hash(key)
        after = [p for p in points if p > h]
        expected = owners[after[0] if after else points[0]]
        assert ring.owner(key) == expected


@pytest.mark.parametrize("n", [3, 4, 8])
def test_adding_a_replica_moves_about_one_over_n_plus_one(n):
    ring = HashRing([f"r{i}" for i in range(n)], virtual_nodes=160)
    before = {s: ring.owner(s) for s in SESSIONS}
    ring.add(f"r{n}")
    after = {s: ring.owner(s) for s in SESSIONS}
    moved = [s for s in SESSIONS if before[s] != after[s]]
    assert all(after[s] == f"r{n}" for s in moved), "only sessions taken by the new replica move"
    assert len(moved) / len(SESSIONS) <= 1 / (n + 1) + 0.05
    assert len(moved) / len(SESSIONS) >= 1 / (n + 1) - 0.05


def test_removing_a_replica_moves_only_its_sessions():
    ring = HashRing([f"r{i}" for i in range(5)], virtual_nodes=160)
    before = {s: ring.owner(s) for s in SESSIONS}
    ring.remove("r2")
    for s in SESSIONS:
        if before[s] != "r2":
            assert ring.owner(s) == before[s]
        else:
            assert ring.owner(s) != "r2"


def test_ring_rejects_duplicates_and_unknown():
    ring = HashRing(["a"])
    with pytest.raises(ValueError, match="already"):
        ring.add("a")
    with pytest.raises(KeyError, match="not on the ring"):
        ring.remove("b")
    with pytest.raises(NoReplicas):
        HashRing().owner("x")


def _replicas(n: int, prefix: str = "r"):
    """Real VLLMEngine clients pointed at a closed port: routing never contacts them, and a
    request sent to one fails the way a dead server does."""
    from rollout.engines.vllm_engine import VLLMEngine, VLLMEngineConfig

    config = VLLMEngineConfig(base_url="http://127.0.0.1:9", connect_timeout_s=1.0, timeout_s=5.0)
    return [VLLMEngine(config, name=f"{prefix}{i}") for i in range(n)]


def _answer_health_from(engines, up: dict[str, bool]) -> None:
    """Make each engine's health probe answer ``up[its name]``, read at each probe."""
    for engine in engines:

        async def health(name=engine.name) -> bool:
            return up[name]

        engine.health = health


def _a_request_fails(router: Router, engines) -> None:
    """Session ``s``'s request fails with the dead server's error; the engines are closed after."""

    async def body():
        try:
            with pytest.raises(EngineError, match="unreachable"):
                await router.generate("s", [1, 2, 3], SamplingParams(max_new_tokens=2))
        finally:
            for engine in engines:
                await engine.close()

    asyncio.run(body())


def test_sticky_sessions_keep_their_replica_and_loads_are_bounded():
    eps = 0.1
    router = Router(_replicas(4), RouterConfig(policy="sticky", load_epsilon=eps))
    first = {s: router.route(s).name for s in SESSIONS[:400]}
    assert all(router.route(s).name == first[s] for s in SESSIONS[:400])
    loads = [router.load(n) for n in router.replicas]
    assert sum(loads) == 400
    assert max(loads) <= math.ceil((1 + eps) * 400 / 4)
    ring = HashRing(router.replicas, virtual_nodes=router.config.virtual_nodes)
    at_owner = sum(first[s] == ring.owner(s) for s in SESSIONS[:400])
    assert at_owner >= 0.8 * 400, "most sessions still land on their hash owner"


def test_bounded_load_reference_walk():
    """Each new session takes the first replica clockwise whose load is under capacity,
    checked against a loop written out here."""
    eps = 0.05
    router = Router(_replicas(3), RouterConfig(policy="sticky", load_epsilon=eps, virtual_nodes=16))
    ring = HashRing(router.replicas, virtual_nodes=16)
    clockwise = sorted(zip(ring._points, ring._owners, strict=True))
    loads = dict.fromkeys(router.replicas, 0)
    past_second = 0
    for s in SESSIONS[:300]:
        capacity = math.ceil((1 + eps) * (sum(loads.values()) + 1) / 3)
        h = _hash(s)
        order = [o for p, o in clockwise if p > h] + [o for p, o in clockwise if p <= h]
        walk = list(dict.fromkeys(order))
        expected = next((n for n in walk if loads[n] < capacity), walk[0])
        past_second += expected == walk[2]
        loads[expected] += 1
        assert router.route(s).name == expected
    assert past_second > 0, "some sessions find their owner and the next replica both full"


def test_adding_a_replica_keeps_assigned_sessions_and_new_sessions_remap_minimally():
    router = Router(_replicas(4), RouterConfig(policy="sticky", load_epsilon=10.0))
    old = {s: router.route(s).name for s in SESSIONS[:500]}
    router.add(_replicas(1, prefix="new")[0])
    assert all(router.route(s).name == old[s] for s in SESSIONS[:500])
    fresh = Router(_replicas(4), RouterConfig(policy="sticky", load_epsilon=10.0))
    before = {s: fresh.route(s).name for s in SESSIONS[500:2500]}
    grown = Router(
        [*_replicas(4), *_replicas(1, prefix="new")], RouterConfig(policy="sticky", load_epsilon=10.0)
    )
    moved = sum(grown.route(s).name != before[s] for s in SESSIONS[500:2500])
    assert moved / 2000 <= 1 / 5 + 0.05


def test_removing_a_replica_reassigns_only_its_sessions():
    router = Router(_replicas(4), RouterConfig(policy="sticky", load_epsilon=10.0))
    old = {s: router.route(s).name for s in SESSIONS[:400]}
    router.remove("r1")
    assert router.load("r1") == 0
    for s in SESSIONS[:400]:
        now = router.route(s).name
        assert now != "r1"
        if old[s] != "r1":
            assert now == old[s]


def test_least_loaded_heap_and_end_session():
    router = Router(_replicas(3), RouterConfig(policy="least_loaded"))
    for s in SESSIONS[:30]:
        router.route(s)
    assert sorted(router.load(n) for n in router.replicas) == [10, 10, 10]
    victims = [s for s in SESSIONS[:30] if router.assignment(s) == "r2"][:4]
    for s in victims:
        router.end_session(s)
    assert router.load("r2") == 6
    new = [router.route(f"new-{i}").name for i in range(4)]
    assert new == ["r2"] * 4, "freed capacity is filled first"
    assert router.route(SESSIONS[0]).name == router.assignment(SESSIONS[0]), "sticky once assigned"


def test_round_robin_cycles_per_request():
    router = Router(_replicas(3), RouterConfig(policy="round_robin"))
    names = [router.route("same-session").name for _ in range(6)]
    assert names == ["r0", "r1", "r2", "r0", "r1", "r2"]


def test_no_replicas_is_an_engine_error():
    router = Router([], RouterConfig())
    with pytest.raises(NoReplicas):
        router.route("s")
    assert issubclass(NoReplicas, EngineError)


def test_random_add_remove_keeps_loads_consistent():
    rng = random.Random(0)
    router = Router(_replicas(4), RouterConfig(policy="sticky"))
    spare = _replicas(4, prefix="x")
    live: set[str] = set()
    for step in range(600):
        op = rng.random()
        if op < 0.6:
            s = f"s{step}"
            router.route(s)
            live.add(s)
        elif op < 0.9 and live:
            s = rng.choice(sorted(live))
            router.end_session(s)
            live.discard(s)
        elif op < 0.95 and spare:
            router.add(spare.pop())
        elif len(router.replicas) > 1:
            router.remove(rng.choice(router.replicas))
        assigned = [router.assignment(s) for s in live]
        for name in router.replicas:
            assert router.load(name) == sum(a == name for a in assigned)


@pytest.mark.parametrize("policy", ["sticky", "least_loaded", "round_robin"])
def test_new_sessions_avoid_a_draining_replica_until_undrained(policy):
    router = Router(_replicas(3), RouterConfig(policy=policy))
    router.drain("r1")
    assert router.draining == ["r1"]
    assert "r1" not in {router.route(s).name for s in SESSIONS[:300]}
    assert router.load("r1") == 0
    router.drain("r0")
    router.drain("r2")
    with pytest.raises(NoReplicas, match="draining"):
        router.route("one-more")
    router.undrain("r0")
    router.undrain("r2")
    router.undrain("r1")
    assert "r1" in {router.route(s).name for s in SESSIONS[300:600]}
    with pytest.raises(KeyError, match="not draining"):
        router.undrain("r1")
    with pytest.raises(KeyError, match="not known"):
        router.drain("nope")


@pytest.mark.parametrize("policy", ["sticky", "least_loaded"])
def test_sessions_move_off_a_draining_replica_at_their_next_turn(policy):
    router = Router(_replicas(4), RouterConfig(policy=policy))
    before = {s: router.route(s).name for s in SESSIONS[:400]}
    on_r2 = [s for s in SESSIONS[:400] if before[s] == "r2"]
    router.drain("r2")
    assert router.load("r2") == len(on_r2) > 0, "draining moves nothing by itself"
    for i, s in enumerate(on_r2):
        assert router.route(s).name != "r2"
        assert router.load("r2") == len(on_r2) - i - 1
    assert router.migrations == len(on_r2)
    assert all(router.route(s).name == before[s] for s in SESSIONS[:400] if s not in on_r2)
    assert sum(router.load(n) for n in router.replicas) == 400
    if policy == "least_loaded":
        loads = sorted(router.load(n) for n in ["r0", "r1", "r3"])
        assert loads[-1] - loads[0] <= 1, "each moved session goes to the least loaded replica"


def test_without_migration_a_drained_session_stays_until_it_ends():
    router = Router(_replicas(3), RouterConfig(policy="least_loaded", migrate_on_drain=False))
    for s in SESSIONS[:30]:
        router.route(s)
    on_r0 = [s for s in SESSIONS[:30] if router.assignment(s) == "r0"]
    router.drain("r0")
    assert all(router.route(s).name == "r0" for s in on_r0)
    assert router.load("r0") == len(on_r0) and router.migrations == 0
    assert router.route("new").name != "r0"
    for s in on_r0:
        router.end_session(s)
    assert router.load("r0") == 0


def test_a_session_moves_only_to_a_replica_with_a_free_slot():
    router = Router(_replicas(2), RouterConfig(policy="least_loaded", migration_slots=2))
    for s in SESSIONS[:4]:
        router.route(s)
    on_r0 = [s for s in SESSIONS[:4] if router.assignment(s) == "r0"]
    on_r1 = [s for s in SESSIONS[:4] if router.assignment(s) == "r1"]
    assert len(on_r0) == len(on_r1) == 2
    router.drain("r0")
    assert router.route(on_r0[0]).name == "r0", "r1 is full: the session stays"
    router.end_session(on_r1[0])
    assert router.route(on_r0[0]).name == "r1"
    assert router.route(on_r0[1]).name == "r0"
    assert (router.load("r0"), router.load("r1"), router.migrations) == (1, 2, 1)


def test_a_generation_in_flight_finishes_on_its_replica_and_the_next_turn_moves():
    """Real TorchEngine replicas on the tiny model: drained mid-generation, the turn's tokens
    and log-probs equal an undisturbed run's; the next turn re-prefills the whole history on
    the new replica and the old one drops the session's cache."""
    import copy

    import torch

    from rl.models import TinyModelConfig, build_tiny_model
    from rollout.engines.torch_engine import TorchEngine

    torch.manual_seed(0)
    model, tokenizer = build_tiny_model(
        TinyModelConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64)
    )
    params = SamplingParams(max_new_tokens=12, seed=7)
    prompt = tokenizer.encode("What is 2 + 3?")

    async def body():
        engines = [TorchEngine(copy.deepcopy(model), tokenizer, name=f"r{i}") for i in range(2)]
        reference = TorchEngine(copy.deepcopy(model), tokenizer, name="reference")
        router = Router(engines, RouterConfig(policy="least_loaded"))
        try:
            expected = await reference.generate("s", prompt, params)
            turn = asyncio.create_task(router.generate("s", prompt, params))
            await asyncio.sleep(0)  # the task routes and awaits its engine
            assert router.assignment("s") == "r0"
            router.drain("r0")
            assert router.route("s").name == "r0", "no turn boundary while a generation is in flight"
            first = await turn
            assert (first.engine, first.token_ids, first.logprobs) == (
                "r0",
                expected.token_ids,
                expected.logprobs,
            )
            history = [*prompt, *first.token_ids, *tokenizer.encode(" ok")]
            second = await router.generate("s", history, params)
            assert second.engine == "r1" and router.assignment("s") == "r1"
            assert (router.load("r0"), router.load("r1"), router.migrations) == (0, 1, 1)
            assert engines[1].stats().prefill_computed == len(history), "the whole history is re-prefilled"
            assert engines[0].stats().extra["cache_sessions"] == 0.0
        finally:
            for engine in [*engines, reference]:
                await engine.close()

    asyncio.run(body())


def test_session_ages_and_lengths_count_from_first_routing_across_moves(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr("rollout.router.time.monotonic", lambda: clock[0])
    router = Router(_replicas(2), RouterConfig(policy="least_loaded"))
    first = router.route("a").name
    clock[0] = 103.0
    second = router.route("b").name
    assert first != second
    clock[0] = 110.0
    assert router.session_ages() == {first: [10.0], second: [7.0]}
    router.drain(first)
    assert router.route("a").name == second, "migrated"
    router.remove(second)  # its sessions are re-pinned at their next turn
    router.undrain(first)
    assert router.route("b").name == first and router.route("a").name == first
    clock[0] = 112.0
    assert sorted(router.session_ages()[first]) == [9.0, 12.0], "moves keep each session's start"
    router.end_session("a")
    router.end_session("a")  # ending twice counts once
    router.end_session("never-routed")
    assert (router.sessions_ended, list(router.session_lengths)) == (1, [12.0])
    assert router.session_ages() == {first: [9.0]}


def test_a_session_ended_for_idling_frees_its_replica_but_is_no_ended_rollout(monkeypatch):
    """A gateway ends a session its client left unused past its idle timeout (a harness that
    crashed): its replica is released (a drained one empties), but no record of it reaches the
    trainer, so it counts in ``sessions_expired`` and not in ``sessions_ended`` nor the lengths
    the elastic controller forecasts finished trajectories from; a compacted rollout whose last
    context idled out counts once, as expired."""
    clock = [0.0]
    monkeypatch.setattr("rollout.router.time.monotonic", lambda: clock[0])
    router = Router(_replicas(2), RouterConfig(policy="least_loaded", migrate_on_drain=False))
    crashed = router.route("crashed").name
    router.route("finished")
    router.drain(crashed)
    clock[0] = 1850.0
    router.end_session("crashed", expired=True)
    router.end_session("finished")
    assert router.load(crashed) == 0 and router.assignment("crashed") is None
    assert (router.sessions_ended, router.sessions_expired) == (1, 1)
    assert (list(router.session_lengths), list(router.session_contexts)) == ([1850.0], [1])
    router.route("c1")
    router.end_session("c1", continued_in="c2")
    router.route("c2")
    router.end_session("c2", expired=True)
    router.end_session("c2", expired=True)  # ending twice counts once
    router.end_session("never-routed", expired=True)
    assert (router.sessions_ended, router.sessions_expired, list(router.session_lengths)) == (1, 2, [1850.0])
    # one its gateway opened and ends once (known), its client gone before its first turn
    router.end_session("opened, never routed", expired=True, known=True)
    assert (router.sessions_ended, router.sessions_expired, list(router.session_lengths)) == (1, 3, [1850.0])
    assert router.session_ages() == {name: [] for name in router.replicas}


def test_round_robin_counts_no_session_ended_for_idling():
    """``round_robin`` tracks no session, so it counts none as ended nor expired, routed or
    ended by its gateway before its first turn alike: its counts stay all zero, not a part."""
    router = Router(_replicas(2), RouterConfig(policy="round_robin"))
    router.route("routed")
    router.end_session("routed", expired=True)
    router.end_session("opened, never routed", expired=True, known=True)
    router.end_session("finished", known=True)
    assert (router.sessions_ended, router.sessions_expired) == (0, 0)


def test_a_session_ended_for_idling_after_its_record_is_an_ended_rollout_without_its_idle_time(monkeypatch):
    """A gateway ends a session left unused past its idle timeout whose client got its record
    and never ended it: the record may reach the trainer, so the session counts as an ended
    rollout, as long as up to its last request (``idle_s``, its idle time, left out); a
    compacted rollout counts from its first context's start."""
    clock = [10.0]
    monkeypatch.setattr("rollout.router.time.monotonic", lambda: clock[0])
    router = Router(_replicas(2), RouterConfig(policy="least_loaded"))
    router.route("recorded")
    router.route("c1")
    clock[0] = 20.0
    router.end_session("c1", continued_in="c2")
    router.route("c2")
    clock[0] = 1860.0
    router.end_session("recorded", idle_s=1800.0)
    router.end_session("c2", idle_s=1820.0)
    assert (router.sessions_ended, router.sessions_expired) == (2, 0)
    assert (list(router.session_lengths), list(router.session_contexts)) == ([50.0, 30.0], [1, 2])
    assert router.session_ages() == {name: [] for name in router.replicas}
    # an idle time longer than the router saw the session (the gateway's clock read apart) is no
    # negative length
    router.route("brief")
    clock[0] = 1865.0
    router.end_session("brief", idle_s=60.0)
    assert list(router.session_lengths)[-1] == 0.0
    router.route("s")
    for bad in (-1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match=r"^idle_s=\S+ is not a finite number of seconds >= 0$"):
            router.end_session("s", idle_s=bad)
    assert router.assignment("s") is not None, "a refused end leaves the session routed"


def test_a_rollout_continued_in_a_new_session_ends_once_and_is_as_old_as_its_first(monkeypatch):
    """A compacted rollout's contexts: each ending frees its replica (a drained one empties at
    that boundary, migration off), and the rollout ends once, as long as all of them."""
    clock = [0.0]
    monkeypatch.setattr("rollout.router.time.monotonic", lambda: clock[0])
    router = Router(_replicas(2), RouterConfig(policy="least_loaded", migrate_on_drain=False))
    first = router.route("c1").name
    router.drain(first)
    clock[0] = 10.0
    assert router.route("c1").name == first, "no migration: it stays until its context ends"
    router.end_session("c1", continued_in="c2")
    assert router.load(first) == 0 and router.sessions_ended == 0
    clock[0] = 15.0
    second = router.route("c2").name
    assert second != first and router.session_ages() == {first: [], second: [15.0]}
    clock[0] = 20.0
    router.end_session("c2", continued_in="c3")
    router.end_session("c3")  # it ended before routing its first turn
    assert (router.sessions_ended, list(router.session_lengths)) == (1, [20.0])
    assert list(router.session_contexts) == [3]
    router.route("s")
    router.end_session("s")
    assert list(router.session_contexts) == [3, 1]
    router.route("c3")  # an id ended before, used again for a rollout of its own
    router.end_session("c3")
    assert list(router.session_contexts) == [3, 1, 1]
    with pytest.raises(ValueError, match="cannot continue in itself"):
        router.end_session("c4", continued_in="c4")


def test_a_session_ended_while_its_failed_replica_is_probed_is_not_pinned_again():
    """The client closes its session while the router probes the replica its request failed
    on: the request fails and the session stays unpinned, instead of being re-pinned to the
    next replica, where nothing would ever release it."""

    engines = _replicas(2)
    router = Router(engines, RouterConfig(policy="sticky", failover=True))
    failing = router.route("s")

    async def probe_while_the_session_ends() -> bool:
        router.end_session("s")
        return False  # the replica is down

    failing.health = probe_while_the_session_ends

    _a_request_fails(router, engines)
    (other,) = router.replicas
    assert other != failing.name
    assert router.assignment("s") is None and router.load(other) == 0
    assert router.session_ages() == {other: []} and router.sessions_ended == 1


def test_a_replica_that_keeps_failing_its_restore_is_warned_of_once_per_error(caplog):
    """A replica whose probe answers but whose restore keeps failing (its worker's version too
    stale, its weights unreadable) was warned of at every health check while it lasted; now once
    per error, again when the error changes, and again after it came back and failed anew."""
    engines = _replicas(2)
    router = Router(engines, RouterConfig(policy="sticky"))
    up = {"r0": False, "r1": True}
    errors = ["weights unreadable"] * 3 + ["version 4 is too stale"] * 2 + [None] + ["weights unreadable"]

    _answer_health_from(engines, up)

    async def restore(engine) -> None:
        error = errors.pop(0)
        if error is not None:
            raise OSError(error)

    async def body():
        try:
            await router.check_health(restore=restore)
            up["r0"] = True
            for _ in range(6):
                await router.check_health(restore=restore)
            assert sorted(router.replicas) == ["r0", "r1"]
            up["r0"] = False
            await router.check_health(restore=restore)
            up["r0"] = True
            await router.check_health(restore=restore)
        finally:
            for engine in engines:
                await engine.close()

    with caplog.at_level(logging.WARNING, logger="rollout.router"):
        asyncio.run(body())
    warned = [
        r.getMessage().rpartition(": ")[2]
        for r in caplog.records
        if "could not be restored" in r.getMessage()
    ]
    assert warned == ["weights unreadable", "version 4 is too stale", "weights unreadable"]
    assert errors == []


def test_a_recovered_replica_is_restored_before_it_is_back_in_service():
    """``check_health`` awaits ``restore`` on a replica that came back before routing to it
    again; while ``restore`` fails, the replica stays out."""

    engines = _replicas(2)
    router = Router(engines, RouterConfig(policy="sticky"))
    up = {"r0": False, "r1": True}
    restored = []

    _answer_health_from(engines, up)

    async def restore(engine) -> None:
        if not restored:
            restored.append(("failed", engine.name))
            raise OSError("weights unreadable")
        restored.append((engine.name, engine.name in router.replicas))

    async def body():
        try:
            assert await router.check_health(restore=restore) == {"r0": False, "r1": True}
            assert router.replicas == ["r1"]
            up["r0"] = True
            await router.check_health(restore=restore)
            assert router.replicas == ["r1"], "the replica stays out while restoring it fails"
            await router.check_health(restore=restore)
            assert sorted(router.replicas) == ["r0", "r1"]
        finally:
            for engine in engines:
                await engine.close()

    asyncio.run(body())
    assert restored == [("failed", "r0"), ("r0", False)], "restored once, while still out of service"


def test_a_replica_two_concurrent_checks_restore_is_put_back_once(caplog):
    """The worker's periodic check and another one (a weight load's) both find r0 recovered
    and both await ``restore`` on it; the first to finish puts it back, the second leaves it
    in service (it would raise adding it again): each check answers, r0 serves once."""

    engines = _replicas(2)
    router = Router(engines, RouterConfig(policy="sticky"))
    up = {"r0": False, "r1": True}
    _answer_health_from(engines, up)
    restoring: list[tuple[str, bool]] = []

    async def body():
        both_restoring, release = asyncio.Event(), asyncio.Event()

        async def restore(engine) -> None:
            restoring.append((engine.name, engine.name in router.replicas))
            if len(restoring) == 2:
                both_restoring.set()
            await release.wait()

        try:
            await router.check_health()
            assert router.down == ["r0"]
            up["r0"] = True
            checks = [asyncio.create_task(router.check_health(restore=restore)) for _ in range(2)]
            await both_restoring.wait()
            release.set()
            return await asyncio.gather(*checks)
        finally:
            for engine in engines:
                await engine.close()

    with caplog.at_level("INFO", logger="rollout.router"):
        answers = asyncio.run(body())
    assert answers == [{"r1": True, "r0": True}] * 2
    assert restoring == [("r0", False), ("r0", False)]
    assert sorted(router.replicas) == ["r0", "r1"] and router.down == []
    assert [r.getMessage() for r in caplog.records if "putting it back" in r.getMessage()] == [
        "replica r0 is healthy again; putting it back"
    ]
    assert {router.route(session).name for session in SESSIONS[:200]} == {"r0", "r1"}


def test_when_the_last_accepting_replica_fails_the_least_loaded_draining_one_accepts_again():
    """The elastic plan left r0 accepting and drains r1 and r2; r0 fails its probe: new
    sessions go to the least loaded draining replica instead of failing with NoReplicas."""

    engines = _replicas(3)
    router = Router(engines, RouterConfig(policy="sticky"))
    for session in SESSIONS[:30]:
        router.route(session)
    router.drain("r1")
    router.drain("r2")
    router.end_session(next(s for s in SESSIONS[:30] if router.assignment(s) == "r2"))
    up = {"r0": False, "r1": True, "r2": True}
    _answer_health_from(engines, up)

    async def body():
        try:
            await router.check_health()
        finally:
            for engine in engines:
                await engine.close()

    loads = {name: router.load(name) for name in ("r1", "r2")}
    asyncio.run(body())
    reopened = min(loads, key=loads.get)
    assert router.replicas == ["r1", "r2"] and router.draining == sorted({"r1", "r2"} - {reopened})
    assert router.route("a new session").name == reopened


def test_a_replica_whose_probe_hangs_is_taken_out_and_the_others_are_probed():

    engines = _replicas(2)
    router = Router(engines, RouterConfig(policy="sticky", health_timeout_s=0.2))
    hung = asyncio.Event()

    async def hangs() -> bool:
        await hung.wait()
        return True

    async def answers() -> bool:
        return True

    engines[0].health, engines[1].health = hangs, answers

    async def body():
        try:
            return await asyncio.wait_for(router.check_health(), 30)
        finally:
            for engine in engines:
                await engine.close()

    assert asyncio.run(body()) == {"r0": False, "r1": True}
    assert router.replicas == ["r1"]


def test_a_draining_replica_that_goes_down_and_comes_back_is_still_draining():
    """r1 drains (the elastic plan is handing it elsewhere), fails a probe and recovers while
    r0 still accepts: it comes back draining, and new sessions keep away from it."""

    engines = _replicas(2)
    router = Router(engines, RouterConfig(policy="sticky"))
    router.drain("r1")
    up = {"r0": True, "r1": False}
    _answer_health_from(engines, up)

    async def body():
        try:
            await router.check_health()
            assert router.down == ["r1"] and router.draining == ["r1"]
            up["r1"] = True
            await router.check_health()
        finally:
            for engine in engines:
                await engine.close()

    asyncio.run(body())
    assert sorted(router.replicas) == ["r0", "r1"] and router.draining == ["r1"]
    assert {router.route(session).name for session in SESSIONS[:50]} == {"r0"}


def test_a_draining_replica_back_while_the_accepting_one_is_down_accepts_again():
    """r1 drains and goes down; r0, the replica accepting, goes down too; r1 comes back alone:
    new sessions go to it, as they would have had r0 failed while r1 was up, rather than
    failing with NoReplicas until r0 is back."""

    engines = _replicas(2)
    router = Router(engines, RouterConfig(policy="sticky"))
    router.drain("r1")
    up = {"r0": True, "r1": False}
    _answer_health_from(engines, up)

    async def body():
        try:
            await router.check_health()
            up["r0"] = False
            await router.check_health()
            assert router.replicas == []
            up["r1"] = True
            await router.check_health()
        finally:
            for engine in engines:
                await engine.close()

    asyncio.run(body())
    assert router.replicas == ["r1"] and router.draining == []
    assert router.route("a new session").name == "r1"


def test_an_aborted_generation_is_an_engine_failure_failed_over_when_its_replica_is_down():
    """A vLLM server shutting down ends its requests with finish_reason abort: that cut
    action is not returned as the policy's. Its replica found down, the request is retried on
    another; found up (a pause), the request fails with EngineError."""

    engines = _replicas(2)
    router = Router(engines, RouterConfig(policy="sticky", failover=True))
    up = {"r0": True, "r1": True}
    for engine in engines:

        async def generate(session_id, prompt_ids, params, name=engine.name) -> Generation:
            reason = "abort" if name == aborting else "stop"
            return Generation([5, 6], [-0.5, -0.5], [0, 0], reason, engine=name)

        async def health(name=engine.name) -> bool:
            return up[name]

        engine.generate, engine.health = generate, health

    params = SamplingParams(max_new_tokens=2)

    async def body():
        try:
            with pytest.raises(EngineError, match="aborted the generation after 2 tokens"):
                await router.generate("s", [1, 2, 3], params)
            assert router.replicas == ["r0", "r1"], "a replica that answers its probe stays"
            up[aborting] = False
            return await router.generate("s", [1, 2, 3], params)
        finally:
            for engine in engines:
                await engine.close()

    aborting = router.route("s").name
    generation = asyncio.run(body())
    assert generation.finish_reason == "stop" and generation.engine != aborting
    assert router.replicas == [generation.engine] and router.assignment("s") == generation.engine


@pytest.mark.parametrize("policy", ["sticky", "round_robin"])
def test_an_ended_session_is_forgotten_by_the_replicas_that_may_cache_it(policy):
    """A pinned session's replica alone drops its cache; under round_robin, which pins
    nothing, every replica in service does (any may hold some of it)."""
    engines = _replicas(3)
    told: list[tuple[str, str]] = []
    for engine in engines:
        engine.end_session = lambda session_id, name=engine.name: told.append((name, session_id))
    router = Router(engines, RouterConfig(policy=policy))
    served = router.route("s").name
    router.end_session("s")
    expected = ["r0", "r1", "r2"] if policy == "round_robin" else [served]
    assert sorted(told) == [(name, "s") for name in expected]


def test_a_replica_that_is_down_can_be_set_draining_and_comes_back_draining():
    """The elastic plan may drain a replica while its health check has it out: it is known,
    so the drain holds, and it takes no new session once back."""

    engines = _replicas(2)
    router = Router(engines, RouterConfig(policy="sticky"))
    router.take_down("r1")
    router.drain("r1")
    assert router.down == ["r1"] and router.draining == ["r1"]
    _answer_health_from(engines, {"r0": True, "r1": True})

    async def body():
        try:
            await router.check_health()
        finally:
            for engine in engines:
                await engine.close()

    asyncio.run(body())
    assert sorted(router.replicas) == ["r0", "r1"] and router.draining == ["r1"]
    assert {router.route(session).name for session in SESSIONS[:50]} == {"r0"}


def test_session_lengths_keep_only_the_most_recent_ended_sessions(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr("rollout.router.time.monotonic", lambda: clock[0])
    router = Router(_replicas(2))
    for i in range(SESSION_LENGTHS_KEPT + 5):
        clock[0] = float(i)
        router.route(f"s{i}")
        clock[0] += i
        router.end_session(f"s{i}")
    assert router.sessions_ended == SESSION_LENGTHS_KEPT + 5
    assert list(router.session_lengths) == [float(i) for i in range(5, SESSION_LENGTHS_KEPT + 5)]


def test_a_finished_generation_leaves_no_in_flight_count_behind():
    """The in-flight count of a session whose requests all finished is dropped, not kept at
    zero: a worker routes sessions for days."""

    engines = _replicas(2)
    router = Router(engines, RouterConfig(failover=False))

    async def body():
        try:
            for session in ("a", "b"):
                with pytest.raises(EngineError):
                    await router.generate(session, [1, 2], SamplingParams(max_new_tokens=1))
        finally:
            for engine in engines:
                await engine.close()

    asyncio.run(body())
    assert router._in_flight == {}


def test_a_draining_replica_taken_out_of_service_is_no_longer_draining():
    """``remove`` forgets the drain: ``draining`` names replicas in service or down only, and
    the replica put back later takes new sessions like any other."""
    engines = _replicas(2)
    router = Router(engines, RouterConfig(policy="least_loaded"))
    router.drain("r1")
    router.remove("r1")
    assert router.draining == []
    router.add(engines[1])
    router.route("a")
    assert router.route("b").name == "r1"


def test_a_replica_not_serving_is_taken_out_though_its_probe_answers_up():
    """A replica whose weight reload failed midway is up (its probe answers) but refuses to
    generate with NotServing: the request fails over, and the replica stays out until a
    health check restores it, instead of the request failing while it stays in service."""

    engines = _replicas(2)
    router = Router(engines, RouterConfig(policy="sticky", failover=True))
    stuck = router.route("s").name
    for engine in engines:

        async def generate(session_id, prompt_ids, params, name=engine.name) -> Generation:
            if name == stuck:
                raise NotServing(f"replica {name} serves no weight version")
            return Generation([5, 6], [-0.5, -0.5], [0, 0], "stop", engine=name)

        async def health() -> bool:
            return True

        engine.generate, engine.health = generate, health

    async def body():
        try:
            return await router.generate("s", [1, 2, 3], SamplingParams(max_new_tokens=2))
        finally:
            for engine in engines:
                await engine.close()

    generation = asyncio.run(body())
    assert generation.engine != stuck and generation.finish_reason == "stop"
    assert router.down == [stuck] and router.assignment("s") == generation.engine


def test_a_replica_whose_probe_raises_is_taken_out_and_the_others_are_probed():
    """A health probe that raises (a dead actor's client) counts as down for that replica
    alone: the check answers for every replica instead of raising."""

    engines = _replicas(2)
    router = Router(engines, RouterConfig(policy="sticky"))

    async def raises() -> bool:
        raise RuntimeError("the actor died unexpectedly")

    async def answers() -> bool:
        return True

    engines[0].health, engines[1].health = raises, answers

    async def body():
        try:
            return await router.check_health()
        finally:
            for engine in engines:
                await engine.close()

    assert asyncio.run(body()) == {"r0": False, "r1": True}
    assert router.replicas == ["r1"] and router.down == ["r0"]


def test_without_failover_a_failed_request_raises_and_its_replica_stays_in_service():
    """failover off: an engine error is the caller's, even from a replica whose probe says
    down; the router neither probes it out nor retries elsewhere."""

    engines = _replicas(2)
    router = Router(engines, RouterConfig(policy="sticky", failover=False))
    _answer_health_from(engines, {"r0": False, "r1": False})
    served = router.route("s").name

    _a_request_fails(router, engines)
    assert router.replicas == ["r0", "r1"] and router.down == [] and router.assignment("s") == served


def test_two_requests_failing_on_one_replica_at_once_both_fail_over():
    """Two sessions' requests fail on the same replica and both probe it: the first takes it
    out, the second finds it out already and retries too, rather than failing because the
    replica is no longer in service."""

    engines = _replicas(2)
    router = Router(engines, RouterConfig(policy="sticky", failover=True))
    first, second = [s for s in SESSIONS if router.route(s).name == "r0"][:2]

    async def body():
        both_probing = asyncio.Barrier(2)
        for engine in engines:

            async def generate(session_id, prompt_ids, params, name=engine.name) -> Generation:
                if name == "r0":
                    raise EngineError("replica r0 is unreachable")
                return Generation([5], [-0.5], [0], "stop", engine=name)

            async def health(name=engine.name) -> bool:
                if name == "r0":
                    await both_probing.wait()
                return name != "r0"

            engine.generate, engine.health = generate, health
        try:
            params = SamplingParams(max_new_tokens=1)
            return await asyncio.gather(*(router.generate(s, [1, 2], params) for s in (first, second)))
        finally:
            for engine in engines:
                await engine.close()

    generations = asyncio.run(body())
    assert [g.engine for g in generations] == ["r1", "r1"]
    assert router.replicas == ["r1"] and router.down == ["r0"]


def test_a_session_cannot_both_expire_and_continue_in_another():
    """An expired session's client is gone: no session goes on with its rollout. Ending one so
    with ``continued_in`` counted it expired and dropped the continuation's start, so that
    branch's end later counted nowhere; it is refused, the session left routed."""
    router = Router(_replicas(2), RouterConfig(policy="least_loaded"))
    router.route("c1")
    with pytest.raises(
        ValueError, match=r"^session 'c1' expired: it continues in no session \('c2' given\)$"
    ):
        router.end_session("c1", continued_in="c2", expired=True)
    assert router.assignment("c1") is not None and router.sessions_expired == 0


def _wedge(engines, wedged: set[str], served: list[str] | None = None) -> None:
    """Replicas named in ``wedged`` fail every generation with an engine error while their
    probe answers up (vLLM answering 500 to every completion, /health OK); the others serve,
    appending their name to ``served``."""
    for engine in engines:

        async def generate(session_id, prompt_ids, params, name=engine.name) -> Generation:
            if name in wedged:
                raise EngineError(f"vLLM server {name} answered 500 on /v1/completions")
            if served is not None:
                served.append(name)
            return Generation([5], [-0.5], [0], "stop", engine=name)

        async def health() -> bool:
            return True

        engine.generate, engine.health = generate, health


def _run(router: Router, engines, requests):
    """Await ``requests(router)`` (a coroutine), then close the engines; its answer."""

    async def body():
        try:
            return await requests(router)
        finally:
            for engine in engines:
                await engine.close()

    return asyncio.run(body())


def test_a_replica_failing_the_requests_of_several_sessions_though_its_probe_answers_up_is_taken_out():
    """A wedged replica answers its probe but fails every generation: the requests of the
    first sessions fail (nothing yet tells the replica from their prompts), the request of
    the ``failing_sessions``-th one takes it out and is retried on another replica, and new
    sessions go there, instead of every rollout routed to it ending as an infra error (3 by
    default)."""

    engines = _replicas(2)
    router = Router(engines, RouterConfig(policy="sticky"))
    sessions = [s for s in SESSIONS if router.route(s).name == "r0"][:3]
    _wedge(engines, {"r0"})
    params = SamplingParams(max_new_tokens=1)

    async def requests(router):
        for i, session in enumerate(sessions[:2]):
            with pytest.raises(EngineError, match="answered 500"):
                await router.generate(session, [1, i], params)
        assert router.replicas == ["r0", "r1"], "two sessions' failures leave it in service"
        return await router.generate(sessions[2], [1, 2], params)

    generation = _run(router, engines, requests)
    assert generation.engine == "r1" and router.assignment(sessions[2]) == "r1"
    assert router.replicas == ["r1"] and router.down == ["r0"]


def test_failures_of_one_session_or_between_successes_do_not_take_a_replica_out():
    """What one session's prompt makes fail (retried by its client again and again) counts
    once, and a success on the replica starts the count again: a replica that serves other
    sessions stays in service."""

    engines = _replicas(2)
    router = Router(engines, RouterConfig(policy="sticky", failing_sessions=2))
    poisoned, fine, other, third = [s for s in SESSIONS if router.route(s).name == "r0"][:4]
    wedged: set[str] = set()
    _wedge(engines, wedged)
    params = SamplingParams(max_new_tokens=1)

    async def requests(router):
        wedged.add("r0")
        for _ in range(4):
            with pytest.raises(EngineError):
                await router.generate(poisoned, [1, 2], params)
        wedged.clear()
        await router.generate(fine, [1, 2], params)
        wedged.add("r0")
        with pytest.raises(EngineError):
            await router.generate(other, [1, 3], params)
        assert router.replicas == ["r0", "r1"]
        return await router.generate(third, [1, 4], params)

    generation = _run(router, engines, requests)
    assert generation.engine == "r1", "the failures of two sessions in a row take it out"
    assert router.down == ["r0"]


def test_a_group_sharing_a_prompt_that_fails_everywhere_does_not_take_a_healthy_replica_out():
    """A GRPO group's sessions start on one prompt, all at once: one that makes vLLM answer
    500 (not 400) fails on every replica, for each session of the group. Counted per session,
    the group looked like a wedged replica and took out the healthy one it landed on (then its
    retries failed on the next); its failures count once, and the replica keeps serving."""

    engines = _replicas(2)
    router = Router(engines, RouterConfig(policy="sticky", failing_sessions=3))
    *group, other = [s for s in SESSIONS if router.route(s).name == "r0"][:5]
    poisoned = [7, 7, 7]
    served: list[str] = []
    for engine in engines:

        async def generate(session_id, prompt_ids, params, name=engine.name) -> Generation:
            if prompt_ids == poisoned:
                raise EngineError(f"vLLM server {name} answered 500 on /v1/completions")
            served.append(name)
            return Generation([5], [-0.5], [0], "stop", engine=name)

        async def health() -> bool:
            return True

        engine.generate, engine.health = generate, health

    async def requests(router):
        params = SamplingParams(max_new_tokens=1)
        answers = [router.generate(s, poisoned, params) for s in group]
        answers = await asyncio.gather(*answers, return_exceptions=True)
        await router.generate(other, [1, 2], params)
        return answers

    answers = _run(router, engines, requests)
    assert all(isinstance(a, EngineError) for a in answers), answers
    assert router.replicas == ["r0", "r1"] and router.down == []
    assert served == ["r0"]


def test_requests_failing_at_once_on_a_replica_taken_out_meanwhile_fail_over():
    """Four sessions' requests fail on a wedged replica at once: two fail, the third's takes it
    out and is retried, and the fourth finds it out already and is retried too."""

    engines = _replicas(2)
    router = Router(engines, RouterConfig(policy="sticky", failing_sessions=3))
    sessions = [s for s in SESSIONS if router.route(s).name == "r0"][:4]
    _wedge(engines, {"r0"})

    async def requests(router):
        params = SamplingParams(max_new_tokens=1)
        answers = [router.generate(s, [1, i], params) for i, s in enumerate(sessions)]
        return await asyncio.gather(*answers, return_exceptions=True)

    answers = _run(router, engines, requests)
    assert sum(isinstance(a, EngineError) for a in answers) == 2
    assert sorted(a.engine for a in answers if isinstance(a, Generation)) == ["r1", "r1"]
    assert router.down == ["r0"]


def test_without_a_limit_on_failing_sessions_a_replica_whose_probe_answers_up_stays():
    """A wedged replica stays in service, and the router keeps none of its failures: with no
    success to clear them, one failing every request for hours held every failed session."""
    engines = _replicas(2)
    router = Router(engines, RouterConfig(policy="sticky", failing_sessions=None))
    sessions = [s for s in SESSIONS if router.route(s).name == "r0"][:5]
    _wedge(engines, {"r0"})

    async def requests(router):
        for session in sessions:
            with pytest.raises(EngineError):
                await router.generate(session, [1, 2], SamplingParams(max_new_tokens=1))

    _run(router, engines, requests)
    assert router.replicas == ["r0", "r1"]
    assert router._failing == {}


def test_a_replica_taken_out_for_failing_requests_comes_back_after_a_quarantine_doubled_each_time(
    monkeypatch,
):
    """A wedged replica passes its probe, so a health check would put it back at once, and it
    would fail the requests of ``failing_sessions`` more sessions at every check. It stays out
    ``quarantine_s``, twice as long each time it is taken out again without serving a request
    in between (up to ``quarantine_max_s``), and once it serves, its next quarantine is
    ``quarantine_s`` again."""

    now = [1000.0]
    monkeypatch.setattr("rollout.router.time.monotonic", lambda: now[0])
    engines = _replicas(2)
    config = RouterConfig(policy="sticky", failing_sessions=1, quarantine_s=30, quarantine_max_s=100)
    router = Router(engines, config)
    sessions = iter([s for s in SESSIONS if router.route(s).name == "r0"])
    wedged = {"r0"}
    served: list[str] = []
    _wedge(engines, wedged, served)
    restored: list[tuple[float, str]] = []

    async def restore(engine) -> None:
        restored.append((now[0], engine.name))

    async def take_out_and_wait(router, quarantine_s: float) -> None:
        """Fail r0 out, then check at ``quarantine_s`` less and more a second."""
        await router.generate(next(sessions), [1, 2], SamplingParams(max_new_tokens=1))
        assert router.down == ["r0"]
        start = now[0]
        now[0] = start + quarantine_s - 1
        assert await router.check_health(restore=restore) == {"r1": True, "r0": True}
        assert router.down == ["r0"] and restored == [], "it stays out for its quarantine"
        now[0] = start + quarantine_s + 1
        await router.check_health(restore=restore)
        assert router.down == [] and restored == [(now[0], "r0")], "restored, then back in service"
        restored.clear()

    async def requests(router):
        for quarantine_s in (30, 60, 100, 100):
            await take_out_and_wait(router, quarantine_s)
        wedged.clear()
        session = next(sessions)
        await router.generate(session, [1, 2], SamplingParams(max_new_tokens=1))
        assert served == ["r1"] * 4 + ["r0"]
        wedged.add("r0")
        await take_out_and_wait(router, 30)

    _run(router, engines, requests)


def test_a_replica_quarantined_while_a_check_restores_it_stays_out(monkeypatch):
    """Two checks find r0 recovered; the second restores it first and puts it back, where it
    fails a request and goes into quarantine. The first, done restoring, put it back into
    service through ``add`` at once; it stays out for its quarantine, and ``add`` refuses it."""
    monkeypatch.setattr("rollout.router.time.monotonic", lambda: 1000.0)
    engines = _replicas(2)
    router = Router(engines, RouterConfig(policy="sticky", failing_sessions=1))
    on_r0 = next(s for s in SESSIONS if router.route(s).name == "r0")
    wedged = {"r0"}
    _wedge(engines, wedged)
    up = {"r0": False, "r1": True}
    _answer_health_from(engines, up)

    async def requests(router):
        await router.check_health()
        assert router.down == ["r0"]
        up["r0"] = True
        restoring, release = asyncio.Event(), asyncio.Event()

        async def slow_restore(engine) -> None:
            restoring.set()
            await release.wait()

        first = asyncio.create_task(router.check_health(restore=slow_restore))
        await restoring.wait()
        await router.check_health()
        assert router.down == []
        generation = await router.generate(on_r0, [1, 2], SamplingParams(max_new_tokens=1))
        assert generation.engine == "r1" and router.down == ["r0"], "quarantined"
        release.set()
        await first
        assert router.down == ["r0"], "the first check's restore does not end its quarantine"
        with pytest.raises(ValueError, match=r"^replica 'r0' is in quarantine for 30 s more"):
            router.add(engines[0])

    _run(router, engines, requests)
    assert router.down == ["r0"] and router.replicas == ["r1"]


def test_a_replica_taken_down_by_its_probe_comes_back_at_the_next_check_without_quarantine(monkeypatch):
    """Quarantine is for a replica whose probe said up while it failed requests: one whose
    probe fails (restarting, say) comes back at the first check that finds it up."""
    monkeypatch.setattr("rollout.router.time.monotonic", lambda: 1000.0)
    engines = _replicas(2)
    router = Router(engines, RouterConfig(policy="sticky", failing_sessions=1))
    up = {"r0": False, "r1": True}
    _answer_health_from(engines, up)

    async def checks(router):
        await router.check_health()
        assert router.down == ["r0"]
        up["r0"] = True
        await router.check_health()

    _run(router, engines, checks)
    assert router.down == []


def test_a_quarantine_shorter_than_its_doubling_limit_is_refused():
    with pytest.raises(ValueError, match=r"quarantine_max_s=10.0 is below quarantine_s=30.0"):
        RouterConfig(quarantine_s=30, quarantine_max_s=10)


def test_a_request_a_replica_serves_as_a_retry_starts_its_count_of_failing_sessions_again():
    """r1 fails one session's request, then serves the retry of a request whose replica went
    down, then fails another session's: no two failed in a row, so it stays in service (it
    was taken out, with r0 down too, leaving none)."""

    engines = _replicas(2)
    router = Router(engines, RouterConfig(policy="sticky", failing_sessions=2))
    on_r0 = next(s for s in SESSIONS if router.route(s).name == "r0")
    first, second = [s for s in SESSIONS if router.route(s).name == "r1"][:2]
    wedged: set[str] = set()
    _wedge(engines, wedged)
    down = engines[0]

    async def down_generate(session_id, prompt_ids, params) -> Generation:
        raise EngineError("vLLM server r0 unreachable")

    async def down_health() -> bool:
        return False

    async def requests(router):
        params = SamplingParams(max_new_tokens=1)
        wedged.add("r1")
        with pytest.raises(EngineError, match="answered 500"):
            await router.generate(first, [1, 2], params)
        wedged.clear()
        down.generate, down.health = down_generate, down_health
        retried = await router.generate(on_r0, [1, 2], params)
        wedged.add("r1")
        with pytest.raises(EngineError, match="answered 500"):
            await router.generate(second, [1, 3], params)
        return retried

    assert _run(router, engines, requests).engine == "r1"
    assert router.replicas == ["r1"] and router.down == ["r0"]


def test_under_round_robin_a_draining_replica_is_empty_only_once_its_requests_in_flight_end():
    """Round-robin pins no session, so a replica's load is its requests in flight: the worker
    reports a draining replica as empty (the trainer then takes it) at load 0, which must not
    come while a generation still runs on it."""
    engines = _replicas(2)
    router = Router(engines, RouterConfig(policy="round_robin"))

    async def body():
        release = asyncio.Event()
        for engine in engines:

            async def generate(session_id, prompt_ids, params, name=engine.name) -> Generation:
                await release.wait()
                return Generation([5], [-0.5], [0], "stop", engine=name)

            engine.generate = generate
        try:
            turn = asyncio.create_task(router.generate("s", [1, 2], SamplingParams(max_new_tokens=1)))
            await asyncio.sleep(0)
            router.drain("r0")
            assert (router.load("r0"), router.load("r1")) == (1, 0)
            release.set()
            assert (await turn).engine == "r0"
            assert (router.load("r0"), router.load("r1")) == (0, 0)
        finally:
            for engine in engines:
                await engine.close()

    asyncio.run(body())
