"""What a run shows in the Prefect UI: progress, tables, reward and loss curves."""

from __future__ import annotations

import base64
import hashlib
import io
import logging
import math
import re
import threading
import time
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from typing import Any

import httpx
import pyarrow as pa
import pyarrow.compute as pc
from prefect import get_run_logger, task
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.context import (
    ContextModel,
    FlowRunContext,
    SyncClientContext,
    TaskRunContext,
    get_settings_context,
)

from flows import run_body
from flows.config import RunConfig
from storage.tables import Tables, one_row_per_step
from tasks.common import SIDE_EFFECTS, STORAGE_RETRIES, TRANSIENT_ERRORS, reporting, run_store, said

log = logging.getLogger(__name__)


class ProgressReporter:
    """A progress artifact of a count toward ``total`` (or of elapsed time toward a
    ``deadline`` when there is no total), updated at most every ``every_s`` seconds, and a
    log line (what the console shows while a flow runs) at most every ``log_every_s``.
    The final update is sent and logged whatever the pace; its bar is the count toward
    ``total`` (the work may end short of it), else full.
    The bars are sent by a thread of their own, so that the work never waits for the Prefect
    API: its client retries an API it reached once for about a minute while it does not
    answer (a server restarted, or gone), and the trainer and the rollout worker's status
    stood still meanwhile, and a task started while it did not answer waited that long before
    any work. The thread creates the artifact (at 0) first; a bar handed over while one is
    being sent replaces any still waiting, and one sent while the artifact is not created
    (the API did not take it) creates it at that bar. The final bar is waited for, so that it
    lands before the task ends (sent with a client that never reached the API, it fails at
    once where no server listens). An artifact the Prefect API fails to take is logged
    (once, until one is taken again) and skipped, never raised."""

    def __init__(
        self,
        description: str,
        total: int | None = None,
        deadline: float | None = None,
        every_s: float = 2.0,
        log_every_s: float = 10.0,
    ):
        self.description = description
        self.total = total
        self.deadline = deadline if deadline is not None and math.isfinite(deadline) else None
        self.started = time.time()  # the deadline's clock (epoch seconds, shared by the run's tasks)
        self.every_s = every_s
        self.log_every_s = log_every_s
        # paced by the monotonic clock: by the wall clock, one set back silenced them for as long
        self._last = -math.inf
        self._last_log = time.monotonic()
        self.logger = get_run_logger()
        self.artifact_id = None
        # this task run's settings (its API) and runs (the artifact's links), for the sender
        self._contexts = [
            c for c in (get_settings_context(), FlowRunContext.get(), TaskRunContext.get()) if c is not None
        ]
        self._lock = threading.Lock()
        self._waiting: tuple[float, str] | None = None  # the newest bar not sent yet
        self._sender: threading.Thread | None = None  # alive while it has bars to send
        self._failing = False
        with self._lock:
            self._send(first=(0.0, f"{description}: 0"))

    def time_toward(self, deadline: float) -> None:
        """Measure elapsed time toward ``deadline`` from now: a deadline set once the work is up."""
        self.started = time.time()
        self.deadline = deadline if math.isfinite(deadline) else None

    def _percent(self, count: int) -> float:
        if self.total:
            return min(100.0, 100.0 * count / self.total)
        if self.deadline and self.deadline > self.started:
            elapsed = (time.time() - self.started) / (self.deadline - self.started)
            return min(100.0, max(0.0, 100.0 * elapsed))
        return 0.0

    def update(self, count: int, final: bool = False, detail: str = "") -> None:
        now = time.monotonic()
        if final or now - self._last_log >= self.log_every_s:
            self._last_log = now
            self.logger.info("%s: %d%s", self.description, count, f" — {detail}" if detail else "")
        if not final and now - self._last < self.every_s:
            return
        self._last = now
        bar = (100.0 if final and not self.total else self._percent(count), f"{self.description}: {count}")
        with self._lock:
            self._waiting = bar
            self._send()
        if final:
            self.sent()

    def _send(self, first: tuple[float, str] | None = None) -> None:
        """Start the sender unless it is alive, sending ``first`` (never replaced), then the bar
        waiting; called holding the lock."""
        if self._sender is None:
            self._sender = threading.Thread(
                target=self._send_waiting,
                args=([c.model_copy() for c in self._contexts], first),  # each entered once, by its thread
                name=f"progress of {self.description}",
                daemon=True,
            )
            self._sender.start()

    def _send_waiting(self, contexts: list[ContextModel], bar: tuple[float, str] | None) -> None:
        """Send ``bar``, then the bar waiting until none is left, each with a Prefect client of
        its own, in ``contexts`` (entered here), creating the artifact while it is not: the
        task run's is closed with its flow run, which may end first, and one that reached the
        API before waits for it to answer again (a minute where it is gone)."""
        with ExitStack() as entered:
            for context in contexts:
                entered.enter_context(context)
            while True:
                with self._lock:
                    if bar is None:
                        bar, self._waiting = self._waiting, None
                    if bar is None:
                        self._sender = None
                        return
                creating = self.artifact_id is None
                try:
                    with SyncClientContext():
                        if creating:
                            self.artifact_id = create_progress_artifact(bar[0], description=bar[1])
                        else:
                            update_progress_artifact(self.artifact_id, bar[0], description=bar[1])
                except Exception as exc:
                    if not self._failing:
                        self.logger.warning(
                            "progress artifact of %s not %s, the work goes on: %s",
                            self.description,
                            "created" if creating else "updated",
                            said(exc),
                        )
                    self._failing = True
                else:
                    self._failing = False
                bar = None

    def sent(self) -> None:
        """Wait until the bars handed over so far are sent, or failed."""
        with self._lock:
            sender = self._sender
        if sender is not None:
            sender.join()


