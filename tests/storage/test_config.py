"""StorageConfig: which roots are accepted, and where a run's data then lives."""

from __future__ import annotations

import http.server
import pickle
import re
import threading
from collections.abc import Iterator
from datetime import UTC, datetime

import pytest
from pydantic import ValidationError

from flows.sql import connect
from storage.config import RunStore, StorageConfig, create_on_s3
from storage.tables import Tables
from tests.conftest import serving


@pytest.mark.parametrize(
    ("root", "uri"),
    [
        ("s3://bucket/treadle/", "s3://bucket/treadle/r1"),
        ("S3://bucket/treadle", "s3://bucket/treadle/r1"),
        ("s3a://bucket", "s3a://bucket/r1"),
    ],
)
def test_s3_roots_are_normalised(root, uri):
    config = StorageConfig(root=root)
    assert config.is_s3
    assert RunStore(config, "r1").uri == uri


def test_a_plain_path_is_a_local_folder(tmp_path):
    store = RunStore(StorageConfig(root=str(tmp_path / "runs")), "r1")
    assert not store.config.is_s3 and store.uri == str(tmp_path / "runs" / "r1")


def test_a_local_root_written_with_a_tilde_is_in_the_home_folder(tmp_path, monkeypatch):
    """``root: ~/runs`` kept every run in a folder named ``~`` of the current directory."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    config = StorageConfig(root="~/runs")
    assert config.root == str(tmp_path / "home" / "runs")
    assert RunStore(config, "r1").uri == str(tmp_path / "home" / "runs" / "r1")
    assert StorageConfig(root="s3://bucket/~/runs").root == "s3://bucket/~/runs"  # a key, not a home


@pytest.mark.parametrize("run_id", ["", "a/b", ".", ".."])
def test_a_run_id_that_is_not_one_folder_of_the_root_is_refused(tmp_path, run_id):
    # '..' made the run the root's parent folder (``treadle inspect --run-id ..`` read it)
    for root in (str(tmp_path / "runs"), "s3://bucket/runs"):
        with pytest.raises(ValueError, match="run_id must be a non-empty name"):
            RunStore(StorageConfig(root=root), run_id)


@pytest.mark.parametrize("unsafe", ["%41", "[1]", "^", "|", "\\"])
def test_a_run_whose_path_holds_what_deltalake_cannot_take_is_refused_before_its_tables_go_elsewhere(
    tmp_path, unsafe
):
    """deltalake read ``%41`` as ``A`` and a backslash as a separator (the tables went to another
    folder) and panicked on ``[``, ``]``, ``^`` and ``|`` (a ``BaseException``, past every handler)."""
    with pytest.raises(ValueError, match=f"must hold no {re.escape(repr(unsafe[0]))}"):
        RunStore(StorageConfig(root=str(tmp_path)), f"run{unsafe}")


@pytest.mark.parametrize("root", ["runs/p%41q", "s3://b/p%41q", "runs/a[1]", "runs/a\\b"])
def test_a_root_that_holds_what_deltalake_cannot_take_fails_at_load_naming_the_root(root):
    """A run config with such a root loaded, and its flow failed only at its first look at
    the store; ``treadle inspect --root`` blamed ``--run-id``."""
    with pytest.raises(ValidationError, match=r"root\n.*holds a '"):
        StorageConfig(root=root)


@pytest.mark.parametrize(
    ("root", "problem"),
    [
        ("s3://bucket/p?x", "a '\\?' or '#'"),
        ("s3://bucket/p#x", "a '\\?' or '#'"),
        ("s3://bucket//p", "an empty, '.' or '..' segment"),
        ("s3://bucket/a/./b", "an empty, '.' or '..' segment"),
        ("s3://bucket/a/../b", "an empty, '.' or '..' segment"),
        ("s3://bucket/a\tb", "a '\\?' or '#'.* or a control character"),
        ("s3://bucket/runs\n", "a '\\?' or '#'.* or a control character"),
    ],
)
def test_an_s3_root_whose_path_deltalake_reads_otherwise_fails_at_load_naming_the_root(root, problem):
    """s3fs takes an S3 root's path as written, deltalake as a URL: with ``s3://bucket/p?x`` (or
    ``#x``) every table of every run went to the one Delta table ``bucket/p`` (a run under
    ``p#x`` read the weights row a run under ``p?x`` wrote); with ``a/./b`` or ``a/../b`` the
    tables went to ``a/b`` or ``b``, away from the run's shards and weights (``Tables.vacuum``
    and ``check_log``, which list the table with s3fs, found nothing there); ``//`` failed at
    the first table access ("contained empty path segment"); a tab or line break deltalake
    drops from the URL (``a\\tb`` made its tables ``ab``)."""
    with pytest.raises(ValidationError, match=rf"root\n.*holds {problem}"):
        StorageConfig(root=root)


@pytest.mark.parametrize("run_id", ["r?1", "r#1", "r\t1"])
def test_a_run_id_that_deltalake_reads_otherwise_is_refused_on_s3_only(tmp_path, run_id):
    """On S3 every table of ``r?1`` would be the one Delta table ``<root>/r`` (of ``r\\t1``:
    ``<root>/r1``); a local folder's path reaches deltalake as a path, not as a URL, and
    takes them as written."""
    with pytest.raises(ValueError, match="must hold no '\\?', '#' or control character on S3"):
        RunStore(StorageConfig(root="s3://bucket/runs"), run_id)
    assert RunStore(StorageConfig(root=str(tmp_path)), run_id).uri == str(tmp_path / run_id)


def test_a_store_that_has_been_used_pickles_and_its_copy_reads_the_run(store):
    """A run store travels to Ray actors (engines on other nodes fetch weights from it) after
    the driver used it: its S3 filesystem (a live session) did not pickle, so the copy builds
    its own."""
    store.fs.pipe(store.path("probe"), b"written before pickling")

    copy = pickle.loads(pickle.dumps(store))

    assert copy.fs.cat(copy.path("probe")) == b"written before pickling"


@pytest.mark.parametrize(
    ("root", "message"),
    [
        ("file:///data/runs", "unsupported URL scheme 'file'"),
        ("gs://bucket/treadle", "unsupported URL scheme 'gs'"),
        ("https://example.com/runs", "unsupported URL scheme 'https'"),
        ("s3://", "names no bucket"),
        ("s3:///prefix", "names no bucket"),
        ("  ", "must name a folder or URL"),
    ],
)
def test_other_roots_are_refused_naming_the_value(root, message):
    with pytest.raises(ValidationError, match=message) as error:
        StorageConfig(root=root)
    assert repr(root) in str(error.value) or not root.strip()


@pytest.mark.parametrize("root", ["s3:/bucket/runs", "s3:bucket/runs", "S3A:/bucket", "s3:"])
def test_an_s3_url_short_of_its_slashes_is_refused_not_taken_for_a_local_folder(root):
    """``s3:/bucket/runs`` was a local folder (./s3:/bucket/runs): each worker wrote its
    rollouts to its own disk, where the trainer never saw them."""
    with pytest.raises(ValidationError, match="root starts with an S3 scheme but is no S3 URL"):
        StorageConfig(root=root)
    assert StorageConfig(root="s3/runs").root == "s3/runs"  # a folder named s3 is one


SECRET_INPUTS = [
    ({"aws_secret_access_key": "TOP-SECRET-VALUE"}, "aws_secret_access_key"),  # a misspelt field
    ({"secret_access_key": ["TOP-SECRET-VALUE"]}, "secret_access_key"),  # a wrong type
    ({"access_key_id": {"value": "TOP-SECRET-VALUE"}}, "access_key_id"),
    ({"endpoint_url": "http://key:TOP-SECRET-VALUE@127.0.0.1:9000"}, "endpoint_url holds credentials"),
    ({"endpoint_url": "http://TOP-SECRET-VALUE@minio.internal"}, "endpoint_url holds credentials"),
    ({"endpoint_url": "key:TOP-SECRET-VALUE@127.0.0.1:9000"}, "endpoint_url must be an http"),
    ({"root": "s3://AKIAEXAMPLE:TOP-SECRET-VALUE@bucket/runs"}, "root holds credentials"),
    ({"root": "https://user:TOP-SECRET-VALUE@example.com/runs"}, "root holds credentials"),
    ({"root": "s3:/AKIAEXAMPLE:TOP-SECRET-VALUE@bucket/runs"}, "root starts with an S3 scheme"),
    ({"root": "s3:///AKIAEXAMPLE:TOP-SECRET-VALUE@bucket/runs"}, "root holds credentials"),
    ({"root": "https://bucket.s3.amazonaws.com/runs?X-Amz-Signature=TOP-SECRET-VALUE%3D"}, "root holds a"),
    ({"root": "s3://bucket/runs?X-Amz-Security-Token=TOP-SECRET-VALUE"}, "root holds a"),
]


@pytest.mark.parametrize(("storage", "field"), SECRET_INPUTS)
def test_a_validation_error_names_the_field_but_never_shows_a_credential(storage, field):
    with pytest.raises(ValidationError) as error:
        StorageConfig(**storage)
    assert field in str(error.value) and "TOP-SECRET-VALUE" not in str(error.value)


@pytest.mark.parametrize(
    "endpoint",
    [
        "127.0.0.1:9000",
        "localhost:9000",
        "minio.internal",
        "ftp://minio:21",
        "http://minio:port",
        "http://[::1:9000",
    ],
)
def test_an_endpoint_that_is_not_an_http_url_is_refused_naming_the_field(endpoint):
    # deltalake panicked on these ("TokioMultiThreadExecutor has crashed") at the first table access
    with pytest.raises(ValidationError, match=r"endpoint_url\n.*must be an http:// or https:// URL"):
        StorageConfig(root="s3://bucket", endpoint_url=endpoint)
    for good in ("http://127.0.0.1:9000", "https://s3.eu-west-1.amazonaws.com", "http://[::1]:9000/"):
        assert StorageConfig(root="s3://bucket", endpoint_url=good).endpoint_url == good


@pytest.mark.parametrize("field", ["access_key_id", "secret_access_key", "session_token"])
def test_a_credential_that_comes_back_masked_is_refused(field):
    # what Prefect stores for a SecretStr parameter, and hands back on a re-run
    pair = {"access_key_id": "real-key", "secret_access_key": "real-secret"}
    stored = StorageConfig(root="s3://bucket", **pair | {field: "real-value"}).model_dump(mode="json")
    assert stored[field] == "**********"
    with pytest.raises(ValidationError, match=rf"{field}\n.*arrived masked.*AWS_ACCESS_KEY_ID"):
        StorageConfig.model_validate(stored | {name: value for name, value in pair.items() if name != field})


@pytest.mark.parametrize(
    ("given", "missing"), [("access_key_id", "secret_access_key"), ("secret_access_key", "access_key_id")]
)
def test_half_of_a_key_pair_is_refused_naming_the_half_that_is_missing(monkeypatch, given, missing):
    """s3fs failed at its first request on the half it lacked, with an obscure error, while
    deltalake, given no key, used the machine's role."""
    # refused even so: a pair comes whole from the config or from the environment
    for variable in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(variable, "from-the-environment")
    with pytest.raises(ValidationError, match=f"{given} is set but {missing} is not") as error:
        StorageConfig(root="s3://bucket", **{given: "TOP-SECRET-VALUE"})
    assert "TOP-SECRET-VALUE" not in str(error.value)


