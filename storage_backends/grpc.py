"""A ``kvtier serve`` daemon used as a tier: an engine chains ``[GPU] -> [local CPU] -> [daemon]``.

``GrpcTier`` implements the Tier contract over the daemon's KvCache service. Keys must be derived
with the domains the daemon hands out (``domains()``: the caller's own scopes only; the server
secret never leaves the daemon), so ``block_chain(layout, segments, tier.domains())`` works like
``block_chain`` with a local DomainDeriver.

Failure model (as for the S3 tier): the engine-facing calls (contains, get, get_into, put) never
raise when the daemon is unreachable, slow or overloaded; they return misses / rejected puts and
count the cause in ``metrics.errors`` (``unavailable``, ``timeout``, ``overloaded``, ``corrupt``).
Credentials and requests that are wrong (UNAUTHENTICATED, PERMISSION_DENIED, INVALID_ARGUMENT)
raise the matching kvtier exception: retrying cannot fix them. Administrative calls (delete,
delete_scope, keys_in_scope, usage, purge, revoke, stats) raise on every failure.
Every block is verified end to end: the daemon sends the xxh3 of each payload and a block whose
bytes do not match is a counted miss, never returned.

Beside it: how to reach the daemon (``grpc_config.GrpcTierConfig``), the channel every client on
it shares with its shared-memory session and breaker (``grpc_channel.DaemonChannel``), the Put's
messages (``grpc_put_frames``), where a Get's blocks land in shared memory (``grpc_get_share``),
and a router's Locate client for an event loop (``grpc_locate``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import Any

import grpc
import torch

from kvtier.block import Block, BlockMeta
from kvtier.dataplane.layered_read import PlacedShare
from kvtier.dataplane.region_blocks import RegionBlocks
from kvtier.dataplane.session import RETRY_AFTER_S, DataPlaneSession, PagesLink, SharedMemoryLink
from kvtier.dataplane.slices import Slice, SliceLease
from kvtier.errors import (
    AccessDenied,
    DataPlaneUnavailable,
    DeadlineExceeded,
    HeldOff,
    InvalidRequest,
    KvtierError,
    LayoutMismatch,
    Overloaded,
    RateLimited,
    RegionUnavailable,
    TierUnavailable,
)
from kvtier.keys import BlockKey, Scope, ScopeDomain
from kvtier.layout import DTYPES
from kvtier.rpc import kvtier_pb2 as pb
from kvtier.rpc.block_assembler import BlockAssembler
from kvtier.rpc.names import AUTH_METADATA, DURABLE_METADATA, REGION_METADATA, SALT_METADATA
from kvtier.rpc.status import error_from
from kvtier.rpc.wire import (
    ResponseSlots,
    carries_chunk,
    describes_placed,
)
from kvtier.security.domain_table import DomainTable, ScopeGrant
from kvtier.store.layer_sink import LayerSink
from kvtier.store.lookup import Lookup, TierRun
from kvtier.store.pin_table import PinTable
from kvtier.store.tier import NO_PINS, PutResult, Tier, TierUsage
from storage_backends.circuit_breaker import CircuitBreaker
from storage_backends.grpc_channel import DaemonChannel
from storage_backends.grpc_config import GrpcTierConfig
from storage_backends.grpc_get_share import get_share
from storage_backends.grpc_put_frames import inline_frames, placed_in, region_frames

log = logging.getLogger("kvtier.daemon_client")

#: Failures an engine-facing call turns into a miss (or a rejected put), by metrics cause. A
#: RateLimited read (the daemon's miss limit) is a refusal for now, like Overloaded, not a crash.
DEGRADED: tuple[tuple[type[KvtierError], str], ...] = (
    (HeldOff, "held_off"),
    (DeadlineExceeded, "timeout"),
    (TierUnavailable, "unavailable"),
    (Overloaded, "overloaded"),
    (RateLimited, "rate_limited"),
)




@dataclass(slots=True, frozen=True)
class WarmUp:
    """What ``GrpcTier.warm_up`` paid at connect, so that the first request does not: seconds of
    each step, and how payloads travel from then on (``shm``, or ``inline: <why>``)."""

    connect_s: float
    domains_s: float
    data_plane_s: float
    data_plane: str
    region_bytes: int

    @property
    def total_s(self) -> float:
        return self.connect_s + self.domains_s + self.data_plane_s


class GrpcTier(Tier):
    """The daemon behind one gRPC channel. See the module docstring for the failure model.

    Thread-safe: the channel and stubs are; ``_domains`` is set once under ``_lock``. Pins are
    per process: this tier's PinTable cannot pin blocks inside the daemon (the daemon pins what
    it is streaming itself), so a local pin does not stop another client from evicting there.
    The daemon is shared by every process that reaches it (``shared_across_processes``).
    ``acting_for(salt)`` gives a client on the same channel that acts for a request's principal.
    """

    shared_across_processes = True

    def __init__(self, config: GrpcTierConfig, *, channel: DaemonChannel | None = None) -> None:
        config.validate()
        self.name = config.name
        super().__init__()
        self.config = config
        self._owns_channel = channel is None
        self._ch = channel if channel is not None else DaemonChannel.open(config)
        self._stub, self._get, self._put = self._ch.stub, self._ch.get, self._ch.put
        self._lock = threading.Lock()
        self._domains: DomainTable | None = None
        #: When this client's own data-plane offer was last refused (see ``_offer``).
        self._offer_refused_at = -RETRY_AFTER_S

    def acting_for(self, salt: str) -> GrpcTier:
        """A client on this channel whose calls act for the principal of ``salt`` (this client's
        token must be an engine's; the daemon verifies the salt). Closing it leaves the channel open."""
        return GrpcTier(replace(self.config, salt=salt), channel=self._ch)

    # -- plumbing ---------------------------------------------------------------------------------
    def _token(self) -> str:
        return self.config.token() if callable(self.config.token) else self.config.token

    def _metadata(self, link: SharedMemoryLink | PagesLink | None = None) -> tuple[tuple[str, str], ...]:
        md: tuple[tuple[str, str], ...] = ((AUTH_METADATA, f"Bearer {self._token()}"),)
        if self.config.salt is not None:
            md = (*md, (SALT_METADATA, self.config.salt))
        return md if link is None else (*md, (REGION_METADATA, link.handle))

    def _put_metadata(self, link: SharedMemoryLink | None) -> tuple[tuple[str, str], ...]:
        md = self._metadata(link)
        return (*md, (DURABLE_METADATA, "1")) if self.config.durable else md

    def _link(self, offer: Callable[[], pb.DataPlaneResponse] | None = None) -> SharedMemoryLink | None:
        if time.monotonic() - self._offer_refused_at < RETRY_AFTER_S:
            current = self._ch.session.current  # attached by another client of the channel, or None
            if current is None and self._ch.session.mode == "shm":
                raise DataPlaneUnavailable(f"daemon {self.config.target}: this client's data-plane offer was "
                                           "refused; shared memory is required")
            return current
        return self._ch.session.link(offer or self._offer, self._token)

    def _offer(self, timeout_s: float | None = None) -> pb.DataPlaneResponse:
        try:
            return self._unary("DataPlane", pb.DataPlaneRequest(), timeout_s=timeout_s)
        except AccessDenied:
            # Refused to this client's caller, not to the channel: an engine's own credential
            # without a salt, on a daemon from before it could ask. It stops asking for a while
            # (the session keeps no pause for it), so a client acting for a salt on the same
            # channel still attaches the region, which this one then uses.
            self._offer_refused_at = time.monotonic()
            raise

    @property
    def data_plane(self) -> str:
        """How payloads travel now: ``shm``, or ``inline: <why>``."""
        return self._ch.session.state

    @property
    def session(self) -> DataPlaneSession:
        """This channel's shared-memory session (its link, the bytes moved through it)."""
        return self._ch.session

    @property
    def breaker(self) -> CircuitBreaker | None:
        """This channel's breaker (``hold_off_s``), shared by every client on it; None: off."""
        return self._ch.breaker

    def _unary(self, method: str, request: Any, timeout_s: float | None = None) -> Any:
        """One unary call (``timeout_s``: the config's by default, or less for the breaker's
        probe); every failure becomes the matching kvtier exception (HeldOff: not sent)."""
        fn = getattr(self._stub, method)
        deadline = self._ch.admit(self.config.timeout_s if timeout_s is None else timeout_s)
        t0 = time.perf_counter()
        err: KvtierError | None = None
        try:
            return fn(request, timeout=deadline, metadata=self._metadata())
        except grpc.RpcError as exc:
            err = error_from(exc)
            raise err from None
        finally:
            self._ch.ended(err)
            self.metrics.observe(method.lower(), time.perf_counter() - t0)

    def _degrade(self, exc: KvtierError) -> bool:
        """Count an engine-facing failure that becomes a miss; False when it must propagate."""
        for cls, cause in DEGRADED:
            if isinstance(exc, cls):
                self.metrics.error(cause)
                return True
        return False

    def warm_up(self, *, domains: bool = True, data_plane: bool = True,
                timeout_s: float | None = None) -> WarmUp:
        """Pay this client's first-use costs now, at connect, rather than in its first request:
        the channel's connection, the caller's scope domains (cached), and the shared-memory region
        (created, mapped and pre-faulted on both sides; 256 MiB is 65,536 page faults, about 150 ms
        on a 2-core host, measured in the first reload after start-up before this existed).
        ``domains=False`` for an engine's own credential, which has no scopes (each request's
        salt brings its own); ``data_plane=False`` for a client that moves no payloads (a region
        is the daemon's memory, 256 MiB by default). TierUnavailable when the daemon cannot be
        reached within ``timeout_s`` (default: the config's), which also bounds the data-plane
        offer (the socket's handshake has its own bound); a data plane that cannot be had is
        reported in ``data_plane`` (the calls go inline), raised only in ``shm`` mode, always as
        DataPlaneUnavailable (the daemon answered: the region, not the daemon, is missing).
        Without ``data_plane`` nothing is reported of a region another client attached."""
        wait_s = self.config.timeout_s if timeout_s is None else timeout_s
        t0 = time.perf_counter()
        ready = grpc.channel_ready_future(self._ch.channel)
        try:
            ready.result(timeout=wait_s)
        except grpc.FutureTimeoutError:
            ready.cancel()  # else it keeps polling the channel until the channel closes
            raise TierUnavailable(f"daemon {self.config.target}: not reachable within {wait_s} s") from None
        t1 = time.perf_counter()
        if domains:
            self.domains()
        t2 = time.perf_counter()
        link = self._warm_link(max(0.001, wait_s - (t2 - t0))) if data_plane else None
        t3 = time.perf_counter()
        return WarmUp(t1 - t0, t2 - t1, t3 - t2, self.data_plane if data_plane else "not requested",
                      0 if link is None else link.nbytes)

    def _warm_link(self, timeout_s: float) -> SharedMemoryLink | None:
        try:
            return self._link(lambda: self._offer(timeout_s))
        except DataPlaneUnavailable:
            raise
        except KvtierError as exc:  # only in shm mode: auto answers inline
            hint = (" (a daemon older than this client refuses an engine credential's offer without a "
                    "request's salt: upgrade the daemons first)") if isinstance(exc, AccessDenied) else ""
            raise DataPlaneUnavailable(f"daemon {self.config.target}: no shared-memory region at warm-up: "
                                       f"{exc}{hint}") from exc

    # -- domains ----------------------------------------------------------------------------------
    def domains(self, *, refresh: bool = False) -> DomainTable:
        """The caller's scopes and their domain ids (cached; ``refresh`` after a token change)."""
        with self._lock:
            if self._domains is not None and not refresh:
                return self._domains
        resp = self._unary("Domains", pb.DomainsRequest())
        grants = [ScopeGrant(Scope.parse(e.scope), ScopeDomain(e.domain), e.may_read, e.may_write, e.may_delete)
                  for e in resp.scopes]
        table = DomainTable(resp.principal, grants)
        with self._lock:
            self._domains = table
        return table

    # -- contract ---------------------------------------------------------------------------------
    def contains(self, keys: Sequence[BlockKey]) -> int:
        if not keys:
            return 0
        try:
            return int(self._unary("Lookup", pb.LookupRequest(keys=list(keys))).length)
        except KvtierError as exc:
            if self._degrade(exc):
                return 0
            raise

    def lookup_response(self, keys: Sequence[BlockKey]) -> pb.LookupResponse:
        """The daemon's full answer: prefix length, the tier runs behind it, readable keys, ticket."""
        return self._unary("Lookup", pb.LookupRequest(keys=list(keys)))

    def lookup(self, keys: Sequence[BlockKey]) -> Lookup:
        """What the daemon found for this chain: its runs per daemon tier and its ticket. Hand it
        back to ``load`` to read it with no second walk in the daemon. A daemon that cannot be
        reached answers a miss (counted), as ``contains`` does."""
        try:
            resp = self.lookup_response(keys)
        except KvtierError as exc:
            if self._degrade(exc):
                return Lookup.miss(len(keys))
            raise
        # Named ``<this tier>/<the daemon's tier>`` (``daemon/memory``): where the block is, as the
        # engine sees it (a cost model prices a read from the daemon's RAM, not from its own).
        runs = tuple(TierRun(r.level, f"{self.name}/{r.tier}", r.start, r.count) for r in resp.runs)
        return Lookup(runs, len(keys), tuple(keys[: resp.length]), bytes(resp.ticket))

    def load(self, lookup: Lookup, start: int = 0, end: int | None = None, *,
             sink: LayerSink | None = None) -> list[Block]:
        """The blocks of ``lookup`` (this daemon's answer to ``lookup``) at chain positions
        ``[start, end)``, read in one Get that hands the lookup back (``GET_MODE_FOUND``): the
        daemon re-checks it and reads exactly its runs. The result is a prefix of those blocks:
        one that vanished or failed verification ends it. ``sink``: as for ``get_layers``."""
        end = lookup.length if end is None else min(end, lookup.length)
        if not 0 <= start <= end or not lookup.loadable:
            raise ValueError(f"load: [{start}, {end}) of a {lookup.length}-block lookup")
        got = self._read(lookup.keys[start:end], None, pb.GET_MODE_FOUND, sink, found=(lookup, start))
        n = next((i for i, b in enumerate(got) if b is None), len(got))
        return [b for b in got[:n] if b is not None]

    def get(self, keys: Sequence[BlockKey]) -> list[Block | None]:
        return self._read(keys, None, pb.GET_MODE_EACH)

    def get_into(self, keys: Sequence[BlockKey], outs: Sequence[torch.Tensor]) -> list[Block | None]:
        assert len(outs) == len(keys)
        return self._read(keys, outs, pb.GET_MODE_EACH)

    def get_layers(self, keys: Sequence[BlockKey], sink: LayerSink) -> list[Block | None]:
        """``get`` over shared memory laid out layer by layer (``GetRequest.region_layers``):
        ``sink`` takes each layer of the blocks placed there as soon as it lands (see
        kvtier.dataplane.layered_read). When the sink's own pages are in shared memory
        (``sink.pages``) and the daemon maps them, it writes each block there: the sink is told
        of each layer with no rows and the read returns PlacedBlocks. Inline (no shared memory),
        the sink is never called."""
        return self._read(keys, None, pb.GET_MODE_EACH, sink)

    def get_prefix(self, keys: Sequence[BlockKey], *, sink: LayerSink | None = None) -> list[Block]:
        """The longest cached prefix in one call: the daemon looks it up and reads it in one walk
        (and promotes hits toward its fast tiers). ``sink``: as for ``get_layers``."""
        return [b for b in self._read(keys, None, pb.GET_MODE_PREFIX, sink) if b is not None]

    def _read(
        self, keys: Sequence[BlockKey], outs: Sequence[torch.Tensor] | None, mode: int,
        sink: LayerSink | None = None, found: tuple[Lookup, int] | None = None,
    ) -> list[Block | None]:
        out: list[Block | None] = [None] * len(keys)
        if not keys:
            return out
        t0 = time.perf_counter()
        if sink is not None and sink.pages is not None and outs is None:
            # The reader's own pages are in shared memory: the daemon writes there, nothing is copied here.
            pages = self._ch.session.pages(sink.pages.fd, self._offer, self._token)
            if pages is not None:
                try:
                    self._stream(keys, None, mode, out, None, sink, pages, found)
                    return self._counted(out, t0)
                except RegionUnavailable:  # raised before any byte moved: the daemon restarted
                    self._ch.session.lost_pages(pages)
                    out = [None] * len(keys)
        link = self._link()
        share = None if link is None else link.slices.take(
            sum(o.nbytes for o in outs) if outs is not None else link.read_bytes(len(keys)))
        # Without destinations, blocks are handed out as views of the region (no copy): the slice
        # then stays taken until the call has ended and the last of those blocks is gone.
        lease = None if share is None else SliceLease(link.slices, share)
        try:
            self._stream(keys, outs, mode, out, None if lease is None else (link, lease), sink, found=found)
        except RegionUnavailable:
            assert link is not None
            self._ch.session.lost(link)  # the daemon restarted: this read goes inline
            out = [None] * len(keys)
            self._stream(keys, outs, mode, out, None, None, found=found)
        finally:
            if lease is not None:
                lease.drop()
        if link is not None and any(b is not None for b in out):
            link.note_block_bytes(max(b.nbytes for b in out if b is not None))
        return self._counted(out, t0)

    def _counted(self, out: list[Block | None], t0: float) -> list[Block | None]:
        hits = [b for b in out if b is not None]
        self.metrics.hit(len(hits), sum(b.nbytes for b in hits))
        self.metrics.miss(len(out) - len(hits))
        self.metrics.observe("get", time.perf_counter() - t0)
        return out

    def _stream(
        self, keys: Sequence[BlockKey], outs: Sequence[torch.Tensor] | None, mode: int, out: list[Block | None],
        shm: tuple[SharedMemoryLink, SliceLease] | None, sink: LayerSink | None = None,
        pages: PagesLink | None = None, found: tuple[Lookup, int] | None = None,
    ) -> None:
        """One Get call, its blocks placed into ``out``; failures the engine must survive are counted.
        With ``sink`` and shared memory, the call is laid out layer by layer (see get_layers); with
        ``pages`` (the sink's own pages, attached), each block goes straight to its pages."""

        def allocate(pos: int, meta: BlockMeta) -> torch.Tensor:
            if outs is not None:
                return outs[pos]  # the assembler checks dtype/shape and raises LayoutMismatch
            return torch.empty(meta.shape, dtype=DTYPES[meta.dtype][0])

        request = pb.GetRequest(keys=list(keys), mode=mode)
        if found is not None:
            lookup, request.found_start = found
            request.found_keys.extend(lookup.keys)
            request.found_runs.extend(pb.TierRun(tier=r.tier.removeprefix(f"{self.name}/"), level=r.level,
                                                 start=r.start, count=r.count) for r in lookup.runs)
            request.ticket = lookup.ticket
        gs = get_share(request, keys, outs, sink, shm, pages)
        layered = gs.layered

        # A client trusts blocks the daemon verified (admission, disk, S3) and placed in shared
        # memory; inline blocks are hashed end to end as ever.
        slots = ResponseSlots(keys)
        asm = BlockAssembler(allocate, slots.place, region=gs.window, verify_region=False, adopt=gs.adopt, take=gs.take)
        placed_bytes = 0  # bytes of the blocks described as placed (they never pass through the assembler)
        err: KvtierError | None = None
        admitted = False
        try:
            deadline = self._ch.admit(self.config.timeout_s)
            admitted = True
            stream = self._get(request, timeout=deadline, metadata=self._metadata(gs.named))
            for msg in stream:
                # Laid out by layers, progress (layers_ready) comes alone or on the message that
                # carries the chunks of the blocks it is about (see RegionWriter).
                if describes_placed(msg):
                    if not isinstance(layered, PlacedShare):
                        raise InvalidRequest("placed blocks described on a Get that placed none")
                    for pos, placed_block in layered.describe(msg, slots):
                        layered.placed(pos, placed_block)
                        placed_bytes += placed_block.nbytes
                elif carries_chunk(msg) or not msg.layers_ready:
                    for pos, blk in asm.feed_message(msg):
                        if layered is not None and layered.holds(blk):
                            layered.placed(pos, blk)  # handed out once every layer has landed
                        else:
                            out[pos] = blk
                if msg.layers_ready:
                    if layered is None:
                        raise InvalidRequest("layers_ready on a Get that is not laid out by layers")
                    layered.ready(msg.layers_ready)
            if layered is not None and layered.incomplete:
                raise InvalidRequest(f"the stream ended with {layered.incomplete} blocks laid out by layers incomplete")
            self._ch.session.moved("get", asm.region_bytes + placed_bytes)
        except HeldOff as exc:  # not sent: every block a miss
            self._degrade(exc)
        except grpc.RpcError as exc:
            err = error_from(exc)
            if isinstance(err, RegionUnavailable) or not self._degrade(err):
                raise err from None
        except LayoutMismatch:
            stream.cancel()
            raise
        except InvalidRequest:
            # The daemon's stream broke the wire rules (or bytes were damaged in transit): the
            # open block is dropped, blocks already verified are kept.
            stream.cancel()
            self.metrics.error("corrupt")
        except BaseException:  # the caller's sink failed (a bug): end the call, then surface it
            stream.cancel()
            raise
        finally:
            if admitted:
                self._ch.ended(err)
            if layered is not None:
                for pos, blk in layered.done():
                    out[pos] = blk
            if shm is not None:
                shm[1].trim(gs.used)

    def region_blocks(self, n: int, block_bytes: int) -> RegionBlocks | None:
        """Room for ``n`` blocks in this channel's shared region, for a caller that writes them
        there itself before it Puts them (see RegionBlocks); None without a region or room."""
        link = self._link()
        return None if link is None else link.region_blocks(n, block_bytes)

    def put(self, blocks: Sequence[Block], *, pins: PinTable = NO_PINS, spill: bool = False,
            degrade: bool = True) -> PutResult:
        """The Tier contract's put; ``degrade=False``: an unreachable, slow or overloaded daemon
        raises (TierUnavailable, Overloaded...) instead of answering every block rejected.

        Blocks that already lie in this channel's region (``region_blocks``) are sent as their
        offsets, with no copy; the others are copied into a slice of it (or sent inline)."""
        res = PutResult()
        if not blocks:
            return res
        t0 = time.perf_counter()
        link = self._link()
        try:
            placed = {} if link is None else placed_in(link, blocks)
            copied = sum(b.nbytes for i, b in enumerate(blocks) if i not in placed)
            with nullcontext(None) if link is None or not copied else link.slices.slice(copied) as share:
                try:
                    resp = self._put_call(blocks, None if link is None else (link, share, placed))
                except RegionUnavailable:
                    assert link is not None
                    self._ch.session.lost(link)  # the daemon restarted: this put goes inline
                    resp = self._put_call(blocks, None)
        except KvtierError as err:
            if not degrade or not self._degrade(err):
                raise
            self.metrics.error("dropped_put", len(blocks))
            res.rejected = [b.key for b in blocks]
            return res
        finally:
            self.metrics.observe("put", time.perf_counter() - t0)
        res.stored = [BlockKey(k) for k in resp.stored]
        res.present = [BlockKey(k) for k in resp.present]
        res.rejected = [BlockKey(k) for k in resp.rejected]
        sizes = {b.key: b.nbytes for b in blocks}
        self.metrics.stored(len(res.stored), sum(sizes.get(k, 0) for k in res.stored))
        return res

    def _put_call(self, blocks: Sequence[Block],
                  shm: tuple[SharedMemoryLink, Slice | None, dict[int, int]] | None) -> pb.PutResponse:
        chunks = (inline_frames(blocks, self.config.chunk_bytes) if shm is None
                  else region_frames(blocks, *shm, self._ch.session, self.config.chunk_bytes))
        deadline = self._ch.admit(self.config.timeout_s)
        err: KvtierError | None = None
        try:
            return self._put(chunks, timeout=deadline, metadata=self._put_metadata(None if shm is None else shm[0]))
        except grpc.RpcError as exc:
            err = error_from(exc)
            raise err from None
        finally:
            self._ch.ended(err)

    def delete(self, keys: Sequence[BlockKey]) -> int:
        if not keys:
            return 0
        return int(self._unary("Delete", pb.DeleteRequest(keys=list(dict.fromkeys(keys)))).keys_removed)

    def delete_scope(self, domain: ScopeDomain) -> int:
        return int(self._unary("Delete", pb.DeleteRequest(domain=domain)).keys_removed)

    def keys_in_scope(self, domain: ScopeDomain) -> list[BlockKey]:
        return [BlockKey(k) for k in self._unary("ListScope", pb.ListScopeRequest(domain=domain)).keys]

    def usage(self) -> TierUsage:
        """Blocks and bytes over the daemon's listed (local) tiers; ``by_domain`` covers only the
        caller's own domains. A block held by two daemon tiers counts twice."""
        st = self._unary("Stats", pb.StatsRequest())
        listed = [t for t in st.tiers if t.usage_listed]
        by_domain: dict[ScopeDomain, int] = {}
        for t in listed:
            for hexdom, n in t.domain_bytes.items():
                dom = ScopeDomain(bytes.fromhex(hexdom))
                by_domain[dom] = by_domain.get(dom, 0) + n
        caps = [t.capacity_bytes for t in listed]
        capacity = sum(caps) if caps and all(caps) else None
        return TierUsage(sum(t.blocks for t in listed), sum(t.bytes for t in listed), capacity, by_domain)

    # -- locate -----------------------------------------------------------------------------------
    def locate(self, request: pb.LocateRequest, *, timeout_s: float | None = None) -> pb.LocateResponse:
        """Where the daemon holds a request's prefix and what serving it there would cost
        (kvtier/server/locate.py). Every failure raises its kvtier error (a router decides what
        an unreachable node means); ``timeout_s`` replaces the configured deadline for this call."""
        t0 = time.perf_counter()
        try:
            return self._stub.Locate(request, timeout=self.config.timeout_s if timeout_s is None else timeout_s,
                                     metadata=self._metadata())
        except grpc.RpcError as exc:
            raise error_from(exc) from None
        finally:
            self.metrics.observe("locate", time.perf_counter() - t0)

    # -- held (kvtier/cache/held_watch.py) --------------------------------------------------------
    def watch_held(self, stream: str, keys: Sequence[BlockKey]) -> pb.WatchHeldResponse:
        """Follow ``keys`` on the daemon's watch ``stream`` for this client's principal (a client
        acting for a salt follows them for that salt's principal); the tier of each now. Every
        failure raises its kvtier error."""
        return self._unary("WatchHeld", pb.WatchHeldRequest(stream=stream, keys=list(keys)))

    def held_changes(self, stream: str, ack: int) -> pb.HeldChangesResponse:
        """What changed on the watch ``stream`` since the answer ``ack`` acknowledges (this client's
        own credential: an engine's root client calls it without a salt)."""
        return self._unary("HeldChanges", pb.HeldChangesRequest(stream=stream, ack=ack))

    # -- administration ---------------------------------------------------------------------------
    def stats(self) -> pb.StatsResponse:
        return self._unary("Stats", pb.StatsRequest())

    def purge(self, scope: str, reason: str = "") -> pb.PurgeResponse:
        """Purge a scope everywhere in the daemon and destroy its data keys (``"user"``: the caller's own)."""
        return self._unary("Purge", pb.PurgeRequest(scope=scope, reason=reason))

    def revoke(self, kind: str, target: str, *, reason: str = "", lift: bool = False) -> None:
        """``kind``: principal, tenant or credential."""
        try:
            k = pb.RevokeKind.Value(f"REVOKE_KIND_{kind.upper()}")
        except ValueError:
            raise InvalidRequest(f"unknown revoke kind {kind!r}: principal, tenant or credential") from None
        self._unary("Revoke", pb.RevokeRequest(kind=k, target=target, reason=reason, lift=lift))

    def close(self) -> None:
        if self._owns_channel:
            self._ch.close()


# The router's Locate client (storage_backends/grpc_locate.py), for callers that reach this
# backend by name (``backend("daemon").GrpcLocateClient``). Imported last: it builds on this module.
from storage_backends.grpc_locate import GrpcLocateClient  # noqa: E402, F401
