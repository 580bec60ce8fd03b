"""Processes for the router's tests: node daemons (``kvtier serve``), test engines
(route_test_engine.py: OpenAI-shaped servers, not vLLM) and ``kvtier route`` itself, each in a
process of its own so that it can be killed and frozen (SIGSTOP) like a real one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from kvtier.engine.checkpoint import write_tokenizer
from tests.helpers import freeze, wait_for

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 4096
#: The test model's chat template: a role token, the content, and the assistant's role token to
#: open the answer (token ``t<i>`` is id i).
CHAT_TEMPLATE = ("{% for m in messages %}{{ {'system': 't3', 'user': 't4', 'assistant': 't5'}[m['role']] }} "
                 "{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}t5{% endif %}")


def tokenizer_dir(root: Path) -> Path:
    """A word-level tokenizer (``t<i>`` is id i) with CHAT_TEMPLATE, as a model directory holds it."""
    d = root / "tokenizer"
    d.mkdir(parents=True, exist_ok=True)
    write_tokenizer(d, VOCAB)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": CHAT_TEMPLATE}))
    return d


def text_of(tokens: list[int]) -> str:
    return " ".join(f"t{t}" for t in tokens)


class Proc:
    """A child process that writes a ready file (JSON) once it serves; its output goes to a log."""

    def __init__(self, cmd: list[str], root: Path, name: str, *, wait: bool = True) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.ready_file = root / f"{name}.ready.json"
        self.log_path = root / f"{name}.log"
        self.cmd = [*cmd, "--ready-file", str(self.ready_file)]
        self.name = name
        self.start(wait=wait)

    def start(self, *, wait: bool = True) -> Proc:
        """Launch the process; with ``wait``, return once it is ready (else: call ``wait``)."""
        self.ready_file.unlink(missing_ok=True)
        self.log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(self.cmd, cwd=ROOT, stdout=self.log, stderr=self.log,
                                     env={**os.environ, "PYTHONPATH": str(ROOT)})
        return self.wait() if wait else self

    def wait(self, timeout_s: float = 120) -> Proc:
        """Until the ready file exists (the machine may be loaded: start-up imports take seconds)."""
        if not wait_for(lambda: self.ready_file.exists() or self.proc.poll() is not None, timeout_s, every_s=0.05):
            self.proc.kill()
            raise AssertionError(f"{self.name} did not become ready:\n{self.output()[-3000:]}")
        assert self.proc.poll() is None, f"{self.name} exited:\n{self.output()[-3000:]}"
        self.ready: dict[str, Any] = json.loads(self.ready_file.read_text())
        self.address = self.ready.get("address", "")  # a daemon's: what locate_rig.Engine reads
        return self

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def freeze(self) -> None:
        freeze(self.proc.pid)

    def thaw(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(30)
        self.log.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        self.log.close()


def daemon(dep: Any, name: str, *, wait: bool = True) -> Proc:
    """``kvtier serve`` of deployment ``dep``; ``.address`` is its gRPC address once ready."""
    return Proc([sys.executable, "-m", "kvtier.cli", "serve", "--config", str(dep.config_file)], dep.root, name,
                wait=wait)


def engine(root: Path, name: str, tokenizer: Path | None, *, port: int = 0, prefill_ms: float = 0,
           token_ms: float = 0, wait: bool = True) -> Proc:
    cmd = [sys.executable, "-m", "tests.integration.route_test_engine", "--name", name, "--port", str(port),
           "--prefill-ms", str(prefill_ms), "--token-ms", str(token_ms)]
    if tokenizer is not None:
        cmd += ["--tokenizer", str(tokenizer)]
    return Proc(cmd, root / "engines", name, wait=wait)


def router(root: Path, engines: dict[str, str], *, nodes: dict[str, str] | None = None,
           token_file: Path | None = None, tokenizer: Path | None = None, extra: tuple[str, ...] = ()) -> Proc:
    """``kvtier route`` over ``engines`` (node -> URL), asking ``nodes`` (name -> daemon address).

    The Locate budget is at least 500 ms: the fake engines' prefill prices it at tens of ms, and on
    CI's loaded cores the daemons answered later than that (router.log: "went on after 101.3 ms
    ... without node(s) ['a', 'b']"), so a test of what the cache decides read the budget's
    choice. A budget still ends well before the 1500 ms deadline, which the fault tests tell apart."""
    cmd = [sys.executable, "-m", "kvtier.cli", "route", "--listen", "127.0.0.1:0", "--log-level", "debug",
           "--poll-ms", "300", "--health-timeout-ms", "1500", "--probe-ms", "300", "--deadline-ms", "1500",
           "--locate-budget-min-ms", "500"]
    for node, url in engines.items():
        cmd += ["--engine", f"{node}={url}"]
    for name, address in (nodes or {}).items():
        cmd += ["--node", f"{name}={address}"]
    if token_file is not None:
        cmd += ["--token-file", str(token_file)]
    if tokenizer is not None:
        cmd += ["--tokenizer", str(tokenizer)]
    return Proc([*cmd, *extra], root / "router", "router")


# -- HTTP -------------------------------------------------------------------------------------------
class Answer:
    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status = status
        self.headers = headers
        self.body = body

    @property
    def engine(self) -> str | None:
        return self.headers.get("X-Kvtier-Engine")

    @property
    def route(self) -> str | None:
        return self.headers.get("X-Kvtier-Route")

    def json(self) -> Any:
        return json.loads(self.body)


def call(url: str, path: str, body: dict[str, Any] | bytes | None = None, *, method: str | None = None,
         timeout: float = 60) -> Answer:
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method=method or ("POST" if data is not None else "GET"),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return Answer(r.status, dict(r.headers), r.read())
    except urllib.error.HTTPError as exc:
        return Answer(exc.code, dict(exc.headers), exc.read())


def metric(url: str, name: str, **labels: str) -> float:
    """One sample of the router's (or an engine's) /metrics; 0 when absent."""
    from prometheus_client.parser import text_string_to_metric_families

    text = call(url, "/metrics").body.decode()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


def health(url: str) -> dict[str, Any]:
    return call(url, "/health", timeout=10).json()


def until(cond: Any, timeout: float = 20, what: str = "") -> None:
    assert wait_for(cond, timeout, every_s=0.05), f"not within {timeout} s: {what}"
