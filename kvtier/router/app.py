"""The router's HTTP front (aiohttp): an OpenAI-compatible server for N engines.

Endpoints: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (streamed answers passed
through), ``GET /v1/models`` (an engine's answer), ``GET /health`` (200 while an engine is up,
503 otherwise, with every engine's and node's state) and ``GET /metrics`` (Prometheus text).

Per request, in order:

1. the body is read (at most ``max_body_bytes``: 413) and decoded (not a JSON object: 400);
2. its token ids and ``cache_salt`` (kvtier/router/prompts.py), in a worker thread;
3. unless what the router knows bounds its answer (kvtier/router/held_rule.py), ``Locate`` on
   every node that is up (kvtier/router/cache_view.py), when there are token ids, waited for no
   longer than its answers can save the request (kvtier/router/locate_budget.py);
4. each engine that is up is priced: queue wait (kvtier/router/queue_model.py) + the cost of
   the request on its node, or of what the engine lacks where it is believed to hold the prefix
   itself (kvtier/router/engine_cache.py); the choice (kvtier/router/choice.py);
5. the attempt (kvtier/router/proxy.py); when it fails before a byte was sent, the next choice
   among the engines not yet tried, at most ``max_attempts`` in all;
6. with no engine left, 503 and the reason each engine gave.

The request body goes to the engine unchanged (its ``cache_salt`` with it). Nothing of a prompt
or a salt is logged.

Protocol: ``Router(engines, settings, cache=..., tokenizer=...)`` -> ``serve(host, port, ...)``
(starts the watches, listens, returns when stopped).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from kvtier.errors import ConfigError
from kvtier.router.cache_view import CacheView
from kvtier.router.choice import HELD, Candidate, Choice, Chooser, Edge
from kvtier.router.engine_cache import EngineCacheView
from kvtier.router.engine_watch import EngineWatch
from kvtier.router.engines import EngineSpec
from kvtier.router.errors import error_body
from kvtier.router.held_rule import HeldRule
from kvtier.router.late_timeouts import LateTimeouts
from kvtier.router.locate_budget import LocateBudget
from kvtier.router.loop_lag import probe_loop_lag
from kvtier.router.metrics import RouterMetrics
from kvtier.router.pace import Pace
from kvtier.router.prefix_demand import PrefixDemand
from kvtier.router.prompts import CHAT, COMPLETIONS, NO_TOKENIZER, PromptTokenizer, RequestPrompt, request_prompt
from kvtier.router.proxy import ANSWERED, CLIENT_GONE, FAILED_MID_RESPONSE, Proxy
from kvtier.router.public_prefixes import PublicPrefixes
from kvtier.router.queue_model import QueueModel
from kvtier.router.service_tail import ServiceTail
from kvtier.server.locate import Located

log = logging.getLogger("kvtier.router")

ENDPOINTS = {"/v1/completions": COMPLETIONS, "/v1/chat/completions": CHAT}


@dataclass(slots=True, frozen=True)
class RouterSettings:
    poll_s: float = 1.0
    health_timeout_s: float = 1.0
    probe_s: float = 1.0
    connect_timeout_s: float = 2.0
    max_attempts: int = 3
    edge: Edge = field(default_factory=Edge)
    #: Keep a request with its cache while its prediction there is within this quantile of the
    #: service prices chosen lately (kvtier/router/choice.py); 0: never.
    keep_quantile: float = 0.95
    #: Per-request queue wait before any prefill was measured and without a Locate price.
    queue_prior_s: float = 0.1
    #: Blocks of an engine's own prefix cache until it reports its size (vLLM's
    #: ``vllm:cache_config_info``); 0: what it holds is not estimated (kvtier/router/engine_cache.py).
    engine_cache_blocks: int = 0
    max_body_bytes: int = 32 << 20
    #: Decide without Locate when its answer is already known (``Router._held``). Off: Locate on
    #: every request, for fleets where requests of one conversation also reach other routers.
    skip_locate: bool = True
    #: The least a request waits for Locate under its budget (kvtier/router/locate_budget.py);
    #: None: every request waits for every node up to the deadline.
    locate_budget_min_s: float | None = 0.01

    def __post_init__(self) -> None:
        for name in ("poll_s", "health_timeout_s", "probe_s", "connect_timeout_s", "max_body_bytes"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name}: must be positive")
        if self.max_attempts < 1:
            raise ConfigError("max_attempts: at least 1")
        if self.queue_prior_s < 0:
            raise ConfigError("queue_prior_s: must not be negative")
        if not 0 <= self.keep_quantile < 1:
            raise ConfigError("keep_quantile: must be in [0, 1)")
        if self.engine_cache_blocks < 0:
            raise ConfigError("engine_cache_blocks: must not be negative")
        if self.locate_budget_min_s is not None and self.locate_budget_min_s < 0:
            raise ConfigError("locate_budget_min_s: must not be negative")


class Router:
    """The composition of the module docstring. Event-loop only, once serving."""

    def __init__(self, engines: Sequence[EngineSpec], settings: RouterSettings, *, cache: CacheView | None,
                 tokenizer: PromptTokenizer | None, metrics: RouterMetrics | None = None) -> None:
        if cache is not None:
            missing = sorted({e.node for e in engines} - set(cache.nodes))
            if missing:
                raise ConfigError(f"--engine: node(s) {missing} have no daemon in the membership "
                                  f"({sorted(cache.nodes)}): add them with --node or --members")
        self.engines = list(engines)
        self.by_name = {e.name: e for e in self.engines}
        self.settings = settings
        self.cache = cache
        self.tokenizer = tokenizer
        self.metrics = metrics or RouterMetrics()
        self.queue = QueueModel(e.name for e in self.engines)
        self.cached = EngineCacheView((e.name for e in self.engines), settings.engine_cache_blocks)
        q = settings.keep_quantile
        tail = ServiceTail(quantile=q) if q else None
        self.chooser = Chooser(settings.edge, tail=tail)
        # Read when scraped: the threshold as the last priced decisions left it.
        self.metrics.keep_tail.set_function(lambda: _threshold(tail))
        #: The engines' pace against the cost model's prices (kvtier/router/pace.py).
        self.pace = Pace(e.name for e in self.engines)
        #: How often each prefix was asked for lately (kvtier/router/prefix_demand.py).
        self.demand = PrefixDemand()
        self.held_rule = HeldRule(self.engines, self.cached, self.queue, self.chooser, self.pace, self.demand,
                                  public=PublicPrefixes(settings.edge))
        m = settings.locate_budget_min_s
        self.budget = LocateBudget(m, self.pace) if m is not None else None
        #: Tokens a block, from the daemons' Locate answers (0: none yet).
        self._block_tokens = 0
        self._session: aiohttp.ClientSession | None = None
        self._watch: EngineWatch | None = None
        self._proxy: Proxy | None = None
        self._tasks: list[asyncio.Task[None]] = []

    # -- lifecycle ----------------------------------------------------------------------------------
    async def start(self) -> None:
        s = self.settings
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), auto_decompress=False)
        # One late-timeout count per engine for its health polls and its attempts' timers.
        late = LateTimeouts(self.metrics.late_timeouts, "engine")
        self._watch = EngineWatch(self.engines, self._session, self.queue, self.cached, self.metrics, poll_s=s.poll_s,
                                  timeout_s=s.health_timeout_s, late=late)
        # A stream whose engine was taken down ends when no chunk came for as long as the health
        # watch gives an engine to answer a poll, plus one poll interval.
        self._proxy = Proxy(self._session, s.connect_timeout_s, stall_s=s.poll_s + s.health_timeout_s, late=late)
        await self._watch.poll_all()
        self._tasks.append(asyncio.create_task(self._watch.run(), name="kvtier-route-engine-watch"))
        self._tasks.append(asyncio.create_task(probe_loop_lag(self.metrics.loop_lag), name="kvtier-route-loop-lag"))
        if self.cache is not None:
            self._tasks.append(asyncio.create_task(self.cache.run_probes(), name="kvtier-route-node-probes"))

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
        if self.cache is not None:
            await self.cache.close()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.settings.max_body_bytes)
        for path in ENDPOINTS:
            app.router.add_post(path, self._completion)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        return app

    async def serve(self, host: str, port: int, on_ready: Callable[[str, int], None] | None = None) -> None:
        """Listen on ``host:port`` (0: any free port) until SIGTERM or SIGINT; ``on_ready(host, port)``
        once listening."""
        await self.start()
        runner = web.AppRunner(self.app(), access_log=None, handle_signals=False)
        try:
            await runner.setup()
            site = web.TCPSite(runner, host, port)
            await site.start()
            bound = runner.addresses[0]
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, stop.set)
            log.warning("kvtier route listening on %s:%s for %d engine(s)", bound[0], bound[1], len(self.engines))
            if on_ready is not None:
                on_ready(bound[0], int(bound[1]))
            await stop.wait()
        finally:
            await runner.cleanup()
            await self.close()

    # -- handlers -----------------------------------------------------------------------------------
    async def _completion(self, request: web.Request) -> web.StreamResponse:
        endpoint = request.path
        kind = ENDPOINTS[endpoint]
        arrival = time.monotonic()
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return self._error(endpoint, 413, f"the body is larger than {self.settings.max_body_bytes} bytes")
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            return self._error(endpoint, 400, "the body is not JSON")
        if not isinstance(body, dict):
            return self._error(endpoint, 400, f"the body must be a JSON object, got {type(body).__name__}")
        # Token ids need no tokenizer: only a text prompt pays a thread hop (which a busy host
        # makes cost milliseconds) on its way to Locate.
        prompt = request_prompt(kind, body, None)
        if prompt.why == NO_TOKENIZER and self.tokenizer is not None:
            prompt = await asyncio.to_thread(request_prompt, kind, body, self.tokenizer)
        digests: tuple[bytes, ...] = ()
        bt = self._block_tokens
        if prompt.tokens is not None and bt:
            digests = self.cached.digests(prompt.tokens, prompt.salt, bt)
        held = self._held(digests, prompt) if digests else None
        located = None
        if held is None:
            located = await self._locate(prompt, digests)
            if located and prompt.tokens is not None:
                answer_bt = next(iter(located.values())).block_tokens
                if answer_bt != bt:  # this request digested before the size was known, or with another
                    if answer_bt != self._block_tokens:
                        self._block_tokens = answer_bt
                        self.held_rule.block_tokens(answer_bt)
                    digests = self.cached.digests(prompt.tokens, prompt.salt, answer_bt) if answer_bt else ()
            if located:
                public: tuple[bytes, ...] = ()
                if digests and any(a.public_blocks for a in located.values()):
                    public = self._public_digests(prompt, digests, self._block_tokens)
                self._learn(digests, located, public)
        return await self._attempts(request, endpoint, "POST", raw, prompt, located, arrival, digests, held)

    async def _models(self, request: web.Request) -> web.StreamResponse:
        return await self._attempts(request, request.path, "GET", b"", None, None, time.monotonic(), (), None)

    async def _health(self, request: web.Request) -> web.Response:
        assert self._watch is not None
        engines = {e.name: {"up": self._watch.up(e.name), "node": e.node, "reason": self._watch.reason(e.name),
                            "inflight": self.queue.inflight(e.name)} for e in self.engines}
        nodes = {} if self.cache is None else {n: {"up": self.cache.up(n)} for n in self.cache.nodes}
        up = any(v["up"] for v in engines.values())
        return web.json_response({"status": "ok" if up else "unavailable", "engines": engines, "nodes": nodes},
                                 status=200 if up else 503)

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": self.metrics.content_type})

    # -- routing ------------------------------------------------------------------------------------
    async def _locate(self, prompt: RequestPrompt, digests: tuple[bytes, ...]) -> dict[str, Located] | None:
        """Per node, its Locate answer within the request's budget; None when the request has no
        token ids or there is no fleet. ``digests``: the prompt's, as far as known (for what the
        answers after the budget teach the held rule)."""
        if prompt.tokens is None:
            self.metrics.unlocated.labels(prompt.why).inc()
            return None
        if self.cache is None:
            return None
        budget_s = None
        if self.budget is not None and self._block_tokens:
            assert self._watch is not None
            budget_s = self.budget.budget_s(len(prompt.tokens) // self._block_tokens,
                                            (e.name for e in self._watch.up_engines()), time.monotonic())
        return dict(await self.cache.locate(prompt.tokens, prompt.salt, budget_s=budget_s,
                                            on_late=lambda late: self._learn(digests, late)))

    def _learn(self, digests: tuple[bytes, ...], located: Mapping[str, Located],
               public: tuple[bytes, ...] = ()) -> None:
        """What Locate answers teach: the held rule where each node's blocks are (and, given the
        prompt's salt-free digests, which public prefixes they held alike), the budget their price."""
        self.held_rule.located(digests, located, public, time.monotonic())
        if self.budget is not None:
            self.budget.located(located.values())

    def _held(self, digests: tuple[bytes, ...], prompt: RequestPrompt) -> Choice | None:
        """The choice without Locate (kvtier/router/held_rule.py), or None: ask it."""
        assert self._watch is not None
        if self.cache is None or not self.settings.skip_locate:
            return None
        up, now = self._watch.up_engines(), time.monotonic()
        choice = self.held_rule.decide(up, digests, now)
        if choice is None and self.held_rule.public:  # a first turn: a public prefix every node holds?
            choice = self.held_rule.public_tie(
                up, digests, lambda: self._public_digests(prompt, digests, self._block_tokens), now)
        if choice is not None:
            self.metrics.locate_skipped.inc()
        return choice

    def _public_digests(self, prompt: RequestPrompt, digests: tuple[bytes, ...], bt: int) -> tuple[bytes, ...]:
        """The prompt's block digests without its salt (``digests`` where it has none)."""
        assert prompt.tokens is not None
        return digests if not prompt.salt else self.cached.digests(prompt.tokens, "", bt)

    def _candidates(self, engines: Sequence[EngineSpec], located: dict[str, Located] | None,
                    now: float, digests: tuple[bytes, ...]) -> list[Candidate]:
        """Each engine's predicted queue wait and service time (kvtier/router/choice.py): its node's
        ``Locate`` price, or, where the engine itself is believed to hold at least what its node
        holds (kvtier/router/engine_cache.py), the price of computing what it lacks; at the
        engines' pace, as the waits are measured (kvtier/router/pace.py).

        An engine whose node gave no answer (down, or late for the request's budget) can load
        nothing from it: it is priced at computing what it lacks itself, at the prices another
        node's answer gave this prompt. With no answer at all the router prices what the engines
        hold from what it knows (``HeldRule.unlocated``), and where that is nothing, every engine
        alike: the queue and the load decide."""
        if not located:
            known = self.held_rule.unlocated(engines, digests, now) if digests else None
            if known is not None:
                return known
            return [Candidate(e.name, q.wait_s, 0.0, q.load) for e in engines
                    for q in (self.queue.predict(e.name, now, self.settings.queue_prior_s),)]
        # The most any node prices computing the whole prompt: what a node without an answer costs.
        ref = max(located.values(), key=lambda a: a.recompute_ms)
        out = []
        for e in engines:
            k = self.pace.value(e.name, now)
            q = self.queue.predict(e.name, now, ref.recompute_ms / 1e3 * k)
            answer = located.get(e.node)
            service = answer.ttft_ms if answer is not None else ref.recompute_ms
            if digests:
                resident = self.cached.resident(e.name, digests)
                own = (engine_price_ms(answer, resident) if answer is not None
                       else computing_ms(ref, resident))
                if own is not None:
                    service = min(service, own)
            out.append(Candidate(e.name, q.wait_s, service / 1e3 * k, q.load))
        return out

    async def _attempts(self, request: web.Request, endpoint: str, method: str, raw: bytes,
                        prompt: RequestPrompt | None, located: dict[str, Located] | None, arrival: float,
                        digests: tuple[bytes, ...], held: Choice | None) -> web.StreamResponse:
        """Up to ``max_attempts`` engines in turn; the first is ``held`` when it was decided
        without Locate (a retry then asks it). ``prompt``: None for a request without one."""
        assert self._watch is not None and self._proxy is not None
        streaming = prompt is not None and prompt.streaming
        tried: list[str] = []
        failures: list[str] = []
        for attempt in range(self.settings.max_attempts):
            up = [e for e in self._watch.up_engines() if e.name not in tried]
            if not up:
                break
            now = time.monotonic()
            # A first attempt the cache decided counts in the chooser's rate; a retry is not an arrival.
            if attempt == 0 and held is not None:
                choice = held
                log.debug("decided without Locate (kvtier/router/held_rule.py): %s, %s", choice.engine, choice.reason)
            else:
                if held is not None and located is None and prompt is not None:
                    located = await self._locate(prompt, digests)  # the held engine failed: price the rest
                    if located:
                        self._learn(digests, located)
                    now = time.monotonic()
                candidates = self._candidates(up, located, now, digests)
                demand = self.demand.rate(digests, self._held_depth(up, located, digests), now)
                choice = self.chooser.choose(candidates, now if attempt == 0 else None, demand)
                if log.isEnabledFor(logging.DEBUG):  # what each decision saw, never the prompt or its salt
                    log.debug("priced %s; prefix demand %.2f/s; Locate: %s", ", ".join(
                        f"{c.engine} {c.wait_s * 1e3:.1f} + {c.service_s * 1e3:.1f} ms (load {c.load})"
                        for c in candidates), demand, "no answer" if not located else ", ".join(
                        f"{n} holds {a.matched_blocks} of {a.requested_blocks} blocks"
                        for n, a in sorted(located.items())))
            if attempt == 0:
                self.demand.arrived(digests, now)  # after its own decision: a request does not count itself
            pace = self.pace.value(choice.engine, now)  # what the choice's price was multiplied by
            engine = self.by_name[choice.engine]
            tried.append(engine.name)
            self.metrics.routed.labels(engine.name, choice.reason).inc()
            if attempt == 0:
                self.metrics.decision_seconds.observe(now - arrival)
            self.metrics.predicted_ttft.labels(engine.name).observe(choice.predicted_s)
            ticket = self.queue.sent(engine.name, now, streaming=streaming, expected_first_s=choice.predicted_s)
            pending = self.cached.sent(engine.name, digests)
            if prompt is not None:
                self._record_sent(engine, prompt, digests)
            self.metrics.inflight.labels(engine.name).set(self.queue.inflight(engine.name))

            def first_byte(status: int, ticket=ticket, engine=engine, pending=pending, choice=choice,
                           attempt=attempt, decided=now, pace=pace, priced=bool(located)) -> None:
                t = time.monotonic()
                if status == 200:  # an error answer computed no prompt
                    self.cached.computed(pending)
                # Priced by the cost model (Locate's prices): how much slower than priced it ran.
                # Not a choice priced from the measured prefill (held, or without an answer).
                on_price = priced and choice.reason != HELD and choice.service_s > 0
                sample = self.queue.first_byte(ticket, t, choice.service_s if on_price else None)
                if sample is not None:
                    self.metrics.prefill.labels(engine.name).set(self.queue.prefill_s(engine.name) or 0.0)
                    if on_price and ticket.idle:  # its waking is measured apart (queue_model.py)
                        self.metrics.wake.labels(engine.name).set(self.queue.wake_s(engine.name))
                    elif on_price:
                        self.pace.paced(engine.name, sample, choice.service_s / pace, t)
                        self.metrics.pace.labels(engine.name).set(self.pace.value(engine.name, t))
                if streaming:
                    self.metrics.ttft.labels(engine.name).observe(t - arrival)
                # Never the prompt or its salt: the engine, why, and the times an operator tunes by.
                log.debug("routed to %s (%s, attempt %d): predicted %.1f ms, decided in %.1f ms, "
                          "first byte after %.1f ms, status %d", engine.name, choice.reason, attempt + 1,
                          choice.predicted_s * 1e3, (decided - arrival) * 1e3, (t - arrival) * 1e3, status)

            try:
                outcome = await self._proxy.forward(
                    request, engine, method=method, path=request.path, body=raw, streaming=streaming,
                    down=self._watch.down_signal(engine.name), route=choice.reason, on_first_byte=first_byte)
            finally:
                self.queue.done(ticket, time.monotonic())
                self.cached.settled(pending)
                self.metrics.inflight.labels(engine.name).set(self.queue.inflight(engine.name))
            if outcome.engine_down:
                self._watch.mark_down(engine.name, outcome.reason)
            if outcome.kind == ANSWERED:
                ok = outcome.status == 200
                self.metrics.requests.labels(endpoint, "ok" if ok else "engine_status").inc()
                assert outcome.response is not None
                return outcome.response
            if outcome.kind in (FAILED_MID_RESPONSE, CLIENT_GONE):
                self.metrics.requests.labels(endpoint, outcome.kind).inc()
                assert outcome.response is not None
                return outcome.response
            self.metrics.attempt_failures.labels(engine.name, "status" if outcome.status else "connection").inc()
            failures.append(f"{engine.name}: {outcome.reason}")
        down = [f"{e.name}: {self._watch.reason(e.name)}" for e in self.engines
                if e.name not in tried and not self._watch.up(e.name)]
        why = "; ".join(failures + down) or "no engine configured"
        return self._error(endpoint, 503, f"no engine could answer ({why})")

    def _held_depth(self, engines: Sequence[EngineSpec], located: Mapping[str, Located] | None,
                    digests: tuple[bytes, ...]) -> int:
        """The most leading blocks of the prompt any engine is believed to hold or any node answered
        holding: the prefix whose demand shares the price of a copy (kvtier/router/choice.py)."""
        if not digests:
            return 0
        held = max((self.cached.resident(e.name, digests) for e in engines), default=0)
        found = max((a.matched_blocks for a in (located or {}).values()), default=0)
        return min(len(digests), max(held, found))

    def _record_sent(self, engine: EngineSpec, prompt: RequestPrompt, digests: tuple[bytes, ...]) -> None:
        """What the held rule must know of a prompt sent to ``engine`` (kvtier/router/held_rule.py)."""
        if digests:
            self.held_rule.sent(engine, digests)
        elif prompt.tokens is None:
            self.held_rule.sent_unknown(engine)
        elif not self._block_tokens:
            self.held_rule.sent_tokens(engine, prompt.tokens, prompt.salt)

    def _error(self, endpoint: str, status: int, message: str) -> web.Response:
        outcome = "unavailable" if status == 503 else "bad_request"
        self.metrics.requests.labels(endpoint, outcome).inc()
        return web.json_response(error_body(status, message), status=status)


