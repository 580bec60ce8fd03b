"""Which engines are up, and how loaded: each engine polled every ``poll_s``.

A poll is ``GET /health`` then ``GET /metrics`` (vLLM's, parsed by ``engine_load``), each within
``timeout_s``. An engine is up while its polls succeed; the first failed poll takes it down (a
stopped engine refuses the connection, a frozen one lets the deadline pass), and so does an
attempt of a request that cannot reach it (``mark_down``); the next successful poll brings it back.
So a dead or frozen engine drops out within ``poll_s + timeout_s`` and rejoins within ``poll_s``
of answering again. A poll that timed out while the router's own loop ran late leaves the
engine's state as it was (kvtier/router/late_timeouts.py).

Each engine has a *down signal*: an ``asyncio.Event`` set when it goes down. An attempt takes the
current signal when it starts and gives up on the engine when it is set (kvtier/router/proxy.py);
an engine coming back up gets a fresh one.

Protocol: ``EngineWatch(...)`` -> ``await poll_all()`` once (the state at start) -> ``run()`` as a
task until cancelled. Event-loop only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp

from kvtier.router.engine_cache import EngineCacheView
from kvtier.router.engine_load import parse_vllm_load
from kvtier.router.engines import EngineSpec
from kvtier.router.late_timeouts import LateTimeouts
from kvtier.router.metrics import RouterMetrics
from kvtier.router.queue_model import QueueModel

log = logging.getLogger("kvtier.router")


@dataclass(slots=True)
class _State:
    up: bool
    reason: str
    down: asyncio.Event


class EngineWatch:
    """Health and load of every engine (see the module docstring)."""

    def __init__(self, engines: Sequence[EngineSpec], session: aiohttp.ClientSession, queue: QueueModel,
                 cached: EngineCacheView, metrics: RouterMetrics, *, poll_s: float, timeout_s: float,
                 late: LateTimeouts | None = None) -> None:
        self.engines = list(engines)
        self.session = session
        self.queue = queue
        self.cached = cached
        self._unsized: set[str] = set()  # engines already warned about
        self.metrics = metrics
        self.poll_s = poll_s
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        # Shared with the proxy's timers where given (kvtier/router/app.py): one streak per engine.
        self.late = late if late is not None else LateTimeouts(metrics.late_timeouts, "engine")
        self._state: dict[str, _State] = {}
        for e in self.engines:
            ev = asyncio.Event()
            ev.set()  # down until its first poll answers
            self._state[e.name] = _State(False, "not polled yet", ev)
            metrics.engine_up.labels(e.name).set(0)

    def up(self, name: str) -> bool:
        return self._state[name].up

    def reason(self, name: str) -> str:
        return self._state[name].reason

    def down_signal(self, name: str) -> asyncio.Event:
        return self._state[name].down

    def up_engines(self) -> list[EngineSpec]:
        return [e for e in self.engines if self._state[e.name].up]

    def mark_down(self, name: str, reason: str) -> None:
        s = self._state[name]
        if s.up:
            log.warning("engine %s is down: %s", name, reason)
        s.up, s.reason = False, reason
        s.down.set()
        self.cached.forget(name)  # it may come back with an empty cache
        self.metrics.engine_up.labels(name).set(0)

    def _mark_up(self, name: str) -> None:
        s = self._state[name]
        if not s.up:
            log.warning("engine %s is up", name)
            s.up, s.reason = True, ""
            s.down = asyncio.Event()
        self.metrics.engine_up.labels(name).set(1)

    async def poll_all(self) -> None:
        await asyncio.gather(*(self._poll(e) for e in self.engines))

    async def run(self) -> None:
        # One loop per engine: a frozen engine's slow polls do not delay the others'.
        await asyncio.gather(*(self._loop(e) for e in self.engines))

    async def _loop(self, e: EngineSpec) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            await self._poll(e)

    async def _poll(self, e: EngineSpec) -> None:
        started = time.monotonic()  # of the request that may time out
        try:
            async with self.session.get(e.url + "/health", timeout=self.timeout) as r:
                await r.read()
                if r.status != 200:
                    self.mark_down(e.name, f"/health answered {r.status}")
                    return
            asked_at = started = time.monotonic()  # the engine's counts are as of some moment after this
            async with self.session.get(e.url + "/metrics", timeout=self.timeout) as r:
                text = await r.text()
                if r.status != 200:
                    self.mark_down(e.name, f"/metrics answered {r.status}")
                    return
        except TimeoutError:
            assert self.timeout.total is not None
            waited = time.monotonic() - started
            if self.late.conclusive(e.name, waited, self.timeout.total):
                self.mark_down(e.name, f"no answer to its health poll within {self.timeout.total:g} s")
            else:
                log.debug("engine %s: its health poll timed out %.0f ms late, the router's own delay: "
                          "its state is kept", e.name, (waited - self.timeout.total) * 1e3)
            return
        except aiohttp.ClientError as exc:
            self.mark_down(e.name, f"health poll failed: {type(exc).__name__}: {exc}")
            return
        try:
            load = parse_vllm_load(text)
        except ValueError:
            self.mark_down(e.name, "/metrics is not Prometheus text")
            return
        self.late.answered(e.name)
        self.queue.polled(e.name, load, time.monotonic(), asked_at)
        if load.cache_blocks is not None:
            self.cached.capacity(e.name, load.cache_blocks)
        elif e.name not in self._unsized:
            self._unsized.add(e.name)
            log.warning("engine %s reports no cache size (vllm:cache_config_info): what it holds itself is "
                        "estimated at --engine-cache-blocks (%d; 0: not at all)", e.name, self.cached.default_blocks)
        self._mark_up(e.name)
