"""Each environment end to end with its scripted solver; splits; flawed demonstrators; verifiers."""

import asyncio
import gc
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from envs import code, pytool
from envs.arith import add_without_carry, subtract_without_borrow
from envs.base import Task, TooFewTasks, in_eval_split, sample_unique, stopped
from envs.code import HARNESS_PROCESSES
from envs.dataset import DatasetConfig, make_verifier
from envs.guess import GuessConfig, problems
from envs.pyrepl import PythonRepl
from envs.registry import REGISTRY, demonstrate, make, task_pool, task_set
from envs.sandbox import COMMAND_KINDS, SandboxConfig, SandboxError, bwrap_path
from envs.shell import Shell

SMALL = SandboxConfig(cpu_seconds=5, memory_mb=256, max_processes=32, timeout_s=10)
needs_bwrap = pytest.mark.skipif(bwrap_path() is None, reason="bubblewrap is not installed")


async def play(name, task, actions, **config):
    env = make(name, **config)
    try:
        messages = await env.reset(task)
        assert messages[0]["role"] == "user" and messages[0]["content"] == task.prompt
        result = None
        for action in actions:
            result = await env.step(action)
            assert 0.0 <= result.progress <= 1.0
            if result.done:
                break
        return result, await env.evaluate()
    finally:
        await env.close()


def write_rows(path, rows):
    """A dataset file of ``rows``: Parquet when ``path`` ends in ``.parquet``, else JSON lines."""
    if path.suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        path.write_text("\n".join(map(json.dumps, rows)))


@pytest.mark.parametrize("name", ["arith", "guess", "pytool", "code", "shell"])
def test_splits_are_disjoint_and_reproducible(name):
    train = task_set(name, "train", seed=1, n=20)
    again = task_set(name, "train", seed=1, n=20)
    evals = task_set(name, "eval", seed=1, n=3)
    assert [t.id for t in train] == [t.id for t in again]
    key = (lambda t: (t.prompt, t.data["target"])) if name == "guess" else (lambda t: t.id)
    assert not {key(t) for t in train} & {key(t) for t in evals}


def test_a_split_of_few_tasks_is_found_exhausted_in_draws_proportionate_to_it():
    draws = []

    def make(rng):
        draws.append(1)
        return Task(env="toy", id=str(rng.randrange(300)), prompt="")

    with pytest.raises(TooFewTasks) as exc:
        sample_unique(random.Random(0), make, lambda task: int(task.id) % 10 != 0, 1000)
    assert exc.value.available == 270
    assert len(draws) < 20_000  # 100_000 before


@pytest.mark.parametrize("name", ["arith", "guess"])
def test_scripted_solver_wins(name):
    for task in task_set(name, "train", seed=2, n=10):
        result, score = asyncio.run(play(name, task, demonstrate(task)))
        assert result.done and result.reward == 1.0 and score == 1.0 and result.progress == 1.0


LOSING = {
    "arith": "-1",
    "guess": "-1",
    "pytool": "answer: -1",
    "code": "def f(x): return None",
    "shell": "done",
}


@pytest.mark.parametrize(
    "name", ["arith", "guess", *(pytest.param(n, marks=needs_bwrap) for n in ("pytool", "code", "shell"))]
)
def test_a_step_after_the_episode_is_done_is_refused(name):
    """The scripted solver's actions, played after a lost episode ended, win nothing."""
    task = task_set(name, "train", seed=3, n=1)[0]

    async def run():
        env = make(name, max_turns=1, sandbox=SMALL)
        try:
            await env.reset(task)
            assert (await env.step(LOSING[name])).done
            with pytest.raises(RuntimeError, match="is done; reset before another step"):
                for action in demonstrate(task):
                    await env.step(action)
            return await env.evaluate()
        finally:
            await env.close()

    assert asyncio.run(run()) == 0.0


def test_arith_flawed_drops_carries():
    rng = random.Random(0)
    for _ in range(200):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        assert add_without_carry(a, b, rng, drop=0.0) == a + b
        no_carry = int(
            "".join(str((int(x) + int(y)) % 10) for x, y in zip(f"{a:04d}", f"{b:04d}", strict=True))
        )
        assert add_without_carry(a, b, rng, drop=1.0) == no_carry
    tasks = task_set("arith", "train", seed=3, n=200)
    flawed = sum(demonstrate(t, flawed=True) == demonstrate(t) for t in tasks) / len(tasks)
    assert 0.3 < flawed < 0.95


def test_arith_commuted_twins_share_a_split():
    train = {(t.data["a"], t.data["b"]) for t in task_set("arith", "train", seed=0, n=5000)}
    evals = task_set("arith", "eval", seed=0, n=500)
    assert not [t.prompt for t in evals if (t.data["b"], t.data["a"]) in train]


@pytest.mark.parametrize(
    "op, action, reward, progress",
    [
        ("+", " 47\n", 1.0, 1.0),  # the model's whitespace is not part of its answer
        ("+", "470", 0.0, 0.0),  # the answer and more is wrong
        ("+", "46", 0.0, 0.5),
        ("+", "7", 0.0, 0.5),  # digits aligned from the right: the 7 is right
        ("+", "147", 0.0, 2 / 3),  # an extra digit counts against
        ("+", "74", 0.0, 0.0),
        ("-", "-23", 1.0, 1.0),
        ("-", "23", 0.0, 2 / 3),
        # the number written another way is the number: a sign, a sentence's period, a typeset minus
        ("+", "+47", 1.0, 1.0),
        ("+", "47.", 1.0, 1.0),
        ("+", "047", 1.0, 1.0),
        ("-", "\u221223", 1.0, 1.0),
        ("-", " -23.\n", 1.0, 1.0),
        ("+", "47..", 0.0, 0.0),
        ("+", "4 7", 0.0, 1 / 3),
        ("+", "9" * 5000, 0.0, 0.0),  # past int()'s 4300 digits: wrong, not a ValueError
    ],
)
def test_arith_rewards_the_exact_answer_and_scores_digits_right_from_the_right(op, action, reward, progress):
    task = Task(env="arith", id=f"12{op}35=", prompt=f"12{op}35=", data={"a": 12, "b": 35, "op": op})
    result, score = asyncio.run(play("arith", task, [action]))
    assert result.done and result.reward == score == reward
    assert result.progress == pytest.approx(progress)
    assert result.info == {"expected": 47 if op == "+" else -23}


@pytest.mark.parametrize(
    "data",
    [
        {"a": 3, "b": 4, "op": "*"},
        {"a": "3", "b": "4", "op": "+"},
        {"a": 3, "b": True, "op": "+"},
        {"a": 3.5, "b": 4, "op": "-"},
        {"a": 3, "op": "+"},
    ],
)
def test_arith_task_it_cannot_score_is_refused_at_reset(data):
    """A task sent by a client with another operator was scored as a subtraction (``3*4=``
    rewarded ``-1``), with text operands as their concatenation (``"3"+"4"`` rewarded ``34``);
    a missing operand raised a KeyError at the step."""
    task = Task(env="arith", id="t", prompt="3*4=", data=data)
    with pytest.raises(ValueError, match="arith task 't': data must hold int a and b and op '\\+' or '-'"):
        asyncio.run(make("arith").reset(task))


def test_arith_draws_every_operand_from_zero_to_max_operand():
    config = {"max_operand": 3, "ops": ["+", "-"]}
    drawn = [
        (t.data["a"], t.data["op"], t.data["b"])
        for split in ("train", "eval")
        for t in task_pool("arith", split, 0, 100, config, distinct=True)
    ]
    assert sorted(drawn) == sorted((a, op, b) for a in range(4) for b in range(4) for op in "+-")


@pytest.mark.parametrize(
    "config",
    [{"ops": []}, {"max_turns": 2}, {"eval_fraction": 0.0}, {"eval_fraction": 1.0}, {"max_operand": 0}],
)
def test_arith_config_refuses_out_of_range_settings(config):
    with pytest.raises(ValueError, match=next(iter(config))):
        task_set("arith", "train", 0, 1, config)


def test_pytool_commuted_twins_share_a_split(monkeypatch):
    """The train split's own filter refuses the twin ``b*a%m`` of every eval task ``a*b%m``."""
    filters = []

    def spying(rng, make, accept, n):
        filters.append(accept)
        return sample_unique(rng, make, accept, n)

    monkeypatch.setattr(pytool, "sample_unique", spying)
    task_set("pytool", "train", seed=0, n=1)
    in_train = filters[0]
    evals = task_set("pytool", "eval", seed=0, n=300)
    twins = []
    for task in evals:
        product, modulus = task.data["expr"].split("%")
        a, b = product.split("*")
        twins.append(
            Task(env="pytool", id=f"{b}*{a}%{modulus}", prompt="", data={"expr": f"{b}*{a}%{modulus}"})
        )
    assert not [twin.id for twin in twins if in_train(twin)]


def test_code_functions_written_two_ways_share_a_split():
    """``(x+4)*2`` and ``x*2+8`` are one function: an eval task's is never a train task's."""

    def function(task):
        return tuple(eval(task.data["body"], {}, {"x": x}) for x in range(-20, 21))

    train = {function(task) for task in task_pool("code", "train", seed=0, n=10_000)}
    evals = task_pool("code", "eval", seed=0, n=10_000)
    assert evals and not [task.id for task in evals if function(task) in train]


def test_code_eval_split_holds_about_its_fraction_of_the_functions():
    train, evals = (len(task_pool("code", split, seed=0, n=10_000)) for split in ("train", "eval"))
    assert 0.03 < evals / (train + evals) < 0.25


def test_code_tasks_hold_num_tests_tests_of_their_function():
    for task in task_set("code", "train", seed=4, n=50, config={"num_tests": 7}):
        body = task.data["body"]
        assert task.id == body and task.prompt == f"write f(x) = {body}"
        assert len(task.data["tests"]) == 7
        assert all(-20 <= x <= 20 and want == eval(body, {}, {"x": x}) for x, want in task.data["tests"])


def test_code_flawed_demonstrator_is_off_by_one_about_half_the_time():
    tasks = task_set("code", "train", seed=3, n=200)
    right = [demonstrate(task)[0] for task in tasks]
    flawed = [demonstrate(task, flawed=True)[0] for task in tasks]
    assert all(bad in (good, good + "+1") for good, bad in zip(right, flawed, strict=True))
    assert 0.3 < sum(bad != good for good, bad in zip(right, flawed, strict=True)) / len(tasks) < 0.7


def needs_borrow(a, b):
    a, b = max(a, b), min(a, b)
    return any(int(x) < int(y) for x, y in zip(f"{a:04d}", f"{b:04d}", strict=True))


def test_arith_flawed_subtraction_drops_borrows():
    rng = random.Random(0)
    for _ in range(200):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        assert subtract_without_borrow(a, b, rng, drop=0.0) == a - b
        high, low = max(a, b), min(a, b)
        no_borrow = int(
            "".join(str((int(x) - int(y)) % 10) for x, y in zip(f"{high:04d}", f"{low:04d}", strict=True))
        )
        assert subtract_without_borrow(a, b, rng, drop=1.0) == (no_borrow if a >= b else -no_borrow)
    tasks = task_set("arith", "train", seed=3, n=300, config={"ops": ["-"]})
    wrong = {t.id: demonstrate(t, flawed=True) != demonstrate(t) for t in tasks}
    borrowing = [t.id for t in tasks if needs_borrow(t.data["a"], t.data["b"])]
    assert not [t.id for t in tasks if wrong[t.id] and t.id not in borrowing]
    assert sum(wrong[i] for i in borrowing) / len(borrowing) > 0.5


@pytest.mark.parametrize(
    "config", [{}, {"low": 0, "high": 40, "min_width": 12, "max_width": 12, "eval_fraction": 0.1}]
)
def test_guess_splits_share_numbers_not_problems(config):
    cfg = GuessConfig(**config)
    train, evals = problems(cfg, "train"), problems(cfg, "eval")
    assert not set(train) & set(evals)
    windows = {(low, high) for low, high, _ in train + evals}
    assert set(train) | set(evals) == {(lo, hi, t) for lo, hi in windows for t in range(lo, hi + 1)}
    numbers = range(cfg.low, cfg.high + 1)
    appearances = {n: sum(lo <= n <= hi for lo, hi in windows) for n in numbers}
    in_train, in_eval = ({t for *_, t in split} for split in (train, evals))
    for n in numbers:
        assert (n in in_train and n in in_eval) == (appearances[n] > 1)
    assert abs(len(evals) / (len(train) + len(evals)) - cfg.eval_fraction) < 0.05
    sampled = task_set("guess", "eval", seed=0, n=300, config=config)
    assert {(t.data["low"], t.data["high"], t.data["target"]) for t in sampled} <= set(evals)
    assert all(t.prompt == f"guess {t.data['low']}-{t.data['high']}" for t in sampled)


