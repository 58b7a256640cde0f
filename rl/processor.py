"""The trajectory processor: a raw shard in, a processed shard, trajectory-table rows and
counters out (QwenGyre's trajectory processor, PAPERS.md).

For each execution (rows sharing ``execution_id``) of a shard:

1. **Check** each row: per-token lists of equal length (else ``invalid_record``), a unique
   ``trajectory_id`` (``duplicate_id``), a declared ``parent_id``/``branch_at`` link that
   the tokens confirm (``missing_parent``, ``branch_past_end``, ``prefix_mismatch``,
   ``cycle``), and a status other than ``infra_error`` (``infra_error``: such rows never get
   a reward nor reach the loss). A bad row is reported and dropped; the rest goes on.
2. **Score** partial progress of unsuccessful rows (:func:`combine_reward`), re-scoring the
   execution through the injected ``rescore`` callable when a row has no ``progress``
   (``rescore_failed`` when every attempt fails).
3. **Deduplicate** on the prefix tree rebuilt from the tokens (:mod:`rl.prefix_tree`; the
   declared links were checked against it in step 1): identical paths collapse to one,
   at most ``j_max`` leaves are sampled with probability proportional to the action
   tokens they would still add, and ``train_mask`` marks each distinct action token in
   exactly one selected row.
4. **Weight** each trained token (``loss_weight``, see :class:`ProcessorConfig`).

An execution is assumed to be written whole into one shard; rows of one execution spread
over several shards are processed as separate executions.
"""

from __future__ import annotations

import math
import zlib
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pydantic import BaseModel, ConfigDict, Field

from rl.prefix_tree import path_symbols, select_paths, sorted_paths, tree_from_parents
from storage.schema import PROCESSED_SCHEMA, TOKEN_COLUMNS, TRAJECTORY_SCHEMA, cast

Rescore = Callable[[pa.Table], float]
"""Re-scores an execution from its rows (the environment's EVAL stage, handed in by the
caller): returns progress in [0, 1]; raising or returning anything else is a failed attempt."""

Decode = Callable[[list[int]], str]
"""Turns token ids into text for people (the ``text`` column)."""


class ProcessorConfig(BaseModel):
    """How the trajectory processor selects, scores and weights trajectories."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    j_max: int | None = Field(
        5,
        ge=1,
        description="Most leaves (root-to-leaf paths) trained per execution, sampled with probability "
        "proportional to the action tokens they would still add; None trains every distinct leaf "
        "(QwenGyre reports J_max=5 matching uncapped).",
    )
    weighting: Literal["execution", "token"] = Field(
        "execution",
        description="'execution': the loss is the mean over trainable tokens within an execution, then the "
        "mean over the shard's executions; 'token': the plain mean over trainable tokens. Either way the "
        "weights average 1 over the shard's trained tokens, so the trainer's Σ w·loss / N_train (rl.losses) "
        "gives that mean.",
    )
    success_threshold: float = Field(
        1.0,
        description="A trajectory is successful when its reward is at least this; the others are scored "
        "for partial progress.",
    )
    progress_weight: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="Scale of partial progress in an unsuccessful trajectory's reward: "
        "max(reward, progress_weight * progress); 0 turns partial-progress scoring off.",
    )
    rescore_attempts: int = Field(
        3,
        ge=1,
        description="Attempts of the rescore callable per execution before the rows that need it are "
        "dropped with reason 'rescore_failed'.",
    )
    seed: int = Field(
        0,
        description="Seed of the leaf sampling; each execution's generator is derived from it and the "
        "execution id, so a selection does not depend on the shard's other rows.",
    )


def combine_reward(reward: float | None, progress: float | None, config: ProcessorConfig) -> float:
    """The reward a trajectory is trained with.

    A successful trajectory (``reward ≥ success_threshold``) keeps its reward. An
    unsuccessful one gets ``max(reward, progress_weight · progress)``: partial progress can
    raise a failed attempt's reward but never lower it, and with ``progress_weight ≤ 1``
    it stays under a success. A missing reward counts as 0, and so does missing progress
    (no gradable artifact gives reward 0).
    """
    base = 0.0 if reward is None else float(reward)
    if base >= config.success_threshold or progress is None:
        return base
    return max(base, config.progress_weight * float(progress))


@dataclass
class ShardCounters:
    """What the processor did with one shard.

    ``dropped`` counts input rows by drop reason: ``invalid_record``, ``duplicate_id``,
    ``missing_parent``, ``branch_past_end``, ``prefix_mismatch``, ``cycle``,
    ``infra_error``, ``rescore_failed``, ``duplicate``, ``no_new_tokens``,
    ``not_selected``. ``errors`` has one line per malformed row or failed re-scoring,
    naming the ids.
    """

    trajectories_in: int = 0
    trajectories_out: int = 0
    executions_in: int = 0
    executions_out: int = 0
    tokens_in: int = 0
    action_tokens_in: int = 0
    tokens_out: int = 0
    train_tokens_out: int = 0
    rescore_calls: int = 0
    rescore_failures: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (JSON-ready)."""
        return asdict(self)


