"""What every flow's body runs in (:func:`run_body`), whether a flow command started it or a
Prefect worker did from a deployment (which goes through no command line), and how a run gives
up on a Prefect API gone for good.

Prefect's client retries a request to an API it reached before for about a minute while it does
not answer: a server gone for good at a run's end held the command that long for the flow run's
last state, after the work was done and in storage."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator

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


def stop_retrying_prefect_api() -> None:
    """Make this process's Prefect client give up on a request at its first failure, so that
    the flow run's last state fails at once where the API is gone (the flow command then ends
    with one line) instead of after about a minute of retries."""
    os.environ["PREFECT_CLIENT_MAX_RETRIES"] = "0"
    refresh_global_settings_context()


def _give_up_on_a_gone_api() -> None:
    """At a flow's end: stop the client's retries when the API does not answer within
    :data:`API_BACK_WITHIN_S`, unless they are stopped already (the run's report gave up)."""
    # a flow run's settings keep the value they had as it started: the environment tells
    # whether stop_retrying_prefect_api has run since
    stopped = os.environ.get("PREFECT_CLIENT_MAX_RETRIES") == "0" or PREFECT_CLIENT_MAX_RETRIES.value() == 0
    if stopped or prefect_api_answers(API_BACK_WITHIN_S):
        return
    log.warning(
        "the Prefect API did not answer within %g s: the flow run's last state will not reach it",
        API_BACK_WITHIN_S,
    )
    stop_retrying_prefect_api()


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