@pytest.mark.parametrize(
    "config",
    [
        {},
        {"low": 0, "high": 15, "min_width": 2, "max_width": 16, "eval_fraction": 0.9},
        {"eval_fraction": 0.37},
    ],
)
def test_guess_splits_match_a_reference_listing_ranked_by_hash(config):
    """Every window of ``min_width..max_width`` numbers inside ``low..high``, with each of its
    numbers; per number, the ``round(eval_fraction * count)`` (at least 1, never all) of its
    windows ranked first by hash are eval."""
    cfg = GuessConfig(**config)
    mine = {}
    for lo in range(cfg.low, cfg.high + 1):
        for hi in range(lo, cfg.high + 1):
            if cfg.min_width <= hi - lo + 1 <= cfg.max_width:
                for t in range(lo, hi + 1):
                    mine.setdefault(t, []).append((lo, hi, t))
    want = {"train": set(), "eval": set()}
    for windows in mine.values():
        ranked = sorted(
            windows, key=lambda p: hashlib.sha256(f"guess/{p[0]}-{p[1]}/{p[2]}".encode()).digest()
        )
        held = min(max(1, round(cfg.eval_fraction * len(ranked))), len(ranked) - 1)
        want["eval"] |= set(ranked[:held])
        want["train"] |= set(ranked[held:])
    for split in ("train", "eval"):
        got = problems(cfg, split)
        assert got == sorted(want[split])


def test_guess_config_takes_windows_up_to_the_whole_range_and_a_million_problems():
    assert GuessConfig(low=1, high=16, min_width=8, max_width=16).max_width == 16
    assert GuessConfig(low=1, high=8124, min_width=125, max_width=125).max_width == 125  # 8000 * 125


def test_guess_a_split_with_no_problem_is_a_clear_error():
    """One window as wide as the range: each number has one problem, never held out."""
    config = {"low": 1, "high": 8, "min_width": 8, "max_width": 8}
    train = task_set("guess", "train", 0, 20, config)  # its 8 problems, repeated under distinct ids
    assert len({t.id for t in train}) == 20 and len({t.data["target"] for t in train}) == 8
    with pytest.raises(ValueError, match="the eval split of guess 1-8 is empty"):
        task_set("guess", "eval", 0, 3, config)


def test_guess_feedback_never_widens_the_window_and_reads_a_padded_or_negative_number():
    task = Task(env="guess", id="1-16:8", prompt="guess 1-16", data={"target": 8, "low": 1, "high": 16})

    async def run():
        env = make("guess", max_turns=10)
        await env.reset(task)
        return [await env.step(action) for action in (" 10\n", "12", "-3", "5", "2")]

    steps = asyncio.run(run())
    assert [s.observation[0]["content"] for s in steps] == ["lower", "lower", "higher", "higher", "higher"]
    assert [s.progress for s in steps] == [7 / 16, 7 / 16, 7 / 16, 12 / 16, 12 / 16]
    assert [s.info for s in steps] == [{"turns": i} for i in range(1, 6)]
    with pytest.raises(ValueError, match="max_turns"):
        GuessConfig(max_turns=0)


def test_guess_draws_each_problem_of_its_split_once_before_any_twice():
    """An evaluation's 100 tasks of the 336 held-out problems were 100 draws with replacement:
    about 13 were a second rollout of a problem, which weighed twice in its mean."""
    problem = lambda t: (t.data["low"], t.data["high"], t.data["target"])  # noqa: E731
    held_out = len(problems(GuessConfig(), "eval"))
    for seed in range(3):
        tasks = task_set("guess", "eval", seed=seed, n=100)
        assert len({problem(t) for t in tasks}) == 100
        assert len({t.id for t in tasks}) == 100
    tasks = task_set("guess", "eval", seed=0, n=2 * held_out + 1)
    counts = {}
    for task in tasks:
        counts[problem(task)] = counts.get(problem(task), 0) + 1
    assert len(counts) == held_out and set(counts.values()) == {2, 3}


def test_a_distinct_task_pool_holds_each_problem_once(tmp_path):
    """An evaluation scores each problem once: the envs that repeat their tasks to make ``n``
    give a distinct pool their split's problems, once each (an 8-row split asked for 12 gave
    4 rows twice, and a mean that weighed them double)."""
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": str(i)}) + "\n" for i in range(20)))
    config = {"path": str(path), "eval_fraction": 0.3}
    repeated = task_pool("dataset", "eval", 0, 12, config)
    held_out = {t.prompt for t in repeated}
    assert len(repeated) == 12 and len(held_out) < 12
    distinct = task_pool("dataset", "eval", 0, 12, config, distinct=True)
    assert sorted(t.prompt for t in distinct) == sorted(held_out)
    assert [t.prompt for t in distinct] == [t.prompt for t in repeated[: len(held_out)]]
    agent = {"command": "true", "tasks": [{"id": f"t{i}", "prompt": f"p{i}"} for i in range(40)]}
    tasks = task_pool("agent", "eval", 0, 50, agent, distinct=True)
    assert len(tasks) == len({t.id for t in tasks}) < 50
    guess = {"low": 1, "high": 12, "min_width": 8, "max_width": 8}
    tasks = task_pool("guess", "eval", 0, 50, guess, distinct=True)
    assert len(tasks) == len(problems(GuessConfig(**guess), "eval"))
    assert len(task_pool("arith", "eval", 0, 50, {"max_operand": 9}, distinct=True)) == len(
        task_pool("arith", "eval", 0, 50, {"max_operand": 9})
    )


