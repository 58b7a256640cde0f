"""A rollout worker probes its replicas: a dead one leaves service before a request finds it,
one that recovers comes back on the worker's weight version; one that fails to load a
version is retried alone; closing retries the last commit and always stops the engines."""

from __future__ import annotations

import asyncio
import logging
import os

import pytest
import torch

from flows.config import RunConfig
from rl.models import ensure_base_version, load_policy, publish_policy
from rollout.engines.base import EngineError, SamplingParams
from rollout.engines.vllm_engine import UNKNOWN_VERSION, VLLMEngine
from rollout.router import RouterConfig
from storage.shards import ShardReader
from storage.status import InUse
from storage.weights import CorruptVersion, WeightStore
from tests.rl.test_trainer import TINY
from tests.rollout.vllm_standin import StandinServer
from tests.storage.records import make_record
from tests.tasks.test_elastic_plan import make_worker, until


def with_a_replica_down(local_store, while_down, once_back):
    """Run a two-replica worker whose replica ``torch-1`` fails its probes until
    ``while_down(worker, sick)`` has run, then passes them; ``once_back(worker, sick)`` runs
    once it is back in service. Returns the worker (stopped and closed)."""
    run = RunConfig(engine={"replicas": 2}, orchestrator={"mix": {"arith": 1.0}, "concurrency": 2})
    ensure_base_version(WeightStore(local_store), TINY)
    worker = make_worker(local_store, run, router=RouterConfig(health_check_s=0.05))
    healthy = {"torch-1": True}

    async def body() -> None:
        await worker.start()
        sick = worker.engines[1]
        real_health = sick.health

        async def health() -> bool:
            return healthy["torch-1"] and await real_health()

        sick.health = health
        run_task = asyncio.create_task(worker.run(max_seconds=600))
        try:
            healthy["torch-1"] = False
            await until(lambda: worker.router.replicas == ["torch-0"], "the sick replica to leave service")
            await while_down(worker, sick)
            healthy["torch-1"] = True
            await until(lambda: "torch-1" in worker.router.replicas, "the replica to come back")
            await once_back(worker, sick)
        finally:
            worker.stop()
            await run_task
            await worker.close()

    asyncio.run(body())
    return worker


def test_probes_take_a_dead_replica_out_and_bring_it_back_on_the_current_version(local_store):
    weights = WeightStore(local_store)

    async def while_down(worker, sick) -> None:
        model, tokenizer = load_policy(weights.load(0))
        publish_policy(weights, model, tokenizer, step=1)  # loaded while torch-1 is down
        await until(lambda: worker.version == 1, "the worker to load version 1")
        assert (worker.engines[0].version, sick.version) == (1, 0)

    async def once_back(worker, sick) -> None:
        await until(lambda: sick.version == 1, "the replica that came back to load version 1")

    with_a_replica_down(local_store, while_down, once_back)


def test_a_replica_that_comes_back_loads_the_current_version_before_it_serves(local_store):
    """A replica that was down may have restarted on other weights while still tagging its
    tokens with the version it last loaded (a relaunched vLLM server): it loads the worker's
    version before it is back in service."""
    served = {}

    async def while_down(worker, sick) -> None:
        with torch.no_grad():  # it restarts on other weights, still saying version 0
            for parameter in sick.model.parameters():
                parameter.add_(1.0)

    async def once_back(worker, sick) -> None:
        served.update({name: tensor.clone() for name, tensor in sick.model.state_dict().items()})

    worker = with_a_replica_down(local_store, while_down, once_back)
    model, _ = load_policy(WeightStore(local_store).load(0))
    for name, tensor in model.state_dict().items():
        assert torch.equal(served[name], tensor), f"{name} is not version 0's"
    assert worker.version == worker.engines[1].version == 0


