"""The KvCache gRPC service: the daemon's store and policy behind the wire protocol.

Access rule (the same Policy the in-process KVCache uses): a key's scope domain is its first 16
bytes; the caller's usable domains come from its verified principal (``Policy.readable_domains``).
- Lookup stops the prefix at the first key whose domain the caller may not read, or whose scope
  is being purged; the answer never depends on whether such a key is stored.
- Get, Delete and ListScope refuse the whole call (PERMISSION_DENIED) if any key or domain is not
  the caller's, before any tier is touched.
- Put refuses (PERMISSION_DENIED) a block in a domain the caller cannot read; a block in a shared
  scope (public/org) the caller may read but not publish is not stored and is listed as rejected,
  as KVCache.save does.
- Stats shows per-tier totals to everyone (no tenant can be told apart in them) and per-domain
  usage for the caller's own domains only (operators: all, as opaque ids).
Put commits whole, verified blocks in batches as they arrive: a stream that fails part-way may
leave earlier blocks stored (each whole), never a partial block.
Timing mitigations (``TimingGuard``, KVCache's own rules): Lookup and Get are refused while the
caller is over its missed-read budget (decided before any tier is touched) and count a miss when
they come back short; Lookup and prefix Gets apply the minimum public-prefix rule. A per-key Get
cannot (a key alone does not say how long a public prefix it ends), so while that rule is on it
answers public keys as misses without touching a tier.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import grpc
import torch

from kvtier.block import Block, BlockMeta
from kvtier.errors import AccessDenied, InvalidRequest
from kvtier.keys import BlockKey, Scope, ScopeDomain, ScopeKind, key_domain
from kvtier.layout import DTYPES
from kvtier.rpc import kvtier_pb2 as pb
from kvtier.rpc import kvtier_pb2_grpc as pb_grpc
from kvtier.rpc.wire import (
    BlockAssembler,
    ChunkFrame,
    FrameSource,
    WireFrame,
    check_domain,
    check_keys,
    decode_frame,
    encode_frame,
    pack_items,
)
from kvtier.security.policy import ROLE_ADMIN, ROLE_OPERATOR, Op, Policy, Principal
from kvtier.security.timing import TimingGuard, TimingMitigations
from kvtier.server.auth import Call
from kvtier.server.limits import ByteBudget, ConcurrencyLimit
from kvtier.server.observability import ServerMetrics
from kvtier.store.lookup import Lookup, TierRun
from kvtier.store.tier import Tier
from kvtier.store.tiered_store import TieredStore

log = logging.getLogger("kvtier.server")

@dataclass(slots=True, frozen=True)
class PurgeOutcome:
    domain: ScopeDomain
    removed: dict[str, int]
    keys_destroyed: int


PurgeFn = Callable[[Principal, str, str], PurgeOutcome]
"""``(actor, scope, reason) -> outcome``: a policy-checked purge of every tier plus the scope's data keys."""


@dataclass(slots=True, frozen=True)
class ServiceLimits:
    chunk_bytes: int
    #: Keys accepted in one request (Lookup/Get/Delete).
    max_keys: int = 65536
    #: Blocks read from the store per step of a Get stream (bounds a stream's read-ahead).
    get_batch_blocks: int = 8
    #: Completed blocks of a Put buffered before they are committed to the store together.
    put_batch_bytes: int = 16 << 20


@dataclass(slots=True, frozen=True)
class ServiceParts:
    """What the service is built from (one parameter object instead of a long argument list)."""

    store: TieredStore
    policy: Policy
    local_tiers: Sequence[Tier]
    purge: PurgeFn
    budget: ByteBudget
    concurrency: ConcurrencyLimit
    metrics: ServerMetrics
    limits: ServiceLimits
    mitigations: TimingMitigations = field(default_factory=TimingMitigations)


class RevokeRule(ABC):
    """Who may revoke what: one small strategy per target kind (registry ``REVOKE_RULES``).
    By default only operators may; the policy records every change in its audit log."""

    def allowed(self, actor: Principal, target: str) -> bool:
        return ROLE_OPERATOR in actor.roles

    @abstractmethod
    def apply(self, policy: Policy, target: str, *, lift: bool, actor: str, reason: str) -> None: ...


class RevokePrincipal(RevokeRule):
    """Operators anywhere; tenant admins within their own tenant."""

    def allowed(self, actor: Principal, target: str) -> bool:
        tenant = target.partition("/")[0]
        return ROLE_OPERATOR in actor.roles or (ROLE_ADMIN in actor.roles and tenant == actor.tenant)

    def apply(self, policy: Policy, target: str, *, lift: bool, actor: str, reason: str) -> None:
        (policy.grant if lift else policy.revoke)(target, actor=actor, reason=reason)


