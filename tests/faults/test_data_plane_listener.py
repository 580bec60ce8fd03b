"""Issue 32 point 2, the listener: no single connection stops the data-plane socket.

A real daemon, real unix sockets, real sealed memfds. Attackers send hellos that are deeply
nested (in the body, in the token's claims), huge, or trickled a byte a second; silent
connections pile up; one hello makes the attach code raise something no one expected. Meanwhile
a bystander on the same node attaches a region and does a Put and a Get through it: it must be
served while the attack goes on, every attacker must be answered or dropped (none left hanging),
the listener counts what it refused, dropped or crashed on (on /metrics), and the bystander's
region is freed when it closes.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from benchmarks.localdeploy import LocalDeployment
from kvtier.dataplane.handshake import Attached, Hello, read_reply, send_hello
from kvtier.dataplane.listener import DataPlaneListener, ListenerLimits
from kvtier.dataplane.region import SharedRegion
from kvtier.dataplane.region_table import RegionLimits, RegionTable
from kvtier.errors import AuthError
from kvtier.keys import Scope
from kvtier.layout import KVLayout
from kvtier.security.policy import Principal
from kvtier.server.daemon import Daemon
from storage_backends.grpc import GrpcTier, GrpcTierConfig
from tests.helpers import SECRET, chain_blocks, wait_for

MID = KVLayout("shm-listener", num_layers=4, num_kv_heads=4, head_dim=64, dtype="bfloat16", block_tokens=32)
LEN = struct.Struct(">I")


@pytest.fixture
def deployment(tmp_path: Path) -> Iterator[tuple[LocalDeployment, Daemon]]:
    dep = LocalDeployment(tmp_path / "d", server_secret=SECRET)
    dep.write_config(memory_bytes=64 << 20, server={"metrics_listen": "127.0.0.1:0"})
    daemon = Daemon(dep.config()).start()
    yield dep, daemon
    daemon.stop(grace_s=0)


def socket_of(daemon: Daemon) -> str:
    return daemon._data_plane_offer().socket


def metrics(daemon: Daemon) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{daemon.metrics_port}/metrics", timeout=10) as r:
        return r.read().decode()


def connection_count(text: str, outcome: str) -> float:
    for line in text.splitlines():
        if line.startswith(f'kvtier_data_plane_connections_total{{outcome="{outcome}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def bystander(dep: LocalDeployment, daemon: Daemon, seed: int) -> GrpcTier:
    """A client on the node: attaches a region, puts and gets through it, byte-exact. Returns it open."""
    tier = GrpcTier(GrpcTierConfig(daemon.address, dep.token("acme", "alice"), timeout_s=10.0, data_plane="shm",
                                   region_bytes=4 << 20))
    blocks = chain_blocks(4, layout=MID, scope=Scope.user("acme/alice"), seed=seed, token_base=seed * 10_000)
    assert tier.put(blocks).stored == [b.key for b in blocks]
    got = tier.get([b.key for b in blocks])
    assert all(g is not None and g.equal_bytes(b) for g, b in zip(got, blocks, strict=True))
    assert tier.data_plane == "shm"
    assert tier.session.moved_bytes["put"] > 0 and tier.session.moved_bytes["get"] > 0, "through the region"
    return tier


# -- attacks ------------------------------------------------------------------------------------------
def _b64(raw: bytes) -> str:
    import base64

    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _send_raw(path: str, frame: bytes) -> str:
    """Send ``frame`` with a sealed memfd attached; what came back: the refusal's class, 'closed', or 'no answer'."""
    region = SharedRegion.create(4096)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(3.0)
            s.connect(path)
            try:
                socket.send_fds(s, [frame[:4096]], [region.fd])
                if len(frame) > 4096:
                    s.sendall(frame[4096:])
            except (BrokenPipeError, ConnectionResetError):
                pass  # the daemon refused before reading it all
            try:
                reply = read_reply(s)
            except (ConnectionError, struct.error):
                return "closed"
            except TimeoutError:
                return "no answer"
            return "attached" if isinstance(reply, Attached) else reply[0]
    finally:
        region.close()


def nested_body(path: str, token: str) -> str:
    depth = 30_000
    body = b'{"v":1,"token":"' + token.encode() + b'","bytes":4096,"x":' + b"[" * depth + b"]" * depth + b"}"
    return _send_raw(path, LEN.pack(len(body)) + body)