@dataclass(frozen=True)
class ProcessResult:
    """Output of :func:`process_shard`.

    Attributes:
        processed: the selected rows, :data:`~storage.schema.PROCESSED_SCHEMA`, in input
            order, with ``reward`` the combined reward and ``progress`` the one used.
        trajectories: one row per input row for the ``trajectories`` Delta table (its
            columns, as plain dicts).
        counters: per-shard counters.
    """

    processed: pa.Table
    trajectories: list[dict[str, Any]]
    counters: ShardCounters


def process_shard(
    table: pa.Table,
    config: ProcessorConfig | None = None,
    *,
    shard_id: str,
    rescore: Rescore | None = None,
    decode: Decode | None = None,
    processed_at: datetime | None = None,
) -> ProcessResult:
    """Turn a raw shard into a processed one (see the module docstring for the steps).

    Args:
        table: raw rows with the columns of :data:`~storage.schema.TRAJECTORY_SCHEMA`.
        config: selection, scoring and weighting options (defaults when None).
        shard_id: id of the raw shard, written to the trajectory rows.
        rescore: the environment's EVAL on an execution's rows, for unsuccessful rows
            without ``progress``; without it such rows get no partial progress.
        decode: token ids → text, for the ``text`` column (null when None).
        processed_at: timestamp of the trajectory rows (now when None).

    Returns:
        :class:`ProcessResult`. ``train_mask`` is ``action_mask`` minus every action token
        another selected row of the execution trains; ``loss_weight`` is 0 outside it.
    """
    config = config or ProcessorConfig()
    table = cast(table, TRAJECTORY_SCHEMA)
    counters = ShardCounters(trajectories_in=table.num_rows)
    reasons: list[str | None] = [None] * table.num_rows

    lengths_all = {name: _list_lengths(table.column(name)) for name in TOKEN_COLUMNS}
    token_lengths = lengths_all["tokens"]
    aligned = np.all([lengths_all[name] == token_lengths for name in TOKEN_COLUMNS], axis=0)
    ids_all = table.column("trajectory_id").to_pylist()
    for i in np.flatnonzero(~aligned).tolist():
        reasons[i] = "invalid_record"
        mismatched = [name for name in TOKEN_COLUMNS if lengths_all[name][i] != token_lengths[i]]
        counters.errors.append(f"trajectory {ids_all[i]!r}: {mismatched} lengths differ from tokens")

    rows = np.flatnonzero(aligned)
    work = table.take(pa.array(rows, type=pa.int64()))
    paths = _Paths.from_table(work)
    ids = ids_all if len(rows) == table.num_rows else work.column("trajectory_id").to_pylist()
    executions = work.column("execution_id").to_pylist()
    statuses = work.column("status").to_pylist()
    rewards_in = work.column("reward").to_pylist()
    progress_in = work.column("progress").to_pylist()
    reward_out: list[float | None] = list(rewards_in)
    progress_out: list[float | None] = list(progress_in)
    reason = [None] * len(rows)  # per work row

    groups: dict[str, list[int]] = {}
    seen_ids: set[str] = set()
    for w, (tid, eid) in enumerate(zip(ids, executions, strict=True)):
        if tid in seen_ids:
            reason[w] = "duplicate_id"
            counters.errors.append(f"trajectory {tid!r}: duplicate trajectory_id in the shard")
            continue
        seen_ids.add(tid)
        groups.setdefault(eid, []).append(w)
    counters.executions_in = len(set(table.column("execution_id").to_pylist()))

    parents = work.column("parent_id").to_pylist()
    branch_at = work.column("branch_at").to_pylist()
    selected = np.zeros(len(rows), dtype=bool)
    train_start = np.zeros(len(rows), dtype=np.int64)
    for eid, members in groups.items():
        member_array = np.array(members, dtype=np.int64)
        _, link_errors = tree_from_parents(
            [ids[w] for w in members],
            [parents[w] for w in members],
            [branch_at[w] for w in members],
            paths.symbols,
            paths.starts[member_array],
            paths.lengths[member_array],
        )
        for error in link_errors:
            reason[members[error.path]] = error.reason
            counters.errors.append(f"execution {eid!r}: {error.message}")
        for w in members:
            if reason[w] is None and statuses[w] == "infra_error":
                reason[w] = "infra_error"
                reward_out[w] = None

        live = [w for w in members if reason[w] is None]
        live = _score(
            eid,
            live,
            work,
            rewards_in,
            progress_in,
            reward_out,
            progress_out,
            reason,
            config,
            rescore,
            counters,
        )
        if not live:
            continue
        live_array = np.array(live, dtype=np.int64)
        order, lcp = sorted_paths(paths.symbols, paths.starts[live_array], paths.lengths[live_array])
        rng = np.random.default_rng([config.seed, zlib.crc32(eid.encode())])
        selection = select_paths(
            order,
            lcp,
            paths.lengths[live_array],
            paths.starts[live_array],
            paths.action_cumsum,
            config.j_max,
            rng,
        )
        selected[live_array] = selection.selected
        train_start[live_array] = selection.train_start
        for w, why in zip(live, selection.reason, strict=True):
            reason[w] = why

    for w, i in enumerate(rows.tolist()):
        reasons[i] = reason[w]
    processed, train_counts = _processed_table(
        work, paths, selected, train_start, executions, reward_out, progress_out, config
    )

    num_train = np.zeros(table.num_rows, dtype=np.int64)
    num_train[rows] = train_counts
    counters.trajectories_out = int(selected.sum())
    counters.executions_out = len({executions[w] for w in np.flatnonzero(selected).tolist()})
    counters.tokens_in = int(token_lengths.sum())
    counters.tokens_out = int(paths.lengths[selected].sum())
    counters.train_tokens_out = int(train_counts.sum())
    counters.dropped = dict(Counter(r for r in reasons if r is not None))
    reward_all: list[float | None] = table.column("reward").to_pylist()
    progress_all: list[float | None] = table.column("progress").to_pylist()
    for w, i in enumerate(rows.tolist()):
        reward_all[i] = reward_out[w]
        progress_all[i] = progress_out[w]
    trajectories = _trajectory_rows(
        table,
        shard_id=shard_id,
        reasons=reasons,
        rewards=reward_all,
        progress=progress_all,
        num_train=num_train,
        decode=decode,
        processed_at=processed_at or datetime.now(UTC),
    )
    counters.action_tokens_in = int(sum(row["num_action_tokens"] for row in trajectories))
    return ProcessResult(processed=processed, trajectories=trajectories, counters=counters)


