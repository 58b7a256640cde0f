"""The rollout task serves the gateway's HTTP API to a harness outside the run (``gateway_http``):
a real worker on the tiny model, real HTTP through httpx, real local-folder storage, and the
record the harness asks it to write processed from the worker's committed raw shard."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import urllib.parse
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import httpx
import pyarrow as pa
import pytest

from flows.config import RunConfig
from rl.models import build_tiny_model, ensure_base_version, publish_policy
from rollout.gateway_http import RETRY_AFTER_S, SESSION_HEADER
from rollout.worker import RolloutWorker
from storage.config import RunStore, StorageConfig
from storage.shards import ShardReader
from storage.status import InUse, RolloutStatusBoard, TrainerStatus, TrainerStatusBoard
from storage.tables import Tables
from storage.weights import WeightStore
from tasks.process import run_processor
from tasks.rollout import rollout_detail, run_rollouts
from tests.conftest import free_port
from tests.rl.test_trainer import TINY
from tests.rollout.test_gateway_http_write import recorded
from tests.tasks.test_elastic_plan import make_worker, until

WAIT_S = 600.0
"""A bound on every wait, never reached unless something hangs."""
TOKEN = "harness-token-5e1f"


def serving_run(
    tmp_path, port: int, orchestrator: dict | None = None, **gateway_http
) -> tuple[RunConfig, RunStore]:
    run = RunConfig(
        run_id="served",
        storage=StorageConfig(root=str(tmp_path / "runs")),
        service={"max_new_tokens": 4},
        orchestrator=orchestrator or {},
        gateway_http={"port": port, **gateway_http},
    )
    store = RunStore(run.storage, run.run_id)
    ensure_base_version(WeightStore(store), TINY)
    return run, store


@contextlib.asynccontextmanager
async def harness_client(worker: RolloutWorker, running: asyncio.Task) -> AsyncIterator[httpx.AsyncClient]:
    """A harness's client of ``worker``'s gateway, with its token, once the worker serves it;
    raises at once if its ``running`` run ends first (its error, if any), as it never will."""

    def serving() -> bool:
        if running.done():
            running.result()
            raise AssertionError("the worker's run ended before it served the gateway")
        return worker.http_server is not None

    await until(serving, "the worker to serve")
    async with httpx.AsyncClient(
        base_url=worker.http_server.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=WAIT_S
    ) as client:
        yield client


@contextlib.contextmanager
def serving_worker(run: RunConfig, on_progress=None) -> Iterator[tuple[Future, threading.Event]]:
    """``run_rollouts`` of worker w0 on a thread, and its stop (set on the way out, whatever happens)."""
    stop = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        worker = pool.submit(
            run_rollouts,
            run,
            time.time() + WAIT_S,
            "w0",
            on_progress=on_progress,
            progress_every_s=0.2,
            stop=stop,
            flush_seconds=600,
        )
        try:
            yield worker, stop
        finally:
            stop.set()


def until_serving(client: httpx.Client, worker) -> None:
    """Wait (bounded) until the worker's server answers, failing at once if the worker ended."""
    end = time.monotonic() + WAIT_S
    while time.monotonic() < end:
        if worker.done():
            worker.result()
            pytest.fail("the worker ended before it served")
        try:
            client.get("/health")
            return
        except httpx.TransportError:
            time.sleep(0.05)
    pytest.fail("the worker never served")