def nested_token(path: str, token: str) -> str:
    bad = f"kvt1.{_b64(b'[' * 3000)}.{_b64(b'x' * 32)}"
    body = f'{{"v":1,"token":"{bad}","bytes":4096}}'.encode()
    return _send_raw(path, LEN.pack(len(body)) + body)


def huge_declared(path: str, token: str) -> str:
    return _send_raw(path, LEN.pack(0xFFFF_FFFF) + b"{" * (1 << 20))


def huge_token(path: str, token: str) -> str:
    body = b'{"v":1,"token":"' + b"A" * 6000 + b'","bytes":4096}'
    return _send_raw(path, LEN.pack(len(body)) + body)


ATTACKS: dict[str, Callable[[str, str], str]] = {
    "nested-body": nested_body, "nested-token": nested_token, "huge-declared": huge_declared,
    "huge-token": huge_token,
}


class Repeat(threading.Thread):
    """Runs one attack over and over until stopped; counts what each try got back."""

    def __init__(self, attack: Callable[[str, str], str], path: str, token: str) -> None:
        super().__init__(daemon=True)
        self.attack, self.path, self.token = attack, path, token
        self.outcomes: Counter[str] = Counter()
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            self.outcomes[self.attack(self.path, self.token)] += 1

    def tries(self) -> int:
        return sum(self.outcomes.values())


@pytest.mark.parametrize("kind", ATTACKS, ids=ATTACKS)
def test_the_listener_survives_a_repeated_attack_and_serves_a_bystander_meanwhile(deployment, kind: str) -> None:
    dep, daemon = deployment
    attacker = Repeat(ATTACKS[kind], socket_of(daemon), dep.token("acme", "mallory"))
    attacker.start()
    try:
        assert wait_for(lambda: attacker.tries() >= 3, 20), f"the attack did not get going: {attacker.outcomes}"
        before = attacker.tries()
        tier = bystander(dep, daemon, seed=1)
        # Still going: tries answered after the bystander was served prove the listener lived on.
        assert wait_for(lambda: attacker.tries() >= before + 3, 20), attacker.outcomes
    finally:
        attacker.stop.set()
        attacker.join(30)
    assert not attacker.is_alive()
    # Every try was answered with a named refusal (or, for a message too large to read, dropped).
    expected = {"nested-body": {"InvalidRequest"}, "nested-token": {"AuthError"},
                "huge-declared": {"InvalidRequest", "closed"}, "huge-token": {"AuthError"}}[kind]
    assert set(attacker.outcomes) <= expected, attacker.outcomes
    assert daemon.regions is not None and daemon.regions.snapshot() == (1, 4 << 20), "only the bystander's region"
    text = metrics(daemon)
    assert connection_count(text, "refused") >= attacker.tries()
    assert connection_count(text, "crashed") == 0
    assert connection_count(text, "attached") == 1
    tier.close()
    assert wait_for(lambda: daemon.regions.snapshot() == (0, 0)), "a closed client's region is freed"
    assert wait_for(lambda: connection_count(metrics(daemon), "detached") == 1)


class Trickler(threading.Thread):
    """Sends a hello's length prefix and descriptor, then one byte of its body per ``every_s``."""

    def __init__(self, path: str, every_s: float) -> None:
        super().__init__(daemon=True)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(path)
        self.every_s = every_s
        self.region = SharedRegion.create(4096)
        self.stop = threading.Event()
        self.sent = 0
        self.ended: str | None = None  # how the daemon ended the connection, once it did
        self.ended_at = 0.0

    def _last_word(self) -> str:
        """The refusal the daemon sent before it closed, if it sent one."""
        try:
            reply = read_reply(self.sock)
        except (OSError, struct.error):
            return "closed"
        return reply[0] if isinstance(reply, tuple) else "attached"

    def run(self) -> None:
        body = b'{"v":1,"token":"' + b"t" * 400 + b'","bytes":4096}'
        try:
            socket.send_fds(self.sock, [LEN.pack(len(body)) + body[:1]], [self.region.fd])
            self.sent = 1
            self.sock.settimeout(self.every_s)
            while not self.stop.is_set() and self.sent < len(body):
                try:
                    reply = read_reply(self.sock)  # waits at most every_s for the daemon to speak
                    self.ended = reply[0] if isinstance(reply, tuple) else "attached"
                    break
                except TimeoutError:
                    pass
                except ConnectionError:
                    self.ended = "closed"
                    break
                try:
                    self.sock.sendall(body[self.sent : self.sent + 1])
                except (BrokenPipeError, ConnectionResetError):
                    self.ended = self._last_word()
                    break
                self.sent += 1
        finally:
            self.ended_at = time.monotonic()
            self.sock.close()
            self.region.close()


