"""`kvtier bench vllm --serve-bench`: vLLM's own `vllm bench serve` client, as the bench runs it.

The bench's full run starts `vllm serve` twice on a 12x768 model (minutes on 2 cores; the
running-engine suite in tests/engines/vllm_engine covers the connector against a real engine), so
this test does not start vLLM's server. It runs the real `vllm bench serve` client from
.venv-vllmcpu, with the command line the bench builds, against a small recording OpenAI server
that stands in for `vllm serve` and, like the kvtier connector, writes scheduler and worker stats
files (hit tokens of prefixes it has seen for the salt). So what is checked on real client
output: the prompts share exactly the document prefix and differ after it, every request carries
the tenant's `cache_salt`, the result JSON parses into the reported figures, and the hit tokens come
from the counter deltas around the run. About 30-60 s, most of it the client's start-up.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from benchmarks.vllm_bench import add_arguments, run
from benchmarks.vllm_serve_bench import (
    ServeBench,
    kvtier_serve_bench,
    serve_bench_plan,
    serve_bench_result,
    serve_bench_table,
)
from benchmarks.vllm_server import BLOCK_TOKENS, EVENTS_METRIC, Server, write_model
from kvtier.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllmcpu" / "bin" / "python"
COLD_S, HIT_S = 0.25, 0.03


class RecordingServer:
    """Enough of vLLM's OpenAI server for `vllm bench serve`: /tokenize, /detokenize (the
    word-level tokenizer of ``write_model``), streamed /v1/completions and /metrics. Per salt, a
    prompt's leading full blocks already seen are "hits": answered after HIT_S instead of COLD_S,
    and counted into the connector's counter family on /metrics (scheduler load_tokens, worker
    loaded_blocks) as vLLM exposes the connector's counts."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.seen: dict[str, set[tuple[int, ...]]] = {}
        self.counters = {"scheduler": {"load_tokens": 0, "load_jobs": 0}, "worker": {"loaded_blocks": 0}}
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a: Any) -> None:
                pass

            def _json(self, obj: Any) -> None:
                data = json.dumps(obj).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if self.path != "/metrics":
                    self.send_error(404)
                    return
                data = outer.metrics().encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path == "/tokenize":
                    self._json({"tokens": outer.ids(body["prompt"])})
                elif self.path == "/detokenize":
                    self._json({"prompt": " ".join(f"t{i}" for i in body["tokens"])})
                elif self.path == "/v1/completions":
                    outer.complete(self, body)
                else:
                    self.send_error(404)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    @staticmethod
    def ids(prompt: str | list[int]) -> list[int]:
        special = {"<unk>": 0, "<s>": 1, "</s>": 2}
        return list(prompt) if isinstance(prompt, list) else [special.get(w) or int(w[1:]) for w in prompt.split()]

    def metrics(self) -> str:
        """The counters as vLLM's /metrics exposes the connector's (``EVENTS_METRIC``)."""
        lines = [f"# TYPE {EVENTS_METRIC} counter"]
        with self.lock:
            for role, counts in self.counters.items():
                for event, n in counts.items():
                    if n:
                        lines.append(f'{EVENTS_METRIC}_total{{engine="0",event="{event}",model_name="m",'
                                     f'role="{role}"}} {float(n)}')
        return "\n".join(lines) + "\n"

    def complete(self, h: BaseHTTPRequestHandler, body: dict[str, Any]) -> None:
        tokens = self.ids(body["prompt"])
        salt = body.get("cache_salt")
        n_blocks = (len(tokens) - 1) // BLOCK_TOKENS
        with self.lock:
            self.requests.append({**body, "tokens": tokens})
            seen = self.seen.setdefault(str(salt), set())
            hit = 0
            while hit < n_blocks and tuple(tokens[: (hit + 1) * BLOCK_TOKENS]) in seen:
                hit += 1
            seen.update(tuple(tokens[: (k + 1) * BLOCK_TOKENS]) for k in range(n_blocks))
            if hit and salt is not None:
                self.counters["scheduler"]["load_tokens"] += hit * BLOCK_TOKENS
                self.counters["scheduler"]["load_jobs"] += 1
                self.counters["worker"]["loaded_blocks"] += hit
        time.sleep(HIT_S if hit or n_blocks == 0 else COLD_S)
        h.send_response(200)
        h.send_header("Content-Type", "text/event-stream")
        h.send_header("Connection", "close")
        h.end_headers()
        n = int(body.get("max_tokens") or 1)
        for i in range(n):
            done = "length" if i == n - 1 else None
            chunk = {"choices": [{"index": 0, "text": f" t{10 + i}", "finish_reason": done}]}
            h.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            h.wfile.flush()
        usage = {"choices": [], "usage": {"prompt_tokens": len(tokens), "completion_tokens": n}}
        h.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        h.wfile.flush()
        h.close_connection = True


