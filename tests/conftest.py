"""Shared fixtures: run stores on a local folder and on a real S3-compatible server.

``store`` runs a test twice, on a local folder and on ``s3://`` against a ``moto_server``
process on 127.0.0.1 (a separate process: moto's in-thread server made deltalake hang).
The server starts once per session, only when a test asks for S3. Its dummy credentials
travel in ``StorageConfig`` fields, never through the environment.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import http.server
import json
import logging
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import pytest
from xdist.scheduler import LoadFileScheduling

from storage.config import RunStore, StorageConfig

# Two workers share the two cores of CI: torch's default of a thread per core in each
# oversubscribes them, and its threads spin against each other (a tiny model's step took
# several times as long). Set before any test module imports torch; the processes the
# tests start inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@dataclass(frozen=True)
class S3Server:
    """A running S3-compatible server and the bucket created on it."""

    endpoint_url: str
    bucket: str
    access_key_id: str = "treadle-test-key"
    secret_access_key: str = "treadle-test-secret"
    region: str = "us-east-1"

    def config(self, prefix: str = "runs") -> StorageConfig:
        """A StorageConfig rooted at ``s3://<bucket>/<prefix>`` on this server."""
        return StorageConfig(
            root=f"s3://{self.bucket}/{prefix}",
            endpoint_url=self.endpoint_url,
            region=self.region,
            access_key_id=self.access_key_id,
            secret_access_key=self.secret_access_key,
        )

    def boto3_client(self):
        """A plain boto3 S3 client for this server (an independent reader in tests)."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name=self.region,
            aws_access_key_id=self.access_key_id,
            aws_secret_access_key=self.secret_access_key,
        )


def published_by(monkeypatch, board: type) -> list:
    """Every object published through ``board`` (a status board class) from now on, in
    order; each is still published."""
    objects: list = []
    publish = board.publish

    def recorded(self, obj):
        objects.append(obj)
        publish(self, obj)

    monkeypatch.setattr(board, "publish", recorded)
    return objects


@contextlib.contextmanager
def kept_fresh(publish: Callable[[], None], every_s: float = 0.1) -> Iterator[None]:
    """While the block runs, a thread calls ``publish`` every ``every_s`` (as a live
    process refreshes its status); its first calls are done when the block starts."""
    stop = threading.Event()

    def refresh() -> None:
        while not stop.wait(every_s):
            publish()

    thread = threading.Thread(target=refresh)
    thread.start()
    try:
        time.sleep(3 * every_s)
        yield
    finally:
        stop.set()
        thread.join()


@pytest.fixture(scope="session", autouse=True)
def weights_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Weight loads fetch into ``$TREADLE_CACHE``: a folder of this session's, not the
    user's ``~/.cache/treadle`` (set for the processes the tests start too)."""
    before = os.environ.get("TREADLE_CACHE")
    os.environ["TREADLE_CACHE"] = str(tmp_path_factory.mktemp("weights-cache"))
    yield
    if before is None:
        os.environ.pop("TREADLE_CACHE", None)
    else:
        os.environ["TREADLE_CACHE"] = before


@pytest.fixture(autouse=True)
def prefect_api_given_up_on_kept() -> Iterator[None]:
    """A flow that ends while its Prefect API is gone gives up on it for the whole process
    (``flows.run_body.stop_retrying_prefect_api``, as a run's end should: the client's retries,
    logging to the API, errors in logging, the run loggers' filter): the tests after one such
    in-process flow get them back."""
    names = ("PREFECT_CLIENT_MAX_RETRIES", "PREFECT_LOGGING_TO_API_ENABLED")
    before = {name: os.environ.get(name) for name in names}
    raise_exceptions = logging.raiseExceptions
    yield
    logging.raiseExceptions = raise_exceptions
    run_body = sys.modules.get("flows.run_body")  # not imported: no flow gave up
    for name in run_body.RUN_LOGGERS if run_body else ():
        logging.getLogger(name).removeFilter(run_body._api_errors_in_one_line)
    if all(os.environ.get(name) == value for name, value in before.items()):
        return
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    from prefect.context import refresh_global_settings_context

    refresh_global_settings_context()


