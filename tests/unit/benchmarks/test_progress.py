"""benchmarks/progress: phase, round, elapsed and expected time; plain lines without a terminal;
benchmarks.common.progress goes through the open display."""

from __future__ import annotations

import io

import pytest

from benchmarks import progress as prog
from benchmarks.common import progress as common_progress
from benchmarks.progress import Phase, Progress, advance, clock, say, use_live


class _Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def fake_time(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    c = _Clock()
    monkeypatch.setattr(prog.time, "monotonic", c)
    return c


def test_without_a_terminal_plain_lines_carry_phase_round_elapsed_and_expected(fake_time: _Clock) -> None:
    out = io.StringIO()
    with Progress("job", [Phase("build", 10), Phase("rounds", 20, rounds=2)], stream=out) as p:
        assert p.live is False
        p.phase("build")
        fake_time.t += 12
        say("built")
        p.phase("rounds")
        fake_time.t += 8
        advance("first")
        fake_time.t += 8
        advance("second")
    lines = out.getvalue().splitlines()
    assert lines == [
        "[kvtier bench] [1/2] build: takes about 0:10 (elapsed 0:00 of about 0:30)",
        "[kvtier bench] built",
        "[kvtier bench] build: done in 0:12",
        "[kvtier bench] [2/2] rounds (2 rounds): takes about 0:20 (elapsed 0:12 of about 0:32)",
        # After a round, the phase's estimate is its rounds so far extrapolated.
        "[kvtier bench] rounds: round 1/2 done: first (elapsed 0:20 of about 0:28)",
        "[kvtier bench] rounds: round 2/2 done: second (elapsed 0:28 of about 0:28)",
        "[kvtier bench] rounds: done in 0:16",
        "[kvtier bench] job: 0:28 in all",
    ]
    assert "\x1b" not in out.getvalue(), "no control characters off a terminal"


def test_status_line_and_an_unknown_estimate(fake_time: _Clock) -> None:
    p = Progress("job", [Phase("a", 5)], stream=io.StringIO())
    p.phase("a")
    fake_time.t += 2
    assert p.status() == "job  [1/1] a  elapsed 0:02, expected about 0:05"
    p.phase("unplanned", rounds=3)
    assert p.expected_total() is None and p.status() == "job  unplanned  round 1/3  elapsed 0:02, expected about ?"
    fake_time.t += 3
    p.advance()
    assert p.expected_total() == pytest.approx(5 + 6)
    p.close()


def test_live_only_when_both_streams_are_terminals() -> None:
    assert use_live(_Tty(), _Tty()) is True
    assert use_live(io.StringIO(), _Tty()) is False
    assert use_live(_Tty(), io.StringIO()) is False


def test_live_display_keeps_the_lines_above_it() -> None:
    out = _Tty()
    with Progress("job", [Phase("a", 1)], stream=out, live=True) as p:
        p.phase("a")
        say("hello from deep inside")
    text = out.getvalue()
    assert "[kvtier bench] hello from deep inside" in text and "[kvtier bench] a: done in" in text


def test_common_progress_goes_through_the_open_display(capsys: pytest.CaptureFixture[str]) -> None:
    out = io.StringIO()
    with Progress("job", stream=out):
        common_progress("inside")
    common_progress("outside")
    assert "[kvtier bench] inside" in out.getvalue()
    err = capsys.readouterr().err
    assert err == "[kvtier bench] outside\n"
    assert prog.current() is None


def test_clock_format() -> None:
    assert (clock(0), clock(59.6), clock(65), clock(3725), clock(None)) == ("0:00", "1:00", "1:05", "62:05", "?")