@pytest.mark.parametrize("environment_keys", [False, True])
def test_a_session_token_without_the_key_pair_it_belongs_to_is_refused(monkeypatch, environment_keys):
    """Given no key pair, s3fs and deltalake dropped the token without a word and signed with
    the machine's role, another identity; with the environment's pair, it went with a key it
    was not issued for."""
    for variable in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        if environment_keys:
            monkeypatch.setenv(variable, "from-the-environment")
        else:
            monkeypatch.delenv(variable, raising=False)
    with pytest.raises(
        ValidationError, match="session_token is set but access_key_id and secret_access_key are not"
    ) as error:
        StorageConfig(root="s3://bucket", session_token="TOP-SECRET-TOKEN")
    assert "TOP-SECRET-TOKEN" not in str(error.value)


def test_temporary_credentials_carry_their_session_token(monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "env-key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "env-secret")
    monkeypatch.setenv("AWS_SESSION_TOKEN", "env-token")
    from_env = StorageConfig(root="s3://bucket")
    assert from_env.delta_options()["AWS_SESSION_TOKEN"] == "env-token"
    assert from_env.filesystem().token == "env-token"

    # the environment's token belongs to the environment's key, not to a configured one
    configured = StorageConfig(root="s3://bucket", access_key_id="key", secret_access_key="secret")
    assert configured.delta_options()["AWS_SESSION_TOKEN"] == ""  # deltalake reads it otherwise
    assert configured.filesystem().token is None

    with_token = StorageConfig(
        root="s3://bucket", access_key_id="key", secret_access_key="secret", session_token="its-token"
    )
    assert with_token.delta_options()["AWS_SESSION_TOKEN"] == "its-token"
    assert with_token.filesystem().token == "its-token"
    assert "its-token" not in repr(with_token)


EMPTY_LISTING = (
    b'<?xml version="1.0" encoding="UTF-8"?><ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
    b"<Name>bucket</Name><KeyCount>0</KeyCount><MaxKeys>1000</MaxKeys><IsTruncated>false</IsTruncated>"
    b"</ListBucketResult>"
)


class RecordsTokens(http.server.BaseHTTPRequestHandler):
    """An S3 endpoint with an empty bucket that records the session token each request
    carried (None: no header) in ``RecordsTokens.tokens``."""

    tokens: list[str | None] = []

    def do_GET(self):
        RecordsTokens.tokens.append(self.headers.get("X-Amz-Security-Token"))
        listing = "list-type=2" in self.path
        self.send_response(200 if listing else 404)
        self.send_header("Content-Length", str(len(EMPTY_LISTING) if listing else 0))
        self.end_headers()
        if listing and self.command != "HEAD":
            self.wfile.write(EMPTY_LISTING)

    do_HEAD = do_PUT = do_POST = do_GET

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("variable", ["AWS_SESSION_TOKEN", "AWS_TOKEN"])
def test_the_environments_session_token_never_goes_with_a_configured_key(monkeypatch, variable):
    """deltalake reads ``AWS_SESSION_TOKEN`` (and ``AWS_TOKEN``) from the environment whatever
    its options say: with the key id and secret in the config, it signed the tables' requests
    with that key and the environment's token (refused by a store that checks tokens, and the
    environment's token sent to the configured endpoint), while s3fs sent no token."""
    monkeypatch.setenv(variable, "env-token")
    RecordsTokens.tokens = []
    with serving(RecordsTokens) as url:
        config = StorageConfig(
            root="s3://bucket/runs",
            endpoint_url=url,
            access_key_id="key",
            secret_access_key="secret",
            retries=0,
        )
        store = RunStore(config, "r")
        assert Tables(store).read("weights").num_rows == 0
        assert not store.fs.exists(store.path("probe"))
    assert RecordsTokens.tokens and "env-token" not in RecordsTokens.tokens


def test_an_endpoint_scheme_in_capitals_is_served_as_written_in_lower_case():
    """``HTTP://`` passes as an http endpoint: deltalake then needs its plain-HTTP switch,
    which was set only for a lower-case ``http://``."""
    config = StorageConfig(root="s3://bucket", endpoint_url="HTTP://127.0.0.1:9000")
    assert config.endpoint_url == "http://127.0.0.1:9000"
    assert config.delta_options()["AWS_ALLOW_HTTP"] == "true"


def test_an_empty_endpoint_is_no_endpoint():
    """An empty field (a cleared form field, ``--endpoint-url "$UNSET"``) means AWS's own endpoint."""
    assert StorageConfig(root="s3://bucket", endpoint_url="").endpoint_url is None


CONFLICT = (409, "ConditionalRequestConflict", "A conflicting conditional operation is in progress.")
EXISTS = (412, "PreconditionFailed", "At least one of the pre-conditions you specified did not hold")


class ScriptedPuts(http.server.BaseHTTPRequestHandler):
    """An S3 endpoint that answers each PUT with the next of ``server.answers`` (a status, an
    error code and message; 200 with no code: stored) and counts them in ``server.puts``."""

    def do_PUT(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.server.puts += 1
        status, code, message = self.server.answers.pop(0)
        body = (
            b""
            if code is None
            else f"<Error><Code>{code}</Code><Message>{message}</Message></Error>".encode()
        )
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        if status == 200:
            self.send_header("ETag", '"0"')
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def scripted_puts() -> Iterator[http.server.ThreadingHTTPServer]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), ScriptedPuts)
    server.puts = 0
    thread = threading.Thread(target=server.serve_forever)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        thread.join()
        server.server_close()


