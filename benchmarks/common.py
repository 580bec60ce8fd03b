"""Shared benchmark plumbing: timing, progress, tables, JSON, stopping a started process."""

from __future__ import annotations

import json
import os
import signal
import socket
import statistics
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.progress import say
from kvtier.errors import TierUnavailable


def progress(msg: str) -> None:
    """A progress line: above the open display of ``benchmarks.progress``, else plain on stderr."""
    say(msg)


def best_seconds(fn: Callable[[], object], reps: int, setup: Callable[[], object] | None = None) -> float:
    """Median wall time of ``reps`` runs of ``fn`` (``setup`` runs untimed before each)."""
    times = []
    for _ in range(reps):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def paired_seconds(
    ours: Callable[[], object],
    base: Callable[[], object],
    reps: int,
    setup: Callable[[], object] | None = None,
) -> tuple[float, float]:
    """Medians of ``ours`` and ``base`` timed alternately, so drift on a shared machine hits both.

    The order alternates too: ours first on even repetitions, the baseline first on odd ones.
    Whichever runs first meets the state ``setup`` just left (an emptied tier, cold caches) and
    runs right after the previous pair's second call; a fixed order would hand that to one side
    every time. ``setup`` runs untimed before each pair.
    """
    a: list[float] = []
    b: list[float] = []
    for i in range(reps):
        if setup is not None:
            setup()
        for fn, acc in ((ours, a), (base, b)) if i % 2 == 0 else ((base, b), (ours, a)):
            t0 = time.perf_counter()
            fn()
            acc.append(time.perf_counter() - t0)
    return statistics.median(a), statistics.median(b)


def table(rows: Sequence[dict[str, Any]], cols: Sequence[tuple[str, str, str]]) -> str:
    """cols: (key, header, format spec)."""
    cells = [[format(r.get(k, ""), f) if r.get(k) is not None else "-" for k, _, f in cols] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, (_, h, _) in enumerate(cols)]
    line = "  ".join(h.ljust(w) for (_, h, _), w in zip(cols, widths, strict=True))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(out)


def write_json(path: str | Path | None, payload: dict[str, Any]) -> None:
    if not path:
        return
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n")
    progress(f"wrote {p}")


def stop_on_sigterm() -> None:
    """A benchmark that starts servers in sessions of their own (engines, daemons, routers) stops
    them on SIGTERM as on Ctrl-C: the signal raises KeyboardInterrupt in the main thread, so the
    benchmark's clean-up runs. Killed without it, the servers outlived it (a test that stopped a
    bench past its limit left two engines spinning on the cores the rest of the suite needed).
    Main thread only (Python delivers signals there); elsewhere it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        return

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)


def stop_process(proc: subprocess.Popen[bytes], grace_s: float = 30) -> None:
    """Stop a process this benchmark started (a ``kvtier serve`` daemon): SIGTERM, then SIGKILL
    after ``grace_s`` seconds; waits for it to exit."""
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def stop_group(proc: subprocess.Popen[bytes]) -> None:
    """Stop a process started in its own session and everything in its group (an engine, a router):
    SIGTERM (after a SIGCONT, so that a group a fault test froze can act on it), SIGKILL if it
    lingers past 60 s."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGCONT)
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now (for a server started next)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_ready_file(path: Path, proc: subprocess.Popen[bytes], what: str, timeout_s: float = 120.0, *,
                    log: Path | None = None) -> str:
    """The content of the file ``proc`` writes once it is ready (``kvtier serve --ready-file``, a
    port file), as soon as it has any; TierUnavailable when ``proc`` exits first or the deadline
    passes (``what`` names it; ``log``: its log, whose end the error carries)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if path.exists() and path.stat().st_size:
            return path.read_text()
        if proc.poll() is not None:
            tail = f":\n{log.read_text(errors='replace')[-2000:]}" if log is not None and log.exists() else ""
            raise TierUnavailable(f"{what} exited with {proc.returncode} before it was ready{tail}")
        if time.monotonic() > deadline:
            raise TierUnavailable(f"{what} not ready after {timeout_s:.0f} s" + (f" (log: {log})" if log else ""))
        time.sleep(0.05)


def wait_healthy(url: str, proc: subprocess.Popen[bytes], what: str, timeout_s: float, poll_s: float = 1.0) -> None:
    """Poll ``url`` until it answers 200; TierUnavailable when ``proc`` exits first or the deadline
    passes (``what`` names it, with where to look)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise TierUnavailable(f"{what} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass  # not listening yet: keep polling until the deadline
        if time.monotonic() > deadline:
            raise TierUnavailable(f"{what} did not answer {url} in {timeout_s:.0f} s")
        time.sleep(poll_s)