def test_a_distinct_task_pool_of_a_split_with_repeated_prompts_gives_n_problems_where_it_holds_them(tmp_path):
    """A dataset of 200 rows over 100 sums held out 23 rows of 10 distinct prompts, and an
    evaluation asked for 10 problems measured 8: the first 10 rows drawn held 2 repeats."""
    path = tmp_path / "rows.jsonl"
    rows = [{"id": f"r{i}", "prompt": f"{i % 100}?", "answer": str(i % 100)} for i in range(200)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = {"path": str(path), "id_field": "id", "eval_fraction": 0.1}
    held_out = {t.prompt for t in task_pool("dataset", "eval", 0, 200, config)}
    n = len(held_out)
    drawn = task_pool("dataset", "eval", 0, n, config)
    assert len({t.prompt for t in drawn}) < n, "the draw of n rows repeats a prompt (else this tests nothing)"
    distinct = task_pool("dataset", "eval", 0, n, config, distinct=True)
    assert len(distinct) == n and {t.prompt for t in distinct} == held_out
    assert task_pool("dataset", "eval", 0, n - 1, config, distinct=True) == distinct[: n - 1]


def test_a_distinct_agent_task_pool_keeps_tasks_that_differ_only_in_their_id():
    """The agent program and its EVAL read the task's id in task.json: agent tasks of the same
    prompt and data but other ids (one per repository, say) are other problems, each one
    evaluated (the pool kept the first of them only)."""
    agent = {
        "command": "true",
        "tasks": [{"id": f"repo-{i}", "prompt": "fix the failing test"} for i in range(60)],
    }
    held_out = task_set("agent", "eval", 0, 1, agent)[0]
    ids = {t.id for t in task_pool("agent", "eval", 0, 60, agent)}
    assert len(ids) > 1 and held_out.id in ids
    tasks = task_pool("agent", "eval", 0, 60, agent, distinct=True)
    assert sorted(t.id for t in tasks) == sorted(ids)


def test_guess_config_rejects_impossible_windows():
    with pytest.raises(ValueError, match="min_width"):
        GuessConfig(min_width=12, max_width=8)
    with pytest.raises(ValueError, match="max_width"):
        GuessConfig(low=1, high=10, max_width=16)


def test_guess_config_refuses_a_space_too_large_to_list():
    """Tasks are drawn from the listed, hash-ranked split; a config whose windows make more
    problems than that can list is refused up front rather than hanging the first draw."""
    with pytest.raises(
        ValueError, match=r"max_width \(300\).* 442175090 problems, over the limit of 1000000"
    ):
        GuessConfig(high=9999, max_width=300)
    assert GuessConfig(high=9999, min_width=101, max_width=101).max_width == 101  # 9899 * 101 = 999799
    with pytest.raises(ValueError, match="1009596 problems"):  # 9898 * 102
        GuessConfig(high=9999, min_width=102, max_width=102)


def test_guess_feedback_and_progress():
    task = task_set("guess", "train", seed=4, n=1)[0]
    target = task.data["target"]

    async def run():
        env = make("guess")
        await env.reset(task)
        low = await env.step("0")
        assert low.observation == [{"role": "user", "content": "higher"}] and not low.done
        wrong = await env.step("banana")
        assert wrong.observation[0]["content"] == "number?"
        hit = await env.step(str(target))
        assert hit.observation[0]["content"] == "correct" and hit.done and hit.reward == 1.0
        return low.progress

    assert asyncio.run(run()) == 0.0
    flawed_turns = [
        len(demonstrate(t, flawed=True, seed=s)) for s in range(5) for t in task_set("guess", "train", 5, 10)
    ]
    good_turns = [len(demonstrate(t)) for t in task_set("guess", "train", 5, 10)]
    assert max(good_turns) <= 5 and sum(flawed_turns) / len(flawed_turns) > sum(good_turns) / len(good_turns)


def test_guess_progress_is_full_only_when_the_number_is_found():
    task = Task(env="guess", id="1-16:8", prompt="guess 1-16", data={"target": 8, "low": 1, "high": 16})

    async def run(actions):
        env = make("guess", max_turns=2)
        await env.reset(task)
        return [await env.step(action) for action in actions]

    higher, lost = asyncio.run(run(["7", "9"]))
    assert (higher.progress, lost.progress) == (7 / 16, 15 / 16)
    assert lost.done and lost.reward == 0.0
    _, found = asyncio.run(run(["7", "8"]))
    assert found.reward == found.progress == 1.0


@pytest.mark.parametrize(
    "data",
    [
        {"target": 20, "low": 1, "high": 16},
        {"target": 5, "low": 6, "high": 5},
        {"target": "8", "low": 1, "high": 16},
        {"target": 8, "low": 1.0, "high": 16},
        {"low": 1, "high": 16},
    ],
)
def test_guess_task_it_cannot_play_is_refused_at_reset(data):
    """A task sent by a client with its number outside its window reached full progress
    unfound (16 in 1-16 for 20: ``higher``, no number left); an empty window divided by zero,
    a text number or a missing one failed the step (TypeError, KeyError)."""
    task = Task(env="guess", id="t", prompt="guess 1-16", data=data)
    with pytest.raises(ValueError, match="guess task 't': data must hold int low <= target <= high"):
        asyncio.run(make("guess").reset(task))


def test_guess_answers_number_to_what_is_not_an_ascii_number():
    task = task_set("guess", "train", seed=4, n=1)[0]

    async def run():
        env = make("guess", max_turns=10)
        await env.reset(task)
        return [
            (await env.step(action)).observation[0]["content"]
            for action in ("--5", "²", "٣", "1_0", "9" * 5000)
        ]

    assert asyncio.run(run()) == ["number?"] * 5


WRITE_RED = Task(
    env="shell",
    id="write:red:a",
    prompt="put red in a.txt",
    data={"kind": "write", "file": "a.txt", "content": "red"},
)


@needs_bwrap
def test_shell_commands_the_sandbox_stops_are_failed_actions():
    """A command that prints a violation, runs past its limit or ends the shell fails as an
    action the model is told about (never an env_error): the shell starts afresh, the episode goes on."""
    actions = ["echo 'Connection refused'; false", "sleep 30", "exit 3", "echo red > a.txt"]

    async def run():
        env = make("shell", sandbox=SMALL.model_copy(update={"timeout_s": 1}), max_turns=len(actions))
        await env.reset(WRITE_RED)
        try:
            return [await env.step(action) for action in actions], await env.evaluate()
        finally:
            await env.close()

    results, score = asyncio.run(run())
    assert [result.info.get("stopped") for result in results] == ["network", "timeout", "died", None]
    assert results[0].observation[0]["content"].startswith("Connection refused\n[stopped: network:")
    assert all(result.reward == 0.0 for result in results) and results[-1].done
    assert score == 1.0


@needs_bwrap
def test_a_shell_killed_for_a_command_starts_afresh_in_the_directory_it_was_in():
    """A shell killed for a command (its timeout, its exit) started again in the sandbox's
    folder: the model, told nothing of it, ran its next commands in another directory than
    the one it had moved to. It goes back there, or stays in the folder when that is gone."""
    actions = ["mkdir -p 'a b/c' && cd 'a b/c'", "sleep 30", "pwd", "cd .. && rmdir c && exit", "pwd"]

    async def run():
        env = make("shell", sandbox=SMALL.model_copy(update={"timeout_s": 1}), max_turns=len(actions))
        await env.reset(WRITE_RED)
        try:
            return [await env.step(action) for action in actions], env.sandbox.workdir
        finally:
            await env.close()

    results, workdir = asyncio.run(run())
    assert [result.info.get("stopped") for result in results] == [None, "timeout", None, "died", None]
    assert [results[2].observation[0]["content"], results[4].observation[0]["content"]] == [
        f"{workdir}/a b/c",
        workdir,
    ]


@needs_bwrap
def test_a_command_the_shell_is_stopped_for_shows_the_model_what_it_printed():
    """A command run past its time or its output cap was shown to the model as the reason
    alone: what it had printed (a server's banner, an error before a hang) was dropped, as
    the shell's own timeout and output cap kept none of it."""
    actions = ["echo building; sleep 30", "yes 0123456789"]

    async def run():
        env = make("shell", sandbox=SMALL.model_copy(update={"timeout_s": 1}), max_turns=len(actions))
        await env.reset(WRITE_RED)
        try:
            return [(await env.step(action)).observation[0]["content"] for action in actions]
        finally:
            await env.close()

    timed_out, flooded = asyncio.run(run())
    assert timed_out.startswith("building\n[stopped: timeout:")
    assert flooded.endswith(
        f"[stopped: output_limit: command printed more than {SMALL.max_output_bytes} bytes; the shell was killed]"
    )
    assert "0123456789\n0123456789" in flooded


@needs_bwrap
@pytest.mark.parametrize("name", ["pytool", "shell"])
def test_an_observation_cut_to_its_limit_says_how_much_was_cut(name):
    """Output past ``max_observation_chars`` was cut to its end silently: a number cut to its
    last digits reads as another number, which the model could take for the result."""
    number = str(2**100)  # 31 digits
    task = task_set(name, "train", seed=5, n=1)[0]
    action = f"run: print({number})" if name == "pytool" else f"echo {number}"

    async def run():
        env = make(name, sandbox=SMALL, max_observation_chars=16)
        await env.reset(task)
        try:
            return (await env.step(action)).observation[0]["content"]
        finally:
            await env.close()

    assert asyncio.run(run()) == f"[15 characters cut]\n{number[-16:]}"


def test_what_the_model_is_told_of_a_stopped_action_says_how_much_output_was_cut():
    exc = SandboxError("timeout", "ran past its 1 s limit", "0123456789" * 3)
    assert (
        stopped(exc, 16)
        == "[14 characters cut]\n4567890123456789\n[stopped: timeout: ran past its 1 s limit]"
    )
    assert stopped(SandboxError("timeout", "late", "done\n"), 16) == "done\n[stopped: timeout: late]"


def test_a_reset_cancelled_while_its_sandbox_is_built_leaves_no_sandbox_behind(tmp_path):
    config = SMALL.model_copy(update={"root_dir": str(tmp_path)})

    async def run():
        for _ in range(10):
            env = make("shell", sandbox=config)
            reset = asyncio.create_task(env.reset(WRITE_RED))
            await asyncio.sleep(0)  # the sandbox is being built on a thread
            reset.cancel()
            with pytest.raises(asyncio.CancelledError):
                await reset
            await env.close()

    asyncio.run(run())
    assert os.listdir(tmp_path) == []


class Holding(ThreadPoolExecutor):
    """One worker thread, and what was handed to it, in order."""

    def __init__(self):
        super().__init__(max_workers=1)
        self.submitted: list = []

    def submit(self, fn, /, *args, **kwargs):
        self.submitted.append(fn)
        return super().submit(fn, *args, **kwargs)


async def handed(executor: Holding, count: int) -> None:
    """Wait until ``executor`` has been handed ``count`` calls."""
    deadline = time.monotonic() + 10
    while len(executor.submitted) < count:
        assert time.monotonic() < deadline, (
            f"{len(executor.submitted)} calls handed to the thread, not {count}"
        )
        await asyncio.sleep(0.01)


def test_a_reset_cancelled_again_while_its_sandbox_waits_to_be_closed_still_closes_it(tmp_path):
    """The sandbox built for a cancelled reset is closed on a thread; a second cancel (the
    rollout's, after its stage's timeout) while that close waited for a free worker thread
    dropped it: the folder and uid stayed for the worker's life."""
    config = SMALL.model_copy(update={"root_dir": str(tmp_path)})

    async def run():
        loop = asyncio.get_running_loop()
        executor = Holding()
        loop.set_default_executor(executor)
        first, second = threading.Event(), threading.Event()
        holding = [loop.run_in_executor(None, first.wait)]
        reset = asyncio.create_task(make("shell", sandbox=config).reset(WRITE_RED))
        await handed(executor, 2)  # the sandbox waits for the thread
        reset.cancel()
        holding.append(loop.run_in_executor(None, second.wait))
        first.set()  # the sandbox is built, then its close waits behind the second
        await handed(executor, 4)
        reset.cancel()
        second.set()
        await asyncio.gather(*holding)
        with pytest.raises(asyncio.CancelledError):
            await reset

    asyncio.run(run())
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("name", ["pytool", "shell"])
def test_a_reset_cancelled_while_its_interpreter_starts_closes_the_interpreter(name, monkeypatch):
    """The interpreter (or shell) started for a cancelled reset is closed then, not left
    running with its pipes open until the env is closed."""
    cls = PythonRepl if name == "pytool" else Shell
    started: list = []
    build = cls.__init__

    def slow_start(self, sandbox):
        build(self, sandbox)
        started.append(self)
        time.sleep(0.5)  # still starting when the reset is cancelled

    monkeypatch.setattr(cls, "__init__", slow_start)
    task = task_set(name, "train", seed=0, n=1)[0]

    async def run():
        env = make(name, sandbox=SMALL)
        reset = asyncio.create_task(env.reset(task))
        while not started:
            await asyncio.sleep(0.01)
        reset.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reset
        try:
            return started[0].alive
        finally:
            await env.close()

    assert asyncio.run(run()) is False


@pytest.mark.parametrize("name", ["pytool", "shell"])
def test_close_before_reset_or_twice_closes_the_interpreter_once(name, monkeypatch):
    """close() before reset has nothing to close; a second close() does not close the
    interpreter (or shell) again."""
    cls = PythonRepl if name == "pytool" else Shell
    closed: list = []
    close = cls.close

    def counted_close(self):
        closed.append(self)
        close(self)

    monkeypatch.setattr(cls, "close", counted_close)

    async def run():
        env = make(name, sandbox=SMALL)
        await env.close()
        await env.reset(task_set(name, "train", seed=0, n=1)[0])
        pid = env.resource_pid()
        await env.close()
        await env.close()
        return pid, env.resource_pid(), env.sandbox

    pid, pid_after, sandbox = asyncio.run(run())
    assert pid is not None and len(closed) == 1
    assert pid_after is None and sandbox is None


@needs_bwrap
def test_shell_eval_never_opens_a_fifo_the_model_swapped_in(monkeypatch):
    """A job the model left running can swap a.txt for a FIFO right after any check of the path;
    ``isfile`` answering True stands in for losing that race. EVAL must score 0 without reading
    the FIFO (an open() that waits for its writer would freeze the event loop)."""
    writer_done = threading.Event()

    def feed(path):  # a writer, so that a read of the FIFO ends instead of hanging the test
        while not writer_done.is_set():
            try:
                fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
            except OSError:
                time.sleep(0.01)
                continue
            os.write(fd, b"red\n")
            os.close(fd)
            return

    async def run():
        env = make("shell", sandbox=SMALL)
        await env.reset(WRITE_RED)
        try:
            await env.step("mkfifo a.txt")
            feeder = threading.Thread(target=feed, args=(os.path.join(env.sandbox.workdir, "a.txt"),))
            feeder.start()
            monkeypatch.setattr(os.path, "isfile", lambda path: True)
            try:
                return await env.evaluate()
            finally:
                monkeypatch.undo()
                writer_done.set()
                feeder.join()
        finally:
            await env.close()

    assert asyncio.run(run()) == 0.0


@needs_bwrap
def test_shell_eval_never_follows_a_folder_the_model_made_a_link_out_of_the_sandbox(tmp_path):
    """The model can make the checked file's folder a link to a host path (``ln -s /etc d``):
    the worker, as root, then read the host's file, and a 1 told the model what it holds."""
    outside = tmp_path / "host"
    outside.mkdir()
    (outside / "a.txt").write_text("red\n")
    task = Task(
        env="shell",
        id="write:red:d",
        prompt="put red in d/a.txt",
        data={"kind": "write", "file": "d/a.txt", "content": "red"},
    )

    async def run():
        env = make("shell", sandbox=SMALL)
        await env.reset(task)
        try:
            os.symlink(outside, os.path.join(env.sandbox.workdir, "d"))
            linked = await env.evaluate()
            os.remove(os.path.join(env.sandbox.workdir, "d"))
            await env.step("mkdir d && echo red > d/a.txt")
            return linked, await env.evaluate()
        finally:
            await env.close()

    assert asyncio.run(run()) == (0.0, 1.0)


@needs_bwrap
def test_pytool_runs_the_sandbox_stops_are_failed_actions():
    task = task_set("pytool", "train", seed=5, n=1)[0]
    actions = ["run: raise MemoryError", "run: while True: pass", "run: import os; os._exit(0)", "run: 6 * 7"]

    async def run():
        env = make("pytool", sandbox=SMALL.model_copy(update={"timeout_s": 1}), max_turns=5)
        await env.reset(task)
        try:
            return [(await env.step(action)).observation[0]["content"] for action in actions]
        finally:
            await env.close()

    seen = asyncio.run(run())
    assert "[stopped: memory_limit:" in seen[0]
    assert "[stopped: timeout:" in seen[1] or "[stopped: cpu_limit:" in seen[1]
    assert "[stopped: died:" in seen[2]
    assert seen[3] == "42"


@needs_bwrap
def test_code_solution_that_never_returns_scores_zero():
    task = task_set("code", "train", seed=6, n=1)[0]
    sandbox = SMALL.model_copy(update={"timeout_s": 1})
    _, score = asyncio.run(play("code", task, ["def f(x):\n    while True: pass"], sandbox=sandbox))
    assert score == 0.0


def zombie_children():
    """Ids of this process's children that exited and were never reaped."""
    zombies = set()
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] == "Z" and int(fields[1]) == os.getpid():
            zombies.add(int(entry))
    return zombies


@pytest.mark.parametrize("name", ["pytool", "shell"])
def test_a_close_cancelled_while_its_interpreter_closes_still_closes_the_sandbox(name):
    """A close cancelled while the interpreter (or shell) closed on its thread skipped the
    sandbox: its folder, its uid and the uid's claim stayed for the worker's life."""

    async def run():
        env = make(name, sandbox=SMALL)
        await env.reset(task_set(name, "train", seed=0, n=1)[0])
        sandbox = env.sandbox
        closing = asyncio.create_task(env.close())
        await asyncio.sleep(0)  # the interpreter closes on a thread
        closing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await closing
        return sandbox

    sandbox = asyncio.run(run())
    assert sandbox.closed
    assert not os.path.exists(sandbox.workdir)


