"""One gate: the in-process KVCache and the daemon answer every access question the same way.

The same matrix of principals x scopes x operations (lookup, load/Get, save/Put, delete, purge) is
driven through an in-process KVCache and through a running daemon (real gRPC, the principal from
a signed token). Both derive scope domains from the same server secret, so the same request names
the same keys on both sides. Every answer is reduced to what a caller can observe (a count of
blocks, "skipped", or the exception class) and the two tables must be identical, cell by cell.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks.localdeploy import LocalDeployment
from kvtier.cache.kv_cache import CacheOptions, KVCache
from kvtier.errors import KvtierError
from kvtier.keys import ChainBlock, DomainDeriver, Scope, Segment, block_chain
from kvtier.security.policy import ROLE_ADMIN, ROLE_OPERATOR, ROLE_PUBLISH_ORG, ROLE_PUBLISH_PUBLIC, Policy, Principal
from kvtier.server.daemon import Daemon
from kvtier.store.tiered_store import TieredStore
from storage_backends.grpc import GrpcTier, GrpcTierConfig
from storage_backends.memory import MemoryTier
from tests.helpers import SECRET, SMALL

BT = SMALL.block_tokens
PRINCIPALS: dict[str, Principal] = {
    "alice": Principal("acme", "alice", org="eng", session="s1"),
    "carol": Principal("acme", "carol", org="eng"),
    "bob": Principal("globex", "bob", org="eng"),
    "curator": Principal("kvtier", "curator", roles=frozenset({ROLE_PUBLISH_PUBLIC})),
    "eng-lead": Principal("acme", "lead", org="eng", roles=frozenset({ROLE_PUBLISH_ORG})),
    "acme-admin": Principal("acme", "boss", roles=frozenset({ROLE_ADMIN})),
    "operator": Principal("kvtier", "ops", roles=frozenset({ROLE_OPERATOR})),
    "revoked": Principal("acme", "mallory", org="eng"),
}
SCOPES: dict[str, Scope] = {
    "public": Scope.public(),
    "org": Scope.parse("org:acme/eng"),
    "alice": Scope.parse("user:acme/alice"),
    "alice-session": Scope.parse("session:acme/alice/s1"),
    "bob": Scope.parse("user:globex/bob"),
}
#: Who writes the seeded content of each scope (a principal allowed to).
SEEDERS = {"public": "curator", "org": "eng-lead", "alice": "alice", "alice-session": "alice", "bob": "bob"}


def chain(scope: Scope, salt: int, deriver: DomainDeriver) -> list[ChainBlock]:
    """A shared public prefix of 2 blocks, then 2 blocks in ``scope`` (made unique by ``salt``)."""
    doc = list(range(1000, 1000 + 2 * BT))
    own = list(range(100_000 * (salt + 1), 100_000 * (salt + 1) + 2 * BT))
    return block_chain(SMALL, [Segment(doc, Scope.public()), Segment(own, scope)], deriver)


def tensors(n: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(SMALL.block_shape, generator=gen).to(SMALL.torch_dtype) for _ in range(n)]


def outcome(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except KvtierError as exc:
        return type(exc).__name__


class Front:
    """One way in: the operations of the matrix, answered as a caller can observe them."""

    def lookup(self, who: str, ch: list[ChainBlock]) -> Any: ...
    def load(self, who: str, ch: list[ChainBlock]) -> Any: ...
    def save(self, who: str, ch: list[ChainBlock], data: list[torch.Tensor]) -> Any: ...
    def delete(self, who: str, ch: list[ChainBlock]) -> Any: ...
    def purge(self, who: str, scope: Scope) -> Any: ...
    def revoke(self, who: str) -> None: ...


class InProcess(Front):
    def __init__(self, root: Path) -> None:
        self.store = TieredStore([MemoryTier(256 * SMALL.bytes_per_block)])
        self.policy = Policy(DomainDeriver(SECRET))
        self.cache = KVCache(self.store, SMALL, self.policy, CacheOptions(journal_dir=root / "journal"))

    def lookup(self, who, ch):
        return self.cache.lookup(PRINCIPALS[who], ch).length

    def load(self, who, ch):
        return len(self.cache.load(PRINCIPALS[who], ch))

    def save(self, who, ch, data):
        rep = self.cache.save(PRINCIPALS[who], ch, data)
        return "skipped" if rep.not_published else sum(rep.stored.values())

    def delete(self, who, ch):
        self.cache.delete(PRINCIPALS[who], ch)
        return "ok"

    def purge(self, who, scope):
        self.cache.purge(PRINCIPALS[who], str(scope))
        return "ok"

    def revoke(self, who):
        self.policy.revoke(PRINCIPALS[who].id)

    def close(self) -> None:
        self.store.close()


class ThroughDaemon(Front):
    def __init__(self, root: Path) -> None:
        self.dep = LocalDeployment(root / "dep", server_secret=SECRET)
        # The curator is the deployment's trusted publisher (the default trusts operators only).
        self.dep.write_config(memory_bytes=256 * SMALL.bytes_per_block,
                              security={"public_publishers": "kvtier/curator"})
        self.daemon = Daemon(self.dep.config()).start()
        self.tiers: dict[str, GrpcTier] = {}

    def tier(self, who: str) -> GrpcTier:
        if who not in self.tiers:
            p = PRINCIPALS[who]
            extra = {k: v for k, v in (("org", p.org), ("session", p.session)) if v is not None}
            token = self.dep.token(p.tenant, p.user, roles=tuple(p.roles), **extra)
            self.tiers[who] = GrpcTier(GrpcTierConfig(self.daemon.address, token, max_attempts=1))
        return self.tiers[who]

    def lookup(self, who, ch):
        return self.tier(who).lookup([c.key for c in ch]).length

    def load(self, who, ch):
        return len(self.tier(who).get_prefix([c.key for c in ch]))

    def save(self, who, ch, data):
        from kvtier.block import Block

        blocks = [Block.build(SMALL, c.key, c.domain, t, parent=c.parent, index=c.index)
                  for c, t in zip(ch, data, strict=True)]
        res = self.tier(who).put(blocks)
        return "skipped" if res.rejected else len(res.stored)

    def delete(self, who, ch):
        self.tier(who).delete([c.key for c in ch])
        return "ok"

    def purge(self, who, scope):
        self.tier(who).purge(str(scope))
        return "ok"

    def revoke(self, who):
        self.tier("operator").revoke("principal", PRINCIPALS[who].id)

    def close(self) -> None:
        for t in self.tiers.values():
            t.close()
        self.daemon.stop(grace_s=0)


@pytest.fixture
def fronts(tmp_path: Path) -> Iterator[tuple[InProcess, ThroughDaemon]]:
    a, b = InProcess(tmp_path / "a"), ThroughDaemon(tmp_path / "b")
    yield a, b
    a.close()
    b.close()


def drive(front: Front) -> dict[tuple[str, str, str], Any]:
    deriver = DomainDeriver(SECRET)
    table: dict[tuple[str, str, str], Any] = {}
    front.revoke("revoked")
    seeded = {}
    for i, (name, scope) in enumerate(SCOPES.items()):
        seeded[name] = chain(scope, i, deriver)
        # The public prefix (blocks 0-1) is published by the curator; the rest by the scope's owner.
        assert outcome(lambda c=seeded[name]: front.save("curator", c[:2], tensors(2, 0))) in (0, 2)
        assert outcome(lambda c=seeded[name], n=name: front.save(SEEDERS[n], c, tensors(4, 0))) in (2, 4, "skipped")
    for j, who in enumerate(PRINCIPALS):
        for i, (name, scope) in enumerate(SCOPES.items()):
            ch = seeded[name]
            table[(who, name, "lookup")] = outcome(lambda w=who, c=ch: front.lookup(w, c))
            table[(who, name, "load")] = outcome(lambda w=who, c=ch: front.load(w, c))
            fresh = chain(scope, 100 + 10 * j + i, deriver)
            table[(who, name, "save")] = outcome(lambda w=who, c=fresh, s=j: front.save(w, c[2:], tensors(2, s)))
            table[(who, name, "delete")] = outcome(lambda w=who, c=fresh: front.delete(w, c[2:]))
    for who in PRINCIPALS:
        for name, scope in SCOPES.items():
            table[(who, name, "purge")] = outcome(lambda w=who, s=scope: front.purge(w, s))
    return table


def test_kvcache_and_daemon_give_identical_answers(fronts) -> None:
    in_process, daemon = fronts
    a, b = drive(in_process), drive(daemon)
    diff = {k: (a[k], b[k]) for k in a if a[k] != b[k]}
    assert not diff, "in-process vs daemon:\n" + "\n".join(f"{k}: {v}" for k, v in sorted(diff.items()))
    # The matrix is not trivial: it holds hits, partial hits, skips and refusals.
    assert a[("alice", "alice", "load")] == 4 and a[("bob", "alice", "lookup")] == 2
    assert a[("bob", "alice", "load")] == "AccessDenied" and a[("bob", "public", "save")] == "skipped"
    assert a[("curator", "public", "save")] == 2 and a[("revoked", "public", "lookup")] == "AccessDenied"
    assert a[("acme-admin", "alice", "purge")] == "ok" and a[("acme-admin", "bob", "purge")] == "AccessDenied"
    assert a[("alice", "org", "save")] == "skipped" and a[("eng-lead", "org", "save")] == 2
