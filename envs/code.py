"""``code``: write a function; hidden unit tests run in the sandbox at EVAL.

User ``write f(x) = x*3+1``; the action is Python source defining ``f``, or a reply holding it
in Markdown code blocks (any language tag or none): then the last block that defines ``f`` at
its top level, else the last block, is the source (:func:`solution_source`). The reward is the
fraction of hidden tests passed, measured in the sandbox by a tester that gives the solution's
interpreter only the inputs and checks its int answers itself. The test run is elastic: it
splits the tests over one forked worker per core it was started on (as many as the sandbox's
process limit leaves room for, one per test at most), and asks the scheduler for
1..``test_cores`` cores, no more than it has workers. A call of ``f`` that runs past its share
of the wall-clock limit (``timeout_s`` over twice the tests: a worker may run them all) fails
its own test; a solution that makes the test run overrun its limits (a loop as it loads, too
much memory or output) scores 0; a tester that never started is the sandbox's failure
(``SandboxError``).
Functions are split by what they compute on the test inputs' range (``(x+2)*2`` is
``x*2+4``), so a function held out for eval never has its twin in train.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import secrets

from pydantic import Field

from envs.base import (
    Env,
    EnvConfig,
    ResourceRequest,
    Split,
    StepResult,
    Task,
    amdahl_efficiency,
    fenced_blocks,
    in_eval_split,
    sample_unique,
    user,
    write_anew,
)
from envs.sandbox import SandboxConfig, SandboxError, python_in_sandbox, started_on

# Processes of the test run besides its workers: bwrap's two, the tester and the runner.
HARNESS_PROCESSES = 4

TEMPLATES = ("x*{a}+{b}", "(x+{a})*{b}", "x%{a}+{b}", "max(x,{a})-{b}", "x*x-{a}", "abs(x-{a})+{b}")
INPUTS = range(-20, 21)
"""Where the hidden tests' inputs are drawn from."""

# The tester holds the tests and a token for each possible score, and prints the one of the
# tests passed; the solution runs in a child interpreter (RUNNER) that is given only the inputs,
# its stdio on /dev/null, and sends back ints over a pipe. Undumpable, the tester keeps its memory
# and its stdout out of the child's reach via /proc; but bwrap's init holds the same output pipe,
# which a sandbox of the worker's own uid may open, and read the tester's lines from before the
# worker does: what it learns (the start token, its own score's) forges no better score.
TESTER = r"""
import ctypes, json, os, subprocess, sys
libc = ctypes.CDLL(None)
if libc.prctl(4, 0) != 0:  # PR_SET_DUMPABLE
    sys.exit("cannot make the tester undumpable")

def drop_capabilities():
    # Root of a user namespace (``unshare -r``) could still trace an undumpable process.
    for cap in range(64):
        libc.prctl(24, cap)  # PR_CAPBSET_DROP

request = json.loads(sys.stdin.readline())
tests, scores = request["tests"], request["scores"]
print(request["started"], "started", flush=True)
read, write = os.pipe()
given, give = os.pipe()  # the inputs: no command-line argument holds more than 128 KiB
args = [str(write), str(given), str(request["max_workers"]), str(request["call_s"])]
child = subprocess.Popen(
    [sys.executable, "-I", "-c", request["runner"], *args],
    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    pass_fds=[write, given], preexec_fn=drop_capabilities,
)
os.close(write)
os.close(given)
try:
    with os.fdopen(give, "w") as pipe:
        json.dump([x for x, _ in tests], pipe)
except BrokenPipeError:  # the runner ended before it read them
    pass
with os.fdopen(read, "rb") as pipe:
    reply = pipe.read()
child.wait()
try:
    results = json.loads(reply)
except ValueError:
    results = None
passed = 0
if isinstance(results, list):
    passed = sum(type(got) is int and got == want for got, (_, want) in zip(results, tests))
print(scores[passed], flush=True)
"""