@pytest.mark.parametrize("name", ["pytool", "shell", "code"])
def test_a_close_cancelled_while_every_worker_thread_is_busy_still_closes_everything(name):
    """A close cancelled while its thread waited for a free worker thread (other rollouts'
    sandbox work) was never run: ``asyncio.to_thread`` drops work cancelled before it starts.
    The interpreter (or shell), dropped by the env, kept its pipes and eventfd; the sandbox
    its folder, uid and uid claim."""

    async def run():
        env = make(name, sandbox=SMALL)
        await env.reset(task_set(name, "train", seed=0, n=1)[0])
        process, sandbox = getattr(env, "repl", None) or getattr(env, "shell", None), env.sandbox
        loop = asyncio.get_running_loop()
        loop.set_default_executor(ThreadPoolExecutor(max_workers=1))
        busy = threading.Event()
        holding = loop.run_in_executor(None, busy.wait)
        closing = asyncio.create_task(env.close())
        await asyncio.sleep(0)  # its thread waits for the busy one
        closing.cancel()
        busy.set()
        await holding
        with pytest.raises(asyncio.CancelledError):
            await closing
        return process, sandbox

    process, sandbox = asyncio.run(run())
    assert process is None or process.closed
    assert sandbox.closed and not os.path.exists(sandbox.workdir)


@needs_bwrap
def test_closed_envs_leave_no_open_fds_or_zombies():
    """close() must release the shell's pty and the interpreter's pipes and reap their processes
    at once, not when the env is garbage collected (the envs here stay referenced)."""
    episodes = [
        ("pytool", task_set("pytool", "train", seed=5, n=1)[0], "run: 6 * 7"),
        ("shell", WRITE_RED, "echo red > a.txt"),
    ] * 2
    kept, pids = [], set()

    async def run():
        for name, task, action in episodes:
            env = make(name, sandbox=SMALL)
            kept.append(env)
            await env.reset(task)
            await env.step(action)
            pids.add(env.resource_pid())
            await env.close()

    gc.collect()
    fds = len(os.listdir("/proc/self/fd"))
    asyncio.run(run())
    assert len(os.listdir("/proc/self/fd")) <= fds
    assert None not in pids and not pids & zombie_children()
    assert len(kept) == len(episodes)


@pytest.mark.parametrize("data", [{"expr": "6*7%50", "answer": 42.0}, {"expr": "6*7%50", "answer": True}, {}])
def test_pytool_task_it_cannot_score_is_refused_at_reset(data):
    """A task sent by a client with an answer that is no int (``42.0``, as a table with a gap
    stores it) scored the right answer 0 (``42`` is not ``42.0``); one without an answer made a
    sandbox and failed the step with a KeyError."""
    env = make("pytool", sandbox=SMALL)
    with pytest.raises(ValueError, match="pytool task 't': data must hold an int answer"):
        asyncio.run(env.reset(Task(env="pytool", id="t", prompt="calc 6*7%50", data=data)))
    assert env.sandbox is None


@needs_bwrap
def test_pytool_runs_python_then_answers():
    task = task_set("pytool", "train", seed=5, n=1)[0]
    result, score = asyncio.run(play("pytool", task, demonstrate(task), sandbox=SMALL))
    assert score == 1.0 and result.reward == 1.0
    wrong, score = asyncio.run(
        play("pytool", task, ["run: y = 3", "run: y * 2", "answer: -1"], sandbox=SMALL)
    )
    assert score == 0.0 and wrong.done


@needs_bwrap
def test_pytool_runs_the_code_of_a_fenced_block_after_run():
    """``run:`` then the code in a Markdown block, as a chat model writes it: the fence was
    run as Python, a SyntaxError, and the run that computed the answer was no progress."""
    task = task_set("pytool", "train", seed=5, n=1)[0]
    run = f"run: I will compute it.\n```python\nprint({task.data['expr']})\n```\nThen answer."
    result, _ = asyncio.run(play("pytool", task, [run], sandbox=SMALL, max_turns=1))
    assert result.progress == 0.5


@needs_bwrap
def test_pytool_progress_needs_a_run_that_computes_the_answer():
    task = task_set("pytool", "train", seed=5, n=1)[0]
    cases = [
        (["run: print(*range(97))", "answer: -1"], 0.0),
        (["run: print(list(range(97)))", "answer: -1"], 0.0),
        ([f"run: print({task.data['expr']})", "answer: -1"], 0.5),
        ([f"run: {task.data['expr']}", "answer: -1"], 0.5),
    ]
    for actions, progress in cases:
        result, score = asyncio.run(play("pytool", task, actions, sandbox=SMALL))
        assert (result.progress, score) == (progress, 0.0), actions


@needs_bwrap
def test_code_scores_fraction_of_hidden_tests():
    task = task_set("code", "train", seed=6, n=1)[0]
    _, score = asyncio.run(play("code", task, demonstrate(task), sandbox=SMALL))
    assert score == 1.0
    body = task.data["body"]
    expected = sum(x >= 0 for x, _ in task.data["tests"]) / len(task.data["tests"])
    assert 0 < expected < 1
    # wrong on x < 0 by one, by an answer that is no int or no JSON, or by SystemExit: those tests only
    for wrong in (f"{body} + 1", "None", "True", "{x}", "exit()"):
        partial = f"def f(x):\n    return {body} if x >= 0 else {wrong}"
        _, score = asyncio.run(play("code", task, [partial], sandbox=SMALL))
        assert score == pytest.approx(expected), wrong
    _, score = asyncio.run(play("code", task, ["this is not python"], sandbox=SMALL))
    assert score == 0.0


@needs_bwrap
def test_a_non_ascii_solution_is_scored_on_a_worker_whose_locale_is_not_utf8():
    """``solution.py`` (and a shell task's files) are written as UTF-8, what Python reads
    source as: under an ASCII locale a solution with an accent crashed the env (env_error)."""
    script = (
        "import asyncio\n"
        "from envs.registry import demonstrate, task_set\n"
        "from tests.envs.test_envs import SMALL, play\n"
        "task = task_set('code', 'train', seed=6, n=1)[0]\n"
        "solution = '# r\\u00e9sum\\u00e9\\n' + demonstrate(task)[0]\n"
        "print(asyncio.run(play('code', task, [solution], sandbox=SMALL))[1])\n"
    )
    ascii_locale = os.environ | {"LC_ALL": "C", "PYTHONCOERCECLOCALE": "0", "PYTHONUTF8": "0"}
    run = subprocess.run([sys.executable, "-c", script], env=ascii_locale, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().splitlines()[-1] == "1.0", run.stdout


@needs_bwrap
@pytest.mark.parametrize("max_processes", [4, 5])
def test_code_test_run_keeps_within_the_process_limit(max_processes):
    """The forked workers of the test run (one per core of this machine) must fit under the
    sandbox's process limit, or a right solution scores 0."""
    task = task_set("code", "train", seed=6, n=1)[0]
    sandbox = SMALL.model_copy(update={"backend": "bwrap", "max_processes": max_processes})
    _, score = asyncio.run(play("code", task, demonstrate(task), sandbox=sandbox))
    assert score == 1.0


@needs_bwrap
def test_code_test_run_works_in_process_when_no_worker_can_be_forked(monkeypatch):
    monkeypatch.setattr("envs.code.HARNESS_PROCESSES", 0)  # the runner tries to fork past the limit
    task = task_set("code", "train", seed=6, n=1)[0]
    sandbox = SMALL.model_copy(update={"backend": "bwrap", "max_processes": 4})
    _, score = asyncio.run(play("code", task, demonstrate(task), sandbox=sandbox))
    assert score == 1.0


def code_task(tests):
    return Task(env="code", id="f", prompt="write f", data={"body": "f", "tests": tests})


@pytest.mark.parametrize(
    "max_processes, tests, cores", [(4, 5, 1), (HARNESS_PROCESSES + 2, 5, 2), (64, 3, 3), (64, 5, 4)]
)
def test_code_test_run_asks_for_no_more_cores_than_it_has_workers(max_processes, tests, cores):
    """Under a process limit that leaves room for fewer workers than ``test_cores``, or with
    fewer tests (one worker each at most), the test run asked the scheduler for ``test_cores``
    cores and left the rest idle while it ran."""

    async def run():
        env = make("code", test_cores=4, sandbox=SMALL.model_copy(update={"max_processes": max_processes}))
        try:
            await env.reset(code_task([[x, x] for x in range(tests)]))
            return env.eval_request()
        finally:
            await env.close()

    request = asyncio.run(run())
    assert request.max_units == cores and len(request.efficiency) == cores


@needs_bwrap
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one core: the runner is the only worker")
def test_code_a_worker_that_died_loses_its_own_tests_only():
    tests = [[x, 3 * x + 1] for x in (0, -1, 2, -3, 4, -5)]  # two workers: 0, 2, 4 and -1, -3, -5
    sandbox = SMALL.model_copy(update={"max_processes": HARNESS_PROCESSES + 2})
    solution = "import os\ndef f(x):\n    if x < 0:\n        os._exit(0)\n    return 3 * x + 1\n"
    _, score = asyncio.run(play("code", code_task(tests), [solution], sandbox=sandbox))
    assert score == 0.5


@needs_bwrap
@pytest.mark.parametrize("max_processes", [HARNESS_PROCESSES, HARNESS_PROCESSES + 2])  # one worker, two
def test_code_an_answer_too_long_to_write_loses_its_own_test_only(max_processes):
    """An int past Python's 4300 digits cannot be written as JSON: returned for one input, it
    broke the runner's (or a worker's) reply half-written, and every test scored 0."""
    tests = [[x, 3 * x + 1] for x in range(4)]
    sandbox = SMALL.model_copy(update={"max_processes": max_processes})
    solution = "def f(x):\n    return 10 ** 5000 if x == 0 else 3 * x + 1\n"
    _, score = asyncio.run(play("code", code_task(tests), [solution], sandbox=sandbox))
    assert score == 0.75


@needs_bwrap
@pytest.mark.parametrize("hang", ["while True: pass", "import time; time.sleep(100)"])
def test_code_a_call_that_never_returns_loses_its_own_test_only(hang):
    """A solution right but for one input it hangs on ran the test run past its limit and
    scored 0, however many tests it passed: each call now has its share of the limit."""
    tests = [[x, 3 * x + 1] for x in range(4)]
    solution = f"def f(x):\n    if x == 2:\n        {hang}\n    return 3 * x + 1\n"
    _, score = asyncio.run(play("code", code_task(tests), [solution], sandbox=SMALL))
    assert score == 0.75


@needs_bwrap
def test_code_tests_whose_inputs_outgrow_one_command_line_argument_are_scored():
    """The inputs went to the solution's interpreter as one command-line argument, which Linux
    holds to 128 KiB: past that the interpreter never started and every solution scored 0."""
    tests = [[list(range(i, i + 3000)), i] for i in range(10)]  # about 180 KB of JSON
    _, score = asyncio.run(play("code", code_task(tests), ["def f(x):\n    return x[0]\n"], sandbox=SMALL))
    assert score == 1.0


@pytest.mark.parametrize(
    "tests", [[], [[1]], [[1, 4.5]], [[1, "4"]], [[1, True]], [[1, 4], [2, 7, 9]], "[[1, 4]]", None]
)
def test_code_task_with_malformed_tests_is_refused_at_reset_not_scored_zero(tests):
    """A task sent by a client with tests the tester cannot take (no pair, a fraction or a
    string to expect) scored every solution 0, the right one too; with none, divided by zero."""
    task = code_task(tests) if tests is not None else Task(env="code", id="f", prompt="write f")
    env = make("code", sandbox=SMALL)
    with pytest.raises(ValueError, match="code task 'f': tests must be a non-empty list"):
        asyncio.run(env.reset(task))
    assert env.sandbox is None


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        ({"kind": "count", "files": {"../escaped.txt": "red"}, "answer": "1"}, "relative, without empty"),
        ({"kind": "find", "files": {"{outside}": "red"}, "answer": "x"}, "relative, without empty"),
        ({"kind": "count", "files": {"d1//f.txt": "red"}, "answer": "1"}, "relative, without empty"),
        ({"kind": "count", "files": {"d1/f.txt": 3}, "answer": "1"}, "files must map paths to texts"),
        ({"kind": "count", "files": {"d1/e/f.txt": "red", "d1/e": "red"}, "answer": "1"}, "both a file"),
        ({"kind": "find", "files": {"d1": "red", "d1/f.txt": "owl"}, "answer": "d1"}, "both a file"),
        ({"kind": "count", "files": {"d1/f.txt": "red"}}, "answer must be a text"),
        ({"kind": "write", "file": "../../x.txt", "content": "red"}, "relative, without empty"),
        ({"kind": "write", "file": "a.txt"}, "content must be a text"),
        ({"file": "a.txt", "content": "red"}, "kind must be write, find or count"),
    ],
)
def test_shell_task_whose_paths_leave_the_working_directory_is_refused_at_reset(tmp_path, data, problem):
    """A task sent by a client had its ``files`` written wherever their paths pointed (``../``,
    an absolute path), by a worker that runs as root; one without a field raised a KeyError at
    EVAL, after the episode."""
    outside = tmp_path / "escaped.txt"
    data = {
        key: {name.format(outside=outside): text for name, text in value.items()} if key == "files" else value
        for key, value in data.items()
    }
    env = make("shell", sandbox=SMALL)
    with pytest.raises(ValueError, match=f"shell task 't': .*{problem}"):
        asyncio.run(env.reset(Task(env="shell", id="t", prompt="how many files in d1?", data=data)))
    assert env.sandbox is None and not outside.exists()


