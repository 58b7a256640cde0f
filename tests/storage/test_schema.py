"""Validation of the trajectory record: every error names the trajectory and column."""

from __future__ import annotations

import re

import numpy as np
import pyarrow as pa
import pytest

import storage.schema
from storage.redaction import MASKED
from storage.schema import (
    MAX_ERROR_CHARS,
    PROCESSED_SCHEMA,
    STATUSES,
    TRAJECTORY_SCHEMA,
    SchemaError,
    cast,
    error_text,
    find_errors,
    newer_record,
    rows_with_errors,
    to_table,
    validate,
    widened,
)
from tests.storage.records import make_processed_table, make_record, make_table


def test_a_valid_table_passes():
    table = make_table(0, 5)
    assert validate(table) is table
    assert validate(make_processed_table(0, 3)).num_rows == 3


@pytest.mark.parametrize(
    ("change", "column", "what"),
    [
        ({"logprobs": [-0.1] * 23}, "logprobs", "has 23 entries but tokens has 24"),
        ({"turn": [0] * 25}, "turn", "has 25 entries but tokens has 24"),
        ({"status": "exploded"}, "status", "unknown status 'exploded'"),
        ({"execution_id": ""}, "execution_id", "missing id"),
        ({"prompt_id": " \t"}, "prompt_id", "id is whitespace only"),
        ({"logprobs": [float("nan")] * 24}, "logprobs", "non-finite log-prob"),
        ({"logprobs": [0.5] * 24}, "logprobs", "positive log-prob"),
        ({"versions": [-1] * 24}, "versions", "negative version"),
        ({"tokens": [None] + [7] * 23}, "tokens", "has null entries"),
        ({"tokens": [-100] + [7] * 23}, "tokens", "negative token id"),
        ({"progress": 1.5}, "progress", "1.5 is outside [0, 1]"),
        ({"progress": float("nan")}, "progress", "nan is outside [0, 1]"),
        ({"reward": float("nan")}, "reward", "nan is not finite"),
        ({"reward": float("-inf")}, "reward", "-inf is not finite"),
    ],
)
def test_a_bad_row_is_named_with_its_column(change, column, what):
    records = [make_record(i) for i in range(4)]
    records[2] |= change
    with pytest.raises(SchemaError) as info:
        validate(to_table(records))
    assert f"trajectory 't2', column '{column}': {what}" in str(info.value)
    assert "'t0'" not in str(info.value)


def test_an_infinite_log_prob_on_an_action_token_is_non_finite():
    record = make_record(0)
    assert record["action_mask"][4]
    record["logprobs"][4] = float("-inf")
    assert find_errors(to_table([record])) == [("t0", "logprobs", "non-finite log-prob on an action token")]


def test_a_slightly_positive_log_prob_beyond_the_slack_is_named():
    record = make_record(0)
    record["logprobs"][4] = 1e-4
    assert find_errors(to_table([record])) == [("t0", "logprobs", "positive log-prob on an action token")]


def test_a_log_prob_within_the_slack_is_not_reported_when_another_row_fails():
    records = [make_record(i) for i in range(3)]
    records[1]["logprobs"][4] = 1e-7  # rounding of a log-prob of 0: within the 1e-6 slack
    records[2]["logprobs"][4] = 0.5
    assert find_errors(to_table(records)) == [("t2", "logprobs", "positive log-prob on an action token")]


def test_progress_at_either_end_of_its_range_and_a_missing_reward_of_an_infra_error_are_valid():
    records = [make_record(i) for i in range(3)]
    records[0]["progress"] = 0.0
    records[1]["progress"] = 1.0
    records[2] |= {"reward": None, "status": "infra_error"}
    assert find_errors(to_table(records)) == []


def test_a_null_id_is_a_missing_id():
    records = [make_record(i) for i in range(2)]
    records[1]["execution_id"] = None
    assert find_errors(to_table(records)) == [("t1", "execution_id", "missing id")]


