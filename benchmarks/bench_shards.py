"""Shard throughput: ShardWriter/ShardReader against plain pyarrow IPC, same data, same run.

Both sides stream the same record batches (~2,000 tokens per trajectory) through a local
folder with the same compression: treadle writes, validates and commits a shard per
``flush_records`` trajectories (temp file, rename, one Delta append) and reads every
committed shard back through the Delta log, validated; the baseline writes one Arrow
IPC file with pyarrow and reads it back batch by batch. Throughput is trajectories per
second over write + read. Peak memory of the treadle pass is its RSS growth, shown
beside the total data size and the size of one flush.

    python benchmarks/bench_shards.py [--trajectories 20480] [--flush-records 256]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import threading
import time
import uuid

import numpy as np
import psutil
import pyarrow as pa

from storage.config import RunStore, StorageConfig
from storage.schema import TRAJECTORY_SCHEMA, validate
from storage.shards import COMPRESSION, ShardReader, ShardWriter


def make_batch(seed: int, rows: int, mean_tokens: int) -> pa.Table:
    """``rows`` valid trajectories of about ``mean_tokens`` tokens, built with numpy."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(mean_tokens * 3 // 4, mean_tokens * 5 // 4 + 1, rows)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    total = int(offsets[-1])
    position = np.arange(total) - np.repeat(offsets[:-1], lengths)
    turn = (position // 200).astype(np.int16)
    action_mask = (turn % 2 == 1) & (position >= 100)
    logprobs = np.where(action_mask, -rng.exponential(0.5, total), 0.0).astype(np.float32)
    versions = np.where(action_mask, seed % 7, -1).astype(np.int32)

    def lists(values: np.ndarray) -> pa.ListArray:
        return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))

    ids = [f"{seed}-{uuid.uuid4().hex[:8]}-{i}" for i in range(rows)]
    columns = {
        "trajectory_id": ids,
        "execution_id": ids,
        "parent_id": pa.nulls(rows, pa.string()),
        "branch_at": pa.nulls(rows, pa.int32()),
        "task": ["bench"] * rows,
        "prompt_id": [f"p{i % 97}" for i in range(rows)],
        "group_id": pa.nulls(rows, pa.string()),
        "tokens": lists(rng.integers(0, 32_000, total, dtype=np.int32)),
        "logprobs": lists(logprobs),
        "action_mask": lists(action_mask),
        "turn": lists(turn),
        "versions": lists(versions),
        "reward": rng.random(rows, dtype=np.float32),
        "progress": rng.random(rows, dtype=np.float32),
        "status": ["ok"] * rows,
        "engine": ["torch-0"] * rows,
        "timing": pa.nulls(rows, TRAJECTORY_SCHEMA.field("timing").type),
    }
    return validate(pa.table(columns).cast(TRAJECTORY_SCHEMA))


class PeakRSS:
    """Highest resident set size seen while the block runs, sampled every 5 ms."""

    def __init__(self) -> None:
        self.process = psutil.Process()
        self.start = self.peak = self.process.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self.process.memory_info().rss)

    def __enter__(self) -> PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def growth(self) -> int:
        return self.peak - self.start


def run_treadle(root: str, pool: list[pa.Table], num_batches: int, flush_records: int) -> dict[str, float]:
    store = RunStore(StorageConfig(root=root), f"bench-{uuid.uuid4().hex[:8]}")
    with PeakRSS() as memory:
        started = time.perf_counter()
        with ShardWriter(store, "bench", flush_records=flush_records, flush_seconds=3600) as writer:
            for i in range(num_batches):
                writer.write_table(pool[i % len(pool)])
        written = time.perf_counter()
        reader = ShardReader(store)
        shards, _ = reader.poll()
        rows = 0
        for shard in shards:
            table = reader.read(shard)
            rows += table.num_rows
            del table
        finished = time.perf_counter()
    return {"rows": rows, "shards": len(shards), "write_s": written - started, "read_s": finished - written,
            "peak_rss_growth_bytes": memory.growth}  # fmt: skip


