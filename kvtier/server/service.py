"""The KvCache gRPC service: the daemon's store behind the wire protocol.

Every access decision is made by the one ``AccessGate`` (kvtier/security/gate.py) that the
in-process KVCache uses too; this module only translates between the wire, the gate and the
store, and every read goes through the store (verification, promotion, metrics):
- Lookup: ``gate.lookup``; the prefix stops at the first key the caller may not read or whose
  scope is being purged, and the answer never depends on whether such a key is stored. The
  answer carries the gate's ticket (``gate.seal``), so the caller can hand it back to a Get.
- Get: ``gate.require_readable`` refuses the whole call (PERMISSION_DENIED) if any key is not
  the caller's, before any tier is touched. Prefix mode: ``gate.lookup`` then ``store.load`` of
  that lookup. Per-key mode: ``gate.each`` says which keys may be served, ``store.get_each``
  reads them (promoting hits from lower tiers, as a prefix read does). Both modes ask
  ``gate.require_still_active`` before every message, and the RegionWriter asks it before every
  copy into the caller's region (each group of layers of a layered Get), so a revocation ends an
  open stream.
  Found mode (a Lookup's answer handed back): ``gate.handed_back`` re-checks it (ticket,
  revocation, purges) and ``store.load`` reads exactly its runs, with no second walk; a stale
  ticket makes it a prefix read. One tier walk per request, lookup included.
- Put: ``gate.writable`` per block as it arrives (refused: another's scope, a private scope the
  caller may not write, a scope under purge); a shared scope the caller may read but not publish
  is skipped and listed as rejected. The store's per-key report says stored/present/rejected,
  except that ``gate.reveals_presence`` turns present into stored while the timing mitigations
  are on.
- Delete, ListScope, Purge and Stats: ``gate.require_delete``, ``require_list`` (the public
  scope needs the publish role under the mitigations), the purge function (KVCache.purge:
  ``gate.require_purge``) and ``gate.visible_domains`` / ``gate.sees_totals`` (tier-wide totals
  for operators only). Revoke: ``change_revocation`` (kvtier/security/revoke_rules.py: who may
  revoke, and lift, what).
- Locate: the Locator (kvtier/server/locate.py) answers for the request's end principal through
  ``gate.lookup``; it reads no block.
- WatchHeld / HeldChanges: the daemon's HeldWatch (kvtier/cache/held_watch.py): an engine follows
  the blocks it reports in its KV-event stream, each for the principal it acts for (keys that
  principal may read), and polls, saltless, what changed for its credential's own streams.
- Every method: ``gate.require_method`` first (``service_handler``), for the token's principal and
  the one it acts for: a ``router`` credential calls Locate and nothing else.
Put commits whole, verified blocks in batches as they arrive: a stream that fails part-way may
leave earlier blocks stored (each whole), never a partial block.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import torch

from kvtier.block import Block, BlockMeta
from kvtier.cache.held_watch import HeldWatch
from kvtier.cache.purge import PurgeReport
from kvtier.dataplane.region import SharedRegion
from kvtier.dataplane.region_table import RegionTable
from kvtier.dataplane.region_writer import Placement, RegionWriter
from kvtier.errors import ConfigError, InvalidRequest
from kvtier.keys import BlockKey, Scope, ScopeDomain, ScopeKind, key_domain
from kvtier.layout import DTYPES
from kvtier.rpc import kvtier_pb2 as pb
from kvtier.rpc import kvtier_pb2_grpc as pb_grpc
from kvtier.rpc.block_assembler import BlockAssembler
from kvtier.rpc.framed_block import FramedBlock, frame_from_region
from kvtier.rpc.names import DURABLE_METADATA, REGION_METADATA, SERVICE_NAME
from kvtier.rpc.wire import (
    ChunkFrame,
    FrameSource,
    check_domain,
    check_keys,
    decode_frame,
    encode_frame,
    pack_items,
)
from kvtier.security.audit import check_sizes
from kvtier.security.gate import AccessGate
from kvtier.security.policy import Op, Principal
from kvtier.security.revoke_rules import RevokeKind, change_revocation
from kvtier.server.auth import Call
from kvtier.server.limits import ByteBudget, ConcurrencyLimit
from kvtier.server.locate import Locator
from kvtier.server.locate_wire import located_to_msg, query_from_msg
from kvtier.server.observability import ServerMetrics
from kvtier.store.lookup import Lookup, TierRun
from kvtier.store.miss_budget import MissBudget
from kvtier.store.tiered_store import PutOutcome, Readable, TieredStore

log = logging.getLogger("kvtier.server")


PurgeFn = Callable[[Principal, str, str], PurgeReport]
"""``(actor, scope, reason) -> outcome``: a policy-checked purge of every tier plus the scope's data keys."""


