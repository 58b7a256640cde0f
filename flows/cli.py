"""The ``treadle`` command: ``run``, ``inspect``, ``sql`` and ``ui``."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import fcntl
import http.client
import importlib
import os
import pathlib
import posixpath
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from typing import NoReturn

FLOWS = ("pipeline", "rollout", "process", "train", "evaluate", "maintain")
TABLES = ("shards", "trajectories", "train_steps", "weights", "evals")
"""The tables of a run, named in ``treadle sql --help``: those of ``storage.tables.TABLE_SCHEMAS``,
spelled out because importing it (pyarrow, deltalake) would slow every command's start."""
VIEWS = ("kept_steps", "trained", "versions")
"""The views over them, named in ``treadle sql --help``: those of ``flows.sql.VIEWS``."""
INSPECT_VERSIONS = 12
"""About how many versions ``treadle inspect`` lists (evenly spaced, first and last always)."""


def _store(args):
    """The run that ``inspect``/``sql`` look at: the ``storage`` section and ``run_id`` of
    ``--config`` (if given), overridden by ``--root``, ``--endpoint-url``, ``--region`` and
    ``--run-id``. Credentials come from the config file or the environment only."""
    from pydantic import ValidationError

    from storage.config import RunStore, StorageConfig, run_id_problem

    storage: dict = {}
    run_id = args.run_id
    if args.config:
        # the run config imports every package's config models (a second or two): only --config pays
        from flows.config import ConfigError, load_config

        try:
            config = load_config(args.config)
        except ConfigError as exc:
            _bad_input(str(exc))
        storage = dict(config.storage)
        run_id = config.run_id if run_id is None else run_id
    if problem := run_id_problem(run_id):  # the flows refuse it: no run can have it
        _bad_input(f"--run-id: {problem}")
    flags = {"root": args.root, "endpoint_url": args.endpoint_url, "region": args.region}
    try:
        return RunStore(StorageConfig(**storage | {k: v for k, v in flags.items() if v is not None}), run_id)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc']))}: {e['msg'].removeprefix('Value error, ')}" for e in exc.errors()
        )
        _bad_input(f"invalid storage: {problems}")
    except ValueError as exc:  # a root and run id deltalake cannot take
        _bad_input(str(exc))