@needs_bwrap
def test_code_answers_are_ints_not_bools_even_written_past_the_runner():
    """``True == 1``: booleans must not pass tests that want 1, returned by ``f`` or written
    by the solution straight to the tester's pipe."""
    task = code_task([[x, 1] for x in range(4)])
    past_the_runner = (
        "import __main__, json, os, sys\n"
        "os.write(int(sys.argv[1]), json.dumps([True] * len(__main__.inputs)).encode())\n"
        "os._exit(0)\n"
    )
    for solution, want in (
        ("def f(x):\n    return 1", 1.0),
        ("def f(x):\n    return True", 0.0),
        (past_the_runner, 0.0),
    ):
        _, score = asyncio.run(play("code", task, [solution], sandbox=SMALL))
        assert score == want, solution


FENCED_SOLUTIONS = {
    "python tag, trailing text": "Here it is:\n```python\n{solution}\n```\nIt returns the value asked for.",
    "no tag": "```\n{solution}\n```",
    "py tag, CRLF": "```py\r\n{solution}\r\n```\r\n",
    "draft then answer": "Draft:\n```python\ndef f(x):\n    return 0\n```\nFixed:\n```python\n{solution}\n```",
    "answer then usage": "```python\n{solution}\n```\nUse it so:\n```python\nprint(f(3))\n```",
    "tildes": "Here it is:\n~~~python\n{solution}\n~~~\nDone.",
    "tildes, longer close": "~~~~\n{solution}\n~~~~~~",
    "four backticks": "````python\n{solution}\n````\nDone.",
}


@pytest.mark.parametrize("case", sorted(FENCED_SOLUTIONS))
def test_code_solution_is_taken_from_a_fenced_block_of_the_reply(case):
    """A chat model writes its solution in a Markdown code block, with a language tag or none,
    and text around it: all of that was run as the source, a SyntaxError, and every right
    solution so written scored 0. The block taken is the last that defines ``f``."""
    solution = "def f(x):\n    return x * 3 + 1"
    if "CRLF" in case:
        solution = solution.replace("\n", "\r\n")
    reply = FENCED_SOLUTIONS[case].format(solution=solution)
    assert code.solution_source(reply).strip() == solution.strip()


@pytest.mark.parametrize("fence", ["````", "~~~", "~~~~"])
def test_code_solution_in_a_longer_or_tilde_fence_keeps_the_backtick_fences_it_holds(fence):
    """A block fenced with ``~~~`` or four backticks, which Markdown gives for code that holds
    a line of three backticks, was not found: the whole reply ran as the source and scored 0."""
    solution = 'def f(x):\n    """Use it so:\n```\nf(3)\n```\n"""\n    return x * 3 + 1'
    reply = f"Here it is:\n{fence} python\n{solution}\n{fence}\nIt returns the value asked for."
    assert code.solution_source(reply).strip() == solution


def test_code_solution_in_a_fenced_block_indented_in_a_list_item_is_its_code_dedented():
    """Markdown lets a fence be indented up to three spaces (a block in a list item), its
    lines losing that indent: such a block was not found, and the whole reply ran as source."""
    reply = "1. Define it:\n   ```python\n   def f(x):\n       return x * 3 + 1\n   ```\n2. Call it."
    assert code.solution_source(reply) == "def f(x):\n    return x * 3 + 1\n"


def test_code_solution_without_a_complete_fenced_block_is_the_reply_itself():
    assert code.solution_source("def f(x):\n    return 1\n") == "def f(x):\n    return 1\n"
    cut = "```python\ndef f(x):\n    return 1"  # a reply cut at its token limit
    assert code.solution_source(cut) == cut


@needs_bwrap
def test_code_fenced_solution_is_scored_on_its_code():
    task = task_set("code", "train", seed=6, n=1)[0]
    reply = f"Sure:\n```python\n{demonstrate(task)[0]}\n```\nThis computes f."
    _, score = asyncio.run(play("code", task, [reply], sandbox=SMALL))
    assert score == 1.0


@needs_bwrap
@pytest.mark.parametrize("backend", ["bwrap", "process"])
def test_code_evaluated_again_never_writes_through_a_link_the_solution_left(tmp_path, backend):
    """A solution that ran replaced solution.py with a link to a file of the worker's outside
    the sandbox: the next evaluate wrote the solution's source there, on the worker's host."""
    outside = tmp_path / "worker_file"
    outside.write_text("the worker's own")
    os.chmod(tmp_path, 0o755)
    solution = f"import os\nos.remove('solution.py')\nos.symlink({str(outside)!r}, 'solution.py')\n"
    task = task_set("code", "train", seed=6, n=1)[0]

    async def run():
        env = make("code", sandbox=SMALL.model_copy(update={"backend": backend}))
        try:
            await env.reset(task)
            await env.step(solution)
            return await env.evaluate(), await env.evaluate()
        finally:
            await env.close()

    assert asyncio.run(run()) == (0.0, 0.0)
    assert outside.read_text() == "the worker's own"


@needs_bwrap
def test_code_episode_without_a_solution_scores_zero():
    async def run():
        env = make("code", sandbox=SMALL)
        try:
            await env.reset(task_set("code", "train", seed=6, n=1)[0])
            return await env.evaluate()
        finally:
            await env.close()

    assert asyncio.run(run()) == 0.0


@needs_bwrap
def test_code_test_run_stopped_by_closing_the_env_is_an_env_error_not_a_zero():
    """The sandbox closed under a running test run (the rollout cancelled): no score of the solution."""
    task = task_set("code", "train", seed=6, n=1)[0]

    async def run():
        env = make("code", sandbox=SMALL)
        await env.reset(task)
        await env.step("def f(x):\n    while True: pass")
        evaluation = asyncio.create_task(env.evaluate())
        await asyncio.sleep(1)  # the tester has started
        await env.close()
        with pytest.raises(SandboxError, match="closed while the command ran") as error:
            await evaluation
        assert error.value.kind == "died"

    asyncio.run(run())


@needs_bwrap
def test_code_tester_that_never_started_is_an_env_error():
    task = task_set("code", "train", seed=6, n=1)[0]
    sandbox = SMALL.model_copy(update={"python": "true"})
    with pytest.raises(SandboxError, match="never started") as error:
        asyncio.run(play("code", task, demonstrate(task), sandbox=sandbox))
    assert error.value.kind not in COMMAND_KINDS


@needs_bwrap
def test_code_tester_stopped_before_it_started_is_an_env_error_not_a_zero():
    """An interpreter that fails as it starts, in a way that reads as a limit (MemoryError),
    ran no solution: the test run is the sandbox's failure, not a score of 0."""
    folder = tempfile.mkdtemp()
    try:
        os.chmod(folder, 0o755)  # the sandbox's own uid runs it
        python = os.path.join(folder, "python")
        with open(python, "w") as handle:
            handle.write("#!/bin/sh\necho 'Fatal Python error: MemoryError'\nexit 1\n")
        os.chmod(python, 0o755)
        task = task_set("code", "train", seed=6, n=1)[0]
        sandbox = SMALL.model_copy(update={"python": python, "ro_binds": [folder]})
        with pytest.raises(SandboxError, match="never started") as error:
            asyncio.run(play("code", task, demonstrate(task), sandbox=sandbox))
        assert error.value.kind not in COMMAND_KINDS
    finally:
        shutil.rmtree(folder)


# Solutions that know nothing of the task: read the tests or the full score's token off the tester
# (its __main__, or its memory through /proc), or return an object (or int) that equals anything.
READ_TESTER_MEMORY = """
import json, os, re

def read_tests():
    pid = os.getppid()
    with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "rb", 0) as mem:
        for line in maps:
            span, perms = line.split()[:2]
            start, end = (int(a, 16) for a in span.split("-"))
            if perms.startswith("rw"):
                mem.seek(start)
                found = re.search(rb'"tests": (\\[\\[.*?\\]\\])', mem.read(end - start))
                if found:
                    return dict(json.loads(found.group(1)))

TESTS = read_tests()

def f(x):
    return TESTS[x]
"""
CHEATS = {
    "lookup": "import __main__ as m\ndef f(x):\n    return dict(m.tests)[x]\n",
    "marker": "import __main__ as m, os\nprint(m.scores[-1], flush=True)\nos._exit(0)\n",
    "memory": READ_TESTER_MEMORY,
    "always_equal": "class Yes:\n    def __eq__(self, other):\n        return True\ndef f(x):\n    return Yes()\n",
    "equal_int": "class Yes(int):\n    def __eq__(self, other):\n        return True\ndef f(x):\n    return Yes(0)\n",
    "kill_tester": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n",
}


@needs_bwrap
@pytest.mark.parametrize("backend", ["bwrap", "process"])
@pytest.mark.parametrize("cheat", sorted(CHEATS))
def test_code_cheats_score_nothing(cheat, backend):
    task = task_set("code", "train", seed=6, n=1)[0]
    sandbox = SMALL.model_copy(update={"backend": backend})
    _, score = asyncio.run(play("code", task, [CHEATS[cheat]], sandbox=sandbox))
    assert score == 0.0
    _, score = asyncio.run(play("code", task, demonstrate(task), sandbox=sandbox))
    assert score == 1.0


# Reads what the tester printed before the solution ran off its output pipe, which bwrap's init
# holds (/proc/1/fd/1), and prints each word it found as the pass marker, all tests passed.
STEAL_THE_MARKER = """
import __main__, os, signal, time
tests = len(__main__.inputs)
pipe = os.open("/proc/1/fd/1", os.O_RDONLY | os.O_NONBLOCK)
printed, until = b"", time.monotonic() + 10
while not printed.endswith(b"\\n") and time.monotonic() < until:
    try:
        printed += os.read(pipe, 4096)
    except BlockingIOError:
        time.sleep(0.01)
forged = printed + b"".join(b"%s %d\\n" % (word, tests) for word in printed.split())
os.write(os.open("/proc/1/fd/1", os.O_WRONLY), forged)
open("stolen", "w").close()
os.kill(os.getppid(), signal.SIGKILL)
"""


@needs_bwrap
def test_code_a_solution_that_reads_the_testers_output_before_the_worker_cannot_forge_a_pass(
    tmp_path, monkeypatch
):
    """Sandboxes run as the worker's own uid (a worker that is not root, or in a user-namespaced
    container) can open bwrap's init's descriptors. The tester printed its pass marker as it
    started: a solution that read that line before the worker did (a worker busy elsewhere)
    could print the marker with a full score and kill the tester. Here the worker reads the
    output only once the solution has run."""
    from envs import sandbox as sandbox_module

    monkeypatch.setattr(sandbox_module, "_sandbox_uids_mapped", lambda: False)
    read_capped = sandbox_module.read_capped

    def late(fd, cap, deadline):
        until = time.monotonic() + 10
        while not list(tmp_path.glob("*/stolen")) and time.monotonic() < until:
            time.sleep(0.01)
        return read_capped(fd, cap, deadline)

    monkeypatch.setattr(sandbox_module, "read_capped", late)
    task = task_set("code", "train", seed=6, n=1)[0]
    sandbox = SMALL.model_copy(update={"backend": "bwrap", "root_dir": str(tmp_path)})
    _, score = asyncio.run(play("code", task, [STEAL_THE_MARKER], sandbox=sandbox))
    assert score == 0.0
    monkeypatch.setattr(sandbox_module, "read_capped", read_capped)
    _, score = asyncio.run(play("code", task, demonstrate(task), sandbox=sandbox))
    assert score == 1.0


