"""`kvtier route` against real processes: node daemons (``kvtier serve`` with a [locate] section),
the router itself (``kvtier route``), and TEST ENGINES (route_test_engine.py: OpenAI-shaped
servers that answer a prompt with bytes derived from its token ids; not vLLM). Blocks are stored
in the daemons the way an engine's connector stores them (locate_rig.Engine). What vLLM itself
does behind the router is tested with real ``vllm serve`` in
tests/engines/vllm_engine/test_router_vllm.py.

Covers: a cached prefix (token ids, text, chat) goes to the engine whose node holds it, for its
own tenant only; the answer is the engine's, byte for byte, streamed or not; the salt reaches the
engine and no log; a queue, or an engine slower than priced, outweighs a cache edge; load is
balanced when nothing gives an edge, and a tie goes to the engine awake once the other is measured
slow to wake; engines killed and frozen drop out, in-flight requests are
retried elsewhere, a clear 503 when none is up, and they rejoin; daemons frozen and killed
mid-run (issue 30 part 6): the router answers by load and returns to the cache when the daemon
is back; bad input and bad flags.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from benchmarks.localdeploy import LocalDeployment
from kvtier.cli.main import main
from tests.integration.locate_rig import BT, Engine, deployment, publish
from tests.integration.route_rig import (
    Answer,
    Proc,
    call,
    daemon,
    engine,
    health,
    metric,
    router,
    text_of,
    tokenizer_dir,
    until,
)
from tests.integration.route_test_engine import output_ids, salt_digest

#: 21 tokens: 5 full blocks before the last token.
PROMPT = list(range(1000, 1000 + 5 * BT + 1))
OTHER = list(range(2000, 2000 + 5 * BT + 1))


#: Each test its own prompts: the fleet (and what its daemons hold) is the module's.
Q = list(range(3000, 3000 + 5 * BT + 1))
E = list(range(3500, 3500 + 5 * BT + 1))
D = list(range(4000, 4000 + 5 * BT + 1))


@dataclass
class Fleet:
    root: Path
    dep: LocalDeployment
    nodes: dict[str, Proc]
    engines: dict[str, Proc]
    router: Proc
    tokenizer: Path
    token_file: Path

    @property
    def url(self) -> str:
        return self.router.ready["url"]

    def engine_url(self, name: str) -> str:
        return self.engines[name].ready["url"]

    def store(self, node: str, salt: str, tokens: list[int]) -> None:
        """Save the request's blocks in ``node``'s daemon as its engine's connector would."""
        e = Engine(self.nodes[node], self.dep)  # type: ignore[arg-type]
        try:
            assert e.store(salt, tokens) == (len(tokens) - 1) // BT
        finally:
            e.close()

    def prefill(self, name: str, ms: float, token_ms: float = 0) -> None:
        assert call(self.engine_url(name), "/test/prefill", {"ms": ms, "token_ms": token_ms}).status == 200

    def restart_engine(self, name: str) -> None:
        """A killed engine started again on its port (the router knows it by its URL)."""
        port = int(self.engine_url(name).rsplit(":", 1)[1])
        self.engines[name] = engine(self.root, name, self.tokenizer, port=port)

    def reset(self) -> None:
        """Every engine and node up, no prefill delay: where each test starts."""
        for name, p in self.nodes.items():
            assert p.proc.poll() is None, f"daemon {name} is gone (the daemon-kill test runs last)"
            p.thaw()
        for name, p in list(self.engines.items()):
            if p.proc.poll() is None:
                p.thaw()
            else:
                self.restart_engine(name)
        for name in self.engines:
            self.prefill(name, 0)
        until(lambda: all(v["up"] for h in [health(self.url)] for part in ("engines", "nodes")
                          for v in h[part].values()), what="every engine and node up")


