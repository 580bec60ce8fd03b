"""The client half of the shared-memory data plane: one region per channel to a daemon.

``DataPlaneSession`` attaches a region on first use (``DataPlane`` says where the daemon's
socket is; ``kvtier.dataplane.handshake`` hands it over), re-attaches after the daemon lost it
(a restart), and answers None whenever shared memory cannot be had: no socket offered (the
daemon runs with ``server.data_plane = "off"``, or is older), a socket this process cannot
reach (another node, another user, another container), a refusal (bounds, credential), or an
answer from some other daemon than the one this channel talks to. The caller then sends its
bytes inline over gRPC: the fallback is automatic, and logged once per cause.

A first attachment is made by the call that needs it (an engine pays it at start, in its
warm-up). A re-attachment after a loss is made off the callers' path, in a thread of its own: a
region is created and its pages faulted in, which took 0.1-1.4 s for an engine's 256 MiB on a
busy host, and the call that found it gone may be an engine's step, holding up every request in
the batch. Until it is done, calls go inline; in ``shm`` mode (required) the caller still waits.

On CUDA the region is registered as pinned host memory, so a block read into it is one DMA away
from the GPU, and the region doubles as the transfer staging buffer.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvtier.dataplane.handshake import Attached, Hello, read_reply, send_hello
from kvtier.dataplane.region import SharedRegion
from kvtier.dataplane.region_blocks import RegionBlocks
from kvtier.dataplane.slices import SliceAllocator
from kvtier.errors import AccessDenied, ConfigError, DataPlaneUnavailable, KvtierError
from kvtier.rpc import kvtier_pb2 as pb

log = logging.getLogger("kvtier.client")

#: How long a failed attachment is not retried (a daemon without a data plane answers the same
#: every time; one restarted with one is picked up after this).
RETRY_AFTER_S = 30.0
#: Connecting and the handshake: one small exchange on the local machine.
HANDSHAKE_TIMEOUT_S = 5.0


@dataclass(slots=True)
class SharedMemoryLink:
    """An attached region: the connection that keeps it attached, the mapping, its slices.

    Invariants: ``handle`` names ``region`` in the daemon for as long as ``sock`` is open;
    ``tensor`` views the whole region (pinned when CUDA is available). ``close`` once.
    """

    sock: socket.socket
    region: SharedRegion
    handle: str
    slices: SliceAllocator
    tensor: torch.Tensor
    pinned: bool
    #: Bytes of the largest block of the last read that found any (0: none yet): what
    #: ``read_bytes`` sizes a read of blocks of unknown size by. Set through ``note_block_bytes``.
    _typical_block_bytes: int = field(default=0, init=False)

    @classmethod
    def attach(cls, offer: pb.DataPlaneResponse, token: str, nbytes: int) -> SharedMemoryLink:
        nbytes = min(nbytes, offer.max_region_bytes) if offer.max_region_bytes else nbytes
        region = SharedRegion.create(nbytes)
        try:
            sock, handle = _hand_over(offer, token, region.fd, region.nbytes)
        finally:
            region.close()  # the mapping stays; the daemon holds its own descriptor
        try:
            tensor = torch.from_numpy(region.array)
            pinned = _pin(tensor)
        except BaseException:
            sock.close()
            raise
        return cls(sock, region, handle, SliceAllocator(region.nbytes), tensor, pinned)

    @property
    def nbytes(self) -> int:
        return self.region.nbytes

    def offset_of(self, t: torch.Tensor) -> int | None:
        """Where ``t`` (a contiguous CPU tensor) lies in the region, if it lies wholly inside it."""
        if t.device.type != "cpu" or not t.is_contiguous():
            return None
        base = self.tensor.data_ptr()
        off = t.data_ptr() - base
        n = t.numel() * t.element_size()
        return off if off >= 0 and off + n <= self.nbytes else None

    def region_blocks(self, n: int, block_bytes: int) -> RegionBlocks | None:
        """A slice for ``n`` blocks of ``block_bytes`` (see RegionBlocks), or None when the region
        has no free run that large."""
        want = n * block_bytes
        s = self.slices.take(want)
        if s is None:
            return None
        if s.nbytes < want:  # the largest free run is too small: the caller stages elsewhere
            self.slices.release(s)
            return None
        return RegionBlocks(self.tensor, self.slices, s, n, block_bytes)

    def note_block_bytes(self, nbytes: int) -> None:
        """A read found blocks of at most ``nbytes`` each: size the next reads by it."""
        self._typical_block_bytes = nbytes

    def read_bytes(self, n_blocks: int) -> int:
        """How much of the region a read of ``n_blocks`` blocks of unknown size asks for: n times
        the block size noted last, at most half the region (a quarter before any was noted), so
        one read never takes the whole region from the reads running beside it."""
        if not self._typical_block_bytes:
            return self.nbytes // 4
        return min(n_blocks * self._typical_block_bytes, self.nbytes // 2)

    def close(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
        self.sock.close()  # the daemon detaches the region when this connection ends


@dataclass(slots=True)
class PagesLink:
    """A client's own pages (a sealed memory file it made, ``LayerSink.pages``) attached to the
    daemon as a region of its own, so a placed Get writes there: the connection that keeps it
    attached and the handle that names it. The client keeps its descriptor (it re-attaches the
    same file after a daemon restart). ``close`` once."""

    sock: socket.socket
    handle: str
    nbytes: int

    @classmethod
    def attach(cls, offer: pb.DataPlaneResponse, token: str, fd: int) -> PagesLink:
        nbytes = os.fstat(fd).st_size
        sock, handle = _hand_over(offer, token, fd, nbytes)
        return cls(sock, handle, nbytes)

    def close(self) -> None:
        self.sock.close()


def _hand_over(offer: pb.DataPlaneResponse, token: str, fd: int, nbytes: int) -> tuple[socket.socket, str]:
    """The handshake: ``fd`` to the daemon behind ``offer``; the open connection and the region's handle."""
    if not offer.socket:
        raise DataPlaneUnavailable("the daemon offers no shared-memory data plane")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(HANDSHAKE_TIMEOUT_S)
    try:
        sock.connect(offer.socket)
        send_hello(sock, Hello(token, nbytes), fd)
        reply = read_reply(sock)
        if not isinstance(reply, Attached):
            raise DataPlaneUnavailable(f"the daemon refused the region: {reply[0]}: {reply[1]}")
        if reply.instance != offer.instance:
            raise DataPlaneUnavailable(f"{offer.socket} belongs to another daemon than this channel's")
        sock.settimeout(None)
        return sock, reply.region
    except OSError as exc:
        sock.close()
        raise DataPlaneUnavailable(f"cannot attach through {offer.socket}: {exc}") from None
    except BaseException:
        sock.close()
        raise