REPORT_STEPS = 50
"""Policy steps the report's table lists, the latest."""


def shards_by_worker(shards: pa.Table) -> list[dict[str, Any]]:
    """One row per kind and worker of the ``shards`` table: shards, rows, tokens, the range
    of versions generated and the last commit (a run of days commits tens of thousands of
    shards, too many for one artifact)."""
    if shards.num_rows == 0:
        return []
    generated = pc.greater_equal(shards.column("min_version"), 0)
    shards = shards.set_column(
        shards.schema.get_field_index("min_version"),
        "min_version",
        pc.if_else(generated, shards.column("min_version"), None),
    )
    grouped = shards.group_by(["kind", "worker"]).aggregate(
        [
            ("shard_id", "count"),
            ("num_rows", "sum"),
            ("num_tokens", "sum"),
            ("min_version", "min"),
            ("max_version", "max"),
            ("committed_at", "max"),
        ]
    )
    rows = grouped.sort_by([("kind", "ascending"), ("worker", "ascending")]).to_pylist()
    return [
        {
            "kind": r["kind"],
            "worker": r["worker"],
            "shards": r["shard_id_count"],
            "rows": r["num_rows_sum"],
            "tokens": r["num_tokens_sum"],
            "min_version": r["min_version_min"],
            "max_version": r["max_version_max"] if r["max_version_max"] >= 0 else None,
            "last_commit": r["committed_at_max"].isoformat(),
        }
        for r in rows
    ]


def _rows(table, columns: list[str]) -> list[dict[str, Any]]:
    return table.select([c for c in columns if c in table.column_names]).to_pylist()


_MARKDOWN_SPECIAL = re.compile(r"([\\`*_\[\]<>|!&~])")
"""What starts markdown's inline syntax or splits a table cell; a backslash makes each literal."""


def _text(value: str) -> str:
    """``value`` as literal markdown text, on one line: a ``|`` would split a table cell, a
    line break end the row, a ``*`` or ``_`` start emphasis."""
    return _MARKDOWN_SPECIAL.sub(r"\\\1", " ".join(value.splitlines()))


def _link(url: str) -> str:
    """A markdown link to ``url``, shown as itself: its destination in ``<…>``, where a space
    or a parenthesis of a local root (``/data/my runs (old)``) does not end it."""
    destination = re.sub(r"([<>\\])", r"\\\1", url)
    return f"[{_text(url)}](<{destination}>)"


def _loss(value: float | None) -> str:
    """A loss for the report's table; a dash where there is none (no critic in GRPO mode)."""
    return "—" if value is None else f"{value:.4f}"