def _fleet(root: Path) -> Fleet:
    tok = tokenizer_dir(root)
    deps: dict[str, LocalDeployment] = {}
    for name in ("a", "b"):
        deps[name] = deployment(root / f"node-{name}", node=name, like=deps.get("a"), memory_bytes=1 << 20)
    dep = deps["a"]
    # Started side by side, then waited for: each spends seconds importing.
    nodes = {name: daemon(d, f"daemon-{name}", wait=False) for name, d in deps.items()}
    engines = {name: engine(root, name, tok, wait=False) for name in ("a", "b")}
    for p in [*nodes.values(), *engines.values()]:
        p.wait()
    token_file = root / "router.token"
    token_file.write_text(dep.token("fleet", "router-1", roles=("router",)))
    token_file.chmod(0o600)
    r = router(root, {n: e.ready["url"] for n, e in engines.items()}, nodes={n: p.address for n, p in nodes.items()},
               token_file=token_file, tokenizer=tok)
    return Fleet(root, dep, nodes, engines, r, tok, token_file)


@pytest.fixture(scope="module")
def module_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    f = _fleet(tmp_path_factory.mktemp("route"))
    yield f
    for p in [f.router, *f.engines.values(), *f.nodes.values()]:
        p.stop()


@pytest.fixture
def fleet(module_fleet: Fleet) -> Fleet:
    module_fleet.reset()
    return module_fleet


def complete(url: str, prompt: list[int] | str, salt: str | None = None, **extra: object) -> Answer:
    body: dict[str, object] = {"model": "m", "prompt": prompt, "max_tokens": 8, **extra}
    if salt is not None:
        body["cache_salt"] = salt
    return call(url, "/v1/completions", body)


def _engine_said(a: Answer) -> dict[str, object]:
    assert a.status == 200, a.body
    if a.headers.get("Content-Type", "").startswith("text/event-stream"):
        first = next(line for line in a.body.decode().split("\n\n") if line.startswith("data: {"))
        return json.loads(first[6:])["kvtier_test_engine"]
    return a.json()["kvtier_test_engine"]


# -- routing ---------------------------------------------------------------------------------------
def test_a_cached_prefix_goes_to_the_engine_whose_node_holds_it(fleet: Fleet) -> None:
    f = fleet
    alice, bob = f.dep.salt("acme", "alice"), f.dep.salt("globex", "bob")
    f.store("b", alice, PROMPT)
    chat_messages = [{"role": "user", "content": text_of(OTHER)}]
    chat_ids = [4, *OTHER, 5]  # CHAT_TEMPLATE: the user's role token, the content, the assistant's
    f.store("a", alice, chat_ids)

    # Token ids, text and chat: each goes where its prefix is, for its tenant, every time.
    for _ in range(3):
        got = complete(f.url, PROMPT, alice)
        assert (got.engine, got.route) == ("b", "cache")
        assert _engine_said(got)["prompt_token_ids"] == PROMPT
    got = complete(f.url, text_of(PROMPT), alice)
    assert (got.engine, got.route) == ("b", "cache")
    assert _engine_said(got)["prompt_token_ids"] == PROMPT, "the router located the ids the engine computes"
    chat = call(f.url, "/v1/chat/completions", {"model": "m", "messages": chat_messages, "cache_salt": alice})
    assert (chat.engine, chat.route) == ("a", "cache")
    assert _engine_said(chat)["prompt_token_ids"] == chat_ids
    # The salt reaches the engine unchanged; the answer is the engine's own.
    assert _engine_said(got)["salt_digest"] == salt_digest(alice)
    direct = complete(f.engine_url("b"), text_of(PROMPT), alice)
    assert got.body == direct.body
    assert got.json()["choices"][0]["text"] == "".join(f" t{t}" for t in output_ids(PROMPT))

    # Control: another tenant, or no salt, finds no edge: balanced over both engines.
    seen = {complete(f.url, PROMPT, bob).engine for _ in range(4)}
    assert seen == {"a", "b"}
    plain = [complete(f.url, PROMPT) for _ in range(4)]
    assert {a.route for a in plain} == {"balanced"} and {a.engine for a in plain} == {"a", "b"}
    assert metric(f.url, "kvtier_router_routed_total", engine="b", reason="cache") == 4
    assert metric(f.url, "kvtier_router_routed_total", engine="a", reason="cache") == 1

    # Streaming: passed through, byte for byte what the engine streams.
    s = complete(f.url, PROMPT, alice, stream=True)
    assert s.engine == "b" and s.headers["Content-Type"].startswith("text/event-stream")
    assert s.body == complete(f.engine_url("b"), PROMPT, alice, stream=True).body
    assert s.body.endswith(b"data: [DONE]\n\n")

    # A batch of prompts is routed by load and counted.
    batch = complete(f.url, [text_of(PROMPT), text_of(OTHER)], alice)
    assert batch.status == 200 and batch.route == "balanced"
    assert metric(f.url, "kvtier_router_unlocated_total", reason="batch") == 1
    # What the router adds before a request leaves: one sample per request (no retries here).
    routed = sum(metric(f.url, "kvtier_router_routed_total", engine=e, reason=r)
                 for e in "ab" for r in ("cache", "queue", "balanced"))
    assert routed > 10 and metric(f.url, "kvtier_router_decision_seconds_count") == routed
    assert metric(f.url, "kvtier_router_loop_lag_seconds_count") > 0  # the loop's probe runs in the router

    # Nothing of a prompt or a salt in the router's log (at debug level).
    log = f.router.output()
    assert "listening" in log  # control: the log is there
    assert "routed to b (cache, attempt 1): predicted" in log  # each decision, for an operator to tune by
    # These engines report no cache size: said once each, not estimated silently.
    assert log.count("reports no cache size") == 2
    for secret in (alice, bob, alice.rsplit(":", 1)[-1], text_of(PROMPT[:3]), text_of(OTHER[:3]), "t1000"):
        assert secret not in log


