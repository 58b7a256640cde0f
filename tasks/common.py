"""What every task shares: the run's store, retries on transient errors."""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import posixpath
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import aiohttp
from botocore.exceptions import BotoCoreError, ParamValidationError, PartialCredentialsError, ProfileNotFound
from deltalake.exceptions import CommitFailedError
from huggingface_hub.errors import HFValidationError, RepositoryNotFoundError, RevisionNotFoundError
from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.events import emit_event

from flows.config import RunConfig
from storage.config import RunStore
from storage.redaction import redact
from storage.weights import WeightStore

log = logging.getLogger(__name__)

SIDE_EFFECTS = {"cache_policy": NO_CACHE}
"""Task options of every task that writes: never cached."""

TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (
    OSError,
    BotoCoreError,
    aiohttp.ClientError,
    CommitFailedError,
)
"""Errors a second attempt can clear: storage and network I/O (``TimeoutError`` and
``ConnectionError`` are ``OSError``s; deltalake raises its S3 errors as ``OSError``; s3fs
lets aiohttp's through, e.g. ``ClientPayloadError`` for a download a dropped connection cut
short), a Delta commit that lost a race. :func:`is_transient` names those excepted."""

PERMANENT_OS_ERRORS: tuple[type[OSError], ...] = (
    FileNotFoundError,
    FileExistsError,
    PermissionError,
    IsADirectoryError,
    NotADirectoryError,
    ssl.SSLCertVerificationError,
)
"""``OSError``s that say the same on every attempt: a path missing (no weight version, a
model path that does not exist), taken (``VersionTaken``), forbidden or of the wrong kind,
or a server whose certificate this machine does not trust (botocore's ``SSLError`` wraps
one)."""

PERMANENT_ERRNOS = frozenset({errno.EROFS})
"""Errnos of a plain ``OSError`` that say the same on every attempt: a write to a read-only
file system (a local ``storage.root`` on a volume mounted ``ro``; fsspec raises it as a plain
``OSError``, where a forbidden path is a ``PermissionError``)."""

PERMANENT_BOTOCORE_ERRORS: tuple[type[BotoCoreError], ...] = (
    ProfileNotFound,
    PartialCredentialsError,
    ParamValidationError,
)
"""botocore's errors that say its config is wrong, the same on every attempt: an
``AWS_PROFILE`` no config file names, a key id without its secret, a request botocore will not
send (a bucket name S3 cannot hold). Not ``NoCredentialsError``: botocore raises it too when
the instance metadata service did not answer an EC2 machine in time, and an attempt's fresh
client looks again; nor ``CredentialRetrievalError``, a provider (STS, a container's
endpoint) that failed to answer."""


PERMANENT_ERROR_TEXTS = (
    "lacked the necessary privileges",
    "lacked valid authentication credentials",
    "<Code>NoSuchBucket</Code>",
    "invalid peer certificate",
    "received corrupt message of type InvalidContentType",
    "[SSL: WRONG_VERSION_NUMBER]",
)
"""What an ``OSError`` of the storage clients says when the error is the same on every attempt:
deltalake's (it raises every S3 error as a plain ``OSError``) when the server refused the
credentials or what they may do (403, 401), holds no such bucket, or has a certificate this
machine does not trust, as s3fs's errors for them are; and either's when an ``https://``
endpoint answers in plain http (botocore's ``SSLError``: the wrong TLS version; deltalake's: a
corrupt TLS message)."""


PERMANENT_HUB_ERRORS: tuple[type[Exception], ...] = (
    RepositoryNotFoundError,
    RevisionNotFoundError,
    HFValidationError,
)
"""The Hugging Face Hub client's errors that say the same on every attempt: a repo that does
not exist or that the token may not read (``GatedRepoError`` is one), a revision it lacks, an
id that cannot name a repo. transformers raises each as a plain ``OSError`` it causes."""


def _caused_by_hub_refusal(error: BaseException) -> bool:
    """Whether ``error`` or an error that caused it is one of :data:`PERMANENT_HUB_ERRORS`."""
    seen: set[int] = set()
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, PERMANENT_HUB_ERRORS):
            return True
        seen.add(id(cause))
        cause = cause.__cause__
    return False


