"""KV layout: what a block of cached attention state looks like, and its fingerprint."""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field
from functools import cached_property
from typing import NewType

import torch

LayoutFingerprint = NewType("LayoutFingerprint", bytes)

#: dtype name -> (torch dtype, bytes per element). Names are the stable on-disk spelling.
DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "float32": (torch.float32, 4),
    "float16": (torch.float16, 2),
    "bfloat16": (torch.bfloat16, 2),
    "float8_e4m3fn": (torch.float8_e4m3fn, 1),
    "uint8": (torch.uint8, 1),
}
_NAME_OF = {dt: name for name, (dt, _) in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _NAME_OF[dtype]
    except KeyError:
        raise ValueError(f"unsupported KV dtype {dtype}") from None


def pack_canonical(obj: str | int | list) -> bytes:
    """The msgpack encoding of nested lists of str/int, byte for byte as ``msgpack.packb`` writes it.

    Written out here so that the layout fingerprint (and everything keyed by it) needs no
    third-party package: the GPU transfer path runs on machines that carry only torch and numpy.
    tests/unit/transfer/test_gpu_path_deps.py checks it against msgpack itself.
    """
    if isinstance(obj, bool) or not isinstance(obj, str | int | list):
        raise TypeError(f"pack_canonical: unsupported type {type(obj).__name__}")
    if isinstance(obj, str):
        raw = obj.encode("utf-8")
        n = len(raw)
        if n <= 31:
            return bytes([0xA0 | n]) + raw
        if n <= 0xFF:
            return b"\xd9" + struct.pack(">B", n) + raw
        if n <= 0xFFFF:
            return b"\xda" + struct.pack(">H", n) + raw
        return b"\xdb" + struct.pack(">I", n) + raw
    if isinstance(obj, int):
        if 0 <= obj <= 0x7F:
            return bytes([obj])
        if -32 <= obj < 0:
            return struct.pack(">b", obj)
        for lo, hi, tag, fmt in _INT_FORMATS:
            if lo <= obj <= hi:
                return tag + struct.pack(fmt, obj)
        raise OverflowError(f"pack_canonical: {obj} does not fit in 64 bits")
    n = len(obj)
    if n <= 15:
        head = bytes([0x90 | n])
    else:
        head = b"\xdc" + struct.pack(">H", n) if n <= 0xFFFF else b"\xdd" + struct.pack(">I", n)
    return head + b"".join(pack_canonical(x) for x in obj)


#: (min, max, tag, struct format) in the order msgpack prefers them: unsigned first, smallest first.
_INT_FORMATS: tuple[tuple[int, int, bytes, str], ...] = (
    (0, 0xFF, b"\xcc", ">B"),
    (0, 0xFFFF, b"\xcd", ">H"),
    (0, 0xFFFFFFFF, b"\xce", ">I"),
    (0, 0xFFFFFFFFFFFFFFFF, b"\xcf", ">Q"),
    (-0x80, -1, b"\xd0", ">b"),
    (-0x8000, -1, b"\xd1", ">h"),
    (-0x80000000, -1, b"\xd2", ">i"),
    (-0x8000000000000000, -1, b"\xd3", ">q"),
)


@dataclass(frozen=True)
class KVLayout:
    """The shape of one model's KV cache as kvtier stores it.

    A block is ``[num_layers, 2, block_tokens, num_kv_heads, head_dim]`` (K and V of
    ``block_tokens`` consecutive tokens for every layer) unless a connector declares the engine's
    own page shape through ``block_shape_override``; its byte size must stay the same.
    The fingerprint covers every field, so blocks of two layouts never share a key.
    """

    model_id: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"
    block_tokens: int = 16
    revision: str = "main"
    tp_rank: int = 0
    tp_size: int = 1
    block_shape_override: tuple[int, ...] | None = field(default=None)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"KVLayout.dtype: unsupported {self.dtype!r}; one of {sorted(DTYPES)}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_tokens", "tp_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KVLayout.{name} must be positive")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError("KVLayout.tp_rank must be in [0, tp_size)")
        if self.block_shape_override is not None:
            n = 1
            for d in self.block_shape_override:
                n *= d
            if n * self.itemsize != self.bytes_per_block:
                raise ValueError("KVLayout.block_shape_override must hold exactly bytes_per_block")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype][0]

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype][1]

    @property
    def block_shape(self) -> tuple[int, ...]:
        if self.block_shape_override is not None:
            return tuple(self.block_shape_override)
        return (self.num_layers, 2, self.block_tokens, self.num_kv_heads, self.head_dim)

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_tokens

    @cached_property
    def fingerprint(self) -> LayoutFingerprint:
        """sha256 over a canonical msgpack encoding of every field (stable across processes)."""
        canon = pack_canonical(
            [
                "kvtier-layout-v1",
                self.model_id,
                self.revision,
                self.num_layers,
                self.num_kv_heads,
                self.head_dim,
                self.dtype,
                self.block_tokens,
                self.tp_rank,
                self.tp_size,
                list(self.block_shape),
            ]
        )
        return LayoutFingerprint(hashlib.sha256(canon).digest())

    @property
    def fingerprint_hex(self) -> str:
        """Short printable form used in object names (16 bytes of the hash)."""
        return self.fingerprint[:16].hex()

    def empty_block(self, device: str | torch.device = "cpu") -> torch.Tensor:
        return torch.empty(self.block_shape, dtype=self.torch_dtype, device=device)
