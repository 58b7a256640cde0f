"""SQL over a run's Delta tables with duckdb (``treadle sql``).

duckdb's own extension download needs the internet, so the ``delta`` and ``httpfs``
extensions are loaded by file path from their PyPI wheels (``duckdb-extension-delta``,
``duckdb-extension-httpfs``). Every table of the run is a view of the same name (empty, with
the table's columns, until the run first writes it); a column added to a table's schema since
the run wrote the table reads as null, as ``Tables.read`` gives it, until its next append adds it.
Over those views, those of :data:`VIEWS` read what the trainer learned from.
"""

from __future__ import annotations

import glob
import json
import math
import os
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import numpy as np

from storage.config import S3_SCHEMES, RunStore
from storage.tables import STEP_ORDER, TABLE_SCHEMAS, Tables

WEIGHTS_ORDER = ", ".join(f"{column} NULLS LAST" for column in TABLE_SCHEMAS["weights"].names)
"""The order of ``weights`` rows whose first of each version the ``versions`` view keeps, as
:func:`storage.tables.one_row_per_version` does."""

VIEWS: dict[str, str] = {
    "kept_steps": f"""
        WITH logged AS (
            SELECT *, min(step) OVER (ORDER BY {", ".join(STEP_ORDER)}
                ROWS BETWEEN 1 FOLLOWING AND UNBOUNDED FOLLOWING) AS lowest_after
            FROM train_steps),
        reached AS (
            SELECT moment, published, max(step) OVER later AS step,
                last_value(version IGNORE NULLS) OVER later AS published_in
            FROM (SELECT created_at AS moment, step, version, true AS published FROM weights
                UNION ALL SELECT DISTINCT time, NULL, NULL, false FROM train_steps)
            WINDOW later AS (ORDER BY moment DESC, published DESC, version DESC ROWS UNBOUNDED PRECEDING))
        SELECT DISTINCT s.* EXCLUDE (lowest_after), r.published_in
        FROM logged s JOIN reached r ON r.moment = s.time AND NOT r.published
        WHERE (s.lowest_after IS NULL OR s.step < s.lowest_after) AND s.step <= r.step""",
    "trained": """
        SELECT s.step, s.version, s.published_in, t.*
        FROM (SELECT step, version, published_in, unnest(trajectory_ids) AS trajectory_id FROM kept_steps) s
        JOIN trajectories t ON t.trajectory_id = s.trajectory_id AND t.selected""",
    "versions": f"""
        WITH recorded AS (SELECT DISTINCT ON (version) * FROM weights ORDER BY {WEIGHTS_ORDER})
        SELECT *,
            EXISTS (SELECT 1 FROM recorded w WHERE w.parent < v.version AND w.version > v.version) AS passed_over
        FROM recorded v""",
}
"""Views over the tables' views, by name (with another Delta reader, run these queries over the
tables):

- ``kept_steps``: the ``train_steps`` rows of the policy steps that went into the weights, one
  per step, as :func:`storage.tables.one_row_per_step` reads them. A trainer restarted from
  ``LATEST`` logs the steps after that version again, and the steps its predecessor logged
  after that version went into no weights: a row stays when no row logged after it has a step
  at or below its own (``lowest_after``, over the rows in the order they count as logged in)
  and a version published at or after its time reached its step (``reached``, the newest step
  of the versions published from each time a step was logged on); a row that a retried append
  wrote twice is read once. Rows logged at one microsecond count as logged in the order of
  their step, then ``version``, then ``policy_loss`` (see :data:`storage.tables.STEP_ORDER`):
  of two rows of one step and microsecond, the one of the newer version, then of the higher
  policy loss, stays. Window functions, not a lookup per row, so that a run of 100,000 steps
  reads in well under a second. One column more than the table's: ``published_in``, the
  version that holds the step's update, the first published at or after its time (the lowest
  of those published at that microsecond): a trainer logs a step before it publishes it, and
  a step stays kept only when its trainer published it before another trainer logged again.
- ``trained``: one row per kept step and trajectory it trained on: the step's ``step``,
  ``version`` (the version it started from) and ``published_in`` (the first version that
  holds what it learned), and the trajectory's selected ``trajectories`` row.
- ``versions``: the ``weights`` rows, one per version, with ``passed_over``, true for a version
  that a later version's parent skips (a trainer resumed below it, its files did not verify,
  and trained its rows again), as :func:`flows.cli.passed_over` finds them. A row that a
  retried append wrote twice is read once; of two rows of one version that differ (recorded
  by writers that spelled the run's root differently, say), the least by the table's columns
  in turn (``step``, ``parent``, ``path``, …, nulls last) stays, as in ``treadle inspect``
  (:func:`storage.tables.one_row_per_version`).
"""


