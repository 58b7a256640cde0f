"""Where a run's data lives: a local folder or an S3 URL (``s3://bucket/prefix``)."""

from __future__ import annotations

import errno
import os
import posixpath
import re
import time
import urllib.parse
import uuid
from collections.abc import Callable
from functools import cached_property

import aiobotocore.session
import botocore.handlers
import fsspec
from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator
from pydantic.json_schema import SkipJsonSchema

from storage.redaction import MASKED, redact

DELTA_UNSAFE = "%[]^|\\"
"""Characters deltalake cannot take in a table's path: it reads ``%XX`` as an escaped
character and a backslash as a separator (the run's tables would go to another folder), and
panics on the others (a ``BaseException`` no handler catches)."""

S3_SCHEMES = ("s3", "s3a")
"""URL schemes ``root`` may use (lower case once validated); any other URL is refused, and a
root without ``://`` is a local folder."""


RUN_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"
"""A run id: letters, digits, ``_ . -``, starting with a letter or digit."""


def run_id_problem(run_id: str) -> str | None:
    """Why ``run_id`` cannot name a run (:data:`RUN_ID_PATTERN`), as one line; None when it can."""
    if re.fullmatch(RUN_ID_PATTERN, run_id):
        return None
    return "run_id may hold letters, digits, '_', '.', '-' and must start with a letter or digit"


def _drops_from_a_url(text: str) -> bool:
    """Whether ``text`` holds what deltalake, parsing an S3 path as a URL, does not take as
    part of the path (s3fs does): a query's ``?``, a fragment's ``#``, or a control character
    (dropped: a tab or a line break)."""
    return any(c in "?#" or ord(c) < 32 or c == "\x7f" for c in text)


def _delta_unsafe(path: str) -> str | None:
    """The first character of ``path`` in :data:`DELTA_UNSAFE`, if any."""
    return next((c for c in path if c in DELTA_UNSAFE), None)


def _unset(value: object) -> bool:
    return value is None


def not_masked(value: SecretStr | None, *, what: str, env: str) -> SecretStr | None:
    """``value``, unless it is :data:`MASKED` (what Prefect hands back for a flow run's secret
    parameter): that is refused, naming ``what`` the secret is and the ``env`` variables the
    worker should read it from instead."""
    if value is not None and value.get_secret_value() == MASKED:
        raise ValueError(
            f"arrived masked, as Prefect stores a flow run's secret parameters: {what} cannot "
            f"travel in flow parameters; give the worker {env} in its environment"
        )
    return value


DELTA_ENV_TOKENS = ("AWS_SESSION_TOKEN", "AWS_TOKEN")
"""Environment variables deltalake takes a session token from whatever key its options give."""

ENDPOINT_ENV = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
"""Environment variables that name an S3 endpoint when ``endpoint_url`` is unset, first
found first, as botocore reads them."""


def checked_endpoint(value: str | None, name: str) -> str | None:
    """The endpoint ``value`` (given as ``name``) with its scheme in lower case; None when
    empty. Refused when it holds credentials or is not an http(s) URL with a host."""
    try:
        netloc = "" if value is None else urllib.parse.urlsplit(value).netloc
    except ValueError:  # an unclosed '[' of an IPv6 host: refused below, naming the field
        netloc = ""
    # botocore writes the endpoint into its errors, which reach logs and flow run states
    if "@" in netloc:
        raise ValueError(
            f"{name} holds credentials (user:password@); give them as access_key_id and "
            "secret_access_key, or as AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY in the environment"
        )
    # deltalake panics on an endpoint without a scheme or with a bad port ("TokioMultiThreadExecutor
    # has crashed"); the value is not echoed: a scheme-less one may hold credentials unnoticed above
    if not value:  # a form's or a shell's empty field: no endpoint, as before the check
        return None
    if not is_http_url(value):
        raise ValueError(
            f"{name} must be an http:// or https:// URL with a host and an optional port, "
            "e.g. http://127.0.0.1:9000"
        )
    parts = urllib.parse.urlsplit(value)
    # in lower case: deltalake's plain-HTTP switch and duckdb's SSL flag go by "http://"
    return parts._replace(scheme=parts.scheme.lower()).geturl()