def test_a_worker_with_no_replica_in_service_launches_nothing_until_one_is_back(local_store):
    """A worker whose only replica died launched rollout after rollout, each an infra_error
    at once (no replica to route to): a hot loop that wrote thousands of failed rows a minute
    and spent the run's max_rollouts on them. Launching now waits for a replica in service."""
    worker, up = dying_worker(local_store, health_check_s=0.05)

    async def body() -> None:
        await worker.start()
        run_task = asyncio.create_task(worker.run(max_seconds=600))
        try:
            await until(lambda: worker.orchestrator.stats.finished >= 4, "rollouts to finish")
            up["torch-0"] = False
            await until(lambda: worker.router.replicas == [], "the dead replica to leave service")
            await asyncio.sleep(0.2)  # the rollouts in flight when it died end
            launched = worker.orchestrator.stats.tasks["arith"].started
            await asyncio.sleep(1.0)
            assert worker.orchestrator.stats.tasks["arith"].started == launched
            up["torch-0"] = True
            await until(lambda: worker.router.replicas == ["torch-0"], "the replica to come back")
            await until(
                lambda: (
                    worker.orchestrator.stats.tasks["arith"].statuses["ok"]
                    + worker.orchestrator.stats.tasks["arith"].statuses["truncated"]
                    > 4 + 2
                ),
                "rollouts to finish again",
            )
        finally:
            worker.stop()
            await run_task
            await worker.close()

    asyncio.run(body())
    statuses = worker.orchestrator.stats.tasks["arith"].statuses
    assert statuses["infra_error"] <= 2, statuses  # at most those in flight when it died


def test_a_worker_whose_replicas_are_all_out_with_no_health_check_fails_saying_so(local_store):
    """With no health check nothing brings a replica back: waiting would last until the
    deadline (for ever without one), so the worker fails, naming the setting, and what
    finished is written."""
    worker, up = dying_worker(local_store, health_check_s=None)

    async def body() -> None:
        await worker.start()
        try:
            run_task = asyncio.create_task(worker.run(max_seconds=600))
            await until(lambda: worker.orchestrator.stats.finished >= 4, "rollouts to finish")
            up["torch-0"] = False
            with pytest.raises(
                EngineError, match=r"out of service \(torch-0\) and router.health_check_s is null"
            ):
                await asyncio.wait_for(run_task, 60)
        finally:
            await worker.close()

    asyncio.run(body())
    stats = worker.orchestrator.stats
    assert stats.tasks["arith"].statuses["infra_error"] <= 2, stats.tasks
    reader = ShardReader(local_store)
    assert sum(reader.read(shard).num_rows for shard in reader.poll()[0]) == stats.written >= 4


def dying_worker(local_store, health_check_s):
    """A one-replica worker whose replica dies (fails its probes and every generation) while
    ``up["torch-0"]`` is False."""
    run = RunConfig(orchestrator={"mix": {"arith": 1.0}, "concurrency": 2})
    ensure_base_version(WeightStore(local_store), TINY)
    worker = make_worker(local_store, run, router=RouterConfig(health_check_s=health_check_s))
    up = {"torch-0": True}
    real_start = worker.start

    async def start():
        await real_start()
        engine = worker.engines[0]
        real_health, real_generate = engine.health, engine.generate

        async def health() -> bool:
            return up["torch-0"] and await real_health()

        async def generate(*args, **kwargs):
            if not up["torch-0"]:
                raise EngineError("the engine process died (injected)")
            return await real_generate(*args, **kwargs)

        engine.health, engine.generate = health, generate

    worker.start = start
    return worker, up