# Runs the solution on the inputs (read off a pipe the tester writes, closed before the
# solution loads), split over one forked worker per core it was started on (at
# most max_workers); a chunk whose worker cannot be forked (the process limit) runs in the
# runner itself. Writes a JSON list to the pipe: f(x) where that is an int JSON can write
# (Python's int-to-text limit, 4300 digits by default), else null (as for a call that ran
# past call_s seconds).
RUNNER = r"""
import json, os, signal, sys
out, max_workers, call_s = int(sys.argv[1]), int(sys.argv[3]), float(sys.argv[4])
with os.fdopen(int(sys.argv[2])) as given:
    inputs = json.load(given)
namespace = {}
exec(compile(open("solution.py").read(), "solution.py", "exec"), namespace)
f = namespace["f"]

class Overran(BaseException):
    pass

def overran(signum, frame):
    raise Overran()

signal.signal(signal.SIGALRM, overran)

def results(chunk):
    got = []
    for x in chunk:
        try:
            signal.setitimer(signal.ITIMER_REAL, call_s)
            try:
                y = f(x)
                if type(y) is int:
                    str(y)  # past the int-to-text limit: ValueError, as json.dump would raise
            finally:  # within the outer try: the alarm may go off before it is disarmed
                signal.setitimer(signal.ITIMER_REAL, 0)
        except BaseException:
            y = None
        got.append(y if type(y) is int else None)
    return got

def fork_worker(chunk):
    # the read end of a pipe a forked worker writes results(chunk) to; None if no fork is allowed
    read, write = os.pipe()
    try:
        pid = os.fork()
    except BlockingIOError:
        os.close(read)
        os.close(write)
        return None
    if pid == 0:
        os.close(read)
        with os.fdopen(write, "w") as pipe:
            json.dump(results(chunk), pipe)
        os._exit(0)
    os.close(write)
    return read

workers = max(1, min(len(os.sched_getaffinity(0)), len(inputs), max_workers))
chunks = [inputs[i::workers] for i in range(workers)]
merged = [None] * len(inputs)
if workers > 1:
    pipes = [fork_worker(chunk) for chunk in chunks]
    for i, read in enumerate(pipes):
        if read is None:
            merged[i::workers] = results(chunks[i])
            continue
        with os.fdopen(read, "rb") as pipe:
            chunk = pipe.read()
        if chunk:
            merged[i::workers] = json.loads(chunk)
        os.wait()
else:
    merged = results(inputs)
with os.fdopen(out, "w") as pipe:
    json.dump(merged, pipe)
"""


DEFINES_F = re.compile(r"^(def f\b|f\s*=)", re.MULTILINE)


def solution_source(action: str) -> str:
    """The Python source in the model's reply ``action``: its last complete fenced block that
    defines ``f``, else its last complete fenced block, else the whole reply (bare source; a
    block cut by the token limit is no solution either way)."""
    blocks = fenced_blocks(action)
    if not blocks:
        return action
    return next((block for block in reversed(blocks) if DEFINES_F.search(block)), blocks[-1])


def most_workers(sandbox: SandboxConfig) -> int:
    """The most workers a test run forks under the sandbox's process limit (at least one: the
    runner works its chunk itself); a core granted past them would stand idle."""
    return max(1, sandbox.max_processes - HARNESS_PROCESSES)


def split_key(body: str) -> str:
    """The values of ``f(x) = body`` over :data:`INPUTS`: bodies of one function share a split."""
    return ",".join(str(eval(body, {}, {"x": x})) for x in INPUTS)


class CodeConfig(EnvConfig):
    """Test count of ``code``."""

    max_turns: int = Field(1, ge=1, le=1, description="Single turn: the action is the solution.")
    num_tests: int = Field(5, ge=1, le=100, description="Hidden tests per task.")
    eval_fraction: float = Field(0.1, gt=0, lt=1, description="Share of functions held out for eval.")
    test_cores: int = Field(4, ge=1, description="Most cores the test run asks for (one forked worker each).")
    test_serial_fraction: float = Field(
        0.3, ge=0, lt=1, description="Amdahl serial fraction of the test run, declared to the scheduler."
    )


