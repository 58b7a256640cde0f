"""Task retries: a transient error is retried; a bad config, a bug or a deterministic OS error
(a missing, taken or forbidden path) fails at once."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading
import time
import types
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import httpx
import pytest
import ray.exceptions
from botocore.exceptions import (
    CredentialRetrievalError,
    EndpointConnectionError,
    NoCredentialsError,
    ParamValidationError,
    PartialCredentialsError,
    ProfileNotFound,
)
from deltalake.exceptions import CommitFailedError
from prefect import flow, task
from prefect.server.api.server import SubprocessASGIServer
from prefect.settings import PREFECT_API_URL, PREFECT_LOGGING_TO_API_ENABLED, temporary_settings

import flows.run_body
import tasks.report
from storage.weights import VersionTaken
from tasks.common import SIDE_EFFECTS, STORAGE_RETRIES
from tasks.report import ProgressReporter
from tests.flows.conftest import tiny_config
from tests.flows.prefect_api import artifacts_of


@task(**SIDE_EFFECTS, **{**STORAGE_RETRIES, "retry_delay_seconds": 0})
def fails_at_first(error: type[Exception], attempts: Path, failures: int) -> int:
    with attempts.open("a") as out:
        out.write("attempt\n")
    if len(attempts.read_text().splitlines()) <= failures:
        raise error("an early attempt fails")
    return 2


@flow
def calls(error: type[Exception], attempts: Path, failures: int = 1) -> int:
    return fails_at_first(error, attempts, failures)


class NoEndpoint(EndpointConnectionError):
    """botocore's error for an S3 endpoint it cannot reach (no ``OSError``), made with a message."""

    def __init__(self, message: str):
        super().__init__(endpoint_url=message)


class NoCredentials(NoCredentialsError):
    """botocore's error for credentials none of its providers gave, which it raises too when
    the instance metadata service did not answer in time: made with a message (unused)."""

    def __init__(self, message: str):
        super().__init__()


class NotRetrieved(CredentialRetrievalError):
    """botocore's error for a credential provider that failed (STS, a container's endpoint)."""

    def __init__(self, message: str):
        super().__init__(provider="container-role", error_msg=message)


class NoProfile(ProfileNotFound):
    """botocore's error for an ``AWS_PROFILE`` no config file names."""

    def __init__(self, message: str):
        super().__init__(profile=message)


class KeyIdAlone(PartialCredentialsError):
    """botocore's error for a key id given without its secret."""

    def __init__(self, message: str):
        super().__init__(provider="env", cred_var=message)


class BadRequest(ParamValidationError):
    """botocore's error for a request it refuses to send (a bucket name S3 cannot hold)."""

    def __init__(self, message: str):
        super().__init__(report=message)


@pytest.mark.parametrize(
    "error",
    [
        OSError,
        TimeoutError,
        ConnectionError,
        ConnectionResetError,
        BrokenPipeError,
        NoEndpoint,
        NoCredentials,  # on EC2, where the instance metadata service may not answer for a moment
        NotRetrieved,
        aiohttp.ClientPayloadError,  # an S3 download (a weight file, a status) cut short
        CommitFailedError,  # a Delta commit that lost a race
        # a Ray actor, worker or node lost under the task
        ray.exceptions.RayActorError,
        ray.exceptions.WorkerCrashedError,
        ray.exceptions.NodeDiedError,
    ],
)
def test_a_transient_error_is_retried(prefect_api, tmp_path, error):
    assert calls(error, tmp_path / "attempts") == 2


def test_a_transient_error_is_retried_three_times_then_fails_the_task(prefect_api, tmp_path):
    assert calls(ConnectionResetError, tmp_path / "outage", failures=3) == 2
    with pytest.raises(ConnectionResetError):
        calls(ConnectionResetError, tmp_path / "longer", failures=4)
    assert len((tmp_path / "longer").read_text().splitlines()) == 4


