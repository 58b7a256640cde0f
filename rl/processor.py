"""The trajectory processor: a raw shard in, a processed shard, trajectory-table rows and
counters out (QwenGyre's trajectory processor, PAPERS.md).

For each execution (rows sharing ``execution_id``) of a shard:

1. **Check** each row: per-token lists present, without a null entry and of equal length,
   finite log-probs on action tokens, no action token at position 0, a finite or null
   reward and a progress in [0, 1] or null (else ``invalid_record``: the trainer would
   refuse the row, or its reward would be out of bounds), a unique ``trajectory_id``
   (``duplicate_id``), a declared ``parent_id``/``branch_at`` link that the tokens confirm
   (``branch_past_end``, ``prefix_mismatch``, ``cycle``), and a status outside
   ``EXCLUDED_STATUSES`` (``env_error``, ``infra_error``: such rows never get a reward nor
   reach the loss, nor own a shared prefix). A bad row is reported and dropped; the rest
   goes on. A row whose declared parent is not in the shard (its execution was split over
   shards, or the writer refused the parent) is reported and kept, as a root of its own:
   the tree is rebuilt from the tokens, which it still has.
2. **Score** partial progress of unsuccessful rows (:func:`combine_reward`), re-scoring the
   execution through the injected ``rescore`` callable when a row has no ``progress``
   (``rescore_failed`` when every attempt fails).
3. **Deduplicate** on the prefix tree rebuilt from the tokens (:mod:`rl.prefix_tree`; the
   declared links were checked against it in step 1): identical paths (the same tokens,
   roles and, on actions, versions) collapse to one, at most ``j_max`` leaves are
   sampled with probability proportional to the action tokens they would still add, and
   ``train_mask`` marks each distinct action token in exactly one selected row.
4. **Weight** each trained token (``loss_weight``, see :class:`ProcessorConfig`).

An execution is assumed to be written whole into one shard; rows of one execution spread
over several shards are processed as separate executions (a prefix they share is trained
once in each).
"""

from __future__ import annotations

import logging
import math
import random
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
from storage.schema import EXCLUDED_STATUSES, PROCESSED_SCHEMA, TOKEN_COLUMNS, TRAJECTORY_SCHEMA, cast

log = logging.getLogger(__name__)

Rescore = Callable[[pa.Table], float]
"""Re-scores an execution from its rows (the environment's EVAL stage, handed in by the
caller): returns progress in [0, 1]; raising or returning anything else is a failed attempt."""

Decode = Callable[[list[int]], str]
"""Turns token ids into text for people (the ``text`` column)."""


class ProcessorConfig(BaseModel):
    """How the trajectory processor selects, scores and weights trajectories."""

    model_config = ConfigDict(allow_inf_nan=False, extra="forbid", frozen=True)

    j_max: int | None = Field(
        5,
        ge=1,
        description="Most leaves (root-to-leaf paths) trained per execution, sampled with probability "
        "proportional to the action tokens they would still add; None trains every distinct leaf "
        "(QwenGyre reports J_max=5 matching uncapped).",
    )
    weighting: Literal["execution", "token"] = Field(
        "execution",
        description="'execution': each execution's trained tokens share a total weight of 1, so the loss is "
        "the mean over trainable tokens within an execution, then the mean over executions; 'token': every "
        "trained token weighs 1 (the plain mean over trainable tokens). The trainer divides Σ w·loss by Σ w "
        "over each batch, so a batch holding whole executions, from one shard or several, gets the mean "
        "over them.",
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
        "max(reward, progress_weight * progress) for a reward in [0, success_threshold) (a negative "
        "one is kept); 0 turns partial-progress scoring off.",
    )
    rescore_attempts: int = Field(
        3,
        ge=1,
        description="Attempts of the rescore callable per execution before the rows that need it are "
        "dropped with reason 'rescore_failed'. Only for a processor given one (ShardProcessor's "
        "rescore, a library hook for rows written without progress); the process flow gives none: its "
        "rows carry the progress their env scored at the rollout, if any.",
    )
    seed: int = Field(
        0,
        description="Seed of the leaf sampling; each execution's generator is derived from it and the "
        "execution id, so a selection does not depend on the shard's other rows.",
    )


