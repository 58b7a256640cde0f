"""Task retries: a transient error is retried, a bad config or a bug fails at once."""

from __future__ import annotations

from pathlib import Path

import pytest
from prefect import flow, task

from tasks.common import SIDE_EFFECTS, STORAGE_RETRIES


@task(**SIDE_EFFECTS, **{**STORAGE_RETRIES, "retry_delay_seconds": 0})
def fails_once(error: type[Exception], attempts: Path) -> int:
    with attempts.open("a") as out:
        out.write("attempt\n")
    if len(attempts.read_text().splitlines()) == 1:
        raise error("first attempt fails")
    return 2


@flow
def calls(error: type[Exception], attempts: Path) -> int:
    return fails_once(error, attempts)


@pytest.mark.parametrize("error", [OSError, TimeoutError, ConnectionError])
def test_a_transient_error_is_retried(prefect_api, tmp_path, error):
    assert calls(error, tmp_path / "attempts") == 2


@pytest.mark.parametrize("error", [ValueError, KeyError, AssertionError])
def test_any_other_error_fails_the_task_at_once(prefect_api, tmp_path, error):
    with pytest.raises(error):
        calls(error, tmp_path / "attempts")
    assert (tmp_path / "attempts").read_text().splitlines() == ["attempt"]
