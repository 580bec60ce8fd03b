"""Blocks framed as they arrive: a payload copied once, straight into the WireFrame that keeps it.

A block put through the shared-memory data plane used to cost the daemon two copies into memory
it had never touched (out of the client's region into a tensor, then into the frame its RAM tier
keeps) and a hash that read the copy back. ``frame_from_region`` makes the frame first and copies
the payload into it once, hashing each piece while it is still in cache (``copy_hashed``), and the
block it returns views the frame's payload, so ``FrameMemoryTier`` keeps that frame as it is.
A disk tier that knows a record's payload checksum decrypts it into a frame the same way
(``FrameBuilder``).

The frame is a ``bytes`` object, because gRPC sends only ``bytes`` and a frame is sent as it is.
It is made with ``PyBytes_FromStringAndSize(NULL, n)`` and filled before anything else can see
it: the C API's documented way to build a bytes object in place (its contents are uninitialized
until written). Once the function returns, nothing writes to it again.
"""

from __future__ import annotations

import ctypes
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch

from kvtier.block import Block, BlockMeta
from kvtier.errors import InvalidRequest
from kvtier.layout import DTYPES
from kvtier.rpc.checksum import copy_hashed
from kvtier.rpc.wire import WireFrame, frame_ends

_new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
_new_bytes.restype = ctypes.py_object
_new_bytes.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)
_bytes_address = ctypes.pythonapi.PyBytes_AsString
_bytes_address.restype = ctypes.c_void_p
_bytes_address.argtypes = (ctypes.py_object,)


@dataclass(slots=True)
class FramedBlock(Block):
    """A Block whose payload is the payload of ``frame`` (a read-only view of its bytes).

    Invariant: ``data`` views ``frame.data`` and is never written (the bytes are immutable once
    the frame is made); ``checksum`` is the frame's, verified when the frame was filled.
    """

    frame: WireFrame = field(kw_only=True)


class FrameBuilder:
    """A new frame for ``meta`` whose payload checksum is known before its bytes are: fill
    ``payload`` (writable, uint8), then ``finish``. Nothing else may hold ``payload`` after that.

    Invariant: the frame's bytes are written only between construction and ``finish``, while
    this builder holds the only reference to them.
    """

    __slots__ = ("_data", "_head", "checksum", "meta", "payload")

    def __init__(self, meta: BlockMeta, checksum: int) -> None:
        self.meta = meta
        self.checksum = checksum
        head, tail = frame_ends(meta, checksum)
        n = meta.nbytes
        size = len(head) + n + len(tail)
        self._data: bytes = _new_bytes(None, size)
        self._head = len(head)
        buf = np.ctypeslib.as_array((ctypes.c_ubyte * size).from_address(_bytes_address(self._data)))
        buf[: len(head)] = np.frombuffer(head, dtype=np.uint8)
        buf[len(head) + n :] = np.frombuffer(tail, dtype=np.uint8)
        self.payload: np.ndarray = buf[len(head) : len(head) + n]

    def tensor(self) -> torch.Tensor:
        """``payload`` as a writable tensor of the block's dtype and shape (to decode into)."""
        return torch.from_numpy(self.payload).view(DTYPES[self.meta.dtype][0]).reshape(self.meta.shape)

    def finish(self) -> FramedBlock:
        """The block, once ``payload`` holds the bytes whose xxh3 is ``checksum``."""
        del self.payload
        meta, data = self.meta, self._data
        frame = WireFrame(meta, data, self._head, self.checksum)
        with warnings.catch_warnings():
            # torch warns that a bytes object is not writable; this tensor is never written.
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(data, dtype=DTYPES[meta.dtype][0], count=meta.nbytes // DTYPES[meta.dtype][1],
                                    offset=self._head)
        return FramedBlock(meta, flat.reshape(meta.shape), self.checksum, frame=frame)


def frame_from_region(meta: BlockMeta, src: np.ndarray, checksum: int) -> FramedBlock:
    """A FramedBlock of ``src`` (the payload's bytes, flat uint8, e.g. a shared-memory window):
    the payload copied into a new frame and hashed as it is copied. InvalidRequest if the xxh3 of
    the bytes copied is not ``checksum``."""
    if src.size != meta.nbytes:
        raise InvalidRequest(f"region holds {src.size} bytes for a block of {meta.nbytes}")
    builder = FrameBuilder(meta, checksum)
    if copy_hashed(builder.payload, src) != checksum:
        raise InvalidRequest("payload checksum mismatch")
    return builder.finish()