class RevokeTenant(RevokeRule):
    def apply(self, policy: Policy, target: str, *, lift: bool, actor: str, reason: str) -> None:
        (policy.grant_tenant if lift else policy.revoke_tenant)(target, actor=actor, reason=reason)


class RevokeCredential(RevokeRule):
    def apply(self, policy: Policy, target: str, *, lift: bool, actor: str, reason: str) -> None:
        if lift:
            raise InvalidRequest("a revoked credential stays revoked: mint a new token instead")
        policy.revoke_credential(target, actor=actor, reason=reason)


REVOKE_RULES: dict[int, RevokeRule] = {
    pb.REVOKE_KIND_PRINCIPAL: RevokePrincipal(),
    pb.REVOKE_KIND_TENANT: RevokeTenant(),
    pb.REVOKE_KIND_CREDENTIAL: RevokeCredential(),
}


class KvCacheService(pb_grpc.KvCacheServicer):
    """Serves one TieredStore to many authenticated clients.

    Invariants: every method receives a Call (principal already verified by CallGate); no tier is
    touched for a key outside the caller's domains; a Get stream pins every block it will send
    until the stream ends (however it ends), and every payload byte it or a Put buffers is held
    on the call's lease. The service keeps no per-client state between calls.
    When the fastest tier is a FrameSource, Get sends its blocks as the frames it holds (no copy,
    no hash per call); blocks from the other tiers are read, promoted and encoded as before.
    """

    def __init__(self, parts: ServiceParts) -> None:
        self.parts = parts
        self.store = parts.store
        self.policy = parts.policy
        self.limits = parts.limits
        self._local = list(parts.local_tiers)
        self._local_names = {t.name for t in self._local}
        first = self.store.tiers[0]
        self._hot: FrameSource | None = first if isinstance(first, FrameSource) else None
        self.guard = TimingGuard(self.store, parts.mitigations, parts.metrics.mitigated)

    # -- access -----------------------------------------------------------------------------------
    def _domains(self, p: Principal) -> dict[ScopeDomain, Scope]:
        return self.policy.readable_domains(p)

    def _require_readable(self, p: Principal, keys: Sequence[BlockKey]) -> None:
        readable = self._domains(p)
        for i, k in enumerate(keys):
            if key_domain(k) not in readable:
                raise AccessDenied(f"keys[{i}] is in a scope principal {p.id} cannot read")

    def _scope_for_delete(self, p: Principal, domain: ScopeDomain) -> Scope:
        scope = self._domains(p).get(domain)
        if scope is None or not self.policy.may_delete(p, scope):
            raise AccessDenied(f"delete in this scope refused for principal {p.id}")
        return scope

    def _usable(self, keys: Sequence[BlockKey], readable: dict[ScopeDomain, Scope]) -> int:
        """Leading keys the caller may read and that are not under purge."""
        fence = self.store.fence
        for i, k in enumerate(keys):
            dom = key_domain(k)
            if dom not in readable or fence.is_closed(dom):
                return i
        return len(keys)

    # -- lookup -----------------------------------------------------------------------------------
    def Lookup(self, request: pb.LookupRequest, call: Call) -> pb.LookupResponse:
        keys = check_keys(request.keys, self.limits.max_keys)
        self.guard.admit(call.principal)
        readable = self._domains(call.principal)
        n = self._usable(keys, readable)
        lk = self.guard.lookup(keys[:n], readable)
        self.guard.served(call.principal, lk.length, len(keys))
        runs = [pb.TierRun(tier=r.tier, level=r.level, start=r.start, count=r.count) for r in lk.runs]
        return pb.LookupResponse(length=lk.length, runs=runs, readable=n)

    # -- get --------------------------------------------------------------------------------------
    def Get(self, request: pb.GetRequest, call: Call) -> Iterator[pb.BlockChunk]:
        keys = check_keys(request.keys, self.limits.max_keys)
        self._require_readable(call.principal, keys)
        if request.mode not in (pb.GET_MODE_EACH, pb.GET_MODE_PREFIX):
            raise InvalidRequest(f"unknown get mode {request.mode}")
        self.guard.admit(call.principal)
        sent = [0]  # blocks streamed; a stream that ends early (however) counts as a miss
        try:
            if request.mode == pb.GET_MODE_EACH:
                yield from self._get_each(keys, call, sent)
            else:
                yield from self._get_prefix(keys, call, sent)
        finally:
            self.guard.served(call.principal, sent[0], len(keys))

    def _get_prefix(self, keys: list[BlockKey], call: Call, sent: list[int]) -> Iterator[ChunkFrame | bytes]:
        readable = self._domains(call.principal)
        n = self._usable(keys, readable)
        lk = self.guard.lookup(keys[:n], readable)
        want = keys[: lk.length]
        step = self.limits.get_batch_blocks
        # Pinned for the whole stream: a block promised by this lookup is not evicted before it
        # is sent, however slowly the client reads.
        with self.store.pins.hold(want):
            for a in range(0, len(want), step):
                call.check_deadline()
                b = min(a + step, len(want))
                part = want[a:b]
                sl = _slice(lk, a, b)
                items: list[tuple[int, Block | WireFrame]] = []
                if self._hot is not None and sl.runs and sl.runs[0].level == 0 and sl.runs[0].start == 0:
                    for i, fr in enumerate(self._hot.frames(part[: sl.runs[0].count])):
                        if not _matches(fr, part[i]):
                            break
                        items.append((a + i, fr))
                k = len(items)
                if k < len(part):
                    rest = part[k:]
                    blocks = self.store.get(rest, domains=[key_domain(x) for x in rest], lookup=_slice(lk, a + k, b))
                    items += [(a + k + i, blk) for i, blk in enumerate(blocks)]
                yield from self._send(call, items)
                sent[0] += len(items)
                if len(items) < len(part):
                    return  # a block vanished or failed verification: the prefix ends here

    def _get_each(self, keys: list[BlockKey], call: Call, sent: list[int]) -> Iterator[ChunkFrame | bytes]:
        fence = self.store.fence
        step = self.limits.get_batch_blocks
        hidden = self._public_domains(call.principal) if self.guard.hides_public_keys() else frozenset()
        with self.store.pins.hold(keys):
            for a in range(0, len(keys), step):
                call.check_deadline()
                batch = list(enumerate(keys[a : a + step], a))
                if hidden and (n_hidden := sum(key_domain(k) in hidden for _, k in batch)):
                    self.parts.metrics.mitigated("public_key_get_hidden", n_hidden)
                part = [(i, k) for i, k in batch if key_domain(k) not in hidden and not fence.is_closed(key_domain(k))]
                items = self._read_each(part)
                yield from self._send(call, items)
                sent[0] += len(items)

    def _public_domains(self, p: Principal) -> frozenset[ScopeDomain]:
        return frozenset(d for d, scope in self._domains(p).items() if scope.kind == ScopeKind.PUBLIC)

    def _read_each(self, part: list[tuple[int, BlockKey]]) -> list[tuple[int, Block | WireFrame]]:
        """Each key from the fastest tier that has it; one batched get per tier for what is left."""
        found: dict[int, Block | WireFrame] = {}
        todo = part
        for tier in self.store.tiers:
            if not todo:
                break
            want = [k for _, k in todo]
            got = self._hot.frames(want) if tier is self._hot else tier.get(want)
            left = []
            for (pos, k), item in zip(todo, got, strict=True):
                if _matches(item, k):
                    found[pos] = item
                else:
                    if item is not None:
                        tier.metrics.error("wrong_block")
                    left.append((pos, k))
            todo = left
        return sorted(found.items())

    def _send(self, call: Call, items: list[tuple[int, Block | WireFrame]]) -> Iterator[ChunkFrame | bytes]:
        lease = call.lease
        total = sum(x.nbytes for _, x in items)
        lease.reserve(total)
        try:
            # A block's bytes stay reserved until the message that completes it has been handed on.
            for msg, done in pack_items(items, self.limits.chunk_bytes):
                yield msg
                lease.release(done)
                total -= done
        finally:
            lease.release(total)

    # -- put --------------------------------------------------------------------------------------
    def Put(self, requests: Iterator[pb.BlockChunk], call: Call) -> pb.PutResponse:
        p = call.principal
        readable = self._domains(p)
        writable: dict[ScopeDomain, bool] = {}
        lease = call.lease

        def allocate(_pos: int, meta: BlockMeta) -> torch.Tensor:
            dom = meta.domain
            if dom not in readable:
                raise AccessDenied(f"put into a scope principal {p.id} cannot use")
            if self.store.fence.is_closed(dom):
                raise AccessDenied(f"scope {readable[dom]} is being purged; writes are refused until it finishes")
            if dom not in writable:
                writable[dom] = self.policy.may_write(p, readable[dom])
            lease.reserve(meta.nbytes)
            return torch.empty(meta.shape, dtype=DTYPES[meta.dtype][0])

        asm = BlockAssembler(allocate)
        out = pb.PutResponse()
        batch: list[Block] = []
        batch_bytes = 0
        seen: set[BlockKey] = set()
        for _pos, blk in (done for msg in requests for done in asm.feed_message(msg)):
            if blk.key in seen:
                out.present.append(blk.key)
                lease.release(blk.nbytes)
                continue
            seen.add(blk.key)
            if not writable[blk.meta.domain]:
                out.rejected.append(blk.key)  # shared scope without the publish role: skipped, as in KVCache
                lease.release(blk.nbytes)
                continue
            batch.append(blk)
            batch_bytes += blk.nbytes
            if batch_bytes >= self.limits.put_batch_bytes:
                self._commit(batch, out, call)
                batch, batch_bytes = [], 0
        if asm.open:
            raise InvalidRequest(f"stream ended inside block {asm.open_position} (its last chunk never came)")
        self._commit(batch, out, call)
        return out

    def _commit(self, batch: list[Block], out: pb.PutResponse, call: Call) -> None:
        if not batch:
            return
        try:
            before = [self._held(b.key) for b in batch]
            new = [b for b, had in zip(batch, before, strict=True) if not had]
            if new:
                self.store.put(new)
            for b, had in zip(batch, before, strict=True):
                if had:
                    out.present.append(b.key)
                elif self._held(b.key):
                    out.stored.append(b.key)
                else:
                    out.rejected.append(b.key)
        finally:
            call.lease.release(sum(b.nbytes for b in batch))

    def _held(self, key: BlockKey) -> bool:
        """Whether a local tier holds ``key`` (the remote tier is written asynchronously)."""
        return any(t.contains([key]) for t in self._local)

    # -- delete / list / purge --------------------------------------------------------------------
    def Delete(self, request: pb.DeleteRequest, call: Call) -> pb.DeleteResponse:
        p = call.principal
        if request.keys and request.domain:
            raise InvalidRequest("delete takes keys or a domain, not both")
        if request.domain:
            domain = check_domain(request.domain)
            self._scope_for_delete(p, domain)
            held: set[BlockKey] = set()
            for t in self.store.tiers:
                held.update(t.keys_in_scope(domain))
            removed = self.store.delete_scope(domain)
        else:
            keys = list(dict.fromkeys(check_keys(request.keys, self.limits.max_keys)))
            for dom in {key_domain(k) for k in keys}:
                self._scope_for_delete(p, dom)
            held = {k for k in keys if any(t.contains([k]) for t in self.store.tiers)}
            removed = self.store.delete(keys)
        log.info("delete", extra={"event": "delete", "principal": p.id, "removed": removed})
        return pb.DeleteResponse(removed=removed, keys_removed=len(held))

    def ListScope(self, request: pb.ListScopeRequest, call: Call) -> pb.ListScopeResponse:
        domain = check_domain(request.domain)
        if domain not in self._domains(call.principal):
            raise AccessDenied(f"listing this scope refused for principal {call.principal.id}")
        keys: set[BlockKey] = set()
        for t in self.store.tiers:
            keys.update(t.keys_in_scope(domain))
        return pb.ListScopeResponse(keys=sorted(keys))

    def Purge(self, request: pb.PurgeRequest, call: Call) -> pb.PurgeResponse:
        if not request.scope:
            raise InvalidRequest("purge needs a scope: public, org, user, session or a full scope name")
        res = self.parts.purge(call.principal, request.scope, request.reason)
        kind = request.scope.split(":", 1)[0]  # the kind only: a full scope names a tenant and user
        log.info("purge", extra={"event": "purge", "principal": call.principal.id, "scope_kind": kind,
                                 "reason": request.reason, "removed": res.removed,
                                 "keys_destroyed": res.keys_destroyed})
        return pb.PurgeResponse(removed=res.removed, data_keys_destroyed=res.keys_destroyed, domain=res.domain)

    def Revoke(self, request: pb.RevokeRequest, call: Call) -> pb.RevokeResponse:
        rule = REVOKE_RULES.get(request.kind)
        if rule is None:
            raise InvalidRequest(f"unknown revoke kind {request.kind}")
        if not request.target:
            raise InvalidRequest("revoke needs a target")
        actor = call.principal
        if not rule.allowed(actor, request.target):
            raise AccessDenied(f"principal {actor.id} may not revoke {pb.RevokeKind.Name(request.kind)} targets")
        rule.apply(self.policy, request.target, lift=request.lift, actor=actor.id, reason=request.reason)
        log.info("revoke", extra={"event": "grant" if request.lift else "revoke", "principal": actor.id,
                                  "kind": pb.RevokeKind.Name(request.kind), "target": request.target})
        return pb.RevokeResponse()

    # -- stats / domains --------------------------------------------------------------------------
    def Stats(self, request: pb.StatsRequest, call: Call) -> pb.StatsResponse:
        p = call.principal
        every_domain = ROLE_OPERATOR in p.roles
        mine = self._domains(p)
        out = pb.StatsResponse()
        for t in self.store.tiers:
            snap = t.metrics.snapshot()
            ts = out.tiers.add(name=t.name, hits=snap["hits"], misses=snap["misses"], bytes_in=snap["bytes_in"],
                               bytes_out=snap["bytes_out"], puts=snap["puts"], evictions=snap["evictions"])
            ts.errors.update(snap["errors"])
            for op, h in snap["latency"].items():
                ts.latency[op].count = h["n"]
                ts.latency[op].sum_s = h["sum_s"]
            if t.name in self._local_names:
                u = t.usage()
                ts.usage_listed = True
                ts.blocks, ts.bytes, ts.capacity_bytes = u.blocks, u.bytes, u.capacity_bytes or 0
                for dom, n in u.by_domain.items():
                    if every_domain or dom in mine:
                        ts.domain_bytes[dom.hex()] = n
        srv = self.parts.metrics.snapshot()
        out.server.inflight_bytes = self.parts.budget.in_flight
        out.server.active_rpcs = self.parts.concurrency.active
        out.server.calls.update(srv["calls"])
        out.server.errors.update(srv["errors"])
        return out

    def Domains(self, request: pb.DomainsRequest, call: Call) -> pb.DomainsResponse:
        p = call.principal
        out = pb.DomainsResponse(principal=p.id)
        for dom, scope in self._domains(p).items():
            out.scopes.add(
                kind=ScopeKind(scope.kind).name.lower(), scope=str(scope), domain=dom,
                may_read=self.policy.decide(Op.READ, p, scope), may_write=self.policy.decide(Op.WRITE, p, scope),
                may_delete=self.policy.decide(Op.DELETE, p, scope),
            )
        return out