@pytest.mark.parametrize(
    "blank", ["", " ", "\t\n", "\u3000"], ids=["empty", "space", "tab-newline", "ideographic"]
)
@pytest.mark.parametrize("column", ["trajectory_id", "execution_id", "task", "prompt_id"])
def test_a_blank_id_is_refused_and_a_blank_trajectory_id_is_named_by_its_row(column, blank):
    records = [make_record(i) for i in range(3)]
    records[1][column] = blank
    what = "missing id" if not blank else "id is whitespace only"
    table = to_table(records)
    assert find_errors(table) == [(records[1]["trajectory_id"], column, what)]
    assert rows_with_errors(table) == {1: [f"column {column!r}: {what}"]}
    who = f"row 1 (trajectory id {blank!r})" if column == "trajectory_id" else "trajectory 't1'"
    with pytest.raises(SchemaError) as info:
        validate(table)
    assert str(info.value) == f"{who}, column {column!r}: {what}"


@pytest.mark.parametrize("blank", ["", "  "])
def test_a_blank_group_id_is_refused_not_taken_as_one_group_of_every_such_row(blank):
    """A record sent to POST /v1/records with ``group_id: ""`` (no group, as a client without
    null writes it) validated, and GRPO then took every such row, of any prompt, as one group."""
    records = [make_record(i) for i in range(3)]
    records[1]["group_id"] = blank
    assert find_errors(to_table(records)) == [
        ("t1", "group_id", "id is blank; a row of no group has a null group_id")
    ]


def test_parent_and_group_ids_may_be_null_and_the_engine_blank():
    records = [make_record(i) for i in range(2)]
    records[0] |= {"group_id": None, "parent_id": None, "engine": None}
    records[1] |= {"group_id": "g", "parent_id": "t0", "branch_at": 4, "engine": ""}
    assert find_errors(to_table(records)) == []


def test_a_null_token_list_is_named():
    record = make_record(0)
    record["tokens"] = None
    assert ("t0", "tokens", "is null") in find_errors(to_table([record]))


def test_a_slightly_negative_loss_weight_is_named():
    table = make_processed_table(0, 2)
    loss_weight = table.column("loss_weight").to_pylist()
    loss_weight[1][4] = -1e-3
    column = pa.array(loss_weight, pa.list_(pa.float32()))
    table = table.set_column(table.schema.get_field_index("loss_weight"), "loss_weight", column)
    assert find_errors(cast(table, PROCESSED_SCHEMA)) == [("t1", "loss_weight", "negative or non-finite")]


def test_train_mask_outside_actions_is_named():
    table = make_processed_table(0, 2)
    train_mask = table.column("train_mask").to_pylist()
    train_mask[1][0] = True  # token 0 is a prompt token
    table = table.set_column(table.schema.get_field_index("train_mask"), "train_mask", pa.array(train_mask))
    with pytest.raises(SchemaError, match="trajectory 't1', column 'train_mask': trains a token outside"):
        validate(cast(table, PROCESSED_SCHEMA))


def test_type_and_missing_column_errors_name_the_column():
    table = make_table(0, 2)
    with pytest.raises(SchemaError, match=r"missing columns \['status'\]"):
        validate(table.drop_columns(["status"]))
    wrong = table.set_column(
        table.schema.get_field_index("tokens"), "tokens", table.column("tokens").cast(pa.list_(pa.int64()))
    )
    with pytest.raises(SchemaError, match="column 'tokens' has type list<item: int64>"):
        validate(wrong)
    with pytest.raises(SchemaError, match="column 'tokens'"):
        to_table([make_record(0) | {"tokens": ["a", "b"]}])


@pytest.mark.parametrize(
    ("change", "column"),
    [
        ({"tokens": [1.5] * 24}, "tokens"),
        ({"versions": np.full(24, 2.0)}, "versions"),
        ({"turn": np.ones(24, dtype=bool)}, "turn"),
        ({"branch_at": 3.7}, "branch_at"),
    ],
)
def test_a_float_or_bool_given_for_an_integer_column_is_refused_not_truncated(change, column):
    with pytest.raises(SchemaError, match=f"column '{column}': cannot convert to .*int"):
        to_table([make_record(0) | change])


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"tokens": [1.5] * 24}, "trajectory 't2', column 'tokens'"),
        ({"reward": "high"}, "trajectory 't2', column 'reward'"),
        ({"trajectory_id": 7}, "row 2 (trajectory id None), column 'trajectory_id'"),
    ],
)
def test_a_value_that_cannot_be_converted_is_named_with_its_trajectory(change, named):
    """A batch of records (a POST /v1/records body) with one bad value was refused naming only
    the column, so its sender could not tell which record to mend."""
    records = [make_record(i) for i in range(4)]
    records[2] |= change
    with pytest.raises(SchemaError, match=re.escape(f"{named}: cannot convert to ")):
        to_table(records)


