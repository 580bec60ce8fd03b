"""LayerSink: a read handed over layer by layer as it lands, for a consumer that can use layer s
of every block while layer s + 1 is still on its way (an engine's forward pass)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch


class LayerSink(ABC):
    """Takes the layers of a read's blocks (blocks shaped ``[layers, ...]``) as they land.

    Protocol: a tier that can deliver layer by layer (the daemon's client over shared memory,
    ``GrpcTier``) calls ``layer(0, ...)``, ``layer(1, ...)``, ... in order, from the reading thread,
    each with the same ``positions``, once those blocks' metadata has been checked; the read then
    returns the blocks as ``get`` would. Any other tier never calls it. The consumer therefore
    compares what it was given with what the read returned (``complete``): only when every layer
    of exactly the returned blocks arrived may it skip copying them from the blocks themselves.
    """

    def __init__(self, layers: int) -> None:
        assert layers > 0
        self.layers = layers
        self.delivered = 0  #: layers handed over so far
        self.positions: tuple[int, ...] = ()

    def layer(self, index: int, positions: Sequence[int], rows: torch.Tensor) -> None:
        """Layer ``index`` of the read's blocks at ``positions`` is in place: ``rows[k]`` (uint8,
        one row per block) is layer ``index`` of the block at ``positions[k]``, valid during the call."""
        assert index == self.delivered, f"layer {index} handed over after {self.delivered}"
        assert index == 0 or tuple(positions) == self.positions, "a read's layers cover the same blocks"
        self.positions = tuple(positions)
        self.take(index, self.positions, rows)
        self.delivered = index + 1

    @abstractmethod
    def take(self, index: int, positions: tuple[int, ...], rows: torch.Tensor) -> None:
        """Use layer ``index`` (copy it where it belongs) before returning."""

    def complete(self, blocks: int) -> bool:
        """Whether every layer of exactly the first ``blocks`` blocks of the read was handed over."""
        return self.delivered == self.layers and self.positions == tuple(range(blocks))


__all__ = ["LayerSink"]