@pytest.mark.parametrize("fault", ["raises", "hangs"])
@pytest.mark.parametrize("health_check_s", [0.05, None])
def test_a_version_one_replica_fails_to_load_is_retried_there_and_the_others_keep_it(
    local_store, health_check_s, fault
):
    """``torch-1`` fails to load version 1 once, raising or hanging (it still answers its
    probes) past ``load_timeout_s``: the worker moves on to version 1 with ``torch-0`` and the
    health check reloads it into ``torch-1``; ``torch-0`` is never sent back to version 0.
    With no health check, nothing would retry ``torch-1``: the update fails and the next
    weight poll loads version 1 into both."""
    weights = WeightStore(local_store)
    run = RunConfig(
        engine={"replicas": 2, "load_timeout_s": 0.5},
        orchestrator={"mix": {"arith": 1.0}, "concurrency": 2},
    )
    ensure_base_version(weights, TINY)
    router = RouterConfig(health_check_s=health_check_s)
    worker = make_worker(local_store, run, router=router, weight_poll_s=0.05)
    loads: list[tuple[str, int]] = []
    failures = {"torch-1": 1}

    async def body() -> None:
        await worker.start()
        for engine in worker.engines:
            real_load = engine.load_version

            async def load_version(version, path, engine=engine, real_load=real_load):
                loads.append((engine.name, version))
                if failures.get(engine.name):
                    failures[engine.name] -= 1
                    if fault == "hangs":
                        await asyncio.Event().wait()
                    raise EngineError(f"{engine.name} failed to load version {version} (injected)")
                await real_load(version, path)

            engine.load_version = load_version
        run_task = asyncio.create_task(worker.run(max_seconds=600))
        try:
            model, tokenizer = load_policy(weights.load(0))
            publish_policy(weights, model, tokenizer, step=1)
            await until(lambda: worker.version == 1, "the worker to move on to version 1")
            await until(lambda: worker.engines[1].version == 1, "torch-1 to load version 1 on a retry")
        finally:
            worker.stop()
            await run_task
            await worker.close()

    asyncio.run(body())
    assert [version for name, version in loads if name == "torch-0"] == ([1] if health_check_s else [1, 1])
    assert [version for name, version in loads if name == "torch-1"][:2] == [1, 1]


def test_a_reload_the_health_check_runs_is_awaited_whatever_the_others_do(local_store, caplog):
    """Both replicas missed version 0 (their version differs); the health check reloads them
    together. ``torch-0``'s reload fails at once while ``torch-1``'s still runs: the failure
    is logged, and the health check holds the loading lock until ``torch-1`` is done, so no
    later load of ``torch-1`` overlaps it; the next probe reloads ``torch-0``."""
    run = RunConfig(engine={"replicas": 2}, orchestrator={"mix": {"arith": 1.0}, "concurrency": 2})
    ensure_base_version(WeightStore(local_store), TINY)
    worker = make_worker(local_store, run, router=RouterConfig(health_check_s=0.05), weight_poll_s=600)
    worker.retry_wait_s = lambda failures: 0.05  # not the minute a weight_poll_s of 600 gives
    held_while_torch_1_loads = []

    def failure_logged() -> bool:
        return any("torch-0" in r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)

    async def body() -> None:
        await worker.start()
        failing, slow = worker.engines
        real_load, slow_load = failing.load_version, slow.load_version

        async def fails_once(version, path):
            failing.load_version = real_load
            raise EngineError("torch-0 failed to load (injected)")

        async def outlasts_the_failure(version, path):
            slow.load_version = slow_load
            await until(failure_logged, "torch-0's failure to be logged")
            held_while_torch_1_loads.append(worker._loading.locked())
            await slow_load(version, path)

        failing.load_version, slow.load_version = fails_once, outlasts_the_failure
        failing.version = slow.version = 7
        run_task = asyncio.create_task(worker.run(max_seconds=600))
        try:
            await until(lambda: failing.version == slow.version == 0, "both replicas to load version 0")
        finally:
            worker.stop()
            await run_task
            await worker.close()

    asyncio.run(body())
    assert held_while_torch_1_loads == [True]