def test_a_harness_drives_a_serve_only_worker_over_http_and_its_written_record_is_processed(
    tmp_path, monkeypatch, caplog
):
    # as a secret mounted from a file sets it: its last newline is no part of the token
    monkeypatch.setenv("TREADLE_GATEWAY_TOKEN", f"{TOKEN}\n")
    port = free_port()
    run, store = serving_run(tmp_path, port, serve_only=True)
    caplog.set_level("INFO", logger="rollout.worker")
    progress: list[str] = []
    with (
        serving_worker(run, lambda status: progress.append(rollout_detail(status))) as (worker, stop),
        httpx.Client(
            base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60
        ) as client,
    ):
        until_serving(client, worker)
        # the line after the next is of a status taken while it serves: it names the URL
        serving_line = len(progress) + 1
        end = time.monotonic() + WAIT_S
        while len(progress) <= serving_line:
            assert time.monotonic() < end and not worker.done()
            time.sleep(0.05)
        assert f"gateway at http://127.0.0.1:{port}" in progress[serving_line]
        assert client.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401

        opened = client.post("/v1/sessions", json={"task": "arith", "prompt_id": "p1"}).json()
        header = {SESSION_HEADER: opened["session_id"]}
        first = client.post("/v1/generate", json={"token_ids": [5, 6, 7]}, headers=header).json()
        second = client.post("/v1/generate", json={"token_ids": [8]}, headers=header).json()
        assert first["versions"] and set(first["versions"] + second["versions"]) == {0}
        # its records are trained on: a turn at another temperature than the run's is refused
        other = client.post("/v1/generate", json={"token_ids": [8], "temperature": 0.5}, headers=header)
        assert other.status_code == 400 and "samples at the run's temperature" in other.text

        # a bad body writes nothing, and the session can still be recorded and written
        bad = client.post("/v1/records", json={"records": [{"trajectory_id": "x"}]})
        assert bad.status_code == 400, bad.text
        record = client.post(
            f"/v1/sessions/{opened['session_id']}/record", json={"reward": 1.0, "write": True}
        ).json()
        again = client.post(
            f"/v1/sessions/{opened['session_id']}/record", json={"reward": 1.0, "write": True}
        )
        assert again.status_code == 400 and "written already" in again.text
        assert client.delete(f"/v1/sessions/{opened['session_id']}").status_code == 200

        # serving only, the worker still follows the trainer: a new version serves the next session
        model, tokenizer = build_tiny_model(TINY)
        publish_policy(WeightStore(store), model, tokenizer, step=1)
        versions: list[int] = []
        end = time.monotonic() + WAIT_S
        while 1 not in versions and time.monotonic() < end:
            other = client.post("/v1/sessions", json={"task": "arith", "prompt_id": "p2"}).json()[
                "session_id"
            ]
            versions = client.post(
                "/v1/generate", json={"token_ids": [5]}, headers={SESSION_HEADER: other}
            ).json()["versions"]
            client.delete(f"/v1/sessions/{other}")
        assert 1 in versions

        stop.set()
        result = worker.result(WAIT_S)
        with pytest.raises(httpx.TransportError):  # stopped with the worker
            client.get("/health")

    assert result["orchestrator"]["finished"] == 0  # none of its own rollouts
    # the console shows the run's progress lines, not the worker's INFO records: they say where it
    # serves (waited for above: port 0 picks one) and what harnesses had written
    assert "1 record written by harnesses" in rollout_detail(result)
    assert f"worker w0 serves the gateway at http://127.0.0.1:{port}" in caplog.text
    assert TOKEN not in caplog.text
    assert not RolloutStatusBoard(store).read_worker("w0").running

    reader = ShardReader(store, "raw")
    (shard,) = reader.poll()[0]
    assert shard.worker == "w0"
    assert reader.read(shard).column("trajectory_id").to_pylist() == [record["trajectory_id"]]
    assert run_processor(run, time.time())["shards"] == 1
    trajectories = Tables(store).read("trajectories")
    assert trajectories.column("trajectory_id").to_pylist() == [record["trajectory_id"]]


def test_a_worker_serving_the_gateway_without_its_token_refuses_to_start(tmp_path, monkeypatch):
    monkeypatch.setenv("TREADLE_GATEWAY_TOKEN", "  ")
    run, store = serving_run(tmp_path, 0)
    with pytest.raises(ValueError, match="TREADLE_GATEWAY_TOKEN .*is empty: set it"):
        run_rollouts(run, time.time() + WAIT_S, "w0")
    monkeypatch.delenv("TREADLE_GATEWAY_TOKEN")
    with pytest.raises(ValueError, match="TREADLE_GATEWAY_TOKEN .*is unset: set it"):
        run_rollouts(run, time.time() + WAIT_S, "w0")
    assert not RolloutStatusBoard(store).read_worker("w0").running


