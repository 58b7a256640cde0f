"""Reading what a run left in the Prefect API: flow runs, artifacts, events."""

from __future__ import annotations

import time
from collections.abc import Callable
from uuid import UUID

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterFlowRunId,
    LogFilter,
    LogFilterFlowRunId,
)
from prefect.client.schemas.objects import Artifact
from prefect.client.schemas.sorting import LogSort
from prefect.events import Event
from prefect.events.filters import EventFilter, EventNameFilter, EventResourceFilter
from prefect.events.worker import EventsWorker
from prefect.logging.handlers import APILogHandler


def artifacts_of(flow_run_ids: list[UUID]) -> list[Artifact]:
    """Every artifact created by these flow runs (their tasks included)."""
    with get_client(sync_client=True) as client:
        response = client.request(
            "POST",
            "/artifacts/filter",
            json={
                "artifacts": ArtifactFilter(
                    flow_run_id=ArtifactFilterFlowRunId(any_=flow_run_ids)
                ).model_dump(mode="json", exclude_unset=True)
            },
        )
    return Artifact.model_validate_list(response.json())


def run_logs(flow_run_id) -> list[tuple[str, int, str]]:
    """Logger name, level and message of every log of a flow run (its tasks' included), oldest
    first (read page by page: the API answers at most a page at a time)."""
    APILogHandler().flush()
    log_filter = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id]))
    logs: list = []
    with get_client(sync_client=True) as client:
        while page := client.read_logs(log_filter=log_filter, offset=len(logs), sort=LogSort.TIMESTAMP_ASC):
            logs += page
    return [(log.name, log.level, log.message) for log in logs]


def read_events(resource_id: str, prefix: str = "treadle.") -> list[Event]:
    """Every event named ``prefix…`` about the resource ``resource_id``."""
    event_filter = EventFilter(
        event=EventNameFilter(prefix=[prefix]), resource=EventResourceFilter(id=[resource_id])
    )
    with get_client(sync_client=True) as client:
        page = client.read_events(event_filter, limit=50)
        events = list(page.events)
        while page.next_page is not None:
            page = client.read_events_page(str(page.next_page))
            events += page.events
    return events


def wait_for_events(
    resource_id: str, done: Callable[[list[Event]], bool], prefix: str = "treadle.", timeout_s: float = 90.0
) -> list[Event]:
    """The events of ``resource_id`` once ``done(events)`` holds (the server stores events
    asynchronously); fails with what arrived when it does not within ``timeout_s``."""
    EventsWorker.drain_all(timeout=30, at_exit=False)
    deadline = time.monotonic() + timeout_s
    while True:
        events = read_events(resource_id, prefix)
        if done(events) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert done(events), f"events of {resource_id} so far: {sorted(e.event for e in events)}"
    return events


def count(events: list[Event], name: str) -> int:
    return sum(event.event == name for event in events)