def is_transient(error: BaseException) -> bool:
    """Whether ``error`` is one a retry can clear (:data:`TRANSIENT_ERRORS` but not
    :data:`PERMANENT_OS_ERRORS`, :data:`PERMANENT_BOTOCORE_ERRORS`, one saying
    :data:`PERMANENT_ERROR_TEXTS` or of :data:`PERMANENT_ERRNOS` nor one caused by
    :data:`PERMANENT_HUB_ERRORS`; or a Ray actor, worker or node lost under a task, not an
    error raised inside one)."""
    wrapped = getattr(error, "kwargs", {}).get("error") if isinstance(error, BotoCoreError) else None
    if (
        isinstance(error, PERMANENT_OS_ERRORS + PERMANENT_BOTOCORE_ERRORS)
        or isinstance(wrapped, ssl.SSLCertVerificationError)
        or _caused_by_hub_refusal(error)
    ):
        return False
    if isinstance(error, OSError) and (
        error.errno in PERMANENT_ERRNOS or any(text in str(error) for text in PERMANENT_ERROR_TEXTS)
    ):
        return False
    if isinstance(error, TRANSIENT_ERRORS):
        return True
    try:
        from ray.exceptions import NodeDiedError, RayActorError, WorkerCrashedError
    except ImportError:
        return False
    return isinstance(error, RayActorError | WorkerCrashedError | NodeDiedError)