def run_raw(root: str, pool: list[pa.Table], num_batches: int) -> dict[str, float]:
    path = os.path.join(root, f"raw-{uuid.uuid4().hex[:8]}.arrow")
    options = pa.ipc.IpcWriteOptions(compression=COMPRESSION)
    with PeakRSS() as memory:
        started = time.perf_counter()
        with pa.OSFile(path, "wb") as sink, pa.ipc.new_file(sink, TRAJECTORY_SCHEMA, options=options) as out:
            for i in range(num_batches):
                out.write_table(pool[i % len(pool)])
        written = time.perf_counter()
        rows = 0
        with pa.OSFile(path, "rb") as source:
            reader = pa.ipc.open_file(source)
            for i in range(reader.num_record_batches):
                rows += reader.get_batch(i).num_rows
        finished = time.perf_counter()
    return {"rows": rows, "write_s": written - started, "read_s": finished - written,
            "peak_rss_growth_bytes": memory.growth}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--trajectories", type=int, default=20_480, help="trajectories written and read per pass"
    )
    parser.add_argument("--flush-records", type=int, default=2048, help="trajectories per shard")
    parser.add_argument(
        "--batch-rows", type=int, default=256, help="trajectories per batch handed to the writers"
    )
    parser.add_argument("--tokens", type=int, default=2_000, help="mean tokens per trajectory")
    parser.add_argument(
        "--repeats", type=int, default=2, help="passes of each side, alternated; best is kept"
    )
    parser.add_argument("--root", default=None, help="local folder for the data (default: a temp dir)")
    args = parser.parse_args()

    pool = [make_batch(seed, args.batch_rows, args.tokens) for seed in range(4)]
    num_batches = -(-args.trajectories // args.batch_rows)
    trajectories = num_batches * args.batch_rows
    total_bytes = sum(pool[i % len(pool)].nbytes for i in range(num_batches))
    root = tempfile.mkdtemp(prefix="bench-shards-", dir=args.root)
    try:
        treadle, raw = [], []
        for _ in range(args.repeats):
            raw.append(run_raw(root, pool, num_batches))
            treadle.append(run_treadle(root, pool, num_batches, args.flush_records))
            shutil.rmtree(root)
            os.makedirs(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    assert all(r["rows"] == trajectories for r in treadle + raw), "a pass lost rows"
    best_treadle = min(treadle, key=lambda r: r["write_s"] + r["read_s"])
    best_raw = min(raw, key=lambda r: r["write_s"] + r["read_s"])
    treadle_tps = trajectories / (best_treadle["write_s"] + best_treadle["read_s"])
    raw_tps = trajectories / (best_raw["write_s"] + best_raw["read_s"])
    for name, result in (("treadle", best_treadle), ("raw pyarrow", best_raw)):
        print(f"{name:12s} write {result['write_s']:.2f} s, read {result['read_s']:.2f} s, "
              f"peak RSS growth {result['peak_rss_growth_bytes'] / 2**20:.0f} MiB")  # fmt: skip
    print(
        json.dumps(
            {
                "bench": "shards",
                "ratio": round(treadle_tps / raw_tps, 3),
                "treadle_trajectories_per_s": round(treadle_tps, 1),
                "raw_trajectories_per_s": round(raw_tps, 1),
                "trajectories": trajectories,
                "mean_tokens": args.tokens,
                "compression": f"{COMPRESSION} (Arrow IPC, both sides)",
                "shards": best_treadle["shards"],
                "flush_records": args.flush_records,
                "treadle_write_s": round(best_treadle["write_s"], 3),
                "treadle_read_s": round(best_treadle["read_s"], 3),
                "raw_write_s": round(best_raw["write_s"], 3),
                "raw_read_s": round(best_raw["read_s"], 3),
                "total_data_bytes": total_bytes,
                "batch_rows": args.batch_rows,
                "flush_bytes": pool[0].nbytes * args.flush_records // args.batch_rows,
                "treadle_peak_rss_growth_bytes": best_treadle["peak_rss_growth_bytes"],
                "raw_peak_rss_growth_bytes": best_raw["peak_rss_growth_bytes"],
                "repeats": args.repeats,
            }
        )
    )


if __name__ == "__main__":
    main()