@pytest.mark.parametrize(
    "error",
    [
        ValueError,
        KeyError,
        AssertionError,
        FileNotFoundError,
        PermissionError,
        IsADirectoryError,
        NotADirectoryError,
        FileExistsError,
        VersionTaken,
        # botocore's that say its config is wrong: a profile, a key id alone, a bucket name
        NoProfile,
        KeyIdAlone,
        BadRequest,
    ],
)
def test_any_other_error_fails_the_task_at_once(prefect_api, tmp_path, error):
    with pytest.raises(error):
        calls(error, tmp_path / "attempts")
    assert (tmp_path / "attempts").read_text().splitlines() == ["attempt"]


def test_an_unreachable_prefect_api_at_the_last_progress_report_does_not_fail_the_task(
    prefect_api, monkeypatch, caplog
):
    def unreachable(*args, **kwargs):
        raise httpx.ConnectError("Prefect API unreachable for a moment")

    @task(**SIDE_EFFECTS)
    def reports() -> int:
        progress = ProgressReporter("rollouts", total=10)
        update = tasks.report.update_progress_artifact
        monkeypatch.setattr(tasks.report, "update_progress_artifact", unreachable)
        progress.update(5)
        progress.sent()
        progress.update(9, final=True)
        monkeypatch.setattr(tasks.report, "update_progress_artifact", update)
        progress.update(9, final=True)  # taken: a failure after it is warned of again
        monkeypatch.setattr(tasks.report, "update_progress_artifact", unreachable)
        progress.update(10, final=True)
        monkeypatch.setattr(tasks.report, "create_progress_artifact", unreachable)
        ProgressReporter("trainer steps").update(3, final=True)
        return 10

    @flow
    def reporting_flow() -> int:
        return reports()

    assert reporting_flow() == 10
    # warned once each time it starts failing, not for every bar
    assert caplog.text.count("progress artifact of rollouts not updated, the work goes on") == 2
    assert "progress artifact of trainer steps not created" in caplog.text


@pytest.mark.parametrize("stopped_before", ["the_first_bar", "the_reporter"])
def test_progress_does_not_wait_for_a_prefect_api_that_does_not_answer(prefect_api, stopped_before):
    """Prefect's client retries an API it reached once for about a minute while it does not
    answer (its server restarted, or gone). Each bar was sent from the work's own thread: a
    pipeline whose server restarted trained 2 policy steps in the 35 s it was away (7 in the
    10 s before), and one whose server stayed down stood still until the client gave up; the
    bar's artifact was created there too, so a task started meanwhile (rollouts, train)
    waited that long before any work. The bar is created and sent once the API answers
    again. The server is stopped (SIGSTOP) rather than ended: it is the session's."""
    server = SubprocessASGIServer().server_process
    resumed_by_watchdog = threading.Event()

    def resume() -> None:  # where the reporter waits for the server: the test fails instead of hanging
        resumed_by_watchdog.set()
        os.kill(server.pid, signal.SIGCONT)

    @task(**SIDE_EFFECTS)
    def reports() -> bool:
        started = ProgressReporter("steps", total=10) if stopped_before == "the_first_bar" else None
        os.kill(server.pid, signal.SIGSTOP)
        watchdog = threading.Timer(30.0, resume)
        watchdog.start()
        try:
            progress = started or ProgressReporter("steps", total=10)
            progress.update(3)
            waited = resumed_by_watchdog.is_set()
        finally:
            watchdog.cancel()
            os.kill(server.pid, signal.SIGCONT)
        progress.sent()
        return waited

    @flow
    def reporting_flow() -> bool:
        return reports()

    state = reporting_flow(return_state=True)
    assert state.result() is False, "the progress reporter waited for the server to answer"
    bars = {a.description: a.data for a in artifacts_of([state.state_details.flow_run_id])}
    assert bars == {"steps: 3": 30.0}