def _threshold(tail: ServiceTail | None) -> float:
    """The tail's value in seconds for ``kvtier_router_keep_tail_seconds`` (NaN: none)."""
    v = tail.value() if tail is not None else None
    return math.nan if v is None else v


def engine_price_ms(answer: Located, resident: int) -> float | None:
    """The predicted TTFT at an engine that holds the first ``resident`` requested blocks itself,
    when that covers everything its node holds (else None: the node's price stands)."""
    if resident < answer.matched_blocks:
        return None
    return computing_ms(answer, resident)


def computing_ms(answer: Located, resident: int) -> float | None:
    """The predicted TTFT of computing the prompt of ``answer`` past its first ``resident``
    requested blocks (None when that is none, or the answer has no tail price). Between the
    answer's two prices: every block computed (``recompute_ms``) and only the new tokens
    (``tail_ms``), in proportion to the blocks held."""
    n = answer.requested_blocks
    r = min(resident, n)
    if not r or answer.tail_ms <= 0:
        return None  # tail_ms 0: a daemon from before the field
    return answer.recompute_ms - (answer.recompute_ms - answer.tail_ms) * r / n


def json_ready(host: str, port: int) -> dict[str, Any]:
    """The ready file's content (``kvtier route --ready-file``)."""
    shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    return {"url": f"http://{shown}:{port}", "host": host, "port": port}