@dataclass(slots=True, frozen=True)
class ServiceLimits:
    chunk_bytes: int
    #: Keys accepted in one request (Lookup/Get/Delete).
    max_keys: int = 65536
    #: Blocks read from the store per step of a Get stream (bounds a stream's read-ahead).
    get_batch_blocks: int = 8
    #: Keys one per-key Get may find absent in the shared tiers (S3) before it stops asking them.
    max_remote_misses: int = 64
    #: Completed blocks of a Put buffered before they are committed to the store together.
    put_batch_bytes: int = 16 << 20


@dataclass(slots=True, frozen=True)
class ServiceParts:
    """What the service is built from (one parameter object instead of a long argument list)."""

    store: TieredStore
    #: The access gate of the daemon's KVCache (``cache.gate``): the one set of access rules.
    gate: AccessGate
    purge: PurgeFn
    budget: ByteBudget
    concurrency: ConcurrencyLimit
    metrics: ServerMetrics
    limits: ServiceLimits
    #: Shared-memory regions attached through the data-plane socket (None: no data plane).
    regions: RegionTable | None = None
    #: Where clients attach regions: ``DataPlane``'s answer (an empty socket: none offered).
    data_plane: Callable[[], pb.DataPlaneResponse] = pb.DataPlaneResponse
    #: Answers Locate (None: the daemon's config has no [locate] section).
    locator: Locator | None = None
    #: Answers WatchHeld / HeldChanges (None: one over ``store`` and the gate's policy).
    held: HeldWatch | None = None


#: The wire's revoke kinds, as the revoke rules (kvtier/security/revoke_rules.py) name them.
REVOKE_KINDS: dict[int, RevokeKind] = {
    pb.REVOKE_KIND_PRINCIPAL: RevokeKind.PRINCIPAL,
    pb.REVOKE_KIND_TENANT: RevokeKind.TENANT,
    pb.REVOKE_KIND_CREDENTIAL: RevokeKind.CREDENTIAL,
}