def combine_reward(reward: float | None, progress: float | None, config: ProcessorConfig) -> float:
    """The reward a trajectory is trained with.

    A successful trajectory (``reward ≥ success_threshold``) keeps its reward. An
    unsuccessful one, with a reward in ``[0, success_threshold)``, gets
    ``max(reward, progress_weight · progress)``: partial progress can raise a failed
    attempt's reward but never lower it, and it is at most ``progress_weight`` (under a
    reward of 1 while ``progress_weight < 1``). A negative reward (a penalty, a reward
    model's logit) is kept as it is: progress does not erase it. A missing reward counts as
    0, and so does missing progress (no gradable artifact gives reward 0).
    """
    base = 0.0 if reward is None else float(reward)
    if progress is None or not _progress_counts(base, config):
        return base
    return max(base, config.progress_weight * float(progress))


def _progress_counts(reward: float, config: ProcessorConfig) -> bool:
    """Whether partial progress can raise ``reward``: it is not negative, and under the
    success threshold compared at the float32 precision a shard stores rewards with (0.7
    reads back as 0.69999999, under a threshold of 0.7 taken as a float64)."""
    with np.errstate(over="ignore"):  # a threshold past float32's range is inf: nothing reaches it
        return reward >= 0 and bool(np.float32(reward) < np.float32(config.success_threshold))


