"""The gateway's HTTP server writing its harness's records (``GatewayServer(write=…)``): a real
uvicorn server, a real httpx client, a real TorchEngine on the tiny model, and a real
``ShardWriter`` on a local folder."""

from __future__ import annotations

import asyncio
import contextlib
import copy

import httpx

from rollout.engines.torch_engine import TorchEngine
from rollout.gateway import Gateway, GatewayConfig
from rollout.gateway_http import SESSION_HEADER, GatewayServer
from rollout.router import Router
from storage.shards import ShardReader, ShardWriter
from tests.rollout.test_gateway_http import tiny  # noqa: F401  (the module's model fixture)


@contextlib.asynccontextmanager
async def writing(tiny, write=None):  # noqa: F811
    model, tokenizer = tiny
    engine = TorchEngine(copy.deepcopy(model), tokenizer, name="live")
    gateway = Gateway(Router([engine]), tokenizer, GatewayConfig(max_context_tokens=256, max_new_tokens=4))
    server = await GatewayServer(gateway, write=write).start()
    client = httpx.AsyncClient(
        base_url=server.url, headers={"Authorization": f"Bearer {server.token}"}, timeout=60
    )
    try:
        yield client
    finally:
        await client.aclose()
        await server.stop()
        await engine.close()


async def recorded(client: httpx.AsyncClient, **fields) -> dict:
    """A session opened with ``fields``, one turn taken, recorded (unwritten) and deleted."""
    opened = await client.post("/v1/sessions", json={"task": "arith", "prompt_id": "p1", **fields})
    assert opened.status_code == 200, opened.text
    session = opened.json()["session_id"]
    turn = await client.post("/v1/generate", json={"token_ids": [5, 6]}, headers={SESSION_HEADER: session})
    assert turn.status_code == 200, turn.text
    record = (await client.post(f"/v1/sessions/{session}/record", json={"reward": 0.5})).json()
    await client.delete(f"/v1/sessions/{session}")
    return record


def test_an_execution_is_written_whole_into_one_shard_and_a_bad_one_writes_nothing(tiny, local_store):  # noqa: F811
    writer = ShardWriter(local_store, "harness", flush_records=1000)

    async def body():
        async with writing(tiny, writer.write_table) as client:
            root = await recorded(client, trajectory_id="root")
            branch = await recorded(client, parent_id="root", branch_at=1)
            assert branch["execution_id"] == "root"
            other = await recorded(client)

            # each record's own log-probs one short: another's (the lengths are sampled) could
            # be exactly as long as this one's tokens
            root_cut = {**root, "logprobs": root["logprobs"][:-1]}
            branch_cut = {**branch, "logprobs": branch["logprobs"][:-1]}
            refusals = {
                "two executions": ([root, other], "the records hold executions"),
                "an unknown field": ([{**root, "rewrd": 1.0}], "record 0: unknown fields ['rewrd']"),
                # the table's timing would drop it without a word
                "an unknown timing entry": (
                    [root, {**branch, "timing": {"run": 1.0, "total": 3.0}}],
                    "record 1: unknown timing entries ['total']",
                ),
                "a schema error": ([root, branch_cut], "record 1: "),
                "schema errors": ([root_cut, branch_cut], " (and 1 more records)"),
                "a repeated id": (
                    [root, {**branch, "trajectory_id": "root"}],
                    "trajectory ids ['root'] repeat",
                ),
                "no records": ([], "records: List should have at least 1 item"),
            }
            for why, (records, message) in refusals.items():
                refused = await client.post("/v1/records", json={"records": records})
                assert refused.status_code == 400, why
                assert message in refused.json()["error"]["message"], (why, refused.text)
                assert writer._buffered_rows == 0, why
            one_bad = await client.post("/v1/records", json={"records": [root, branch_cut]})
            assert "more records" not in one_bad.text, one_bad.text
            # a field the request does not take is no option the server ignores
            unknown = await client.post("/v1/records", json={"records": [root, branch], "flush": True})
            assert unknown.status_code == 400 and "flush: Extra inputs are not permitted" in unknown.text
            assert writer._buffered_rows == 0

            written = await client.post("/v1/records", json={"records": [root, branch]})
            assert written.json() == {"written": 2, "execution_id": "root"}
            again = await client.post("/v1/records", json={"records": [branch]})
            assert again.status_code == 400 and "written already" in again.text

            # a record written alone must be its execution's only trajectory
            opened = await client.post(
                "/v1/sessions", json={"task": "arith", "prompt_id": "p1", "trajectory_id": "lone"}
            )
            lone = opened.json()["session_id"]
            await client.post("/v1/generate", json={"token_ids": [5]}, headers={SESSION_HEADER: lone})
            await client.post("/v1/sessions", json={"task": "arith", "prompt_id": "p1", "parent_id": "lone"})
            split = await client.post(f"/v1/sessions/{lone}/record", json={"write": True})
            assert split.status_code == 400 and "POST /v1/records" in split.text

            return branch["trajectory_id"]

    branch_id = asyncio.run(body())
    writer.close()
    reader = ShardReader(local_store, "raw")
    (shard,) = reader.poll()[0]
    assert reader.read(shard).column("trajectory_id").to_pylist() == ["root", branch_id]