@needs_bwrap
def test_shell_tasks_checked_at_eval():
    for task in task_set("shell", "train", seed=7, n=6):
        result, score = asyncio.run(play("shell", task, demonstrate(task), sandbox=SMALL))
        assert score == 1.0, task
        _, score = asyncio.run(play("shell", task, ["done"], sandbox=SMALL))
        assert score == 0.0


@needs_bwrap
def test_shell_write_check_fails_a_file_that_holds_more_than_the_word_past_what_it_reads():
    """The check read a file's first 4096 bytes: the word, whitespace to that length, then
    anything at all passed as the word alone."""
    for command, want in (
        ("printf 'red%4093s' '' > a.txt", 1.0),  # the word and whitespace, 4096 bytes
        ("printf 'red%4093s junk' '' > a.txt", 0.0),
    ):
        _, score = asyncio.run(play("shell", WRITE_RED, [command, "done"], sandbox=SMALL))
        assert score == want, command


@needs_bwrap
def test_shell_runs_the_command_of_a_fenced_block():
    """A command written in a Markdown block, as a chat model writes it, ran with its fences:
    bash took them for command substitutions and ran the command's output as a command
    ('bash: red: command not found'), or its own effects alone."""
    actions = ["I will write it.\n```bash\necho red > a.txt\ncat a.txt\n```\nThen check.", "done"]

    async def run():
        env = make("shell", sandbox=SMALL)
        await env.reset(WRITE_RED)
        try:
            return [await env.step(action) for action in actions], await env.evaluate()
        finally:
            await env.close()

    results, score = asyncio.run(run())
    assert results[0].observation[0]["content"] == "red" and score == 1.0


@needs_bwrap
def test_shell_find_answer_may_name_the_file_by_its_absolute_path():
    """The file found by ``grep -rl owl "$PWD"`` or ``find "$PWD"``, answered by the path the
    shell printed, scored 0: only ``d1/f0.txt`` and ``./d1/f0.txt`` named it."""
    files = {"d1/f0.txt": "owl", "d2/f0.txt": "red"}
    task = Task(
        env="shell",
        id="find",
        prompt="which file has owl?",
        data={"kind": "find", "files": files, "answer": "d1/f0.txt"},
    )

    async def score(answer):
        env = make("shell", sandbox=SMALL)
        await env.reset(task)
        try:
            await env.step(f"answer: {answer.format(workdir=env.sandbox.workdir)}")
            return await env.evaluate()
        finally:
            await env.close()

    answers = ["{workdir}/d1/f0.txt", "/d1/f0.txt", "{workdir}/d2/f0.txt"]
    assert [asyncio.run(score(answer)) for answer in answers] == [1.0, 0.0, 0.0]

    async def score_once_closed(answer):
        env = make("shell", sandbox=SMALL)
        await env.reset(task)
        await env.step(f"answer: {answer}")
        await env.close()
        return await env.evaluate()

    assert [asyncio.run(score_once_closed(answer)) for answer in ("./d1/f0.txt", "/d1/f0.txt")] == [1.0, 0.0]


@needs_bwrap
def test_shell_task_files_in_nested_folders_are_the_sandboxs_to_change():
    """A client's task with a file two folders deep (``a/b/f.txt``): only the innermost folder
    was given to the sandbox's uid, so ``a`` stayed the worker's (root's) and the model could
    neither make a file in it nor remove what the task put there."""
    task = Task(
        env="shell",
        id="nested",
        prompt="how many files in a?",
        data={"kind": "count", "files": {"a/b/f.txt": "owl"}, "answer": "1"},
    )

    async def run():
        env = make("shell", sandbox=SMALL)
        await env.reset(task)
        try:
            return await env.step("touch a/new && rm -r a/b && echo ok")
        finally:
            await env.close()

    assert asyncio.run(run()).observation[0]["content"] == "ok"


def test_shell_eval_tasks_have_no_train_twin():
    """File contents do not decide a count or find answer: an eval task must not have a train
    task asking the same question of the same file names with the same answer."""

    def asked(task):
        return task.prompt, tuple(sorted(task.data.get("files", {}))), task.data.get("answer")

    train = {asked(task) for task in task_set("shell", "train", seed=0, n=3000)}
    evals = [task for task in task_set("shell", "eval", seed=0, n=300) if task.data["kind"] != "write"]
    assert evals and not [task.id for task in evals if asked(task) in train]


def test_dataset_jsonl_parquet_and_verifiers(tmp_path):
    rows = [{"prompt": f"q{i}", "answer": str(i * 1.5)} for i in range(40)]
    jsonl, parquet = tmp_path / "data.jsonl", tmp_path / "data.parquet"
    for path in (jsonl, parquet):
        write_rows(path, rows)
        train = task_set("dataset", "train", 0, 30, {"path": str(path)})
        evals = task_set("dataset", "eval", 0, 5, {"path": str(path)})
        assert not {t.id for t in train} & {t.id for t in evals}
    task = train[0]
    want = task.data["answer"]
    cases = [
        ({"verifier": "exact"}, want, 1.0),
        ({"verifier": "exact"}, want + "0", 0.0),
        ({"verifier": "exact"}, f" {want}\n", 1.0),
        ({"verifier": "numeric", "tolerance": 0.01}, str(float(want) + 0.005), 1.0),
        ({"verifier": "numeric", "tolerance": 0.01}, "nope", 0.0),
        ({"verifier": "regex"}, want, 1.0),
        ({"verifier": "regex"}, f" {want}\n", 1.0),
        ({"verifier": "regex"}, want + "0", 0.0),  # the pattern must match all of the answer
        ({"verifier": "operator:eq"}, want, 1.0),
        ({"verifier": "operator:eq"}, "x", 0.0),
    ]
    for config, answer, score in cases:
        result, final = asyncio.run(play("dataset", task, [answer], path=str(parquet), **config))
        assert result.reward == final == score, (config, answer)
        assert type(result.reward) is float, config  # operator:eq's bool too
    with pytest.raises(ValueError, match="verifier"):
        make("dataset", path=str(jsonl), verifier="not a verifier")
    with pytest.raises(ValueError, match="no field"):
        task_set("dataset", "train", 0, 1, {"path": str(jsonl), "answer_field": "missing"})


def test_dataset_binary_parquet_columns_are_read_as_text(tmp_path):
    """Text written without Parquet's UTF-8 annotation reads back as bytes: the prompt must not
    be shown as ``b'q0'``, nor the right answer scored against ``b'0'``."""
    path = tmp_path / "binary.parquet"
    column = [f"q{i}".encode() for i in range(20)]
    pq.write_table(pa.table({"prompt": column, "answer": [str(i).encode() for i in range(20)]}), path)
    task = task_set("dataset", "train", 0, 1, {"path": str(path)})[0]
    assert task.prompt == f"q{task.data['answer']}"
    result, final = asyncio.run(play("dataset", task, [task.data["answer"]], path=str(path)))
    assert result.reward == final == 1.0
    bad = tmp_path / "latin1.parquet"
    pq.write_table(pa.table({"prompt": [b"caf\xe9"], "answer": [b"1"]}), bad)
    with pytest.raises(ValueError, match="row 0 .*'prompt' is not UTF-8"):
        task_set("dataset", "train", 0, 1, {"path": str(bad)})


def test_dataset_float32_parquet_columns_read_as_the_numbers_written(tmp_path):
    """A float32 column (Hugging Face's ``Value("float32")``, numpy's float32) came back widened
    to the float64 of its binary value: the reference written 1.1 was ``1.100000023841858``, so
    the exact verifier scored the answer ``1.1`` wrong, and 12345.6 was ``12345.599609375``, too
    far from the answer ``12345.6`` for the numeric verifier's tolerance."""
    path = tmp_path / "f32.parquet"
    answers = [1.1, 12345.6, 3.0, 0.1]
    prompts = [f"q{i}" for i in range(len(answers))]
    pq.write_table(pa.table({"prompt": prompts, "answer": pa.array(answers, pa.float32())}), path)
    for verifier in ("exact", "numeric"):
        config = {"path": str(path), "verifier": verifier, "eval_fraction": 0.5}
        tasks = [task for split in ("train", "eval") for task in task_set("dataset", split, 0, 100, config)]
        by_prompt = {task.prompt: task for task in tasks}
        written = {"q0": "1.1", "q1": "12345.6", "q2": "3", "q3": "0.1"}
        assert {prompt: task.data["answer"] for prompt, task in by_prompt.items()} == written
        for prompt, task in by_prompt.items():
            result, final = asyncio.run(play("dataset", task, [written[prompt]], **config))
            assert result.reward == final == 1.0, (verifier, prompt)


@pytest.mark.parametrize("name", ["data.jsonl", "data.parquet"])
def test_dataset_boolean_and_integral_float_fields_read_as_json_writes_them(tmp_path, name):
    """A JSON or Parquet ``true`` was the reference ``True``, and a float column's ``2.0``
    (pandas makes a column of integers with a gap float64) the reference ``2.0``: the exact
    verifier scored the answers ``true`` and ``2`` wrong."""
    rows = [{"prompt": f"q{i}", "flag": i % 2 == 0, "value": [2.0, -3.0, 2.5][i % 3]} for i in range(12)]
    path = tmp_path / name
    write_rows(path, rows)
    for field, text in (
        ("flag", {True: "true", False: "false"}),
        ("value", {2.0: "2", -3.0: "-3", 2.5: "2.5"}),
    ):
        config = {"path": str(path), "answer_field": field, "eval_fraction": 0.5}
        tasks = [task for split in ("train", "eval") for task in task_set("dataset", split, 0, 100, config)]
        assert {(task.prompt, task.data["answer"]) for task in tasks} == {
            (row["prompt"], text[row[field]]) for row in rows
        }
        first = next(task for task in tasks if task.prompt == "q0")
        result, final = asyncio.run(play("dataset", first, [text[rows[0][field]]], **config))
        assert result.reward == final == 1.0, field
    # a boolean's word in any case: the prompt may well have asked for "True or False"
    verify = make_verifier(DatasetConfig(path="x.jsonl"))
    assert [verify(answer, "true") for answer in ("True", " TRUE\n", "true", "False", "yes")] == [
        1,
        1,
        1,
        0,
        0,
    ]
    assert verify("Two", "two") == 0.0


@pytest.mark.parametrize("credentials", ["config", "environment"])
def test_dataset_reads_its_rows_from_s3_with_keys_from_its_config_or_the_environment(
    s3_server, monkeypatch, credentials
):
    rows = [{"prompt": f"q{i}", "answer": str(i)} for i in range(20)]
    url = f"s3://{s3_server.bucket}/datasets/{credentials}.jsonl"
    s3_server.config().filesystem().pipe_file(url, "\n".join(json.dumps(r) for r in rows).encode())
    storage = s3_server.config().model_dump()
    if credentials == "environment":
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.access_key_id)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret_access_key)
        storage |= {"access_key_id": None, "secret_access_key": None}
    else:
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
            monkeypatch.delenv(name, raising=False)
    config = {"path": url, "storage": storage, "eval_fraction": 0.25}
    tasks = [task for split in ("train", "eval") for task in task_set("dataset", split, 0, 100, config)]
    assert {(t.prompt, t.data["answer"]) for t in tasks} == {(r["prompt"], r["answer"]) for r in rows}


@pytest.mark.parametrize("storage", ["endpoint", "none"])
def test_dataset_reads_its_rows_from_s3_whatever_the_runs_root(s3_server, monkeypatch, storage):
    """A storage section that gives the endpoint alone, or none at all (endpoint and keys from
    the environment, as every other S3 read takes them), leaves ``root`` a local folder: the
    file's own s3:// URL makes the read an S3 one."""
    rows = [{"prompt": f"q{i}", "answer": str(i)} for i in range(20)]
    url = f"s3://{s3_server.bucket}/datasets/root-{storage}.jsonl"
    s3_server.config().filesystem().pipe_file(url, "\n".join(json.dumps(r) for r in rows).encode())
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.access_key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret_access_key)
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    config = {"path": url, "eval_fraction": 0.25}
    if storage == "endpoint":
        config["storage"] = {"endpoint_url": s3_server.endpoint_url}
    else:
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_server.endpoint_url)
    tasks = [task for split in ("train", "eval") for task in task_set("dataset", split, 0, 100, config)]
    assert {(t.prompt, t.data["answer"]) for t in tasks} == {(r["prompt"], r["answer"]) for r in rows}