def test_a_progress_artifact_the_prefect_api_did_not_take_is_created_by_a_later_bar(
    prefect_api, monkeypatch, caplog
):
    """The final bar of a task whose API did not take its artifact at the start creates it."""
    create, refused = tasks.report.create_progress_artifact, []

    def refuses_once(*args, **kwargs):
        if not refused:
            refused.append(kwargs["description"])
            raise httpx.ConnectError("Prefect API unreachable for a moment")
        return create(*args, **kwargs)

    monkeypatch.setattr(tasks.report, "create_progress_artifact", refuses_once)

    @task(**SIDE_EFFECTS)
    def reports() -> None:
        progress = ProgressReporter("steps", total=10)
        progress.sent()
        progress.update(10, final=True)

    @flow
    def reporting_flow() -> None:
        reports()

    state = reporting_flow(return_state=True)
    assert state.is_completed()
    bars = {a.description: a.data for a in artifacts_of([state.state_details.flow_run_id])}
    assert bars == {"steps: 10": 100.0}
    assert refused == ["steps: 0"]
    assert "progress artifact of steps not created, the work goes on" in caplog.text


def clock_and_bars(monkeypatch) -> tuple[dict[str, float], list[tuple[str, float]]]:
    """``tasks.report``'s clocks, read from the returned ``clock`` (``wall`` and ``monotonic``,
    set by hand), and the progress bars it updates, as ``(description, progress)``."""
    clock = {"wall": time.time(), "monotonic": time.monotonic()}
    monkeypatch.setattr(
        tasks.report,
        "time",
        types.SimpleNamespace(time=lambda: clock["wall"], monotonic=lambda: clock["monotonic"]),
    )
    bars: list[tuple[str, float]] = []
    monkeypatch.setattr(
        tasks.report,
        "update_progress_artifact",
        lambda artifact_id, progress, description: bars.append((description, progress)),
    )
    return clock, bars


def test_progress_keeps_its_pace_when_the_wall_clock_is_set_back(prefect_api, monkeypatch, caplog):
    """Paced by the wall clock, progress went silent, its bar and its log lines both, for as
    long as the clock was set back (an hour here: NTP correcting a clock that ran fast), and
    a bar toward a deadline went below 0 %."""
    clock = {"wall": time.time(), "monotonic": time.monotonic()}
    monkeypatch.setattr(
        tasks.report,
        "time",
        types.SimpleNamespace(time=lambda: clock["wall"], monotonic=lambda: clock["monotonic"]),
    )

    @task(**SIDE_EFFECTS)
    def reports() -> None:
        counted = ProgressReporter("rollouts", total=10, every_s=2.0, log_every_s=10.0)
        timed = ProgressReporter("steps", deadline=clock["wall"] + 100.0, every_s=2.0, log_every_s=10.0)
        for count in (1, 2, 3):
            clock["wall"] += 11.0 - (3600.0 if count == 2 else 0.0)
            clock["monotonic"] += 11.0
            counted.update(count)
            timed.update(count)
        counted.sent()
        timed.sent()

    @flow
    def reporting_flow() -> None:
        reports()

    with caplog.at_level(logging.INFO):
        state = reporting_flow(return_state=True)
    assert state.is_completed()
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("rollouts: ")] == [
        "rollouts: 1",
        "rollouts: 2",
        "rollouts: 3",
    ]
    bars = {a.description: a.data for a in artifacts_of([state.state_details.flow_run_id])}
    assert bars == {"rollouts: 3": 30.0, "steps: 3": 0.0}  # its time toward the deadline is set back too
    assert "invalid value" not in caplog.text


def test_progress_toward_a_deadline_set_once_the_work_is_up_counts_from_then(prefect_api, monkeypatch):
    """The rollouts task learns its deadline once its worker is up (``stop.max_seconds`` from
    then): its bar measures the time toward it from that moment, the start-up left out."""
    clock, bars = clock_and_bars(monkeypatch)

    @task(**SIDE_EFFECTS)
    def reports() -> None:
        progress = ProgressReporter("rollouts")
        clock["wall"] += 50.0  # the worker starting up
        progress.time_toward(clock["wall"] + 100.0)
        clock["wall"] += 25.0
        progress.update(1)
        progress.sent()

    @flow
    def reporting_flow() -> None:
        reports()

    assert reporting_flow(return_state=True).is_completed()
    assert bars == [("rollouts: 1", 25.0)]