def test_serve_only_without_a_port_is_refused():
    with pytest.raises(ValueError, match="serve_only without port"):
        RunConfig(gateway_http={"serve_only": True})


def test_serve_only_with_a_rollout_limit_is_refused():
    """A serve-only worker runs none of the rollouts stop.max_rollouts counts (a harness's records
    are not among them): without stop.max_seconds the run would never end."""
    with pytest.raises(ValueError, match="stop.max_rollouts .*gateway_http.serve_only"):
        RunConfig(
            gateway_http={"port": 0, "serve_only": True}, stop={"max_rollouts": 64, "max_seconds": None}
        )
    RunConfig(gateway_http={"port": 0, "serve_only": True}, stop={"max_policy_steps": 3, "max_seconds": None})


def test_a_worker_cancelled_while_rolling_out_beside_the_server_stops_serving(tmp_path, monkeypatch):
    """Not serve-only: its own rollouts run beside the server; a cancelled run (a cancelled
    deployment run, Ctrl-C) stops the server before the worker closes, and its rollouts commit."""
    monkeypatch.setenv("TREADLE_GATEWAY_TOKEN", TOKEN)
    run, store = serving_run(tmp_path, 0, orchestrator={"concurrency": 2})
    worker = make_worker(store, run, http=run.gateway_http, flush_seconds=600)

    async def body():
        await worker.start()
        running = asyncio.create_task(worker.run())
        try:
            while worker.http_server is None or not worker.orchestrator.stats.written:
                await asyncio.sleep(0.05)
            url = worker.http_server.url
            async with httpx.AsyncClient(base_url=url) as client:
                assert (await client.get("/health")).status_code == 200
                running.cancel()
                await asyncio.gather(running, return_exceptions=True)
                assert worker.http_server is None
                with pytest.raises(httpx.TransportError):
                    await client.get("/health")
        finally:
            running.cancel()
            await worker.close()

    asyncio.run(asyncio.wait_for(body(), WAIT_S))
    (shard,) = ShardReader(store, "raw").poll()[0]
    assert shard.num_rows >= 1


def test_a_connection_past_the_runs_max_connections_is_closed_at_once(tmp_path, monkeypatch):
    """``gateway_http.max_connections`` bounds the connections the worker's server holds."""
    monkeypatch.setenv("TREADLE_GATEWAY_TOKEN", TOKEN)
    run, store = serving_run(tmp_path, 0, serve_only=True, max_connections=1)
    worker = make_worker(store, run, http=run.gateway_http)

    async def body():
        await worker.start()
        running = asyncio.create_task(worker.run())
        try:
            async with harness_client(worker, running) as client:
                assert (await client.get("/health")).status_code == 200  # its connection stays open
                host, port = urllib.parse.urlsplit(worker.http_server.url).netloc.split(":")
                reader, writer = await asyncio.open_connection(host, int(port))
                writer.write(b"GET /health HTTP/1.1\r\nHost: gateway\r\n\r\n")
                assert await asyncio.wait_for(reader.read(), 20) == b""
                writer.close()
        finally:
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
            await worker.close()

    asyncio.run(asyncio.wait_for(body(), WAIT_S))


def test_a_harness_that_does_not_finish_its_request_within_the_runs_read_timeout_is_disconnected(
    tmp_path, monkeypatch
):
    """``gateway_http.read_timeout_s`` bounds a stalled client: the worker's server had the
    server's own default (60 s) whatever the run set."""
    monkeypatch.setenv("TREADLE_GATEWAY_TOKEN", TOKEN)
    run, store = serving_run(tmp_path, 0, serve_only=True, read_timeout_s=0.5)
    worker = make_worker(store, run, http=run.gateway_http)

    async def body():
        await worker.start()
        running = asyncio.create_task(worker.run())
        try:
            await until(lambda: worker.http_server is not None, "the worker to serve")
            host, port = urllib.parse.urlsplit(worker.http_server.url).netloc.split(":")
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\n")  # and no more
            await writer.drain()
            # the test's own bound, far past the run's timeout and far below the default
            assert await asyncio.wait_for(reader.read(), 20) == b""
            writer.close()
        finally:
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
            await worker.close()

    asyncio.run(asyncio.wait_for(body(), WAIT_S))


