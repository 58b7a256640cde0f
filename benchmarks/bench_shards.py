"""Shard throughput: ShardWriter/ShardReader against plain pyarrow IPC, same data, same run.

Both sides stream the same in-memory record batches (``--batch-rows`` trajectories of
~``--tokens`` tokens each) through a local folder, zstd-compressed Arrow IPC on both
sides (pyarrow's default zstd level and threading, identical ``IpcWriteOptions``).

- treadle: ``ShardWriter.write_table`` per batch (cast, validate every record), a shard
  per ``flush_records`` trajectories (IPC file to a temp key, rename, one Delta commit of
  its row); then ``ShardReader.poll`` through the Delta log and ``read`` of every shard
  (whole shard into memory, schema and row count checked, every record validated).
- raw pyarrow: one IPC file written batch by batch with ``pa.ipc.new_file``, then read
  back batch by batch with ``get_batch`` (decompressing every batch). No validation, no
  commit.

Throughput is trajectories per second over write + read, best of ``--repeats`` passes
of each side, alternated, at the default flush size (256) and at ``--flush-records``.
The ratio printed is at ``--flush-records``; the one at 256 is beside it. Each side's CPU
time (all threads) is printed too: ``cpu_ratio`` (raw core-seconds / treadle's) is the
ratio treadle would reach if it kept the cores as busy as raw pyarrow does, so on a
machine whose cores raw pyarrow already fills, the headline ratio cannot pass it.

Memory: each side is also run in a fresh process at ``--trajectories`` and at twice as
many, with every batch a fresh copy that the producer drops after handing it over (as a
rollout worker would). Peak RSS growth over the process's start (pool built) should track
the flush size, not the number of trajectories.

    python benchmarks/bench_shards.py [--trajectories 20480] [--flush-records 2048]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
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

DEFAULT_FLUSH_RECORDS = 256
"""``ShardWriter``'s default flush size, always measured beside ``--flush-records``."""


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
        "error": pa.nulls(rows, pa.string()),
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


def cpu_seconds() -> float:
    """CPU time of this process so far, every thread's (user + system)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def batches(pool: list[pa.Table], num_batches: int, fresh: bool):
    """The batches handed to the writers: the pool's in turn, or fresh copies of them."""
    for i in range(num_batches):
        table = pool[i % len(pool)]
        yield table.take(np.arange(table.num_rows)) if fresh else table


def run_treadle(
    root: str, pool: list[pa.Table], num_batches: int, flush_records: int, fresh: bool = False
) -> dict[str, float]:
    store = RunStore(StorageConfig(root=root), f"bench-{uuid.uuid4().hex[:8]}")
    with PeakRSS() as memory:
        started, cpu_started = time.perf_counter(), cpu_seconds()
        with ShardWriter(store, "bench", flush_records=flush_records, flush_seconds=3600) as writer:
            for table in batches(pool, num_batches, fresh):
                writer.write_table(table)
                del table
        written = time.perf_counter()
        reader = ShardReader(store)
        shards, _ = reader.poll()
        rows = 0
        for shard in shards:
            table = reader.read(shard)
            rows += table.num_rows
            del table
        finished, cpu_finished = time.perf_counter(), cpu_seconds()
    return {"rows": rows, "shards": len(shards), "write_s": written - started, "read_s": finished - written,
            "cpu_s": cpu_finished - cpu_started, "peak_rss_growth_bytes": memory.growth}  # fmt: skip


def run_raw(root: str, pool: list[pa.Table], num_batches: int, fresh: bool = False) -> dict[str, float]:
    path = os.path.join(root, f"raw-{uuid.uuid4().hex[:8]}.arrow")
    options = pa.ipc.IpcWriteOptions(compression=COMPRESSION)
    with PeakRSS() as memory:
        started, cpu_started = time.perf_counter(), cpu_seconds()
        with pa.OSFile(path, "wb") as sink, pa.ipc.new_file(sink, TRAJECTORY_SCHEMA, options=options) as out:
            for table in batches(pool, num_batches, fresh):
                out.write_table(table)
                del table
        written = time.perf_counter()
        rows = 0
        with pa.OSFile(path, "rb") as source:
            reader = pa.ipc.open_file(source)
            for i in range(reader.num_record_batches):
                rows += reader.get_batch(i).num_rows
        finished, cpu_finished = time.perf_counter(), cpu_seconds()
    return {"rows": rows, "write_s": written - started, "read_s": finished - written,
            "cpu_s": cpu_finished - cpu_started, "peak_rss_growth_bytes": memory.growth}  # fmt: skip


