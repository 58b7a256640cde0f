"""The project's module loggers reach the flow run's logs (the Prefect UI)."""

from __future__ import annotations

import logging
import threading
import uuid
import warnings

from prefect import flow
from prefect.context import FlowRunContext
from prefect.logging import handlers
from prefect.logging.handlers import APILogHandler
from prefect.settings import PREFECT_LOGGING_EXTRA_LOGGERS, PREFECT_LOGGING_TO_API_ENABLED, temporary_settings

from flows.maintain import maintain
from flows.run_logs import (
    EVENTS_CLIENT_LOGGER,
    REPEATS_PER_WINDOW,
    SERVICES_LOGGER,
    _RunLogHandler,
    _unsent_event_errors,
    module_logs_to_run,
    one_line_per_unsent_event,
)
from tasks.common import run_store
from tests.flows.conftest import tiny_config
from tests.flows.prefect_api import run_logs


@flow
def noisy() -> str:
    with module_logs_to_run():
        logging.getLogger("rollout.worker").warning("replica r0 is down")
        # a thread the work started has no run context: its record goes to this flow run
        thread = threading.Thread(target=logging.getLogger("storage.heartbeat").error, args=("beat failed",))
        thread.start()
        thread.join()
        with module_logs_to_run():  # nested (a flow inside a flow): sent once, not twice
            logging.getLogger("tasks.train").warning("trainer idle")
        logging.getLogger("somebody.else").warning("not ours")
    logging.getLogger("rl.trainer").warning("after the body")
    return str(FlowRunContext.get().flow_run.id)


def test_module_warnings_of_the_flow_and_its_threads_reach_the_flow_runs_logs():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        flow_run_id = noisy()
    logs = run_logs(flow_run_id)
    ours = [entry for entry in logs if not entry[0].startswith("prefect")]
    assert sorted(ours) == [
        ("rollout.worker", logging.WARNING, "replica r0 is down"),
        ("storage.heartbeat", logging.ERROR, "beat failed"),
        ("tasks.train", logging.WARNING, "trainer idle"),
    ]
    assert not [w for w in caught if "without a flow run id" in str(w.message)]
    # the handler is gone with the flow: a record logged after it goes nowhere near the API
    assert all(not isinstance(h, APILogHandler) for h in logging.getLogger("rollout").handlers)


@flow
def noisy_with_extra_logger() -> str:
    with module_logs_to_run():
        logging.getLogger("rollout.worker").warning("replica r1 is down")
        logging.getLogger("rollout.worker.beat").warning("beat late")
        logging.getLogger("rollout.router").warning("no replica accepts")
    return str(FlowRunContext.get().flow_run.id)


def test_a_module_in_prefects_extra_loggers_is_sent_once():
    """``PREFECT_LOGGING_EXTRA_LOGGERS=rollout.worker`` gives that logger Prefect's own API
    handler: its records (and its children's) reach the flow run once, not a second time
    through the handler on ``rollout``."""
    worker = logging.getLogger("rollout.worker")
    prefects = APILogHandler()
    worker.addHandler(prefects)  # as Prefect's logging setup does for an extra logger
    try:
        with temporary_settings({PREFECT_LOGGING_EXTRA_LOGGERS: "rollout.worker"}):
            flow_run_id = noisy_with_extra_logger()
    finally:
        worker.removeHandler(prefects)
    ours = sorted(entry for entry in run_logs(flow_run_id) if not entry[0].startswith("prefect"))
    assert ours == [
        ("rollout.router", logging.WARNING, "no replica accepts"),
        ("rollout.worker", logging.WARNING, "replica r1 is down"),
        ("rollout.worker.beat", logging.WARNING, "beat late"),
    ]


@flow
def failing_every_rollout() -> str:
    """What the rollout service logs when one env fails every rollout and another once."""
    failed = "rollout %s of %s/%s: %s: %s"
    with module_logs_to_run():
        service = logging.getLogger("rollout.service")
        for i in range(500):
            service.getChild("arith").warning(
                failed, f"r{i}", "arith", i, "env_error", "ValueError during run: bug"
            )
        service.getChild("code").warning(
            failed, "r500", "code", 0, "infra_error", "sandbox start_failed: no bwrap"
        )
        service.warning("replica %s is down", "r0")
    return str(FlowRunContext.get().flow_run.id)


def test_a_warning_repeated_every_rollout_reaches_the_flow_run_a_few_times_and_the_console_every_time(caplog):
    """An environment that fails every rollout logs a warning per rollout: the flow run's
    logs (the Prefect API) take the first few of the minute, the console every one. Each
    env's failures have a logger of their own, so another env's still reach the flow run."""
    flow_run_id = failing_every_rollout()
    ours = [entry for entry in run_logs(flow_run_id) if entry[0].startswith("rollout.service")]
    repeated = [message for name, _, message in ours if name == "rollout.service.arith"]
    assert len(repeated) == REPEATS_PER_WINDOW
    assert "on the worker's console only" in repeated[-1]
    assert [message for name, _, message in ours if name == "rollout.service.code"] == [
        "rollout r500 of code/0: infra_error: sandbox start_failed: no bwrap"
    ]
    assert [message for name, _, message in ours if name == "rollout.service"] == ["replica r0 is down"]
    assert sum(record.name.startswith("rollout.service") for record in caplog.records) == 502