def _bad_input(message: str) -> NoReturn:
    """Exit with status 2, as argparse does for a bad argument, after one ``error:`` line."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def spaced(values: list, limit: int = INSPECT_VERSIONS) -> set:
    """At most about ``limit`` evenly spaced items of ``values``, the first and last always."""
    return set(values[:: max(1, len(values) // limit)] + values[-1:])


def inspect_run(store) -> str:
    """A run's versions, held-out reward per version, reward of the generated data per
    version, shard counts, and the policy steps that went into the weights with the
    trajectories they trained on, from its Delta tables. Long version lists are thinned to
    evenly spaced versions (``treadle sql`` shows every row)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from storage.tables import STEP_ORDER, Tables, one_row_per_step, one_row_per_version
    from storage.weights import WeightStore

    tables = Tables(store)
    lines = [f"run {store.uri}"]
    weights_table = one_row_per_version(tables.read("weights"))
    weights = weights_table.to_pylist()
    kept = set(WeightStore(store).list())
    skipped = passed_over(weights)
    shown = spaced([row["version"] for row in weights])
    # tagged and passed-over versions are listed too, where thinning leaves them out
    listed = [row for row in weights if row["version"] in shown or row["tag"] or row["version"] in skipped]
    lines.append(f"\nweight versions: {len(weights)} published, {len(kept)} kept (showing {len(listed)})")
    for row in listed:
        tag = f" [{row['tag']}]" if row["tag"] else ""
        marks = ["passed over"] if row["version"] in skipped else []
        marks += ["pruned"] if row["version"] not in kept else []
        marked = f" ({', '.join(marks)})" if marks else ""
        lines.append(
            f"  v{row['version']:<4} step {row['step']:<6} {row['created_at']:%Y-%m-%d %H:%M:%S} UTC{tag}{marked}"
        )
    evals = tables.read("evals").sort_by(
        [("version", "ascending"), ("env", "ascending"), ("time", "ascending")]
    )
    lines.append("\nheld-out reward per version:")
    # the latest evaluation of each setup; setups differ where the eval settings, the env's
    # config or its reward model changed between evaluations of one version: named then
    latest = {(r["version"], r["env"], r["setup"]): r for r in evals.to_pylist()}
    setups = Counter((version, env) for version, env, _ in latest)
    for (version, env, setup), r in latest.items():
        named = f", setup {setup[:8] if setup else 'unrecorded'}" if setups[version, env] > 1 else ""
        lines.append(f"  v{version:<4} {env:<8} {r['reward']:.3f}  ({_measured(r)}{named})")
    if not latest:
        lines.append("  no evaluations")
    # not the decoded text, which holds most of the table's bytes
    trajectories = tables.read(
        "trajectories", columns=["execution_id", "max_version", "task", "reward", "trajectory_id"]
    )
    lines.append("\nreward of generated trajectories by the newest version that generated them:")
    # an execution counts once: a compacted rollout's contexts are rows that share its reward
    executions = (
        trajectories.group_by(["execution_id", "task"])
        .aggregate([("reward", "mean"), ("max_version", "max"), ("trajectory_id", "count")])
        .rename_columns(
            {"reward_mean": "reward", "max_version_max": "version", "trajectory_id_count": "rows"}
        )
    )
    grouped = (
        executions.group_by(["version", "task"])
        .aggregate([("reward", "mean"), ("execution_id", "count"), ("rows", "sum")])
        .rename_columns({"reward_mean": "reward", "execution_id_count": "executions", "rows_sum": "rows"})
    )
    rows = sorted(grouped.to_pylist(), key=lambda r: (r["version"], r["task"]))
    # max_version -1: rollouts that failed before any token, which no version generated
    shown = spaced(sorted({r["version"] for r in rows if r["version"] >= 0}))
    for r in rows:
        if r["version"] < 0 or r["version"] in shown:
            counted = f"{r['rows']} trajectories"
            if r["rows"] != r["executions"]:
                counted = f"{r['executions']} executions, {counted}"
            # a group of env/infra errors only has no reward at all
            mean = "—" if r["reward"] is None else f"{r['reward']:.3f}"
            named = f"v{r['version']}" if r["version"] >= 0 else "none"
            lines.append(f"  {named:<5} {r['task']:<8} {mean:>5}  ({counted})")
    if not rows:
        lines.append("  no trajectories")
    shards = tables.read("shards", columns=["kind", "num_rows", "path"])
    bad = pc.is_in(shards.column("path"), pa.array(quarantined_shards(store), pa.string()))
    lines.append("\nshards:")
    for kind in ("raw", "processed"):
        of_kind = pc.equal(shards.column("kind"), kind)
        rows = shards.filter(of_kind)
        total = pc.sum(rows.column("num_rows")).as_py() or 0
        line = f"  {kind:<10} {rows.num_rows} shards, {total} trajectories"
        if (held := shards.filter(pc.and_(of_kind, bad))).num_rows:
            lost = pc.sum(held.column("num_rows")).as_py()
            line += (
                f"; {held.num_rows} quarantined ({lost} trajectories: shards/quarantine/{kind}/, "
                "a .reason file beside each says why)"
            )
        for what, why in SET_ASIDE.items():
            files, records, unreadable = set_aside_records(store, kind, what)
            if files:
                unread = f", {unreadable} of them unreadable" if unreadable else ""
                line += (
                    f"; {records} {why} ({files} files{unread}: shards/quarantine/{kind}/"
                    f"<worker>/{what}-*.arrow, a .reason file beside each says why)"
                )
        lines.append(line)
    steps = one_row_per_step(tables.read("train_steps", columns=[*STEP_ORDER, "num_samples"]), weights_table)
    trained = pc.sum(steps.column("num_samples")).as_py() or 0
    lines.append(f"\npolicy steps: {steps.num_rows}, on {trained} trajectories")
    # a passed-over version's are its resumed trainer's to drop again
    published = [row for row in weights if row["version"] not in skipped]
    stale = sum(row["dropped_stale"] or 0 for row in published)
    rejected = sum(row["rejected_rows"] or 0 for row in published)
    if stale or rejected:
        lines[-1] += (
            f"; {stale} dropped as stale, {rejected} rejected (by the versions published: "
            "weights.dropped_stale, weights.rejected_rows)"
        )
    return "\n".join(lines)


