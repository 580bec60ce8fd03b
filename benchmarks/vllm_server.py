"""The vLLM servers of kvtier's vLLM benchmarks (``kvtier bench vllm``, benchmarks/vllm_bench.py;
``kvtier bench fleet``, benchmarks/fleet_engines.py): the model they serve, ``vllm serve`` started
with or without the kvtier connector, a streamed completion with its time to first token and
log-probabilities, a document published into the public scope, and the connector's counters as
vLLM's metrics hold them."""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from benchmarks.common import free_port, progress, stop_group, wait_healthy
from benchmarks.output_match import Generation
from kvtier.engine.checkpoint import write_checkpoint
from kvtier.engine.models import ModelSpec, model_spec
from kvtier.errors import DeadlineExceeded, TierUnavailable
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



@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    url: str
    name: str = "vllm"


def launch_vllm(stack: ExitStack, python: str, model: Path, workdir: Path, name: str,
                kvtier: dict[str, Any] | None) -> Server:
    """Start ``vllm serve`` (``kvtier``: with the connector, vLLM's prefix caching off; None:
    without kvtier, prefix caching on); ``wait_ready`` waits until it answers."""
    port = free_port()
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


def fresh_counters(server: Server, salt: str) -> dict[str, dict[str, int]]:
    """Every connector's counters as of now (``connector_counters``). vLLM takes the connector's
    counts with each engine step, so what the worker counted between steps (its saver's) shows
    only after the next one, and the tiers' error counts are taken at most every 0.25 s: after a
    pause, one ``FLUSH_TOKENS`` request with a valid salt carries them, counting nothing itself."""
    time.sleep(0.3)
    complete(server, FLUSH_TOKENS, salt, max_tokens=1, logprobs=0)
    time.sleep(0.1)  # vLLM's front end records a step's metrics just after answering its requests
    return connector_counters(server)


def vllm_version(python: str) -> str:
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


def counter_delta(before: dict[str, int], after: dict[str, int], key: str) -> int:
    """How much counter ``key`` grew from ``before`` to ``after`` (absent: 0)."""
    return after.get(key, 0) - before.get(key, 0)
