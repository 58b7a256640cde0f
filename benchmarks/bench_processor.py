"""Trajectory processor throughput and token saving on a synthetic branching workload.

Workload: executions of long agent trajectories (a long prompt, then alternating action and
observation turns) with several branch points taken from random earlier trajectories late
in their history (long shared prefixes), nested branches and exact retries; about 60k tokens
an execution, so the default 24 executions are 1.4M tokens.

Measured side by side in one run:
- ours: ``rl.processor.process_shard`` on the Arrow table (all of it: checks, prefix trees,
  dedup sampling, weights, the processed table and the trajectory rows);
- straightforward: the same dedup written per trajectory in plain Python — a dict trie
  walked token by token, and the gains recomputed by walking every candidate path after
  each pick.

Each side, and the trie walk alone (``ratio_vs_trie_walk_only``), runs ``--repeats`` times,
taking turns (:func:`alternated_best`); the best run of each counts.

With ``j_max`` unlimited both must train exactly the number of distinct trainable tokens
(asserted). The last line is a JSON object:
``{"bench": "processor", "ratio": ours/straightforward tokens/s, "tokens_per_s": ours,
"token_saving": 1 - trained/action tokens in, ...}``.

Run: ``.venv/bin/python benchmarks/bench_processor.py`` (``--executions`` to resize, down to 1).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections import defaultdict
from collections.abc import Callable
from itertools import accumulate

import numpy as np
import pyarrow as pa

from rl.processor import ProcessorConfig, process_shard
from storage.schema import TRAJECTORY_SCHEMA

VOCAB = 50_000


def turns(
    rng: np.random.Generator, n_turns: int, *, prompt: int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Random ``(tokens, action_mask, logprobs)`` of a prompt and ``n_turns`` action/observation
    turns."""
    lengths, roles = [prompt], [False]
    for _ in range(n_turns):
        lengths += [int(rng.integers(80, 400)), int(rng.integers(40, 300))]
        roles += [True, False]
    mask = np.repeat(np.array(roles), lengths)
    logprobs = np.where(mask, -rng.random(len(mask)), 0.0).astype(np.float32)
    return rng.integers(0, VOCAB, len(mask)).astype(np.int32), mask, logprobs