def passed_over(weights: list[dict]) -> set[int]:
    """The versions of ``weights`` rows a later version's parent skips: a trainer resumed below
    each (its files did not verify) and trained its rows again."""
    skips = [
        (row["parent"], row["version"])
        for row in weights
        if row["parent"] is not None and row["version"] - row["parent"] > 1
    ]
    return {row["version"] for row in weights if any(p < row["version"] < v for p, v in skips)}


def quarantined_shards(store) -> list[str]:
    """Run-relative paths of the committed shards a reader moved to quarantine (see
    :meth:`storage.shards.ShardReader.read`), as the ``shards`` table names them."""
    root = store.path("shards", "quarantine")
    return [
        posixpath.join("shards", posixpath.relpath(path, root))
        for path in store.fs.find(root)
        if path.endswith(".arrow")
    ]


SET_ASIDE = {
    "refused": "refused by their writers",
    "uncommitted": "never committed by a worker whose name another process took",
}
"""The records shard writers keep under the quarantine, by their files' prefix: those that
failed validation (:meth:`storage.shards.ShardWriter._admitted`) and those of an abandoned
writer (:meth:`storage.shards.ShardWriter.abandon`)."""


def set_aside_records(store, kind: str, what: str) -> tuple[int, int, int]:
    """Files, rows and files that do not read as Arrow of the ``kind`` records shard writers
    kept under the quarantine in ``<what>-*.arrow`` files (see :data:`SET_ASIDE`). Rows are
    counted from the files' batch headers."""
    import pyarrow as pa

    files = store.fs.glob(store.path("shards", "quarantine", kind, "*", f"{what}-*.arrow"))
    rows = unreadable = 0
    for path in files:
        with store.fs.open(path, "rb") as source:
            try:
                rows += pa.ipc.open_file(source).count_rows()
            except pa.ArrowInvalid:
                unreadable += 1
    return len(files), rows, unreadable


def _measured(row: dict) -> str:
    """How many of an evaluation's tasks an ``evals`` row measured (``tasks`` is null in rows
    written before it, when every task counted)."""
    if row["tasks"] is None or row["tasks"] == row["count"]:
        return f"{row['count']} tasks"
    return f"{row['count']} of {row['tasks']} tasks measured"


def _run(args) -> None:
    module = importlib.import_module(f"flows.{args.flow}")
    # the flow parses sys.argv: its usage and errors then name `treadle run <flow>`
    sys.argv = [f"treadle run {args.flow}", *args.rest]
    module.main()


def exit_on_prefect_api_error(exc: Exception) -> None:
    """Ends the process with one line when ``exc`` says a flow command's Prefect API is not
    there (no server at PREFECT_API_URL) or went away (the flow engine's own request, once its
    client gave up); returns for any other error."""
    import httpx
    from prefect.settings import PREFECT_API_URL

    from flows.run_body import prefect_api_request

    url = without_credentials(PREFECT_API_URL.value() or "")
    if isinstance(exc, RuntimeError) and _unreachable_api(exc):
        raise SystemExit(
            f"error: no Prefect API at {url} (unset PREFECT_API_URL or start one with treadle ui)"
        ) from None
    # a server gone mid-run failed the command at the flow run's end, after the work, with a
    # page of tracebacks
    if isinstance(exc, httpx.TransportError) and prefect_api_request(exc):
        print(
            f"error: lost the Prefect API at {url} ({type(exc).__name__}: {exc}): the flow run's "
            "state there is not its last; what the run wrote is in its storage",
            file=sys.stderr,
        )
        sys.stdout.flush()
        sys.stderr.flush()
        # not SystemExit: at the interpreter's exit Prefect's workers try each event and log
        # record they hold against the lost API (about 7 s an event), and the hundreds a run
        # holds kept the command from exiting for many minutes after that line
        os._exit(1)


def _unreachable_api(exc: RuntimeError) -> bool:
    """Whether ``exc`` is Prefect's "Failed to reach API" (no server at PREFECT_API_URL)."""
    import httpx

    return str(exc).startswith("Failed to reach API") and isinstance(exc.__cause__, httpx.TransportError)


