"""LayerSink: a read handed over layer by layer as it lands, for a consumer that can use layer s
of every block while layer s + 1 is still on its way (an engine's forward pass)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(slots=True, frozen=True)
class PageTarget:
    """Where a sink's blocks belong when they live in shared memory its consumer owns (an
    engine's pages moved into a sealed memory file): layer s of the read's block k at byte
    ``offsets[k] + s * stride`` of the file ``fd``, which ``memory`` (uint8, 1-D) maps whole.
    A tier that can write there itself (the daemon's client, over its data plane) does, so the
    consumer copies nothing."""

    fd: int
    memory: torch.Tensor
    offsets: tuple[int, ...]
    stride: int


class LayerSink(ABC):
    """Takes the layers of a read's blocks (blocks shaped ``[layers, ...]``) as they land.

    Protocol: a tier that can deliver layer by layer (the daemon's client over shared memory,
    ``GrpcTier``) calls ``layer(0, ...)``, ``layer(1, ...)``, ... in order, from the reading thread,
    each with the same ``positions``, once those blocks' metadata has been checked; the read then
    returns the blocks as ``get`` would. Any other tier never calls it. The consumer therefore
    compares what it was given with what the read returned (``complete``): only when every layer
    of exactly the returned blocks arrived may it skip copying them from the blocks themselves.
    """

    def __init__(self, layers: int, pages: PageTarget | None = None) -> None:
        assert layers > 0
        self.layers = layers
        #: Where the blocks belong, when the tier may write them there itself (then ``rows`` is None).
        self.pages = pages
        self.delivered = 0  #: layers handed over so far
        self.positions: tuple[int, ...] = ()

    def layer(self, index: int, positions: Sequence[int], rows: torch.Tensor | None) -> None:
        """Layer ``index`` of the read's blocks at ``positions`` is in place: ``rows[k]`` (uint8,
        one row per block) is layer ``index`` of the block at ``positions[k]``, valid during the
        call; None when the tier wrote it into ``pages`` itself."""
        assert index == self.delivered, f"layer {index} handed over after {self.delivered}"
        assert index == 0 or tuple(positions) == self.positions, "a read's layers cover the same blocks"
        self.positions = tuple(positions)
        self.take(index, self.positions, rows)
        self.delivered = index + 1

    @abstractmethod
    def take(self, index: int, positions: tuple[int, ...], rows: torch.Tensor | None) -> None:
        """Use layer ``index`` (copy it where it belongs, unless ``rows`` is None: already there)
        before returning."""

    def complete(self, blocks: int) -> bool:
        """Whether every layer of exactly the first ``blocks`` blocks of the read was handed over."""
        return self.delivered == self.layers and self.positions == tuple(range(blocks))


__all__ = ["LayerSink", "PageTarget"]
