"""Timeouts the router saw late (kvtier/router/late_timeouts.py): when the router's own event loop
stalls past a deadline, the engine or node that timed out keeps its state; on time, a timeout
takes it down; late ``MAX_INCONCLUSIVE`` times in a row, it is taken down all the same.

The stall is the router's loop blocked (``time.sleep`` on it) while a poll, a Locate, a connect or a
stream's stall limit waits, as a host whose cores are taken elsewhere stalls it. The peers are
real: a frozen daemon (SIGSTOP), an HTTP server that answers its health poll late, a listener
whose accept queue is full, and an engine in a thread of its own that pauses mid-stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import threading
import time
from pathlib import Path

import aiohttp
from aiohttp import web

from kvtier.router.cache_view import CacheView
from kvtier.router.engine_cache import EngineCacheView
from kvtier.router.engine_watch import EngineWatch
from kvtier.router.engines import EngineSpec
from kvtier.router.late_timeouts import MAX_INCONCLUSIVE, LateTimeouts
from kvtier.router.metrics import RouterMetrics
from kvtier.router.proxy import Proxy
from kvtier.router.queue_model import QueueModel
from kvtier.security.policy import ROLE_ROUTER
from kvtier.server.fleet_view import FleetView, Member
from storage_backends.grpc import GrpcTierConfig
from storage_backends.grpc_locate import GrpcLocateClient
from tests.helpers import freeze
from tests.integration.locate_rig import BT, DaemonProcess, deployment

DEADLINE_S = 0.3
STALL_S = 1.0  # the router's loop blocked this long: well past every deadline here
TOKENS = tuple(range(30_000, 30_000 + 2 * BT + 1))
METRICS_TEXT = (Path(__file__).parents[1] / "unit" / "router" / "data" / "vllm_cpu_0.32_metrics.txt").read_text()


def _late(metrics: RouterMetrics, kind: str) -> float:
    return metrics.late_timeouts.labels(kind)._value.get()


async def _serve(routes: list[web.RouteDef]) -> tuple[web.AppRunner, str]:
    """An HTTP app on a free loopback port: its runner (to clean up) and its base URL."""
    app = web.Application()
    app.router.add_routes(routes)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


async def _stalled(aw, stall_s: float = STALL_S):
    """``aw`` awaited while the loop is blocked for ``stall_s`` just after it started waiting."""
    task = asyncio.ensure_future(aw)
    await asyncio.sleep(0.05)  # the request is out; its deadline runs
    time.sleep(stall_s)  # the router's own stall
    return await task


def test_a_node_keeps_its_state_when_the_router_stalled_past_its_locate_deadline(tmp_path: Path) -> None:
    dep = deployment(tmp_path / "c", node="c", memory_bytes=1 << 20)
    daemon = DaemonProcess(dep)
    token = dep.token("fleet", "router", roles=(ROLE_ROUTER,))
    metrics = RouterMetrics()

    async def run() -> None:
        fleet = FleetView([Member("c", daemon.address)], lambda m: GrpcLocateClient(
            GrpcTierConfig(m.address, token, max_attempts=1, data_plane="tcp", name=m.name)), DEADLINE_S)
        view = CacheView(fleet, metrics, probe_s=0.2)
        probes = asyncio.create_task(view.run_probes())
        try:
            assert "c" in await view.locate(TOKENS, "")  # answers: up
            freeze(daemon.proc.pid)
            # Control: a frozen daemon whose deadline passes on time is taken down at once.
            assert await view.locate(TOKENS, "") == {}
            assert not view.up("c") and _late(metrics, "node") == 0
            os.kill(daemon.proc.pid, signal.SIGCONT)
            for _ in range(100):  # the probe brings it back
                if view.up("c"):
                    break
                await asyncio.sleep(0.1)
            assert view.up("c")
            freeze(daemon.proc.pid)
            # The router stalls past the deadline: inconclusive, the node stays up ...
            for k in range(1, MAX_INCONCLUSIVE):
                assert await _stalled(view.locate(TOKENS, "")) == {}
                assert view.up("c") and _late(metrics, "node") == k
            # ... but not for ever: late MAX_INCONCLUSIVE times in a row, it is judged.
            assert await _stalled(view.locate(TOKENS, "")) == {}
            assert not view.up("c") and _late(metrics, "node") == MAX_INCONCLUSIVE
        finally:
            os.kill(daemon.proc.pid, signal.SIGCONT)
            probes.cancel()
            await asyncio.gather(probes, return_exceptions=True)
            await view.close()

    try:
        asyncio.run(run())
    finally:
        daemon.stop()


def test_an_engine_keeps_its_state_when_the_router_stalled_past_its_health_poll() -> None:
    metrics = RouterMetrics()

    async def run() -> None:
        delay = {"s": 0.0}

        async def health(request: web.Request) -> web.Response:
            await asyncio.sleep(delay["s"])
            return web.Response(text="")

        async def vllm_metrics(request: web.Request) -> web.Response:
            return web.Response(text=METRICS_TEXT)

        runner, url = await _serve([web.get("/health", health), web.get("/metrics", vllm_metrics)])
        spec = EngineSpec("a", url, "a")
        async with aiohttp.ClientSession() as session:
            watch = EngineWatch([spec], session, QueueModel(["a"]), EngineCacheView(["a"], 0), metrics,
                                poll_s=60, timeout_s=DEADLINE_S)
            try:
                await watch.poll_all()
                assert watch.up("a")
                delay["s"] = 2 * STALL_S  # the engine answers its health poll too late from now on
                await watch.poll_all()  # control: on time, the timeout takes it down
                assert not watch.up("a") and _late(metrics, "engine") == 0
                delay["s"] = 0.0
                await watch.poll_all()
                assert watch.up("a")
                delay["s"] = 2 * STALL_S
                for k in range(1, MAX_INCONCLUSIVE):
                    await _stalled(watch.poll_all())
                    assert watch.up("a") and _late(metrics, "engine") == k
                await _stalled(watch.poll_all())
                assert not watch.up("a") and _late(metrics, "engine") == MAX_INCONCLUSIVE
            finally:
                await runner.cleanup()

    asyncio.run(run())


def _blackhole() -> tuple[socket.socket, list[socket.socket], str]:
    """A listener whose accept queue is full: a new connection to it is never accepted, so a
    connect waits for its timeout (as to a host whose kernel is frozen)."""
    srv = socket.create_server(("127.0.0.1", 0), backlog=0)
    port = srv.getsockname()[1]
    fill = []
    for _ in range(3):
        s = socket.socket()
        s.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            s.connect(("127.0.0.1", port))
        fill.append(s)
    time.sleep(0.1)
    return srv, fill, f"http://127.0.0.1:{port}"


async def _front(proxy: Proxy, engine: EngineSpec, stall: dict[str, bool]) -> tuple[web.AppRunner, str]:
    """A real HTTP front whose handler makes one attempt through ``proxy``, and answers the outcome."""

    async def attempt(request: web.Request) -> web.Response:
        aw = proxy.forward(request, engine, method="POST", path="/v1/completions", body=b"{}", streaming=True,
                           down=down, route="test", on_first_byte=lambda status: None)
        outcome = await (_stalled(aw) if stall["on"] else aw)
        if outcome.response is not None:
            return outcome.response
        return web.json_response({"kind": outcome.kind, "engine_down": outcome.engine_down,
                                  "reason": outcome.reason})

    down = asyncio.Event()
    runner, url = await _serve([web.post("/attempt", attempt)])
    return runner, url + "/attempt"


def test_a_connect_timeout_the_router_saw_late_keeps_the_engine_up() -> None:
    metrics = RouterMetrics()
    srv, fill, url = _blackhole()
    engine = EngineSpec("a", url, "a")

    async def run() -> None:
        stall = {"on": False}
        async with aiohttp.ClientSession() as session:
            proxy = Proxy(session, DEADLINE_S, stall_s=STALL_S, late=LateTimeouts(metrics.late_timeouts, "engine"))
            runner, front = await _front(proxy, engine, stall)
            try:
                # Control: a connect timeout on time takes the engine down.
                async with session.post(front) as r:
                    got = await r.json()
                assert (got["kind"], got["engine_down"]) == ("retry", True) and _late(metrics, "engine") == 0, got
                stall["on"] = True
                for k in range(1, MAX_INCONCLUSIVE):
                    async with session.post(front) as r:
                        got = await r.json()
                    assert (got["kind"], got["engine_down"]) == ("retry", False), got
                    assert "the router's own delay" in got["reason"] and _late(metrics, "engine") == k
                async with session.post(front) as r:  # late MAX_INCONCLUSIVE times in a row: judged
                    got = await r.json()
                assert got["engine_down"] is True and _late(metrics, "engine") == MAX_INCONCLUSIVE
            finally:
                await runner.cleanup()

    try:
        asyncio.run(run())
    finally:
        for s in (srv, *fill):
            s.close()


class _PausingEngine:
    """An engine in a thread of its own (the router's stall does not stop it): streams a first
    chunk at once, pauses ``pause_s``, then streams ``chunks`` more and ``data: [DONE]``."""

    def __init__(self, pause_s: float, chunks: int = 3) -> None:
        self.pause_s, self.chunks = pause_s, chunks
        self.url = ""
        ready = threading.Event()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self.thread.start()
        assert ready.wait(10)

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)

        async def stream(request: web.Request) -> web.StreamResponse:
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            await out.write(b'data: {"chunk": 0}\n\n')
            await asyncio.sleep(self.pause_s)
            for i in range(1, self.chunks + 1):
                await out.write(f'data: {{"chunk": {i}}}\n\n'.encode())
            await out.write(b"data: [DONE]\n\n")
            await out.write_eof()
            return out

        self.runner, self.url = self.loop.run_until_complete(_serve([web.post("/v1/completions", stream)]))
        ready.set()
        self.loop.run_forever()

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


#: The stall limit here; the router's stall, from STREAM_STALL_AT_S after the first byte, covers
#: the limit's due time; the engine's pause after its first chunk is longer than the limit, and
#: ends 0.4 s after the router's stall, 0.4 s before a new limit started then would fall due.
STREAM_STALL_S = 0.8
STREAM_STALL_AT_S = 0.1
ROUTER_STALL_S = 2.0
PAUSE_S = 2.5


def test_a_stream_stall_the_router_saw_late_does_not_end_the_stream() -> None:
    """The engine is taken down by the health watch at its first byte, then pauses 2.5 s
    mid-stream; the stall limit is 0.8 s. Control: the pause ends the stream at the limit. With
    the router's loop stalled from 0.1 s to 2.1 s, the limit fires late: the stream is read
    again, and goes on to its end."""
    metrics = RouterMetrics()
    engine_srv = _PausingEngine(PAUSE_S)
    engine = EngineSpec("a", engine_srv.url, "a")

    async def stream_once(session: aiohttp.ClientSession, stall: bool) -> str:
        proxy = Proxy(session, 5.0, stall_s=STREAM_STALL_S, late=LateTimeouts(metrics.late_timeouts, "engine"))
        down = asyncio.Event()

        def first_byte(status: int) -> None:
            down.set()  # taken down by the health watch while streaming: the stall limit applies
            if stall:  # the router's own stall, once the limit's wait has begun
                asyncio.get_running_loop().call_later(STREAM_STALL_AT_S, time.sleep, ROUTER_STALL_S)

        async def attempt(request: web.Request) -> web.StreamResponse:
            outcome = await proxy.forward(request, engine, method="POST", path="/v1/completions", body=b"{}",
                                          streaming=True, down=down, route="test", on_first_byte=first_byte)
            assert outcome.response is not None
            return outcome.response

        runner, url = await _serve([web.post("/attempt", attempt)])
        try:
            async with session.post(url + "/attempt") as r:
                return await r.text()
        finally:
            await runner.cleanup()

    async def run() -> None:
        async with aiohttp.ClientSession() as session:
            body = await stream_once(session, stall=False)  # control: on time, the pause ends it
            assert "failed mid-response" in body and "[DONE]" not in body, body[-300:]
            assert _late(metrics, "engine") == 0
            body = await stream_once(session, stall=True)
            assert body.endswith("data: [DONE]\n\n") and '"chunk": 3' in body, body[-300:]
            assert _late(metrics, "engine") == 1

    try:
        asyncio.run(run())
    finally:
        engine_srv.close()