def test_progress_sends_its_bar_and_log_lines_at_their_pace_and_the_final_one_always(
    prefect_api, monkeypatch, caplog
):
    """A bar at most every ``every_s``, a log line at most every ``log_every_s`` (each at the
    pace exactly), the final update sent and logged at once with its detail; a bar toward a
    total ends at the count (the work may end short of it) and never passes 100 %, one toward
    a deadline ends full, and a deadline already passed at the start shows 0 %."""
    clock, bars = clock_and_bars(monkeypatch)

    def tick(seconds: float) -> None:
        clock["wall"] += seconds
        clock["monotonic"] += seconds

    @task(**SIDE_EFFECTS)
    def reports() -> None:
        counted = ProgressReporter("rollouts", total=10, every_s=2.0, log_every_s=10.0)
        for seconds, count in ((1, 1), (1, 2), (1, 3), (7, 4), (2, 12)):
            tick(seconds)
            counted.update(count, detail="busy")
            counted.sent()  # else a bar handed over while one is sent replaces the one waiting
        tick(0.5)
        counted.update(7, final=True, detail="done")
        timed = ProgressReporter("steps", deadline=clock["wall"] + 100.0)
        tick(10)
        timed.update(1, final=True)
        late = ProgressReporter("late", deadline=clock["wall"])
        tick(1)
        late.update(1)
        late.sent()

    @flow
    def reporting_flow() -> None:
        reports()

    with caplog.at_level(logging.INFO):
        assert reporting_flow(return_state=True).is_completed()
    assert bars == [
        ("rollouts: 1", 10.0),
        ("rollouts: 3", 30.0),
        ("rollouts: 4", 40.0),
        ("rollouts: 12", 100.0),
        ("rollouts: 7", 70.0),
        ("steps: 1", 100.0),
        ("late: 1", 0.0),
    ]
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith(("rollouts: ", "steps: "))]
    assert logged == ["rollouts: 4 — busy", "rollouts: 7 — done", "steps: 1"]


def test_an_unreachable_prefect_api_at_the_run_report_does_not_fail_the_flow(
    prefect_api, tmp_path, monkeypatch, caplog
):
    """The run's results are in its tables; the report's artifacts failing leaves the
    report's markdown returned and the failure logged. The client gives up on an API it
    reached before after about a minute: the artifacts after the first it gave up on are
    not sent (a server gone for good held the run's end that long for each of them)."""
    attempts = []

    def unreachable(*args, **kwargs):
        attempts.append(kwargs["key"])
        raise httpx.ConnectError("Prefect API unreachable")

    monkeypatch.setattr(tasks.report, "create_table_artifact", unreachable)
    monkeypatch.setattr(tasks.report, "create_markdown_artifact", unreachable)

    @flow
    def reporting_flow() -> str:
        return tasks.report.report_run(tiny_config(tmp_path, "report-blip"))

    assert reporting_flow().startswith("# Run `report-blip`")
    assert attempts == [f"{tasks.report.artifact_key('report-blip')}-evals"]
    assert (
        "a table artifact of run report-blip and the rest of the report not sent: the Prefect API "
        "does not answer: ConnectError('Prefect API unreachable')"
    ) in caplog.text