def test_a_serve_only_worker_stopped_under_generating_requests_answers_each(tmp_path, monkeypatch):
    """A worker stopped as SIGTERM stops it (its run cancelled: tasks.event_loop.run_async)
    while harness requests generate answers each of them over HTTP once its drain is over: a
    503 naming the stop, where uvicorn answered a bare 500 "Internal Server Error" and logged
    a traceback for each. The drain is cut to none so that the requests, each of the model's
    whole context, are surely running at its end (``gateway_http.drain_timeout_s`` 0)."""
    monkeypatch.setenv("TREADLE_GATEWAY_TOKEN", TOKEN)
    run, store = serving_run(tmp_path, 0, serve_only=True, drain_timeout_s=0)
    worker = make_worker(store, run, http=run.gateway_http, flush_seconds=600)
    requests = 3

    async def generate(client: httpx.AsyncClient, prompt_id: str) -> httpx.Response:
        opened = (await client.post("/v1/sessions", json={"task": "arith", "prompt_id": prompt_id})).json()
        return await client.post(
            "/v1/generate",
            json={"token_ids": [5, 6, 7], "max_new_tokens": TINY.max_position_embeddings, "stop_ids": []},
            headers={SESSION_HEADER: opened["session_id"]},
        )

    async def body() -> list[httpx.Response]:
        await worker.start()
        running = asyncio.create_task(worker.run())
        try:
            async with harness_client(worker, running) as client:
                sent = [asyncio.create_task(generate(client, f"p{i}")) for i in range(requests)]
                (engine,) = worker.engines
                while engine.stats().extra["active"] < requests:
                    assert not any(task.done() for task in sent), [
                        task.result().text for task in sent if task.done()
                    ]
                    await asyncio.sleep(0.01)
                running.cancel()
                await asyncio.gather(running, return_exceptions=True)
                return await asyncio.gather(*sent)
        finally:
            running.cancel()
            await worker.close()

    answers = asyncio.run(asyncio.wait_for(body(), WAIT_S))
    assert [answer.status_code for answer in answers] == [503] * requests, [a.text for a in answers]
    assert all("the gateway server is stopping" in answer.json()["error"]["message"] for answer in answers)


def test_a_harness_write_buffered_but_not_committed_is_kept_and_its_resend_refused(tmp_path, monkeypatch):
    """A write that the worker's writer buffered but whose commit failed in the request (the store
    down past its max_unsaved_records) is kept for the next flush: answered as written, and a
    resend is refused, so that each trajectory is committed once. Past that bound a write is
    refused (503, nothing buffered) rather than held in memory without end while the store is
    down; sent again once the store is back, it is written."""
    monkeypatch.setenv("TREADLE_GATEWAY_TOKEN", TOKEN)
    run, store = serving_run(tmp_path, 0, serve_only=True)
    store_down = threading.Event()
    store_down.set()

    def before_commit() -> None:
        if store_down.is_set():
            raise OSError("the store is down")

    worker = make_worker(
        store, run, http=run.gateway_http, flush_records=1, flush_seconds=600, before_commit=before_commit
    )
    ids = [f"t{i}" for i in range(worker.writer.max_unsaved_records + 1)]

    def execution(record: dict, tid: str) -> dict:
        return {"records": [{**record, "trajectory_id": tid, "execution_id": tid}]}

    async def body():
        await worker.start()
        running = asyncio.create_task(worker.run())
        try:
            async with harness_client(worker, running) as client:
                record = await recorded(client)
                for tid in ids:
                    answer = await client.post("/v1/records", json=execution(record, tid))
                    assert answer.status_code == 200, answer.text
                resent = await client.post("/v1/records", json=execution(record, ids[-1]))
                assert resent.status_code == 400 and "written already" in resent.text
                held = worker.writer.unsaved_records
                refused = await client.post("/v1/records", json=execution(record, "late"))
                assert refused.status_code == 503 and "send it again" in refused.text, refused.text
                assert "max_unsaved_records" in refused.text
                assert worker.writer.unsaved_records == held and worker.harness_records == len(ids)
                store_down.clear()
                worker.writer.flush()  # what the worker's flusher does once the records are due
                again = await client.post("/v1/records", json=execution(record, "late"))
                assert again.status_code == 200, again.text
            worker.stop()
            await running
        finally:
            store_down.clear()
            running.cancel()
            await worker.close()

    asyncio.run(asyncio.wait_for(body(), WAIT_S))
    reader = ShardReader(store, "raw")
    written = [
        tid for shard in reader.poll()[0] for tid in reader.read(shard).column("trajectory_id").to_pylist()
    ]
    assert sorted(written) == sorted([*ids, "late"])


