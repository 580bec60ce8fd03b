"""benchmarks/common.paired_seconds: neither side of a ratio always runs first (issue 16 §5)."""

from __future__ import annotations

from benchmarks.common import paired_seconds


def test_order_alternates_ours_first_on_even_reps_base_first_on_odd() -> None:
    calls: list[str] = []
    medians = paired_seconds(lambda: calls.append("ours"), lambda: calls.append("base"), 5,
                             setup=lambda: calls.append("setup"))
    assert calls == ["setup", "ours", "base", "setup", "base", "ours", "setup", "ours", "base",
                     "setup", "base", "ours", "setup", "ours", "base"]
    assert len(medians) == 2 and all(m >= 0 for m in medians)


def test_each_side_runs_reps_times_without_setup() -> None:
    calls: list[str] = []
    paired_seconds(lambda: calls.append("ours"), lambda: calls.append("base"), 4)
    assert calls == ["ours", "base", "base", "ours", "ours", "base", "base", "ours"]