def extension_paths() -> list[str]:
    """Files of the httpfs and delta extensions shipped in their wheels."""
    import duckdb_extension_delta
    import duckdb_extension_httpfs

    paths = []
    for package in (duckdb_extension_httpfs, duckdb_extension_delta):
        found = glob.glob(
            os.path.join(os.path.dirname(package.__file__), "extensions", "*", "*.duckdb_extension")
        )
        if not found:
            raise RuntimeError(f"no duckdb extension file inside {package.__name__}")
        paths.append(found[0])
    return paths


def connect(store: RunStore):
    """A duckdb connection with one view per table of the run, and those of :data:`VIEWS`."""
    import duckdb

    # a persistent secret of the user's (~/.duckdb/stored_secrets) scoped to the run's bucket
    # would win over the run's own, sending the queries to its endpoint with its credentials;
    # a name that is no table would be looked up among the variables of the querying code
    connection = duckdb.connect(
        config={"allow_persistent_secrets": False, "python_enable_replacements": False}
    )
    # duckdb's session time zone is the machine's: timestamps came back in it, and a cast to
    # DATE or strftime read the local day and hour, where treadle inspect reads UTC (the
    # setting needs the icu extension, loaded only once the connection is open)
    connection.execute("SET TimeZone = 'UTC'")
    for path in extension_paths():
        connection.execute(f"LOAD {_literal(path)}")
    config = store.config
    if config.is_s3:
        options = config.delta_options()
        credentials = (
            options.get("AWS_ACCESS_KEY_ID", ""),
            options.get("AWS_SECRET_ACCESS_KEY", ""),
            options.get("AWS_SESSION_TOKEN", ""),
        )
        if not credentials[0]:
            credentials = role_credentials()
        url = config.endpoint() or ""
        endpoint = url.removeprefix("http://").removeprefix("https://")
        connection.execute(
            "CREATE SECRET (TYPE s3, KEY_ID ?, SECRET ?, SESSION_TOKEN ?, REGION ?, ENDPOINT ?, "
            "URL_STYLE 'path', USE_SSL ?)",
            [
                *credentials,
                options["AWS_REGION"],
                endpoint or aws_endpoint(options["AWS_REGION"]),
                not url.startswith("http://"),
            ],
        )
    tables = Tables(store)
    for name, schema in TABLE_SCHEMAS.items():
        present = tables.columns(name)
        if present is None:  # not written yet (a new run): empty, so queries over it answer rather than fail
            connection.register(name, schema.empty_table())
            continue
        canonical = connection.from_arrow(schema.empty_table())
        added = "".join(
            f", CAST(NULL AS {kind}) AS {_identifier(column)}"
            for column, kind in zip(canonical.columns, canonical.types, strict=True)
            if column not in present
        )
        scan = f"delta_scan({_literal(_delta_scan_url(tables.uri(name)))})"
        connection.execute(f"CREATE VIEW {name} AS SELECT *{added} FROM {scan}")
    for name, query in VIEWS.items():
        connection.execute(f"CREATE VIEW {name} AS {query}")
    return connection


NESTED = ("list", "array", "struct", "map")
"""duckdb's kinds of type whose values ``treadle sql`` prints as JSON."""