@dataclass(frozen=True)
class _Paths:
    """Flat token data of a table whose per-token lists are aligned."""

    tokens: np.ndarray  # (total,) int32
    action: np.ndarray  # (total,) bool
    symbols: np.ndarray  # (total,) int64, see rl.prefix_tree.path_symbols
    starts: np.ndarray  # (n,) int64
    lengths: np.ndarray  # (n,) int64
    action_cumsum: np.ndarray  # (total + 1,) int64

    @classmethod
    def from_table(cls, table: pa.Table) -> _Paths:
        lengths = _list_lengths(table.column("tokens"))
        starts = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(lengths[:-1], out=starts[1:])
        tokens = _list_values(table.column("tokens"))
        action = _list_values(table.column("action_mask")).astype(bool)
        action_cumsum = np.zeros(len(action) + 1, dtype=np.int64)
        np.cumsum(action, out=action_cumsum[1:])
        return cls(tokens, action, path_symbols(tokens, action), starts, lengths, action_cumsum)


def _list_lengths(column: pa.ChunkedArray) -> np.ndarray:
    return pc.list_value_length(column).to_numpy(zero_copy_only=False).astype(np.int64)


def _list_values(column: pa.ChunkedArray) -> np.ndarray:
    return pc.list_flatten(column).to_numpy(zero_copy_only=False)