class KvCacheService(pb_grpc.KvCacheServicer):
    """Serves one TieredStore to many authenticated clients.

    Invariants: every method receives a Call (principal already verified by CallGate) and asks
    the gate before touching a tier; a Get stream pins every block it will send until the stream
    ends (however it ends), and every payload byte it or a Put buffers is held on the call's
    lease. The service keeps no per-client state between calls. When the fastest tier is a
    FrameSource, the store reads it as frames (no copy, no hash per call); blocks from the other
    tiers are verified, promoted and encoded.
    """

    def __init__(self, parts: ServiceParts) -> None:
        self.parts = parts
        self.store = parts.store
        self.gate = parts.gate
        self.policy = parts.gate.policy
        self.limits = parts.limits
        first = self.store.tiers[0]
        self._frames = first.frames if isinstance(first, FrameSource) else None
        self.held = parts.held if parts.held is not None else HeldWatch(self.store, self.policy)

    # -- lookup -----------------------------------------------------------------------------------
    def Lookup(self, request: pb.LookupRequest, call: Call) -> pb.LookupResponse:
        keys = check_keys(request.keys, self.limits.max_keys)
        gl = self.gate.lookup(call.principal, keys)
        sealed = self.gate.seal(call.principal, gl.lookup)
        return pb.LookupResponse(length=sealed.length, runs=runs_to_msg(sealed.runs), readable=gl.readable,
                                 ticket=sealed.ticket)

    # -- get --------------------------------------------------------------------------------------
    def Get(self, request: pb.GetRequest, call: Call) -> Iterator[pb.BlockChunk]:
        keys = check_keys(request.keys, self.limits.max_keys)
        p = call.principal
        self.gate.require_readable(p, keys)
        if request.mode not in (pb.GET_MODE_EACH, pb.GET_MODE_PREFIX, pb.GET_MODE_FOUND):
            raise InvalidRequest(f"unknown get mode {request.mode}")
        found = self._found(request, keys) if request.mode == pb.GET_MODE_FOUND else None
        placement = None
        if request.block_offsets or request.layer_stride:
            if len(request.block_offsets) != len(keys):
                raise InvalidRequest(f"{len(request.block_offsets)} block_offsets for {len(keys)} keys")
            placement = Placement(tuple(request.block_offsets), request.layer_stride)
        sent = [0]  # blocks streamed; a stream that ends early (however) counts as a miss
        with self._region(call) as region:
            # Without a region there is nothing to lay out: region_layers then changes nothing. The
            # writer asks the gate before each copy into the region (a revocation stops it there).
            out = None if region is None else RegionWriter(region, request.region_offset, request.region_bytes,
                                                           request.region_layers, placement,
                                                           still_active=lambda: self.gate.require_still_active(p))
            try:
                if request.mode == pb.GET_MODE_EACH:
                    self.gate.admit(p)
                    yield from self._get_each(keys, call, sent, out)
                elif found is not None:
                    yield from self._get_lookup(self._recheck_found(p, found, request.found_start, len(keys)),
                                                call, sent, out)
                else:
                    yield from self._get_lookup(self.gate.lookup(p, keys, then_read=True).lookup, call, sent, out)
            finally:
                self.gate.served(p, sent[0], len(keys))

    def _found(self, request: pb.GetRequest, keys: list[BlockKey]) -> Lookup:
        """The Lookup a found-mode Get hands back, checked for shape (keys within its prefix)."""
        found_keys = check_keys(request.found_keys, self.limits.max_keys)
        runs = tuple(TierRun(r.level, r.tier, r.start, r.count) for r in request.found_runs)
        lk = Lookup(runs, len(found_keys), tuple(found_keys), bytes(request.ticket))
        at = request.found_start
        pos = 0
        for r in runs:
            if r.start != pos or r.count == 0 or r.level >= len(self.store.tiers) \
                    or self.store.tiers[r.level].name != r.tier:
                raise InvalidRequest("found_runs: not the runs of a lookup of this daemon")
            pos += r.count
        if pos != len(found_keys) or list(found_keys[at : at + len(keys)]) != keys:
            raise InvalidRequest("found mode: keys must be found_keys[found_start:...] of a whole lookup")
        return lk

    def _recheck_found(self, p: Principal, found: Lookup, at: int, n: int) -> Lookup:
        """What a handed-back lookup still holds for keys ``[at, at + n)``: its runs when its
        ticket is good (no walk), else a fresh lookup of the chain up to there (one walk)."""
        checked = self.gate.handed_back(p, found)
        if checked is None:
            checked = self.gate.lookup(p, list(found.keys[: at + n]), then_read=True).lookup
        return checked.slice(at, at + n)

    def _get_lookup(
        self, lk: Lookup, call: Call, sent: list[int], out: RegionWriter | None
    ) -> Iterator[ChunkFrame | pb.BlockChunk | bytes]:
        """Stream what ``lk`` found (a prefix read's own lookup, or one handed back)."""
        keys = lk.keys
        step = self._batch(out, len(keys))
        # Pinned for the whole stream: a block promised by this lookup is not evicted before it
        # is sent, however slowly the client reads.
        with self.store.pins.hold(list(lk.keys)):
            for a in range(0, lk.length, step):
                call.check_deadline()
                b = min(a + step, lk.length)
                got = self.store.load(lk.slice(a, b), first=self._frames)
                yield from self._send(call, [(a + i, x) for i, x in enumerate(got)], out)
                sent[0] += len(got)
                if len(got) < b - a:
                    break  # a block vanished or failed verification: the prefix ends here
            if out is not None:  # while the blocks are pinned: a Get laid out by layers copies them now
                yield from out.drain()

    def _get_each(
        self, keys: list[BlockKey], call: Call, sent: list[int], out: RegionWriter | None
    ) -> Iterator[ChunkFrame | pb.BlockChunk | bytes]:
        step = self._batch(out, len(keys))
        may = self.gate.each(call.principal, keys)
        misses = MissBudget(self.limits.max_remote_misses)  # the whole call's, through every batch
        with self.store.pins.hold(keys):
            for a in range(0, len(keys), step):
                call.check_deadline()
                pos = [i for i in range(a, min(a + step, len(keys))) if may[i]]
                got = self.store.get_each([keys[i] for i in pos], first=self._frames, misses=misses)
                items = [(i, x) for i, x in zip(pos, got, strict=True) if x is not None]
                yield from self._send(call, items, out)
                sent[0] += len(items)
            if out is not None:  # while the blocks are pinned: a Get laid out by layers copies them now
                yield from out.drain()

    def _batch(self, out: RegionWriter | None, n: int) -> int:
        """Blocks read per step of a Get stream: ``get_batch_blocks``, or all of them when the
        region keeps every block anyway (laid out by layers)."""
        return max(n, 1) if out is not None and out.keeps_all else self.limits.get_batch_blocks

    def _send(
        self, call: Call, items: Sequence[tuple[int, Readable]], out: RegionWriter | None = None
    ) -> Iterator[ChunkFrame | pb.BlockChunk | bytes]:
        """Stream ``items`` in order: into the call's region while they fit (described a message
        per few MiB, the last by ``drain``), each one that does not fit inline."""
        if out is None:
            yield from self._send_inline(call, items)
            return
        # The gate is asked before any byte lands where the client can read it.
        self.gate.require_still_active(call.principal)
        for pos, item in items:
            if out.place(pos, item):
                if out.full:
                    yield from out.take()
                continue
            yield from out.take()  # order: what was placed before goes first
            yield from self._send_inline(call, [(pos, item)])

    def _send_inline(self, call: Call, items: Sequence[tuple[int, Readable]]) -> Iterator[ChunkFrame | bytes]:
        # A block framed when it was read (a disk hit) is sent as its frame: no copy, no hash.
        items = [(pos, x.frame if isinstance(x, FramedBlock) else x) for pos, x in items]
        lease = call.lease
        total = sum(x.nbytes for _, x in items)
        lease.reserve(total)
        try:
            # A block's bytes stay reserved until the message that completes it has been handed on.
            for msg, done in pack_items(items, self.limits.chunk_bytes):
                # Every message re-asks the gate: a stream opened before a revocation ends here.
                self.gate.require_still_active(call.principal)
                yield msg
                lease.release(done)
                total -= done
        finally:
            lease.release(total)

    @contextmanager
    def _region(self, call: Call) -> Iterator[SharedRegion | None]:
        """The shared-memory region the call names (metadata ``kvtier-region``), if any."""
        handle = next((v for k, v in call.context.invocation_metadata() or () if k == REGION_METADATA), None)
        if handle is None:
            yield None
            return
        if self.parts.regions is None:
            raise InvalidRequest("this daemon offers no shared-memory data plane")
        assert call.credential is not None
        with self.parts.regions.use(str(handle), call.credential) as region:
            yield region

    def DataPlane(self, request: pb.DataPlaneRequest, call: Call) -> pb.DataPlaneResponse:
        return self.parts.data_plane()

    # -- put --------------------------------------------------------------------------------------
    def Put(self, requests: Iterator[pb.BlockChunk], call: Call) -> pb.PutResponse:
        p = call.principal
        writable: dict[ScopeDomain, bool] = {}
        lease = call.lease

        def admit(meta: BlockMeta) -> None:
            # Asked per block, before its bytes are buffered: a purge that starts mid-stream
            # refuses the blocks after it.
            writable.update(self.gate.writable(p, [meta.domain]))
            lease.reserve(meta.nbytes)

        def allocate(_pos: int, meta: BlockMeta) -> torch.Tensor:
            admit(meta)
            return torch.empty(meta.shape, dtype=DTYPES[meta.dtype][0])

        def take(_pos: int, meta: BlockMeta, src: np.ndarray, checksum: int) -> Block:
            # A block in the region is copied once, into the frame the RAM tier will keep.
            admit(meta)
            return frame_from_region(meta, src, checksum)  # a bad checksum ends the call (its lease too)

        durable = any(k == DURABLE_METADATA and v == "1" for k, v in call.context.invocation_metadata() or ())
        with self._region(call) as region:
            asm = BlockAssembler(allocate, region=None if region is None else region.window, verify_region=True,
                                 take=take)
            return self._put_stream(requests, call, asm, writable, durable)

    def _put_stream(self, requests: Iterator[pb.BlockChunk], call: Call, asm: BlockAssembler,
                    writable: dict[ScopeDomain, bool], durable: bool) -> pb.PutResponse:
        lease = call.lease
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
                out.rejected.append(blk.key)  # shared scope without the publish role: skipped
                lease.release(blk.nbytes)
                continue
            batch.append(blk)
            batch_bytes += blk.nbytes
            if batch_bytes >= self.limits.put_batch_bytes:
                self._commit(batch, out, call, durable)
                batch, batch_bytes = [], 0
        if asm.open:
            raise InvalidRequest(f"stream ended inside block {asm.open_position} (its last chunk never came)")
        self._commit(batch, out, call, durable)
        return out

    def _commit(self, batch: list[Block], out: pb.PutResponse, call: Call, durable: bool) -> None:
        if not batch:
            return
        try:
            report = self.store.put(batch, durable=durable)
            present = sum(report.outcomes[b.key].outcome is PutOutcome.PRESENT for b in batch)
            # While the timing mitigations are on, "already present" is answered as "stored".
            reveal = self.gate.reveals_presence(call.principal, present)
            for b in batch:
                outcome = report.outcomes[b.key].outcome
                if outcome is PutOutcome.STORED or (outcome is PutOutcome.PRESENT and not reveal):
                    out.stored.append(b.key)
                elif outcome is PutOutcome.PRESENT:
                    out.present.append(b.key)
                else:  # no local tier took it, or its scope is being purged
                    out.rejected.append(b.key)
        finally:
            call.lease.release(sum(b.nbytes for b in batch))

    # -- delete / list / purge --------------------------------------------------------------------
    def Delete(self, request: pb.DeleteRequest, call: Call) -> pb.DeleteResponse:
        p = call.principal
        if request.keys and request.domain:
            raise InvalidRequest("delete takes keys or a domain, not both")
        if request.domain:
            domain = check_domain(request.domain)
            self.gate.require_delete(p, [domain])
            held = self.store.keys_in_scope(domain)
            removed = self.store.delete_scope(domain)
        else:
            keys = list(dict.fromkeys(check_keys(request.keys, self.limits.max_keys)))
            self.gate.require_delete(p, {key_domain(k) for k in keys})
            held = self.store.held(keys)  # one batched ask per tier (concurrent HEADs on S3), not one per key
            removed = self.store.delete(keys)
        log.info("delete", extra={"event": "delete", "principal": p.id, "removed": removed})
        return pb.DeleteResponse(removed=removed, keys_removed=len(held))

    def ListScope(self, request: pb.ListScopeRequest, call: Call) -> pb.ListScopeResponse:
        domain = check_domain(request.domain)
        self.gate.require_list(call.principal, domain)
        return pb.ListScopeResponse(keys=sorted(self.store.keys_in_scope(domain)))

    def Purge(self, request: pb.PurgeRequest, call: Call) -> pb.PurgeResponse:
        if not request.scope:
            raise InvalidRequest("purge needs a scope: public, org, user, session or a full scope name")
        check_sizes(target=request.scope, reason=request.reason)  # KVCache.purge checks too; before the log line
        res = self.parts.purge(call.principal, request.scope, request.reason)
        kind = request.scope.split(":", 1)[0]  # the kind only: a full scope names a tenant and user
        log.info("purge", extra={"event": "purge", "principal": call.principal.id, "scope_kind": kind,
                                 "reason": request.reason, "removed": res.removed,
                                 "keys_destroyed": res.keys_destroyed})
        return pb.PurgeResponse(removed=res.removed, data_keys_destroyed=res.keys_destroyed,
                                domain=bytes.fromhex(res.domain))

    def Revoke(self, request: pb.RevokeRequest, call: Call) -> pb.RevokeResponse:
        kind = REVOKE_KINDS.get(request.kind)
        if kind is None:
            raise InvalidRequest(f"unknown revoke kind {request.kind}")
        if not request.target:
            raise InvalidRequest("revoke needs a target")
        check_sizes(target=request.target, reason=request.reason)  # before anything (audited in full)
        actor = call.principal
        change_revocation(self.policy, kind, actor, request.target, lift=request.lift, reason=request.reason)
        log.info("revoke", extra={"event": "grant" if request.lift else "revoke", "principal": actor.id,
                                  "kind": pb.RevokeKind.Name(request.kind), "target": request.target})
        return pb.RevokeResponse()

    # -- stats / domains --------------------------------------------------------------------------
    def Stats(self, request: pb.StatsRequest, call: Call) -> pb.StatsResponse:
        visible = self.gate.visible_domains(call.principal)
        if not self.gate.sees_totals(call.principal):
            return self._own_stats(visible or {})
        out = pb.StatsResponse()
        usage = self.store.usage(remote=False)  # the remote tier's would be a listing of the whole bucket
        for t in self.store.tiers:
            snap = t.metrics.snapshot()
            ts = out.tiers.add(name=t.name, hits=snap["hits"], misses=snap["misses"], bytes_in=snap["bytes_in"],
                               bytes_out=snap["bytes_out"], puts=snap["puts"], evictions=snap["evictions"])
            ts.errors.update(snap["errors"])
            for op, h in snap["latency"].items():
                ts.latency[op].count = h["n"]
                ts.latency[op].sum_s = h["sum_s"]
            u = usage.get(t.name)
            if u is not None:
                ts.usage_listed = True
                ts.blocks, ts.bytes, ts.capacity_bytes = u.blocks, u.bytes, u.capacity_bytes or 0
                for dom, n in u.by_domain.items():
                    if visible is None or dom in visible:
                        ts.domain_bytes[dom.hex()] = n
        srv = self.parts.metrics.snapshot()
        out.server.inflight_bytes = self.parts.budget.in_flight
        out.server.active_rpcs = self.parts.concurrency.active
        out.server.calls.update(srv["calls"])
        out.server.errors.update(srv["errors"])
        if self.parts.regions is not None:
            out.server.data_plane_regions, out.server.data_plane_bytes = self.parts.regions.snapshot()
        return out

    def _own_stats(self, visible: dict[ScopeDomain, Scope]) -> pb.StatsResponse:
        """Stats for a non-operator: per local tier, only the bytes and blocks of its own readable
        scopes and the tier's capacity (configuration). No tier-wide totals, hit/miss or traffic
        counters, no server counters: those are everyone's usage together, and totals minus one's
        own usage would be the other tenants' usage."""
        out = pb.StatsResponse()
        usage = self.store.usage(remote=False, domains=visible)  # totals of the visible domains only
        for t in self.store.tiers:
            ts = out.tiers.add(name=t.name)
            u = usage.get(t.name)
            if u is None:
                continue
            ts.usage_listed = True
            ts.capacity_bytes = u.capacity_bytes or 0
            ts.blocks, ts.bytes = u.blocks, u.bytes
            for dom, n in u.by_domain.items():
                ts.domain_bytes[dom.hex()] = n
        out.server.SetInParent()
        return out

    # -- locate -----------------------------------------------------------------------------------
    def Locate(self, request: pb.LocateRequest, call: Call) -> pb.LocateResponse:
        """Where this node holds the request's prefix, and what serving it here would cost."""
        locator = self.parts.locator
        if locator is None:
            raise ConfigError("this daemon answers no Locate: its configuration has no [locate] section")
        query = query_from_msg(request, self.limits.max_keys)
        assert call.credential is not None  # CallGate sets it on every call
        return located_to_msg(locator.locate(call.credential, call.principal, query))

    # -- held (what an engine reports in its KV events) -------------------------------------------
    def WatchHeld(self, request: pb.WatchHeldRequest, call: Call) -> pb.WatchHeldResponse:
        keys = check_keys(request.keys, self.limits.max_keys)
        w = self.held.watch(_watcher(call), request.stream, call.principal, keys)
        return pb.WatchHeldResponse(instance=w.instance, tiers=[t or "" for t in w.tiers])

    def HeldChanges(self, request: pb.HeldChangesRequest, call: Call) -> pb.HeldChangesResponse:
        ch = self.held.changes(_watcher(call), request.stream, request.ack)
        return pb.HeldChangesResponse(instance=ch.instance, cursor=ch.cursor,
                                      changes=[pb.HeldChange(key=k, tier=t or "") for k, t in ch.changes])

    def Domains(self, request: pb.DomainsRequest, call: Call) -> pb.DomainsResponse:
        p = call.principal
        out = pb.DomainsResponse(principal=p.id)
        for dom, scope in self.gate.readable(p).items():
            out.scopes.add(
                kind=ScopeKind(scope.kind).name.lower(), scope=str(scope), domain=dom,
                may_read=self.policy.decide(Op.READ, p, scope), may_write=self.policy.decide(Op.WRITE, p, scope),
                may_delete=self.policy.decide(Op.DELETE, p, scope),
            )
        return out