def _pin(t: torch.Tensor) -> bool:
    """Register the region as pinned memory when a GPU is present (one copy to it, not two)."""
    if not torch.cuda.is_available():
        return False
    rc = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel(), 0)
    if int(rc) != 0:
        raise DataPlaneUnavailable(f"cudaHostRegister of the region failed ({rc})")
    return True


class DataPlaneSession:
    """The shared-memory link of one channel (shared by every client on it).

    Modes: ``auto`` (shared memory when it can be had, else inline), ``shm`` (required: a
    failure raises DataPlaneUnavailable), ``tcp`` (never). Thread-safe: a first attachment happens
    under one lock, a re-attachment in one thread of its own and is adopted under it (module
    docstring); a link handed out stays valid until ``lost`` or ``close`` (calls in flight on a
    lost link fail with RegionUnavailable and are retried inline by the caller).
    """

    MODES = ("auto", "shm", "tcp")

    def __init__(self, mode: str, region_bytes: int) -> None:
        if mode not in self.MODES:
            raise ConfigError(f"data_plane must be one of {self.MODES}, got {mode!r}")
        self.mode = mode
        self.region_bytes = region_bytes
        self._link: SharedMemoryLink | None = None
        self._failed_at = -RETRY_AFTER_S
        #: A link was lost (``lost``) and none attached since: the next one is made off the path.
        self._lost = False
        self._reattaching: threading.Thread | None = None
        self._closed = False
        #: Clients' own pages attached (``pages``), by memory file (device, inode); when each last failed.
        self._pages: dict[tuple[int, int], PagesLink] = {}
        self._pages_failed: dict[tuple[int, int], float] = {}
        self._reason = "not attached yet" if mode != "tcp" else "inline by configuration"
        self._lock = threading.Lock()
        #: Payload bytes moved through the region, by direction ("get", "put"); "put_in_place":
        #: bytes a Put found already in the region (RegionBlocks) and sent without a copy.
        self.moved_bytes = {"get": 0, "put": 0, "put_in_place": 0}
        #: Regions attached, and the microseconds they took (the offer, the region's creation and
        #: page faults, the handshake): a first-use cost, reported wherever it was paid.
        self.attaches = 0
        self.attach_us = 0

    @property
    def current(self) -> SharedMemoryLink | None:
        """The attached link, if any (attaches nothing)."""
        return self._link

    @property
    def state(self) -> str:
        """``shm``, or ``inline: <why>``."""
        return "shm" if self._link is not None else f"inline: {self._reason}"

    def link(self, offer: Callable[[], pb.DataPlaneResponse], token: Callable[[], str]) -> SharedMemoryLink | None:
        if self.mode == "tcp":
            return None
        with self._lock:
            if self._link is not None:
                return self._link
            if self.mode == "auto" and time.monotonic() - self._failed_at < RETRY_AFTER_S:
                return None
            if self.mode == "auto" and self._lost:
                if self._reattaching is None and not self._closed:
                    self._reattaching = threading.Thread(target=self._reattach, args=(offer, token), daemon=True,
                                                         name="kvtier-data-plane-reattach")
                    self._reattaching.start()
                return None
            t0 = time.perf_counter()
            try:
                link = SharedMemoryLink.attach(offer(), token(), self.region_bytes)
            except KvtierError as exc:  # DataPlaneUnavailable, or the DataPlane call failed
                self._attach_failed(exc)
                if self.mode == "shm":
                    raise
                return None
            self._adopt(link, t0)
            return link

    def _reattach(self, offer: Callable[[], pb.DataPlaneResponse], token: Callable[[], str]) -> None:
        """After a loss, in a thread of its own (module docstring); calls go inline meanwhile."""
        t0 = time.perf_counter()
        try:
            link = SharedMemoryLink.attach(offer(), token(), self.region_bytes)
        except KvtierError as exc:
            with self._lock:
                self._reattaching = None
                self._attach_failed(exc)
            return
        except Exception as exc:  # a bug: no region, said where it shows (state, log), not retried soon
            log.exception("re-attaching the shared-memory region failed")
            with self._lock:
                self._reattaching = None
                self._failed_at = time.monotonic()
                self._reason = f"re-attaching failed: {exc!r}"
            return
        with self._lock:
            self._reattaching = None
            if self._closed:
                link.close()
                return
            self._adopt(link, t0)

    def _adopt(self, link: SharedMemoryLink, t0: float) -> None:
        """Under the lock: ``link`` is the channel's from now on."""
        took_us = round((time.perf_counter() - t0) * 1e6)
        self._link, self._lost = link, False
        self.attaches += 1
        self.attach_us += took_us
        log.info("shared-memory data plane attached", extra={
            "event": "data_plane", "bytes": link.nbytes, "attach_ms": round(took_us / 1000, 1)})

    def _attach_failed(self, exc: KvtierError) -> None:
        """Under the lock: why there is no region now."""
        if not isinstance(exc, AccessDenied):
            # Refused to one caller (AccessDenied) is no reason to stop another client
            # of this channel, acting for someone else, from attaching: no pause for it.
            self._failed_at = time.monotonic()
        if str(exc) != self._reason:
            log.info("inline data path", extra={"event": "data_plane", "reason": str(exc)})
        self._reason = str(exc)

    def pages(self, fd: int, offer: Callable[[], pb.DataPlaneResponse],
              token: Callable[[], str]) -> PagesLink | None:
        """The attachment of a client's own pages (memory file ``fd``), attached on first use;
        None when shared memory is off or the daemon refused them (too large for its bound, say:
        logged, retried after RETRY_AFTER_S), so the read goes through the channel's own region."""
        if self.mode == "tcp":
            return None
        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino)
        with self._lock:
            link = self._pages.get(key)
            if link is not None:
                return link
            if time.monotonic() - self._pages_failed.get(key, -RETRY_AFTER_S) < RETRY_AFTER_S:
                return None
            try:
                link = self._pages[key] = PagesLink.attach(offer(), token(), fd)
                log.info("client pages attached", extra={"event": "data_plane", "bytes": link.nbytes})
                return link
            except KvtierError as exc:
                self._pages_failed[key] = time.monotonic()
                log.warning("client pages not attached; reads go through the region",
                            extra={"event": "data_plane", "reason": str(exc)})
                return None

    def lost_pages(self, link: PagesLink) -> None:
        """The daemon no longer knows ``link`` (it restarted): the next read attaches the pages again."""
        with self._lock:
            for key, held in list(self._pages.items()):
                if held is link:
                    del self._pages[key]
        link.close()

    def moved(self, direction: str, nbytes: int) -> None:
        with self._lock:
            self.moved_bytes[direction] += nbytes

    def lost(self, link: SharedMemoryLink) -> None:
        """The daemon no longer knows ``link`` (it restarted): drop it; the next call re-attaches."""
        with self._lock:
            if self._link is link:
                self._link, self._lost = None, True
                self._reason = "the daemon lost the region; re-attaching"
        link.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            link, self._link = self._link, None
            pages, self._pages = list(self._pages.values()), {}
        if link is not None:
            link.close()
        for p in pages:
            p.close()