class CodeEnv(Env):
    """Write ``f``; reward = fraction of hidden tests passed (EVAL)."""

    name = "code"
    config_cls = CodeConfig
    makes_sandboxes = True

    @classmethod
    def tasks(cls, split: Split, seed: int, n: int, config: CodeConfig | None = None) -> list[Task]:
        cfg = config or CodeConfig()

        def make(rng: random.Random) -> Task:
            body = rng.choice(TEMPLATES).format(a=rng.randint(2, 9), b=rng.randint(1, 9))
            inputs = [rng.choice(INPUTS) for _ in range(cfg.num_tests)]
            tests = [[x, eval(body, {}, {"x": x})] for x in inputs]
            return Task(
                env=cls.name, id=body, prompt=f"write f(x) = {body}", data={"body": body, "tests": tests}
            )

        def accept(task: Task) -> bool:
            return in_eval_split(split_key(task.data["body"]), cfg.eval_fraction) == (split == "eval")

        return sample_unique(random.Random(f"{seed}/{split}"), make, accept, n)

    @classmethod
    def demonstrate(cls, task: Task, flawed: bool = False, seed: int = 0) -> list[str]:
        """The reference (``flawed``: half the time off by one)."""
        off = flawed and random.Random(f"{seed}/{task.id}").random() < 0.5
        return [f"def f(x): return {task.data['body']}" + ("+1" if off else "")]

    async def reset(self, task: Task) -> list[dict[str, str]]:
        self._start(task)
        require_tests(task)
        await self._new_sandbox()
        self.solution: str | None = None
        return user(task.prompt)

    async def step(self, action: str) -> StepResult:
        self._next_turn()
        self.solution = solution_source(action)
        return self._ended(StepResult([], 0.0, True, 0.0, {"scored_at": "eval"}))

    def eval_request(self) -> ResourceRequest | None:
        """The test run: elastic on 1..``test_cores`` cores, no more than it has workers (one
        per test at most, :func:`most_workers`), Amdahl scaling."""
        tests = len(self._require_task().data["tests"])
        cores = min(self.config.test_cores, most_workers(self.config.sandbox), tests)
        return ResourceRequest(
            elastic="cpu",
            max_units=cores,
            efficiency=amdahl_efficiency(self.config.test_serial_fraction, cores),
            kind="code.test",
        )

    async def evaluate(self) -> float:
        task = self._require_task()
        if self.solution is None or self.sandbox is None:
            return 0.0
        return await asyncio.to_thread(self._score, task, self.solution)

    def _score(self, task: Task, solution: str) -> float:
        sandbox = self.sandbox
        write_anew(sandbox.workdir, "solution.py", solution)
        started = secrets.token_hex(8)
        scores = [secrets.token_hex(8) for _ in range(len(task.data["tests"]) + 1)]
        request = {
            "started": started,
            "scores": scores,
            "tests": task.data["tests"],
            "runner": RUNNER,
            "max_workers": most_workers(sandbox.config),
            "call_s": sandbox.config.timeout_s / (2 * len(task.data["tests"])),
        }
        stdin = json.dumps(request).encode() + b"\n"
        python = python_in_sandbox(sandbox.config)
        try:
            with started_on(self.cores):
                result = sandbox.run([python, "-I", "-c", TESTER], stdin=stdin)
        except SandboxError as exc:
            if not self._by_action(exc):
                raise
            # stopped before the solution ran (an interpreter that cannot start): not its fault
            require_started(exc.output, started)
            return 0.0
        return tester_score(result.output, started, scores)


def require_tests(task: Task) -> None:
    """Raise ValueError unless ``task`` holds at least one test, each an ``[input, int]`` pair:
    a task sent by a client with others made the tester fail or find no test passable, and
    score every solution 0 (no test at all: divide by zero)."""
    tests = task.data.get("tests")
    if not (
        isinstance(tests, list)
        and tests
        and all(isinstance(test, (list, tuple)) and len(test) == 2 and type(test[1]) is int for test in tests)
    ):
        raise ValueError(
            f"code task {task.id!r}: tests must be a non-empty list of [input, expected int] pairs, "
            f"got {tests!r:.200}"
        )


def require_started(output: str, started: str) -> None:
    """Raise :class:`SandboxError` when the tester never printed that it started (its token
    ``started``): the interpreter or the sandbox failed, before any solution ran."""
    if f"{started} started" not in output.splitlines():
        raise SandboxError("start_failed", f"the test harness never started; it printed {output[-200:]!r}")


def tester_score(output: str, started: str, scores: list[str]) -> float:
    """The share of tests passed, told by which of the tokens ``scores`` (one per number of
    tests passed, 0 to all) the tester printed; 0 when it started but did not get to the end
    (the solution brought it down). A tester that never started is no score of the solution,
    so :class:`SandboxError` is raised (:func:`require_started`)."""
    require_started(output, started)
    passed = {token: count for count, token in enumerate(scores)}
    for line in reversed(output.splitlines()):
        if line in passed:
            return passed[line] / (len(scores) - 1)
    return 0.0