def readme_query(mentioning: str) -> str:
    """The one SQL query in the README's inline code that holds ``mentioning``, on one line."""
    readme = Path(__file__).resolve().parents[1] / "README.md"
    text = re.sub(r"```.*?```", "", readme.read_text(), flags=re.DOTALL)
    (query,) = [
        q for q in (" ".join(code.split()) for code in re.findall(r"`([^`]+)`", text)) if mentioning in q
    ]
    return query


@contextlib.contextmanager
def one_ray_at_a_time() -> Iterator[None]:
    """Hold the block against every other test process that starts Ray (pytest-xdist's workers,
    other runs of the suite): a worker once died ("node down") while its Ray cluster ran beside
    the local Rays that ``test_ray_local`` stops mid-start, and Ray instances started side by
    side on one machine race for ports now and then (its dashboard agent's; the raylet shares
    its agent's fate, and its driver, the worker, the raylet's). A test that starts Ray holds
    it, in a ``test_ray*.py`` file (:class:`RayFilesInOneUnit`)."""
    with open(os.path.join(tempfile.gettempdir(), "treadle-tests-ray.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


RAY_UNIT = "the test files that start Ray"

DURATIONS = Path(__file__).with_name("durations.json")
"""The seconds each test file took when last run with ``--record-durations`` (``make durations``
runs the whole suite so): :class:`RayFilesInOneUnit` hands the longest work out first."""

UNRECORDED_SECONDS_PER_TEST = 0.5
"""What a test of a file that :data:`DURATIONS` lacks is taken to last: about the suite's mean."""


class RayFilesInOneUnit(LoadFileScheduling):
    """pytest-xdist's ``loadfile``, but every ``test_ray*.py`` file (the tests that start Ray
    live there) is in one unit of work: run on two workers, they waited for each other's Ray in
    :func:`one_ray_at_a_time`, a worker idle meanwhile (about two minutes of the suite's time).

    The units are handed out longest first, as :data:`DURATIONS` recorded them, not as
    pytest-xdist orders them (most tests first): its order left the files of a few long tests
    (a real Prefect server and worker, three flow processes on S3) to the end, run by one
    worker while the other had nothing left (some 40 s of the suite's 1,150 here)."""

    def __init__(self, config: pytest.Config, log=None) -> None:
        super().__init__(config, log)
        self.recorded = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}

    def _split_scope(self, nodeid: str) -> str:
        path = super()._split_scope(nodeid)
        return RAY_UNIT if os.path.basename(path).startswith("test_ray") else path

    def _expected_seconds(self, unit: str) -> float:
        tests = collections.Counter(nodeid.split("::", 1)[0] for nodeid in self.workqueue[unit])
        return sum(
            self.recorded.get(path, UNRECORDED_SECONDS_PER_TEST * count) for path, count in tests.items()
        )

    def _assign_work_unit(self, node) -> None:
        for unit in sorted(self.workqueue, key=self._expected_seconds, reverse=True):
            self.workqueue.move_to_end(unit)
        super()._assign_work_unit(node)


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log) -> LoadFileScheduling | None:
    return RayFilesInOneUnit(config, log) if config.getvalue("dist") == "loadfile" else None


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--record-durations",
        action="store_true",
        help=f"record the seconds each test file run took in {DURATIONS.name}",
    )


FILE_SECONDS: collections.Counter[str] = collections.Counter()
"""The seconds each test file's tests have taken so far, set-up and tear-down included."""


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    FILE_SECONDS[report.nodeid.split("::", 1)[0]] += report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    # on pytest-xdist's controller, which hears every worker's reports
    if session.config.getoption("record_durations") and not hasattr(session.config, "workerinput"):
        recorded = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
        recorded |= {path: round(seconds, 1) for path, seconds in FILE_SECONDS.items()}
        root = session.config.rootpath
        kept = {path: recorded[path] for path in sorted(recorded) if (root / path).exists()}
        DURATIONS.write_text(json.dumps(kept, indent=1) + "\n")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start_moto(port: int, log: IO[bytes], env: dict[str, str] | None = None) -> subprocess.Popen:
    # The request log goes to a file: an unread pipe fills up and stalls the server.
    executable = os.path.join(os.path.dirname(sys.executable), "moto_server")
    return subprocess.Popen(
        [executable, "-H", "127.0.0.1", "-p", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, **(env or {})},
    )


