"""The pure helpers of ``benchmarks/`` that decide what a benchmark's ratio compares."""

from __future__ import annotations

import importlib

import pytest

from benchmarks.bench_processor import alternated_best
from benchmarks.bench_tools import alternated_medians_ms


def test_the_processor_sides_run_as_often_as_each_other_taking_turns():
    calls: list[str] = []

    def side(name: str):
        def run() -> str:
            calls.append(name)
            return f"{name}-{calls.count(name)}"

        return run

    best = alternated_best({"ours": side("ours"), "straightforward": side("straightforward")}, repeats=3)

    assert calls == ["ours", "straightforward"] * 3
    assert {name: result for name, (_, result) in best.items()} == {
        "ours": "ours-3",
        "straightforward": "straightforward-3",
    }
    assert all(seconds >= 0 for seconds, _ in best.values())


def test_the_persistent_and_fresh_shell_are_timed_as_often_as_each_other_taking_turns():
    calls: list[str] = []
    medians = alternated_medians_ms(
        {"persistent": lambda: calls.append("persistent"), "fresh": lambda: calls.append("fresh")}, repeats=4
    )

    assert calls == ["persistent", "fresh"] * 4
    assert set(medians) == {"persistent", "fresh"}
    assert all(median >= 0 for median in medians.values())


@pytest.mark.parametrize(
    ("bench", "argv", "flag"),
    [
        ("bench_engine", ["--prompts", "0"], "--prompts"),
        ("bench_engine", ["--new-tokens", "0"], "--new-tokens"),
        ("bench_routing", ["--sessions", "0"], "--sessions"),
        ("bench_routing", ["--turns", "0"], "--turns"),
        ("bench_routing", ["--replicas", "0"], "--replicas"),
        ("bench_shards", ["--repeats", "0"], "--repeats"),
        ("bench_shards", ["--batch-rows", "0"], "--batch-rows"),
        ("bench_shards", ["--trajectories", "0"], "--trajectories"),
        ("bench_learning", ["--eval-every", "0"], "--eval-every"),
        ("bench_learning", ["--arith-seconds", "-1"], "--arith-seconds"),
        ("bench_train_memory", ["--tokens", "8", "--action-share", "0.05"], "--action-share"),
    ],
)
def test_a_size_a_benchmark_cannot_run_with_is_refused_naming_its_flag(bench, argv, flag, capsys):
    module = importlib.import_module(f"benchmarks.{bench}")

    with pytest.raises(SystemExit) as exited:
        module.parse_args(argv)

    assert exited.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]  # the usage above it names every flag
    assert "error:" in error and flag in error and "unrecognized arguments" not in error, error