def curves_png(steps, evals) -> bytes:
    """A PNG of reward and losses per policy step, and held-out reward per version."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    step = steps.column("step").to_pylist()
    axes[0].plot(step, steps.column("reward_mean").to_pylist(), marker=".")
    axes[0].set(title="reward of the trained data", xlabel="policy step")
    # marked: a line through one step's point draws nothing
    axes[1].plot(step, steps.column("policy_loss").to_pylist(), marker=".", label="policy")
    if steps.column("value_loss").null_count < steps.num_rows:  # GRPO has no critic: no line to name
        axes[1].plot(step, steps.column("value_loss").to_pylist(), marker=".", label="value")
    axes[1].set(title="losses", xlabel="policy step")
    axes[1].legend()
    envs = sorted(set(evals.column("env").to_pylist()))
    lines = []
    for env in envs:
        rows = evals.filter(pc.equal(evals.column("env"), env))
        lines += axes[2].plot(
            rows.column("version").to_pylist(), rows.column("reward").to_pylist(), marker="o"
        )
    axes[2].set(title="held-out reward", xlabel="weight version")
    if evals.num_rows:  # a run not evaluated yet has no line to name
        # named as given: a label from the lines drops a name starting with "_", and two "$"
        # make the name math markup (one that does not parse failed the report)
        for text in axes[2].legend(lines, envs).get_texts():
            text.set_parse_math(False)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90)
    plt.close(fig)
    return buffer.getvalue()


def artifact_key(run_id: str) -> str:
    """The run's artifact key prefix: Prefect keys hold lowercase letters, digits and dashes
    only, so a hash of the exact run id keeps runs such as ``exp_1`` and ``Exp.1`` apart."""
    slug = re.sub(r"[^a-z0-9-]", "-", run_id.lower())
    return f"{slug}-{hashlib.sha256(run_id.encode()).hexdigest()[:8]}"


EVALS_COLUMNS = ["version", "env", "reward", "count"]
"""The columns of the ``evals`` table the run's artifacts show."""

STEPS_COLUMNS = ["step", "version", "reward_mean", "policy_loss", "value_loss", "masked_fraction", "kl"]
"""The columns of the ``train_steps`` table the report shows (not the trajectory ids: a long
run's would be most of what is read)."""


EVALS_DECIMALS = 4
"""Decimals of the rewards the evals artifact shows: a float32 reward's further digits are
noise of the conversion (0.43 reads back as 0.4300000071525574)."""


def latest_evals(evals: pa.Table, setups: Mapping[str, str] | None = None) -> pa.Table:
    """The ``evals`` rows that stand, by version then env: of a version's evaluations of an
    env, the one measured last under the run's setup (``setups``, env -> its
    ``tasks.weights.eval_setup``, as a rerun reuses: the curve compares versions measured
    alike), else the one measured last (``treadle inspect`` names each setup's latest). A
    version evaluated again was two rows and two points at one version, neither saying which
    stands."""

    def rank(row: dict) -> tuple[bool, Any]:
        # an env out of the mix has no setup of the run's: a row recorded without one is not its
        own = setups is not None and row["env"] in setups and row.get("setup") == setups[row["env"]]
        return own, row["time"]

    latest: dict[tuple[int, str], dict] = {}
    for row in evals.to_pylist():
        key = (row["version"], row["env"])
        if key not in latest or rank(row) >= rank(latest[key]):
            latest[key] = row
    return pa.Table.from_pylist([latest[key] for key in sorted(latest)], schema=evals.schema)


def run_setups(config: RunConfig) -> dict[str, str] | None:
    """The setup each env of the run's mix is evaluated with (``tasks.weights.eval_setup``);
    None, logged, when its held-out tasks cannot be listed (a dataset gone)."""
    from tasks.weights import eval_setup, held_out_tasks  # torch: not for a flow's --help

    try:
        tasks = held_out_tasks(config)
        return {env: eval_setup(config, env, tasks[env]) for env in tasks}
    except Exception as exc:
        log.warning("the report shows each version's latest evaluation, whatever its setup: %s", said(exc))
        return None


def _create_evals_artifact(config: RunConfig, evals: pa.Table) -> None:
    create_table_artifact(
        [{**r, "reward": round(r["reward"], EVALS_DECIMALS)} for r in _rows(evals, EVALS_COLUMNS)],
        key=f"{artifact_key(config.run_id)}-evals",
        description="Held-out reward per weight version and env, its latest measurement",
    )


def _prefect_api_gone(what: str) -> bool:
    """Whether the Prefect API stays away past ``run_body.API_BACK_WITHIN_S`` at a run's end,
    where ``what`` (that run's report) is to be sent: then it is not, said once, and the
    process's client stops retrying (each request would wait about a minute)."""
    if run_body.prefect_api_answers(run_body.API_BACK_WITHIN_S):
        return False
    run_body.stop_retrying_prefect_api()  # first: the warning is not sent to the API
    log.warning(
        "%s not sent: the Prefect API did not answer within %g s, nor will the flow run's last state be",
        what,
        run_body.API_BACK_WITHIN_S,
    )
    return True


def report_evals(config: RunConfig) -> None:
    """The run's keyed evals table artifact, from its ``evals`` table now, unless the Prefect
    API stays away (:func:`_prefect_api_gone`). An error reading the table or from the Prefect
    API is logged, never raised: it comes once the evaluation is recorded, and a failed flow
    run, run again, would record it a second time."""
    if _prefect_api_gone(f"the evals artifact of run {config.run_id}"):
        return

    def publish() -> None:
        _create_evals_artifact(
            config, latest_evals(Tables(run_store(config)).read("evals"), run_setups(config))
        )

    reporting(publish, f"the evals artifact of run {config.run_id}")()