@pytest.mark.parametrize("verifier", ["no_such_module:verify", "json:no_such_function"])
def test_dataset_verifier_that_cannot_be_imported_fails_the_task_set(tmp_path, verifier):
    """Not every episode's reset: a run with it would make nothing but env errors."""
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"prompt": "say it", "answer": "it"}))
    with pytest.raises(ValueError, match=f"verifier '{verifier}' cannot be imported"):
        task_set("dataset", "train", 0, 1, {"path": str(path), "verifier": verifier, "eval_fraction": 0.5})


def test_dataset_config_refuses_credentials_and_malformed_verifiers_and_lowers_the_s3_scheme():
    with pytest.raises(ValueError, match="path\n.*holds credentials") as refused:
        make("dataset", path="s3://AKIAEXAMPLE:secret@bucket/rows.jsonl")
    assert "AKIAEXAMPLE" not in str(refused.value) and "secret@bucket" not in str(refused.value)
    with pytest.raises(ValueError, match="verifier must be exact, numeric, regex or 'pkg.mod:fn'"):
        make("dataset", path="rows.jsonl", verifier="operator:eq and more")
    assert make("dataset", path="S3://bucket/rows.jsonl").config.path == "s3://bucket/rows.jsonl"


def test_dataset_path_under_the_home_folder_and_half_a_key_pair(monkeypatch, tmp_path):
    """``~/rows.jsonl`` is the home folder's file, not one in a folder named ``~``; the
    dataset's own storage section refuses half a key pair as the run's does (its s3:// path
    is set as the root only when the file is read)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "rows.jsonl").write_text('{"prompt": "say it", "answer": "it"}\n' * 2)
    env = make("dataset", path="~/rows.jsonl")
    assert env.config.path == str(tmp_path / "rows.jsonl")
    with pytest.raises(ValueError, match="secret_access_key is set but access_key_id is not") as refused:
        make("dataset", path="s3://bucket/rows.jsonl", storage={"secret_access_key": "TOP-SECRET-VALUE"})
    assert "TOP-SECRET-VALUE" not in str(refused.value)


LOOP_RAN = threading.Event()


def verify_once_the_loop_runs(answer: str, reference: str) -> float:
    """A user's verifier that takes its time: 1 when the event loop ran meanwhile (0 after 5 s)."""
    return float(LOOP_RAN.wait(timeout=5))


def test_dataset_user_verifier_runs_off_the_event_loop(tmp_path):
    """A user's function may take long on the model's answer: other rollouts on the loop keep running."""
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"prompt": "say it", "answer": "it"}))
    verifier = f"{__name__}:verify_once_the_loop_runs"
    env = make("dataset", path=str(path), verifier=verifier, eval_fraction=0.5)
    task = Task(env="dataset", id="t", prompt="say it", data={"answer": "it"})
    LOOP_RAN.clear()

    async def other_rollout():
        await asyncio.sleep(0.01)
        LOOP_RAN.set()

    async def main():
        await env.reset(task)
        ticker = asyncio.create_task(other_rollout())
        try:
            assert (await env.step("it")).reward == 1.0
        finally:
            ticker.cancel()
            await env.close()

    asyncio.run(main())


def test_dataset_regex_verifier_has_a_time_limit_and_leaves_the_event_loop_free(tmp_path):
    """A reference that backtracks catastrophically on the model's answer (``(a|aa)+c`` on
    40 a's takes ~fib(40) steps) ends the step with a TimeoutError, which the rollout service
    records as env_error, and meanwhile other rollouts on the loop keep running."""
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"prompt": "say it", "answer": "(a|aa)+c"}))
    env = make("dataset", path=str(path), verifier="regex", regex_timeout_s=0.5, eval_fraction=0.5)
    task = Task(env="dataset", id="t", prompt="say it", data={"answer": "(a|aa)+c"})
    ticks = []

    async def other_rollout():
        while True:
            await asyncio.sleep(0.01)
            ticks.append(time.monotonic())

    async def main():
        await env.reset(task)
        ticker = asyncio.create_task(other_rollout())
        try:
            with pytest.raises(TimeoutError, match="gave up after 0.5 s matching a 40-character answer"):
                await env.step("a" * 40)
            assert ticks, "the event loop was held while the verifier matched"
            assert (await env.step("aac")).reward == 1.0
        finally:
            ticker.cancel()
            await env.close()

    asyncio.run(main())


@pytest.mark.parametrize(
    ("name", "content", "config", "error"),
    [
        ("null.jsonl", b'{"prompt": "q", "answer": null}', {}, "line 1 of .*null.jsonl has a null 'answer'"),
        (
            "scalar.jsonl",
            b'{"prompt": "q", "answer": "a"}\n\n7',
            {},
            "line 3 of .*scalar.jsonl is not an object",  # the line an editor shows, blank ones counted
        ),
        ("bad.jsonl", b'{"prompt": "q", "answer": "a"}\n\n{"prompt": }', {}, "bad.jsonl line 3: Expecting"),
        (
            "latin1.jsonl",  # the line, not a byte offset into a file of a million rows
            '{"prompt": "q", "answer": "a"}\n{"prompt": "café", "answer": "b"}'.encode("latin-1"),
            {},
            "latin1.jsonl line 2 is not UTF-8",
        ),
        (
            "marked.jsonl",  # after a byte-order mark, which the decoder drops
            b'\xef\xbb\xbf{"prompt": "q", "answer": "a"}\n\xff',
            {},
            "marked.jsonl line 2 is not UTF-8",
        ),
        ("array.json", b'[{"prompt": "q", "answer": "a"},', {}, "array.json: not valid JSON"),
        (  # a Hugging Face or SQuAD-style file: its rows under a key, over several lines
            "object.json",
            json.dumps({"version": 1, "data": [{"prompt": "q", "answer": "a"}]}, indent=2).encode(),
            {},
            r"object.json holds one JSON object \(keys: \['data', 'version'\]\), not an array of rows",
        ),
        (
            "surrogate.jsonl",
            b'{"prompt": "q", "answer": "a"}\n{"prompt": "r \\ud83d", "answer": "b"}',
            {},
            "line 2 of .*surrogate.jsonl: 'prompt' is not UTF-8 text",
        ),
        ("re.jsonl", b'{"prompt": "q", "answer": "(a"}', {"verifier": "regex"}, "line 1 .*not a regex"),
        *(
            (
                "blank.jsonl",
                b'{"prompt": "q", "answer": "a"}\n{"prompt": "r", "answer": " \\n"}',
                {"verifier": verifier},
                "line 2 of .*blank.jsonl has a blank 'answer'",
            )
            for verifier in ("exact", "regex")
        ),
        (
            "noid.jsonl",
            b'{"prompt": "q", "answer": "a", "qid": 1}\n{"prompt": "r", "answer": "b"}',
            {"id_field": "qid"},
            "line 2 of .*noid.jsonl has no field 'qid'",
        ),
        (
            "nullid.jsonl",
            b'{"prompt": "q", "answer": "a", "qid": null}',
            {"id_field": "qid"},
            "line 1 of .*nullid.jsonl has a null 'qid'",
        ),
        (
            "blankid.jsonl",
            b'{"prompt": "q", "answer": "a", "qid": "q1"}\n{"prompt": "r", "answer": "b", "qid": " "}',
            {"id_field": "qid"},
            "line 2 of .*blankid.jsonl has a blank 'qid'",
        ),
        (
            "blankprompt.jsonl",
            b'{"prompt": "q", "answer": "a"}\n{"prompt": "\\u001f", "answer": "b"}',
            {},
            "line 2 of .*blankprompt.jsonl has a blank 'prompt'",
        ),
        *(
            (
                "num.jsonl",
                b'{"prompt": "q", "answer": "2"}\n{"prompt": "r", "answer": '
                + json.dumps(bad).encode()
                + b"}",
                {"verifier": "numeric"},
                "line 2 of .*num.jsonl: reference is not a number",
            )
            for bad in ("1,000", "3/4", "$5", "NaN")
        ),
    ],
)
def test_dataset_bad_files_fail_the_load_naming_file_and_row(tmp_path, name, content, config, error):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(ValueError, match=error):
        task_set("dataset", "train", 0, 1, {"path": str(path)} | config)


def test_dataset_refuses_a_blank_prompt_when_the_id_is_another_field(tmp_path):
    """Only the id was checked for blanks: with ``id_field`` set, a row whose prompt was empty
    (a lost column, an export gone wrong) loaded, and the model was asked an empty message."""
    path = tmp_path / "blank.jsonl"
    rows = [{"qid": "a", "prompt": "q", "answer": "1"}, {"qid": "b", "prompt": " \n", "answer": "2"}]
    write_rows(path, rows)
    with pytest.raises(ValueError, match="line 2 of .*blank.jsonl has a blank 'prompt'"):
        task_set("dataset", "train", 0, 1, {"path": str(path), "id_field": "qid"})


@pytest.mark.parametrize(
    ("name", "field"), [("data.jsonl", "prompt"), ("data.jsonl", "answer"), ("data.parquet", "answer")]
)
def test_dataset_refuses_a_nan_field(tmp_path, name, field):
    """NaN is how numpy and ``json.dumps`` of a pandas row write a missing value; it loaded as
    the text ``nan``: a prompt ``nan`` shown to the model, a reference ``nan`` the exact
    verifier scored the answer ``nan`` right against."""
    rows = [{"prompt": f"q{i}", "answer": float(i)} for i in range(4)]  # a float column, as pandas makes
    rows[2][field] = float("nan")
    path = tmp_path / name
    write_rows(path, rows)
    where = "row 2" if name.endswith(".parquet") else "line 3"
    with pytest.raises(ValueError, match=f"{where} of .*{name} has a NaN '{field}'"):
        task_set("dataset", "train", 0, 1, {"path": str(path)})


@pytest.mark.parametrize(
    ("field", "value", "kind"),
    [
        ("prompt", [{"role": "user", "content": "hi"}], "list"),
        ("answer", ["4", "four"], "list"),
        ("qid", {"n": 1}, "dict"),
    ],
)
def test_dataset_refuses_a_prompt_answer_or_id_that_is_no_text_or_number(tmp_path, field, value, kind):
    """A chat-format prompt (a list of messages) was shown to the model as its Python repr,
    ``[{'role': 'user', ...}]``, and a list of answers scored as that repr."""
    rows = [{"prompt": "q", "answer": "4", "qid": "a"}, {"prompt": "r", "answer": "5", "qid": "b"}]
    rows[1][field] = value
    path = tmp_path / "nested.jsonl"
    write_rows(path, rows)
    with pytest.raises(ValueError, match=f"line 2 of .*nested.jsonl: '{field}' holds a {kind}, not text"):
        task_set("dataset", "train", 0, 1, {"path": str(path), "id_field": "qid"})


@pytest.mark.parametrize("name", ["data.jsonl", "data.parquet"])
def test_dataset_refuses_a_prompt_given_twice_with_different_answers(tmp_path, name):
    """One task would score an answer right and its twin the same answer wrong: the load
    passed it, and RL trained on a reward that was a coin toss."""
    rows = [{"prompt": f"q{i}", "answer": str(i)} for i in range(4)] + [{"prompt": " q1\n", "answer": "5"}]
    rows += [
        {"prompt": "q2", "answer": "6"},
        {"prompt": "q3", "answer": "3"},
        {"prompt": "q3", "answer": "7"},
    ]
    path = tmp_path / name
    write_rows(path, rows)
    first, second = ("row 1", "row 4") if name.endswith(".parquet") else ("line 2", "line 5")
    with pytest.raises(
        ValueError,
        match=rf"{second} of .*{name}: prompt 'q1' has the answer '5', but '1' at {first} \(and 2 more rows "
        r"like it\): give each prompt one reference",
    ):
        task_set("dataset", "train", 0, 1, {"path": str(path)})