@pytest.mark.parametrize("failures", [2, 4])
def test_close_retries_the_last_commit_and_stops_the_engines_whatever_it_does(local_store, failures):
    """The last shard's commit fails ``failures`` times: with 3 retries it lands on the third
    attempt (every rollout committed), or close raises the last failure; either way the
    engines are stopped and the copy of the version they served leaves the weight cache (it
    stayed there for good, a model's size on the machine's disk per worker run)."""
    run = RunConfig(
        engine={"replicas": 2},
        orchestrator={"mix": {"arith": 1.0}, "concurrency": 2, "max_rollouts": 4},
    )
    ensure_base_version(WeightStore(local_store), TINY)
    worker = make_worker(local_store, run, close_retry_s=(0.01, 0.01, 0.01), flush_seconds=600)
    attempts = []
    real_close = worker.writer.close

    def close() -> None:
        attempts.append(worker.writer.unsaved_records)
        if len(attempts) <= failures:
            raise OSError("store unreachable (injected)")
        real_close()

    worker.writer.close = close

    async def body():
        await worker.start()
        stats = await worker.run(max_seconds=600)
        if failures > len(worker.close_retry_s):
            with pytest.raises(OSError, match="unreachable"):
                await worker.close()
        else:
            await worker.close()
        return stats

    stats = asyncio.run(body())
    assert len(attempts) == min(failures + 1, 4)
    assert attempts[0] == stats.finished == 4
    assert all(engine._closed for engine in worker.engines)
    assert not [path for path in worker.weights.cache_dir.rglob("v0*") if path.is_dir()]
    if failures <= len(worker.close_retry_s):
        reader = ShardReader(local_store)
        assert sum(reader.read(shard).num_rows for shard in reader.poll()[0]) == stats.finished > 0


def test_close_does_not_retry_a_commit_refused_because_another_worker_took_the_name(local_store, caplog):
    """Another worker runs under this one's name: its shards, not these, come next, so the
    refused commit is raised at once, not tried again after each wait."""
    run = RunConfig(orchestrator={"mix": {"arith": 1.0}})
    worker = make_worker(local_store, run, close_retry_s=(0.01, 0.01, 0.01))
    attempts = []

    def close() -> None:
        attempts.append(worker.writer.unsaved_records)
        raise InUse("rollout worker name 'w0' was taken over (injected)")

    worker.writer.close = close
    with caplog.at_level(logging.WARNING, logger="rollout.worker"), pytest.raises(InUse, match="taken over"):
        asyncio.run(worker.close())
    assert len(attempts) == 1 and "trying again" not in caplog.text


def test_a_worker_whose_name_was_taken_says_so_when_its_records_cannot_be_set_aside_either(
    local_store, caplog
):
    """The commit of the worker's last records is refused (another worker took its name) and
    the store takes no file in the quarantine either: close raises that the name was taken,
    not the store's error, and logs that those records are neither committed nor set aside."""
    run = RunConfig(orchestrator={"mix": {"arith": 1.0}})

    def taken() -> None:
        raise InUse("rollout worker name 'w0' was taken over (injected)")

    worker = make_worker(local_store, run, before_commit=taken)
    worker.writer.write_many([make_record(0), make_record(1)])
    blocked = local_store.path("shards", "quarantine", "raw", "w0")  # a file where its folder goes
    os.makedirs(os.path.dirname(blocked))
    local_store.fs.pipe_file(blocked, b"")
    with caplog.at_level(logging.ERROR, logger="rollout.worker"), pytest.raises(InUse, match="taken over"):
        asyncio.run(worker.close())
    assert "worker w0 could neither commit its last records nor set them aside" in caplog.text


def test_a_worker_loads_its_version_onto_a_vllm_server_that_holds_another(local_store):
    """A vLLM server keeps the weights it was launched with (here version 0) across a worker
    restart or a resumed run: the worker loads the newest version (1) onto it before it
    serves, so the tokens tagged 1 come from version 1's weights."""
    weights = WeightStore(local_store)
    ensure_base_version(weights, TINY)
    model, tokenizer = load_policy(weights.load(0))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    publish_policy(weights, model, tokenizer, step=1)
    launched_with, _ = load_policy(weights.load(0))

    async def body() -> None:
        server = await StandinServer(launched_with, max_model_len=256).start()
        run = RunConfig(
            engine={"kind": "vllm", "vllm": [{"base_url": server.url}]},
            gateway={"max_context_tokens": 256},
            orchestrator={"mix": {"arith": 1.0}, "concurrency": 1},
        )
        worker = make_worker(local_store, run)
        try:
            await worker.start()
            assert worker.version == worker.engines[0].version == 1
            assert ("reload", weights.load(1, "serving")) in server.events
            prompt = [5, 6, 7, 8]
            generation = await worker.engines[0].generate(
                "s", prompt, SamplingParams(max_new_tokens=4, seed=3)
            )
            assert generation.versions == [1] * 4
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([prompt + generation.token_ids])).logits[0]
            expected = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
            expected = expected.gather(1, torch.tensor(generation.token_ids)[:, None])[:, 0]
            assert torch.allclose(torch.tensor(generation.logprobs), expected, atol=1e-4)
        finally:
            await worker.close()
            await server.stop()

    asyncio.run(body())