def _creates(store: RunStore) -> dict:
    """The conditional creates of the store: a lease's, a quota link's or a weight claim's, and
    a shard's (``ShardWriter._upload``)."""
    return {
        "create_exclusive": lambda path: store.create_exclusive(path, b"payload"),
        "pipe_file": lambda path: create_on_s3(
            path, lambda: store.fs.pipe_file(path, b"payload", mode="create")
        ),
    }


@pytest.mark.parametrize("create", ["create_exclusive", "pipe_file"])
@pytest.mark.parametrize(("after", "created"), [((200, None, None), True), (EXISTS, False)])
def test_a_conditional_create_that_meets_a_write_in_progress_is_tried_again(
    scripted_puts, create, after, created
):
    """AWS answers 409 ConditionalRequestConflict to a conditional create while another write
    or a delete of the key is in progress (racing claimants, a lease released while another
    takes it), and asks for a retry: it was raised as a storage error, failing the claim."""
    config = StorageConfig(
        root="s3://bucket/runs",
        endpoint_url=f"http://127.0.0.1:{scripted_puts.server_port}",
        access_key_id="k",
        secret_access_key="s",
        retries=1,
    )
    store = RunStore(config, "run")
    scripted_puts.answers = [CONFLICT, CONFLICT, after]
    if created:
        _creates(store)[create](store.path("lease"))
    else:
        with pytest.raises(FileExistsError):
            _creates(store)[create](store.path("lease"))
    assert scripted_puts.puts == 3


