"""connectors/lookups_in_flight.py: one lookup per request off the scheduling step."""

from __future__ import annotations

import threading

import pytest

from connectors.lookups_in_flight import LookupsInFlight
from kvtier.errors import AccessDenied


def test_a_quick_lookup_is_answered_in_the_call_that_asked() -> None:
    lookups: LookupsInFlight[int] = LookupsInFlight(2, inline_wait_s=5.0)
    try:
        assert lookups.ask("r1", lambda: 7) == 7
        assert len(lookups) == 0
    finally:
        lookups.close()


def test_a_slow_lookup_answers_none_until_done_then_its_result_once() -> None:
    release = threading.Event()
    calls: list[str] = []

    def slow() -> int:
        calls.append("r1")
        assert release.wait(10)
        return 3

    lookups: LookupsInFlight[int] = LookupsInFlight(2, inline_wait_s=0.0)
    try:
        assert lookups.ask("r1", slow) is None
        assert lookups.ask("r1", slow) is None  # asked again: the same lookup, not a second one
        assert lookups.ask("r2", lambda: 4) in (None, 4)  # another request is not behind it
        release.set()
        got = None
        while got is None:
            got = lookups.ask("r1", slow)
        assert got == 3 and calls == ["r1"]
        assert lookups.ask("r1", lambda: 9) in (None, 9)  # taken once: a later ask is a new lookup
    finally:
        release.set()
        lookups.close()


def test_a_failed_lookup_raises_where_it_is_taken() -> None:
    def refused() -> int:
        raise AccessDenied("revoked")

    lookups: LookupsInFlight[int] = LookupsInFlight(1, inline_wait_s=5.0)
    try:
        with pytest.raises(AccessDenied, match="revoked"):
            lookups.ask("r1", refused)
        assert len(lookups) == 0
    finally:
        lookups.close()


def test_a_finished_request_leaves_no_lookup_behind() -> None:
    release = threading.Event()
    lookups: LookupsInFlight[int] = LookupsInFlight(1, inline_wait_s=0.0)
    try:
        assert lookups.ask("r1", lambda: int(release.wait(10))) is None
        lookups.forget("r1")
        lookups.forget("never-asked")
        assert len(lookups) == 0
    finally:
        release.set()
        lookups.close()