def compare(root: str, pool: list[pa.Table], num_batches: int, flush_records: int, repeats: int) -> dict:
    """Best treadle and raw pass at ``flush_records``, alternated side by side."""
    treadle, raw = [], []
    for _ in range(repeats):
        raw.append(run_raw(root, pool, num_batches))
        treadle.append(run_treadle(root, pool, num_batches, flush_records))
        shutil.rmtree(root)
        os.makedirs(root)
    trajectories = num_batches * pool[0].num_rows
    assert all(r["rows"] == trajectories for r in treadle + raw), "a pass lost rows"
    best_treadle = min(treadle, key=lambda r: r["write_s"] + r["read_s"])
    best_raw = min(raw, key=lambda r: r["write_s"] + r["read_s"])
    treadle_tps = trajectories / (best_treadle["write_s"] + best_treadle["read_s"])
    raw_tps = trajectories / (best_raw["write_s"] + best_raw["read_s"])
    for name, result in (("treadle", best_treadle), ("raw pyarrow", best_raw)):
        wall = result["write_s"] + result["read_s"]
        print(
            f"flush {flush_records:5d} {name:12s} write {result['write_s']:.2f} s, read {result['read_s']:.2f} s, "
            f"CPU {result['cpu_s']:.2f} core-s ({result['cpu_s'] / wall:.2f} cores busy)"
        )
    return {"ratio": treadle_tps / raw_tps, "treadle_tps": treadle_tps, "raw_tps": raw_tps,
            "shards": best_treadle["shards"], "treadle": best_treadle, "raw": best_raw}  # fmt: skip


def memory_pass(side: str, args: argparse.Namespace, trajectories: int) -> int:
    """Peak RSS growth of one side streaming ``trajectories`` fresh trajectories, measured
    in a fresh process so that no earlier pass has warmed its allocator."""
    command = [sys.executable, __file__, "--memory-pass", side, "--trajectories", str(trajectories),
               "--flush-records", str(args.flush_records), "--batch-rows", str(args.batch_rows),
               "--tokens", str(args.tokens)]  # fmt: skip
    if args.root:
        command += ["--root", args.root]
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])["peak_rss_growth_bytes"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--trajectories", type=int, default=20_480, help="trajectories written and read per pass"
    )
    parser.add_argument(
        "--flush-records", type=int, default=2048, help="trajectories per shard of the headline ratio"
    )
    parser.add_argument(
        "--batch-rows", type=int, default=256, help="trajectories per batch handed to the writers"
    )
    parser.add_argument("--tokens", type=int, default=2_000, help="mean tokens per trajectory")
    parser.add_argument(
        "--repeats", type=int, default=3, help="passes of each side, alternated; best is kept"
    )
    parser.add_argument("--root", default=None, help="local folder for the data (default: a temp dir)")
    parser.add_argument("--memory-pass", choices=["treadle", "raw"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in ("trajectories", "flush_records", "batch_rows", "tokens", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, not {getattr(args, name)}")
    return args


def main() -> None:
    args = parse_args()

    pool = [make_batch(seed, args.batch_rows, args.tokens) for seed in range(4)]
    num_batches = -(-args.trajectories // args.batch_rows)
    trajectories = num_batches * args.batch_rows
    root = tempfile.mkdtemp(prefix="bench-shards-", dir=args.root)
    try:
        if args.memory_pass:
            if args.memory_pass == "treadle":
                result = run_treadle(root, pool, num_batches, args.flush_records, fresh=True)
            else:
                result = run_raw(root, pool, num_batches, fresh=True)
            print(json.dumps(result))
            return
        results = {
            flush: compare(root, pool, num_batches, flush, args.repeats)
            for flush in dict.fromkeys([DEFAULT_FLUSH_RECORDS, args.flush_records])
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)
    memory = {
        f"{side}_peak_rss_growth_bytes_at_{n}": memory_pass(side, args, n)
        for side in ("treadle", "raw")
        for n in (trajectories, 2 * trajectories)
    }
    for key, value in memory.items():
        print(f"{key}: {value / 2**20:.0f} MiB")
    headline = results[args.flush_records]
    small = results[DEFAULT_FLUSH_RECORDS]
    print(
        json.dumps(
            {
                "bench": "shards",
                "ratio": round(headline["ratio"], 3),
                "flush_records": args.flush_records,
                "treadle_trajectories_per_s": round(headline["treadle_tps"], 1),
                "raw_trajectories_per_s": round(headline["raw_tps"], 1),
                "shards": headline["shards"],
                "treadle_write_s": round(headline["treadle"]["write_s"], 3),
                "treadle_read_s": round(headline["treadle"]["read_s"], 3),
                "raw_write_s": round(headline["raw"]["write_s"], 3),
                "raw_read_s": round(headline["raw"]["read_s"], 3),
                "treadle_cpu_s": round(headline["treadle"]["cpu_s"], 3),
                "raw_cpu_s": round(headline["raw"]["cpu_s"], 3),
                "cpu_ratio": round(headline["raw"]["cpu_s"] / headline["treadle"]["cpu_s"], 3),
                f"ratio_at_flush_{DEFAULT_FLUSH_RECORDS}": round(small["ratio"], 3),
                f"treadle_trajectories_per_s_at_flush_{DEFAULT_FLUSH_RECORDS}": round(
                    small["treadle_tps"], 1
                ),
                f"raw_trajectories_per_s_at_flush_{DEFAULT_FLUSH_RECORDS}": round(small["raw_tps"], 1),
                "trajectories": trajectories,
                "mean_tokens": args.tokens,
                "compression": f"{COMPRESSION} (Arrow IPC, both sides)",
                "total_data_bytes": sum(pool[i % len(pool)].nbytes for i in range(num_batches)),
                "batch_rows": args.batch_rows,
                "flush_bytes": pool[0].nbytes * args.flush_records // args.batch_rows,
                **memory,
                "repeats": args.repeats,
            }
        )
    )


if __name__ == "__main__":
    main()