def test_an_engine_slower_than_priced_loses_its_cache_edge(fleet: Fleet) -> None:
    """Engine b holds the prefix but takes 1.5 s a prefill, where its node prices it at 13 ms:
    once measured, b is priced at its pace (kvtier/router/pace.py), and the next request goes to
    a, whose recompute (about 0.1 s at the nodes' 5 ms a token) comes sooner. A router of its own:
    the pace it learns here is not the module's router's."""
    f = fleet
    alice = f.dep.salt("acme", "alice")
    f.store("b", alice, Q)
    r = router(f.root / "slow", {n: f.engine_url(n) for n in f.engines},
               nodes={n: p.address for n, p in f.nodes.items()}, token_file=f.token_file, tokenizer=f.tokenizer)
    u = r.ready["url"]
    try:
        first = complete(u, Q, alice, stream=True)
        assert (first.engine, first.route) == ("b", "cache")  # control: on its price, b's cache wins
        f.prefill("b", 1500)
        slow = complete(u, Q, alice, stream=True)
        assert (slow.engine, slow.route) == ("b", "cache")
        assert metric(u, "kvtier_router_pace", engine="b") > 10  # about 1 + 0.2 x (1.5 s / 13 ms - 1)
        assert metric(u, "kvtier_router_pace", engine="a") == 0  # never sampled: a is on its price
        second = complete(u, Q, alice, stream=True)
        # a's recompute is now the lower price: a wins, on it.
        assert (second.engine, second.route) == ("a", "cache")
        assert second.body == complete(f.engine_url("a"), Q, alice, stream=True).body
    finally:
        r.stop()


