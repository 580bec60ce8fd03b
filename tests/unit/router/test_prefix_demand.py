"""How often requests for a prefix arrived lately (kvtier/router/prefix_demand.py)."""

from __future__ import annotations

import logging

import pytest

from kvtier.router.prefix_demand import PrefixDemand

DOC = ("d0", "d1", "d2")


def test_requests_that_shared_a_prefix_are_counted_per_second_over_the_window() -> None:
    d = PrefixDemand(window_s=10.0)
    for i in range(5):
        d.arrived((*DOC, f"q{i}"), now=float(i))
    d.arrived(("d0", "other"), now=5.0)
    prompt = (*DOC, "new")
    assert d.rate(prompt, 3, now=6.0) == pytest.approx(0.5)  # 5 shared all three blocks
    assert d.rate(prompt, 1, now=6.0) == pytest.approx(0.6)  # 6 shared the first
    assert d.rate(prompt, 4, now=6.0) == 0.0  # nobody asked for "new"
    assert d.rate(prompt, 0, now=6.0) == 0.0  # no held prefix: no demand


def test_a_request_counts_once_and_only_after_it_arrived() -> None:
    d = PrefixDemand(window_s=10.0)
    prompt = ("x", "x", "y")  # a repeated digest counts once for its request
    assert d.rate(prompt, 3, now=0.0) == 0.0  # asked before its own arrival: itself not counted
    d.arrived(prompt, now=0.0)
    assert d.rate(prompt, 1, now=0.0) == pytest.approx(0.1)
    assert d.rate(prompt, 3, now=0.0) == pytest.approx(0.1)


def test_arrivals_older_than_the_window_are_forgotten() -> None:
    d = PrefixDemand(window_s=10.0)
    d.arrived(DOC, now=0.0)
    d.arrived(DOC, now=5.0)
    assert d.rate(DOC, 3, now=10.0) == pytest.approx(0.2)
    assert d.rate(DOC, 3, now=10.5) == pytest.approx(0.1)  # the first is 10.5 s old
    assert d.rate(DOC, 3, now=16.0) == 0.0
    assert d._counts == {}  # nothing kept once every request left the window


def test_beyond_max_entries_the_oldest_requests_are_forgotten_early_and_rates_read_low() -> None:
    d = PrefixDemand(window_s=100.0, max_entries=4)
    d.arrived(("a0", "a1"), now=0.0)
    d.arrived(("b0", "b1"), now=1.0)
    assert d.rate(("a0", "a1"), 2, now=1.0) == pytest.approx(0.01)
    d.arrived(("c0",), now=2.0)  # 5 digests held: the oldest request goes
    assert d._entries == 3 and set(d._counts) == {"b0", "b1", "c0"}
    assert d.rate(("a0", "a1"), 2, now=2.0) == 0.0
    assert d.rate(("b0", "b1"), 2, now=2.0) == pytest.approx(0.01)
    # Shared digests count against the bound once per request that holds them.
    d.arrived(("c0",), now=3.0)
    assert d._entries == 4 and d.rate(("c0",), 1, now=3.0) == pytest.approx(0.02)
    d.arrived(tuple(f"long{i}" for i in range(5)), now=4.0)  # longer than the bound: nothing kept
    assert d._entries == 0 and d._counts == {}


def test_a_depth_beyond_the_prompt_is_a_bug() -> None:
    with pytest.raises(AssertionError):
        PrefixDemand().rate(DOC, 4, now=0.0)


def test_the_bound_cutting_the_window_short_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    d = PrefixDemand(window_s=100.0, max_entries=2)
    with caplog.at_level(logging.WARNING, logger="kvtier.router"):
        d.arrived(("a0", "a1"), now=0.0)
        assert not caplog.records  # within the bound: nothing to say
        d.arrived(("b0",), now=1.0)
        d.arrived(("c0",), now=2.0)
    warned = [r for r in caplog.records if "forgotten early" in r.getMessage()]
    assert len(warned) == 1