def test_a_worker_whose_sessions_hold_more_than_its_vllm_server_does_not_start(local_store):
    """A session may hold max_context_tokens; a server launched with a smaller max_model_len
    would end every longer rollout early (truncated): the start fails naming both numbers."""
    weights = WeightStore(local_store)
    ensure_base_version(weights, TINY)
    launched_with, _ = load_policy(weights.load(0))

    async def body() -> None:
        server = await StandinServer(launched_with, max_model_len=256).start()
        run = RunConfig(
            engine={"kind": "vllm", "vllm": [{"base_url": server.url}]},
            gateway={"max_context_tokens": 257},
            orchestrator={"mix": {"arith": 1.0}, "concurrency": 1},
        )
        worker = make_worker(local_store, run)
        try:
            with pytest.raises(
                ValueError, match="max_context_tokens=257 is over vLLM server vllm-0's max_model_len=256"
            ):
                await worker.start()
        finally:
            await worker.close()
            await server.stop()

    asyncio.run(body())


def run_on(servers: list[StandinServer]) -> RunConfig:
    """A run whose engines are ``servers`` (of 256 positions), one arith rollout at a time."""
    return RunConfig(
        engine={"kind": "vllm", "vllm": [{"base_url": server.url} for server in servers]},
        gateway={"max_context_tokens": 256},
        orchestrator={"mix": {"arith": 1.0}, "concurrency": 1},
    )


def test_a_vllm_server_down_at_start_serves_once_it_is_up_and_has_loaded_the_version(
    local_store, monkeypatch
):
    """A server still launching when the worker starts cannot load the worker's version: it
    stays out of service until a probe finds it up and loads the version onto it (left in
    service, it failed every request: its weights are of no known version). When no
    replica can load the version, the start fails."""
    weights = WeightStore(local_store)
    ensure_base_version(weights, TINY)
    launched_with, _ = load_policy(weights.load(0))
    launching = {"vllm-0"}
    real_health = VLLMEngine.health

    async def health(engine) -> bool:
        return engine.name not in launching and await real_health(engine)

    monkeypatch.setattr(VLLMEngine, "health", health)

    async def body() -> None:
        servers = [await StandinServer(launched_with, max_model_len=256).start() for _ in range(2)]
        run = run_on(servers)
        worker = make_worker(local_store, run, router=RouterConfig(health_check_s=0.05))
        try:
            await worker.start()
            assert worker.router.replicas == ["vllm-1"]
            assert [engine.version for engine in worker.engines] == [UNKNOWN_VERSION, 0]
            run_task = asyncio.create_task(worker.run(max_seconds=600))
            launching.clear()
            await until(lambda: "vllm-0" in worker.router.replicas, "the launched server to come in")
            assert worker.engines[0].version == 0
            generation = await worker.engines[0].generate("s", [5, 6, 7], SamplingParams(max_new_tokens=2))
            assert generation.versions == [0, 0]
            worker.stop()
            await run_task
        finally:
            await worker.close()
        launching.update({"vllm-0", "vllm-1"})
        nothing_up = make_worker(local_store, run)
        try:
            with pytest.raises(EngineError, match="no replica could load weight version 0"):
                await nothing_up.start()
        finally:
            await nothing_up.close()
            for server in servers:
                await server.stop()

    asyncio.run(body())