def without_credentials(url: str) -> str:
    """``url`` without a ``user:password@`` part."""
    parts = urllib.parse.urlsplit(url)
    return parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl()


def existing_run(store, hint: str = "--root and --run-id", unreadable_logs: bool = False):
    """``store``, after checking that the run has a table; exits with an error naming
    ``hint`` when it has none (a wrong root or id would otherwise look like an empty run).
    ``unreadable_logs``: a table whose Delta log does not parse counts as one the run has,
    for a command that reports it itself after its other steps (maintain); else it is the error."""
    from deltalake.exceptions import DeltaError

    from storage.tables import TABLE_SCHEMAS, Tables

    def present(name: str) -> bool:
        try:
            return tables.version(name) is not None
        except DeltaError:
            if not unreadable_logs:
                raise
            return True

    try:
        tables = Tables(store)
        empty = not any(present(name) for name in TABLE_SCHEMAS)
    # ValueError: an endpoint the environment names that is no URL (StorageConfig.endpoint)
    except (OSError, DeltaError, ValueError) as exc:
        raise SystemExit(f"error: cannot read the run at {store.uri}: {one_line(exc)}") from None
    if empty:
        raise SystemExit(f"error: no run at {store.uri}: it has no tables (check {hint})")
    return store


def weight_versions(store) -> list[int]:
    """The run's published weight versions (the first thing a warm start reads); exits with
    one line naming where it looked when the storage does not answer. A wrong endpoint or
    refused credentials otherwise failed the flow run after its task's retries, with a page
    of tracebacks. An absent bucket, which lists as a run with no versions (and so failed
    the warm start's publish, after its training), is named."""
    from storage.weights import WeightStore

    try:
        versions = WeightStore(store).list()
        if not versions and store.config.is_s3:
            bucket = store.path().split("/", 1)[0]
            try:
                store.fs.call_s3("head_bucket", Bucket=bucket)
            except FileNotFoundError:  # its 404
                raise SystemExit(
                    f"error: bucket {bucket!r} of {store.uri} does not exist at "
                    f"{store.config.endpoint() or 'AWS'} (create it, or check storage.root)"
                ) from None
            except PermissionError:  # s3:ListBucket granted under a prefix only: the listing read
                pass
        return versions
    except Exception as exc:  # an endpoint s3fs cannot reach raises botocore's errors, not OSError
        refused = (
            " (the server refused the credentials, or what they may do: check storage.access_key_id "
            "and storage.secret_access_key, or AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY)"
            if isinstance(exc, PermissionError) and store.config.is_s3
            else ""
        )
        raise SystemExit(
            f"error: cannot read the weight versions in {store.url('weights')}: "
            + store.config.redacted(one_line(exc))
            + refused
        ) from None


def one_line(exc: BaseException) -> str:
    """A storage error's message on one line: Delta's are a colored multi-line chain of
    causes, some followed by a native backtrace (numbered frames), left out."""
    text = re.split(r"\n\s*0: ", re.sub(r"\x1b\[[0-9;]*m", "", str(exc)))[0]
    return " ".join(line.strip(" ↳") for line in text.splitlines() if line.strip(" ↳"))


def _inspect(args) -> None:
    from deltalake.exceptions import DeltaError

    store = existing_run(_store(args))
    try:
        report = inspect_run(store)
    except (OSError, DeltaError) as exc:  # a table whose data files the store cannot serve
        raise SystemExit(f"error: cannot read the run at {store.uri}: {one_line(exc)}") from None
    print(report)