def test_a_tie_goes_to_the_engine_awake_once_the_other_is_measured_slow_to_wake(fleet: Fleet) -> None:
    """Engine b takes 300 ms more to start after a second idle (kvtier/router/queue_model.py,
    ``wake``). Its first request, sent to it asleep, measures that; a prompt both nodes hold alike
    then goes to a, which just served, by its shorter wait. Control: a router that has measured no
    waking, in the same state (a just served, b asleep), ties them and balances. Routers of their own."""
    f = fleet
    alice = f.dep.salt("acme", "alice")
    only_b, only_a, both = (list(range(s, s + 5 * BT + 1)) for s in (13000, 13500, 14000))
    f.store("b", alice, only_b)
    f.store("a", alice, only_a)
    for node in "ab":
        f.store(node, alice, both)
    assert call(f.engine_url("b"), "/test/prefill", {"ms": 0, "wake_ms": 300}).status == 200
    engines = {n: f.engine_url(n) for n in f.engines}
    nodes = {n: p.address for n, p in f.nodes.items()}
    for name, measured in (("wake", True), ("no-wake", False)):
        r = router(f.root / name, engines, nodes=nodes, token_file=f.token_file, tokenizer=f.tokenizer)
        u = r.ready["url"]
        try:
            if measured:
                first = complete(u, only_b, alice, stream=True)
                assert (first.engine, first.route) == ("b", "cache")
                # 300 ms late, counted as at most its price again: a fifth of that price.
                assert metric(u, "kvtier_router_wake_seconds", engine="b") > 0.002
            time.sleep(1.2)  # b asleep, whatever it served last
            awake = complete(u, only_a, alice, stream=True)
            assert (awake.engine, awake.route) == ("a", "cache")
            tie = complete(u, both, alice, stream=True)
            if measured:
                assert (tie.engine, tie.route) == ("a", "queue")
            else:
                assert tie.route == "balanced"  # no edge: the load, then the rotation, chose
        finally:
            r.stop()


def _locates(url: str) -> float:
    return sum(metric(url, "kvtier_router_locate_answers_total", node=n, status="ok") for n in "ab")


def test_a_first_turn_on_a_public_document_every_node_holds_is_decided_without_locate(fleet: Fleet) -> None:
    """Bob's first turn on a document published to both nodes is Located, and both answers hold
    its public blocks alike (kvtier/router/public_prefixes.py). Alice's first turn on it, with
    her own salt and question, then needs no Locate: the nodes tie, the queue and the load decide.
    Control: a document only node a holds is Located for every first turn, and goes to a."""
    f = fleet
    for p in f.nodes.values():
        doc = publish(p, f.dep, 4, token_base=15000)  # type: ignore[arg-type]
    only_a = publish(f.nodes["a"], f.dep, 4, token_base=16000)  # type: ignore[arg-type]
    bob, alice, carol = f.dep.salt("globex", "bob"), f.dep.salt("acme", "alice"), f.dep.salt("acme", "carol")
    r = router(f.root / "public", {n: f.engine_url(n) for n in f.engines},
               nodes={n: p.address for n, p in f.nodes.items()}, token_file=f.token_file, tokenizer=f.tokenizer)
    u = r.ready["url"]

    def first_turn(document: list[int], salt: str, question: int) -> tuple[Answer, float, float]:
        locates, skipped = _locates(u), metric(u, "kvtier_router_locate_skipped_total")
        got = complete(u, document + list(range(question, question + BT + 1)), salt, stream=True)
        assert got.status == 200, got.body
        return got, _locates(u) - locates, metric(u, "kvtier_router_locate_skipped_total") - skipped

    try:
        assert first_turn(doc, bob, 17000)[1:] == (2, 0)  # both nodes asked
        got, asked, skipped = first_turn(doc, alice, 17500)
        assert (asked, skipped) == (0, 1) and got.route in ("queue", "balanced")
        assert first_turn(only_a, bob, 18000)[1:] == (2, 0)  # control
        got, asked, skipped = first_turn(only_a, carol, 18500)
        assert (asked, skipped) == (2, 0) and (got.engine, got.route) == ("a", "cache")
    finally:
        r.stop()


