"""The pure helpers of ``benchmarks/`` that decide what a benchmark's ratio compares."""

from __future__ import annotations

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
