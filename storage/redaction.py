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

_ESCAPED_BREAK = r"(?<=\\[nrt])"
"""Just after a line break or a tab as a repr escapes it (``\\n``): where a line of the
message starts in ``repr(error)``, which ``tasks.common.said`` masks."""
_ESCAPED_LINE_START = r"(?<=\\[nr])"
_VALUE_CHAR = r"(?:[^\\{stop}]|\\(?![nrt]))"
"""One character of a value ending at ``stop`` or at a line break or tab a repr escaped."""

URL_USER_INFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]{0,31}://)[^\s/?#'\"<>]+@")
"""The user info of a URL (``https://user:password@host``, ``https://token@host``): up to
the authority's last ``@``, as URL parsers take it (a password may hold one)."""

_HEADER_NAME_END = r"(?:['\"]?[ \t]*[=:]|['\"][ \t]*,)[ \t]*(?:b?['\"])?"
"""From the end of a header's name to its value: ``: ``, ``=`` in a query, ``': b'`` in a
dict of bytes (botocore's), ``', '`` in a (name, value) pair (an ASGI scope's)."""

SIGNED_REQUEST = re.compile(
    rf"(?P<name>(?:\b|{_ESCAPED_BREAK})X-Amz-(?:Credential|Security-Token|Signature){_HEADER_NAME_END})"
    + _VALUE_CHAR.format(stop=r"\s&#'\"<>")
    + "+",
    re.IGNORECASE,
)
"""What makes a presigned S3 URL a credential until it expires (its query's key id, session
token and signature), and a signed request's session token header."""

_SECRET_ENV_NAME = (
    r"(?:[A-Z0-9]+_)*(?:SECRET|TOKEN|PASSWORD|PASSWD|CREDENTIALS|API_KEY|ACCESS_KEY|SECRET_KEY|PRIVATE_KEY)"
)
_SECRET_SETTING_NAME = (
    r"(?i:aws_secret_access_key|aws_session_token|access_token|refresh_token|client_secret|api_key"
    r"|password)"
)
SECRET_SETTING = re.compile(
    rf"(?P<name>(?:(?<![\w.-])|{_ESCAPED_BREAK})(?:b?(?P<quote>['\"])(?:{_SECRET_ENV_NAME}|{_SECRET_SETTING_NAME})(?P=quote)[ \t]*[:=](?!=)"
    rf"|{_SECRET_ENV_NAME}[ \t]*=(?!=)|(?:(?m:^)|{_ESCAPED_LINE_START})[ \t]*{_SECRET_ENV_NAME}[ \t]*:|{_SECRET_SETTING_NAME}[ \t]*=(?!=))[ \t]*(?:b(?=['\"]))?)"
    r"(?:(?P<open>['\"])[^\n]*?(?P=open)|(?P<unclosed>['\"]?)" + _VALUE_CHAR.format(stop=r"\s'\"&,;") + "+)"
)
"""A secret's value where a name says what it is: an environment's (``AWS_SECRET_ACCESS_KEY=…``,
``'HF_TOKEN': '…'`` in a dump of ``os.environ``, ``GITHUB_TOKEN: …`` opening a line), a
credentials file's or a URL query's setting (``aws_session_token = …``, ``?access_token=…``).
Lower-case names are only these settings' (``eos_token=</s>``, ``max_tokens=100`` are no
secrets), and a name followed by ``:`` is a setting only quoted or opening a line (``wrong
password: try again``, ``variable HF_TOKEN: not set`` are none), and one followed by ``==``
compares (``assert PAD_TOKEN == 0`` in a traceback)."""

AUTHORIZATION = re.compile(
    rf"(?P<name>(?:\b|{_ESCAPED_BREAK})authorization{_HEADER_NAME_END})"
    + _VALUE_CHAR.format(stop=r"'\"\n")
    + "+",
    re.IGNORECASE,
)
"""An ``Authorization`` header's value, whatever its scheme (``Bearer``, ``Basic``, ``token``,
an AWS signature), up to its quote or the line's end."""

BEARER_TOKEN = re.compile(r"(?P<scheme>\b(?i:bearer)[ \t]+)(?=[\w~+/-]*[\d.~+/-])[\w.~+/-]+=*")
"""A bearer token wherever it stands (``Illegal header value b'Bearer …\\n'`` from h11, of a
key that kept its file's newline): a token holds a digit or a punctuation mark, which the
words after "Bearer" in a sentence (``Bearer token rejected``) do not."""


def redact(text: str, secrets: Iterable[str | None] = ()) -> str:
    """``text`` with each of ``secrets`` masked wherever it appears (the longest first: one
    that holds another is masked whole), the elements of an S3 error body that echo
    credentials (:data:`ECHOED_CREDENTIALS`), a URL's user info (:data:`URL_USER_INFO`), a
    presigned URL's credentials (:data:`SIGNED_REQUEST`), a named secret's value
    (:data:`SECRET_SETTING`), an ``Authorization`` header's (:data:`AUTHORIZATION`), a bearer
    token wherever it stands (:data:`BEARER_TOKEN`) and any AWS key id (:data:`AWS_KEY_ID`)."""
    for value in sorted(filter(None, secrets), key=len, reverse=True):
        text = text.replace(value, MASKED)
    text = ECHOED_CREDENTIALS.sub(rf"\g<open>{MASKED}\g<close>", text)
    text = URL_USER_INFO.sub(rf"\g<scheme>{MASKED}@", text)
    text = SIGNED_REQUEST.sub(rf"\g<name>{MASKED}", text)
    text = SECRET_SETTING.sub(_masked_setting, text)
    text = AUTHORIZATION.sub(rf"\g<name>{MASKED}", text)
    text = BEARER_TOKEN.sub(rf"\g<scheme>{MASKED}", text)
    return AWS_KEY_ID.sub(MASKED, text)


def _masked_setting(match: re.Match[str]) -> str:
    quote = match["open"] or ""
    return f"{match['name']}{quote or match['unclosed']}{MASKED}{quote}"
