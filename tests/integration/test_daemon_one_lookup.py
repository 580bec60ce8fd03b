"""One lookup, end to end: the daemon's Lookup crosses the wire with its runs and its ticket, and
the Get that hands it back is served from those runs with no second tier walk. Real daemon (RAM
and LMDB), real gRPC.

Before this, the engine's client kept only the length of the daemon's answer and asked per key,
so the daemon walked its tiers twice per request, and with the minimum public-prefix rule on,
the per-key read hid every public block: a public prefix the lookup had found loaded as misses.
The per-key path is kept below as the control that shows both effects.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from benchmarks.localdeploy import LocalDeployment
from connectors.daemon_cache import DaemonCache
from connectors.provision import daemon_cache
from kvtier.cache.kv_cache import RequestSegment
from kvtier.errors import AccessDenied, InvalidRequest
from kvtier.keys import ScopeKind
from kvtier.security.policy import ROLE_PUBLISH_PUBLIC
from kvtier.server.daemon import Daemon
from kvtier.store.lookup import TierRun
from storage_backends.grpc import GrpcTierConfig
from tests.helpers import SECRET, SMALL

BT = SMALL.block_tokens
MIN_PUBLIC = 3


def _start(tmp_path: Path, **security: int) -> tuple[Daemon, LocalDeployment]:
    dep = LocalDeployment(tmp_path / "dep", server_secret=SECRET)
    # acme/pub publishes the public documents (the default trusts operators only).
    dep.write_config(memory_bytes=64 * SMALL.bytes_per_block, disk_bytes=32 << 20,
                     security={"public_publishers": "acme/pub", **security})
    return Daemon(dep.config()).start(), dep


@pytest.fixture
def plain(tmp_path: Path) -> Iterator[tuple[Daemon, LocalDeployment]]:
    d, dep = _start(tmp_path)
    yield d, dep
    d.stop(grace_s=0)


@pytest.fixture
def guarded(tmp_path: Path) -> Iterator[tuple[Daemon, LocalDeployment]]:
    d, dep = _start(tmp_path, min_public_prefix_blocks=MIN_PUBLIC)
    yield d, dep
    d.stop(grace_s=0)


def _data(n: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(SMALL.block_shape, generator=gen).to(SMALL.torch_dtype) for _ in range(n)]


def counted(daemon: Daemon, what: str) -> int:
    """What the daemon's access gate counted (timing mitigations and access stops alike)."""
    snap = daemon.metrics.snapshot()
    return snap["mitigations"].get(what, 0) + snap["access"].get(what, 0)


def _client(daemon: Daemon, dep: LocalDeployment, user: str, *roles: str) -> DaemonCache:
    return daemon_cache(GrpcTierConfig(daemon.address, dep.token("acme", user, roles=roles)), SMALL)


def test_the_same_prompt_costs_one_tier_walk_in_the_daemon(plain) -> None:
    daemon, dep = plain
    alice = _client(daemon, dep, "alice")
    try:
        p = alice.principal
        # Six blocks asked about, five cached: the lookup ends short, as a new prompt's does.
        chain = alice.chain(p, [RequestSegment(list(range(6 * BT)), "user")])[:6]
        data = _data(5, seed=1)
        alice.save(p, chain[:5], data)
        walks = daemon.store.requests.walks
        lookup = alice.lookup(p, chain)
        assert lookup.length == 5 and lookup.ticket and [r.tier for r in lookup.runs] == ["daemon/memory"]
        blocks = alice.load_found(p, lookup)
        assert [b.key for b in blocks] == [c.key for c in chain[:5]]
        assert all(torch.equal(b.data, d) for b, d in zip(blocks, data, strict=True))
        assert daemon.store.requests.walks - walks == 1, "lookup and load of one prompt: one walk"
        # A part of it (what vLLM loads after its own prefix cache hit): still no walk.
        walks = daemon.store.requests.walks
        part = alice.load_found(p, lookup, start=2, end=4)
        assert [b.key for b in part] == [c.key for c in chain[2:4]]
        assert daemon.store.requests.walks == walks
        # Control: the per-key read the engine used before walks again for the same prompt.
        got = alice.client.get([c.key for c in chain[:5]])
        assert all(b is not None for b in got) and daemon.store.requests.walks == walks + 1
    finally:
        alice.close()


