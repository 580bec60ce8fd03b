"""The routers ``kvtier bench fleet`` compares, each started fresh for its run in front of the
same two engines, with the settings its users give it.

- vllm-router 0.1.17 (``.venv-vllmrouter``, pinned in benchmarks/peers/vllm-router-requirements.txt,
  built by ``make test``/``make peer-venvs``): ``round_robin``; ``cache_aware`` with its default
  thresholds; ``kv_aware`` with its default tier credits, fed by each engine's KV-event stream
  (``--kv-event-source WORKER_URL=ENDPOINT``, replayed from the engine's replay endpoint so a
  router that starts late still learns what the engines hold), which carries vLLM's own blocks and
  the blocks kvtier holds for that engine; block size the engines'.
- ``kvtier route``: the engines, their nodes' daemons (``Locate``), the model's tokenizer, a
  ``router`` token; its defaults otherwise.

A router is up when its ``/health`` answers 200; each serves ``POST /v1/completions``.
"""

from __future__ import annotations

import json
import os
import subprocess
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from benchmarks.common import free_port, stop_group, wait_healthy, wait_ready_file
from benchmarks.fleet_engines import BT, ROOT, Fleet
from kvtier.errors import ConfigError, TierUnavailable

ROUTER_PYTHON = ROOT / ".venv-vllmrouter" / "bin" / "python"
ROUTER_BIN = ROOT / ".venv-vllmrouter" / "bin" / "vllm-router"
VLLM_ROUTER_VERSION = "0.1.17"
#: The routers, in the order each round runs them.
ROUTERS = ("round_robin", "cache_aware", "kv_aware", "kvtier")


def check_vllm_router() -> str:
    """The installed vllm-router version; ConfigError unless it is the pinned one."""
    if not ROUTER_BIN.exists():
        raise ConfigError(f"{ROUTER_BIN} not found: `make peer-venvs` (or `make test`) builds .venv-vllmrouter")
    out = subprocess.run([str(ROUTER_PYTHON), "-c", "import importlib.metadata as m; print(m.version('vllm-router'))"],
                         capture_output=True, text=True, timeout=60)
    version = out.stdout.strip()
    if out.returncode != 0 or version != VLLM_ROUTER_VERSION:
        raise ConfigError(f"{ROUTER_PYTHON} has vllm-router {version or '?'} ({out.stderr.strip()[-300:]}), the bench "
                          f"pins {VLLM_ROUTER_VERSION}: rebuild .venv-vllmrouter")
    return version


def vllm_router_command(fleet: Fleet, policy: str, port: int) -> list[str]:
    urls = [n.url for n in fleet.nodes.values()]
    cmd = [str(ROUTER_BIN), "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls, "--policy", policy,
           "--log-level", "warning"]
    if policy == "kv_aware":
        for n in fleet.nodes.values():
            cmd += ["--kv-event-source", f"{n.url}={n.events}", "--kv-event-replay-source", f"{n.url}={n.replay}"]
        cmd += ["--kv-event-block-size", str(BT), "--kv-event-model", "m"]  # the engines' served model name
    return cmd


def kvtier_route_command(fleet: Fleet, token_file: Path, ready: Path, log_level: str = "warning",
                         engines: Sequence[str] | None = None) -> list[str]:
    """``engines``: the nodes whose engine and daemon the router is given (None: all)."""
    assert fleet.model is not None
    cmd = [fleet.daemon_python, "-m", "kvtier.cli", "route", "--listen", "127.0.0.1:0", "--token-file",
           str(token_file), "--tokenizer", str(fleet.model), "--ready-file", str(ready), "--log-level", log_level]
    for name, n in fleet.nodes.items():
        if engines is None or name in engines:
            cmd += ["--engine", f"{name}={n.url}", "--node", f"{name}={n.address}"]
    return cmd


def router_metrics(url: str) -> dict[str, float]:
    """``kvtier route``'s own counters after a run (``/metrics``: routing reasons, Locate answers
    and time, predicted and measured TTFT, the event loop's lateness), per sample name and label set."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("kvtier_router_") and not s.name.endswith("_created"):
                # Histogram buckets: the sums and counts say enough, but for the loop's lateness,
                # whose tail is the point (how often every request in flight waited that long).
                if "le" in s.labels and not s.name.startswith("kvtier_router_loop_lag"):
                    continue
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


@contextmanager
def router(fleet: Fleet, name: str, tag: str, route_log_level: str = "warning",
           route_engines: Sequence[str] | None = None) -> Iterator[str]:
    """Start router ``name`` (one of ``ROUTERS``) in front of the fleet; yields its URL. ``kvtier
    route`` logs at ``route_log_level`` into ``router-<tag>.log`` (debug: a line per request) and is
    given the engines of ``route_engines`` (None: all)."""
    if name not in ROUTERS:
        raise ConfigError(f"unknown router {name!r}: one of {', '.join(ROUTERS)}")
    log_path = fleet.work / f"router-{tag}.log"
    log = open(log_path, "wb")  # noqa: SIM115 - closed below
    try:
        if name == "kvtier":
            token = fleet.work / "router.token"
            if not token.exists():
                token.write_text(fleet.dep.token("fleet", "router-1", roles=("router",)))
                token.chmod(0o600)
            ready = fleet.work / f"router-{tag}.json"
            ready.unlink(missing_ok=True)
            proc = subprocess.Popen(kvtier_route_command(fleet, token, ready, route_log_level, route_engines), cwd=ROOT,
                                    env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            try:
                url = json.loads(wait_ready_file(ready, proc, "kvtier route", 120, log=log_path))["url"]
            except TierUnavailable:
                stop_group(proc)
                raise
        else:
            port = free_port()
            proc = subprocess.Popen(vllm_router_command(fleet, name, port), cwd=fleet.work, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(url + "/health", proc, f"router {name} (log {log_path})", 120, poll_s=0.25)
            yield url
        finally:
            stop_group(proc)
    finally:
        log.close()