def _sql(args) -> None:
    try:
        import duckdb
        import duckdb_extension_delta  # noqa: F401 (loaded by file path in flows.sql.connect)
        import duckdb_extension_httpfs  # noqa: F401
    except ImportError as exc:
        raise SystemExit(
            f"error: treadle sql needs duckdb and its delta and httpfs extensions ({exc.name} is not "
            "installed): pip install 'treadle[sql]'"
        ) from None
    from flows.sql import connect, field_text

    store = existing_run(_store(args))
    with _query_errors(store, duckdb.Error):
        connection = connect(store)
        statements = len(connection.extract_statements(args.query))
        if not statements:  # only whitespace or comments
            raise SystemExit("error: no SQL statement")
        if statements > 1:  # duckdb would print the last one's rows alone
            raise SystemExit(f"error: {statements} SQL statements: treadle sql runs one at a time")
        result = connection.execute(args.query)
        if result.description is None:  # a statement without a result set
            return
        # a batch at a time: the whole result, fetched at once, was held in memory (a run's
        # trajectory text) before the first row showed, even to a reader that wanted ten (`| head`)
        rows = result.fetchmany(SQL_BATCH_ROWS)
    print("\t".join(_tsv_field(d[0]) for d in result.description))
    kinds = [d[1] for d in result.description]
    while rows:
        for row in rows:
            print("\t".join(_tsv_field(field_text(v, kind)) for v, kind in zip(row, kinds, strict=True)))
        with _query_errors(store, duckdb.Error):
            rows = result.fetchmany(SQL_BATCH_ROWS)


SQL_BATCH_ROWS = 10_000
"""Rows ``treadle sql`` fetches from duckdb at a time."""
STREAM_FAILED = "Attempting to execute an unsuccessful or closed pending query result\nError: "
"""What duckdb puts before the error of a query that failed after its first rows were fetched."""


@contextlib.contextmanager
def _query_errors(store, duckdb_error: type[Exception]) -> Iterator[None]:
    """A query's errors on ``store`` as one line each (``SystemExit``), and duckdb's answer to
    Ctrl-C as the ``KeyboardInterrupt`` it is."""
    from deltalake.exceptions import DeltaError

    try:
        yield
    except RuntimeError as exc:
        if isinstance(exc.__cause__, KeyboardInterrupt):  # duckdb's "Query interrupted" on Ctrl-C
            raise KeyboardInterrupt from None
        raise
    except duckdb_error as exc:
        # an error raised while a later batch is fetched comes after a line of duckdb's own
        message = str(exc).rpartition(STREAM_FAILED)[2]
        # duckdb's delta extension quotes a refused request's body, in which AWS echoes the
        # key id and the session token (what Tables masks in deltalake's errors)
        raise SystemExit(f"error: {store.config.redacted(_run_tables_guessed(message))}") from None
    except (OSError, DeltaError) as exc:  # the store refused the views' look at a table (masked)
        raise SystemExit(f"error: cannot read the run at {store.uri}: {one_line(exc)}") from None


def _run_tables_guessed(message: str) -> str:
    """duckdb's ``message``, where it is for a table it lacks and its guess of the name meant
    is no table or view of the run (one of duckdb's own: ``steps`` got "Did you mean
    "sqlite_temp_schema"?"), with the run's tables and views in place of the guess."""
    guess = re.search(r'\nDid you mean "([^"]*)"\?', message)
    if (
        not message.startswith("Catalog Error: Table with name ")
        or guess is None
        or guess[1] in TABLES + VIEWS
    ):
        return message
    listed = f"\nThe run's tables: {', '.join(TABLES)}; views: {', '.join(VIEWS)}"
    return message.replace(guess[0], listed, 1)


def _tsv_field(text: str) -> str:
    """``text`` as one tab-separated field: quoted as CSV quotes it when it holds a tab, a
    line break or a quote (trajectory text does). The csv module leaves a bare carriage
    return unquoted, and readers then split the row there."""
    if any(c in text for c in '\t\n\r"'):
        return '"' + text.replace('"', '""') + '"'
    return text