def retry_if_transient(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect's ``retry_condition_fn``: retry a failed task run only when what failed it
    is transient; a bad config or a bug fails at once, with its error logged once."""
    error = state.data
    return not isinstance(error, BaseException) or is_transient(error)


STORAGE_RETRIES = {"retries": 3, "retry_delay_seconds": [1, 4, 16], "retry_condition_fn": retry_if_transient}
"""Retries with backoff for transient errors. Every task is safe to run again: shards
commit atomically, processing is idempotent, the trainer resumes exactly from ``LATEST``,
and warm start does nothing once a version exists."""


def said(error: BaseException) -> str:
    """``repr(error)`` for a log line, masked (:func:`storage.redaction.redact`): an error of
    Prefect's client names the URL it asked, with the password ``PREFECT_API_URL`` may hold."""
    return redact(repr(error))


def reporting(callback: Callable[..., None] | None, what: str) -> Callable[..., None] | None:
    """``callback`` made unable to stop the work it reports on (a progress artifact, an
    event: the Prefect API may be unreachable for a moment); its errors are logged."""
    if callback is None:
        return None

    def guarded(*args: Any, **kwargs: Any) -> None:
        try:
            callback(*args, **kwargs)
        except Exception as exc:
            log.warning("%s failed, the work goes on: %s", what, said(exc))

    return guarded


def run_store(config: RunConfig) -> RunStore:
    return RunStore(config.storage, config.run_id)


def deadline_of(config: RunConfig) -> float:
    """The epoch seconds at which ``stop.max_seconds`` from now runs out (inf without one)."""
    return time.time() + config.stop.max_seconds if config.stop.max_seconds else math.inf


@task(name="list-versions", cache_policy=NO_CACHE, **STORAGE_RETRIES)
def published_versions(config: RunConfig) -> list[int]:
    """The run's published weight versions, ascending: a storage read a retry can clear."""
    return WeightStore(run_store(config)).list()


SIGNAL_POLL_S = 1.0
"""How often a task looks for a signal it watches."""
SIGNAL_RETRY_S = (0.5, 1.0, 2.0, 4.0)
"""Waits between the attempts to raise a signal when the store fails."""

_raised_here: set[str] = set()
"""The path of each signal raised in this process and not cleared: its tasks that run as
threads hear one the store refused."""
_raised_here_lock = threading.Lock()


def signals_dir(key: str) -> str:
    """Where the signals of the tasks sharing ``key`` lie, relative to the run."""
    return posixpath.join("status", "signals", key)


def signal_path(key: str, name: str) -> str:
    """Where signal ``name`` of the tasks sharing ``key`` lies, relative to the run."""
    return posixpath.join(signals_dir(key), name)


def send_signal(
    store: RunStore,
    key: str,
    name: str,
    retry_s: tuple[float, ...] = SIGNAL_RETRY_S,
    content: str | None = None,
) -> None:
    """Raise signal ``name`` for the tasks sharing ``key``, wherever they run (threads,
    processes, Ray workers on other machines: the run's store is what they share), holding
    ``content`` (:func:`read_signal`; its name when None).

    A store error is retried after each wait of ``retry_s``, then raised: a task of this
    process (a thread) hears the signal all the same, another runs on to its deadline, or
    for ever without one.
    """
    path = store.path(signal_path(key, name))
    with _raised_here_lock:
        _raised_here.add(path)
    for wait in (*retry_s, None):
        try:
            store.fs.pipe_file(path, (name if content is None else content).encode())
            return
        except Exception as exc:
            if wait is None:
                raise
            log.warning("could not raise signal %r: %s; trying again in %.1f s", name, said(exc), wait)
            time.sleep(wait)


def read_signal(
    store: RunStore, key: str, name: str, retry_s: tuple[float, ...] = SIGNAL_RETRY_S
) -> str | None:
    """What signal ``name`` of ``key`` holds; None while it is not raised, or while its file is
    still being written (empty: a local store's write is not atomic).

    A store error is retried after each wait of ``retry_s``, then raised."""
    for wait in (*retry_s, None):
        try:
            return store.fs.cat_file(store.path(signal_path(key, name))).decode() or None
        except FileNotFoundError:
            return None
        except Exception as exc:
            if wait is None:
                raise
            log.warning("could not read signal %r: %s; trying again in %.1f s", name, said(exc), wait)
            time.sleep(wait)


def deadline_once_started(store: RunStore, key: str, *ends: threading.Event | None) -> float | None:
    """The run's deadline, which the rollouts task sharing ``key`` raises in signal ``started``
    once its worker is up (looked for every :data:`SIGNAL_POLL_S`); None once one of ``ends``
    is set first: the run ends before its worker came up (its rollouts task failed, or the run
    was stopped)."""
    while (started := read_signal(store, key, "started")) is None:
        if any(end is not None and end.is_set() for end in ends):
            return None
        time.sleep(SIGNAL_POLL_S)
    return float(started)


def clear_signals(store: RunStore, key: str) -> None:
    """Remove the signals of ``key`` once no task watches them."""
    folder = store.path(signals_dir(key))
    with _raised_here_lock:
        _raised_here.difference_update([path for path in _raised_here if posixpath.dirname(path) == folder])
    with contextlib.suppress(FileNotFoundError):
        store.fs.rm(folder, recursive=True)


@contextlib.contextmanager
def watch_signal(store: RunStore, key: str | None, name: str) -> Iterator[threading.Event | None]:
    """An event set once signal ``name`` of ``key`` is raised (None without a key); the
    store is looked at every :data:`SIGNAL_POLL_S` while the block runs.

    An error that says the same on every look (:data:`PERMANENT_OS_ERRORS`,
    :data:`PERMANENT_BOTOCORE_ERRORS`: the signal's file forbidden) sets the event too, so
    that the work ends rather than run on deaf to its end, and is raised once the block ends
    (unless the block raised). Any other is looked past: ending a long run's work on an
    error seen once would cost more than a warning a second."""
    if key is None:
        yield None
        return
    raised, done = threading.Event(), threading.Event()
    path = store.path(signal_path(key, name))
    failed: list[Exception] = []

    def watch() -> None:
        while not done.wait(SIGNAL_POLL_S):
            try:
                if path in _raised_here or store.fs.exists(path):
                    raised.set()
                    return
            except Exception as exc:
                if isinstance(exc, PERMANENT_OS_ERRORS + PERMANENT_BOTOCORE_ERRORS):
                    log.error("cannot look for signal %s at %s, ending the work: %s", name, path, said(exc))
                    failed.append(exc)
                    raised.set()
                    return
                # the store away for a moment: look again next time
                log.warning("could not look for signal %s: %s", name, said(exc))

    watcher = threading.Thread(target=watch, name=f"signal-{name}", daemon=True)
    watcher.start()
    try:
        yield raised
    finally:
        done.set()
        watcher.join()
    if failed:
        raise failed[0]


def run_resource(config: RunConfig) -> dict[str, str]:
    """The resource of the run's events (``treadle.run.<run id>``), which the process
    deployment's trigger matches (deployments/prefect.yaml)."""
    return {"prefect.resource.id": f"treadle.run.{config.run_id}", "treadle.run_id": config.run_id}


def announce_version(config: RunConfig, version: int) -> None:
    """Emit ``treadle.weights.published`` for weight version ``version`` of the run."""
    emit_event(
        event="treadle.weights.published",
        resource=run_resource(config),
        payload={"version": version, "path": WeightStore(run_store(config)).version_url(version)},
    )
