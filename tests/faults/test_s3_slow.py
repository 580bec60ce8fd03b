"""A slow or refusing endpoint, through a real loopback TCP proxy in front of the session SeaweedFS:
the configured timeouts hold, failures are counted misses / dropped puts, and service resumes."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from kvtier.server.embedded_s3 import EmbeddedS3
from storage_backends.circuit_breaker import BreakerState
from storage_backends.s3 import S3Tier
from tests.helpers import chain_blocks


class DelayProxy:
    """Forwards TCP between clients and ``upstream``; holds every upstream reply chunk for
    ``delay_s`` seconds, or, with ``refuse`` set, closes each new connection at once.

    Settings are read by the pump threads as they go, so tests flip them between calls.
    """

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.delay_s = 0.0
        self.refuse = False
        self._stop = threading.Event()
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _track(self, s: socket.socket) -> None:
        with self._lock:
            self._socks.append(s)

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            if self.refuse:
                client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                client.close()  # RST: what a crashed or overloaded gateway looks like
                continue
            try:
                up = socket.create_connection(self.upstream)
            except OSError:
                client.close()
                continue
            self._track(client)
            self._track(up)
            threading.Thread(target=self._pump, args=(client, up, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(up, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, delayed: bool) -> None:
        try:
            while data := src.recv(65536):
                if delayed and self.delay_s and self._stop.wait(self.delay_s):
                    return
                dst.sendall(data)
        except OSError:
            pass  # the other side went away: tear the pair down below
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def drop_connections(self) -> None:
        with self._lock:
            socks, self._socks = self._socks, []
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._stop.set()
        self._server.close()
        with self._lock:
            for s in self._socks:
                with contextlib.suppress(OSError):
                    s.close()


@pytest.fixture
def proxy(s3_server: EmbeddedS3) -> Iterator[DelayProxy]:
    assert s3_server.ports is not None
    p = DelayProxy(("127.0.0.1", s3_server.ports.s3))
    yield p
    p.close()


def _tier(s3_server: EmbeddedS3, proxy: DelayProxy, prefix: str) -> S3Tier:
    return S3Tier(s3_server.s3_config(prefix, endpoint_url=f"http://127.0.0.1:{proxy.port}", connect_timeout_s=0.3,
                                      read_timeout_s=0.3, max_attempts=2, breaker_failures=2, breaker_cooldown_s=0.5))


def _seed(s3_server: EmbeddedS3, prefix: str, blocks: list) -> None:
    """Store ``blocks`` straight to the server with default timeouts: the 0.3 s ones under test
    can end a healthy put on a loaded CI host, and the seeding is not what these tests measure."""
    seeder = S3Tier(s3_server.s3_config(prefix))
    try:
        assert seeder.put(blocks).stored == [b.key for b in blocks]
    finally:
        seeder.close()


def _recovers(tier: S3Tier, keys: list, timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if tier.contains(keys) == len(keys):
            return True
        time.sleep(0.1)
    return False


def test_slow_endpoint_timeouts_hold(s3_server: EmbeddedS3, proxy: DelayProxy, s3_prefix: str) -> None:
    tier = _tier(s3_server, proxy, s3_prefix)
    blocks = chain_blocks(3)
    keys = [b.key for b in blocks]
    _seed(s3_server, s3_prefix, blocks)
    assert _recovers(tier, keys), "the proxied tier reads the seeded blocks"
    proxy.delay_s = 30.0  # every reply now takes 30 s: only the client's timeouts can end a call

    t0 = time.monotonic()
    assert tier.contains(keys) == 0
    assert tier.get(keys) == [None, None, None]
    fresh = chain_blocks(2, token_base=900)
    assert tier.put(fresh).rejected == [b.key for b in fresh]
    assert time.monotonic() - t0 < 15, "timeouts must bound every call"
    errors = tier.metrics.snapshot()["errors"]
    assert errors["timeout"] >= 1 and errors["dropped_put"] == 2
    assert tier.breaker.state is BreakerState.OPEN

    proxy.delay_s = 0.0
    assert _recovers(tier, keys), "service resumes once the endpoint is fast again"
    tier.close()


def test_refusing_endpoint_is_a_counted_miss(s3_server: EmbeddedS3, proxy: DelayProxy, s3_prefix: str) -> None:
    tier = _tier(s3_server, proxy, s3_prefix)
    blocks = chain_blocks(2)
    keys = [b.key for b in blocks]
    _seed(s3_server, s3_prefix, blocks)
    proxy.refuse = True
    proxy.drop_connections()  # pooled keep-alive connections would otherwise still work
    assert tier.contains(keys) == 0
    assert tier.get(keys) == [None, None]
    assert tier.put(chain_blocks(1, token_base=77)).rejected
    errors = tier.metrics.snapshot()["errors"]
    assert errors["unavailable"] >= 1 and errors["dropped_put"] == 1
    proxy.refuse = False
    assert _recovers(tier, keys)
    tier.close()