def prefect_server(host: str, port: int, *options: str) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of ``prefect server start`` on ``host:port`` with
    ``options``: ``treadle ui``'s server and a flow command's temporary one."""
    prefect = shutil.which("prefect", path=os.path.dirname(sys.executable)) or "prefect"
    command = [prefect, "server", "start", "--host", host, "--port", str(port), *options]
    # as the flows' own servers (flows.cli_args.parse): an offline machine's server logged an
    # ERROR at every start, its telemetry unable to reach its host
    return command, {"PREFECT_SERVER_ANALYTICS_ENABLED": "false"} | os.environ


def temporary_api() -> None:
    """Start a Prefect server of this process's own on 127.0.0.1 and point the Prefect API at
    it for the rest of the process (stopped at exit), when no API is set (environment or
    profile; an empty value sets none, as Prefect takes it): what a flow command does just
    before its flow run, after the checks that would fail it (the server takes seconds to
    start). Prefect's ephemeral mode starts its server in the command's process group: Ctrl-C
    stopped that server too, and the flow engine then tried for a minute or more to report the
    flow run Crashed to it, and ended with a ConnectError traceback. This server has a session of its own, out of reach of the terminal's signals."""
    from prefect.context import refresh_global_settings_context
    from prefect.settings import (
        PREFECT_API_URL,
        PREFECT_HOME,
        PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS,
    )

    if PREFECT_API_URL.value():
        return
    timeout = PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value()
    taken = []
    with _starting_alone(PREFECT_HOME.value()):
        # a port free when picked is bound by the server seconds later: another program may
        # take it meanwhile (it then answers at the server's URL), which loses this start only
        for _ in range(SERVER_START_TRIES):
            if taken:
                print(
                    f"the temporary Prefect server's port {taken[-1]} was taken: starting it on another",
                    file=sys.stderr,
                )
            port = unused_port()
            server = _start_server(port)
            if _answers(server, port, timeout):
                break
            if _bindable(port):
                raise SystemExit(
                    f"error: the temporary Prefect server exited with status {server.returncode}"
                )
            taken.append(str(port))
        else:
            raise SystemExit(
                "error: the temporary Prefect server could not start: another program took each port it "
                f"was given ({', '.join(taken)}) before it listened (set PREFECT_API_URL to a running "
                "server's API)"
            )
    os.environ["PREFECT_API_URL"] = f"http://127.0.0.1:{port}/api"
    refresh_global_settings_context()


SERVER_START_TRIES = 3
"""How many ports a flow command's temporary Prefect server is started on before the command
gives up, each taken by another program before the server listened."""


def unused_port() -> int:
    """A TCP port on 127.0.0.1 that no socket holds now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start_server(port: int) -> _TemporaryServer:
    """A flow command's temporary Prefect server on 127.0.0.1:``port``, stopped at exit."""
    # with its UI, which the flow run's "View at" link names; without the scheduler, as in
    # Prefect's ephemeral mode: it would add runs of the local database's deployments
    command, env = prefect_server("127.0.0.1", port, "--no-scheduler")
    try:
        server = _TemporaryServer(
            command,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=_stopped_with(os.getpid()),
        )
    except OSError as exc:  # no `prefect` beside this Python or on PATH
        raise SystemExit(
            f"error: cannot start a temporary Prefect server: {command[0]}: {exc.strerror} "
            "(set PREFECT_API_URL to a running server's API)"
        ) from None
    # before Prefect's own exit handlers, which run first and send their last logs and events
    atexit.register(_stop_server, server)
    return server


RELAY_DRAIN_S = 2.0
"""How long an exited server's stderr is relayed on at the command's exit (a process it started
may hold the pipe open)."""


class _TemporaryServer(subprocess.Popen):
    """A flow command's Prefect server, what it writes to stderr copied onto the command's
    until the command stops it (:func:`_stop_server`): stopped while a request's database
    connection was being given back, a server logs that cancellation's traceback
    (sqlalchemy's "Exception during reset"), after the command's work is done."""

    def __init__(self, command: list[str], **options) -> None:
        super().__init__(command, stderr=subprocess.PIPE, text=True, errors="replace", **options)
        self.stopping = threading.Event()
        self.relay = threading.Thread(target=self._relay, name="prefect-server-stderr", daemon=True)
        self.relay.start()

    def _relay(self) -> None:
        for line in self.stderr:  # read to the end, so that the server never blocks on a full pipe
            if not self.stopping.is_set():
                sys.stderr.write(line)
                sys.stderr.flush()


def _answers(server: subprocess.Popen, port: int, timeout: float) -> bool:
    """Whether ``server``, started on ``port``, answers there within ``timeout`` s (False: it
    exited first)."""
    url = f"http://127.0.0.1:{port}/api"
    deadline = time.monotonic() + timeout
    # the health check alone would take the answer of another program holding the port
    while not (_healthy(url) and _listening(server, port)):
        if server.poll() is not None:
            return False
        if time.monotonic() > deadline:
            raise SystemExit(
                f"error: the temporary Prefect server did not answer at {url} within {timeout} s"
            )
        time.sleep(0.1)
    return True


