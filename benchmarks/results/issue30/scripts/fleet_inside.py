"""What the fleet bench's processes do, run by run: ``kvtier bench fleet`` with three recorders.

- every process's CPU time (user + system, ``/proc/PID/stat``) after each run;
- each engine's own request timings (vLLM's ``/metrics``: time to first token, queue, prefill)
  after each run, as running totals;
- each daemon's own RPC latency totals (its ``/metrics``, turned on here: ``Locate`` is what the
  router waits for), after each run;
- with ``TIMED=1``, every kvtier connector call in the engines timed (timed_connector.py):
  calls over 200 ms land in ``OUT/timed.slow.<pid>`` as they happen. With ``ROUTE_DEBUG=1``,
  ``kvtier route`` logs each decision (``routed to ...``, in the workdir's router logs).

Per-run differences of the first two are what docs/benchmarks.md quotes (worker CPU per engine,
vLLM's TTFT against its prefill). Run from the repository root::

    .venv/bin/python benchmarks/results/issue30/scripts/fleet_inside.py OUT \\
        bench fleet --routers cache_aware,kvtier --rounds 2 --json OUT/fleet.json --workdir OUT/work
    .venv/bin/python benchmarks/results/issue30/scripts/fleet_inside.py --report OUT

``OUT/inside.jsonl`` holds one record per run: ``{"run", "cpu": {pid: [ticks, command]},
"engines": {node: {metric: value}}, "daemons": {node: {metric: value}}}``; ``--report`` prints the per-run differences.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT))
HERE = Path(__file__).resolve().parent
CONNECTOR = '"kv_connector": "KvtierConnector", "kv_connector_module_path": "connectors.vllm_connector"'
TIMED_CONNECTOR = '"kv_connector": "TimedConnector", "kv_connector_module_path": "timed_connector"'
VLLM_METRICS = ("vllm:time_to_first_token_seconds", "vllm:request_queue_time_seconds",
                "vllm:request_prefill_time_seconds")


def cpu_ticks() -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # the process ended meanwhile
            continue
        out[pid] = [int(fields[11]) + int(fields[12]), command[:160]]
    return out


def scraped(url: str, key: Callable[[str], str | None]) -> dict[str, float]:
    """The Prometheus samples of ``url`` that ``key`` names (None: skipped), summed by that name."""
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        name = None if line.startswith("#") else key(line.rsplit(" ", 1)[0])
        if name is not None:
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def engine_metrics(url: str) -> dict[str, float]:
    """vLLM's request timings (sum and count), every label set summed."""
    wanted = {f"{m}_{k}" for m in VLLM_METRICS for k in ("sum", "count")}
    return scraped(f"{url}/metrics", lambda sample: n if (n := sample.split("{", 1)[0]) in wanted else None)


def daemon_metrics(port: int) -> dict[str, float]:
    """The daemon's RPC latency (sum and count) per method."""
    prefixes = ("kvtier_rpc_latency_seconds_sum{", "kvtier_rpc_latency_seconds_count{")
    return scraped(f"http://127.0.0.1:{port}/metrics", lambda sample: sample if sample.startswith(prefixes) else None)


def record(out: Path) -> None:
    from benchmarks import fleet_engines, fleet_real

    engines: dict[str, str] = {}
    daemons: dict[str, int] = {}
    write_config = fleet_engines.Fleet._write_daemon_config

    def write_config_with_metrics(self: Any, node: Any, prefill: Any) -> None:
        write_config(self, node, prefill)
        port = daemons.setdefault(node.name, fleet_engines.free_port())
        text = node.dep.config_file.read_text()
        listen = f'[server]\nmetrics_listen = "127.0.0.1:{port}"\n'
        node.dep.config_file.write_text(text.replace("[server]\n", listen, 1))

    fleet_engines.Fleet._write_daemon_config = write_config_with_metrics  # type: ignore[method-assign]
    launch = fleet_engines.Fleet._launch_engine

    def launch_and_note(self: Any, node: Any) -> Any:
        server = launch(self, node)
        engines[node.name] = server.url
        return server

    fleet_engines.Fleet._launch_engine = launch_and_note  # type: ignore[method-assign]
    popen = subprocess.Popen

    def popen_with_probes(cmd: Any, *args: Any, **kwargs: Any) -> Any:
        if os.environ.get("TIMED") and "vllm.entrypoints.openai.api_server" in cmd:
            cmd = [c.replace(CONNECTOR, TIMED_CONNECTOR) for c in cmd]
            env = dict(kwargs.get("env") or os.environ)
            env["PYTHONPATH"] = f"{env.get('PYTHONPATH', '')}:{HERE}"
            env["TIMED_OUT"] = str(out / "timed")
            kwargs["env"] = env
        if os.environ.get("ROUTE_DEBUG") and "route" in cmd and "--tokenizer" in cmd:
            cmd = [*cmd, "--log-level", "debug"]
        return popen(cmd, *args, **kwargs)

    # The engines and routers are started through subprocess.Popen: replaced for this process.
    subprocess.Popen = popen_with_probes  # type: ignore[misc]
    figures = fleet_real.run_figures

    def figures_and_record(name: str, rnd: int, *args: Any, **kwargs: Any) -> Any:
        rec = {"run": f"{name}-{rnd}", "cpu": cpu_ticks(),
               "engines": {n: engine_metrics(u) for n, u in engines.items()},
               "daemons": {n: daemon_metrics(p) for n, p in daemons.items()}}
        with open(out / "inside.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")
        return figures(name, rnd, *args, **kwargs)

    fleet_real.run_figures = figures_and_record  # type: ignore[assignment]


def report(out: Path) -> None:
    runs = [json.loads(line) for line in (out / "inside.jsonl").read_text().splitlines()]
    hz = os.sysconf("SC_CLK_TCK")
    for before, after in itertools.pairwise(runs):
        print(f"== {after['run']} (since the end of {before['run']})")
        rows = []
        for pid, (ticks, command) in after["cpu"].items():
            used = ticks - before["cpu"].get(pid, [0])[0]
            if used > 0.05 * hz:
                rows.append((used / hz, pid, command[:90]))
        for seconds, pid, command in sorted(rows, reverse=True)[:12]:
            print(f"  {seconds:6.2f} s  {pid:>7}  {command}")
        for node, now in after["engines"].items():
            was = before["engines"].get(node, {})
            parts = []
            for m in VLLM_METRICS:
                n = now.get(f"{m}_count", 0) - was.get(f"{m}_count", 0)
                s = now.get(f"{m}_sum", 0) - was.get(f"{m}_sum", 0)
                if n:
                    parts.append(f"{m.split(':')[1].replace('_seconds', '')} {s / n * 1e3:.1f} ms")
            print(f"  engine {node}: " + (", ".join(parts) or "no requests"))
        for node, now in after.get("daemons", {}).items():
            was = before.get("daemons", {}).get(node, {})
            parts = []
            for method in ("Locate", "Lookup", "Get", "Put"):
                count, total = (f'kvtier_rpc_latency_seconds_{k}{{method="{method}"}}' for k in ("count", "sum"))
                n = now.get(count, 0) - was.get(count, 0)
                t = now.get(total, 0) - was.get(total, 0)
                if n:
                    parts.append(f"{method} {int(n)} x {t / n * 1e3:.1f} ms")
            print(f"  daemon {node}: " + (", ".join(parts) or "no calls"))


def main() -> int:
    if sys.argv[1:2] == ["--report"]:
        report(Path(sys.argv[2]))
        return 0
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    record(out)
    from kvtier.cli.main import main as kvtier_main

    return kvtier_main(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