def test_a_vllm_server_up_at_start_that_fails_to_load_the_version_stays_out_of_service(
    local_store, monkeypatch
):
    """A server that answers its probes but refuses the worker's version holds weights of no
    known version: it is taken out of service, and the other serves."""
    weights = WeightStore(local_store)
    ensure_base_version(weights, TINY)
    launched_with, _ = load_policy(weights.load(0))
    real_load = VLLMEngine.load_version

    async def load_version(engine, version, path) -> None:
        if engine.name == "vllm-0":
            raise EngineError("vllm-0 refuses the weights (injected)")
        await real_load(engine, version, path)

    monkeypatch.setattr(VLLMEngine, "load_version", load_version)

    async def body() -> None:
        servers = [await StandinServer(launched_with, max_model_len=256).start() for _ in range(2)]
        run = run_on(servers)
        worker = make_worker(local_store, run, router=RouterConfig(health_check_s=0.05))
        try:
            await worker.start()
            assert worker.router.replicas == ["vllm-1"] and worker.router.down == ["vllm-0"]
        finally:
            await worker.close()
            for server in servers:
                await server.stop()

    asyncio.run(body())


@pytest.mark.parametrize("health_check_s", [0.05, None])
def test_a_replica_whose_probe_hangs_does_not_hold_up_a_new_version(local_store, health_check_s):
    """``torch-1``'s health probe never answers (a stuck actor): loading version 1 counts it
    as down after ``health_timeout_s``, as the router's probes do, and ``torch-0`` serves
    version 1; the probe does not hold the weight update (and the lock the health check
    needs) for ever."""
    weights = WeightStore(local_store)
    run = RunConfig(engine={"replicas": 2}, orchestrator={"mix": {"arith": 1.0}, "concurrency": 2})
    ensure_base_version(weights, TINY)
    router = RouterConfig(health_check_s=health_check_s, health_timeout_s=0.2)
    worker = make_worker(local_store, run, router=router, weight_poll_s=0.05)

    async def body() -> None:
        await worker.start()
        stuck = worker.engines[1]

        async def health() -> bool:
            await asyncio.Event().wait()  # never answers
            return True

        stuck.health = health
        run_task = asyncio.create_task(worker.run(max_seconds=600))
        try:
            model, tokenizer = load_policy(weights.load(0))
            publish_policy(weights, model, tokenizer, step=1)
            await until(lambda: worker.version == 1, "the worker to move on to version 1")
            assert worker.engines[0].version == 1
        finally:
            worker.stop()
            await run_task
            await worker.close()

    asyncio.run(body())


def refuse_version_1(engine, tried: list[int]) -> None:
    """Make ``engine`` fail every load of version 1, recording each version it is asked to load."""
    real_load = engine.load_version

    async def load_version(version, path):
        tried.append(version)
        if version == 1:
            raise EngineError("version 1 does not fit on this replica (injected)")
        await real_load(version, path)

    engine.load_version = load_version


def test_a_version_no_replica_can_load_is_tried_again_later_and_later_and_a_newer_one_at_once(local_store):
    """Every replica fails to load version 1 (it does not fit, the server refuses it): each
    weight poll tried it again, verifying the copy's digests (the model's size read) and
    warning, once a second for as long as it was LATEST. Now the waits double, up to
    ``LOAD_RETRY_MAX_S``; a newer version is tried at once."""
    run = RunConfig(engine={"replicas": 1}, orchestrator={"mix": {"arith": 1.0}, "concurrency": 1})
    weights = WeightStore(local_store)
    ensure_base_version(weights, TINY)
    worker = make_worker(local_store, run, weight_poll_s=30.0)
    model, tokenizer = load_policy(weights.load(0))
    tried: list[int] = []

    async def body() -> list[bool]:
        await worker.start()
        refuse_version_1(worker.engines[0], tried)
        try:
            publish_policy(weights, model, tokenizer, step=1)
            with pytest.raises(EngineError, match="does not fit"):
                await worker.sync_weights()
            held_back = await worker.sync_weights()
            publish_policy(weights, model, tokenizer, step=2)
            return [held_back, await worker.sync_weights()]
        finally:
            await worker.close()

    assert asyncio.run(body()) == [False, True]
    assert tried == [1, 2] and worker.version == 2
    worker.weight_poll_s = 1.0
    assert [worker.retry_wait_s(failures) for failures in (1, 2, 5, 6)] == [2.0, 4.0, 32.0, 60.0]