def workload(seed: int, executions: int) -> pa.Table:
    """Executions of ~9 trajectories: a root, 6 branches (some nested), 2 exact retries; a
    branch copies its parent's record (tokens and log-probs) before the branch point."""
    rng = np.random.default_rng(seed)
    columns = defaultdict(list)
    for e in range(executions):
        paths: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = [turns(rng, 12, prompt=1500)]
        parents, branch_at = [None], [None]
        for _ in range(6):
            p = int(rng.integers(0, len(paths)))
            tokens, mask, logprobs = paths[p]
            at = int(rng.integers(len(tokens) // 3, len(tokens)))
            tail_tokens, tail_mask, tail_logprobs = turns(rng, int(rng.integers(3, 10)))
            tail_tokens[0] = (tokens[at] + 1) % VOCAB if at < len(tokens) else tail_tokens[0]
            paths.append(
                tuple(
                    np.concatenate([head[:at], tail])
                    for head, tail in ((tokens, tail_tokens), (mask, tail_mask), (logprobs, tail_logprobs))
                )
            )
            parents.append(p)
            branch_at.append(at)
        for _ in range(2):
            p = int(rng.integers(0, len(paths)))
            paths.append(paths[p])
            parents.append(p)
            branch_at.append(len(paths[p][0]))
        for k, ((tokens, mask, logprobs), p, at) in enumerate(zip(paths, parents, branch_at, strict=True)):
            columns["trajectory_id"].append(f"e{e}-{k}")
            columns["execution_id"].append(f"e{e}")
            columns["parent_id"].append(None if p is None else f"e{e}-{p}")
            columns["branch_at"].append(at)
            columns["tokens"].append(tokens)
            columns["action_mask"].append(mask)
            columns["logprobs"].append(logprobs)
            columns["reward"].append(float(rng.random()))
            columns["progress"].append(float(rng.random()))
    n = len(columns["tokens"])
    lengths = np.array([len(t) for t in columns["tokens"]])
    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    tokens = np.concatenate(columns["tokens"])
    mask = np.concatenate(columns["action_mask"])
    turn = np.concatenate(
        [np.cumsum(np.diff(m.astype(np.int8), prepend=0) == 1) for m in columns["action_mask"]]
    )

    def lists(values: np.ndarray, type_: pa.DataType) -> pa.ListArray:
        return pa.ListArray.from_arrays(offsets, pa.array(values, type=type_))

    data = {
        "trajectory_id": pa.array(columns["trajectory_id"]),
        "execution_id": pa.array(columns["execution_id"]),
        "parent_id": pa.array(columns["parent_id"], pa.string()),
        "branch_at": pa.array(columns["branch_at"], pa.int32()),
        "task": pa.array(["swe"] * n),
        "prompt_id": pa.array([f"p{e}" for e in columns["execution_id"]]),
        "group_id": pa.nulls(n, pa.string()),
        "tokens": lists(tokens, pa.int32()),
        "logprobs": lists(np.concatenate(columns["logprobs"]), pa.float32()),
        "action_mask": lists(mask, pa.bool_()),
        "turn": lists(turn, pa.int16()),
        "versions": lists(np.where(mask, 0, -1), pa.int32()),
        "reward": pa.array(columns["reward"], pa.float32()),
        "progress": pa.array(columns["progress"], pa.float32()),
        "status": pa.array(["ok"] * n),
        "engine": pa.array(["torch-0"] * n),
        "timing": pa.nulls(n, TRAJECTORY_SCHEMA.field("timing").type),
        "error": pa.nulls(n, pa.string()),
    }
    return pa.table(data, schema=TRAJECTORY_SCHEMA)


def trie_paths(
    rows: list[int], tokens: list[list[int]], masks: list[list[bool]]
) -> tuple[dict[tuple[int, int, bool], int], list[bool], dict[int, list[int]]]:
    """One execution's dict trie, walked token by token: (children, is_action per node,
    node path of each row)."""
    children: dict[tuple[int, int, bool], int] = {}
    is_action = [False]
    paths = {}
    for i in rows:
        node, path = 0, []
        for token, action in zip(tokens[i], masks[i], strict=True):
            key = (node, token, action)
            child = children.get(key)
            if child is None:
                child = children[key] = len(is_action)
                is_action.append(action)
            node = child
            path.append(node)
        paths[i] = path
    return children, is_action, paths


def trie_only(table: pa.Table) -> None:
    """The trie walk alone: a floor for any per-token Python implementation."""
    executions = table.column("execution_id").to_pylist()
    tokens = table.column("tokens").to_pylist()
    masks = table.column("action_mask").to_pylist()
    rows_of = defaultdict(list)
    for i, eid in enumerate(executions):
        rows_of[eid].append(i)
    for rows in rows_of.values():
        trie_paths(rows, tokens, masks)


def straightforward_process(table: pa.Table, j_max: int | None, seed: int) -> dict[int, list[bool]]:
    """Per-trajectory Python dedup: returns the train mask of each selected row."""
    rng = random.Random(seed)
    executions = table.column("execution_id").to_pylist()
    tokens = table.column("tokens").to_pylist()
    masks = table.column("action_mask").to_pylist()
    rows_of = defaultdict(list)
    for i, eid in enumerate(executions):
        rows_of[eid].append(i)
    train_masks: dict[int, list[bool]] = {}
    for rows in rows_of.values():
        children, is_action, paths = trie_paths(rows, tokens, masks)
        inner = {parent for parent, _, _ in children}
        ends, leaves = set(), []
        for i in rows:
            end = paths[i][-1] if paths[i] else 0
            if end not in inner and end not in ends:
                ends.add(end)
                leaves.append(i)
        trained: set[int] = set()
        picks = 0
        while leaves and (j_max is None or picks < j_max):
            gains = [sum(1 for node in paths[i] if is_action[node] and node not in trained) for i in leaves]
            total = sum(gains)
            if total == 0:
                break
            target = rng.random() * total
            pick = next(i for i, running in zip(leaves, accumulate(gains), strict=True) if running > target)
            train_masks[pick] = [is_action[node] and node not in trained for node in paths[pick]]
            trained.update(node for node in paths[pick] if is_action[node])
            leaves.remove(pick)
            picks += 1
    return train_masks


def alternated_best(sides: dict[str, Callable[[], object]], repeats: int) -> dict[str, tuple[float, object]]:
    """Each side's fewest seconds over ``repeats`` runs and its last run's result; the sides
    take turns, so that the machine's drift (neighbours' load, clock changes) reaches both alike."""
    seconds: dict[str, list[float]] = {name: [] for name in sides}
    results: dict[str, object] = {}
    for _ in range(repeats):
        for name, run in sides.items():
            start = time.perf_counter()
            results[name] = run()
            seconds[name].append(time.perf_counter() - start)
    return {name: (min(seconds[name]), results[name]) for name in sides}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--executions", type=int, default=24)
    parser.add_argument(
        "--repeats", type=int, default=5, help="runs of each side, alternated; the best counts"
    )
    args = parser.parse_args()
    if args.executions < 1 or args.repeats < 1:
        parser.error("--executions and --repeats must be at least 1")
    pa.set_cpu_count(1)  # one core: numpy here is single-threaded, Arrow's pool is capped

    table = workload(0, args.executions)
    tokens_in = int(sum(len(t) for t in table.column("tokens").to_numpy(zero_copy_only=False)))
    print(f"workload: {args.executions} executions, {table.num_rows} trajectories, {tokens_in} tokens")

    config = ProcessorConfig(j_max=None, progress_weight=0.5)
    best = alternated_best(
        {
            "ours": lambda: process_shard(table, config, shard_id="bench"),
            "straightforward": lambda: straightforward_process(table, None, seed=0),
            "trie walk": lambda: trie_only(table),
        },
        args.repeats,
    )
    ours, result = best["ours"]
    straightforward, reference = best["straightforward"]
    trie_seconds, _ = best["trie walk"]

    distinct = sum(sum(mask) for mask in reference.values())
    counters = result.counters
    print(
        f"action tokens in {counters.action_tokens_in}, distinct trainable {distinct}, trained (ours) {counters.train_tokens_out}"
    )
    assert counters.train_tokens_out == distinct, (
        "unlimited j_max must train every distinct trainable token once"
    )

    bounded = process_shard(table, ProcessorConfig(j_max=5), shard_id="bench").counters
    saving = 1 - counters.train_tokens_out / counters.action_tokens_in
    saving_j5 = 1 - bounded.train_tokens_out / counters.action_tokens_in
    ours_rate = tokens_in / ours
    straightforward_rate = tokens_in / straightforward
    print(
        f"ours: {ours:.3f} s ({ours_rate / 1e6:.1f} M tokens/s); straightforward: {straightforward:.2f} s "
        f"({straightforward_rate / 1e6:.2f} M tokens/s)"
    )
    print(f"the per-token trie walk alone: {trie_seconds:.2f} s (ours is {trie_seconds / ours:.1f}x faster)")
    print(
        f"token saving: {saving:.1%} uncapped, {saving_j5:.1%} with j_max=5 ({bounded.trajectories_out} rows)"
    )
    print(
        json.dumps(
            {
                "bench": "processor",
                "ratio": round(ours_rate / straightforward_rate, 2),
                "tokens_per_s": round(ours_rate),
                "straightforward_tokens_per_s": round(straightforward_rate),
                "ratio_vs_trie_walk_only": round(trie_seconds / ours, 2),
                "token_saving": round(saving, 4),
                "token_saving_j_max_5": round(saving_j5, 4),
                "tokens_in": tokens_in,
                "action_tokens_in": counters.action_tokens_in,
                "train_tokens_out": counters.train_tokens_out,
                "distinct_trainable_tokens": distinct,
            }
        )
    )


if __name__ == "__main__":
    main()
