"""Which errors a task's retries (``tasks.common.STORAGE_RETRIES``) are spent on, as
deltalake raises them from a real S3-compatible server."""

from __future__ import annotations

import pytest
from prefect.states import Failed

from storage.config import RunStore, StorageConfig
from storage.tables import Tables
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
