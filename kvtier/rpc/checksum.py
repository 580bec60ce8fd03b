"""The payload checksum (xxh3-64), computed while a payload is copied.

Hashing a block after copying it reads every byte from memory a second time; for a block larger
than the cache that is a second full pass. Copying in pieces of ``PIECE_BYTES`` and hashing each
piece right after it lands reads it from cache instead (measured on the 2-core machine: a 32 MiB
copy then hash 10-12 ms, piece by piece 8 ms). The digest is the same as hashing the whole
payload at once: xxh3's streaming and one-shot forms agree.
"""

from __future__ import annotations

import numpy as np
import xxhash

#: Bytes copied, then hashed, at a time: small enough to stay in a core's L2 cache.
PIECE_BYTES = 256 << 10


def copy_hashed(dst: np.ndarray, src: np.ndarray) -> int:
    """Copy ``src`` into ``dst`` (flat uint8 arrays of one size) and return the xxh3-64 of the
    bytes as they are in ``dst``: what was written, even if ``src`` changes meanwhile."""
    assert dst.shape == src.shape and dst.dtype == src.dtype == np.uint8, "flat uint8 arrays of one size"
    n = dst.size
    if n <= PIECE_BYTES:
        np.copyto(dst, src)
        return xxhash.xxh3_64_intdigest(memoryview(dst))
    h = xxhash.xxh3_64()
    for o in range(0, n, PIECE_BYTES):
        piece = dst[o : o + PIECE_BYTES]
        np.copyto(piece, src[o : o + PIECE_BYTES])
        h.update(memoryview(piece))
    return h.intdigest()
