"""The canonical trajectory record as an Arrow schema, and its validation.

One row per trajectory. Per-token columns are lists of equal length. Processed shards
carry two more per-token columns (``train_mask``, ``loss_weight``) written by the
trajectory processor; everything else is the same record. Beyond the record's first version,
``error`` says why a rollout ended as it did (:data:`ADDED_COLUMNS`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from storage.redaction import redact

STATUSES = ("ok", "truncated", "env_error", "infra_error", "timeout")
"""Known values of ``status``."""

EXCLUDED_STATUSES = frozenset({"env_error", "infra_error"})
"""Statuses of trajectories that failed for reasons outside the policy (a crashed
environment, the infrastructure): they never get a reward nor reach the loss."""

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
        pa.field("error", pa.string()),
    ],
    metadata={"treadle.schema": "trajectory/2"},
)

PROCESSED_SCHEMA = pa.schema(
    [
        *TRAJECTORY_SCHEMA,
        pa.field("train_mask", pa.list_(pa.bool_()), nullable=False),
        pa.field("loss_weight", pa.list_(pa.float32()), nullable=False),
    ],
    metadata={"treadle.schema": "processed/2"},
)
"""Processed shard: the trajectory record plus ``train_mask`` (action tokens this row
trains; a shared prefix is trained in one row only) and ``loss_weight`` (per-token weight
of the loss term)."""

ADDED_COLUMNS = ("error",)
"""Columns added to the record since its first version (``error`` in ``trajectory/2`` and
``processed/2``). Each is nullable, and a table written before it (a shard of an older
treadle) lacks it: :func:`cast` and the shard reader read it as null. ``error``: why the
rollout failed (``env_error``, ``infra_error``, ``timeout``) or which limit truncated it (the
context; null for a truncation at ``max_turns`` or the token budget, which the status says),
as the rollout service warned it; null for ``ok``."""

MAX_ERROR_CHARS = 1000
"""Most characters an ``error`` holds. Enough for the classification, the stage and the start
of the exception's message (``sandbox start_failed during init: …``); an env whose exception
carries a whole test log or traceback would otherwise put it in every row of the
``trajectories`` table and every SQL answer that shows the column. At the bound a failed
row's ``error`` is a few percent of its per-token columns (about 14 bytes a token: 28 KB for
2,000 tokens)."""


class SchemaError(ValueError):
    """A table or row that does not match the canonical schema; the message names the
    trajectory id, the column and what is wrong."""


class NewerSchemaError(SchemaError):
    """A shard written in a later version of its record than this treadle knows (a writer
    upgraded before its reader): read under the old meaning, or quarantined, its rows would
    be lost to the reader that is upgraded next."""


SCHEMA_KEY = b"treadle.schema"
"""Schema metadata naming the record and its version (``trajectory/2``)."""


def newer_record(found: pa.Schema, canonical: pa.Schema) -> str | None:
    """``found``'s record version (``trajectory/3``) when its metadata names a later
    version of ``canonical``'s record, else None (the same or an earlier version, another
    record, or no version named)."""
    name, version = _record_version(found)
    own_name, own_version = _record_version(canonical)
    if name != own_name or version is None or own_version is None or version <= own_version:
        return None
    return f"{name}/{version}"


def _record_version(schema: pa.Schema) -> tuple[str | None, int | None]:
    named = (schema.metadata or {}).get(SCHEMA_KEY, b"").decode(errors="replace")
    name, _, version = named.partition("/")
    if not (version.isascii() and version.isdigit()):
        return None, None
    return name, int(version)


def error_text(text: str, secrets: Iterable[str | None] = ()) -> str:
    """``text`` as a record's ``error``: ``secrets``, echoed S3 credentials and AWS key ids
    masked (:func:`storage.redaction.redact`), a lone surrogate (output decoded with
    ``surrogateescape``: no table can hold it) written as its escape, then cut to
    :data:`MAX_ERROR_CHARS` (ending in ``…``). Masked first, so a cut never leaves the start
    of a secret unmasked."""
    text = redact(text, secrets).encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 1] + "…"


def to_table(records: Iterable[Mapping[str, Any]], schema: pa.Schema = TRAJECTORY_SCHEMA) -> pa.Table:
    """Build a table of ``schema`` from record dicts (missing optional fields become null)."""
    rows = list(records)
    columns = {}
    for field in schema:
        values = [row.get(field.name) for row in rows]
        try:
            wide = _array(values, widened(field.type))
        except _CONVERSION_ERRORS as exc:
            where = _unconvertible_row(rows, values, widened(field.type))
            raise SchemaError(f"{where}column {field.name!r}: cannot convert to {field.type}: {exc}") from exc
        columns[field.name] = wide.cast(field.type)
        if wide.type != field.type:
            beyond = np.flatnonzero(beyond_float32(wide, columns[field.name]))
            if len(beyond):
                raise SchemaError(
                    _beyond_float32(rows[beyond[0]].get("trajectory_id"), beyond[0], field.name)
                )
    return pa.table(columns, schema=schema)


_CONVERSION_ERRORS = (pa.ArrowException, TypeError, ValueError, OverflowError)
"""What :func:`_array` raises for a value that does not fit the column's type."""


