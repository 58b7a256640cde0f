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


@pytest.mark.parametrize(
    ("text", "masked"),
    [
        (
            "env: AWS_SECRET_ACCESS_KEY=wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY HF_TOKEN=hf_abc PATH=/bin",
            f"env: AWS_SECRET_ACCESS_KEY={MASKED} HF_TOKEN={MASKED} PATH=/bin",
        ),
        (
            "environ({'OPENAI_API_KEY': 'sk-abc def', 'HOME': '/root', 'DB_PASSWORD': \"p'w\"})",
            f"environ({{'OPENAI_API_KEY': '{MASKED}', 'HOME': '/root', 'DB_PASSWORD': \"{MASKED}\"}})",
        ),
        ("  GITHUB_TOKEN: ghp_abc\n  LANG: C", f"  GITHUB_TOKEN: {MASKED}\n  LANG: C"),
        # an empty value masks nothing of the next line
        ("HF_TOKEN=\nHOME=/root\nAPI_TOKEN=x", f"HF_TOKEN=\nHOME=/root\nAPI_TOKEN={MASKED}"),
        # a dump cut short inside a quoted value (an error message truncated to its first bytes)
        (
            "environ({'HOME': '/root', 'HF_TOKEN': 'hf_abcdefgh",
            f"environ({{'HOME': '/root', 'HF_TOKEN': '{MASKED}",
        ),
        (
            "[default]\naws_secret_access_key = wJalr/K7MDENG\naws_session_token=IQoJb3JpZ2lu\nregion = us-east-1",
            f"[default]\naws_secret_access_key = {MASKED}\naws_session_token={MASKED}\nregion = us-east-1",
        ),
        (
            "401 for url 'https://api.example.com/v1?access_token=abc123&page=2'",
            f"401 for url 'https://api.example.com/v1?access_token={MASKED}&page=2'",
        ),
        (
            '{"client_secret": "s3cr3t", "client_id": "app"}',
            f'{{"client_secret": "{MASKED}", "client_id": "app"}}',
        ),
        (
            "curl -H 'Authorization: Bearer eyJhbGciOiJIUzI1NiJ9.e30.sig' https://x",
            f"curl -H 'Authorization: {MASKED}' https://x",
        ),
        ("headers={'authorization': 'token ghp_abc'}", f"headers={{'authorization': '{MASKED}'}}"),
    ],
)
def test_a_secret_in_an_environment_dump_a_setting_or_a_header_is_masked(text, masked):
    """An env's tool that failed printing its environment (or a config file, a request's
    headers) put the S3 secret key, API keys and tokens into a rollout's ``error`` as they were:
    only URL user info, presigned URLs' parameters and AWS key ids were masked."""
    assert redact(text) == masked


def test_settings_that_only_look_secret_are_kept():
    text = (
        "eos_token=</s> pad_token: <pad> max_tokens=100 MAX_TOKENS=512 TOKENIZERS_PARALLELISM=false "
        "wrong password: try again; the token: expired; Bearer token rejected; variable HF_TOKEN: not set"
    )
    assert redact(text) == text


def test_a_comparison_with_a_secret_looking_name_is_kept():
    # a traceback's source line compares, it sets nothing: `==` is no `=` of a setting
    text = (
        "    assert PAD_TOKEN == 0\n"
        "    if SECRET_KEY==expected: return\n"
        "    if api_key == None: raise\n"
        "    if password==confirm: ok\n"
        "    env['HF_TOKEN'] == token"
    )
    assert redact(text) == text


def test_a_secret_opening_a_line_of_an_errors_repr_is_masked():
    """``said`` logs ``redact(repr(error))``, and a repr writes the message's line breaks as
    ``\\n``: a header or a setting opening a line then followed a letter, not a line's start,
    and was not masked at all (a masked value ran on over the next lines)."""
    message = (
        "tool failed:\nAuthorization: Bearer abc123\nHF_TOKEN=hf_abc\n  GITHUB_TOKEN: ghp_abc\r\n"
        "X-Amz-Security-Token: IQoJb3\nHOME=/root"
    )
    masked = (
        f"tool failed:\nAuthorization: {MASKED}\nHF_TOKEN={MASKED}\n  GITHUB_TOKEN: {MASKED}\r\n"
        f"X-Amz-Security-Token: {MASKED}\nHOME=/root"
    )
    assert redact(repr(RuntimeError(message))) == repr(RuntimeError(masked))


@pytest.mark.parametrize(
    ("text", "masked"),
    [
        # an ASGI scope's headers, and a dict of them as bytes
        (
            "[(b'authorization', b'Bearer abc123'), (b'host', b'gw')]",
            f"[(b'authorization', b'{MASKED}'), (b'host', b'gw')]",
        ),
        ("[('Authorization', 'Bearer abc123')]", f"[('Authorization', '{MASKED}')]"),
        ("{b'Authorization': b'Bearer abc123'}", f"{{b'Authorization': b'{MASKED}'}}"),
        # botocore's prepared request, its headers' values bytes
        (
            "headers={'X-Amz-Security-Token': b'IQoJb3JpZ2lu', 'Authorization': b'AWS4-HMAC-SHA256 "
            "Credential=minioadmin/20260101/us-east-1/s3/aws4_request, Signature=abc'}",
            f"headers={{'X-Amz-Security-Token': b'{MASKED}', 'Authorization': b'{MASKED}'}}",
        ),
        (
            "environ({b'HF_TOKEN': b'hf_abc', b'HOME': b'/root'})",
            f"environ({{b'HF_TOKEN': b'{MASKED}', b'HOME': b'/root'}})",
        ),
    ],
)
def test_a_header_or_a_setting_given_as_bytes_or_in_a_pair_is_masked(text, masked):
    """A header as bytes (an ASGI scope's, botocore's) or as a (name, value) pair kept the
    value whole: the masking took the ``b`` before its quote for the value, or found no
    ``:`` after the name."""
    assert redact(text) == masked


def test_a_bearer_token_outside_an_authorization_header_is_masked():
    """h11 refuses a header value holding a line break (a key read from a file, its newline
    kept) naming the value: the vLLM engine's ``VLLM_API_KEY`` was whole in the gateway's
    error, which names no header."""
    assert redact("LocalProtocolError: Illegal header value b'Bearer sk-abc123\\n'") == (
        f"LocalProtocolError: Illegal header value b'Bearer {MASKED}\\n'"
    )
    assert redact("auth = 'bearer eyJhbGciOiJIUzI1NiJ9.e30.sig'") == f"auth = 'bearer {MASKED}'"
    text = 'Bearer token rejected; WWW-Authenticate: Bearer realm="api", error="invalid_token"'
    assert redact(text) == text
