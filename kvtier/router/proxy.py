"""One attempt of a request at one engine, committed at its first byte.

Nothing reaches the client before the engine's first byte of body has reached the router: until
then the attempt can fail (connection refused or reset, the engine taken down by the health
watch, an answer of 502/503/504, a stream that ends before it begins) and the router tries another
engine. From the first byte on, the attempt is the answer: a streamed answer (server-sent events)
is passed through chunk by chunk as it comes; one that is not streamed is read whole and sent.
A streamed answer whose engine fails after it began ends with an error event (``data: {"error":
...}``, as vLLM streams its own errors) and no ``data: [DONE]``: the client sees it end short,
never bytes of another engine's answer spliced in. The health watch taking the engine down ends
a stream only once the stream has also stalled (no chunk for ``stall_s``): a poll can fail or be
slow on an engine that is merely busy, and a stream still delivering chunks proves its engine is
alive (a frozen engine sends none, so it still ends within ``stall_s``).

Both of the proxy's timers, the connect timeout and the stall limit, are judged by the
late-timeout rule (kvtier/router/late_timeouts.py), with the health watch's count for the engine:
one that fired late past its deadline is the router's own delay. A late connect timeout still
tries another engine (nothing was sent), but leaves the engine up; a late stall reads the stream
again.

The engine's own answers (200, and 4xx/500 about the request) pass through with their status
and body. Only the headers that describe the content pass, plus ``X-Kvtier-Engine`` (who
answered) and ``X-Kvtier-Route`` (why it was chosen).

Protocol: ``Proxy(session, connect_timeout_s, stall_s, late)`` -> ``forward(...)`` per attempt -> an ``Outcome``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

import aiohttp
from aiohttp import web

from kvtier.router.engines import EngineSpec
from kvtier.router.errors import sse_error
from kvtier.router.late_timeouts import LateTimeouts

#: Request headers passed to the engine (the rest, hop-by-hop ones included, are the router's).
FORWARDED_REQUEST_HEADERS = ("Authorization", "Content-Type", "Accept", "X-Request-Id", "traceparent")
#: Response headers passed back to the client.
FORWARDED_RESPONSE_HEADERS = ("Content-Type", "X-Request-Id")
#: Engine answers that say "not now, here" rather than "not this request": tried elsewhere.
RETRY_STATUSES = frozenset({502, 503, 504})
ENGINE_HEADER, ROUTE_HEADER = "X-Kvtier-Engine", "X-Kvtier-Route"
#: A non-streamed answer larger than this is refused (a completion with log-probabilities of many
#: tokens stays far below it).
MAX_ANSWER_BYTES = 256 << 20

T = TypeVar("T")

#: Outcome kinds.
ANSWERED, RETRY, FAILED_MID_RESPONSE, CLIENT_GONE = "answered", "retry", "failed_mid_response", "client_gone"


@dataclass(slots=True, frozen=True)
class Outcome:
    """``answered`` (``response`` is what the client got), ``retry`` (nothing was sent: try another
    engine; ``engine_down`` when the engine could not be reached), ``failed_mid_response`` or
    ``client_gone`` (the client disconnected during a streamed answer)."""

    kind: str
    response: web.StreamResponse | None = None
    status: int = 0
    reason: str = ""
    engine_down: bool = False


class _EngineDown(Exception):
    pass


async def _race(aw: Awaitable[T], down: asyncio.Event) -> T:
    """``aw``'s result, or _EngineDown as soon as ``down`` is set (``aw`` is then cancelled)."""
    if down.is_set():
        if asyncio.iscoroutine(aw):
            aw.close()
        raise _EngineDown
    task = asyncio.ensure_future(aw)
    waiter = asyncio.ensure_future(down.wait())
    try:
        done, _ = await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        waiter.cancel()
    if task in done:
        return task.result()
    task.cancel()
    raise _EngineDown