def test_a_new_turn_on_the_engine_that_computed_its_history_is_decided_without_locate(fleet: Fleet) -> None:
    """A router that knows its engines' cache sizes: the second turn of a conversation adds blocks
    it never sent anywhere, so no node holds more of it than the engine that computed the first
    turn; it goes there without a Locate (``held``). Controls: a prefix saved in a daemon that
    this router never sent is still Located; a turn whose holder is busy is Located and goes to
    the idle engine; ``--locate-every-request`` asks for every request."""
    f = fleet
    alice = f.dep.salt("acme", "alice")
    nodes = {n: p.address for n, p in f.nodes.items()}
    engines = {n: f.engine_url(n) for n in f.engines}
    sized = router(f.root / "sized", engines, nodes=nodes, token_file=f.token_file, tokenizer=f.tokenizer,
                   extra=("--engine-cache-blocks", "1000"))
    every = router(f.root / "every", engines, nodes=nodes, token_file=f.token_file, tokenizer=f.tokenizer,
                   extra=("--engine-cache-blocks", "1000", "--locate-every-request"))
    try:
        for r in (sized, every):
            turn1 = list(range(6000, 6000 + 3 * BT + 1)) if r is sized else list(range(7000, 7000 + 3 * BT + 1))
            turn2 = turn1 + list(range(turn1[0] + 500, turn1[0] + 500 + 2 * BT))
            first = complete(r.ready["url"], turn1, alice, stream=True)
            assert first.route == "balanced" and _locates(r.ready["url"]) == 2  # nothing held: Located
            second = complete(r.ready["url"], turn2, alice, stream=True)
            assert second.engine == first.engine
            if r is sized:
                assert second.route == "held" and _locates(r.ready["url"]) == 2
                assert metric(r.ready["url"], "kvtier_router_locate_skipped_total") == 1
                assert metric(r.ready["url"], "kvtier_router_routed_total", engine=first.engine, reason="held") == 1
            else:
                assert second.route == "cache" and _locates(r.ready["url"]) == 4
                assert metric(r.ready["url"], "kvtier_router_locate_skipped_total") == 0
            assert second.body == complete(f.engine_url(first.engine), turn2, alice, stream=True).body

        # A prefix in b's daemon that this router never sent: Located, and b's cache wins.
        u = sized.ready["url"]
        doc = list(range(11000, 11000 + 5 * BT + 1))  # this test's own: the fleet's daemons keep it
        f.store("b", alice, doc)
        stored = complete(u, doc, alice, stream=True)
        assert (stored.engine, stored.route) == ("b", "cache") and _locates(u) == 4

        # Its holder busy (1.5 s a prefill, one request there): the new turn is Located and goes
        # to the other engine, whose floor is lower.
        f.prefill("b", 1500)
        turn = doc + list(range(9000, 9000 + BT))
        for i in range(2):  # b's measured prefill rises to about a second
            complete(u, [*turn, 9999 - i], alice, stream=True)
        assert 0.5 < metric(u, "kvtier_router_prefill_seconds", engine="b") < 10
        busy = threading.Thread(target=lambda: complete(u, [*turn, 9990], alice, stream=True))
        busy.start()
        until(lambda: health(u)["engines"]["b"]["inflight"] == 1, what="b busy")
        located = _locates(u)
        moved = complete(u, turn + list(range(9100, 9100 + BT)), alice, stream=True)
        busy.join(30)
        assert moved.engine == "a" and moved.route == "queue" and _locates(u) == located + 2
    finally:
        sized.stop()
        every.stop()


def test_a_client_leaving_mid_stream_ends_the_engines_request(fleet: Fleet) -> None:
    f = fleet
    for name in f.engines:
        f.prefill(name, 0, token_ms=500)  # 8 tokens: 4 s a stream
    host, port = f.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("POST", "/v1/completions", json.dumps({"model": "m", "prompt": Q, "stream": True}),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.read1(65536).startswith(b"data: ")
    engine_name = resp.getheader("X-Kvtier-Engine")
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    until(lambda: metric(f.url, "kvtier_router_requests_total", endpoint="/v1/completions",
                         outcome="client_gone") == 1, what="the router saw the client leave")
    until(lambda: health(f.url)["engines"][engine_name]["inflight"] == 0, what="the attempt ended")
    # The engine's request was aborted with it (its running count back to 0), and the router serves on.
    until(lambda: metric(f.engine_url(engine_name), "vllm:num_requests_running") == 0, what="engine request ended")
    for name in f.engines:
        f.prefill(name, 0)
    assert complete(f.url, Q).status == 200


# -- engine faults ---------------------------------------------------------------------------------
def _stream_started(f: Fleet, prompt: list[int]) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse, str]:
    host, port = f.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({"model": "m", "prompt": prompt, "stream": True}),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.read1(65536).startswith(b"data: ")
    return conn, resp, resp.getheader("X-Kvtier-Engine") or ""