def test_a_resent_write_is_told_its_records_were_written_already(tiny, local_store):  # noqa: F811
    """A harness that resent a write whose answer it lost was told "nothing of this request was
    written", though the first request had written these very records: it would take them for
    lost. The resend is still refused (each trajectory is trained once), saying they were written
    already by a request with the same records; one that changes a written record is told that
    the written one differs and that it wrote nothing."""
    writer = ShardWriter(local_store, "harness", flush_records=1000)

    async def body():
        async with writing(tiny, writer.write_table) as client:
            root = await recorded(client, trajectory_id="root")
            branch = await recorded(client, parent_id="root")
            written = await client.post("/v1/records", json={"records": [root, branch]})
            assert written.status_code == 200, written.text
            ids = ["root", branch["trajectory_id"]]
            answers = {
                "resent": await client.post("/v1/records", json={"records": [root, branch]}),
                "changed": await client.post(
                    "/v1/records", json={"records": [root, {**branch, "reward": 0.25}]}
                ),
            }
            return ids, {why: answer.json()["error"]["message"] for why, answer in answers.items()}

    ids, messages = asyncio.run(body())
    writer.close()
    assert messages == {
        "resent": f"these records (trajectories {ids}) were written already, by an earlier request of the "
        "same records; a resend writes them no more",
        "changed": f"trajectories {ids} were written already by an earlier request, {ids[1:]} with other "
        "contents than these; this request wrote nothing",
    }


def test_a_server_with_nowhere_to_write_refuses_to_write(tiny):  # noqa: F811
    async def body():
        async with writing(tiny) as client:
            record = await recorded(client)
            refused = await client.post("/v1/records", json={"records": [record]})
            assert refused.status_code == 400 and "writes no records" in refused.text
            opened = (await client.post("/v1/sessions", json={"task": "arith", "prompt_id": "p1"})).json()
            write = await client.post(f"/v1/sessions/{opened['session_id']}/record", json={"write": True})
            assert write.status_code == 400 and "writes no records" in write.text
            kept = await client.post(f"/v1/sessions/{opened['session_id']}/record", json={})
            assert kept.status_code == 200  # the session stays open and recordable

    asyncio.run(body())


def test_a_write_that_fails_answers_503_and_its_resend_is_written(tiny, local_store):  # noqa: F811
    """A write that keeps nothing (a closed writer) is answered as a JSON 503, not a bare 500, and
    its records are not taken for written: the harness's resend writes them."""
    closed = ShardWriter(local_store, "gone")
    closed.close()
    writer = ShardWriter(local_store, "harness", flush_records=1000)
    writes = iter([closed.write_table, writer.write_table])

    async def body():
        async with writing(tiny, lambda table: next(writes)(table)) as client:
            record = await recorded(client)
            failed = await client.post("/v1/records", json={"records": [record]})
            assert failed.status_code == 503, failed.text
            assert "nothing of this request was written" in failed.json()["error"]["message"]
            resent = await client.post("/v1/records", json={"records": [record]})
            assert resent.status_code == 200, resent.text
            return record["trajectory_id"]

    trajectory = asyncio.run(body())
    writer.close()
    reader = ShardReader(local_store, "raw")
    (shard,) = reader.poll()[0]
    assert reader.read(shard).column("trajectory_id").to_pylist() == [trajectory]


def test_a_server_refuses_to_write_again_the_last_trajectories_it_wrote(tiny, local_store, monkeypatch):  # noqa: F811
    """A trajectory written already is refused, among the last ``REMEMBERED_WRITES`` written
    (here 1): the server's memory of them is bounded, the oldest forgotten first."""
    monkeypatch.setattr("rollout.gateway_http.REMEMBERED_WRITES", 1)
    writer = ShardWriter(local_store, "harness", flush_records=1000)

    async def body():
        async with writing(tiny, writer.write_table) as client:
            older, newer = await recorded(client), await recorded(client)
            for record in (older, newer):
                written = await client.post("/v1/records", json={"records": [record]})
                assert written.status_code == 200, written.text
            again = await client.post("/v1/records", json={"records": [newer]})
            assert again.status_code == 400 and "written already" in again.text
            forgotten = await client.post("/v1/records", json={"records": [older]})
            assert forgotten.status_code == 200, forgotten.text

    asyncio.run(body())
    writer.close()
