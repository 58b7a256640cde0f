"""Shard files that no ShardWriter of this treadle wrote (a buggy writer's, a newer one's),
committed where a shard goes so readers meet them as they would in a run."""

from __future__ import annotations

import io

import pyarrow as pa

from storage.config import RunStore
from storage.shards import ShardInfo
from storage.tables import Tables


def commit_foreign_file(store: RunStore, seq: int, payload: bytes, kind: str = "raw") -> ShardInfo:
    """Put ``payload`` where shard ``<kind>/w9/<seq>`` goes and commit it."""
    info = ShardInfo(
        shard_id=f"{kind}/w9/{seq:08d}",
        kind=kind,
        path=f"shards/{kind}/w9/{seq:08d}.arrow",
        worker="w9",
        seq=seq,
        num_rows=2,
        num_tokens=48,
        min_version=0,
        max_version=1,
    )
    store.fs.pipe_file(store.path(info.path), payload)
    Tables(store).append(
        "shards", [info.__dict__ | {"committed_at": pa.scalar(0, pa.timestamp("us", tz="UTC"))}]
    )
    return info


def ipc_bytes(table: pa.Table) -> bytes:
    """``table`` as the bytes of an (uncompressed) Arrow IPC file."""
    sink = io.BytesIO()
    with pa.ipc.new_file(sink, table.schema) as out:
        out.write_table(table)
    return sink.getvalue()


def first_version(table: pa.Table) -> pa.Table:
    """``table`` (raw or processed records) as treadle wrote it before the record had ``error``:
    without the column, its schema naming version 1 (``trajectory/1``, ``processed/1``)."""
    named = table.schema.metadata[b"treadle.schema"].decode().partition("/")[0]
    fields = [field for field in table.schema if field.name != "error"]
    schema = pa.schema(fields, metadata={"treadle.schema": f"{named}/1"})
    return pa.Table.from_arrays([table.column(field.name) for field in fields], schema=schema)