def test_trickled_hellos_neither_block_a_bystander_nor_stay_forever(deployment) -> None:
    dep, daemon = deployment
    tricklers = [Trickler(socket_of(daemon), every_s=1.0) for _ in range(4)]
    started = time.monotonic()
    for t in tricklers:
        t.start()
    try:
        assert wait_for(lambda: all(t.sent >= 2 for t in tricklers), 10), "the trickle did not start"
        assert all(t.ended is None for t in tricklers), "the attack is still going when the bystander comes"
        tier = bystander(dep, daemon, seed=2)
        # Each trickled hello is cut at the hello deadline with a refusal that says so, long
        # before its 400-odd bytes could have arrived.
        assert wait_for(lambda: all(t.ended is not None for t in tricklers), 60), [t.sent for t in tricklers]
    finally:
        for t in tricklers:
            t.stop.set()
            t.join(10)
    assert {t.ended for t in tricklers} == {"InvalidRequest"}, [t.ended for t in tricklers]
    assert all(t.sent < 100 for t in tricklers), [t.sent for t in tricklers]
    assert all(t.ended_at - started < 60 for t in tricklers)
    assert connection_count(metrics(daemon), "timed_out") == 4
    tier.close()
    assert wait_for(lambda: daemon.regions.snapshot() == (0, 0)), "a closed client's region is freed"


def test_a_pile_of_silent_connections_does_not_lock_out_a_bystander(deployment) -> None:
    dep, daemon = deployment
    path = socket_of(daemon)
    silent = []
    try:
        for _ in range(300):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(path)  # blocking: waits for room in the listen backlog
            silent.append(s)
        tier = bystander(dep, daemon, seed=3)
        text = metrics(daemon)
        # The listener holds a bounded number of unfinished hellos: the oldest were let go.
        let_go = connection_count(text, "evicted") + connection_count(text, "timed_out")
        assert let_go >= 300 - ListenerLimits().max_pending
        tier.close()
    finally:
        for s in silent:
            s.close()
    assert wait_for(lambda: daemon.regions.snapshot() == (0, 0))


# -- a bug in one connection's handling ---------------------------------------------------------------
def test_an_unexpected_error_in_one_hello_is_logged_counted_and_the_listener_serves_on(tmp_path, caplog) -> None:
    alice = Principal("acme", "alice", credential_id="t1")

    def authenticate(token: str) -> Principal:
        if token == "boom":
            raise RuntimeError("a bug in the attach path")
        if token == "good":
            return alice
        raise AuthError("not a token")

    table = RegionTable(RegionLimits(8 << 20, 8, 4))
    listener = DataPlaneListener(tmp_path / "dp.sock", table, authenticate)
    regions = [SharedRegion.create(8192) for _ in range(3)]
    socks = []
    try:
        replies = []
        with caplog.at_level(logging.ERROR, logger="kvtier.server"):
            for token, region in zip(("boom", "boom", "good"), regions, strict=True):
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.settimeout(5)
                s.connect(str(listener.path))
                send_hello(s, Hello(token, region.nbytes), region.fd)
                replies.append(read_reply(s))
                socks.append(s)
        assert [r[0] if isinstance(r, tuple) else "attached" for r in replies] == ["KvtierError", "KvtierError",
                                                                                  "attached"]
        assert "RuntimeError" not in replies[0][1], "the client is told it failed, not the daemon's internals"
        assert listener.counts()["crashed"] == 2 and listener.counts()["attached"] == 1
        crashes = [r for r in caplog.records if getattr(r, "event", None) == "data_plane_crashed"]
        assert len(crashes) == 2 and all(r.exc_info is not None for r in crashes)
        assert table.snapshot() == (1, 8192)
        socks[2].close()
        assert wait_for(lambda: table.snapshot() == (0, 0)), "the attached client's region is freed on close"
        assert wait_for(lambda: listener.counts()["detached"] == 1)
    finally:
        for s in socks:
            s.close()
        for r in regions:
            r.close()
        listener.close()
    assert not os.path.exists(tmp_path / "dp.sock")