def test_an_artifact_the_prefect_api_refuses_is_logged_and_the_rest_of_the_report_still_sent(
    prefect_api, tmp_path, monkeypatch, caplog
):
    """An API that answers but refuses one artifact (a 422, say) is no API gone: the report's
    other artifacts are still sent."""
    sent = []

    def refused(*args, **kwargs):
        raise RuntimeError("422 Unprocessable Entity (injected)")

    monkeypatch.setattr(tasks.report, "create_table_artifact", refused)
    monkeypatch.setattr(tasks.report, "create_markdown_artifact", lambda *a, **kw: sent.append(kw["key"]))

    @flow
    def reporting_flow() -> str:
        return tasks.report.report_run(tiny_config(tmp_path, "report-refused"))

    assert reporting_flow().startswith("# Run `report-refused`")
    assert sent == [f"{tasks.report.artifact_key('report-refused')}-report"]
    assert (
        "a table artifact of run report-refused failed, the work goes on: "
        "RuntimeError('422 Unprocessable Entity (injected)')"
    ) in caplog.text


def refused_by_an_api_with_credentials(*args, **kwargs):
    """What Prefect's client raises when the API at a ``PREFECT_API_URL`` holding a user and
    password (basic auth) answers an error: the URL it asked, password included."""
    api = httpx.Client(
        base_url="http://treadle:s3cret-pw@127.0.0.1:4300/api",
        transport=httpx.MockTransport(lambda request: httpx.Response(500, request=request)),
    )
    api.post("/artifacts/").raise_for_status()


def test_an_artifact_refused_by_an_api_whose_url_holds_a_password_is_logged_without_it(
    prefect_api, tmp_path, monkeypatch, caplog
):
    """The warnings quoted the client's error whole, and with it the password of the API's URL,
    to the console and to the flow run's logs."""
    monkeypatch.setattr(tasks.report, "create_progress_artifact", refused_by_an_api_with_credentials)
    monkeypatch.setattr(tasks.report, "create_table_artifact", refused_by_an_api_with_credentials)
    monkeypatch.setattr(tasks.report, "create_markdown_artifact", refused_by_an_api_with_credentials)

    @flow
    def reporting_flow() -> None:
        ProgressReporter("steps", total=10).update(10, final=True)
        tasks.report.report_run(tiny_config(tmp_path, "report-refused"))
        tasks.report.report_evals(tiny_config(tmp_path, "report-refused"))

    assert reporting_flow(return_state=True).is_completed()
    warned = [r.getMessage() for r in caplog.records if "500 Internal Server Error" in r.getMessage()]
    assert any(m.startswith("progress artifact of steps not created") for m in warned), warned
    assert any(m.startswith("a table artifact of run report-refused failed") for m in warned), warned
    assert any(m.startswith("the evals artifact of run report-refused failed") for m in warned), warned
    assert all("http://**********@127.0.0.1:4300/api/artifacts/" in m for m in warned), warned
    assert "s3cret-pw" not in caplog.text


@contextlib.contextmanager
def gone_api() -> Iterator[str]:
    """The API URL of a port bound but never listening: its connections are refused."""
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{closed.getsockname()[1]}/api"


@pytest.mark.parametrize(
    ("report", "what"),
    [(tasks.report.report_run, "the report"), (tasks.report.report_evals, "the evals artifact")],
    ids=["run", "evals"],
)
def test_the_run_report_gives_up_on_a_prefect_api_that_stays_away_after_a_short_wait(
    prefect_api, tmp_path, monkeypatch, caplog, report, what
):
    """A server gone for good at the run's end: Prefect's client waited about a minute for the
    report's first artifact, and about a minute again for the flow run's last state (``treadle
    run`` exited 1 about 2.5 minutes after the work; ``treadle evaluate`` waited as long for
    its evals artifact). The report now waits ``API_BACK_WITHIN_S`` for the API to answer, then
    sends none of its artifacts and has the process's Prefect client stop retrying, so that the
    last state fails at once."""
    attempts = []
    monkeypatch.setattr(tasks.report, "create_table_artifact", lambda *a, **kw: attempts.append(kw["key"]))
    monkeypatch.setattr(tasks.report, "create_markdown_artifact", lambda *a, **kw: attempts.append(kw["key"]))
    monkeypatch.setattr(flows.run_body, "API_BACK_WITHIN_S", 0.5)
    with gone_api() as gone:

        @flow
        def reporting_flow() -> None:
            with temporary_settings({PREFECT_API_URL: gone}):
                report(tiny_config(tmp_path, "report-gone"))

        reporting_flow()
    assert os.environ.get("PREFECT_CLIENT_MAX_RETRIES") == "0"  # the conftest fixture restores it
    assert attempts == []
    assert (
        f"{what} of run report-gone not sent: the Prefect API did not answer within 0.5 s, nor will "
        "the flow run's last state be"
    ) in caplog.text


