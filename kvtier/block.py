"""Blocks: the unit every tier stores. Metadata is immutable; the payload is a tensor."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtier.errors import BlockSizeError, LayoutMismatch
from kvtier.keys import LAYOUT_TAG_BYTES, BlockKey, ScopeDomain, key_domain, key_layout_tag
from kvtier.layout import DTYPES, KVLayout, LayoutFingerprint, dtype_name


@dataclass(slots=True, frozen=True)
class BlockMeta:
    """Identity and shape of a block. ``parent`` is the previous block of the chain (None at 0)."""

    key: BlockKey
    domain: ScopeDomain
    layout_fp: LayoutFingerprint
    parent: BlockKey | None
    index: int
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = DTYPES[self.dtype][1]
        for d in self.shape:
            n *= d
        return n

    def check_layout(self, layout: KVLayout) -> None:
        """Raise LayoutMismatch unless this block belongs to ``layout`` exactly."""
        if self.layout_fp != layout.fingerprint:
            raise LayoutMismatch("block was written for another KV layout (fingerprint differs)")
        if self.dtype != layout.dtype:
            raise LayoutMismatch(f"block dtype {self.dtype} != layout dtype {layout.dtype}")
        if tuple(self.shape) != layout.block_shape:
            raise LayoutMismatch(f"block shape {self.shape} != layout block shape {layout.block_shape}")


class Described:
    """``key`` and ``nbytes`` as a block's metadata states them (blocks and sealed records alike)."""

    __slots__ = ()
    meta: BlockMeta

    @property
    def key(self) -> BlockKey:
        return self.meta.key

    @property
    def nbytes(self) -> int:
        return self.meta.nbytes


@dataclass(slots=True, frozen=True)
class PlacedBlock(Described):
    """A block a tier wrote straight into its reader's own pages (``LayerSink.pages``): its bytes
    are there, layer by layer from ``offset`` of the reader's memory, not in a tensor of its own."""

    meta: BlockMeta
    offset: int


@dataclass(slots=True)
class Block(Described):
    """A block's metadata and its payload tensor (contiguous, dtype/shape as the metadata says).

    Tiers copy payloads in and out: a caller never holds a view into a tier's own storage, so an
    eviction can never change bytes a caller is still using.

    ``checksum``, when set, is the xxh3-64 of the payload as it was verified on arrival (the wire
    assembler sets it): whoever encodes the block again reuses it instead of hashing twice. A
    block whose bytes are changed in place must not keep it.
    """

    meta: BlockMeta
    data: torch.Tensor
    checksum: int | None = None

    def __post_init__(self) -> None:
        m = self.meta
        if key_domain(m.key) != m.domain:
            raise LayoutMismatch("block key's scope-domain prefix differs from its declared domain")
        if dtype_name(self.data.dtype) != m.dtype:
            raise LayoutMismatch(f"payload dtype {self.data.dtype} != declared {m.dtype}")
        if tuple(self.data.shape) != tuple(m.shape):
            raise LayoutMismatch(f"payload shape {tuple(self.data.shape)} != declared {m.shape}")
        if not self.data.is_contiguous():
            raise LayoutMismatch("payload must be contiguous")

    @classmethod
    def build(
        cls,
        layout: KVLayout,
        key: BlockKey,
        domain: ScopeDomain,
        data: torch.Tensor,
        *,
        parent: BlockKey | None = None,
        index: int = 0,
    ) -> Block:
        """Make a block for ``layout``, refusing payloads of the wrong dtype, shape or size."""
        if key_layout_tag(key) != layout.fingerprint[:LAYOUT_TAG_BYTES]:
            raise LayoutMismatch("key was derived for another KV layout")
        if data.dtype != layout.torch_dtype:
            raise LayoutMismatch(f"payload dtype {data.dtype} != layout dtype {layout.dtype}")
        if data.numel() * data.element_size() != layout.bytes_per_block:
            raise BlockSizeError(
                f"payload has {data.numel() * data.element_size()} bytes, layout needs {layout.bytes_per_block}"
            )
        if tuple(data.shape) != layout.block_shape:
            raise LayoutMismatch(f"payload shape {tuple(data.shape)} != layout block shape {layout.block_shape}")
        meta = BlockMeta(key, domain, layout.fingerprint, parent, index, layout.dtype, layout.block_shape)
        return cls(meta, data.contiguous())

    def as_bytes_view(self) -> memoryview:
        """The payload's bytes without a copy (CPU tensors only)."""
        assert self.data.device.type == "cpu", "byte view needs a CPU tensor"
        return memoryview(self.data.view(torch.uint8).reshape(-1).numpy()).cast("B")

    def equal_bytes(self, other: Block) -> bool:
        return self.meta == other.meta and torch.equal(
            self.data.view(torch.uint8).reshape(-1).cpu(), other.data.view(torch.uint8).reshape(-1).cpu()
        )