def test_a_stale_or_forged_ticket_costs_a_walk_never_a_blind_read(plain) -> None:
    daemon, dep = plain
    alice = _client(daemon, dep, "alice")
    try:
        p = alice.principal
        chain = alice.chain(p, [RequestSegment(list(range(3 * BT)), "user")])
        alice.save(p, chain, _data(3, seed=2))
        lookup = alice.lookup(p, chain)
        stale = counted(daemon, "lookup_ticket_stale")
        for bad in (replace(lookup, ticket=b""), replace(lookup, ticket=bytes(len(lookup.ticket))),
                    replace(lookup, runs=(TierRun(0, "daemon/memory", 0, 2), TierRun(0, "daemon/memory", 2, 1)))):
            walks = daemon.store.requests.walks
            assert [b.key for b in alice.load_found(p, bad)] == [c.key for c in chain]
            assert daemon.store.requests.walks == walks + 1, "looked up again, not read on the client's word"
        assert counted(daemon, "lookup_ticket_stale") - stale == 3
        # Runs that are not this daemon's (a tier it does not have): a clear error, nothing read.
        with pytest.raises(InvalidRequest, match="found_runs"):
            alice.load_found(p, replace(lookup, runs=(TierRun(0, "elsewhere", 0, 3),)))
    finally:
        alice.close()


def test_a_lookup_handed_to_another_principal_is_refused(plain) -> None:
    daemon, dep = plain
    alice, bob = _client(daemon, dep, "alice"), _client(daemon, dep, "bob")
    try:
        chain = alice.chain(alice.principal, [RequestSegment(list(range(2 * BT)), "user")])
        alice.save(alice.principal, chain, _data(2, seed=3))
        lookup = alice.lookup(alice.principal, chain)
        with pytest.raises(AccessDenied):
            bob.load_found(bob.principal, lookup)
    finally:
        alice.close()
        bob.close()


def test_a_public_prefix_under_the_timing_rule_loads_from_the_daemon(guarded) -> None:
    """A public prefix at least ``min_public_prefix_blocks`` long, found by the lookup, loads in
    full through the lookup handed back (the vLLM connector's worker path); the per-key read, as
    the engine made it before, gets none of it (the control)."""
    daemon, dep = guarded
    publisher = _client(daemon, dep, "pub", ROLE_PUBLISH_PUBLIC)
    reader = _client(daemon, dep, "reader")
    try:
        doc = list(range(1000, 1000 + 4 * BT))
        published = publisher.chain(publisher.principal, [RequestSegment(doc, ScopeKind.PUBLIC)])
        data = _data(4, seed=4)
        assert publisher.save(publisher.principal, published, data).not_published == ()
        chain = reader.chain(reader.principal, [RequestSegment(doc, ScopeKind.PUBLIC),
                                                RequestSegment(list(range(9 * BT, 10 * BT)), "user")])
        lookup = reader.lookup(reader.principal, chain)
        assert lookup.length == 4, "4 public blocks >= the minimum: the lookup finds them"
        walks = daemon.store.requests.walks
        blocks = reader.load_found(reader.principal, lookup)
        assert daemon.store.requests.walks == walks, "loaded from the lookup's runs"
        assert [b.key for b in blocks] == [c.key for c in published]
        assert all(torch.equal(b.data, d) for b, d in zip(blocks, data, strict=True))
        # Control: per key, every public block is hidden under the rule (a key alone does not say
        # how long a prefix it ends), which is what turned these loads into recomputes.
        hidden = counted(daemon, "public_key_get_hidden")
        assert reader.client.get([c.key for c in chain[:4]]) == [None] * 4
        assert counted(daemon, "public_key_get_hidden") - hidden == 4
        # And a short public prefix stays hidden on the new path too: the rule still holds.
        short = reader.chain(reader.principal, [RequestSegment(doc[: 2 * BT], ScopeKind.PUBLIC)])
        assert reader.lookup(reader.principal, short).length == 0
    finally:
        publisher.close()
        reader.close()
