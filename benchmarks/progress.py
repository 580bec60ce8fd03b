"""Progress of a long command: which phase runs, which round of how many, time elapsed and expected.

One place for it, used by every long benchmark (``make run``, ``kvtier bench e2e``, ``vllm``,
``peer``) and by the code they call, which reports through the module functions ``say`` and
``advance`` without holding the display:

    plan = [Phase("model", 5), Phase("scenario", 50, rounds=2), Phase("tiers", 30)]
    with Progress("kvtier main job", plan) as p:
        p.phase("model")              # starts a phase (and ends the one before)
        ...
        p.phase("scenario")
        for r in range(2):
            say("cold tenant0: ...")  # a line above the display (or a plain line)
            advance()                 # one round of the current phase is done

Milestones are lines on stderr: one when a phase starts, one per round, one when a phase ends,
each with the elapsed and expected time. On a terminal (stdout and stderr both) a ``rich`` live
display stays below them: the phase, the round, elapsed and expected time, and a bar of the time.
Otherwise (a pipe, a file, CI) the lines are plain text, with no control characters.

Expected time: a phase's own estimate (``Phase.expected_s``, measured on the 2-core development
machine) until its first round is done, then its rounds so far extrapolated; the whole command's
expected time is the time spent so far plus what the current and later phases are expected to
take. It is "unknown" while a phase has no estimate and no finished round.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO, Any

PREFIX = "[kvtier bench]"


@dataclass(slots=True, frozen=True)
class Phase:
    """One planned phase: its name, how long it is expected to take, in how many rounds."""

    name: str
    expected_s: float | None = None
    rounds: int | None = None


def use_live(out: IO[str], err: IO[str]) -> bool:
    """A live display only when both output streams are terminals: a live display redirects what
    is printed while it runs, which must not move a result meant for a file into the terminal."""
    return _isatty(out) and _isatty(err)


def _isatty(stream: IO[str]) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # a closed or wrapped stream: not a terminal
        return False


def clock(seconds: float | None) -> str:
    """``1:05`` for 65 s; ``?`` for unknown."""
    if seconds is None:
        return "?"
    s = max(0, round(seconds))
    return f"{s // 60}:{s % 60:02d}"


class Progress:
    """The progress of one command. See the module docstring.

    Invariants: at most one phase is current; ``done`` <= ``rounds`` of the current phase is not
    enforced (a phase may run more rounds than planned; the estimate then follows the rounds);
    ``close`` ends the current phase and the display, once. The innermost open Progress receives
    ``say`` and ``advance``.
    """

    def __init__(self, title: str, plan: Sequence[Phase] = (), *, stream: IO[str] | None = None,
                 live: bool | None = None) -> None:
        self.title = title
        self.plan = list(plan)
        self.stream = stream if stream is not None else sys.stderr
        self.live = use_live(sys.stdout, self.stream) if live is None else live
        self.t0 = time.monotonic()
        self._current: Phase | None = None
        self._phase_t0 = self.t0
        self._done = 0
        self._finished: set[str] = set()
        self._note = ""
        self._live: Any = None
        self._closed = False

    # -- lifecycle --------------------------------------------------------------------------------
    def __enter__(self) -> Progress:
        _ACTIVE.append(self)
        if self.live:
            from rich.console import Console
            from rich.live import Live

            console = Console(file=self.stream, force_terminal=True)
            self._live = Live(_View(self), console=console, refresh_per_second=4, transient=True,
                              redirect_stdout=True, redirect_stderr=False)
            self._live.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._end_phase()
        if self._live is not None:
            self._live.stop()
            self._live = None
        if self in _ACTIVE:
            _ACTIVE.remove(self)
        self._line(f"{self.title}: {clock(self.elapsed())} in all")

    # -- reporting --------------------------------------------------------------------------------
    def phase(self, name: str, *, rounds: int | None = None, expected_s: float | None = None) -> None:
        """Start phase ``name`` (planned or not); ``rounds`` and ``expected_s`` override the plan's."""
        self._end_phase()
        planned = next((p for p in self.plan if p.name == name), None)
        self._current = Phase(name, expected_s if expected_s is not None else planned and planned.expected_s,
                              rounds if rounds is not None else planned and planned.rounds)
        self._phase_t0 = time.monotonic()
        self._done = 0
        self._note = ""
        est = self._current.expected_s
        self._line(f"{self._position()}{name}" + (f" ({self._current.rounds} rounds)" if self._current.rounds else "")
                   + (f": takes about {clock(est)}" if est is not None else "") + self._times())

    def advance(self, note: str = "") -> None:
        """One round of the current phase is done (``note``: what it did, shown with it)."""
        if self._current is None:
            if note:
                self.say(note)
            return
        self._done += 1
        self._note = note
        self._line(f"{self._current.name}: {self._round_text()} done" + (f": {note}" if note else "") + self._times())

    def say(self, msg: str) -> None:
        """A line of information: above the live display, or a plain line."""
        if self._live is not None:
            self._live.console.print(f"{PREFIX} {msg}", markup=False, highlight=False, soft_wrap=True)
        else:
            print(f"{PREFIX} {msg}", file=self.stream, flush=True)

    # -- estimates --------------------------------------------------------------------------------
    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def phase_remaining(self) -> float | None:
        """Expected seconds left in the current phase (None: unknown)."""
        cur = self._current
        if cur is None:
            return 0.0
        spent = time.monotonic() - self._phase_t0
        if cur.rounds and self._done:
            return spent / self._done * max(cur.rounds - self._done, 0)
        return None if cur.expected_s is None else max(cur.expected_s - spent, 0.0)

    def expected_total(self) -> float | None:
        """Expected seconds of the whole command: elapsed + the rest of this phase + later phases."""
        rest = self.phase_remaining()
        if rest is None:
            return None
        later = [p for p in self.plan if p.name not in self._finished
                 and (self._current is None or p.name != self._current.name)]
        if any(p.expected_s is None for p in later):
            return None
        return self.elapsed() + rest + sum(p.expected_s or 0.0 for p in later)

    # -- rendering --------------------------------------------------------------------------------
    def status(self) -> str:
        """One line: title, phase, round, elapsed, expected (what the live display shows)."""
        cur = self._current
        parts = [self.title]
        if cur is not None:
            parts.append(f"{self._position()}{cur.name}")
            if cur.rounds:
                parts.append(f"round {min(self._done + 1, cur.rounds)}/{cur.rounds}")
        parts.append(f"elapsed {clock(self.elapsed())}, expected about {clock(self.expected_total())}")
        return "  ".join(parts)

    def _position(self) -> str:
        names = [p.name for p in self.plan]
        cur = self._current
        if cur is None or cur.name not in names:
            return ""
        return f"[{names.index(cur.name) + 1}/{len(names)}] "

    def _round_text(self) -> str:
        cur = self._current
        assert cur is not None
        return f"round {self._done}/{cur.rounds}" if cur.rounds else f"step {self._done}"

    def _times(self) -> str:
        return f" (elapsed {clock(self.elapsed())} of about {clock(self.expected_total())})"

    def _end_phase(self) -> None:
        cur = self._current
        if cur is None:
            return
        self._finished.add(cur.name)
        self._current = None
        self._line(f"{cur.name}: done in {clock(time.monotonic() - self._phase_t0)}")

    def _line(self, msg: str) -> None:
        """A milestone (a phase begun or ended, a round done): a line kept above the live display."""
        self.say(msg)


class _View:
    """What the live display renders, read from the Progress at every refresh."""

    def __init__(self, progress: Progress) -> None:
        self.p = progress

    def __rich__(self) -> Any:
        from rich.console import Group
        from rich.progress_bar import ProgressBar
        from rich.text import Text

        p = self.p
        total = p.expected_total()
        bar = ProgressBar(total=total or None, completed=min(p.elapsed(), total) if total else 0, width=40)
        note = f"  last: {p._note}" if p._note else ""
        return Group(Text(p.status() + note, overflow="ellipsis", no_wrap=True), bar)


#: The open displays, innermost last (``say`` and ``advance`` go to it).
_ACTIVE: list[Progress] = []


def current() -> Progress | None:
    return _ACTIVE[-1] if _ACTIVE else None


def say(msg: str) -> None:
    """A line of information: through the open display, else a plain line on stderr."""
    p = current()
    if p is not None:
        p.say(msg)
    else:
        print(f"{PREFIX} {msg}", file=sys.stderr, flush=True)


def advance(note: str = "") -> None:
    """One round of the open display's current phase is done; without a display, ``note`` is said."""
    p = current()
    if p is not None:
        p.advance(note)
    elif note:
        say(note)