class Proxy:
    """Sends attempts to engines over one shared client session (see the module docstring)."""

    def __init__(self, session: aiohttp.ClientSession, connect_timeout_s: float, stall_s: float,
                 late: LateTimeouts) -> None:
        assert stall_s > 0 and connect_timeout_s > 0
        self.session = session
        self.stall_s = stall_s
        self.connect_timeout_s = connect_timeout_s
        self.late = late
        # No overall deadline: a long generation is no fault. A frozen engine is caught by the
        # health watch (its down signal ends the attempt), a dead one by its connection.
        self.timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s)

    async def forward(self, request: web.Request, engine: EngineSpec, *, method: str, path: str, body: bytes,
                      streaming: bool, down: asyncio.Event, route: str,
                      on_first_byte: Callable[[int], None]) -> Outcome:
        headers = {h: request.headers[h] for h in FORWARDED_REQUEST_HEADERS if h in request.headers}
        resp: aiohttp.ClientResponse | None = None
        done = False  # the engine's answer read to its end: its connection may serve the next
        started = time.monotonic()  # of the connect that may time out
        try:
            try:
                resp = await _race(self.session.request(method, engine.url + path, data=body or None,
                                                        headers=headers, timeout=self.timeout), down)
                self.late.answered(engine.name)
                if resp.status in RETRY_STATUSES:
                    return Outcome(RETRY, status=resp.status, reason=f"answered {resp.status}")
                event_stream = resp.content_type == "text/event-stream"
                if not (streaming and event_stream and resp.status == 200):
                    data = await _race(resp.content.read(MAX_ANSWER_BYTES + 1), down)
                    if len(data) > MAX_ANSWER_BYTES:
                        return Outcome(RETRY, reason=f"answer larger than {MAX_ANSWER_BYTES} bytes")
                    on_first_byte(resp.status)
                    done = True
                    out = web.Response(status=resp.status, body=data,
                                       headers=self._headers(resp.headers, engine, route))
                    return Outcome(ANSWERED, out, resp.status)
                first = await _race(resp.content.readany(), down)
            except _EngineDown:
                return Outcome(RETRY, reason="taken down by the health watch", engine_down=True)
            except TimeoutError:
                waited = time.monotonic() - started
                if self.late.conclusive(engine.name, waited, self.connect_timeout_s):
                    return Outcome(RETRY, reason="could not connect in time", engine_down=True)
                late_ms = (waited - self.connect_timeout_s) * 1e3
                return Outcome(RETRY, reason=f"could not connect in time, {late_ms:.0f} ms late: the router's own "
                                             "delay, the engine is kept up")
            except aiohttp.ClientError as exc:
                return Outcome(RETRY, reason=f"{type(exc).__name__}: {exc}", engine_down=True)
            if not first:
                return Outcome(RETRY, reason="the stream ended before its first byte")
            on_first_byte(resp.status)
            outcome = await self._stream(request, resp, first, engine, route, down)
            done = outcome.kind == ANSWERED
            return outcome
        finally:
            if resp is not None:
                if done:
                    resp.release()
                else:
                    resp.close()  # an attempt given up aborts the engine's request (vLLM aborts on disconnect)

    async def _stream(self, request: web.Request, resp: aiohttp.ClientResponse, first: bytes, engine: EngineSpec,
                      route: str, down: asyncio.Event) -> Outcome:
        out = web.StreamResponse(status=resp.status, headers=self._headers(resp.headers, engine, route))
        out.headers["Cache-Control"] = "no-cache"
        try:
            await out.prepare(request)
            await out.write(first)
            while True:
                try:
                    if down.is_set():  # taken down, but still streaming: ended only if it stalls too
                        waiting = time.monotonic()
                        try:
                            chunk = await asyncio.wait_for(resp.content.readany(), self.stall_s)
                        except TimeoutError:
                            if not self.late.conclusive(engine.name, time.monotonic() - waiting, self.stall_s):
                                continue  # the router's own delay: read again
                            raise
                    else:
                        try:
                            chunk = await _race(resp.content.readany(), down)
                        except _EngineDown:
                            continue  # read again, under the stall limit
                except (TimeoutError, aiohttp.ClientError) as exc:
                    stalled = isinstance(exc, TimeoutError) and down.is_set()
                    why = f"taken down by the health watch, no chunk for {self.stall_s:g} s" if stalled \
                        else type(exc).__name__
                    await out.write(sse_error(502, f"engine {engine.name} failed mid-response ({why})"))
                    await out.write_eof()
                    return Outcome(FAILED_MID_RESPONSE, out, 200, why, engine_down=stalled)
                if not chunk:
                    break
                await out.write(chunk)
            await out.write_eof()
        except ConnectionResetError:  # the client left: the engine's request is aborted (closed)
            return Outcome(CLIENT_GONE, out, 200, "the client disconnected")
        return Outcome(ANSWERED, out, 200)

    @staticmethod
    def _headers(upstream: Mapping[str, str], engine: EngineSpec, route: str) -> dict[str, str]:
        out = {h: upstream[h] for h in FORWARDED_RESPONSE_HEADERS if h in upstream}
        out[ENGINE_HEADER] = engine.name
        out[ROUTE_HEADER] = route
        return out