@pytest.mark.parametrize(
    ("change", "column"),
    [({"tokens": [2**64] * 24}, "tokens"), ({"branch_at": -(2**63) - 1}, "branch_at")],
)
def test_an_integer_beyond_64_bits_is_refused_naming_its_column(change, column):
    with pytest.raises(SchemaError, match=f"column '{column}': cannot convert to .*int32"):
        to_table([make_record(0) | change])


@pytest.mark.parametrize(
    ("change", "column"),
    [
        ({"reward": 1e39}, "reward"),
        ({"progress": -1e39}, "progress"),
        ({"logprobs": [1e39] + [0.0] * 23}, "logprobs"),  # a prompt token: validate checks none
        ({"timing": {"init": 0.1, "run": 1e39, "eval": 0.2, "queue": 0.0}}, "timing"),
        ({"loss_weight": [1.0] * 23 + [np.float64(4e38)]}, "loss_weight"),
    ],
)
def test_a_number_beyond_float32s_range_is_refused_naming_its_column_not_stored_as_infinity(change, column):
    records = [make_record(i) | {"train_mask": [False] * 24, "loss_weight": [1.0] * 24} for i in range(4)]
    records[2] |= change
    message = f"trajectory 't2', column '{column}': a number beyond float32's range"
    with pytest.raises(SchemaError, match=message):
        to_table(records, PROCESSED_SCHEMA)
    wide = pa.Table.from_pylist(records, schema=_widened(PROCESSED_SCHEMA))
    with pytest.raises(SchemaError, match=message):
        cast(wide, PROCESSED_SCHEMA)
    if column in ("logprobs", "loss_weight"):
        for layout in (pa.large_list(pa.float64()), pa.list_(pa.float64(), 24)):
            relaid = wide.set_column(wide.schema.get_field_index(column), column, wide[column].cast(layout))
            with pytest.raises(SchemaError, match=message):
                cast(relaid, PROCESSED_SCHEMA)


def test_float32s_own_extremes_infinities_and_nan_are_taken_as_they_are():
    highest = float(np.finfo(np.float32).max)
    record = make_record(0) | {"reward": float("inf"), "progress": float("nan")}
    record["logprobs"] = [-highest, float("-inf")] + record["logprobs"][2:]
    wide = pa.Table.from_pylist([record], schema=_widened(TRAJECTORY_SCHEMA))
    for table in (to_table([record]), cast(wide)):
        assert table.column("reward").to_pylist() == [float("inf")]
        assert table.column("logprobs")[0].as_py()[:2] == [-highest, float("-inf")]
        assert np.isnan(table.column("progress")[0].as_py())


def _widened(schema: pa.Schema) -> pa.Schema:
    """``schema`` with float64 wherever it has float32 (in lists and structs too)."""
    return pa.schema([field.with_type(widened(field.type)) for field in schema])


@pytest.mark.parametrize(
    ("column", "values"),
    [("action_mask", pa.array([[0, 2] * 12] * 2)), ("tokens", pa.array([[1.0] * 24] * 2))],
)
def test_cast_refuses_a_column_of_another_kind_for_an_integer_or_boolean_one(column, values):
    table = make_table(0, 2)
    table = table.set_column(table.schema.get_field_index(column), column, values)
    with pytest.raises(SchemaError, match=f"column '{column}' has type {values.type}, expected"):
        cast(table)


@pytest.mark.parametrize(
    ("column", "values"),
    [
        ("tokens", pa.array([[7] * 24, [7] * 23 + [2**40], [2**40] * 24], pa.list_(pa.int64()))),
        ("turn", pa.array([[0] * 24, [40000] * 24, [0] * 24], pa.list_(pa.int64()))),
        ("reward", pa.array(["1", "high", "x"])),
    ],
)
def test_a_value_cast_cannot_fit_is_named_with_its_trajectory_and_column(column, values):
    """Arrow's own message (``Integer value 1099511627776 not in range``) named neither the
    column nor the row."""
    table = make_table(0, 3)
    table = table.set_column(table.schema.get_field_index(column), column, values)
    table = pa.concat_tables([table.slice(0, 1), table.slice(1)])  # the row in a later chunk
    with pytest.raises(SchemaError, match=f"^trajectory 't1', column '{column}': cannot cast to "):
        cast(table)