def test_a_harness_write_counts_its_records_and_is_refused_once_the_workers_name_is_taken(
    tmp_path, monkeypatch
):
    """A commit that finds the worker's name taken (another process took it over) stops its
    shards for good: the harness's next write is told it was not written (503), not that it
    was, and is not counted; the progress line counts the records it took, two for an
    execution of two."""
    monkeypatch.setenv("TREADLE_GATEWAY_TOKEN", TOKEN)
    run, store = serving_run(tmp_path, 0, serve_only=True)

    def before_commit() -> None:
        raise InUse("rollout worker 'w0' was taken over by another process (injected)")

    worker = make_worker(
        store, run, http=run.gateway_http, flush_records=2, flush_seconds=600, before_commit=before_commit
    )

    def execution(record: dict, name: str) -> dict:
        return {
            "records": [{**record, "trajectory_id": f"{name}-{i}", "execution_id": name} for i in range(2)]
        }

    closed = []

    async def body() -> str:
        await worker.start()
        running = asyncio.create_task(worker.run())
        try:
            async with harness_client(worker, running) as client:
                record = await recorded(client)
                written = await client.post("/v1/records", json=execution(record, "e1"))
                assert written.status_code == 200, written.text
                detail = rollout_detail(await worker.status())
                refused = await client.post("/v1/records", json=execution(record, "e2"))
                assert refused.status_code == 503 and "taken over" in refused.text, refused.text
                again = await client.post("/v1/records", json=execution(record, "e2"))  # its harness's resend
                assert again.status_code == 503 and "taken over" in again.text, again.text
            return detail
        finally:
            worker.stop()
            await asyncio.gather(running, return_exceptions=True)
            closed.extend(await asyncio.gather(worker.close(), return_exceptions=True))

    assert "2 records written by harnesses" in asyncio.run(asyncio.wait_for(body(), WAIT_S))
    assert worker.harness_records == 2
    assert isinstance(closed[0], InUse)  # the worker stops on it too, committing nothing more
    # the records answered 200 are not lost: they wait in the quarantine; the refused write's
    # do not, as its harness was told they were not written (it sends them again, elsewhere)
    (kept,) = store.fs.glob(store.path("shards/quarantine/raw/w0/uncommitted-*.arrow"))
    with store.fs.open(kept, "rb") as source:
        assert pa.ipc.open_file(source).read_all().column("trajectory_id").to_pylist() == ["e1-0", "e1-1"]