@pytest.mark.parametrize("fails", [True, False], ids=["fails", "returns"])
def test_a_flow_body_that_ends_gives_up_on_a_prefect_api_that_stays_away(prefect_api, monkeypatch, fails):
    """A flow body that raises, or returns, while the API is gone: Prefect's client retried the
    flow run's last state for about a minute. The body's end asks the API's health, waits
    ``API_BACK_WITHIN_S``, then has the client stop retrying, so that the state fails at once."""
    monkeypatch.setattr(flows.run_body, "API_BACK_WITHIN_S", 0.5)
    with gone_api() as gone:

        @flow
        def ending_flow() -> str:
            with temporary_settings({PREFECT_API_URL: gone}), flows.run_body.run_body():
                if fails:
                    raise ValueError("the work failed")
                return "done"

        if fails:
            with pytest.raises(ValueError, match="the work failed"):
                ending_flow()
        else:
            assert ending_flow() == "done"
    assert os.environ.get("PREFECT_CLIENT_MAX_RETRIES") == "0"  # the conftest fixture restores it


def test_a_flow_body_leaves_the_retries_of_a_prefect_api_that_answers(prefect_api):
    @flow
    def healthy_flow() -> str:
        with flows.run_body.run_body():
            return "done"

    assert healthy_flow() == "done"
    assert "PREFECT_CLIENT_MAX_RETRIES" not in os.environ


def test_a_flow_body_whose_run_gave_up_on_the_prefect_api_does_not_wait_for_it_again(
    prefect_api, monkeypatch, caplog
):
    """The run's report gave up on the API (it stopped the client's retries): the body's end
    does not wait ``API_BACK_WITHIN_S`` for it a second time, nor warn again."""
    monkeypatch.setattr(flows.run_body, "API_BACK_WITHIN_S", 0.5)
    with gone_api() as gone:

        @flow
        def reported_flow() -> str:
            with temporary_settings({PREFECT_API_URL: gone}), flows.run_body.run_body():
                flows.run_body.stop_retrying_prefect_api()  # as the report does
                return "done"

        assert reported_flow() == "done"
    assert "did not answer" not in caplog.text


def test_a_process_that_gave_up_on_the_prefect_api_logs_its_errors_in_one_line_and_others_in_full():
    """Once a run gave up on the API, the flow engine's error for the last state loses its
    traceback (the client's and httpx's frames: about 80 lines) and keeps its line; the flow's
    own errors, a refused connection of its own among them, keep theirs. Logging to the API is
    off, and its errors are not written to stderr."""
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("prefect.flow_runs")
    api = "http://127.0.0.1:4200/api"

    def logged(error: Exception) -> logging.LogRecord:
        try:
            raise error
        except Exception:  # outside a flow run: not for the API, which would warn
            logger.exception(
                "Encountered exception during execution: %r", error, extra={"send_to_api": False}
            )
        return records[-1]

    def refused(url: str) -> httpx.ConnectError:
        return httpx.ConnectError("[Errno 111] Connection refused", request=httpx.Request("PUT", url))

    logger.addHandler(handler)
    try:
        with temporary_settings({PREFECT_API_URL: api}):
            assert logged(refused(f"{api}/flow_runs/x/set_state")).exc_info is not None
        flows.run_body.stop_retrying_prefect_api()
        with temporary_settings({PREFECT_API_URL: api}):
            assert not PREFECT_LOGGING_TO_API_ENABLED.value() and not logging.raiseExceptions
            last_state = logged(refused(f"{api}/flow_runs/x/set_state"))
            own = [
                logged(ValueError("the work failed")),
                logged(refused("http://127.0.0.1:8000/v1/generate")),
            ]
    finally:
        logger.removeHandler(handler)
    assert last_state.exc_info is None and last_state.getMessage() == (
        "Encountered exception during execution: ConnectError('[Errno 111] Connection refused')"
    )
    assert all(record.exc_info is not None for record in own)