def _score(
    execution_id: str,
    live: list[int],
    work: pa.Table,
    rewards_in: list[float | None],
    progress_in: list[float | None],
    reward_out: list[float | None],
    progress_out: list[float | None],
    reason: list[str | None],
    config: ProcessorConfig,
    rescore: Rescore | None,
    counters: ShardCounters,
) -> list[int]:
    """Combine reward and progress for an execution's live rows (:func:`combine_reward`),
    re-scoring at most once per execution; returns the rows still live."""
    needs_rescore = [
        w
        for w in live
        if config.progress_weight > 0
        and progress_in[w] is None
        and (rewards_in[w] is None or rewards_in[w] < config.success_threshold)
    ]
    rescored: float | None = None
    if needs_rescore and rescore is not None:
        rescored = _rescore(
            execution_id, work.take(pa.array(live, type=pa.int64())), config, rescore, counters
        )
        if rescored is None:
            for w in needs_rescore:
                reason[w] = "rescore_failed"
            live = [w for w in live if reason[w] is None]
    for w in live:
        progress = progress_in[w] if progress_in[w] is not None else rescored
        progress_out[w] = progress
        reward_out[w] = combine_reward(rewards_in[w], progress, config)
    return live


def _rescore(
    execution_id: str, rows: pa.Table, config: ProcessorConfig, rescore: Rescore, counters: ShardCounters
) -> float | None:
    last_error = ""
    for _ in range(config.rescore_attempts):
        counters.rescore_calls += 1
        try:
            value = float(rescore(rows))
        except Exception as exc:  # the environment's EVAL may fail in any way; each is one attempt
            last_error = f"{type(exc).__name__}: {str(exc)[:200]}"
        else:
            if math.isfinite(value) and 0.0 <= value <= 1.0:
                return value
            last_error = f"returned {value!r}, expected progress in [0, 1]"
        counters.rescore_failures += 1
    counters.errors.append(
        f"execution {execution_id!r}: rescore failed {config.rescore_attempts} times; last: {last_error}"
    )
    return None