def _matches(item: Block | WireFrame | None, key: BlockKey) -> bool:
    """Whether a tier's answer for ``key`` is that block, in the key's own scope domain."""
    return item is not None and item.meta.key == key and item.meta.domain == key_domain(key)


def _slice(lk: Lookup, a: int, b: int) -> Lookup:
    """The runs of ``lk`` that cover chain positions [a, b), renumbered from 0."""
    runs = []
    for r in lk.runs:
        lo, hi = max(r.start, a), min(r.start + r.count, b)
        if lo < hi:
            runs.append(TierRun(r.level, r.tier, lo - a, hi - lo))
    return Lookup(tuple(runs), b - a)


SERVICE_NAME = pb.DESCRIPTOR.services_by_name["KvCache"].full_name


def service_handler(service: KvCacheService) -> grpc.GenericRpcHandler:
    """The service's method handlers: protobuf messages throughout, except that Get's responses
    and Put's requests go through the frame codec (payloads copied once, not three times)."""
    unary = grpc.unary_unary_rpc_method_handler
    methods = {
        "Lookup": unary(service.Lookup, pb.LookupRequest.FromString, pb.LookupResponse.SerializeToString),
        "Get": grpc.unary_stream_rpc_method_handler(service.Get, pb.GetRequest.FromString, encode_frame),
        "Put": grpc.stream_unary_rpc_method_handler(service.Put, decode_frame, pb.PutResponse.SerializeToString),
        "Delete": unary(service.Delete, pb.DeleteRequest.FromString, pb.DeleteResponse.SerializeToString),
        "ListScope": unary(service.ListScope, pb.ListScopeRequest.FromString,
                           pb.ListScopeResponse.SerializeToString),
        "Purge": unary(service.Purge, pb.PurgeRequest.FromString, pb.PurgeResponse.SerializeToString),
        "Revoke": unary(service.Revoke, pb.RevokeRequest.FromString, pb.RevokeResponse.SerializeToString),
        "Stats": unary(service.Stats, pb.StatsRequest.FromString, pb.StatsResponse.SerializeToString),
        "Domains": unary(service.Domains, pb.DomainsRequest.FromString, pb.DomainsResponse.SerializeToString),
    }
    missing = set(pb.DESCRIPTOR.services_by_name["KvCache"].methods_by_name) - set(methods)
    assert not missing, f"service_handler lacks {missing}"
    return grpc.method_handlers_generic_handler(SERVICE_NAME, methods)