def _listening(server: subprocess.Popen, port: int) -> bool:
    """Whether ``server`` or a process it started (its process group, as ``_stop_server``
    stops) holds a socket listening on IPv4 ``port``, where Linux's /proc says (True elsewhere)."""
    try:
        with open("/proc/net/tcp") as table:
            rows = [line.split() for line in table.readlines()[1:]]
    except OSError:
        return True
    # local address as hex ip:port, state 0A (LISTEN), inode
    listening = {f"socket:[{row[9]}]" for row in rows if row[1].endswith(f":{port:04X}") and row[3] == "0A"}
    for pid in _group(server.pid):
        with contextlib.suppress(OSError):  # ended meanwhile
            for descriptor in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):  # closed meanwhile
                    if os.readlink(f"/proc/{pid}/fd/{descriptor}") in listening:
                        return True
    return False


def _group(leader: int) -> list[int]:
    """The live processes of ``leader``'s process group, by /proc."""
    members = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError), open(f"/proc/{entry}/stat") as stat:
            # the fields after the name: state, ppid, pgrp
            if int(stat.read().rpartition(")")[2].split()[2]) == leader:
                members.append(int(entry))
    return members


def _bindable(port: int) -> bool:
    """Whether a server could bind 127.0.0.1:``port`` now (as Prefect's binds it)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


PR_SET_PDEATHSIG = 1
"""prctl's option for the signal a process gets when its parent dies (linux/prctl.h)."""


def _stopped_with(parent: int) -> Callable[[], None] | None:
    """What a child of ``parent`` runs before its command so that it gets SIGTERM when
    ``parent`` dies, however it dies (SIGKILL, the OOM killer), where Linux offers it (None
    elsewhere). Linux sends it when the thread that started the child ends: start it from the
    main thread. Resolved here: the child, forked from a process with threads, only calls it."""
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except AttributeError:
        return None

    def stop_with_parent() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # it died before that: no signal will come
            os.kill(os.getpid(), signal.SIGTERM)

    return stop_with_parent


@contextlib.contextmanager
def _starting_alone(home: pathlib.Path) -> Iterator[None]:
    """Hold off the other commands' server starts on ``home`` (its Prefect database): each
    server migrates the database at its start, and one that raced another's on a fresh
    database exited with status 3 (an index or constraint the other had just made)."""
    with contextlib.ExitStack() as stack:
        try:
            home.mkdir(parents=True, exist_ok=True)
            lock = stack.enter_context(open(home / "treadle-server-start.lock", "a"))
        except OSError:  # no database there either: the server fails and says why
            pass
        else:
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=1) as response:
            return response.status == 200
    except (OSError, http.client.HTTPException):  # a program that is no HTTP server holds the port
        return False


def _stop_server(server: _TemporaryServer) -> None:
    """Stop ``server``, the leader of its own process group, and whatever it started (what it
    says from then on is not relayed). One that exited on its own has the rest of what it said
    relayed first: why it exited (a migration that failed) is in its last lines."""
    if server.poll() is not None:
        server.relay.join(timeout=RELAY_DRAIN_S)
    server.stopping.set()
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def _port(text: str) -> int:
    """``--port``'s value: a TCP port a server can listen on and its URL name (not 0, which
    has the system pick one)."""
    try:
        port = int(text)
    except ValueError:
        port = 0
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text} is no TCP port: give one from 1 to 65535")
    return port


def _waited(process: subprocess.Popen) -> int:
    """``process.wait()`` that runs this process's signal handlers within 50 ms of a signal. A
    plain one blocks in ``waitpid``, which a signal that lands just before the call (or that
    the kernel gives another thread) does not wake: its handler would wait for the process's end."""
    while True:
        with contextlib.suppress(subprocess.TimeoutExpired):
            return process.wait(timeout=3600)  # with a timeout it polls, sleeping 50 ms at most