def _wait_until_serving(
    process: subprocess.Popen, url: str, log: IO[bytes], deadline_s: float = 30.0
) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"moto_server exited with {process.returncode}: {log.read().decode()[-2000:]}")
        try:
            urllib.request.urlopen(url, timeout=1).close()
            return
        except urllib.error.HTTPError:
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"moto_server did not answer on {url} within {deadline_s} s")


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """A ``moto_server`` process on 127.0.0.1 with one bucket, for the whole session."""
    log = open(tmp_path_factory.mktemp("moto") / "server.log", "w+b")  # noqa: SIM115 (closed at teardown)
    for _attempt in range(3):
        port = free_port()
        process = _start_moto(port, log)
        endpoint = f"http://127.0.0.1:{port}"
        try:
            _wait_until_serving(process, endpoint, log)
            break
        except RuntimeError:
            process.kill()
            process.wait()
    else:
        raise RuntimeError("could not start moto_server on 127.0.0.1")
    server = S3Server(endpoint_url=endpoint, bucket="treadle-test")
    try:
        server.boto3_client().create_bucket(Bucket=server.bucket)
        yield server
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


@pytest.fixture(scope="session")
def s3_checking_credentials(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The endpoint of a ``moto_server`` that checks every request's credentials against its
    IAM users (it has none, so it refuses every key)."""
    log = open(tmp_path_factory.mktemp("moto-auth") / "server.log", "w+b")  # noqa: SIM115 (closed at teardown)
    port = free_port()
    process = _start_moto(port, log, {"INITIAL_NO_AUTH_ACTION_COUNT": "0"})
    endpoint = f"http://127.0.0.1:{port}"
    try:
        _wait_until_serving(process, endpoint, log)
        yield endpoint
    finally:
        process.kill()
        process.wait()
        log.close()


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path) -> RunStore:
    """A fresh run store, once on a local folder and once on the S3 server."""
    run_id = f"run-{uuid.uuid4().hex[:12]}"
    if request.param == "local":
        return RunStore(StorageConfig(root=str(tmp_path / "runs")), run_id)
    server: S3Server = request.getfixturevalue("s3_server")
    return RunStore(server.config(), run_id)


@pytest.fixture
def local_store(tmp_path) -> RunStore:
    """A fresh run store on a local folder (for tests that do not need S3)."""
    return RunStore(StorageConfig(root=str(tmp_path / "runs")), f"run-{uuid.uuid4().hex[:12]}")


class EchoingDenial(http.server.BaseHTTPRequestHandler):
    """Refuses every request as AWS refuses a bad signature or an expired session: with an
    error body that echoes the key id and the session token the request was signed with."""

    def do_GET(self):
        key_id = self.headers.get("Authorization", "").partition("Credential=")[2].split("/")[0]
        body = (
            "<Error><Code>ExpiredToken</Code><Message>The provided token has expired.</Message>"
            f"<AWSAccessKeyId>{key_id}</AWSAccessKeyId>"
            f"<Token-0>{self.headers.get('X-Amz-Security-Token', '')}</Token-0></Error>"
        ).encode()
        self.send_response(400)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_HEAD = do_PUT = do_POST = do_GET

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def serving(handler: type[http.server.BaseHTTPRequestHandler]) -> Iterator[str]:
    """Serve ``handler`` on 127.0.0.1 while the block runs; yields the server's URL."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        thread.join()
        server.server_close()


@pytest.fixture
def echoing_endpoint() -> Iterator[str]:
    """URL of an S3 endpoint on 127.0.0.1 that refuses every request as AWS refuses an expired
    session, with an error body that echoes the key id and the session token it was signed with."""
    with serving(EchoingDenial) as url:
        yield url