def test_a_column_whose_type_cast_cannot_fit_is_named_with_its_type_not_a_row():
    table = make_table(0, 2)
    timing = pa.array(["1 s", "2 s"])
    table = table.set_column(table.schema.get_field_index("timing"), "timing", timing)
    with pytest.raises(
        SchemaError, match="^" + re.escape(f"column 'timing' has type {timing.type}, expected")
    ):
        cast(table)


@pytest.mark.parametrize(
    "timing",
    [
        {"init": 0.1, "run": 1.0, "eval": 0.2},
        {"init": 0.1, "run": 1.0, "eval": 0.2, "queue": 0.0, "load": 3.0},
        {"queue": 0.0, "eval": 0.2, "run": 1.0, "init": 0.1},
    ],
    ids=["one-entry-short", "one-entry-more", "reordered"],
)
def test_cast_takes_a_timing_struct_of_other_entries_by_name(timing):
    """A timing struct of three entries or five raised zip()'s ValueError (the float32 range
    check paired the entries by position), not a cast nor a SchemaError."""
    records = [make_record(i) | {"timing": timing} for i in range(2)]
    cast_timing = cast(pa.Table.from_pylist(records)).column("timing").to_pylist()
    expected = {key: timing.get(key) for key in ("init", "run", "eval", "queue")}
    assert cast_timing == [pytest.approx(expected)] * 2


def test_a_timing_entry_beyond_float32s_range_is_found_by_name_in_a_reordered_struct():
    records = [
        make_record(i) | {"timing": {"run": 1.0, "init": 0.1, "eval": 0.2, "queue": 0.0}} for i in range(2)
    ]
    records[1]["timing"] = {"run": 1e39, "init": float("nan"), "eval": 0.2, "queue": 0.0}
    with pytest.raises(SchemaError, match="trajectory 't1', column 'timing': a number beyond float32"):
        cast(pa.Table.from_pylist(records))


def test_cast_takes_integers_in_any_list_layout():
    table = make_table(0, 2)
    for layout in (pa.large_list(pa.int64()), pa.list_(pa.int64(), 24)):
        tokens = table.column("tokens").cast(layout)
        changed = table.set_column(table.schema.get_field_index("tokens"), "tokens", tokens)
        assert cast(changed).equals(table)


def test_a_repeated_column_is_named_by_cast_and_validate():
    table = make_table(0, 2)
    table = table.append_column("tokens", table.column("tokens"))
    for check in (cast, validate):
        with pytest.raises(SchemaError, match=r"repeated columns \['tokens'\]"):
            check(table)


def _reference_errors(table: pa.Table) -> list[tuple[str | None, str, str]]:
    """The checks written as a plain loop over rows and tokens."""
    rows = table.to_pylist()
    token_columns = [
        c
        for c in ("tokens", "logprobs", "action_mask", "turn", "versions", "train_mask", "loss_weight")
        if c in table.column_names
    ]
    errors = []
    for row in rows:
        for name in ("trajectory_id", "execution_id", "task", "prompt_id"):
            if not row[name]:
                errors.append((row["trajectory_id"], name, "missing id"))
            elif row[name].isspace():
                errors.append((row["trajectory_id"], name, "id is whitespace only"))
        if row["group_id"] is not None and not row["group_id"].strip():
            errors.append(
                (row["trajectory_id"], "group_id", "id is blank; a row of no group has a null group_id")
            )
    for name in token_columns:
        for row in rows:
            if len(row[name]) != len(row["tokens"]):
                errors.append(
                    (
                        row["trajectory_id"],
                        name,
                        f"has {len(row[name])} entries but tokens has {len(row['tokens'])}",
                    )
                )
            if None in row[name]:
                errors.append((row["trajectory_id"], name, "has null entries"))
    for row in rows:
        if row["status"] not in STATUSES:
            errors.append(
                (
                    row["trajectory_id"],
                    "status",
                    f"unknown status {row['status']!r}; expected one of {STATUSES}",
                )
            )
        if row["progress"] is not None and not 0 <= row["progress"] <= 1:
            errors.append((row["trajectory_id"], "progress", f"{row['progress']} is outside [0, 1]"))
        if row["reward"] is not None and not np.isfinite(row["reward"]):
            errors.append((row["trajectory_id"], "reward", f"{row['reward']} is not finite"))
        if row["error"] is not None and len(row["error"]) > MAX_ERROR_CHARS:
            what = f"holds {len(row['error'])} characters, over {MAX_ERROR_CHARS}"
            errors.append((row["trajectory_id"], "error", what))
    for row in rows:
        if any(len(row[name]) != len(row["tokens"]) or None in row[name] for name in token_columns):
            continue
        if any(t < 0 for t in row["tokens"]):
            errors.append((row["trajectory_id"], "tokens", "negative token id"))
        action = [i for i, generated in enumerate(row["action_mask"]) if generated]
        logprobs = [row["logprobs"][i] for i in action]
        if not all(np.isfinite(lp) for lp in logprobs):
            errors.append((row["trajectory_id"], "logprobs", "non-finite log-prob on an action token"))
        elif any(lp > 1e-6 for lp in logprobs):
            errors.append((row["trajectory_id"], "logprobs", "positive log-prob on an action token"))
        if any(row["versions"][i] < 0 for i in action):
            errors.append((row["trajectory_id"], "versions", "negative version on an action token"))
        if "train_mask" in row and any(
            t and not row["action_mask"][i] for i, t in enumerate(row["train_mask"])
        ):
            errors.append((row["trajectory_id"], "train_mask", "trains a token outside action_mask"))
        if "loss_weight" in row and not all(np.isfinite(w) and w >= 0 for w in row["loss_weight"]):
            errors.append((row["trajectory_id"], "loss_weight", "negative or non-finite"))
        if any(t < 0 or t > 32766 for t in row["turn"]):
            errors.append((row["trajectory_id"], "turn", "turn index outside [0, 32766]"))
    return errors


