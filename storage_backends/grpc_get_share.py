"""Where a Get's blocks land in shared memory, and how the client reaches and checks them there.

A Get to a daemon goes one of three ways: inline (every payload in the messages), into a slice of
the channel's shared region (the daemon writes the blocks there; the client hands them out as
views of the slice), or into the reader's own pages (the daemon writes each block straight to
the engine's KV pages). ``get_share`` fills the request's region fields for the last two and
returns what ``BlockAssembler`` and the read loop need: the bounds-checked window onto the
region, how a block there becomes a tensor, and the layer-by-layer layout where there is one.
The rule a daemon is held to is here: it may write only inside the call's own share.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kvtier.block import BlockMeta
from kvtier.dataplane.layered_read import LayerMajorShare, PlacedShare
from kvtier.dataplane.session import PagesLink, SharedMemoryLink
from kvtier.dataplane.slices import SliceLease
from kvtier.dataplane.typed_views import TypedViews
from kvtier.errors import InvalidRequest
from kvtier.keys import BlockKey
from kvtier.rpc import kvtier_pb2 as pb
from kvtier.rpc.block_assembler import Adopt, RegionView, Take
from kvtier.store.layer_sink import LayerSink


@dataclass(slots=True)
class GetShare:
    """One Get's shared memory, as ``get_share`` set it up (all None for an inline Get).

    ``filled[0]`` grows as the daemon's blocks are checked into place: the bytes of the slice it
    filled, from the slice's start (it fills in order), so the caller can give the rest back. It
    is a list the window writes, not a field of this object: a window that held this object would
    make a reference cycle, and the blocks' slice would stay leased until the garbage collector
    ran instead of until the last block is gone.
    """

    named: SharedMemoryLink | PagesLink | None = None
    layered: LayerMajorShare | PlacedShare | None = None
    window: RegionView | None = None
    adopt: Adopt | None = None
    take: Take | None = None
    filled: list[int] = field(default_factory=lambda: [0])

    @property
    def used(self) -> int:
        return self.filled[0]


def get_share(request: pb.GetRequest, keys: Sequence[BlockKey], outs: Sequence[torch.Tensor] | None,
              sink: LayerSink | None, shm: tuple[SharedMemoryLink, SliceLease] | None,
              pages: PagesLink | None) -> GetShare:
    """Set ``request``'s region fields for the reader's ``pages`` (attached), else for the
    leased slice of ``shm``, else leave it inline; the share the read loop works with."""
    if pages is not None:
        assert sink is not None and sink.pages is not None and outs is None
        placed = PlacedShare(sink.pages, sink, len(keys))
        request.region_offset, request.region_bytes = 0, pages.nbytes
        request.region_layers = sink.layers
        request.block_offsets.extend(placed.offsets)
        request.layer_stride = placed.stride
        return GetShare(named=pages, layered=placed, window=placed.window, take=placed.take)
    if shm is None:
        return GetShare()
    link, lease = shm
    share = lease.slice
    request.region_offset, request.region_bytes = share.offset, share.nbytes
    # One tensor over the whole share: the blocks adopted from it are views of one storage
    # (back to back, in request order), and the share stays leased while any is alive.
    whole = link.region.window(share.offset, share.nbytes)
    lease.hold(whole)
    whole_t = torch.from_numpy(whole)
    layered = LayerMajorShare(whole_t, share.offset, sink) if sink is not None and outs is None else None
    if layered is not None:
        request.region_layers = sink.layers
    del whole
    typed = TypedViews(whole_t)
    filled = [0]

    def adopt(offset: int, meta: BlockMeta) -> torch.Tensor:
        return typed.block(offset - share.offset, meta)

    def window(offset: int, nbytes: int) -> np.ndarray:
        # The daemon may write only inside this call's share of the region.
        if not (share.offset <= offset and offset + nbytes <= share.offset + share.nbytes):
            raise InvalidRequest("daemon placed a block outside this call's share of the region")
        if layered is not None:
            layered.check(offset, nbytes)
        filled[0] = max(filled[0], offset + nbytes - share.offset)
        return link.region.window(offset, nbytes)

    # A block is adopted (a view of the share, no copy) only where the caller gave no destination.
    return GetShare(named=link, layered=layered, window=window, adopt=adopt if outs is None else None, filled=filled)
