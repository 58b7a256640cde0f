"""The processor's selection and per-row outputs against slow references written out here.

``select_paths`` is checked draw for draw against a roulette over sets of whole-prefix
records (gains recounted from scratch after every pick); ``process_shard``'s copied lists,
trained rewards and trajectory-table counts against plain per-row Python, on shards holding
malformed rows, duplicate ids, excluded statuses and several record batches.
"""

from __future__ import annotations

import math
import random
from collections import defaultdict

import numpy as np
import pyarrow as pa
import pytest

from rl.batching import samples_from_table
from rl.prefix_tree import path_symbols, select_paths, sorted_paths
from rl.processor import ProcessorConfig, combine_reward, process_shard
from storage.schema import EXCLUDED_STATUSES, to_table, validate


def random_paths(rng: random.Random) -> list[list[tuple[int, bool, int]]]:
    """Paths of (token, action, version) records, many sharing a prefix with an earlier one;
    position 0 is never an action."""
    paths: list[list[tuple[int, bool, int]]] = []
    for _ in range(rng.randint(1, 8)):
        path = list(rng.choice(paths)[: rng.randint(0, 6)]) if paths and rng.random() < 0.7 else []
        for _ in range(rng.randint(0, 5)):
            action = bool(path) and rng.random() < 0.6
            path.append((rng.randrange(3), action, rng.choice([1, 2]) if action else -1))
        paths.append(path)
    return paths


def slow_selection(paths, order, j_max, rng):
    """The bounded dedup sampling spelled out: a path equal to or a prefix of its successor in
    ``order`` never adds anything; every pick draws a path with probability proportional to
    its action records whose whole prefix no picked path holds yet, and trains from the first
    such position."""
    n = len(paths)
    duplicate = [False] * n
    for k in range(n - 1):
        shorter, longer = paths[order[k]], paths[order[k + 1]]
        duplicate[order[k]] = longer[: len(shorter)] == shorter
    trained: set[tuple] = set()
    selected, start, picks = [False] * n, [0] * n, 0
    while j_max is None or picks < j_max:
        gains = [
            0
            if duplicate[i] or selected[i]
            else sum(a and tuple(paths[i][: p + 1]) not in trained for p, (_, a, _) in enumerate(paths[i]))
            for i in order
        ]
        if sum(gains) == 0:
            break
        target, k, running = rng.random() * sum(gains), 0, gains[0]
        while running <= target:
            k += 1
            running += gains[k]
        path = paths[order[k]]
        first_new = 0
        while first_new < len(path) and tuple(path[: first_new + 1]) in trained:
            first_new += 1
        selected[order[k]], start[order[k]] = True, first_new
        trained |= {tuple(path[: p + 1]) for p in range(len(path))}
        picks += 1
    return selected, start


@pytest.mark.parametrize("seed", range(300))
def test_selection_matches_a_slow_roulette_over_whole_prefix_records(seed):
    rng = random.Random(seed)
    paths = random_paths(rng)
    lengths = np.array([len(p) for p in paths], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    column = [
        np.array([r[c] for p in paths for r in p] or [], dtype=t)
        for c, t in enumerate((np.int32, bool, np.int32))
    ]
    symbols = path_symbols(*column)
    order, lcp = sorted_paths(symbols, starts, lengths)
    action_cumsum = np.concatenate([[0], np.cumsum(column[1])]).astype(np.int32)
    j_max = rng.choice([None, 1, 2, 3])

    got = select_paths(order, lcp, lengths, starts, action_cumsum, j_max, random.Random(seed))
    want_selected, want_start = slow_selection(paths, order.tolist(), j_max, random.Random(seed))
    assert got.selected.tolist() == want_selected
    assert got.train_start.tolist() == [
        s if chosen else 0 for s, chosen in zip(want_start, want_selected, strict=True)
    ]


def random_row(rng: random.Random, index: int) -> dict:
    """A raw row of execution e0 or e1; sometimes with an id already used, a broken link, a
    non-finite reward, lists of unequal length or a status that keeps it out of the loss."""
    tokens = rng.choice([[1, 2, 3], [1, 2], []]) + [rng.randrange(6) for _ in range(rng.choice([0, 1, 3, 6]))]
    mask = [False] + [rng.random() < 0.6 for _ in tokens[1:]] if tokens else []
    row = {
        "trajectory_id": f"t{rng.randrange(4)}" if rng.random() < 0.1 else f"t{index}",
        "execution_id": rng.choice(["e0", "e1"]),
        "parent_id": rng.choice([None, None, f"t{rng.randrange(8)}", "elsewhere"]),
        "branch_at": rng.choice([None, None, rng.randrange(-1, 8)]),
        "task": "toy",
        "prompt_id": "p",
        "tokens": tokens,
        "logprobs": [-0.5 if m else 0.0 for m in mask],
        "action_mask": mask,
        "turn": [rng.randrange(4) for _ in tokens],
        "versions": [rng.choice([1, 2]) if m else -1 for m in mask],
        "reward": rng.choice([None, 0.0, 1.0, 0.25, -1.0, math.nan]),
        "progress": rng.choice([None, 0.5, 1.0]),
        "status": rng.choice(["ok", "ok", "truncated", "timeout", "env_error", "infra_error"]),
    }
    if tokens and rng.random() < 0.1:
        row["action_mask"] = mask[:-1]
    return row


@pytest.mark.parametrize("seed", range(200))
def test_processed_rows_and_trajectory_counts_match_each_input_row(seed):
    rng = random.Random(seed)
    rows = [random_row(rng, i) for i in range(rng.randint(1, 9))]
    table = to_table(rows)
    if len(rows) > 1:  # several record batches
        cut = rng.randrange(1, len(rows))
        table = pa.concat_tables([table.slice(0, cut), table.slice(cut)])
    config = ProcessorConfig(j_max=rng.choice([None, 1, 2]), seed=seed)
    result = process_shard(table, config, shard_id="s")

    assert [t["trajectory_id"] for t in result.trajectories] == [r["trajectory_id"] for r in rows]
    for row, out in zip(rows, result.trajectories, strict=True):
        assert out["num_tokens"] == len(row["tokens"])
        assert out["num_action_tokens"] == sum(row["action_mask"])
        assert out["num_turns"] == max(row["turn"], default=-1) + 1
        if out["drop_reason"] != "invalid_record":
            versions = [v for v, a in zip(row["versions"], row["action_mask"], strict=True) if a]
            assert (out["min_version"], out["max_version"]) == (
                min(versions, default=-1),
                max(versions, default=-1),
            )
        if row["status"] in EXCLUDED_STATUSES or row["reward"] is None:
            assert out["reward"] is None
        elif not math.isnan(row["reward"]):
            assert out["reward"] == pytest.approx(row["reward"])

    chosen = [row for row, out in zip(rows, result.trajectories, strict=True) if out["selected"]]
    weights = defaultdict(float)
    for row, out in zip(chosen, result.processed.to_pylist(), strict=True):
        assert out["trajectory_id"] == row["trajectory_id"] and row["status"] not in EXCLUDED_STATUSES
        for name in ("tokens", "action_mask", "turn", "versions", "logprobs"):
            assert out[name] == row[name]
        assert out["reward"] == pytest.approx(combine_reward(row["reward"], row["progress"], config))
        weights[row["execution_id"]] += sum(out["loss_weight"])
    assert all(total == pytest.approx(1.0, rel=1e-5) for total in weights.values())
    validate(result.processed)
    samples, rejected = samples_from_table(result.processed, "s", vocab_size=8)
    assert rejected == [] and len(samples) == len(chosen)