def _ui(args) -> None:
    from flows.demo import UI_URL

    url = f"http://{args.host}:{args.port}"
    if url == UI_URL:
        watch = "`make demo` in another shell will show up there."
    else:  # `make demo` only looks for a server at UI_URL
        watch = f"Flows show up there with `export PREFECT_API_URL={url}/api`."
    print(f"Prefect UI: {url}  (API {url}/api). {watch} Ctrl-C stops it.", flush=True)
    server, env = prefect_server(args.host, args.port)
    # the server goes with this process however it ends (a SIGKILL too)
    with subprocess.Popen(server, env=env, preexec_fn=_stopped_with(os.getpid())) as process:
        # a stop that reaches only this process (a service manager's, `kill`): the server
        # shuts down as on Ctrl-C, then so do we
        before = signal.signal(signal.SIGTERM, lambda *_: process.send_signal(signal.SIGTERM))
        try:
            code = _waited(process)
        except KeyboardInterrupt:  # Ctrl-C reached the server too: it shuts down, then so do we
            code = _waited(process)
        finally:
            signal.signal(signal.SIGTERM, before)
    raise SystemExit(code)


def main(argv: list[str] | None = None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command in ("inspect", "sql") and args.run_id is None and not args.config:
        parser.error(f"{args.command} needs --run-id or --config")
    try:
        args.handler(args)
        sys.stdout.flush()  # a closed pipe shows here rather than at exit
    except BrokenPipeError:
        # the reader (`| head`) has all it wants: stop quietly, with the status of a
        # command killed by SIGPIPE; stdout goes to devnull so the exit's flush is silent
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(128 + signal.SIGPIPE) from None
    except KeyboardInterrupt:  # Ctrl-C while a command reads a run (a flow's own says so itself)
        print("stopped by SIGINT", file=sys.stderr)
        raise SystemExit(128 + signal.SIGINT) from None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="treadle", description="Asynchronous RL for LLM agents on Prefect.")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser(
        "run",
        help="Run a flow: treadle run pipeline --config configs/tiny.yaml",
        description="Run one flow on a run config. The flow's options: treadle run <flow> --help.",
    )
    run.add_argument("flow", choices=FLOWS, help="The flow to run.")
    rest = run.add_argument(
        "rest", nargs=argparse.REMAINDER, metavar="ARGS", help="Arguments of the flow (--config, --set …)."
    )
    # argparse marks every positional but '?' and '*' required, and names it in its error
    # when the flow is missing: the flow's arguments may all be left out
    rest.required = False
    run.set_defaults(handler=_run)
    for name, handler, helptext, description in (
        (
            "inspect",
            _inspect,
            "Print a run's versions, rewards and shard counts.",
            "Print a run's weight versions (pruned ones marked), held-out reward per version, "
            "reward of the generated data per version, shard counts and policy steps.",
        ),
        (
            "sql",
            _sql,
            "Run SQL over a run's Delta tables (each table is a view).",
            "Run one SQL query (duckdb) over a run's Delta tables and print the result as "
            "tab-separated values, timestamps in UTC, lists, structs and maps as JSON. Tables: "
            + ", ".join(TABLES)
            + ". Views over them (the README says what they hold): "
            + ", ".join(VIEWS)
            + ".",
        ),
    ):
        command = sub.add_parser(name, help=helptext, description=description)
        command.add_argument(
            "--config", help="Run config YAML: its storage section and run_id (credentials included)."
        )
        command.add_argument(
            "--root", help="Storage root: a local folder or s3://bucket/prefix (default: ./runs)."
        )
        command.add_argument("--endpoint-url", help="S3 endpoint of a MinIO-compatible store.")
        command.add_argument("--region", help="S3 region.")
        command.add_argument("--run-id", help="Run to look at (default: the run_id of --config).")
        if name == "sql":
            command.add_argument("query", help='e.g. "SELECT version, env, reward FROM evals"')
        command.set_defaults(handler=handler)
    ui = sub.add_parser(
        "ui",
        help="Start a local Prefect server and UI (default 127.0.0.1:4200).",
        description="Start a Prefect server and its UI; runs reach it through PREFECT_API_URL.",
    )
    ui.add_argument("--host", default="127.0.0.1", help="Address to listen on (default: 127.0.0.1).")
    ui.add_argument("--port", type=_port, default=4200, help="Port to listen on (default: 4200).")
    ui.set_defaults(handler=_ui)
    return parser


if __name__ == "__main__":
    main()