def test_a_harness_opening_a_rollout_while_the_trainer_lags_is_told_to_retry_and_open_ones_go_on(
    tmp_path, monkeypatch
):
    """A serve-only worker whose harness's written records pile up past max_backlog (or whose
    trainer holds too much untrained): a new rollout is refused with a 429 saying why, as the
    worker's own would wait; a turn of an open session and a branch of a live rollout are served,
    and a new rollout opens once the trainer catches up."""
    monkeypatch.setenv("TREADLE_GATEWAY_TOKEN", TOKEN)
    run, store = serving_run(tmp_path, 0, orchestrator={"max_backlog": 1}, serve_only=True)
    worker = make_worker(store, run, http=run.gateway_http, flush_records=1, trainer_poll_s=0.05)
    rollout = {"task": "arith", "prompt_id": "p1"}

    async def body():
        await worker.start()
        running = asyncio.create_task(worker.run())
        try:
            async with harness_client(worker, running) as client:

                async def turn(session_id: str) -> httpx.Response:
                    return await client.post(
                        "/v1/generate", json={"token_ids": [5, 6]}, headers={SESSION_HEADER: session_id}
                    )

                live = (await client.post("/v1/sessions", json=rollout)).json()
                assert (await turn(live["session_id"])).status_code == 200
                written = []
                for _ in range(2):  # a shard each (flush_records 1): a backlog of 2 > max_backlog 1
                    opened = (await client.post("/v1/sessions", json=rollout)).json()
                    await turn(opened["session_id"])
                    reply = await client.post(
                        f"/v1/sessions/{opened['session_id']}/record", json={"reward": 1.0, "write": True}
                    )
                    assert reply.status_code == 200, reply.text
                    await client.delete(f"/v1/sessions/{opened['session_id']}")
                    written.append(opened["trajectory_id"])
                await until(lambda: worker.backlog() == 2, "the written records to commit")

                refused = await client.post("/v1/sessions", json=rollout)
                assert refused.status_code == 429 and refused.headers["Retry-After"] == str(RETRY_AFTER_S)
                error = refused.json()["error"]
                assert error["code"] == 429 and error["type"] == "rate_limit_error"
                assert (
                    "(backlog 2 shards > max_backlog 1: waits for a new weight version)" in error["message"]
                )
                assert (await turn(live["session_id"])).status_code == 200
                branch = await client.post(
                    "/v1/sessions", json={**rollout, "parent_id": live["trajectory_id"]}
                )
                assert branch.status_code == 200, branch.text
                ended = await client.post("/v1/sessions", json={**rollout, "parent_id": written[0]})
                assert ended.status_code == 429  # its rollout ended: a branch of it is a new one
                status = await worker.status()
                assert status["harness_sessions_refused"] == 2
                line = rollout_detail(status)
                assert "paused: backlog 2 shards > max_backlog 1: waits for a new weight version" in line
                assert "2 new harness rollouts refused (429) while paused" in line
                worker.service.gateway.close(worker.service.gateway.open(**rollout).session_id)

                model, tokenizer = build_tiny_model(TINY)
                await asyncio.to_thread(publish_policy, WeightStore(store), model, tokenizer, step=1)
                await until(lambda: worker.backlog() == 0, "the new version to clear the backlog")
                assert (await client.post("/v1/sessions", json=rollout)).status_code == 200
                status = await worker.status()
                assert status["backpressure"] is None and "paused:" not in rollout_detail(status)

                board = TrainerStatusBoard(store)
                board.publish(TrainerStatus(time=time.time(), buffered_tokens=5000, token_budget=1000))
                await until(lambda: worker.trainer_queue() == 5.0, "the trainer's queue")
                refused = await client.post("/v1/sessions", json=rollout)
                assert refused.status_code == 429
                assert "the trainer holds 5.0 steps' worth untrained > max_trainer_batches 2" in refused.text
                board.publish(TrainerStatus(time=time.time(), buffered_tokens=0, token_budget=1000))
                await until(lambda: worker.trainer_queue() == 0, "the trainer to catch up")
                assert (await client.post("/v1/sessions", json=rollout)).status_code == 200
        finally:
            worker.stop()
            await asyncio.gather(running, return_exceptions=True)
            await worker.close()

    asyncio.run(asyncio.wait_for(body(), WAIT_S))