def test_each_failed_load_of_a_version_doubles_the_wait_before_the_next(local_store, caplog):
    """The worker's weight loop counts the failures of one version in a row: each warning
    says the next try waits twice as long as the last one did."""
    run = RunConfig(engine={"replicas": 1}, orchestrator={"mix": {"arith": 1.0}, "concurrency": 1})
    weights = WeightStore(local_store)
    ensure_base_version(weights, TINY)
    worker = make_worker(local_store, run, weight_poll_s=0.05)
    model, tokenizer = load_policy(weights.load(0))
    tried: list[int] = []

    def waits() -> list[str]:
        said = [
            r.getMessage() for r in caplog.records if "could not load a new weight version" in r.getMessage()
        ]
        return [message.rsplit("tried again in ", 1)[1] for message in said]

    async def body() -> None:
        await worker.start()
        refuse_version_1(worker.engines[0], tried)
        follower = asyncio.create_task(worker._follow_weights())
        try:
            publish_policy(weights, model, tokenizer, step=1)
            await until(lambda: len(waits()) >= 3, "three failed loads of version 1")
        finally:
            follower.cancel()
            await asyncio.gather(follower, return_exceptions=True)
            await worker.close()

    with caplog.at_level(logging.WARNING, logger="rollout.worker"):
        asyncio.run(body())
    assert waits()[:3] == ["0.1 s", "0.2 s", "0.4 s"]
    assert set(tried) == {1} and worker.version == 0


def test_a_weights_pointer_storage_cannot_serve_is_warned_of_once_while_it_lasts(local_store, caplog):
    """Storage unreachable: the weight loop read ``LATEST`` every ``weight_poll_s`` and warned at
    every read for as long as it lasted, where the worker's other loops warn once per error. It
    now warns once, says when it reads it again, and then loads the version published meanwhile."""
    run = RunConfig(engine={"replicas": 1}, orchestrator={"mix": {"arith": 1.0}, "concurrency": 1})
    weights = WeightStore(local_store)
    ensure_base_version(weights, TINY)
    worker = make_worker(local_store, run, weight_poll_s=0.01)
    model, tokenizer = load_policy(weights.load(0))
    reads = []

    async def body() -> None:
        await worker.start()
        real_latest = worker.weights.latest

        def unreachable() -> int | None:
            reads.append(1)
            if len(reads) <= 5:
                raise OSError("connection refused (injected)")
            return real_latest()

        worker.weights.latest = unreachable
        follower = asyncio.create_task(worker._follow_weights())
        try:
            publish_policy(weights, model, tokenizer, step=1)
            await until(lambda: worker.version == 1, "the worker to load version 1 once storage is back")
        finally:
            follower.cancel()
            await asyncio.gather(follower, return_exceptions=True)
            await worker.close()

    with caplog.at_level(logging.INFO, logger="rollout.worker"):
        asyncio.run(body())
    said = [
        r.getMessage() for r in caplog.records if "injected" in r.getMessage() or "again" in r.getMessage()
    ]
    assert said == [
        "worker w0 could not read the weights' LATEST: connection refused (injected)",
        "worker w0 reads the weights' LATEST again",
    ]


def corrupt_model(weights: WeightStore, version: int) -> None:
    """Flip the last byte of ``version``'s model file: it no longer matches its manifest."""
    fs = weights.store.fs
    model_file = f"{weights.version_path(version)}/model.safetensors"
    payload = bytearray(fs.cat_file(model_file))
    payload[-1] ^= 0xFF
    fs.pipe_file(model_file, bytes(payload))