@dataclass
class ShardCounters:
    """What the processor did with one shard.

    ``dropped`` counts input rows by drop reason: ``invalid_record``, ``duplicate_id``,
    ``branch_past_end``, ``prefix_mismatch``, ``cycle``, ``env_error``, ``infra_error``,
    ``rescore_failed``, ``duplicate``, ``no_new_tokens``, ``not_selected``. ``errors`` has
    one line per malformed row, row kept without its parent, or failed re-scoring, naming
    the ids.
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
    counters.executions_in = len(set(table.column("execution_id").to_pylist()))
    rows = np.flatnonzero(_sound_rows(table, counters))
    work, paths = _work(table, rows)
    unscorable = _unscorable_rows(work, paths, counters)
    if unscorable.any():
        rows = rows[~unscorable]
        work, paths = _work(table, rows)
    state = _RowState.from_table(work)
    for execution_id, members in _executions(state, counters).items():
        _process_execution(execution_id, members, work, paths, state, config, rescore, counters)
    processed, train_counts = _processed_table(work, paths, state, config)

    reasons: list[str | None] = ["invalid_record"] * table.num_rows
    rewards: list[float | None] = table.column("reward").to_pylist()
    progress: list[float | None] = table.column("progress").to_pylist()
    # reward stays the env's for every row; the processed shard holds the one trained with
    for w, i in enumerate(rows.tolist()):
        reasons[i], progress[i] = state.reason[w], state.progress[w]
    # whatever drops it (its status, a broken link, a duplicate id, bad lists)
    excluded = pc.is_in(table.column("status"), value_set=pa.array(sorted(EXCLUDED_STATUSES)))
    for i in np.flatnonzero(pc.fill_null(excluded, False).to_numpy(zero_copy_only=False)).tolist():
        rewards[i] = None
    stats = _row_stats(table, rows, paths)
    stats["num_train_tokens"][rows] = train_counts
    counters.trajectories_out = int(state.selected.sum())
    counters.executions_out = len(set(processed.column("execution_id").to_pylist()))
    counters.tokens_in = int(stats["num_tokens"].sum())
    counters.action_tokens_in = int(stats["num_action_tokens"].sum())
    counters.tokens_out = int(paths.lengths[state.selected].sum())
    counters.train_tokens_out = int(train_counts.sum())
    counters.dropped = dict(Counter(r for r in reasons if r is not None))
    trajectories = _trajectory_rows(
        table,
        shard_id=shard_id,
        reasons=reasons,
        rewards=rewards,
        progress=progress,
        stats=stats,
        decode=decode,
        processed_at=processed_at or datetime.now(UTC),
    )
    return ProcessResult(processed=processed, trajectories=trajectories, counters=counters)


@dataclass(frozen=True)
class _Paths:
    """Flat token data of a table whose per-token lists are aligned."""

    values: dict[str, np.ndarray]  # TOKEN_COLUMNS name -> (total,) values
    symbols: np.ndarray  # (total,) token records, see rl.prefix_tree.path_symbols
    starts: np.ndarray  # (n,) int64
    lengths: np.ndarray  # (n,) int64
    action_cumsum: np.ndarray  # (total + 1,) int32

    @property
    def action(self) -> np.ndarray:
        return self.values["action_mask"]

    @classmethod
    def from_table(cls, table: pa.Table) -> _Paths:
        lengths = _list_lengths(table.column("tokens"))
        starts = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(lengths[:-1], out=starts[1:])
        values = {name: _list_values(table.column(name)) for name in TOKEN_COLUMNS}
        values["action_mask"] = values["action_mask"].astype(bool, copy=False)
        # int32: a shard's lists have int32 offsets, and a bool → int64 cumsum is ~10x slower.
        action_cumsum = np.zeros(len(values["action_mask"]) + 1, dtype=np.int32)
        np.cumsum(values["action_mask"], out=action_cumsum[1:])
        symbols = path_symbols(values["tokens"], values["action_mask"], values["versions"])
        return cls(values, symbols, starts, lengths, action_cumsum)


@dataclass
class _RowState:
    """Per-row inputs and decisions for the rows being processed (indexed like ``work``)."""

    ids: list[str]
    executions: list[str]
    parents: list[str | None]
    branch_at: list[int | None]
    statuses: list[str]
    reward_in: list[float | None]
    progress_in: list[float | None]
    reward: list[float | None]  # the reward trained with (None for infra errors)
    progress: list[float | None]  # the progress used
    reason: list[str | None]  # drop reason, None when selected
    selected: np.ndarray  # (n,) bool
    train_start: np.ndarray  # (n,) int64, see rl.prefix_tree.Selection

    @classmethod
    def from_table(cls, work: pa.Table) -> _RowState:
        column = {
            name: work.column(name).to_pylist() for name in work.column_names if name not in TOKEN_COLUMNS
        }
        n = work.num_rows
        return cls(
            ids=column["trajectory_id"],
            executions=column["execution_id"],
            parents=column["parent_id"],
            branch_at=column["branch_at"],
            statuses=column["status"],
            reward_in=column["reward"],
            progress_in=column["progress"],
            reward=list(column["reward"]),
            progress=list(column["progress"]),
            reason=[None] * n,
            selected=np.zeros(n, dtype=bool),
            train_start=np.zeros(n, dtype=np.int64),
        )


def _sound_rows(table: pa.Table, counters: ShardCounters) -> np.ndarray:
    """``(N,)`` bool: rows whose per-token lists are all present, without a null entry and of
    the length of ``tokens``, whose reward is finite or null and whose progress is in
    [0, 1] or null; the others are reported (``invalid_record``)."""
    lengths = {name: _list_lengths(table.column(name)) for name in TOKEN_COLUMNS}
    holes = {name: _rows_with_nulls(table.column(name)) for name in TOKEN_COLUMNS}
    aligned = np.all([(lengths[name] == lengths["tokens"]) & ~holes[name] for name in TOKEN_COLUMNS], axis=0)
    reward, progress = table.column("reward"), table.column("progress")
    finite_reward = pc.fill_null(pc.is_finite(reward), True).to_numpy(zero_copy_only=False)
    in_range = pc.and_(pc.greater_equal(progress, 0), pc.less_equal(progress, 1))  # false on NaN
    bounded_progress = pc.fill_null(in_range, True).to_numpy(zero_copy_only=False)
    sound = aligned & finite_reward & bounded_progress
    bad = np.flatnonzero(~sound).tolist()
    ids = table.column("trajectory_id").take(pa.array(bad, type=pa.int64())).to_pylist()
    for i, tid in zip(bad, ids, strict=True):
        nulls = [name for name in TOKEN_COLUMNS if holes[name][i]]
        mismatched = [name for name in TOKEN_COLUMNS if lengths[name][i] != lengths["tokens"][i]]
        problems = [f"{nulls} null or with null entries"] if nulls else []
        problems += [f"{mismatched} lengths differ from tokens"] if mismatched else []
        problems += [] if finite_reward[i] else [f"reward {reward[i].as_py()} is not finite"]
        problems += [] if bounded_progress[i] else [f"progress {progress[i].as_py()} is outside [0, 1]"]
        counters.errors.append(f"trajectory {tid!r}: {'; '.join(problems)}")
    return sound


def _unscorable_rows(work: pa.Table, paths: _Paths, counters: ShardCounters) -> np.ndarray:
    """``(n,)`` bool: rows with a non-finite log-prob on an action token, or an action token at
    position 0 (nothing precedes it to score it from), reported (``invalid_record``). The
    trainer refuses such a row (:func:`rl.batching.samples_from_table`): kept, it could be
    handed the prefix it shares with a sound row, which then trains nowhere."""
    unscorable_token = paths.action & ~np.isfinite(paths.values["logprobs"])
    non_finite = np.zeros(len(paths.lengths), dtype=bool)
    if unscorable_token.any():
        row_of_token = np.repeat(np.arange(len(paths.lengths)), paths.lengths)
        non_finite[row_of_token[unscorable_token]] = True
    nonempty = paths.lengths > 0
    action_first = np.zeros(len(paths.lengths), dtype=bool)
    action_first[nonempty] = paths.action[paths.starts[nonempty]]
    for rows, problem in (
        (non_finite, "non-finite logprobs on an action token"),
        (action_first & ~non_finite, "an action token at position 0, with no context to score it"),
    ):
        bad = np.flatnonzero(rows).tolist()
        for tid in work.column("trajectory_id").take(pa.array(bad, type=pa.int64())).to_pylist():
            counters.errors.append(f"trajectory {tid!r}: {problem}")
    return non_finite | action_first


def _work(table: pa.Table, rows: np.ndarray) -> tuple[pa.Table, _Paths]:
    """The ``rows`` of ``table`` being processed, and their flat token data."""
    work = table if len(rows) == table.num_rows else table.take(pa.array(rows, type=pa.int64()))
    return work, _Paths.from_table(work)


def _rows_with_nulls(column: pa.ChunkedArray) -> np.ndarray:
    """``(N,)`` bool: rows whose list is null or holds a null entry."""
    out = pc.is_null(column).to_numpy(zero_copy_only=False)
    entries = pc.list_flatten(column)
    if entries.null_count:
        parents = pc.list_parent_indices(column).to_numpy(zero_copy_only=False)
        out[parents[pc.is_null(entries).to_numpy(zero_copy_only=False)]] = True
    return out


def _executions(state: _RowState, counters: ShardCounters) -> dict[str, list[int]]:
    """Rows of each execution in input order; a repeated trajectory id is dropped
    (``duplicate_id``)."""
    groups: dict[str, list[int]] = {}
    seen: set[str] = set()
    for w, (tid, eid) in enumerate(zip(state.ids, state.executions, strict=True)):
        if tid in seen:
            state.reason[w] = "duplicate_id"
            counters.errors.append(f"trajectory {tid!r}: duplicate trajectory_id in the shard")
            continue
        seen.add(tid)
        groups.setdefault(eid, []).append(w)
    return groups


def _process_execution(
    execution_id: str,
    members: list[int],
    work: pa.Table,
    paths: _Paths,
    state: _RowState,
    config: ProcessorConfig,
    rescore: Rescore | None,
    counters: ShardCounters,
) -> None:
    """Check links, drop infra errors, score, and select the rows of one execution."""
    member_array = np.array(members, dtype=np.int64)
    _, link_errors = tree_from_parents(
        [state.ids[w] for w in members],
        [state.parents[w] for w in members],
        [state.branch_at[w] for w in members],
        paths.symbols,
        paths.starts[member_array],
        paths.lengths[member_array],
    )
    for error in link_errors:
        if error.reason == "missing_parent":
            counters.errors.append(f"execution {execution_id!r}: {error.message}; kept as a root")
            continue
        state.reason[members[error.path]] = error.reason
        counters.errors.append(f"execution {execution_id!r}: {error.message}")
    for w in members:
        if state.reason[w] is None and state.statuses[w] in EXCLUDED_STATUSES:
            state.reason[w] = state.statuses[w]

    live = _score(
        execution_id, [w for w in members if state.reason[w] is None], work, state, config, rescore, counters
    )
    if not live:
        return
    live_array = np.array(live, dtype=np.int64)
    starts, lengths = paths.starts[live_array], paths.lengths[live_array]
    order, lcp = sorted_paths(paths.symbols, starts, lengths)
    rng = random.Random(f"{config.seed}/{execution_id}")
    selection = select_paths(order, lcp, lengths, starts, paths.action_cumsum, config.j_max, rng)
    state.selected[live_array] = selection.selected
    state.train_start[live_array] = selection.train_start
    for w, why in zip(live, selection.reason, strict=True):
        state.reason[w] = why


def _list_lengths(column: pa.ChunkedArray) -> np.ndarray:
    """``(N,)`` int64 list lengths, 0 for a null list."""
    return pc.fill_null(pc.list_value_length(column), 0).to_numpy(zero_copy_only=False).astype(np.int64)


def _list_values(column: pa.ChunkedArray) -> np.ndarray:
    return pc.list_flatten(column).to_numpy(zero_copy_only=False)


def _score(
    execution_id: str,
    live: list[int],
    work: pa.Table,
    state: _RowState,
    config: ProcessorConfig,
    rescore: Rescore | None,
    counters: ShardCounters,
) -> list[int]:
    """Combine reward and progress of an execution's live rows (:func:`combine_reward`),
    re-scoring at most once per execution; returns the rows still live."""
    # only where progress can change the reward (combine_reward): not a success, not a penalty
    needs_rescore = [
        w
        for w in live
        if config.progress_weight > 0
        and state.progress_in[w] is None
        and _progress_counts(0.0 if state.reward_in[w] is None else state.reward_in[w], config)
    ]
    rescored: float | None = None
    if needs_rescore and rescore is not None:
        rows = work.take(pa.array(live, type=pa.int64()))
        rescored = _rescore(execution_id, rows, config, rescore, counters)
        if rescored is None:
            for w in needs_rescore:
                state.reason[w] = "rescore_failed"
            live = [w for w in live if state.reason[w] is None]
    for w in live:
        progress = state.progress_in[w] if state.progress_in[w] is not None else rescored
        state.progress[w] = progress
        state.reward[w] = combine_reward(state.reward_in[w], progress, config)
    return live


def _rescore(
    execution_id: str, rows: pa.Table, config: ProcessorConfig, rescore: Rescore, counters: ShardCounters
) -> float | None:
    last_error = ""
    for _ in range(config.rescore_attempts):
        counters.rescore_calls += 1
        try:
            value = rescore(rows)
            if isinstance(value, str | bytes | bool | np.bool_):  # float() would take "0.5" and True
                raise TypeError(f"returned {value!r:.80}, not a number")
            value = float(value)
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
    work: pa.Table, paths: _Paths, state: _RowState, config: ProcessorConfig
) -> tuple[pa.Table, np.ndarray]:
    """The selected rows with ``train_mask`` and ``loss_weight``; also the number of
    trained tokens of every work row ``(n,)``."""
    chosen = np.flatnonzero(state.selected)
    lengths = paths.lengths[chosen]
    starts = paths.starts[chosen]
    begin = state.train_start[chosen]
    counts = paths.action_cumsum[starts + lengths] - paths.action_cumsum[starts + begin]
    train_counts = np.zeros(len(state.selected), dtype=np.int64)
    train_counts[chosen] = counts

    chosen_executions = [state.executions[w] for w in chosen.tolist()]
    per_execution = Counter()
    for eid, count in zip(chosen_executions, counts.tolist(), strict=True):
        per_execution[eid] += count
    if config.weighting == "execution":
        # a weight that depends on the execution alone (not on the rest of its shard), so
        # that batches drawn from several shards still average over executions
        row_weight = np.array(
            [1.0 / per_execution[eid] if per_execution[eid] else 0.0 for eid in chosen_executions],
            dtype=np.float64,
        )
    else:
        row_weight = np.ones(len(chosen), dtype=np.float64)

    offsets = np.zeros(len(chosen) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    # The selected rows' lists are copied slice by slice (memcpy per row): faster than
    # both Table.take on list columns and a per-token gather.
    pieces = [slice(s, s + n) for s, n in zip(starts.tolist(), lengths.tolist(), strict=True)]
    lists = {name: _concatenate(paths.values[name], pieces) for name in TOKEN_COLUMNS}
    train_mask = lists["action_mask"].copy()
    for offset, trained_elsewhere in zip(offsets[:-1].tolist(), begin.tolist(), strict=True):
        train_mask[offset : offset + trained_elsewhere] = False
    loss_weight = np.repeat(row_weight.astype(np.float32), lengths)
    loss_weight *= train_mask
    lists |= {"train_mask": train_mask, "loss_weight": loss_weight}

    offsets32 = pa.array(offsets.astype(np.int32))
    chosen_rows = chosen.tolist()
    taken = work.select([n for n in TRAJECTORY_SCHEMA.names if n not in TOKEN_COLUMNS]).take(chosen)
    scores = {
        "reward": [state.reward[w] for w in chosen_rows],
        "progress": [state.progress[w] for w in chosen_rows],
    }
    columns = []
    for out_field in PROCESSED_SCHEMA:
        if out_field.name in lists:
            values = pa.array(lists[out_field.name], out_field.type.value_type)
            columns.append(pa.ListArray.from_arrays(offsets32, values))
        elif out_field.name in scores:
            columns.append(pa.array(scores[out_field.name], out_field.type))
        else:
            columns.append(taken.column(out_field.name))
    return pa.table(columns, schema=PROCESSED_SCHEMA), train_counts


def _concatenate(values: np.ndarray, pieces: list[slice]) -> np.ndarray:
    return np.concatenate([values[piece] for piece in pieces]) if pieces else values[:0]


def _row_stats(table: pa.Table, rows: np.ndarray, paths: _Paths) -> dict[str, np.ndarray]:
    """Per input row ``(N,)`` int64: ``num_tokens``, ``num_action_tokens``, ``num_turns``
    (highest turn index + 1), ``min_version``/``max_version`` over action tokens (−1
    without any) and a zeroed ``num_train_tokens``. Rows outside ``rows`` (``invalid_record``)
    get their tokens, action tokens and turns each counted on its own list (the lists may
    differ in length), and versions −1."""
    n = table.num_rows
    stats = {name: np.zeros(n, dtype=np.int64) for name in ("num_tokens", "num_action_tokens", "num_turns")}
    stats |= {name: np.full(n, -1, dtype=np.int64) for name in ("min_version", "max_version")}
    stats["num_train_tokens"] = np.zeros(n, dtype=np.int64)
    stats["num_tokens"][rows] = paths.lengths
    num_action = paths.action_cumsum[paths.starts + paths.lengths] - paths.action_cumsum[paths.starts]
    stats["num_action_tokens"][rows] = num_action
    stats["num_turns"][rows] = _segment_reduce(np.maximum, paths.values["turn"], paths.lengths, empty=-1) + 1
    action_versions = paths.values["versions"][paths.action]
    stats["min_version"][rows] = _segment_reduce(np.minimum, action_versions, num_action, empty=-1)
    stats["max_version"][rows] = _segment_reduce(np.maximum, action_versions, num_action, empty=-1)

    invalid = np.setdiff1d(np.arange(n), rows).tolist()
    for i in invalid:
        tokens, action, turn = (
            table.column(name)[i].as_py() or [] for name in ("tokens", "action_mask", "turn")
        )
        stats["num_tokens"][i] = len(tokens)
        stats["num_action_tokens"][i] = sum(bool(a) for a in action)
        stats["num_turns"][i] = max((t for t in turn if t is not None), default=-1) + 1
    return stats


def _trajectory_rows(
    table: pa.Table,
    *,
    shard_id: str,
    reasons: list[str | None],
    rewards: list[float | None],
    progress: list[float | None],
    stats: dict[str, np.ndarray],
    decode: Decode | None,
    processed_at: datetime,
) -> list[dict[str, Any]]:
    """One row per input row, with the ``trajectories`` table's columns."""
    names = (
        "trajectory_id",
        "execution_id",
        "parent_id",
        "task",
        "prompt_id",
        "group_id",
        "status",
        "engine",
        "error",
    )
    columns = {name: table.column(name).to_pylist() for name in names}
    columns |= {name: values.tolist() for name, values in stats.items()}
    # one row's tokens as Python ints at a time: the whole column would be ~36 bytes a token
    tokens = table.column("tokens")
    out = []
    for i in range(table.num_rows):
        row = {name: columns[name][i] for name in columns}
        row |= {
            "shard_id": shard_id,
            "reward": rewards[i],
            "progress": progress[i],
            "selected": reasons[i] is None,
            "drop_reason": reasons[i],
            "text": None
            if decode is None
            else _decoded(decode, tokens[i].as_py(), columns["trajectory_id"][i]),
            "processed_at": processed_at,
        }
        out.append(row)
    return out


def _decoded(decode: Decode, tokens: list[int], trajectory_id: str) -> str | None:
    """The text of ``tokens``, a lone surrogate (a decoder's ``surrogateescape``: no table can
    hold it, and its appends would fail shard after shard) written as its escape; None when
    they do not decode (ids from another tokenizer) or not into a str: the text is for
    people, and a row without it still trains."""
    try:
        text = decode(tokens)
        if not isinstance(text, str):
            raise TypeError(f"decode returned {type(text).__name__}, not str")
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    except Exception as exc:
        log.warning("trajectory %s does not decode, its text is left empty: %s", trajectory_id, exc)
        return None


def _segment_reduce(ufunc: np.ufunc, values: np.ndarray, lengths: np.ndarray, *, empty: int) -> np.ndarray:
    """``ufunc`` over consecutive segments of ``values`` ``(Σ lengths,)`` → ``(n,)``;
    ``empty`` for zero-length segments."""
    out = np.full(len(lengths), empty, dtype=np.int64)
    nonempty = lengths > 0
    if nonempty.any():
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        out[nonempty] = ufunc.reduceat(values, starts[nonempty])
    return out