def test_a_flow_run_not_started_by_a_flow_command_logs_one_line_per_unsent_event(tmp_path):
    """A flow run a Prefect worker starts from a deployment goes through no flow command
    (``parse()``), which alone had Prefect's events client log one line per event it cannot
    send: such a run logged two. Every flow's body now filters them, once however many runs
    the process starts."""
    loggers = [logging.getLogger(name) for name in (EVENTS_CLIENT_LOGGER, SERVICES_LOGGER)]
    for logger in loggers:
        logger.removeFilter(_unsent_event_errors)
    config = tiny_config(tmp_path / "runs", "unfiltered")
    store = run_store(config)
    store.fs.makedirs(store.path())  # an empty run: nothing to maintain
    for _ in range(2):
        maintain(config)
    assert [logger.filters.count(_unsent_event_errors) for logger in loggers] == [1, 1]


class Kept(logging.Handler):
    """The messages of the records a logger's filters let through."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_only_the_events_workers_error_right_after_its_clients_warning_on_its_thread_is_dropped():
    """An API away: Prefect's events client warns that it cannot connect and its worker then
    logs the event it failed to send, both in the worker's thread; the error goes. An error
    with no such warning just before it in its thread (another record of the client's, or of
    the thread's, between them), or another service's, is kept."""
    one_line_per_unsent_event()
    client, services = logging.getLogger(EVENTS_CLIENT_LOGGER), logging.getLogger(SERVICES_LOGGER)
    kept = Kept()
    for logger in (client, services):
        logger.addHandler(kept)
    unsent = ("Service %r failed to process item %r", "EventsWorker", "Event(event='treadle.test')")
    try:
        client.warning("Unable to connect to %r. Reason: %s.", "ws://api", "refused")
        services.error(*unsent)  # dropped
        services.error(*unsent)  # no warning just before it
        client.warning("EventsClient(id=%d): %s", 1, "reconnecting")
        services.error(*unsent)  # after another record of the client
        client.warning("Unable to connect to %r. Reason: %s.", "ws://api", "refused")
        other_thread = threading.Thread(target=services.error, args=unsent)
        other_thread.start()
        other_thread.join()
        services.error("Service %r failed to process item %r", "APILogWorker", "log")
        services.error(*unsent)  # the warning was followed by another record of its thread
    finally:
        for logger in (client, services):
            logger.removeHandler(kept)
    warning = "Unable to connect to 'ws://api'. Reason: refused."
    error = "Service 'EventsWorker' failed to process item \"Event(event='treadle.test')\""
    assert kept.messages == [
        warning,
        error,
        "EventsClient(id=1): reconnecting",
        error,
        warning,
        error,
        "Service 'APILogWorker' failed to process item 'log'",
        error,
    ]


def test_a_record_whose_message_cannot_be_formatted_never_raises_at_its_caller(monkeypatch):
    """A logging call does not raise: a record whose arguments do not fit its template goes to
    ``handleError`` (a "--- Logging error ---" on stderr) as any handler's does. The run log
    handler formatted the message itself at its last repeat of the window, outside Prefect's
    ``emit``, and so raised the TypeError into the code that logged it, there alone."""
    handled = []
    handler = _RunLogHandler(uuid.uuid4())
    monkeypatch.setattr(handler, "handleError", handled.append)
    logger = logging.getLogger("rollout.badly_formatted")
    monkeypatch.setattr(logger, "propagate", False)  # pytest's capture handlers raise on such a record
    logger.addHandler(handler)
    try:
        for _ in range(REPEATS_PER_WINDOW):
            logger.warning("replica %d is down", "r0")
    finally:
        logger.removeHandler(handler)
    assert len(handled) == REPEATS_PER_WINDOW


def test_what_a_module_logs_reaches_the_prefect_api_with_its_credentials_masked(monkeypatch):
    """A module's record that quotes an error as it came (``storage.leases``' "could not renew
    lease …: %s", a worker's "could not read …") went to the Prefect API, stored and shown to
    whoever can see the run, with any credentials it held; that copy is masked as the
    project's errors are (``storage.redaction.redact``), its traceback too."""
    sent = []
    monkeypatch.setattr(handlers, "_api_log_sink", sent.append)
    handler = _RunLogHandler(uuid.uuid4())
    logger = logging.getLogger("storage.leaky")
    monkeypatch.setattr(logger, "propagate", False)
    logger.addHandler(handler)
    try:
        with temporary_settings({PREFECT_LOGGING_TO_API_ENABLED: True}):
            try:
                raise OSError("cannot reach https://ci:hunter2@minio.example:9000/runs")
            except OSError as exc:
                logger.warning("could not renew lease %s: %s", "runs/x", exc, exc_info=True)
    finally:
        logger.removeHandler(handler)
    [log] = sent
    assert "could not renew lease runs/x: cannot reach https://" in log["message"]
    assert "OSError" in log["message"]  # the traceback is kept
    assert "hunter2" not in log["message"]