def test_a_corrupt_version_after_a_failed_one_is_not_said_to_be_tried_again(local_store, caplog):
    """Version 1 failed to load (tried again later), then version 2 came corrupt: a refused
    version is never tried again, and its warning said it was, with version 1's wait."""
    run = RunConfig(engine={"replicas": 1}, orchestrator={"mix": {"arith": 1.0}, "concurrency": 1})
    weights = WeightStore(local_store)
    ensure_base_version(weights, TINY)
    worker = make_worker(local_store, run, weight_poll_s=0.05)
    model, tokenizer = load_policy(weights.load(0))

    def refused() -> list[str]:
        return [r.getMessage() for r in caplog.records if "model.safetensors" in r.getMessage()]

    async def body() -> None:
        await worker.start()
        refuse_version_1(worker.engines[0], [])
        try:
            publish_policy(weights, model, tokenizer, step=1)
            with pytest.raises(EngineError, match="does not fit"):
                await worker.sync_weights()
            publish_policy(weights, model, tokenizer, step=2)
            corrupt_model(weights, 2)
            follower = asyncio.create_task(worker._follow_weights())
            await until(refused, "the corrupt version's warning")
            follower.cancel()
            await asyncio.gather(follower, return_exceptions=True)
        finally:
            await worker.close()

    with caplog.at_level(logging.WARNING, logger="rollout.worker"):
        asyncio.run(body())
    (warning,) = refused()
    assert "could not load a new weight version" in warning and "tried again" not in warning
    assert worker.version == 0


def test_a_corrupt_version_is_refused_once_and_the_next_one_is_loaded(store, monkeypatch):
    """LATEST names a version whose weights do not match its manifest: the worker keeps
    serving its version and does not fetch and hash the refused one again at every poll
    (the whole policy, downloaded again from S3) until a new version comes."""
    run = RunConfig(engine={"replicas": 1}, orchestrator={"mix": {"arith": 1.0}, "concurrency": 1})
    weights = WeightStore(store)
    ensure_base_version(weights, TINY)
    worker = make_worker(store, run)
    model, tokenizer = load_policy(weights.load(0))
    loads = []
    load = worker.weights.load
    monkeypatch.setattr(worker.weights, "load", lambda *args: (loads.append(args[0]), load(*args))[1])

    async def body() -> list[bool]:
        await worker.start()
        try:
            publish_policy(weights, model, tokenizer, step=1)
            corrupt_model(weights, 1)
            with pytest.raises(CorruptVersion, match="model.safetensors"):
                await worker.sync_weights()
            synced = [await worker.sync_weights() for _ in range(3)]
            publish_policy(weights, model, tokenizer, step=2)
            return [*synced, await worker.sync_weights()]
        finally:
            await worker.close()

    assert asyncio.run(body()) == [False, False, False, True]
    assert loads == [0, 1, 2]
    assert worker.version == worker.engines[0].version == 2


def test_a_worker_starts_past_a_garbled_latest_and_below_a_version_that_does_not_verify(local_store, caplog):
    """A garbled LATEST: the newest complete version is served; a version whose files do not
    verify: the newest below it that does. With none that verifies the worker stops with one
    line that says what to do."""
    run = RunConfig(engine={"replicas": 1}, orchestrator={"mix": {"arith": 1.0}, "concurrency": 1})
    weights = WeightStore(local_store)
    ensure_base_version(weights, TINY)
    model, tokenizer = load_policy(weights.load(0))
    publish_policy(weights, model, tokenizer, step=1)

    async def started() -> int:
        worker = make_worker(local_store, run)
        try:
            await worker.start()
            return worker.version
        finally:
            await worker.close()

    local_store.fs.pipe_file(f"{weights.root}/LATEST", b"1\x00\x00")
    assert asyncio.run(started()) == 1
    assert "LATEST holds '1\\x00\\x00', not a version number" in caplog.text
    model_file = f"{weights.version_path(1)}/model.safetensors"
    local_store.fs.pipe_file(model_file, local_store.fs.cat_file(model_file)[:-1])
    assert asyncio.run(started()) == 0
    config_file = f"{weights.version_path(0)}/config.json"  # rewritten in place: its cached hard link too
    local_store.fs.pipe_file(config_file, local_store.fs.cat_file(config_file)[:-1])
    with pytest.raises(
        CorruptVersion, match=r"worker w0 has no weights to serve: .*; restore the version's files"
    ):
        asyncio.run(started())