def report_run(config: RunConfig) -> str:
    """Artifacts of the run so far: eval and shard tables, and a markdown page with the
    curves and their numbers. The curves' PNG is written to the run's storage and linked,
    and embedded in the page as a data URL: the Prefect UI cannot fetch a local path or an
    ``s3://`` URL, while the page itself is kept by the Prefect API."""
    store = run_store(config)
    tables = Tables(store)
    steps = one_row_per_step(
        tables.read("train_steps", columns=[*STEPS_COLUMNS, "time"]),
        tables.read("weights", columns=["step", "created_at"]),
    )
    evals = latest_evals(tables.read("evals"), run_setups(config))
    shards = tables.read("shards")
    key = artifact_key(config.run_id)
    # the run's results are in its tables already: an API blip here must not fail the run
    unanswered = _prefect_api_gone(f"the report of run {config.run_id}")

    def artifact(create: Callable[..., Any], what: str) -> Callable[..., None]:
        """``create`` guarded, and skipped once the Prefect API left one unanswered: Prefect's
        client waits about a minute for an API it reached before."""

        def guarded(*args: Any, **kwargs: Any) -> None:
            nonlocal unanswered
            if unanswered:
                return
            try:
                create(*args, **kwargs)
            except httpx.TransportError as exc:
                unanswered = True
                log.warning(
                    "%s and the rest of the report not sent: the Prefect API does not answer: %s",
                    what,
                    said(exc),
                )
            except Exception as exc:
                log.warning("%s failed, the work goes on: %s", what, said(exc))

        return guarded

    table_artifact = artifact(create_table_artifact, f"a table artifact of run {config.run_id}")
    markdown_artifact = artifact(create_markdown_artifact, f"the report artifact of run {config.run_id}")
    artifact(_create_evals_artifact, f"a table artifact of run {config.run_id}")(config, evals)
    table_artifact(
        shards_by_worker(shards),
        key=f"{key}-shards",
        description="Committed shards per kind and worker (the shards table lists each one)",
    )
    png_path = "reports/curves.png"
    png = curves_png(steps, evals)
    try:
        with store.fs.open(store.path(png_path), "wb") as out:
            out.write(png)
        stored = f"Curves as stored: {_link(store.url(png_path))}"
    except TRANSIENT_ERRORS as exc:  # the curves are embedded below; a storage error must not fail the run
        log.warning("curves of run %s not written to %s: %s", config.run_id, store.url(png_path), said(exc))
        stored = "Curves not stored (see the run's logs)."
    lines = [
        f"# Run `{config.run_id}`",
        "",
        f"![reward and loss curves](data:image/png;base64,{base64.b64encode(png).decode()})",
        "",
        stored,
        "",
        "## Held-out reward",
        "",
        "The latest measurement of each version and env, under this run's evaluation setup where it has one "
        "(`evals` holds every one).",
        "",
        "| version | env | reward | tasks measured |",
        "|---|---|---|---|",
        *(
            f"| {r['version']} | {_text(r['env'])} | {r['reward']:.3f} | {r['count']} |"
            for r in _rows(evals, EVALS_COLUMNS)
        ),
        "",
        "## Policy steps",
        "",
        f"The last {min(steps.num_rows, REPORT_STEPS)} of {steps.num_rows} (`train_steps` holds every one).",
        "",
        "| step | version | reward | policy loss | value loss | masked | KL |",
        "|---|---|---|---|---|---|---|",
        *(
            f"| {r['step']} | {r['version']} | {r['reward_mean']:.3f} | {r['policy_loss']:.4f} | {_loss(r['value_loss'])} "
            f"| {r['masked_fraction']:.3f} | {r['kl']:.4f} |"
            for r in _rows(
                steps.slice(max(steps.num_rows - REPORT_STEPS, 0)),
                STEPS_COLUMNS,
            )
        ),
    ]
    markdown = "\n".join(lines)
    markdown_artifact(markdown, key=f"{key}-report", description=f"Reward and loss curves of {config.run_id}")
    return markdown


@task(name="report", **SIDE_EFFECTS, **STORAGE_RETRIES)
def report_task(config: RunConfig) -> str:
    """:func:`report_run` with the retries of every task that reads the run's storage: a
    transient read error at the end (an S3 503) failed a run whose work was done."""
    return report_run(config)