def test_a_stream_still_coming_outlives_a_slow_health_poll_and_a_frozen_one_ends(fleet: Fleet) -> None:
    """A busy engine answering its polls late is taken down for new requests, but a stream it is
    still delivering completes; a frozen engine's stream ends with an error event (the control)."""
    f = fleet
    for name in f.engines:
        f.prefill(name, 0, token_ms=400)  # 8 tokens: 3.2 s a stream, a chunk every 0.4 s
    conn, resp, busy = _stream_started(f, D)
    # Its polls now answer after 2.5 s, beyond the router's health timeout (1.5 s): taken down.
    assert call(f.engine_url(busy), "/test/prefill", {"ms": 0, "token_ms": 400, "health_ms": 2500}).status == 200
    until(lambda: not health(f.url)["engines"][busy]["up"], what="the busy engine taken down")
    rest = resp.read()
    conn.close()
    assert b"data: [DONE]" in rest and b'"error"' not in rest, rest[-400:]
    f.prefill(busy, 0, token_ms=400)
    until(lambda: health(f.url)["engines"][busy]["up"], what="the busy engine back")
    # Control: an engine frozen mid-stream sends nothing more; its stream ends with an error event.
    conn, resp, frozen = _stream_started(f, Q)
    f.engines[frozen].freeze()
    try:
        rest = resp.read()
    finally:
        f.engines[frozen].thaw()
        conn.close()
    assert b"failed mid-response" in rest and b"no chunk for" in rest and b"[DONE]" not in rest, rest[-400:]
    for name in f.engines:
        f.prefill(name, 0)


def test_engines_killed_or_frozen_drop_out_and_rejoin(fleet: Fleet) -> None:
    f = fleet
    alice = f.dep.salt("acme", "alice")
    f.store("a", alice, E)
    b_answer = complete(f.engine_url("b"), E, alice).body
    failures_before = metric(f.url, "kvtier_router_attempt_failures_total", engine="a", reason="connection")

    # a frozen while it holds a request (before its first byte): the health watch takes a
    # down, the request is tried again on b, and the client gets b's whole answer.
    f.prefill("a", 2000)
    results: list[Answer] = []
    t = threading.Thread(target=lambda: results.append(complete(f.url, E, alice)))
    t.start()
    until(lambda: health(f.url)["engines"]["a"]["inflight"] == 1, what="the request at a")
    f.engines["a"].freeze()
    t.join(30)
    assert results and results[0].status == 200
    assert results[0].engine == "b" and results[0].body == b_answer
    h = health(f.url)["engines"]["a"]
    assert not h["up"] and h["reason"]
    assert metric(f.url, "kvtier_router_attempt_failures_total", engine="a", reason="connection") == \
        failures_before + 1
    assert metric(f.url, "kvtier_router_engine_up", engine="a") == 0
    # While a is down, everything goes to b, and is answered.
    assert {complete(f.url, E, alice).engine for _ in range(3)} == {"b"}
    f.engines["a"].thaw()
    f.prefill("a", 0)
    until(lambda: health(f.url)["engines"]["a"]["up"], what="a rejoins after SIGCONT")
    assert complete(f.url, E, alice).engine == "a"

    # b killed: a request finds it gone and is answered by a; b drops out.
    f.engines["b"].kill()
    got = [complete(f.url, OTHER) for _ in range(3)]
    assert {g.engine for g in got} == {"a"} and {g.status for g in got} == {200}
    until(lambda: not health(f.url)["engines"]["b"]["up"], what="b down")
    # a killed too: a clear 503 naming each engine's reason; /health says so.
    f.engines["a"].kill()
    until(lambda: not health(f.url)["engines"]["a"]["up"], what="a down")
    none = complete(f.url, E, alice)
    assert none.status == 503
    err = none.json()["error"]
    assert err["type"] == "service_unavailable" and err["code"] == 503
    assert "a:" in err["message"] and "b:" in err["message"]
    assert call(f.url, "/health").status == 503
    # b restarted on its port: it rejoins and answers.
    f.restart_engine("b")
    until(lambda: health(f.url)["engines"]["b"]["up"], what="b rejoins")
    assert complete(f.url, E, alice).engine == "b"


