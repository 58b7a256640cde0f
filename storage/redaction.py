"""Masking the secrets a text may hold before it leaves the process (an error, a log, a record).

Its own module, without storage's clients, so that the record's schema can use it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

MASKED = "**********"
"""What Prefect stores (and hands back) in place of a ``SecretStr`` parameter's value."""

ECHOED_CREDENTIALS = re.compile(
    r"(?P<open><(?P<tag>AWSAccessKeyId|Token-\d+|StringToSign|StringToSignBytes|CanonicalRequest"
    r"|CanonicalRequestBytes|SignatureProvided)>).*?(?P<close></(?P=tag)>)",
    re.DOTALL,
)
"""Elements of an S3 error body that echo the request's credentials: the key id, the session
token, and what was signed (its canonical request holds the token's header)."""

AWS_KEY_ID = re.compile(r"(?<![A-Z0-9])(?:AKIA|ASIA)[A-Z0-9]{16}(?![A-Z0-9])")
"""An AWS access key id (long-term ``AKIA…``, temporary ``ASIA…``)."""

URL_USER_INFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]{0,31}://)[^\s/?#'\"<>]+@")
"""The user info of a URL (``https://user:password@host``, ``https://token@host``): up to
the authority's last ``@``, as URL parsers take it (a password may hold one)."""

SIGNED_REQUEST = re.compile(
    r"(?P<name>\bX-Amz-(?:Credential|Security-Token|Signature)\s*[=:]\s*)[^\s&#'\"<>]+", re.IGNORECASE
)
"""What makes a presigned S3 URL a credential until it expires (its query's key id, session
token and signature), and a signed request's session token header."""


def redact(text: str, secrets: Iterable[str | None] = ()) -> str:
    """``text`` with each of ``secrets`` masked wherever it appears (the longest first: one
    that holds another is masked whole), the elements of an S3 error body that echo
    credentials (:data:`ECHOED_CREDENTIALS`), a URL's user info (:data:`URL_USER_INFO`), a
    presigned URL's credentials (:data:`SIGNED_REQUEST`) and any AWS key id (:data:`AWS_KEY_ID`)."""
    for value in sorted(filter(None, secrets), key=len, reverse=True):
        text = text.replace(value, MASKED)
    text = ECHOED_CREDENTIALS.sub(rf"\g<open>{MASKED}\g<close>", text)
    text = URL_USER_INFO.sub(rf"\g<scheme>{MASKED}@", text)
    text = SIGNED_REQUEST.sub(rf"\g<name>{MASKED}", text)
    return AWS_KEY_ID.sub(MASKED, text)