def _unconvertible_row(rows: list[Mapping[str, Any]], values: list[Any], type: pa.DataType) -> str:
    """``"trajectory 'id', "`` (:func:`row_name`) of the first row whose value alone does not
    convert to ``type``; ``""`` when each converts alone. Only run once a column failed."""
    for row, value in enumerate(values):
        try:
            _array([value], type)
        except _CONVERSION_ERRORS:
            trajectory_id = rows[row].get("trajectory_id")
            return row_name(trajectory_id if isinstance(trajectory_id, str) else None, row) + ", "
    return ""


def _array(values: list[Any], type: pa.DataType) -> pa.Array:
    """``values`` as an array of ``type``. Integers must be given as integers: Arrow's
    conversion to an integer type truncates a float (token 1.5 would become 1)."""
    if not pa.types.is_integer(_value_type(type)):
        return pa.array(values, type=type)
    array = pa.array(values)
    found = _value_type(array.type)
    if not (pa.types.is_integer(found) or pa.types.is_null(found)):
        raise TypeError(f"got {array.type}")
    return array.cast(type)


def widened(type: pa.DataType) -> pa.DataType:
    """``type`` with float64 for float32, in lists and structs too: Python's floats are
    converted to it first, so that :func:`beyond_float32` sees the numbers given."""
    if type == pa.float32():
        return pa.float64()
    if pa.types.is_list(type):
        return pa.list_(widened(type.value_type))
    if pa.types.is_struct(type):
        return pa.struct([field.with_type(widened(field.type)) for field in type])
    return type