def _processed_table(
    work: pa.Table,
    paths: _Paths,
    selected: np.ndarray,
    train_start: np.ndarray,
    executions: list[str],
    reward_out: list[float | None],
    progress_out: list[float | None],
    config: ProcessorConfig,
) -> tuple[pa.Table, np.ndarray]:
    """The selected rows with ``train_mask`` and ``loss_weight``; also the number of
    trained tokens of every work row ``(n,)``."""
    chosen = np.flatnonzero(selected)
    lengths = paths.lengths[chosen]
    starts = paths.starts[chosen]
    begin = train_start[chosen]
    counts = paths.action_cumsum[starts + lengths] - paths.action_cumsum[starts + begin]
    train_counts = np.zeros(len(selected), dtype=np.int64)
    train_counts[chosen] = counts

    chosen_executions = [executions[w] for w in chosen.tolist()]
    per_execution = Counter()
    for eid, count in zip(chosen_executions, counts.tolist(), strict=True):
        per_execution[eid] += count
    total_train = sum(per_execution.values())
    trained_executions = sum(1 for count in per_execution.values() if count > 0)
    if config.weighting == "execution":
        row_weight = np.array(
            [
                total_train / (trained_executions * per_execution[eid]) if per_execution[eid] else 0.0
                for eid in chosen_executions
            ],
            dtype=np.float64,
        )
    else:
        row_weight = np.ones(len(chosen), dtype=np.float64)

    offsets = np.zeros(len(chosen) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    position = np.arange(offsets[-1], dtype=np.int64) - np.repeat(offsets[:-1], lengths)
    source = np.repeat(starts, lengths) + position
    train_mask = paths.action[source] & (position >= np.repeat(begin, lengths))
    loss_weight = np.where(train_mask, np.repeat(row_weight, lengths), 0.0).astype(np.float32)

    offsets32 = pa.array(offsets.astype(np.int32))
    out = work.take(pa.array(chosen, type=pa.int64()))
    out = out.set_column(
        out.schema.get_field_index("reward"),
        "reward",
        pa.array([reward_out[w] for w in chosen.tolist()], pa.float32()),
    )
    out = out.set_column(
        out.schema.get_field_index("progress"),
        "progress",
        pa.array([progress_out[w] for w in chosen.tolist()], pa.float32()),
    )
    out = out.append_column("train_mask", pa.ListArray.from_arrays(offsets32, pa.array(train_mask)))
    out = out.append_column("loss_weight", pa.ListArray.from_arrays(offsets32, pa.array(loss_weight)))
    return out.cast(PROCESSED_SCHEMA), train_counts


def _trajectory_rows(
    table: pa.Table,
    *,
    shard_id: str,
    reasons: list[str | None],
    rewards: list[float | None],
    progress: list[float | None],
    num_train: np.ndarray,
    decode: Decode | None,
    processed_at: datetime,
) -> list[dict[str, Any]]:
    """One row per input row, with the ``trajectories`` table's columns."""
    num_tokens = _list_lengths(table.column("tokens"))
    action_lengths = _list_lengths(table.column("action_mask"))
    action = _list_values(table.column("action_mask")).astype(bool)
    num_action = _segment_reduce(np.add, action.astype(np.int64), action_lengths, empty=0)
    turn_lengths = _list_lengths(table.column("turn"))
    num_turns = (
        _segment_reduce(
            np.maximum, _list_values(table.column("turn")).astype(np.int64), turn_lengths, empty=-1
        )
        + 1
    )
    versions = _list_values(table.column("versions")).astype(np.int64)
    aligned = _list_lengths(table.column("versions")) == action_lengths
    min_version = np.full(table.num_rows, -1, dtype=np.int64)
    max_version = np.full(table.num_rows, -1, dtype=np.int64)
    if aligned.all():
        big = np.iinfo(np.int64).max
        lowest = _segment_reduce(np.minimum, np.where(action, versions, big), action_lengths, empty=big)
        highest = _segment_reduce(np.maximum, np.where(action, versions, -1), action_lengths, empty=-1)
        has_action = num_action > 0
        min_version[has_action] = lowest[has_action]
        max_version[has_action] = highest[has_action]

    columns = {
        name: table.column(name).to_pylist()
        for name in ("trajectory_id", "execution_id", "parent_id", "task")
    }
    columns |= {
        name: table.column(name).to_pylist() for name in ("prompt_id", "group_id", "status", "engine")
    }
    token_lists = table.column("tokens").to_pylist() if decode is not None else None
    out = []
    for i in range(table.num_rows):
        out.append(
            {
                "trajectory_id": columns["trajectory_id"][i],
                "execution_id": columns["execution_id"][i],
                "parent_id": columns["parent_id"][i],
                "task": columns["task"][i],
                "prompt_id": columns["prompt_id"][i],
                "group_id": columns["group_id"][i],
                "shard_id": shard_id,
                "reward": rewards[i],
                "progress": progress[i],
                "status": columns["status"][i],
                "num_tokens": int(num_tokens[i]),
                "num_action_tokens": int(num_action[i]),
                "num_train_tokens": int(num_train[i]),
                "num_turns": int(num_turns[i]),
                "min_version": int(min_version[i]),
                "max_version": int(max_version[i]),
                "selected": reasons[i] is None,
                "drop_reason": reasons[i],
                "text": decode(token_lists[i]) if token_lists is not None else None,
                "engine": columns["engine"][i],
                "processed_at": processed_at,
            }
        )
    return out


def _segment_reduce(ufunc: np.ufunc, values: np.ndarray, lengths: np.ndarray, *, empty: int) -> np.ndarray:
    """``ufunc`` over consecutive segments of ``values`` ``(Σ lengths,)`` → ``(n,)``;
    ``empty`` for zero-length segments."""
    out = np.full(len(lengths), empty, dtype=np.int64)
    nonempty = lengths > 0
    if nonempty.any():
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        out[nonempty] = ufunc.reduceat(values, starts[nonempty])
    return out