def _allowed(gate: AccessGate, name: str, method: Callable[..., Any], *, streams: bool) -> Callable[..., Any]:
    """``method`` behind ``gate.require_method`` for the token's principal and the one it acts for,
    asked before the method runs (a streaming method: before its first message)."""

    def check(call: Call) -> None:
        gate.require_method(call.principal, name)
        if call.credential is not None:
            gate.require_method(call.credential, name)

    if streams:
        def stream(request: Any, call: Call) -> Iterator[Any]:
            check(call)
            yield from method(request, call)

        return stream

    def once(request: Any, call: Call) -> Any:
        check(call)
        return method(request, call)

    return once


def _watcher(call: Call) -> str:
    """Whose watch streams a call reaches: its credential's (an engine's, whoever it acts for)."""
    c = call.credential if call.credential is not None else call.principal
    return f"{c.id}#{c.credential_id or ''}"


def runs_to_msg(runs: Sequence[TierRun]) -> list[pb.TierRun]:
    return [pb.TierRun(tier=r.tier, level=r.level, start=r.start, count=r.count) for r in runs]


def service_handler(service: KvCacheService) -> grpc.GenericRpcHandler:
    """The service's method handlers: protobuf messages throughout, except that Get's responses
    and Put's requests go through the frame codec (payloads copied once, not three times)."""
    unary = grpc.unary_unary_rpc_method_handler
    # Every method behind the method check: a confined role (router) reaches only its own.
    fn = {name: _allowed(service.gate, name, getattr(service, name), streams=name == "Get")
          for name in pb.DESCRIPTOR.services_by_name["KvCache"].methods_by_name}
    methods = {
        "Lookup": unary(fn["Lookup"], pb.LookupRequest.FromString, pb.LookupResponse.SerializeToString),
        "Get": grpc.unary_stream_rpc_method_handler(fn["Get"], pb.GetRequest.FromString, encode_frame),
        "Put": grpc.stream_unary_rpc_method_handler(fn["Put"], decode_frame, pb.PutResponse.SerializeToString),
        "Delete": unary(fn["Delete"], pb.DeleteRequest.FromString, pb.DeleteResponse.SerializeToString),
        "ListScope": unary(fn["ListScope"], pb.ListScopeRequest.FromString, pb.ListScopeResponse.SerializeToString),
        "Purge": unary(fn["Purge"], pb.PurgeRequest.FromString, pb.PurgeResponse.SerializeToString),
        "Revoke": unary(fn["Revoke"], pb.RevokeRequest.FromString, pb.RevokeResponse.SerializeToString),
        "Stats": unary(fn["Stats"], pb.StatsRequest.FromString, pb.StatsResponse.SerializeToString),
        "Domains": unary(fn["Domains"], pb.DomainsRequest.FromString, pb.DomainsResponse.SerializeToString),
        "DataPlane": unary(fn["DataPlane"], pb.DataPlaneRequest.FromString, pb.DataPlaneResponse.SerializeToString),
        "Locate": unary(fn["Locate"], pb.LocateRequest.FromString, pb.LocateResponse.SerializeToString),
        "WatchHeld": unary(fn["WatchHeld"], pb.WatchHeldRequest.FromString, pb.WatchHeldResponse.SerializeToString),
        "HeldChanges": unary(fn["HeldChanges"], pb.HeldChangesRequest.FromString,
                             pb.HeldChangesResponse.SerializeToString),
    }
    missing = set(pb.DESCRIPTOR.services_by_name["KvCache"].methods_by_name) - set(methods)
    assert not missing, f"service_handler lacks {missing}"
    return grpc.method_handlers_generic_handler(SERVICE_NAME, methods)