def field_text(value, kind) -> str:
    """``value`` of duckdb type ``kind`` as ``treadle sql`` prints it: null as nothing; a
    timestamp with a time zone in UTC (:func:`utc_text`); a boolean as ``true`` or ``false``,
    as duckdb and JSON spell it (Python's ``True`` differed from the same value inside a list);
    a list, struct or map as JSON, that another tool reads as it is (Python's repr quoted
    strings with ``'`` and wrote ``None``); a FLOAT with the digits it holds (duckdb hands one over widened to a double: 0.43 as
    0.4300000071525574); NaN and the infinities as inside JSON (``NaN``, ``Infinity``,
    ``-Infinity``, which ``float`` and duckdb's casts read too), not Python's ``nan``; a
    negative interval with a minus sign; a BLOB as duckdb's cast to text writes it, not as
    Python's ``b'...'``."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return json.dumps(value)
    if isinstance(value, list | tuple | dict):
        return json.dumps(_jsonable(value, kind), ensure_ascii=False)
    if isinstance(value, datetime) and value.tzinfo is not None:
        return utc_text(value)
    if isinstance(value, float) and not math.isfinite(value):
        return json.dumps(value)
    if isinstance(value, float) and kind is not None and kind.id == "float":
        return str(np.float32(value))
    if isinstance(value, timedelta) and value < timedelta(0):
        return f"-{-value}"  # Python writes 35 s back as "-1 day, 23:59:25"
    if isinstance(value, bytes):
        return "".join(chr(byte) if byte in BLOB_PLAIN else f"\\x{byte:02X}" for byte in value)
    return str(value)


BLOB_PLAIN = frozenset(range(0x20, 0x7F)) - {ord('"'), ord("'"), ord("\\")}
"""The bytes a BLOB's text holds as they are, as duckdb's cast to VARCHAR writes it (any other
byte as ``\\xHH``)."""


def utc_text(moment: datetime) -> str:
    """``moment`` in UTC as ``treadle inspect`` prints it (``2026-01-01 00:00:00 UTC``), with
    its microseconds when it has any."""
    moment = moment.astimezone(UTC)
    fraction = f".{moment.microsecond:06d}" if moment.microsecond else ""
    return f"{moment:%Y-%m-%d %H:%M:%S}{fraction} UTC"


def _jsonable(value, kind):
    """``value`` of duckdb type ``kind`` as :func:`field_text` has ``json.dumps`` write it.
    A value of a UNION is handed over without saying its member: a FLOAT there keeps its
    widened digits. A DECIMAL is a JSON number, as duckdb's ``to_json`` writes it, through a
    double (rounded past 17 significant digits); a value JSON has no type for (a date, an
    interval, a UUID) is its text."""
    kind_id = kind.id if kind is not None else None
    children = [child for _, child in kind.children] if kind_id in NESTED else []
    if isinstance(value, list | tuple):  # a LIST, an ARRAY (of a fixed size) or an unnamed STRUCT
        kinds = children if kind_id == "struct" else [children[0] if children else None] * len(value)
        return [_jsonable(item, item_kind) for item, item_kind in zip(value, kinds, strict=True)]
    if isinstance(value, dict):
        if kind_id == "struct":
            return {name: _jsonable(value[name], child) for name, child in kind.children}
        key_kind, value_kind = children if kind_id == "map" else (None, None)
        # duckdb hands a map whose keys Python cannot hash (lists, structs) over as its
        # lists of keys and of values
        unhashable = key_kind is not None and key_kind.id in NESTED
        pairs = zip(value["key"], value["value"], strict=True) if unhashable else value.items()
        return {field_text(key, key_kind): _jsonable(item, value_kind) for key, item in pairs}
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return float(str(np.float32(value))) if kind_id == "float" else value
    if isinstance(value, Decimal):
        return float(value)
    return field_text(value, kind)


ROLE_PROVIDERS = ("assume-role-with-web-identity", "container-role", "iam-role")
"""botocore's credential providers of a machine's role, those deltalake falls back on when the
run's config and the environment give no key: a pod's web identity, a container's (ECS, EKS)
or the instance's role."""


def role_credentials() -> tuple[str, str, str]:
    """Key id, secret and session token of the machine's role, or empty ones when it has none.
    duckdb signs nothing with an S3 secret whose key is empty: given one, a run that deltalake
    reads with the role's credentials refused the views' requests. Raises ``OSError`` when the
    role's credentials endpoint fails or is not one botocore asks, or ``AWS_PROFILE`` names a
    profile the AWS config lacks."""
    import botocore.credentials
    import botocore.exceptions
    import botocore.session

    try:
        resolver = botocore.credentials.create_credential_resolver(botocore.session.get_session())
        found = botocore.credentials.CredentialResolver(
            [provider for provider in resolver.providers if provider.METHOD in ROLE_PROVIDERS]
        ).load_credentials()
    # ValueError: an AWS_CONTAINER_CREDENTIALS_FULL_URI botocore refuses to ask
    except (botocore.exceptions.BotoCoreError, ValueError) as exc:
        raise OSError(f"cannot get the credentials of the machine's role: {exc}") from None
    if found is None:
        return "", "", ""
    frozen = found.get_frozen_credentials()
    return frozen.access_key, frozen.secret_key, frozen.token or ""


def aws_endpoint(region: str) -> str:
    """AWS's S3 endpoint of ``region``: the views' requests are path-style, which AWS serves
    only at the bucket's own region's endpoint (``s3.amazonaws.com`` answers a bucket of
    another region with a redirect, which duckdb does not follow)."""
    domain = "amazonaws.com.cn" if region.startswith("cn-") else "amazonaws.com"
    return f"s3.{region}.{domain}"


def _delta_scan_url(url: str) -> str:
    """``url`` as the delta extension reads it: it hands the S3 secret only to ``s3://``
    paths, so a table under an ``s3a://`` root is named by the same object's ``s3://`` URL."""
    scheme, sep, rest = url.partition("://")
    return f"s3://{rest}" if sep and scheme in S3_SCHEMES else url


def _identifier(name: str) -> str:
    """``name`` as a quoted SQL identifier."""
    return '"' + name.replace('"', '""') + '"'


def _literal(text: str) -> str:
    """``text`` as a SQL string literal (a path may hold a quote)."""
    return "'" + text.replace("'", "''") + "'"
