"""What every flow's body runs in (:func:`run_body`), whether a flow command started it or a
Prefect worker did from a deployment (which goes through no command line), and how a run gives
up on a Prefect API gone for good.

Prefect's client retries a request to an API it reached before for about a minute while it does
not answer: a server gone for good at a run's end held the command that long for the flow run's
last state, after the work was done and in storage. Once the run gave up on the API, Prefect also
printed a page of traceback for that last state and an ``--- Error logging to API ---`` block for
each batch of the run's logs it could not send, before the command's one ``error:`` line."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator

import httpx
from prefect.client.orchestration import get_client
from prefect.context import refresh_global_settings_context
from prefect.settings import PREFECT_API_URL, PREFECT_CLIENT_MAX_RETRIES, temporary_settings

from flows.run_logs import module_logs_to_run, one_line_per_unsent_event

log = logging.getLogger(__name__)

API_BACK_WITHIN_S = 15.0
"""How long a run's end (its report, its last state) waits for a Prefect API that does not
answer (a server restarting) before the run gives up on it."""


def prefect_api_answers(within_s: float, every_s: float = 0.5) -> bool:
    """Whether the Prefect API answers its health check within ``within_s`` seconds, asked
    every ``every_s`` with a client of its own that does not retry (True without an API URL:
    nothing to wait for). An API that answers costs one request."""
    if not PREFECT_API_URL.value():
        return True
    deadline = time.monotonic() + within_s
    while True:
        try:
            with (
                temporary_settings({PREFECT_CLIENT_MAX_RETRIES: 0}),
                get_client(sync_client=True, httpx_settings={"timeout": every_s + 1.0}) as client,
            ):
                if client.api_healthcheck() is None:
                    return True
        except Exception:  # the client could not be made or asked: asked again until the deadline
            pass
        if time.monotonic() >= deadline:
            return False
        time.sleep(every_s)


RUN_LOGGERS = ("prefect.flow_runs", "prefect.task_runs")
"""Where Prefect's engines log a run's error, with its traceback."""


def prefect_api_request(exc: httpx.TransportError) -> bool:
    """Whether ``exc`` failed a request to the Prefect API at PREFECT_API_URL (not one of the
    flow's own connections: an inference server's, the storage's)."""
    api = PREFECT_API_URL.value()
    try:
        url = str(exc.request.url)
    except RuntimeError:  # raised with no request
        return False
    return bool(api) and url.startswith(api.rstrip("/") + "/")


class _ApiErrorsInOneLine(logging.Filter):
    """Drops the traceback of a record whose error is a request to the Prefect API that did not
    go through (the flow engine's "Encountered exception during execution" for the last state),
    and keeps its line: the client's and httpx's frames say nothing the line does not."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, httpx.TransportError) and prefect_api_request(error):
            record.exc_info = record.exc_text = None
        return True


_api_errors_in_one_line = _ApiErrorsInOneLine()


def stop_retrying_prefect_api() -> None:
    """Give up on the Prefect API for the rest of this process: its client gives up on a
    request at its first failure, so that the flow run's last state fails at once where the
    API is gone (the flow command then ends with one line) instead of after about a minute of
    retries; the run's logs are no longer sent to it; and its errors are logged in one line
    each (:class:`_ApiErrorsInOneLine`)."""
    os.environ["PREFECT_CLIENT_MAX_RETRIES"] = "0"
    os.environ["PREFECT_LOGGING_TO_API_ENABLED"] = "false"
    refresh_global_settings_context()
    # Prefect's log worker writes "--- Error logging to API ---" and the error to stderr for
    # each batch of logs queued before now that it fails to send, unless the standard
    # library's switch for errors in logging is off
    logging.raiseExceptions = False
    for name in RUN_LOGGERS:
        logging.getLogger(name).addFilter(_api_errors_in_one_line)


def _give_up_on_a_gone_api() -> None:
    """At a flow's end: stop the client's retries when the API does not answer within
    :data:`API_BACK_WITHIN_S`, unless they are stopped already (the run's report gave up)."""
    # a flow run's settings keep the value they had as it started: the environment tells
    # whether stop_retrying_prefect_api has run since
    stopped = os.environ.get("PREFECT_CLIENT_MAX_RETRIES") == "0" or PREFECT_CLIENT_MAX_RETRIES.value() == 0
    if stopped or prefect_api_answers(API_BACK_WITHIN_S):
        return
    stop_retrying_prefect_api()  # first: the warning is not sent to the API
    log.warning(
        "the Prefect API did not answer within %g s: the flow run's last state will not reach it",
        API_BACK_WITHIN_S,
    )


@contextlib.contextmanager
def run_body() -> Iterator[None]:
    """A flow's body: its modules' records sent to the flow run's logs
    (:func:`~flows.run_logs.module_logs_to_run`), Prefect's events client logging one line per
    event it cannot send (:func:`~flows.run_logs.one_line_per_unsent_event`), and, as the body
    returns or raises an error, the client's retries stopped where the API does not answer (a
    healthy one is asked once), so that the flow run's last state fails at once. An
    interrupted body (Ctrl-C, SIGTERM) does not wait for the API."""
    one_line_per_unsent_event()
    with module_logs_to_run():
        try:
            yield
        except Exception:
            _give_up_on_a_gone_api()
            raise
        _give_up_on_a_gone_api()