def beyond_float32(wide: pa.Array | pa.ChunkedArray, narrow: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """``(N,)`` True at the rows where ``narrow`` (``wide`` cast, e.g. float64 to float32)
    holds an infinity, in a list entry or struct field too, that ``wide`` holds as a finite
    number: Arrow casts 1e39 to a float32 infinity without a word."""
    if isinstance(wide, pa.ChunkedArray):
        if [len(chunk) for chunk in wide.chunks] != [len(chunk) for chunk in narrow.chunks]:
            # a table's cast may rechunk a column (to line it up with a column of other chunks)
            return beyond_float32(wide.combine_chunks(), narrow.combine_chunks())
        pairs = zip(wide.chunks, narrow.chunks, strict=True)
        return np.concatenate([np.zeros(0, dtype=bool), *(beyond_float32(w, n) for w, n in pairs)])
    if pa.types.is_floating(wide.type):
        lost = pc.and_(pc.is_finite(wide), pc.is_inf(narrow))
        return pc.fill_null(lost, False).to_numpy(zero_copy_only=False)
    rows = np.zeros(len(wide), dtype=bool)
    if any(
        kind(wide.type) for kind in (pa.types.is_list, pa.types.is_large_list, pa.types.is_fixed_size_list)
    ):
        entries = beyond_float32(pc.list_flatten(wide), pc.list_flatten(narrow))
        if entries.any():
            rows[pc.list_parent_indices(wide).to_numpy()[entries]] = True
    elif pa.types.is_struct(wide.type):
        # by name: a cast matches a struct's fields so, whatever their order or number
        wide_fields = dict(zip([field.name for field in wide.type], wide.flatten(), strict=True))
        for field, narrow_field in zip(narrow.type, narrow.flatten(), strict=True):
            if field.name in wide_fields:
                rows |= beyond_float32(wide_fields[field.name], narrow_field)
    return rows


BEYOND_FLOAT32 = (
    f"a number beyond float32's range (±{np.finfo(np.float32).max:.4g}) would be stored as infinity"
)
"""What is wrong with a row that :func:`beyond_float32` finds."""


def _beyond_float32(trajectory_id: str | None, row: int, column: str) -> str:
    """The error for a number of ``column`` that :func:`beyond_float32` finds in ``row``."""
    return f"{row_name(trajectory_id, row)}, column {column!r}: {BEYOND_FLOAT32}"


def _value_type(type: pa.DataType) -> pa.DataType:
    """The type of the values of a list (of any layout) or encoded array, else ``type``."""
    return getattr(type, "value_type", type)


def _castable(found: pa.DataType, wanted: pa.DataType) -> bool:
    """Whether values of ``found`` may be cast to ``wanted``: into integers and booleans only
    from their own kind, as Arrow casts 2 to True and 1.0 to 1 without a word."""
    for kind in (pa.types.is_integer, pa.types.is_boolean):
        if kind(wanted):
            return kind(found) or pa.types.is_null(found)
    return True


def cast(table: pa.Table, schema: pa.Schema = TRAJECTORY_SCHEMA) -> pa.Table:
    """Select and cast ``table``'s columns to ``schema`` (extra columns are dropped; one of
    :data:`ADDED_COLUMNS` it lacks, as a table of an earlier record version does, is null);
    a table already of ``schema`` is returned as it is."""
    if table.schema.equals(schema, check_metadata=True):
        return table
    missing = [name for name in schema.names if name not in table.column_names]
    required = [name for name in missing if name not in ADDED_COLUMNS]
    if required:
        raise SchemaError(f"missing columns {required}")
    for name in missing:
        table = table.append_column(name, pa.nulls(table.num_rows, schema.field(name).type))
    _check_unrepeated(table.schema, schema)
    for field in schema:
        actual = table.schema.field(field.name).type
        if not _castable(_value_type(actual), _value_type(field.type)):
            raise SchemaError(f"column {field.name!r} has type {actual}, expected {field.type}")
    table = table.select(schema.names)
    try:
        cast_table = table.cast(schema)
    except _CAST_ERRORS as exc:
        raise SchemaError(f"{_uncastable(table, schema)}cannot cast to the canonical schema: {exc}") from exc
    for field in schema:
        column = table.column(field.name)
        if column.type == field.type:
            continue
        beyond = np.flatnonzero(beyond_float32(column, cast_table.column(field.name)))
        if len(beyond):
            trajectory_id = cast_table.column("trajectory_id")[beyond[0]].as_py()
            raise SchemaError(_beyond_float32(trajectory_id, beyond[0], field.name))
    return cast_table


_CAST_ERRORS = (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError)
"""What Arrow's cast raises for a value or a type that does not fit."""


def _uncastable(table: pa.Table, schema: pa.Schema) -> str:
    """``"trajectory 'id', column 'x': "`` (:func:`row_name`) for the first column of
    ``table`` that does not cast to its ``schema`` type and the first row of it that does
    not (only the column, and its type, when no value of that type casts); ``""`` when
    each column casts alone. Only run once a cast failed."""
    for field in schema:
        column = table.column(field.name)
        if _casts(column, field.type, np.arange(len(column))):
            continue
        if not _casts(column, field.type, np.arange(0)):
            return f"column {field.name!r} has type {column.type}, expected {field.type}: "
        low, high = 0, len(column)  # the first row that fails lies in [low, high)
        while high - low > 1:
            middle = (low + high) // 2
            if _casts(column, field.type, np.arange(low, middle)):
                low = middle
            else:
                high = middle
        trajectory_id = table.column("trajectory_id")[low].as_py()
        name = row_name(trajectory_id if isinstance(trajectory_id, str) else None, low)
        return f"{name}, column {field.name!r}: "
    return ""


def _casts(column: pa.ChunkedArray, type: pa.DataType, rows: np.ndarray) -> bool:
    """Whether ``column``'s ``rows`` cast to ``type``: taken, not sliced, as a sliced list
    casts every value of the lists around it too."""
    try:
        column.take(rows).cast(type)
    except _CAST_ERRORS:
        return False
    return True


ID_COLUMNS = ("trajectory_id", "execution_id", "task", "prompt_id")
"""Columns that must hold a string with something other than whitespace in it: the
identity of a trajectory. ``parent_id`` and ``group_id`` are null where there is no
parent or group (a blank ``group_id`` is refused: GRPO would take every row holding it, of
any prompt, as one group), and ``engine`` is only informative."""

PROCESSED_TOKEN_COLUMNS = ("train_mask", "loss_weight")
"""Per-token list columns only processed records have."""

MAX_TURN = 32766
"""Highest turn index: the ``trajectories`` table counts turns (highest index + 1) in int16."""

LOGPROB_SLACK = 1e-6
"""How far above 0 an action token's log-prob may lie (float rounding) and still count as ≤ 0."""

TOKEN_BLOCK = 1 << 18
"""Tokens the per-token checks look at in one go (a few hundred KiB per column)."""


def find_errors(table: pa.Table) -> list[tuple[str | None, str, str]]:
    """Every problem in ``table`` as ``(trajectory_id, column, what is wrong)``.

    Checks: required ids present (not null, empty or whitespace only), ``group_id`` null or
    not blank, per-token lists of equal length with no null entry,
    token ids ≥ 0, finite log-probs ≤ 0 and versions ≥ 0 on action tokens, turn indexes in
    [0, :data:`MAX_TURN`], ``status`` in
    :data:`STATUSES`, ``progress`` null or in [0, 1], ``reward`` null or finite, ``error``
    null or at most :data:`MAX_ERROR_CHARS` characters, and for
    processed tables ``train_mask`` only where ``action_mask`` and every ``loss_weight``
    finite and ≥ 0. The checks run vectorised: row checks over whole columns, per-token
    checks over each record batch where it lies in memory (token values are not copied
    unless a check fails). Order: missing ids row by row, list lengths and
    null entries column by column, status, progress, reward and error row by row, per-token
    checks row by row.
    """
    return [error for _, _, error in sorted(_problems(table), key=lambda problem: problem[0])]


def rows_with_errors(table: pa.Table) -> dict[int, list[str]]:
    """The rows of ``table`` that :func:`find_errors` objects to, each with what is wrong
    (``"column 'x': …"``), in row order. Raises :class:`SchemaError` as
    :func:`check_columns` does."""
    check_columns(table.schema)
    found: dict[int, list[str]] = {}
    for _, row, (_, column, what) in sorted(_problems(table), key=lambda problem: (problem[1], problem[0])):
        found.setdefault(row, []).append(f"column {column!r}: {what}")
    return found


def check_columns(schema: pa.Schema) -> None:
    """Raise :class:`SchemaError` naming a column that ``schema`` lacks or types differently
    from the canonical schema (processed when it has ``train_mask``, else raw)."""
    expected = PROCESSED_SCHEMA if "train_mask" in schema.names else TRAJECTORY_SCHEMA
    if schema.names == expected.names and schema.types == expected.types:
        return
    missing = [name for name in expected.names if name not in schema.names]
    if missing:
        raise SchemaError(f"missing columns {missing}")
    _check_unrepeated(schema, expected)
    for field in expected:
        actual = schema.field(field.name).type
        if actual != field.type:
            raise SchemaError(f"column {field.name!r} has type {actual}, expected {field.type}")


def _check_unrepeated(schema: pa.Schema, expected: pa.Schema) -> None:
    """Raise :class:`SchemaError` when ``schema`` holds a column of ``expected`` twice
    (Arrow would raise a ``KeyError`` looking it up)."""
    repeated = sorted({name for name in expected.names if schema.names.count(name) > 1})
    if repeated:
        raise SchemaError(f"repeated columns {repeated}")


def validate(table: pa.Table) -> pa.Table:
    """Raise :class:`SchemaError` naming the first bad rows (by :func:`row_name`); return
    ``table`` when valid."""
    check_columns(table.schema)
    problems = sorted(_problems(table), key=lambda problem: problem[0])
    if problems:
        shown = "; ".join(
            f"{row_name(tid, row)}, column {col!r}: {what}" for _, row, (tid, col, what) in problems[:5]
        )
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise SchemaError(shown + more)
    return table


def row_name(trajectory_id: str | None, row: int) -> str:
    """How an error names a row: ``trajectory 'id'``, or, when the id is blank and so names
    nothing, ``row N (trajectory id '')`` with the row's index in the table checked."""
    if trajectory_id is None or not trajectory_id.strip():
        return f"row {row} (trajectory id {trajectory_id!r})"
    return f"trajectory {trajectory_id!r}"


_Problem = tuple[tuple[int, ...], int, tuple[str | None, str, str]]
"""An error of :func:`find_errors` behind the key that sorts it into its place and the
table row it is about."""


def _problems(table: pa.Table) -> list[_Problem]:
    """Row checks on whole columns (one kernel call each, however many record batches the
    table holds), per-token checks record batch by record batch where each lies in memory."""
    token_columns = [c for c in (*TOKEN_COLUMNS, *PROCESSED_TOKEN_COLUMNS) if c in table.column_names]
    ids = table.column("trajectory_id")
    problems: list[_Problem] = []

    def add(key: tuple[int, ...], row: int, column: str, what: str) -> None:
        problems.append((key, row, (ids[row].as_py(), column, what)))

    for position, name in enumerate(ID_COLUMNS):
        column = table.column(name)
        for row in np.flatnonzero(_blank_strings(column)):
            what = "missing id" if not column[row].as_py() else "id is whitespace only"
            add((0, row, position), row, name, what)

    group = table.column("group_id")
    blank_group = pc.is_valid(group).to_numpy(zero_copy_only=False) & _blank_strings(group)
    for row in np.flatnonzero(blank_group):
        add((0, row, len(ID_COLUMNS)), row, "group_id", "id is blank; a row of no group has a null group_id")

    lengths = {name: _list_lengths(table.column(name)) for name in token_columns}
    n_tokens = lengths["tokens"]
    bad_rows = np.zeros(table.num_rows, dtype=bool)
    for position, name in enumerate(token_columns):
        bad = (lengths[name] != n_tokens) | (lengths[name] < 0)
        for row in np.flatnonzero(bad):
            if lengths[name][row] < 0:
                what = "is null"
            elif n_tokens[row] < 0:
                what = f"has {lengths[name][row]} entries but tokens is null"
            else:
                what = f"has {lengths[name][row]} entries but tokens has {n_tokens[row]}"
            add((1, position, row), row, name, what)
        bad_rows |= bad
    for position, name in enumerate(token_columns):
        for row in _rows_with_null_entries(table.column(name)):
            add((1, position, row), row, name, "has null entries")
            bad_rows[row] = True

    status = table.column("status")
    known = pc.is_in(status, value_set=pa.array(STATUSES)).to_numpy(zero_copy_only=False)
    for row in np.flatnonzero(~known):
        what = f"unknown status {status[row].as_py()!r}; expected one of {STATUSES}"
        add((2, row, 0), row, "status", what)
    progress = table.column("progress")
    in_range = pc.and_(pc.greater_equal(progress, 0), pc.less_equal(progress, 1))
    for row in np.flatnonzero(pc.fill_null(in_range, True).to_numpy(zero_copy_only=False) == 0):
        add((2, row, 1), row, "progress", f"{progress[row].as_py()} is outside [0, 1]")
    reward = table.column("reward")
    for row in np.flatnonzero(pc.fill_null(pc.is_finite(reward), True).to_numpy(zero_copy_only=False) == 0):
        add((2, row, 2), row, "reward", f"{reward[row].as_py()} is not finite")
    error = table.column("error")
    too_long = pc.fill_null(pc.greater(pc.utf8_length(error), MAX_ERROR_CHARS), False)
    for row in np.flatnonzero(too_long.to_numpy(zero_copy_only=False)):
        what = f"holds {len(error[row].as_py())} characters, over {MAX_ERROR_CHARS}"
        add((2, row, 3), row, "error", what)

    start = 0
    for batch in table.to_batches():
        rows = slice(start, start + batch.num_rows)
        for row, check, column, what in _token_problems(batch, bad_rows[rows], n_tokens[rows]):
            add((3, start + row, check), start + row, column, what)
        start += batch.num_rows
    return problems


def _token_problems(
    batch: pa.RecordBatch, bad_rows: np.ndarray, n_tokens: np.ndarray
) -> list[tuple[int, int, str, str]]:
    """``(row, check, column, what)`` of the per-token checks on action tokens, over the
    rows whose lists have equal lengths (``bad_rows`` are reported already). Rows are only
    worked out for a check that fails somewhere."""
    good = np.flatnonzero(~bad_rows)
    rows = batch if len(good) == batch.num_rows else batch.take(pa.array(good))
    tokens = _flat(rows.column("tokens"), 0)
    # a negative id (-100, the labels' ignore index) is in no vocabulary: the trainer would
    # refuse the whole shard it lands in, every other row with it
    tokens_ok = int(tokens.min(initial=0)) >= 0
    mask = _flat(rows.column("action_mask"), False)
    logprobs = _flat(rows.column("logprobs"), np.nan)
    versions = _flat(rows.column("versions"), -1)
    train = _flat(rows.column("train_mask"), False) if "train_mask" in batch.column_names else None
    logprobs_ok, versions_ok, train_ok = _token_checks(mask, logprobs, versions, train)
    weight = _flat(rows.column("loss_weight"), np.nan) if "loss_weight" in batch.column_names else None
    weight_ok = weight is None or bool(np.isfinite(weight).all() and weight.min(initial=0) >= 0)
    turn = _flat(rows.column("turn"), 0)
    # seen as unsigned, a negative index is above the bound too: one pass checks both ends
    turn_ok = int(turn.view(np.uint16).max(initial=0)) <= MAX_TURN
    if tokens_ok and logprobs_ok and versions_ok and train_ok and weight_ok and turn_ok:
        return []
    row_of_token = np.repeat(good, n_tokens[good])
    located = []
    if not tokens_ok:
        located.append((0, np.unique(row_of_token[tokens < 0]), "tokens", "negative token id"))
    if not logprobs_ok:
        nonfinite = np.unique(row_of_token[mask & ~np.isfinite(logprobs)])
        positive = np.setdiff1d(row_of_token[mask & (logprobs > LOGPROB_SLACK)], nonfinite)
        located.append((1, nonfinite, "logprobs", "non-finite log-prob on an action token"))
        located.append((1, positive, "logprobs", "positive log-prob on an action token"))
    if not versions_ok:
        located.append(
            (
                2,
                np.unique(row_of_token[mask & (versions < 0)]),
                "versions",
                "negative version on an action token",
            )
        )
    if not train_ok:
        located.append(
            (3, np.unique(row_of_token[train & ~mask]), "train_mask", "trains a token outside action_mask")
        )
    if not weight_ok:
        bad_weight = ~(np.isfinite(weight) & (weight >= 0))
        located.append((4, np.unique(row_of_token[bad_weight]), "loss_weight", "negative or non-finite"))
    if not turn_ok:
        bad_turn = (turn < 0) | (turn > MAX_TURN)
        located.append((5, np.unique(row_of_token[bad_turn]), "turn", f"turn index outside [0, {MAX_TURN}]"))
    return [(int(row), check, column, what) for check, bad, column, what in located for row in bad]


def _token_checks(
    mask: np.ndarray, logprobs: np.ndarray, versions: np.ndarray, train: np.ndarray | None
) -> tuple[bool, bool, bool]:
    """Whether the log-probs, the versions and (when given) the train mask pass their
    per-token checks on action tokens; every array is ``(num_tokens,)``.

    Worked out block by block: the comparisons' temporaries of a block stay in the CPU
    cache, which makes the checks about three times faster than on whole columns.
    """
    logprobs_ok = versions_ok = train_ok = True
    for start in range(0, len(mask), TOKEN_BLOCK):
        block = slice(start, start + TOKEN_BLOCK)
        action = mask[block]
        # Prompt and observation tokens carry log-prob 0, so bounds over every token settle
        # the common case at SIMD speed; only when they fail are action tokens looked at
        # alone. A max or min is NaN when any log-prob is, and NaN fails the comparison.
        logprobs_ok &= _bounded(logprobs[block]) or _bounded(logprobs[block], where=action)
        versions_ok &= not ((versions[block] < 0) & action).any()
        if train is not None:
            train_ok &= not (train[block] & ~action).any()
    return logprobs_ok, versions_ok, train_ok


def _bounded(logprobs: np.ndarray, where: np.ndarray | bool = True) -> bool:
    """Whether every log-prob (where ``where``) is finite and ≤ 0 (:data:`LOGPROB_SLACK` of slack)."""
    highest = np.maximum.reduce(logprobs, where=where, initial=-np.inf)
    lowest = np.minimum.reduce(logprobs, where=where, initial=0)
    return bool(highest <= LOGPROB_SLACK and lowest > -np.inf)


def _rows_with_null_entries(column: pa.ChunkedArray) -> np.ndarray:
    """Rows of ``column`` whose list holds a null entry."""
    if not pc.list_flatten(column).null_count:
        return np.array([], dtype=np.int64)
    return np.array(
        [row for row, entries in enumerate(column) if entries.is_valid and entries.values.null_count]
    )


def _blank_strings(column: pa.ChunkedArray) -> np.ndarray:
    """True where a string is null, empty or whitespace only (Unicode whitespace, as
    ``str.isspace``)."""
    blank = pc.or_kleene(pc.equal(pc.binary_length(column), 0), pc.utf8_is_space(column))
    return pc.fill_null(blank, True).to_numpy(zero_copy_only=False)


def _list_lengths(column: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """Entries of each list, −1 for a null list."""
    lengths = pc.list_value_length(column)
    if lengths.null_count:
        lengths = pc.fill_null(lengths, -1)
    return lengths.to_numpy()


def _flat(column: pa.ListArray, fill: Any) -> np.ndarray:
    """Values of every list of ``column``, concatenated, nulls as ``fill`` (no copy when
    nothing is null and the values are not booleans)."""
    values = column.flatten()
    if values.null_count:
        values = pc.fill_null(values, fill)
    if pa.types.is_boolean(values.type) and len(values):
        # Arrow packs booleans into bits; unpacking the buffer beats to_numpy's conversion.
        bits = np.frombuffer(values.buffers()[1], dtype=np.uint8)
        unpacked = np.unpackbits(bits, count=values.offset + len(values), bitorder="little")
        return unpacked[values.offset :].view(bool)
    return values.to_numpy(zero_copy_only=False)