def test_a_flow_body_without_a_prefect_api_url_neither_waits_nor_stops_the_retries(caplog):
    """Without an API URL (a flow run against Prefect's ephemeral server) there is no API to wait for."""
    with temporary_settings(restore_defaults={PREFECT_API_URL}), flows.run_body.run_body():
        pass
    assert "PREFECT_CLIENT_MAX_RETRIES" not in os.environ
    assert "did not answer" not in caplog.text


def test_the_run_report_waits_for_a_prefect_api_that_answers_again(prefect_api, tmp_path):
    """A server restarting at the run's end (here stopped, SIGSTOP, and resumed 2 s later)
    gets the report: the run gives up on an API only once it stayed away
    ``API_BACK_WITHIN_S``."""
    server = SubprocessASGIServer().server_process

    @flow
    def reporting_flow() -> str:
        os.kill(server.pid, signal.SIGSTOP)
        resume = threading.Timer(2.0, os.kill, (server.pid, signal.SIGCONT))
        resume.start()
        try:
            return tasks.report.report_run(tiny_config(tmp_path, "report-back"))
        finally:
            resume.cancel()
            os.kill(server.pid, signal.SIGCONT)

    state = reporting_flow(return_state=True)
    assert state.result().startswith("# Run `report-back`")
    keys = {a.key for a in artifacts_of([state.state_details.flow_run_id])}
    assert f"{tasks.report.artifact_key('report-back')}-report" in keys
    assert "PREFECT_CLIENT_MAX_RETRIES" not in os.environ


def test_a_transient_storage_error_at_the_run_report_is_retried(prefect_api, tmp_path, monkeypatch):
    """A nightly training whose report met a transient read error (an S3 503) failed,
    though its training was done; the report is retried as every storage task is."""
    import flows.train
    import tasks.train
    import tasks.weights
    from storage.tables import Tables

    monkeypatch.setattr(tasks.weights, "warm_start", lambda config: 0)
    monkeypatch.setattr(tasks.train, "train", lambda *args: {"steps": 0, "versions": 0})
    read, refused = Tables.read, []

    def fails_once(self, name, *args, **kwargs):
        if not refused:
            refused.append(name)
            raise OSError("503 Slow Down (injected)")
        return read(self, name, *args, **kwargs)

    monkeypatch.setattr(Tables, "read", fails_once)
    state = flows.train.train(tiny_config(tmp_path / "runs", "report-retried"), drain=True, return_state=True)
    assert state.is_completed() and refused == ["train_steps"]
    keys = {a.key for a in artifacts_of([state.state_details.flow_run_id])}
    assert f"{tasks.report.artifact_key('report-retried')}-report" in keys