@pytest.mark.parametrize("variable", ["AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"])
def test_an_endpoint_the_environment_names_serves_files_tables_and_sql_alike(
    s3_server, monkeypatch, variable
):
    """botocore takes an unset endpoint from the environment, and so did deltalake, which then
    refused an http:// one ("URL scheme is not allowed"), and duckdb, which went to AWS."""
    monkeypatch.setenv(variable, s3_server.endpoint_url)
    config = s3_server.config().model_copy(update={"endpoint_url": None})
    store = RunStore(config, f"env-endpoint-{variable.lower()}")
    row = {"version": 3, "env": "arith", "reward": 0.5, "count": 2, "time": datetime.now(UTC)}
    Tables(store).append("evals", [row])
    store.fs.pipe_file(store.path("note"), b"x")
    assert Tables(store).read("evals", ["version"]).column("version").to_pylist() == [3]
    assert connect(store).execute("SELECT version, count FROM evals").fetchall() == [(3, 2)]
    listed = s3_server.boto3_client().list_objects_v2(Bucket=s3_server.bucket, Prefix=f"runs/{store.run_id}/")
    assert f"runs/{store.run_id}/note" in {item["Key"] for item in listed["Contents"]}


@pytest.mark.parametrize("endpoint", ["minio:9000", "http://[::1:9000"])
def test_an_endpoint_the_environment_names_is_checked_as_the_field_is(monkeypatch, endpoint):
    """An unclosed IPv6 bracket raised urllib's bare "Invalid IPv6 URL" at the run's first
    look at its storage, naming no variable."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    with pytest.raises(ValueError, match="AWS_ENDPOINT_URL must be an http:// or https:// URL"):
        StorageConfig(root="s3://bucket").delta_options()
    assert StorageConfig(root="./runs").delta_options() == {}


SLOW_DOWN = (503, "SlowDown", "Please reduce your request rate.")


@pytest.mark.parametrize("retries", [0, 2])
def test_retries_counts_the_attempts_after_the_first(scripted_puts, retries):
    """botocore's ``max_attempts`` (and deltalake's ``max_retries``) count the retries after the
    first attempt: ``retries`` 2 sends a request 3 times, 0 once."""
    config = StorageConfig(
        root="s3://bucket/runs",
        endpoint_url=f"http://127.0.0.1:{scripted_puts.server_port}",
        access_key_id="k",
        secret_access_key="s",
        retries=retries,
    )
    store = RunStore(config, "run")
    scripted_puts.answers = [SLOW_DOWN] * (retries + 2)
    with pytest.raises(OSError):
        store.fs.pipe_file(store.path("note"), b"x")
    assert scripted_puts.puts == retries + 1
    assert config.delta_options()["max_retries"] == str(retries)