# -- daemon faults (issue 30 part 6); kills a daemon, so it runs last of the module fleet's tests ---
def test_a_turn_whose_nodes_did_not_answer_goes_to_the_engine_holding_its_history(fleet: Fleet) -> None:
    """Locate asked for every request, the router knowing its engines' caches: with the holder's
    daemon frozen, the holder is priced at computing what it lacks (at the prices the other
    node's answer gave), not at computing it all, and the turn goes there; with both daemons
    frozen (no answer within the request's budget), it still goes there, priced from what the router knows
    (kvtier/router/held_rule.py, ``unlocated``). Control: the first turn, held nowhere, is balanced."""
    f = fleet
    alice = f.dep.salt("acme", "alice")
    r = router(f.root / "unanswered", {n: f.engine_url(n) for n in f.engines},
               nodes={n: p.address for n, p in f.nodes.items()}, token_file=f.token_file, tokenizer=f.tokenizer,
               extra=("--engine-cache-blocks", "1000", "--locate-every-request"))
    u = r.ready["url"]
    try:
        turn = list(range(12000, 12000 + 3 * BT + 1))
        first = complete(u, turn, alice, stream=True)
        assert first.route == "balanced"
        holder = first.engine
        other = next(n for n in f.engines if n != holder)
        for i, frozen in enumerate(((holder,), (holder, other))):
            f.nodes[frozen[-1]].freeze()
            ended = metric(u, "kvtier_router_locate_budget_ended_total")
            turn = turn + list(range(12500 + 100 * i, 12500 + 100 * i + 2 * BT))
            got = complete(u, turn, alice, stream=True)
            assert (got.engine, got.route) == (holder, "cache"), (frozen, got.engine, got.route)
            if len(frozen) == 2:  # no node answered within the request's budget
                assert metric(u, "kvtier_router_locate_budget_ended_total") == ended + 1
            assert got.body == complete(f.engine_url(holder), turn, alice, stream=True).body
    finally:
        for p in f.nodes.values():
            p.thaw()
        r.stop()


def test_a_daemon_frozen_or_killed_mid_run_the_router_routes_around_it(fleet: Fleet) -> None:
    f = fleet
    alice = f.dep.salt("acme", "alice")
    f.store("a", alice, D)
    want = {e: complete(f.engine_url(e), D, alice).body for e in f.engines}
    assert complete(f.url, D, alice).engine == "a"  # control: the cache decides
    unavailable_before = metric(f.url, "kvtier_router_locate_answers_total", node="a", status="unavailable")
    ok_before = metric(f.url, "kvtier_router_locate_answers_total", node="b", status="ok")
    ended_before = metric(f.url, "kvtier_router_locate_budget_ended_total")

    f.nodes["a"].freeze()
    answers = [complete(f.url, D, alice) for _ in range(6)]
    # Answered, by load (both engines, each with its own correct bytes), without a's daemon.
    assert {a.status for a in answers} == {200}
    assert {a.route for a in answers} == {"balanced"} and {a.engine for a in answers} == {"a", "b"}
    assert all(a.body == want[a.engine] for a in answers)
    # The frozen daemon cost one request its Locate budget (kvtier/router/locate_budget.py), not
    # the deadline; the others did not ask it. Its call, judged at the deadline, takes it down.
    assert metric(f.url, "kvtier_router_locate_budget_ended_total") == ended_before + 1
    until(lambda: health(f.url)["nodes"]["a"] == {"up": False}, what="a's daemon taken down at its deadline")
    assert metric(f.url, "kvtier_router_locate_answers_total", node="a", status="unavailable") == \
        unavailable_before + 1
    assert metric(f.url, "kvtier_router_locate_answers_total", node="b", status="ok") >= ok_before + 6

    f.nodes["a"].thaw()
    until(lambda: health(f.url)["nodes"]["a"]["up"], what="a's daemon rejoins")
    got = complete(f.url, D, alice)
    assert (got.engine, got.route) == ("a", "cache") and got.body == want["a"]

    f.nodes["a"].kill()
    answers = [complete(f.url, D, alice) for _ in range(4)]
    assert {a.status for a in answers} == {200} and {a.route for a in answers} == {"balanced"}
    assert all(a.body == want[a.engine] for a in answers)
    assert health(f.url)["nodes"]["a"] == {"up": False}
    assert call(f.url, "/health").status == 200  # engines up: the router serves