def test_dataset_takes_a_prompt_given_twice_with_one_answer(tmp_path):
    """Written alike (around blanks), or, under the numeric verifier, as one number."""
    rows = [{"prompt": f"q{i}", "answer": str(i)} for i in range(10)]
    rows += [{"prompt": "q1", "answer": " 1\n"}, {"prompt": "q2", "answer": "2.0"}]
    path = tmp_path / "data.jsonl"
    write_rows(path, rows)
    config = {"path": str(path), "eval_fraction": 0.5, "verifier": "numeric"}
    tasks = [task for split in ("train", "eval") for task in task_set("dataset", split, 0, 100, config)]
    assert {task.prompt for task in tasks} == {row["prompt"] for row in rows}
    with pytest.raises(
        ValueError, match="line 12 of .*: prompt 'q2' has the answer '2.0', but '2' at line 3"
    ):
        task_set("dataset", "train", 0, 1, config | {"verifier": "exact"})


def test_dataset_a_file_that_is_no_parquet_fails_the_load_naming_it(tmp_path):
    path = tmp_path / "broken.parquet"
    path.write_bytes(b"not parquet\n")
    with pytest.raises(ValueError, match="broken.parquet is not a Parquet file"):
        task_set("dataset", "train", 0, 1, {"path": str(path)})


@pytest.mark.parametrize(
    ("name", "content"), [("empty.jsonl", ""), ("blank.jsonl", "\n \n"), ("empty.json", "[]")]
)
def test_dataset_a_file_without_rows_fails_the_load_saying_so(tmp_path, name, content):
    """It said none of its 0 rows fell in the split, and to change eval_fraction."""
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(ValueError, match=f"{name} holds no rows"):
        task_set("dataset", "train", 0, 1, {"path": str(path)})


@pytest.mark.parametrize("layout", ["array", "lines"])
def test_dataset_reads_a_json_file_holding_an_array_or_json_lines(tmp_path, layout):
    rows = [{"prompt": f"q{i}", "answer": str(i)} for i in range(20)]
    path = tmp_path / "rows.json"
    # pretty-printed after a blank line; lines apart by lines of blanks
    path.write_text(
        "\n" + json.dumps(rows, indent=2) if layout == "array" else "\n \t\n".join(map(json.dumps, rows))
    )
    tasks = task_set("dataset", "train", 0, 5, {"path": str(path)})
    assert len(tasks) == 5 and all(task.data["answer"] == task.prompt[1:] for task in tasks)


def test_dataset_jsonl_lines_end_only_at_newlines(tmp_path):
    """A JSON string may hold U+2028, U+2029 or U+0085 unescaped (``ensure_ascii=False``)."""
    rows = [{"prompt": f"q{i}\u2028{i}\u2029\x85", "answer": str(i)} for i in range(20)]
    path = tmp_path / "data.jsonl"
    path.write_text("\r\n".join(json.dumps(row, ensure_ascii=False) for row in rows) + "\n", "utf-8")
    config = {"path": str(path), "eval_fraction": 0.5}
    tasks = [task for split in ("train", "eval") for task in task_set("dataset", split, 0, 100, config)]
    assert {(task.prompt, task.data["answer"]) for task in tasks} == {
        (r["prompt"], r["answer"]) for r in rows
    }


@pytest.mark.parametrize(
    "name, layout", [("data.jsonl", "lines"), ("data.json", "lines"), ("data.json", "array")]
)
def test_dataset_reads_a_file_that_starts_with_a_byte_order_mark(tmp_path, name, layout):
    """Notepad and PowerShell write UTF-8 with a BOM: it is no part of the first row."""
    rows = [{"prompt": f"q{i}", "answer": str(i)} for i in range(20)]
    text = json.dumps(rows) if layout == "array" else "\r\n".join(map(json.dumps, rows)) + "\r\n"
    path = tmp_path / name
    path.write_bytes(b"\xef\xbb\xbf" + text.encode())
    config = {"path": str(path), "eval_fraction": 0.5}
    tasks = [task for split in ("train", "eval") for task in task_set("dataset", split, 0, 100, config)]
    assert {(task.prompt, task.data["answer"]) for task in tasks} == {
        (r["prompt"], r["answer"]) for r in rows
    }


def test_dataset_split_keeps_a_prompt_under_many_ids_in_one_split(tmp_path):
    rows = [
        {"qid": f"{i}-{copy}", "prompt": f"q{i}", "answer": str(i)} for i in range(100) for copy in range(4)
    ]
    path = tmp_path / "data.jsonl"
    write_rows(path, rows)
    config = {"path": str(path), "id_field": "qid"}
    train, evals = (task_set("dataset", split, 0, 1000, config) for split in ("train", "eval"))
    assert not {t.prompt for t in train} & {t.prompt for t in evals}
    assert {t.id for t in train} | {t.id for t in evals} == {row["qid"] for row in rows}


@pytest.mark.parametrize("name", ["data.jsonl", "data.parquet"])
def test_dataset_refuses_an_id_given_to_two_prompts(tmp_path, name):
    """Two prompts under one id were two tasks of one name, each split by its own prompt: the
    id was held out for eval and trained on, and the trajectories' prompt_id named both."""
    rows = [{"qid": f"id{i}", "prompt": f"q{i}", "answer": str(i)} for i in range(4)]
    rows += [{"qid": "id1", "prompt": " q1\n", "answer": "1"}, {"qid": "id2", "prompt": "q2", "answer": "2"}]
    rows += [{"qid": "id3", "prompt": "q7", "answer": "7"}]
    path = tmp_path / name
    write_rows(path, rows)
    first, second = ("row 3", "row 6") if name.endswith(".parquet") else ("line 4", "line 7")
    with pytest.raises(
        ValueError,
        match=rf"{second} of .*{name}: id 'id3' names the prompt 'q7', but 'q3' at {first}: give each "
        "prompt an id of its own",
    ):
        task_set("dataset", "train", 0, 1, {"path": str(path), "id_field": "qid"})


def test_dataset_split_keeps_a_prompt_written_with_surrounding_whitespace_in_one_split(tmp_path):
    rows = [{"prompt": prompt, "answer": str(i)} for i in range(100) for prompt in (f"q{i}", f" q{i}\n")]
    path = tmp_path / "data.jsonl"
    write_rows(path, rows)
    train, evals = (task_set("dataset", split, 0, 1000, {"path": str(path)}) for split in ("train", "eval"))
    assert not {t.prompt.strip() for t in train} & {t.prompt.strip() for t in evals}


def test_dataset_demonstrates_answers_never_regex_patterns(tmp_path):
    """The warm start would teach the policy to answer with the patterns, which score 0."""
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"q{i}", "answer": f"{i}+"}) for i in range(20)))
    config = {"path": str(path), "eval_fraction": 0.5}
    task = task_set("dataset", "train", 0, 1, config)[0]
    assert asyncio.run(play("dataset", task, demonstrate(task), **config))[1] == 1.0
    task = task_set("dataset", "train", 0, 1, config | {"verifier": "regex"})[0]
    with pytest.raises(NotImplementedError, match="no scripted solver with verifier 'regex'"):
        demonstrate(task)


def test_dataset_flawed_demonstrator_answers_blank_about_half_the_time(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"q{i}", "answer": str(i)}) for i in range(400)))
    tasks = task_set("dataset", "train", 0, 300, {"path": str(path)})
    flawed = [demonstrate(task, flawed=True) for task in tasks]
    assert {tuple(answer) for answer in flawed} - {(task.data["answer"],) for task in tasks} == {("",)}
    assert 0.3 < sum(answer == [""] for answer in flawed) / len(tasks) < 0.7


def test_dataset_tasks_are_the_split_shuffled_by_seed_and_repeated_past_its_end(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"q{i}", "answer": str(i)}) for i in range(40)))
    config = {"path": str(path), "eval_fraction": 0.5}
    split = [f"q{i}" for i in range(40) if not in_eval_split(f"q{i}", 0.5)]
    orders = [[t.id for t in task_set("dataset", "train", seed, len(split), config)] for seed in range(3)]
    assert all(sorted(order) == sorted(split) for order in orders)
    assert split not in orders and len({tuple(order) for order in orders}) == 3
    assert [t.id for t in task_set("dataset", "train", 0, 2 * len(split) + 1, config)] == [
        *orders[0],
        *orders[0],
        orders[0][0],
    ]


def test_dataset_tasks_of_a_seed_are_the_same_whatever_the_order_of_the_rows(tmp_path):
    """The same rows in another order (a re-export, a shuffled copy) gave another shuffle, so an
    evaluation measured other held-out problems than the last run's, on the same seed."""
    rows = [{"qid": f"r{i}", "prompt": f"q{i % 30}", "answer": str(i % 30)} for i in range(60)]
    tasks = []
    for name, ordered in (("a.jsonl", rows), ("b.jsonl", rows[::-1])):
        path = tmp_path / name
        path.write_text("\n".join(map(json.dumps, ordered)))
        config = {"path": str(path), "id_field": "qid", "eval_fraction": 0.3}
        tasks.append([task_set("dataset", split, 7, 10, config) for split in ("train", "eval")])
    assert tasks[0] == tasks[1]


def test_dataset_episode_without_an_answer_scores_zero_on_a_reused_env(tmp_path):
    """A reset env must not keep the last episode's score for one that ends with no step."""
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"prompt": "say it", "answer": "it"}))
    task = Task(env="dataset", id="t", prompt="say it", data={"answer": "it"})

    async def run():
        env = make("dataset", path=str(path), eval_fraction=0.5)
        try:
            await env.reset(task)
            assert (await env.step("it")).reward == await env.evaluate() == 1.0
            await env.reset(task)
            return await env.evaluate()
        finally:
            await env.close()

    assert asyncio.run(run()) == 0.0


def nan_verifier(answer, reference):
    return float("nan")


def test_dataset_verifier_returning_nan_scores_zero(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"q{i}", "answer": str(i)}) for i in range(20)))
    config = {"path": str(path), "verifier": f"{__name__}:nan_verifier"}
    task = task_set("dataset", "train", 0, 1, config)[0]
    result, score = asyncio.run(play("dataset", task, ["0"], **config))
    assert result.reward == result.progress == score == 0.0


@pytest.mark.parametrize(
    ("reference", "answer", "score"),
    [
        ("18446744073709551616", "18446744073709551615", 0.0),  # 2**64 and 2**64 - 1: one float
        ("18446744073709551616", "1.8446744073709551616e19", 1.0),
        ("0.1", "0.1000005", 1.0),
        ("0.1", "0.1000015", 0.0),
        ("0.1", "0.100001", 1.0),  # 1e-6 apart: at the tolerance, not past it
        ("inf", "1e999", 0.0),  # past the float range, but a finite number
        ("inf", "inf", 1.0),
        ("1", "1e999999999", 0.0),
        ("1", "sNaN", 0.0),
        ("-5", "\u22125", 1.0),  # U+2212, the typeset minus
        ("\u22125", "-5.", 1.0),
        ("-5", "\u2212\u22125", 0.0),
        ("0", "1e\u22127", 1.0),
    ],
)
def test_dataset_numeric_verifier_compares_the_numbers_written_not_their_floats(reference, answer, score):
    task = Task(env="dataset", id="q", prompt="q", data={"answer": reference})
    result, final = asyncio.run(play("dataset", task, [answer], verifier="numeric"))
    assert result.reward == final == score


def test_dataset_numeric_verifier_takes_a_reference_written_with_the_typeset_minus(tmp_path):
    """It was refused as no number, though the answer ``-5`` is the number it writes."""
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"q{i}", "answer": f"\u2212{i}"}) for i in range(20)))
    task = task_set("dataset", "train", 0, 1, {"path": str(path), "verifier": "numeric"})[0]
    result, _ = asyncio.run(play("dataset", task, [f"-{task.prompt[1:]}"], verifier="numeric"))
    assert result.reward == 1.0


def test_registry_knows_every_env():
    assert set(REGISTRY) == {"arith", "guess", "pytool", "code", "shell", "dataset", "agent"}
    with pytest.raises(KeyError, match="unknown environment"):
        make("nope")


@pytest.mark.parametrize("name", ["arith", "guess"])
def test_a_negative_task_count_is_refused(name):
    """Not every task sample_unique drew (arith) nor none (guess): a clear error."""
    with pytest.raises(ValueError, match="n \\(the number of tasks\\) must be >= 0, got -1"):
        task_set(name, "train", seed=0, n=-1)
