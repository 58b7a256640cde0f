"""Which errors a task's retries (``tasks.common.STORAGE_RETRIES``) are spent on, as
deltalake raises them from a real S3-compatible server, and transformers for a checkpoint
on the Hugging Face Hub."""

from __future__ import annotations

import datetime
import errno
import http.server
import ipaddress
import os
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import transformers
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from prefect.states import Failed

from storage.config import RunStore, StorageConfig
from storage.tables import Tables
from storage.weights import WeightStore
from tasks.common import retry_if_transient
from tests.conftest import S3Server
from tests.storage.s3_proxy import S3Proxy, proxying


def deltalake_error(config: StorageConfig) -> OSError:
    """What reading a run's ``shards`` table (process-pending's first read) raises."""
    with pytest.raises(OSError) as raised:
        Tables(RunStore(config, "run-0")).version("shards")
    return raised.value


def test_deltalake_refusing_the_credentials_or_naming_no_bucket_is_not_retried(
    s3_server: S3Server, s3_checking_credentials: str
):
    """deltalake raises every S3 error as a plain ``OSError``: refused credentials (403)
    and an absent bucket were retried three times (~21 s, and each attempt's work before
    its first read) to fail the same way, where s3fs's ``PermissionError`` and
    ``FileNotFoundError`` for them fail at once."""
    refused = StorageConfig(
        root=f"s3://{s3_server.bucket}/runs",
        endpoint_url=s3_checking_credentials,
        region=s3_server.region,
        access_key_id="unknown-key",
        secret_access_key="unknown-secret",
    )
    no_bucket = s3_server.config().model_copy(update={"root": "s3://no-such-bucket/runs"})
    for config in (refused, no_bucket):
        error = deltalake_error(config)
        assert type(error) is OSError
        assert retry_if_transient(None, None, Failed(data=error)) is False, error


class Unavailable(S3Proxy):
    """Answers every request as an S3 server that is overloaded for a moment."""

    def relay(self) -> None:
        self.answer(503, {}, b"<Error><Code>ServiceUnavailable</Code></Error>")


def test_deltalake_failing_otherwise_is_retried(s3_server: S3Server):
    """A server error, which deltalake raises as a plain ``OSError`` too, is retried."""
    with proxying(Unavailable, s3_server.endpoint_url) as endpoint:
        error = deltalake_error(
            s3_server.config().model_copy(update={"endpoint_url": endpoint, "retries": 0})
        )
    assert type(error) is OSError and "503" in str(error), error
    assert retry_if_transient(None, None, Failed(data=error)) is True


def self_signed(folder: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 signed by its own key, which no machine trusts, and the key."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False
        )
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = folder / "cert.pem", folder / "key.pem"
    cert_path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return cert_path, key_path


@pytest.fixture
def untrusted_endpoint(tmp_path: Path) -> Iterator[str]:
    """An https endpoint whose certificate this machine does not trust (an S3-compatible
    server with a self-signed one, its CA not installed)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(*self_signed(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever)
    thread.start()
    try:
        yield f"https://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        thread.join()
        server.server_close()


def test_a_certificate_this_machine_does_not_trust_is_not_retried(untrusted_endpoint: str):
    """An S3 endpoint whose certificate fails verification fails the same way on every
    attempt: through s3fs (botocore's ``SSLError``, an ``OSError``) and through deltalake
    (a plain ``OSError``) it was retried three times before failing."""
    config = StorageConfig(
        root="s3://bucket/runs",
        endpoint_url=untrusted_endpoint,
        region="us-east-1",
        access_key_id="key-id",
        secret_access_key="secret",
        retries=0,
    )
    store = RunStore(config, "run-0")
    for read in (WeightStore(store).list, lambda: Tables(store).version("shards")):
        with pytest.raises(OSError) as raised:
            read()
        assert retry_if_transient(None, None, Failed(data=raised.value)) is False, raised.value


def test_https_to_an_endpoint_that_speaks_http_is_not_retried(s3_server: S3Server):
    """``https://`` given for an S3-compatible server that serves plain http (MinIO's
    default) fails the same on every attempt, through s3fs (botocore's ``SSLError``:
    wrong version number) and deltalake (a corrupt TLS message)."""
    https = s3_server.endpoint_url.replace("http://", "https://")
    store = RunStore(s3_server.config().model_copy(update={"endpoint_url": https, "retries": 0}), "run-0")
    for read in (WeightStore(store).list, lambda: Tables(store).version("shards")):
        with pytest.raises(OSError) as raised:
            read()
        assert retry_if_transient(None, None, Failed(data=raised.value)) is False, raised.value


def hub_error(
    status: int, error: type[HfHubHTTPError] | None = None
) -> HfHubHTTPError | LocalEntryNotFoundError:
    """What the Hugging Face Hub client raises for an answer of ``status`` (``error``: its
    class for it), or, when ``status`` is 0, for a Hub it could not reach."""
    if not status:
        return LocalEntryNotFoundError("cannot reach the Hub, and the files are not cached")
    request = httpx.Request("GET", "https://huggingface.co/api/models/org/model")
    return (error or HfHubHTTPError)(f"{status} answered", response=httpx.Response(status, request=request))


def loading_error(error: Exception, monkeypatch: pytest.MonkeyPatch) -> OSError:
    """What loading a checkpoint by its Hub id (``model.path``: the warm start's, the
    trainer's base) raises when the Hub client raises ``error``: transformers raises each as a
    plain ``OSError`` caused by it."""

    def download(*args, **kwargs):
        raise error

    monkeypatch.setattr(transformers.utils.hub, "hf_hub_download", download)
    with pytest.raises(OSError) as raised:
        transformers.AutoConfig.from_pretrained("org/model")
    return raised.value


@pytest.mark.parametrize(
    ("status", "error"),
    [(401, RepositoryNotFoundError), (403, GatedRepoError), (404, RevisionNotFoundError)],
    ids=["NoSuchRepo", "Gated", "NoSuchRevision"],
)
def test_a_hub_checkpoint_that_is_not_there_or_not_allowed_is_not_retried(status, error, monkeypatch):
    """A ``model.path`` naming a Hub repo that does not exist (or is private), a gated one
    this token may not read, or a revision it lacks: transformers raises each as a plain
    ``OSError``, which was retried three times (~21 s, each attempt's load) to fail the same way."""
    raised = loading_error(hub_error(status, error), monkeypatch)
    assert type(raised) is OSError
    assert retry_if_transient(None, None, Failed(data=raised)) is False, raised


@pytest.mark.parametrize("status", [0, 503], ids=["Unreachable", "Unavailable"])
def test_a_hub_that_fails_for_a_moment_is_retried(status, monkeypatch):
    raised = loading_error(hub_error(status), monkeypatch)
    assert retry_if_transient(None, None, Failed(data=raised)) is True, raised


def test_a_store_on_a_read_only_file_system_is_not_retried():
    """A local ``storage.root`` on a read-only mount (a volume mounted ``ro``): every write
    fails as fsspec raises it here, a plain ``OSError`` of errno ``EROFS``, on every attempt;
    it was retried three times (~21 s, and the trainer's load on each), where a forbidden
    path's ``PermissionError`` fails at once."""
    error = OSError(errno.EROFS, os.strerror(errno.EROFS))
    assert type(error) is OSError  # no subclass of its own, as EACCES has
    assert retry_if_transient(None, None, Failed(data=error)) is False
    assert retry_if_transient(None, None, Failed(data=OSError(errno.EIO, os.strerror(errno.EIO)))) is True