@pytest.fixture
def recording(tmp_path: Path) -> Iterator[RecordingServer]:
    srv = RecordingServer()
    t = threading.Thread(target=srv.httpd.serve_forever, daemon=True)
    t.start()
    yield srv
    srv.httpd.shutdown()
    srv.httpd.server_close()


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def test_serve_bench_is_on_in_the_full_run_and_opt_in_with_quick() -> None:
    full = serve_bench_plan(_args())
    assert [(s.concurrency, s.num_prompts, s.prefix_tokens, s.suffix_tokens) for s in full] == [
        (1, 12, 4000, 100), (2, 12, 4000, 100)]
    assert len({s.seed for s in full}) == 2  # a prefix of its own per run
    assert serve_bench_plan(_args("--quick")) == []
    assert [(s.concurrency, s.num_prompts) for s in serve_bench_plan(_args("--quick", "--serve-bench"))] == [(1, 8)]
    assert serve_bench_plan(_args("--no-serve-bench")) == []
    assert [s.concurrency for s in serve_bench_plan(_args("--serve-concurrency", "1,3", "--serve-prompts", "6"))] == [
        1, 3]
    with pytest.raises(ConfigError):
        serve_bench_plan(_args("--serve-concurrency", "4", "--serve-prompts", "4"))
    # 4,000 tokens = 125 full blocks, reused by every prompt after the first `concurrency`.
    assert full[0].expected_hit_tokens == 11 * 4000 and full[1].expected_hit_tokens == 10 * 4000


def test_same_repeats_below_one_is_refused_before_anything_starts(tmp_path: Path) -> None:
    assert _args().same_repeats == 3
    args = _args("--same-repeats", "0", "--vllm-python", sys.executable, "--workdir", str(tmp_path / "w"))
    with pytest.raises(ConfigError, match="--same-repeats must be at least 1, got 0"):
        run(args)
    assert not (tmp_path / "w").exists()  # refused before the work directory, a daemon or a server


@pytest.mark.timeout(300)
def test_vllm_bench_serve_runs_the_prefix_sharing_dataset_with_the_salt(recording: RecordingServer,
                                                                        tmp_path: Path) -> None:
    if not VLLM_PYTHON.exists():
        msg = ".venv-vllmcpu is missing: run `make engine-venvs`"
        if os.environ.get("KVTIER_REQUIRE_ENGINES") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    model = write_model(tmp_path / "model")
    spec = ServeBench(prefix_tokens=8 * BLOCK_TOKENS, suffix_tokens=40, output_tokens=3, num_prompts=5,
                      concurrency=1, seed=1000)
    salt = "a-tenant-salt"
    server = Server(proc=None, url=recording.url)  # type: ignore[arg-type]

    kv = kvtier_serve_bench(str(VLLM_PYTHON), server, model, spec, salt, tmp_path)

    # Two flushes of the connector's counters (8 tokens as ids) around the client's 5 prompts (text).
    bench = [r for r in recording.requests if isinstance(r["prompt"], str)]
    assert len(recording.requests) == 7 and len(bench) == 5
    assert all(r["cache_salt"] == salt for r in recording.requests)
    assert all(r["stream"] and r["max_tokens"] == 3 and r["ignore_eos"] and r["temperature"] == 0 and
               r["model"] == "m" for r in bench)
    prefix = bench[0]["tokens"][: spec.prefix_tokens]
    assert all(len(r["tokens"]) == spec.prefix_tokens + spec.suffix_tokens for r in bench)
    assert all(r["tokens"][: spec.prefix_tokens] == prefix for r in bench)
    assert len({tuple(r["tokens"][spec.prefix_tokens:]) for r in bench}) == 5
    assert min(prefix) > 2  # no special tokens: the text round-tripped through the tokenizer exactly

    # The client's result JSON, parsed; the first prompt computed the prefix, the others hit it.
    assert kv["completed"] == 5 and kv["input_tokens"] == 5 * (spec.prefix_tokens + spec.suffix_tokens)
    assert kv["ttft_first_ms"] >= COLD_S * 1e3 and kv["ttft_p99_ms"] >= 0.9 * COLD_S * 1e3
    assert kv["ttft_median_ms"] < COLD_S * 1e3 / 2
    assert kv["ttft_median_ms"] <= kv["ttft_mean_ms"] <= kv["ttft_p99_ms"]
    assert kv["request_throughput"] > 0
    assert (kv["kvtier_hit_tokens"], kv["expected_hit_tokens"], kv["kvtier_loaded_blocks"]) == (4 * 256, 4 * 256, 32)
    assert kv["kvtier_load_failed_blocks"] == 0 and kv["kvtier_refused_requests"] == 0
    assert json.loads((tmp_path / "serve-bench" / "kvtier-c1.json").read_text())["num_prompts"] == 5

    base = {k: v for k, v in kv.items() if not k.startswith(("kvtier_", "expected_"))}
    sb = serve_bench_result([spec], [kv], [base], str(VLLM_PYTHON))
    assert sb["kvtier_served_hits"] and sb["kvtier_hit_tokens"] == 1024
    assert sb["client"].startswith("vllm bench serve (vllm")
    assert sb["runs"][0]["median_ttft_kvtier_vs_vllm"] == 1.0
    table = serve_bench_table(sb)
    assert "1024 / 1024" in table and table.count("\n") == 4
    # No hits at all: the comparison is flagged as meaningless.
    assert not serve_bench_result([spec], [{**kv, "kvtier_hit_tokens": 0}], [base], str(VLLM_PYTHON))[
        "kvtier_served_hits"]