@pytest.mark.parametrize("role", ["train", "rollouts"])
def test_a_load_that_fails_for_good_is_not_retried_when_its_stopped_status_cannot_be_written(
    prefect_api, tmp_path, monkeypatch, role
):
    """The trainer (or a worker) fails to load with a bug, and the store refuses the status
    saying it stopped (an S3 503): that refusal replaced the bug as the task's error, so the
    task was retried, loading again three times, and failed with the store's error."""
    import tasks.rollout
    import tasks.train
    from storage.status import RolloutStatusBoard, TrainerStatusBoard

    board = TrainerStatusBoard if role == "train" else RolloutStatusBoard
    publish, loads = board.publish, []

    def refuses_the_stopped_status(self, status):
        if not status.running:
            raise OSError("503 Slow Down (injected)")
        publish(self, status)

    def broken(*args, **kwargs):
        loads.append(args)
        raise ValueError("the model has a bug (injected)")

    monkeypatch.setattr(board, "publish", refuses_the_stopped_status)
    monkeypatch.setattr(tasks.train, "Trainer", broken)
    monkeypatch.setattr(tasks.rollout, "_build_worker", broken)
    task = getattr(getattr(tasks, "train" if role == "train" else "rollout"), role)

    @flow
    def loads_once(config):
        once = task.with_options(retry_delay_seconds=0)
        return once(config, time.time() + 600) if role == "train" else once(config)

    with pytest.raises(ValueError, match="injected"):
        loads_once(tiny_config(tmp_path / "runs", f"{role}-fails-to-load"))
    assert len(loads) == 1


def test_a_retried_rollouts_task_of_the_rollout_flow_keeps_its_first_attempts_deadline(
    prefect_api, tmp_path, monkeypatch
):
    """A standalone worker's rollouts task retried after a transient error took a new deadline,
    a whole stop.max_seconds from its retry: each retry lengthened the run. The flow leaves no
    signals behind."""
    import tasks.rollout
    from flows.rollout import rollout
    from tasks.common import run_store
    from tasks.weights import build_base_version

    run_rollouts, ends = tasks.rollout.run_rollouts, []

    def recording(config, deadline, *args, **kwargs):
        def end() -> float:
            ends.append(deadline())
            if len(ends) == 1:
                raise ConnectionResetError("the store dropped the connection (injected)")
            return time.time()  # its deadline recorded, not waited for

        return run_rollouts(config, end, *args, **kwargs)

    monkeypatch.setattr(tasks.rollout, "run_rollouts", recording)
    time_toward, bars_toward = ProgressReporter.time_toward, []

    def bar_toward(progress, deadline):
        bars_toward.append(deadline)
        time_toward(progress, deadline)

    monkeypatch.setattr(ProgressReporter, "time_toward", bar_toward)
    config = tiny_config(
        tmp_path / "runs", "rollout-retried", warm_start={"enabled": False}, stop={"max_seconds": 600.0}
    )
    build_base_version(config, log=lambda line: None)

    state = rollout(config, "w0", return_state=True)

    assert state.is_completed(), state.message
    first, retried = ends
    assert retried == first
    assert bars_toward == [first, first]  # each attempt's progress bar, toward the deadline it runs to
    store = run_store(config)
    assert not store.fs.exists(store.path("status/signals")) or not store.fs.ls(store.path("status/signals"))


@pytest.mark.parametrize("outcome", ["done", "failed"])
def test_a_rollout_flow_whose_signals_cannot_be_removed_keeps_its_result_or_its_error(
    prefect_api, tmp_path, monkeypatch, outcome
):
    """A store that refuses the removal of the flow run's signals leaves them behind with a
    warning: it neither fails a run whose rollouts ended nor replaces their error."""
    import flows.rollout
    import tasks.rollout
    import tasks.weights

    def rollouts(config, worker_name, signals):
        if outcome == "failed":
            raise ValueError("the rollouts failed (injected)")
        return {"worker": worker_name}

    def refused(store, key):
        raise OSError("the store refused the delete (injected)")

    monkeypatch.setattr(tasks.weights, "warm_start", lambda config: None)
    monkeypatch.setattr(tasks.rollout, "rollouts", rollouts)
    monkeypatch.setattr(flows.rollout, "clear_signals", refused)
    config = tiny_config(tmp_path / "runs", "signals-stay", warm_start={"enabled": False})

    state = flows.rollout.rollout(config, "w0", return_state=True)

    if outcome == "done":
        assert state.is_completed(), state.message
        assert state.result() == {"worker": "w0"}
    else:
        assert state.is_failed()
        with pytest.raises(ValueError, match="the rollouts failed"):
            state.result()