@pytest.mark.parametrize("token_block", [None, 5], ids=["default-block", "block-of-5"])
@pytest.mark.parametrize("seed", range(12))
def test_find_errors_matches_a_row_by_row_reference(seed, token_block, monkeypatch):
    if token_block is not None:
        # small blocks, so that the per-token checks cross block boundaries inside rows
        monkeypatch.setattr(storage.schema, "TOKEN_BLOCK", token_block)
    rng = np.random.default_rng(seed)
    records = []
    for i in range(int(rng.integers(1, 40))):
        n = int(rng.integers(0, 12))
        mask = rng.random(n) < 0.5
        record = make_record(i, n) | {"action_mask": mask.tolist()}
        record["logprobs"] = np.where(mask, -rng.random(n), 0.0).tolist()
        record["versions"] = np.where(mask, 1, -1).tolist()
        record["train_mask"] = (mask & (rng.random(n) < 0.7)).tolist()
        record["loss_weight"] = [1.0] * n
        fault = rng.integers(0, 16)
        if fault == 1 and n:
            record["logprobs"][int(rng.integers(n))] = float(rng.choice([np.nan, np.inf, 0.3]))
        elif fault == 2 and n:
            record["versions"][int(rng.integers(n))] = -2
        elif fault == 3:
            record["turn"] = [0] * (n + 1)
        elif fault == 4 and n:
            record["train_mask"][int(rng.integers(n))] = True
        elif fault == 5:
            record["status"] = "weird"
        elif fault == 6:
            record["prompt_id"] = ""
        elif fault == 7 and n:
            column = str(rng.choice(["tokens", "logprobs", "action_mask", "turn", "versions", "train_mask"]))
            record[column][int(rng.integers(n))] = None
        elif fault == 8:
            record["progress"] = float(rng.choice([np.nan, -0.25, 1.5]))
        elif fault == 9 and n:
            record["loss_weight"][int(rng.integers(n))] = float(rng.choice([np.nan, np.inf, -1.0]))
        elif fault == 10 and n:
            record["turn"][int(rng.integers(n))] = int(rng.choice([-1, 32767]))
        elif fault == 11:
            record["reward"] = float(rng.choice([np.nan, np.inf, -np.inf]))
        elif fault == 12:
            record["execution_id"] = " \t"
        elif fault == 13:  # characters, not UTF-8 bytes, are counted: the bound and one past it
            record["error"] = "é" * int(rng.choice([MAX_ERROR_CHARS, MAX_ERROR_CHARS + 1]))
        elif fault == 14 and n:
            record["tokens"][int(rng.integers(n))] = -1
        elif fault == 15:
            record["group_id"] = str(rng.choice(["", " ", "g"]))
        records.append(record)
    table = to_table(records, PROCESSED_SCHEMA)
    table = pa.concat_tables([table.slice(0, len(records) // 2), table.slice(len(records) // 2)])
    assert find_errors(table) == _reference_errors(table)
    raw = cast(table, TRAJECTORY_SCHEMA)
    assert find_errors(raw) == _reference_errors(raw)
    row_of = {tid: row for row, tid in enumerate(table.column("trajectory_id").to_pylist())}
    expected: dict[int, list[str]] = {}
    for tid, column, what in _reference_errors(table):
        expected.setdefault(row_of[tid], []).append(f"column {column!r}: {what}")
    assert rows_with_errors(table) == dict(sorted(expected.items()))


@pytest.mark.parametrize("status", STATUSES)
def test_every_known_status_is_valid(status):
    record = make_record(0)
    record["status"] = status
    assert find_errors(to_table([record])) == []


def test_the_highest_turn_index_is_valid_also_beside_a_row_past_it():
    records = [make_record(i) for i in range(2)]
    records[0]["turn"] = [storage.schema.MAX_TURN] * len(records[0]["tokens"])
    assert find_errors(to_table(records[:1])) == []
    records[1]["turn"][3] = storage.schema.MAX_TURN + 1
    assert find_errors(to_table(records)) == [("t1", "turn", "turn index outside [0, 32766]")]


def test_a_processed_table_without_loss_weight_is_refused_not_read_as_raw():
    table = make_processed_table(0, 2)
    table = table.drop_columns(["loss_weight"])
    with pytest.raises(SchemaError, match=r"missing columns \['loss_weight'\]"):
        validate(table)


def test_validate_names_the_first_five_bad_rows_and_counts_the_rest():
    records = [make_record(i) for i in range(8)]
    for record in records[:6]:
        record["status"] = "exploded"
    with pytest.raises(SchemaError) as info:
        validate(to_table(records))
    message = str(info.value)
    assert [f"'t{i}'" in message for i in range(8)] == [True] * 5 + [False] * 3
    assert message.endswith(" (and 1 more)")


def test_an_error_over_the_bound_is_refused_naming_its_length():
    records = [make_record(i) | {"status": "env_error"} for i in range(2)]
    records[0]["error"] = "x" * MAX_ERROR_CHARS
    records[1]["error"] = "x" * (MAX_ERROR_CHARS + 1)
    assert find_errors(to_table(records)) == [
        ("t1", "error", f"holds 1001 characters, over {MAX_ERROR_CHARS}")
    ]
    assert validate(to_table(records[:1])).column("error").to_pylist() == ["x" * MAX_ERROR_CHARS]


def test_a_table_of_the_first_record_version_casts_with_error_null():
    """A table written before ``error`` (``trajectory/1``, ``processed/1``) lacks the column:
    it reads as null, raw or processed; a column that was always there is still required.
    A treadle of the first version refuses a table of this one (a newer record) rather than
    dropping its ``error``."""
    for schema, table in [
        (TRAJECTORY_SCHEMA, make_table(0, 2)),
        (PROCESSED_SCHEMA, make_processed_table(0, 2)),
    ]:
        version = schema.metadata[b"treadle.schema"].decode().replace("/2", "/1")
        older = table.drop_columns(["error"]).replace_schema_metadata({"treadle.schema": version})
        read = validate(cast(older, schema))
        assert read.schema.equals(schema, check_metadata=True)
        assert read.column("error").to_pylist() == [None, None]
        assert read.drop_columns(["error"]).equals(table.drop_columns(["error"]))
        assert newer_record(schema, older.schema) == version.replace("/1", "/2")
    with pytest.raises(SchemaError, match=r"missing columns \['status'\]"):
        cast(make_table(0, 1).drop_columns(["error", "status"]))


def test_error_text_masks_secrets_before_it_cuts_to_the_bound():
    secret = "s3cr3t-value"
    key_id = "AKIAABCDEFGHIJKLMNOP"
    text = (
        f"RuntimeError during eval: curl -u key:{secret} failed; key {key_id}; "
        "<Error><Token-0>session-token</Token-0></Error>"
    )
    masked = error_text(text, [secret, None])
    assert masked == (
        f"RuntimeError during eval: curl -u key:{MASKED} failed; key {MASKED}; "
        f"<Error><Token-0>{MASKED}</Token-0></Error>"
    )
    # a secret that straddles the bound is masked whole, not cut into a readable start
    long = "x" * (MAX_ERROR_CHARS - 5) + secret + "y" * 5000
    cut = error_text(long, [secret])
    assert len(cut) == MAX_ERROR_CHARS and cut.endswith("…")
    assert cut == ("x" * (MAX_ERROR_CHARS - 5) + MASKED)[: MAX_ERROR_CHARS - 1] + "…"
    assert "s3cr" not in cut
    # one secret holding another is masked whole
    assert error_text("token abc123 and abc", ["abc", "abc123"]) == f"token {MASKED} and {MASKED}"
    assert error_text(cut, [secret]) == cut
    # a text at the bound is kept whole
    assert error_text("x" * MAX_ERROR_CHARS) == "x" * MAX_ERROR_CHARS


def test_error_text_masks_every_element_of_s3_error_bodies_that_echoes_credentials():
    """An S3 endpoint refusing a signature echoes the key id (not always an AWS one: MinIO,
    Ceph), the session token and what was signed, over lines; a retried request quotes one
    body per try. Each such element is masked, what lies between them kept; a temporary
    (``ASIA…``) key id is masked anywhere."""
    echoed = {
        "AWSAccessKeyId": "minio-key",
        "StringToSign": "AWS4-HMAC-SHA256\n20260101T000000Z",
        "StringToSignBytes": "41 57 53",
        "SignatureProvided": "abcdef",
        "CanonicalRequest": "GET\n/bucket\nx-amz-security-token:tok",
        "CanonicalRequestBytes": "47 45 54",
        "Token-1": "tok",
    }
    code = "<Code>SignatureDoesNotMatch</Code>"
    body = f"<Error>{code}" + "".join(f"<{tag}>{value}</{tag}>" for tag, value in echoed.items()) + "</Error>"
    masked = f"<Error>{code}" + "".join(f"<{tag}>{MASKED}</{tag}>" for tag in echoed) + "</Error>"
    assert error_text(f"try 1: {body} try 2: {body} key ASIAABCDEFGHIJKLMNOP") == (
        f"try 1: {masked} try 2: {masked} key {MASKED}"
    )


def test_error_text_masks_the_user_and_password_of_every_url_in_it():
    """An endpoint or API URL given as ``scheme://user:password@host`` is quoted by the errors
    of its client; its user and password are masked, the rest of the URL and text kept."""
    text = (
        "ClientError('500 for url http://treadle:s3cret-pw@127.0.0.1:4300/api/artifacts/') via "
        "https://key-id@minio.local:9000/bucket and s3://bucket/key@v2, mailto user@example.com"
    )
    assert error_text(text) == (
        f"ClientError('500 for url http://{MASKED}@127.0.0.1:4300/api/artifacts/') via "
        f"https://{MASKED}@minio.local:9000/bucket and s3://bucket/key@v2, mailto user@example.com"
    )


def test_error_text_writes_a_lone_surrogate_as_its_escape_so_the_record_stays_writable():
    text = error_text("UnicodeDecodeError in output b'\udcff'")
    assert text == "UnicodeDecodeError in output b'\\udcff'"
    assert validate(to_table([make_record(0) | {"status": "env_error", "error": text}])).num_rows == 1


def test_a_table_read_in_several_batches_casts_and_is_checked_whatever_its_columns_chunks():
    """A shard of the first record version read in two record batches gets its ``error``
    as one chunk of nulls, and Arrow's cast then rechunks every column: the float32 range
    check paired the chunks of the columns before and after the cast and raised a bare
    ``ValueError: zip() argument 2 is shorter than argument 1``."""
    table = make_table(0, 4).drop_columns(["error"])
    wide = table.set_column(
        table.schema.get_field_index("reward"), "reward", table.column("reward").cast(pa.float64())
    )
    batches = pa.Table.from_batches(wide.to_batches(max_chunksize=2))
    read = cast(batches)
    assert read.column("reward").to_pylist() == table.column("reward").to_pylist()
    assert read.column("error").null_count == 4
    rewards = batches.column("reward").to_pylist()
    beyond = batches.set_column(
        batches.schema.get_field_index("reward"),
        "reward",
        pa.chunked_array([rewards[:2], [*rewards[2:3], 1e39]]),
    )
    trajectory_id = batches.column("trajectory_id")[3].as_py()
    with pytest.raises(SchemaError, match=rf"trajectory '{trajectory_id}', column 'reward': a number beyond"):
        cast(beyond)
