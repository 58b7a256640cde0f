"""``dataset``: prompts and reference answers from the user's Parquet, JSONL or JSON-array file.

The file is local or remote (``s3://`` through :class:`storage.config.StorageConfig`). The
verifier is chosen in config: exact match, numeric tolerance, a regex the answer must match
in full, or a Python function named by import path (``pkg.mod:fn(answer, reference) -> float``).
The regex verifier runs on a thread with a time limit (``regex_timeout_s``): the answer is the
model's, and a reference pattern that backtracks on some answer would otherwise hold the
event loop, and every rollout of the worker with it, for as long as it takes. A Python
function runs on a thread too (without a limit: it cannot be stopped), for the same reason:
its cost on the model's answer is unknown (a symbolic checker's on ``9**9**9**9``, say).
The file must hold a row, and every row must be an object with a prompt and answer (and id,
when ``id_field`` is set), none of them null or NaN (a missing value), each text or a number,
not a list or an object (a chat-format prompt, a list of answers), the prompt and id not
blank; for the exact and regex verifiers, an answer that is not blank, for the regex one, an
answer that compiles, and for the numeric one, an answer that is a number. A bad row fails
the load with its file and where it is (a JSON-lines file's line, from 1; a Parquet file's or
JSON array's row, from 0), a file that is no Parquet with its name.
A binary column is read as UTF-8 text, a boolean as JSON writes it (``true``; the exact
verifier takes ``True`` for it too), an integral float as its integer (``2``, not ``2.0``), and
a float32 as the shortest decimal it holds (``1.1``, not ``1.100000023841858``).
Rows are split into train and eval by a hash of their prompt (less the whitespace around it),
so the splits never share a prompt, even one that occurs under several ids or with a trailing
newline; ``id_field`` only names the task. A prompt given again must come with the same
reference (the same number, for the numeric verifier): with another, one answer would score 1
on one task and 0 on its twin, and the load fails naming both rows of the first such prompt
and how many rows more are like it. An id (``id_field``) given again must come with the same
prompt: the split goes by the prompt, so one id over two would name a task of each split.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import math
import os
import posixpath
import random
import re
import urllib.parse
from collections.abc import Callable
from decimal import Decimal, InvalidOperation, Overflow
from typing import ClassVar

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import regex
from pydantic import Field, field_validator

from envs.base import Env, EnvConfig, Split, StepResult, Task, clamp_score, in_eval_split, user
from storage.config import S3_SCHEMES, StorageConfig

FORMATS = (".parquet", ".jsonl", ".json")


class DatasetConfig(EnvConfig):
    """Where the rows are and how answers are checked."""

    required_fields: ClassVar[tuple[str, ...]] = ("path",)

    max_turns: int = Field(1, ge=1, le=1, description="Single turn: the action is the answer.")
    path: str = Field(
        "",
        description="Parquet (.parquet), JSON-lines (.jsonl) or JSON-array (.json) file, local (a leading ~ is the "
        "home folder) or s3://.",
    )
    storage: StorageConfig | None = Field(None, description="Endpoint and credentials for an s3:// path.")
    prompt_field: str = Field("prompt", description="Column holding the user message.")
    answer_field: str = Field("answer", description="Column holding the reference answer.")
    id_field: str | None = Field(
        None, description="Column holding a stable row id, the task's id; the prompt when unset."
    )
    verifier: str = Field(
        "exact",
        description="exact | numeric | regex | an import path 'pkg.mod:fn' of fn(answer, reference) -> float.",
    )
    tolerance: float = Field(1e-6, ge=0, description="Absolute tolerance of the numeric verifier.")
    regex_timeout_s: float = Field(
        2.0,
        gt=0,
        description="Seconds the regex verifier may spend on one answer; past them the rollout ends as "
        "env_error.",
    )
    eval_fraction: float = Field(0.1, gt=0, lt=1, description="Share of rows held out for eval.")

    @field_validator("path")
    @classmethod
    def _known_format(cls, value: str) -> str:
        # checked before anything names the value: it reaches errors, logs and the flow run's parameters
        if "@" in urllib.parse.urlsplit(value).netloc:
            raise ValueError(
                "holds credentials (user:secret@ before the bucket); give them as storage.access_key_id and "
                "storage.secret_access_key, or as AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY in the environment"
            )
        if value and not value.endswith(FORMATS):
            raise ValueError(f"must end in .parquet, .jsonl or .json, got {posixpath.basename(value)!r}")
        scheme, url, rest = value.partition("://")
        if not url:
            return os.path.expanduser(value)
        if scheme.lower() not in S3_SCHEMES:
            raise ValueError(f"must be a local file or an s3:// URL, not a {scheme}:// one")
        return f"{scheme.lower()}://{rest}"

    @field_validator("verifier")
    @classmethod
    def _known_verifier(cls, value: str) -> str:
        if value not in ("exact", "numeric", "regex") and not re.fullmatch(r"[\w.]+:\w+", value):
            raise ValueError(f"verifier must be exact, numeric, regex or 'pkg.mod:fn', got {value!r}")
        return value


def _numeric(answer: str, reference: str, tolerance: float) -> float:
    """1.0 when the numbers are at most ``tolerance`` apart. They are read as decimals, not
    floats: two long numerals one float apart (``2**64`` and ``2**64 - 1``) are one number as
    floats, and a numeral past the float range (``1e999``) is infinity."""
    try:
        got, want = Decimal(_numeral(answer)), Decimal(_numeral(reference))
    except InvalidOperation:
        return 0.0
    if got.is_nan() or want.is_nan():
        return 0.0
    if got.is_infinite() or want.is_infinite():
        return float(got == want)
    try:
        return float(abs(got - want) <= Decimal(repr(tolerance)))
    except Overflow:  # a difference past the decimal range is past any tolerance
        return 0.0


def _numeral(text: str) -> str:
    """``text`` as Python reads a number: U+2212, the typeset minus (``−5``, ``1e−6``), as ``-``."""
    return text.strip().replace("\u2212", "-")


def make_verifier(config: DatasetConfig) -> Callable[[str, str], float]:
    """``verify(answer, reference) -> score in [0, 1]`` for ``config.verifier``."""
    if config.verifier == "exact":
        return _exact
    if config.verifier == "numeric":
        return lambda answer, reference: _numeric(answer.strip(), reference.strip(), config.tolerance)
    if config.verifier == "regex":
        return lambda answer, reference: _regex_match(answer.strip(), reference, config.regex_timeout_s)
    module_name, fn_name = config.verifier.split(":")
    try:
        fn = getattr(importlib.import_module(module_name), fn_name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"verifier {config.verifier!r} cannot be imported: {exc}") from exc
    return lambda answer, reference: float(fn(answer, reference))


def _exact(answer: str, reference: str) -> float:
    """1.0 when the two are the same text, less the whitespace around them; a boolean
    reference (``true``, as JSON writes one) takes its word in any case (``True``)."""
    answer, reference = answer.strip(), reference.strip()
    if reference in ("true", "false"):
        answer = answer.lower()
    return float(answer == reference)


def _regex_match(answer: str, reference: str, timeout: float) -> float:
    """1.0 when ``reference`` matches all of ``answer``; raises ``TimeoutError`` past ``timeout`` s.

    The ``regex`` module (``re``'s syntax, plus a time limit) lets go of the GIL while it matches.
    """
    try:
        return float(regex.fullmatch(reference, answer, timeout=timeout) is not None)
    except TimeoutError:
        raise TimeoutError(
            f"the regex verifier gave up after {timeout} s matching a {len(answer)}-character answer "
            f"against {reference!r:.80}"
        ) from None


_ROWS: dict[str, tuple[dict, ...]] = {}
"""Checked rows by config, read once per process. The key is the config's JSON, where
credentials are masked: configs that differ only in them read the same file."""


def _load_rows(config: DatasetConfig) -> tuple[dict, ...]:
    key = config.model_dump_json()
    if key not in _ROWS:
        _ROWS[key] = _read_rows(config)
    return _ROWS[key]


def _read_rows(config: DatasetConfig) -> tuple[dict, ...]:
    if not config.path:
        raise ValueError("dataset env needs config.path (a .parquet, .jsonl or .json file)")
    fs = None
    if "://" in config.path:
        # the file's URL as the root: a storage section for its endpoint and keys (or none, the
        # environment's) leaves the default root, a local folder, which would read it from disk
        fs = (config.storage or StorageConfig()).model_copy(update={"root": config.path}).filesystem()
    opener = fs.open if fs is not None else open
    if config.path.endswith(".parquet"):
        with opener(config.path, "rb") as handle:
            try:
                table = pq.read_table(handle)
            except pa.ArrowInvalid as exc:
                raise ValueError(f"{config.path} is not a Parquet file pyarrow can read: {exc}") from exc
        rows = _float32_as_written(table).to_pylist()
        places = [f"row {i}" for i in range(len(rows))]
    else:  # .jsonl or .json (the config checks the path's ending)
        with opener(config.path, "rb") as handle:
            rows, places = _json_rows(config.path, handle.read())
    if not rows:
        raise ValueError(f"{config.path} holds no rows")
    required = (config.prompt_field, config.answer_field, *([config.id_field] if config.id_field else []))
    asked: dict[str, tuple[str, str]] = {}  # prompt, as the split keys it -> its first answer, where
    named: dict[str, tuple[str, str]] = {}  # id -> its first prompt, as the split keys it, where
    conflicts: list[str] = []
    for place, row in zip(places, rows, strict=True):
        where = f"{place} of {config.path}"
        if not isinstance(row, dict):
            raise ValueError(f"{where} is not an object: {row!r:.80}")
        for field in required:
            if field not in row:
                raise ValueError(f"{where} has no field {field!r} (fields: {sorted(row)})")
            if row[field] is None:
                raise ValueError(f"{where} has a null {field!r}")
            if isinstance(row[field], float) and math.isnan(row[field]):  # numpy's missing value
                raise ValueError(f"{where} has a NaN {field!r} (a missing value?)")
            if isinstance(row[field], (list, dict)):  # str() would show the model a Python repr
                kind = type(row[field]).__name__
                raise ValueError(f"{where}: {field!r} holds a {kind}, not text or a number")
            try:
                if isinstance(row[field], bytes):  # a binary Parquet column: text without its UTF-8 tag
                    row[field] = row[field].decode()
                elif isinstance(row[field], str):  # JSON may escape half a surrogate pair ("\ud83d")
                    row[field].encode()
            except UnicodeError as exc:
                raise ValueError(f"{where}: {field!r} is not UTF-8 text: {exc}") from exc
            row[field] = _text(row[field])
        if not row[config.prompt_field].strip():
            raise ValueError(f"{where} has a blank {config.prompt_field!r} (the user message)")
        if config.id_field and not row[config.id_field].strip():
            raise ValueError(f"{where} has a blank {config.id_field!r} (the task's id)")
        if config.verifier in ("exact", "regex") and not row[config.answer_field].strip():
            # the model's answer is stripped: a blank one would be scored right
            raise ValueError(f"{where} has a blank {config.answer_field!r} (the reference)")
        if config.verifier == "regex":
            try:
                regex.compile(row[config.answer_field])
            except regex.error as exc:
                raise ValueError(f"{where}: reference is not a regex: {exc}") from exc
        if config.verifier == "numeric" and not _is_number(row[config.answer_field]):
            raise ValueError(f"{where}: reference is not a number: {row[config.answer_field]!r:.80}")
        prompt, answer = row[config.prompt_field].strip(), row[config.answer_field]
        if config.id_field:
            # one id over two prompts would be one task name in both splits
            named_prompt, named_place = named.setdefault(row[config.id_field], (prompt, place))
            if named_prompt != prompt:
                raise ValueError(
                    f"{where}: id {row[config.id_field]!r:.80} names the prompt {prompt!r:.80}, but "
                    f"{named_prompt!r:.80} at {named_place}: give each prompt an id of its own"
                )
        first, first_place = asked.setdefault(prompt, (answer, place))
        if not _same_reference(answer, first, config.verifier):
            # the same answer would score 1 on one task and 0 on its twin
            conflicts.append(
                f"{where}: prompt {prompt!r:.80} has the answer {answer!r:.80}, but {first!r:.80} at {first_place}"
            )
    if conflicts:
        more = f" (and {len(conflicts) - 1} more rows like it)" if len(conflicts) > 1 else ""
        raise ValueError(
            f"{conflicts[0]}{more}: give each prompt one reference (several right answers take a regex or "
            "a 'pkg.mod:fn' verifier)"
        )
    return tuple(rows)


def _float32_as_written(table: pa.Table) -> pa.Table:
    """``table`` with each float32 column widened through the shortest decimal of each value
    (``1.1``), not its binary value (``1.100000023841858``, far from a number written ``1.1``
    to the exact verifier, and from ``12345.6`` to the numeric one's tolerance)."""
    for index, field in enumerate(table.schema):
        if pa.types.is_float32(field.type):
            shortest = pc.cast(table.column(index), pa.string())
            table = table.set_column(index, field.name, pc.cast(shortest, pa.float64()))
    return table


def _same_reference(answer: str, other: str, verifier: str) -> bool:
    """Whether two references of one prompt score every answer alike (as far as we can tell:
    two patterns or two references to a Python function are alike when written alike)."""
    if verifier == "numeric":
        return _numeric(answer.strip(), other.strip(), 0.0) == 1.0
    return answer.strip() == other.strip()


def _text(value: object) -> str:
    """A field's value as the model and the verifiers see it: a boolean as JSON writes it
    (``true``, not Python's ``True``), and an integral float as the integer it is (``2``, not
    ``2.0``: pandas stores a column of integers with a gap as floats). Past 2**53 a float
    holds no one integer, and keeps its ``1e+16``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return str(value)


def _is_number(text: str) -> bool:
    """Whether the numeric verifier can ever match ``text`` (NaN equals nothing)."""
    try:
        return not math.isnan(float(_numeral(text)))
    except ValueError:
        return False


def _json_rows(path: str, data: bytes) -> tuple[list, list[str]]:
    """The rows of a JSON-lines file, or of a ``.json`` file holding one array of rows (a
    ``.json`` file in JSON lines, as ``datasets``' ``to_json`` writes, is read as such), and
    where each is: ``line N`` (from 1, as an editor counts them) or ``row i`` of the array."""
    try:
        text = data.decode("utf-8-sig")  # a byte-order mark (Notepad, PowerShell) is no part of row 1
    except UnicodeDecodeError as exc:
        line = exc.object.count(b"\n", 0, exc.start) + 1  # the object is the data less its mark
        raise ValueError(f"{path} line {line} is not UTF-8 text: {exc}") from exc
    if path.endswith(".json") and text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"{path}: not valid JSON: {exc}") from exc
        return rows, [f"row {i}" for i in range(len(rows))]
    rows, places = [], []
    # only "\n" ends a line: str.splitlines() also splits at U+2028 and the like, which JSON
    # strings may hold unescaped
    for number, line in enumerate(text.split("\n"), 1):
        line = line.removesuffix("\r")
        if line.strip():
            try:
                rows.append(json.loads(line))
            except ValueError as exc:
                _refuse_one_object(path, text)
                raise ValueError(f"{path} line {number}: {exc}") from exc
            places.append(f"line {number}")
    return rows, places


def _refuse_one_object(path: str, text: str) -> None:
    """Raise, saying so, where a ``.json`` file that does not read as JSON lines is one object
    over several lines (its rows under a key, as some Hugging Face files keep them): its first
    line alone is no JSON, and saying only that would call a valid file malformed."""
    if not path.endswith(".json"):
        return
    try:
        value = json.loads(text)
    except ValueError:
        return
    if isinstance(value, dict):
        raise ValueError(
            f"{path} holds one JSON object (keys: {sorted(value)!r:.200}), not an array of rows nor "
            "one row a line: write its rows as a JSON array or JSON lines"
        )


class DatasetEnv(Env):
    """One prompt, one answer, scored by the configured verifier."""

    name = "dataset"
    config_cls = DatasetConfig

    @classmethod
    def tasks(cls, split: Split, seed: int, n: int, config: DatasetConfig | None = None) -> list[Task]:
        cfg = config or DatasetConfig()
        make_verifier(cfg)  # a verifier that cannot be imported fails here, not in every reset
        tasks = []
        for row in _load_rows(cfg):
            prompt, answer = row[cfg.prompt_field], row[cfg.answer_field]
            row_id = row[cfg.id_field] if cfg.id_field else prompt
            if in_eval_split(prompt.strip(), cfg.eval_fraction) == (split == "eval"):
                data = {"answer": answer, "verifier": cfg.verifier}
                tasks.append(Task(env=cls.name, id=row_id, prompt=prompt, data=data))
        if not tasks:
            raise ValueError(
                f"none of the {len(_load_rows(cfg))} rows of {cfg.path} falls in the {split} split "
                f"(eval_fraction {cfg.eval_fraction}, by a hash of each prompt): add rows or change "
                "eval_fraction"
            )
        # in an order of their own, not the file's: a copy of the rows in another order draws the same
        tasks.sort(key=lambda task: (task.id, task.prompt, task.data["answer"]))
        rng = random.Random(f"{seed}/{split}")
        rng.shuffle(tasks)
        return [tasks[i % len(tasks)] for i in range(n)]

    @classmethod
    def demonstrate(cls, task: Task, flawed: bool = False, seed: int = 0) -> list[str]:
        """The reference answer (``flawed``: half the time an empty answer). A regex reference
        is a pattern, not an answer: there is none to give (``NotImplementedError``)."""
        if task.data.get("verifier") == "regex":
            raise NotImplementedError(
                "the dataset env has no scripted solver with verifier 'regex': its references are "
                "patterns, not answers"
            )
        if flawed and random.Random(f"{seed}/{task.id}").random() < 0.5:
            return [""]
        return [task.data["answer"]]

    async def reset(self, task: Task) -> list[dict[str, str]]:
        self._start(task)
        self.verify = make_verifier(self.config)
        self.score = 0.0
        return user(task.prompt)

    async def step(self, action: str) -> StepResult:
        task = self._next_turn()
        if self.config.verifier in ("exact", "numeric"):
            score = self.verify(action, task.data["answer"])
        else:
            score = await asyncio.to_thread(self.verify, action, task.data["answer"])
        self.score = clamp_score(score)
        return self._ended(StepResult([], self.score, True, self.score, {}))

    async def evaluate(self) -> float:
        self._require_task()
        return self.score
