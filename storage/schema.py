"""The canonical trajectory record (DESIGN.md) as an Arrow schema, and its validation.

One row per trajectory. Per-token columns are lists of equal length. Processed shards
carry two more per-token columns (``train_mask``, ``loss_weight``) written by the
trajectory processor; everything else is the same record.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

STATUSES = ("ok", "truncated", "env_error", "infra_error", "timeout")
"""Known values of ``status``; ``infra_error`` never reaches the loss."""

TIMING_TYPE = pa.struct(
    [
        ("init", pa.float32()),
        ("run", pa.float32()),
        ("eval", pa.float32()),
        ("queue", pa.float32()),
    ]
)

TOKEN_COLUMNS = ("tokens", "logprobs", "action_mask", "turn", "versions")
"""Per-token list columns of the raw record, in schema order."""

TRAJECTORY_SCHEMA = pa.schema(
    [
        pa.field("trajectory_id", pa.string(), nullable=False),
        pa.field("execution_id", pa.string(), nullable=False),
        pa.field("parent_id", pa.string()),
        pa.field("branch_at", pa.int32()),
        pa.field("task", pa.string(), nullable=False),
        pa.field("prompt_id", pa.string(), nullable=False),
        pa.field("group_id", pa.string()),
        pa.field("tokens", pa.list_(pa.int32()), nullable=False),
        pa.field("logprobs", pa.list_(pa.float32()), nullable=False),
        pa.field("action_mask", pa.list_(pa.bool_()), nullable=False),
        pa.field("turn", pa.list_(pa.int16()), nullable=False),
        pa.field("versions", pa.list_(pa.int32()), nullable=False),
        pa.field("reward", pa.float32()),
        pa.field("progress", pa.float32()),
        pa.field("status", pa.string(), nullable=False),
        pa.field("engine", pa.string()),
        pa.field("timing", TIMING_TYPE),
    ],
    metadata={"treadle.schema": "trajectory/1"},
)

PROCESSED_SCHEMA = pa.schema(
    [
        *TRAJECTORY_SCHEMA,
        pa.field("train_mask", pa.list_(pa.bool_()), nullable=False),
        pa.field("loss_weight", pa.list_(pa.float32()), nullable=False),
    ],
    metadata={"treadle.schema": "processed/1"},
)
"""Processed shard: the trajectory record plus ``train_mask`` (action tokens this row
trains; a shared prefix is trained in one row only) and ``loss_weight`` (per-token weight
of the loss term)."""


class SchemaError(ValueError):
    """A table or row that does not match the canonical schema; the message names the
    trajectory id, the column and what is wrong."""


def to_table(records: Iterable[Mapping[str, Any]], schema: pa.Schema = TRAJECTORY_SCHEMA) -> pa.Table:
    """Build a table of ``schema`` from record dicts (missing optional fields become null)."""
    rows = list(records)
    columns = {}
    for field in schema:
        values = [row.get(field.name) for row in rows]
        try:
            columns[field.name] = pa.array(values, type=field.type)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError) as exc:
            raise SchemaError(f"column {field.name!r}: cannot convert to {field.type}: {exc}") from exc
    return pa.table(columns, schema=schema)


def cast(table: pa.Table, schema: pa.Schema = TRAJECTORY_SCHEMA) -> pa.Table:
    """Select and cast ``table``'s columns to ``schema`` (extra columns are dropped)."""
    missing = [name for name in schema.names if name not in table.column_names]
    if missing:
        raise SchemaError(f"missing columns {missing}")
    try:
        return table.select(schema.names).cast(schema)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as exc:
        raise SchemaError(f"cannot cast to the canonical schema: {exc}") from exc


