"""redact: the credentials a text may hold, masked before it leaves the process."""

from __future__ import annotations

import pytest

from storage.redaction import MASKED, redact


@pytest.mark.parametrize(
    ("text", "masked"),
    [
        (
            "fatal: unable to access 'https://oauth2:glpat-SECRET@gitlab.example.com/g/r.git/': 403",
            f"fatal: unable to access 'https://{MASKED}@gitlab.example.com/g/r.git/': 403",
        ),
        (
            "Client error '401 Unauthorized' for url 'https://ghp_SECRET@api.github.com/repos'",
            f"Client error '401 Unauthorized' for url 'https://{MASKED}@api.github.com/repos'",
        ),
        ("GET http://minioadmin:SECRET@127.0.0.1:9000/bucket", f"GET http://{MASKED}@127.0.0.1:9000/bucket"),
        # a password holding an '@' (a URL's host follows its last one: urllib, httpx)
        ("GET http://user:p@ss@db.example:5432/x", f"GET http://{MASKED}@db.example:5432/x"),
    ],
)
def test_a_urls_user_info_is_masked(text, masked):
    """A rollout's ``error`` (an env's tool that failed quoting the URL it fetched, with the
    token in its user info) was written to the trajectories table as it came: only the run's
    own credentials and AWS key ids were masked."""
    assert redact(text) == masked


def test_text_that_only_looks_like_user_info_is_kept():
    text = "vLLM server vllm@x answered 500; mail ops@example.com; see https://example.com/a@b"
    assert redact(text) == text


def test_the_credentials_of_a_presigned_url_and_of_a_signed_request_are_masked():
    """A presigned URL is a credential of its own until it expires, whatever store signed it
    (MinIO's key id is no ``AKIA…``, which was the only part masked); a signed request's
    security token header likewise."""
    url = (
        "http://minio:9000/b/k?X-Amz-Algorithm=AWS4-HMAC-SHA256"
        "&X-Amz-Credential=minioadmin%2F20260101%2Fus-east-1%2Fs3%2Faws4_request&X-Amz-Date=20260101T000000Z"
        "&X-Amz-Expires=604800&X-Amz-SignedHeaders=host&X-Amz-Security-Token=SECRET-TOKEN"
        "&X-Amz-Signature=SECRET-SIGNATURE"
    )
    assert redact(f"403 Forbidden for url '{url}'\nx-amz-security-token: SECRET-TOKEN") == (
        "403 Forbidden for url 'http://minio:9000/b/k?X-Amz-Algorithm=AWS4-HMAC-SHA256"
        f"&X-Amz-Credential={MASKED}&X-Amz-Date=20260101T000000Z&X-Amz-Expires=604800"
        f"&X-Amz-SignedHeaders=host&X-Amz-Security-Token={MASKED}&X-Amz-Signature={MASKED}'\n"
        f"x-amz-security-token: {MASKED}"
    )