# -- bad input -------------------------------------------------------------------------------------
def test_bad_requests_get_clear_errors(tmp_path: Path) -> None:
    tok = tokenizer_dir(tmp_path)
    e = engine(tmp_path, "a", tok)
    r = router(tmp_path, {"a": e.ready["url"]}, extra=("--max-body-mb", "0.01"))
    try:
        url = r.ready["url"]
        until(lambda: health(url)["engines"]["a"]["up"], what="engine up")
        for body, status, words in ((b"{not json", 400, "not JSON"), (b"[1, 2]", 400, "JSON object"),
                                    (json.dumps({"prompt": "t1 " * 5000}).encode(), 413, "larger than")):
            got = call(url, "/v1/completions", body)
            assert got.status == status and words in got.json()["error"]["message"], got.body
            assert got.json()["error"]["code"] == status
        # The engine's own refusal passes through, status and body.
        bad = complete(url, "bad")
        assert bad.status == 400 and bad.json()["error"]["message"] == "bad prompt" and bad.engine == "a"
        assert call(url, "/v1/completions", method="GET").status == 405
        assert call(url, "/v1/nothing", {}).status == 404
        # Without nodes the router balances load and still tokenizes nothing it does not need.
        ok = complete(url, "t1 t2 t3")
        assert ok.status == 200 and ok.route == "queue"
        assert call(url, "/v1/models").json()["data"][0]["id"] == "m"
        assert metric(url, "kvtier_router_requests_total", endpoint="/v1/completions", outcome="bad_request") == 3
    finally:
        r.stop()
        e.stop()


def test_route_flags_are_checked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tok = tokenizer_dir(tmp_path)
    loose = tmp_path / "loose.token"
    loose.write_text("kvt1.x")
    loose.chmod(0o644)
    good = tmp_path / "router.token"
    good.write_text("kvt1.x")
    good.chmod(0o600)
    cases = [
        (["--engine", "a"], "expected NODE=URL"),
        (["--engine", "a=ftp://h:1"], "http(s)://HOST:PORT"),
        (["--engine", "a=http://h:1/v1"], "without a path"),
        (["--engine", "a=http://h:1", "--engine", "b=http://h:1"], "given twice"),
        (["--engine", "a=http://h:1", "--node", "a=127.0.0.1:1", "--tokenizer", str(tok)], "--token-file"),
        (["--engine", "a=http://h:1", "--node", "a=127.0.0.1:1", "--token-file", str(good)], "--tokenizer"),
        (["--engine", "a=http://h:1", "--node", "a=127.0.0.1:1", "--token-file", str(loose), "--tokenizer", str(tok)],
         "chmod 0600"),
        (["--engine", "c=http://h:1", "--node", "a=127.0.0.1:1", "--token-file", str(good), "--tokenizer", str(tok)],
         "have no daemon"),
        (["--engine", "a=http://h:1", "--token-file", str(good)], "without nodes"),
        (["--engine", "a=http://h:1", "--listen", "nowhere"], "--listen"),
        (["--engine", "a=http://h:1", "--poll-ms", "0"], "--poll-ms"),
        (["--engine", "a=http://h:1", "--keep-quantile", "1"], "--keep-quantile: must be in [0, 1)"),
        (["--engine", "a=http://h:1", "--tokenizer", str(tmp_path / "none")], "not a directory"),
    ]
    for argv, words in cases:
        assert main(["route", *argv]) == 1, argv
        err = capsys.readouterr().err
        assert words in err, (argv, err)
        assert "kvt1.x" not in err