def find_errors(table: pa.Table) -> list[tuple[str | None, str, str]]:
    """Every problem in ``table`` as ``(trajectory_id, column, what is wrong)``.

    Checks: required ids present, per-token lists of equal length, finite log-probs ≤ 0
    and versions ≥ 0 on action tokens, ``status`` in :data:`STATUSES`, and for processed
    tables ``train_mask`` only where ``action_mask``.
    """
    errors: list[tuple[str | None, str, str]] = []
    if table.num_rows == 0:
        return errors
    ids = table.column("trajectory_id").to_pylist()

    for name in ("trajectory_id", "execution_id", "task", "prompt_id"):
        values = table.column(name).to_pylist()
        for i, value in enumerate(values):
            if not value:
                errors.append((ids[i], name, "missing id"))

    token_columns = [c for c in (*TOKEN_COLUMNS, "train_mask", "loss_weight") if c in table.column_names]
    lengths = {c: pc.list_value_length(table.column(c)).to_numpy(zero_copy_only=False) for c in token_columns}
    n_tokens = lengths["tokens"]
    for name in token_columns:
        bad = np.flatnonzero(lengths[name] != n_tokens)
        for i in bad:
            errors.append((ids[i], name, f"has {lengths[name][i]} entries but tokens has {n_tokens[i]}"))
    bad_rows = np.any([lengths[c] != n_tokens for c in token_columns], axis=0)

    statuses = table.column("status").to_pylist()
    for i, status in enumerate(statuses):
        if status not in STATUSES:
            errors.append((ids[i], "status", f"unknown status {status!r}; expected one of {STATUSES}"))

    errors.extend(_token_errors(table, ids, bad_rows))
    return errors


def validate(table: pa.Table) -> pa.Table:
    """Raise :class:`SchemaError` naming the first bad rows; return ``table`` when valid."""
    expected = PROCESSED_SCHEMA if "train_mask" in table.column_names else TRAJECTORY_SCHEMA
    missing = [name for name in expected.names if name not in table.column_names]
    if missing:
        raise SchemaError(f"missing columns {missing}")
    for field in expected:
        actual = table.schema.field(field.name).type
        if actual != field.type:
            raise SchemaError(f"column {field.name!r} has type {actual}, expected {field.type}")
    errors = find_errors(table)
    if errors:
        shown = "; ".join(f"trajectory {tid!r}, column {col!r}: {what}" for tid, col, what in errors[:5])
        more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
        raise SchemaError(shown + more)
    return table


def _token_errors(table: pa.Table, ids: list, bad_rows: np.ndarray) -> list[tuple[str | None, str, str]]:
    """Per-token checks on action tokens, vectorized over the flattened lists of the rows
    whose lists have equal lengths (``bad_rows`` are reported already). Row indices are
    only worked out for a check that fails somewhere."""
    good = np.flatnonzero(~bad_rows)
    rows = table.take(good) if len(good) < table.num_rows else table
    mask = _flat(rows, "action_mask", False)
    logprobs = _flat(rows, "logprobs", np.nan)
    # NaN fails both comparisons, +inf the first, -inf the second.
    logprob_ok = (logprobs <= 1e-6) & (logprobs > -np.inf)
    checks = [
        (mask & ~logprob_ok, "logprobs", None),
        (mask & (_flat(rows, "versions", -1) < 0), "versions", "negative version on an action token"),
    ]
    if "train_mask" in table.column_names:
        checks.append(
            (_flat(rows, "train_mask", False) & ~mask, "train_mask", "trains a token outside action_mask")
        )
    failing = [check for check in checks if check[0].any()]
    if not failing:
        return []
    row_of_token = good[pc.list_parent_indices(rows.column("action_mask").combine_chunks()).to_numpy()]
    found: dict[int, list[tuple[str, str]]] = {}
    for bad_tokens, column, what in failing:
        if column == "logprobs":
            nonfinite = np.unique(row_of_token[mask & ~np.isfinite(logprobs)])
            positive = np.setdiff1d(row_of_token[mask & (logprobs > 1e-6)], nonfinite)
            located = [(nonfinite, "non-finite log-prob on an action token")]
            located.append((positive, "positive log-prob on an action token"))
        else:
            located = [(np.unique(row_of_token[bad_tokens]), what)]
        for bad, message in located:
            for row in bad:
                found.setdefault(int(row), []).append((column, message))
    return [(ids[row], column, what) for row in sorted(found) for column, what in found[row]]


def _flat(table: pa.Table, column: str, fill: Any) -> np.ndarray:
    """Values of list column ``column`` of every row, concatenated, nulls as ``fill``."""
    values = pc.list_flatten(table.column(column).combine_chunks())
    if values.null_count:
        values = pc.fill_null(values, fill)
    if pa.types.is_boolean(values.type) and len(values):
        # Arrow packs booleans into bits; unpacking the buffer beats to_numpy's conversion.
        bits = np.frombuffer(values.buffers()[1], dtype=np.uint8)
        unpacked = np.unpackbits(bits, count=values.offset + len(values), bitorder="little")
        return unpacked[values.offset :].view(bool)
    return values.to_numpy(zero_copy_only=False)