def is_http_url(value: str) -> bool:
    """Whether ``value`` is an http:// or https:// URL with a host and, if any, a port in 1-65535."""
    try:
        parts = urllib.parse.urlsplit(value)
        return parts.scheme.lower() in ("http", "https") and bool(parts.hostname) and parts.port != 0
    except ValueError:  # a port that is not a number in range, an unclosed '[' of an IPv6 host
        return False


class StorageConfig(BaseModel):
    """Object storage for shards, Delta tables and weight versions.

    Credentials come from this config or from the standard environment variables
    (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, and ``AWS_SESSION_TOKEN`` for
    temporary credentials); they are never logged: the secret fields are ``SecretStr`` and
    ``repr`` hides them.
    """

    # its inputs may hold credentials: errors name the field, never the value
    model_config = ConfigDict(allow_inf_nan=False, extra="forbid", hide_input_in_errors=True)

    root: str = Field(
        "./runs",
        description="Local folder (a leading ~ is the home folder) or S3 URL (s3://bucket/prefix) that holds "
        "every run.",
    )
    endpoint_url: str | None = Field(
        None,
        description="S3 endpoint for MinIO-compatible stores, e.g. http://127.0.0.1:9000; defaults to "
        "AWS_ENDPOINT_URL_S3, else AWS_ENDPOINT_URL.",
    )
    region: str | None = Field(
        None, description="S3 region; defaults to AWS_REGION, else AWS_DEFAULT_REGION, else us-east-1."
    )
    # Left out of the JSON schema, and of a dump while unset: a deployment's form never offers
    # them, and the Prefect server, which stores a run's parameters as sent, refuses a run
    # that carries them (the schema allows no other field).
    access_key_id: SkipJsonSchema[SecretStr | None] = Field(
        None,
        description="S3 key id, set with secret_access_key or not at all; defaults to AWS_ACCESS_KEY_ID.",
        exclude_if=_unset,
    )
    secret_access_key: SkipJsonSchema[SecretStr | None] = Field(
        None,
        description="S3 secret, set with access_key_id or not at all; defaults to AWS_SECRET_ACCESS_KEY.",
        exclude_if=_unset,
    )
    session_token: SkipJsonSchema[SecretStr | None] = Field(
        None,
        description="S3 session token of temporary credentials, set only with access_key_id and "
        "secret_access_key; defaults to AWS_SESSION_TOKEN when the key id and secret come from the environment too.",
        exclude_if=_unset,
    )
    connect_timeout: float = Field(
        5.0, gt=0, description="Seconds to wait for an S3 connection before failing."
    )
    read_timeout: float = Field(
        60.0, gt=0, description="Seconds to wait for an S3 response (per attempt) before failing."
    )
    retries: int = Field(
        3,
        ge=0,
        description="Retries of a failed S3 request after its first attempt before the error is raised.",
    )

    @field_validator("root")
    @classmethod
    def _root_is_a_folder_or_s3(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("root must name a folder or URL")
        scheme, url, rest = value.partition("://")
        if not url:  # as a shell would: root ~/runs made a folder named '~' in the current one
            value = os.path.expanduser(value)
        head, colon, _ = value.partition(":")
        if not url and colon and head.lower() in S3_SCHEMES:
            # a local folder (./s3:/bucket) would keep each worker's data on its own disk;
            # not echoed: without its slashes, user:secret@ goes unnoticed below
            raise ValueError("root starts with an S3 scheme but is no S3 URL; write s3://bucket/prefix")
        # checked before anything that names the value: it reaches errors, logs and the weights table
        if url and "@" in rest.lstrip("/").split("/", 1)[0]:
            raise ValueError(
                "root holds credentials (user:secret@ before the bucket); give them as access_key_id and "
                "secret_access_key, or as AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY in the environment"
            )
        # not echoed either: a presigned URL's query holds its signature and session token
        if url and _drops_from_a_url(rest):
            raise ValueError(
                "root holds a '?' or '#', which deltalake reads as the start of a URL's query or fragment "
                "(every table of every run would be one), or a control character, which it drops; write "
                "s3://bucket/prefix"
            )
        if unsafe := _delta_unsafe(value):  # as RunStore refuses it, but at load, naming the field
            raise ValueError(
                f"root {value!r} holds a {unsafe!r}, which deltalake cannot take in a table's path"
            )
        if not url:
            return value
        if scheme.lower() not in S3_SCHEMES:
            raise ValueError(
                f"root {value!r}: unsupported URL scheme {scheme!r}; use a local folder or s3://bucket/prefix"
            )
        rest = rest.rstrip("/")
        if not rest or rest.startswith("/"):
            raise ValueError(f"root {value!r} names no bucket; use s3://bucket/prefix")
        if any(segment in ("", ".", "..") for segment in rest.split("/")):
            # deltalake resolves them (or refuses an empty one), s3fs takes them as written: the
            # tables would not be where the run's shards and weights are
            raise ValueError(f"root {value!r} holds an empty, '.' or '..' segment; write s3://bucket/prefix")
        return f"{scheme.lower()}://{rest}"

    @field_validator("endpoint_url")
    @classmethod
    def _endpoint_is_an_http_url(cls, value: str | None) -> str | None:
        return checked_endpoint(value, "endpoint_url")

    @field_validator("access_key_id", "secret_access_key", "session_token")
    @classmethod
    def _not_masked(cls, value: SecretStr | None) -> SecretStr | None:
        return not_masked(value, what="credentials", env="AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY")

    @model_validator(mode="after")
    def _key_pair_whole(self) -> StorageConfig:
        # s3fs failed at its first request on the missing half, with an obscure error, and
        # deltalake, given no key, used the machine's role instead
        if bool(self.access_key_id) != bool(self.secret_access_key):
            given, missing = ("access_key_id", "secret_access_key")
            if not self.access_key_id:
                given, missing = missing, given
            raise ValueError(
                f"{given} is set but {missing} is not: give both, or neither and set AWS_ACCESS_KEY_ID "
                "and AWS_SECRET_ACCESS_KEY in the environment"
            )
        # without the pair, s3fs and deltalake dropped it and signed as the machine's role; and a
        # token goes with the key it was issued with, as the environment's goes only with its own
        if self.session_token and not self.access_key_id:
            raise ValueError(
                "session_token is set but access_key_id and secret_access_key are not: give the token "
                "with its key pair, or all three as AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and "
                "AWS_SESSION_TOKEN in the environment"
            )
        return self

    @property
    def is_s3(self) -> bool:
        return self.root.startswith(tuple(f"{scheme}://" for scheme in S3_SCHEMES))

    def endpoint(self) -> str | None:
        """The S3 endpoint every client is given: ``endpoint_url``, else one the environment
        names (:data:`ENDPOINT_ENV`). Left to each client, botocore took it from there and
        deltalake too, but refused an http:// one (its plain-HTTP switch is set here), and
        duckdb ignored it."""
        if self.endpoint_url:
            return self.endpoint_url
        for name in ENDPOINT_ENV:
            if endpoint := checked_endpoint(os.environ.get(name), name):
                return endpoint
        return None

    def _credentials(self) -> tuple[str | None, str | None, str | None, str]:
        """Key id, secret, session token and region, each from this config or else the
        environment. An environment token goes only with the environment's key id and
        secret: it belongs to them."""
        key = (
            self.access_key_id.get_secret_value()
            if self.access_key_id
            else os.environ.get("AWS_ACCESS_KEY_ID")
        )
        secret = (
            self.secret_access_key.get_secret_value()
            if self.secret_access_key
            else os.environ.get("AWS_SECRET_ACCESS_KEY")
        )
        if self.session_token:
            token = self.session_token.get_secret_value()
        elif self.access_key_id or self.secret_access_key:
            token = None
        else:
            token = os.environ.get("AWS_SESSION_TOKEN")
        region = (
            self.region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
        )
        return key, secret, token, region

    def secrets(self) -> list[str]:
        """The credentials in use (key id, secret, session token), from this config or the
        environment: what :meth:`redacted` masks, for other text that must not hold them (a
        rollout's ``error``)."""
        key, secret, token, _ = self._credentials()
        return [value for value in (key, secret, token) if value]

    def redacted(self, text: str) -> str:
        """``text`` with the credentials in use masked: AWS echoes the key id and the session
        token in some error bodies (a bad signature, an expired token), and deltalake quotes a
        failed request's body whole. Those of this config or the environment are masked
        wherever they appear; those deltalake found itself (an instance's or a pod's role) in
        the error body's elements that echo them (``storage.redaction.ECHOED_CREDENTIALS``),
        and any AWS key id."""
        if not self.is_s3:
            return text
        return redact(text, self.secrets())

    def filesystem(self) -> fsspec.AbstractFileSystem:
        """A fresh fsspec filesystem for ``root`` (local or s3fs)."""
        if not self.is_s3:
            return fsspec.filesystem("file", auto_mkdir=True)
        key, secret, token, region = self._credentials()
        client_kwargs = {"region_name": region}
        if endpoint := self.endpoint():
            client_kwargs["endpoint_url"] = endpoint
        # botocore asks for "100-continue" before an upload's body, and aiohttp waits for that
        # answer with no timeout: an endpoint that accepts and never answers held it for ever
        session = aiobotocore.session.AioSession()
        session.unregister("before-call.s3", botocore.handlers.add_expect_header)
        fs = fsspec.filesystem(
            "s3",
            session=session,
            key=key,
            secret=secret,
            token=token,
            client_kwargs=client_kwargs,
            config_kwargs={
                "connect_timeout": self.connect_timeout,
                "read_timeout": self.read_timeout,
                "retries": {"max_attempts": self.retries, "mode": "standard"},
            },
            skip_instance_cache=True,
            use_listings_cache=False,
        )
        # botocore makes the attempts configured above; s3fs would repeat each failed call up
        # to 5 times more (a silent endpoint then held a read for ten minutes)
        fs.retries = 1
        return fs

    def delta_options(self) -> dict[str, str]:
        """``storage_options`` for deltalake (object_store keys)."""
        if not self.is_s3:
            return {}
        key, secret, token, region = self._credentials()
        # Conditional put (If-None-Match) makes each Delta commit a put-if-absent, so
        # concurrent writers cannot overwrite each other's commit; unsafe rename could.
        options = {
            "AWS_REGION": region,
            "AWS_CONDITIONAL_PUT": "etag",
            "connect_timeout": f"{round(self.connect_timeout * 1000)}ms",
            "timeout": f"{round(self.read_timeout * 1000)}ms",
            "max_retries": str(self.retries),
        }
        if key and secret:
            options |= {"AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": secret}
            if token:
                options["AWS_SESSION_TOKEN"] = token
            elif any(os.environ.get(name) for name in DELTA_ENV_TOKENS):
                # deltalake would send it with this key, to this endpoint; given empty, it sends an
                # empty token header instead
                options["AWS_SESSION_TOKEN"] = ""
        if endpoint := self.endpoint():
            options["AWS_ENDPOINT_URL"] = endpoint
            if endpoint.startswith("http://"):
                options["AWS_ALLOW_HTTP"] = "true"
        return options


class RunStore:
    """The storage of one run: ``<root>/<run_id>/…`` (see README.md, Storage)."""

    def __init__(self, config: StorageConfig, run_id: str):
        if not run_id or "/" in run_id or run_id in (".", ".."):
            raise ValueError(f"run_id must be a non-empty name without '/', not '.' or '..', got {run_id!r}")
        if config.is_s3 and _drops_from_a_url(run_id):
            raise ValueError(
                f"run_id must hold no '?', '#' or control character on S3 (deltalake takes none of them "
                f"as part of a table's path), got {run_id!r}"
            )
        self.config = config
        self.run_id = run_id
        if unsafe := _delta_unsafe(self.uri):
            raise ValueError(
                f"run {self.uri!r}: its root and run_id must hold no {unsafe!r} (deltalake cannot take "
                f"any of {DELTA_UNSAFE!r} in a table's path)"
            )

    @cached_property
    def fs(self) -> fsspec.AbstractFileSystem:
        return self.config.filesystem()

    @property
    def uri(self) -> str:
        if self.config.is_s3:
            return f"{self.config.root}/{self.run_id}"
        return os.path.abspath(os.path.join(self.config.root, self.run_id))

    def path(self, *parts: str) -> str:
        """Filesystem path (no scheme for s3fs) of ``parts`` inside the run."""
        base = self.uri.split("://", 1)[1] if self.config.is_s3 else self.uri
        return posixpath.join(base, *parts)

    def url(self, *parts: str) -> str:
        """Full URL of ``parts`` inside the run (what deltalake and people are given)."""
        return posixpath.join(self.uri, *parts)

    def create_exclusive(self, path: str, payload: bytes) -> None:
        """Write a new object at ``path`` (a :meth:`path`), raising ``FileExistsError`` when
        one is there: ``O_EXCL`` on a local folder, a conditional PUT (If-None-Match) on S3.
        Two writers racing for one path: exactly one succeeds."""
        if not payload:  # s3fs writes an empty object without the condition
            raise ValueError("create_exclusive needs a non-empty payload")
        if self.config.is_s3:

            def put() -> None:
                with self.fs.open(path, "xb") as out:
                    out.write(payload)

            create_on_s3(path, put)
            return
        # written aside and linked into place: a reader never sees the object empty; on disk
        # before it is linked, and its entry after: a power loss must not leave it there empty
        # (a quota's link that does not parse would refuse every claim of the run for ever)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        temp = f"{path}.tmp-{uuid.uuid4().hex}"
        with open(temp, "wb") as out:
            out.write(payload)
            out.flush()
            os.fsync(out.fileno())
        try:
            os.link(temp, path)
        finally:
            os.unlink(temp)
        fsync_path(os.path.dirname(path))

    def __getstate__(self) -> dict:
        # the filesystem holds live connections (s3fs: an aiobotocore session and its event
        # loop), which do not pickle: a copy sent to another process (a Ray actor) builds its own
        state = dict(self.__dict__)
        state.pop("fs", None)
        return state

    def __repr__(self) -> str:
        return f"RunStore({self.uri!r})"


def fsync_path(path: str) -> None:
    """Flush a local file's (or a folder's: its entries') written data to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


CONFLICT_ATTEMPTS = 6
"""Attempts of an S3 conditional create that the store answers 409 ConditionalRequestConflict."""


def create_on_s3(path: str, create: Callable[[], None]) -> None:
    """Run ``create``, an S3 conditional create (If-None-Match) of ``path``; raise
    ``FileExistsError`` when the store refuses it because ``path`` exists (HTTP 412
    PreconditionFailed).

    s3fs raises ``FileExistsError`` only when the reply names the failed condition, as AWS's
    does; MinIO and other S3-compatible stores answer PreconditionFailed without it, which
    s3fs turns into a plain ``OSError`` (EINVAL). AWS answers 409 ConditionalRequestConflict
    while another write or a delete of the key is in progress (two claimants racing, a lease
    released as another takes it) and asks for a retry, which then stores the object or
    meets the winner's (412): it is tried again, ``CONFLICT_ATTEMPTS`` times in all."""
    for attempt in range(1, CONFLICT_ATTEMPTS + 1):
        try:
            create()
            return
        except FileExistsError:
            raise
        except OSError as exc:
            response = getattr(exc.__cause__, "response", None) or {}
            code = (response.get("Error") or {}).get("Code")
            status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
            if code == "PreconditionFailed" or status == 412:
                raise FileExistsError(errno.EEXIST, f"{path} exists (conditional create refused)") from exc
            if code != "ConditionalRequestConflict" or attempt == CONFLICT_ATTEMPTS:
                raise
        time.sleep(0.05 * 2**attempt)
