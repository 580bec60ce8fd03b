"""A set of block digests that never says "absent" wrongly: a Bloom filter.

The router keeps one per node (the blocks that may be in its tiers) and one for the fleet, to
decide without ``Locate`` where its answer is bounded (kvtier/router/held_rule.py).

A Bloom filter never forgets and never says "unseen" of a digest it was given; it may say "seen"
of one it was not (a false positive, which only costs the request a ``Locate``). It has a fixed
size: with ``bits`` of 2^24 (2 MiB) and 4 probes, about 1 % of unseen digests read as seen after
1.5 million digests, 5 % after 2.5 million (2^27 bits: 12 and 20 million); as it fills the router
asks ``Locate`` more, never less. The digests are already keyed hashes (kvtier/router/engine_cache.py), so their own
bytes are the probes.

Event-loop only (not thread-safe).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvtier.router.engine_cache import DIGEST_BYTES

PROBES = 4


class SeenBlocks:
    """A Bloom filter over block digests (module docstring). Invariant: every digest ``add``-ed
    reads as seen.

    A prompt's digests are probed together, as one array: a 131,072-token prompt has 8,192 blocks,
    and a probe at a time in Python held the event loop 19 ms a filter to add them
    (benchmarks/results/issue30/scripts/router_cpu.py).
    """

    def __init__(self, bits: int = 1 << 24) -> None:
        assert 0 < bits < 1 << 32 and bits % 8 == 0  # a probe is a 32-bit word modulo ``bits``
        assert PROBES * 4 <= DIGEST_BYTES
        self.bits = bits
        self._array = np.zeros(bits // 8, dtype=np.uint8)

    def _probes(self, digests: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray]:
        """Per digest (rows) and probe (columns), the byte of the filter and the bit in it: probe
        ``i`` is the digest's ``i``-th little-endian 32-bit word modulo the filter's size."""
        raw = b"".join(digests)
        assert len(raw) == DIGEST_BYTES * len(digests), "a digest of the wrong size"
        words = np.frombuffer(raw, dtype="<u4").reshape(len(digests), DIGEST_BYTES // 4)[:, :PROBES]
        at = words % np.uint32(self.bits)
        return at >> 3, np.left_shift(np.uint8(1), (at & 7).astype(np.uint8))

    def _hits(self, digests: Sequence[bytes]) -> np.ndarray:
        """Per digest, whether it reads as seen."""
        if not digests:
            return np.zeros(0, dtype=bool)
        byte, bit = self._probes(digests)
        return (self._array[byte] & bit).all(axis=1)

    def add(self, digests: Sequence[bytes]) -> None:
        if not digests:
            return
        byte, bit = self._probes(digests)
        # ``.at`` applies every index, repeated ones included (a plain ``|=`` keeps one write each).
        np.bitwise_or.at(self._array, byte.ravel(), bit.ravel())

    def seen(self, digest: bytes) -> bool:
        return bool(self._hits([digest])[0])

    def none_seen(self, digests: Sequence[bytes]) -> bool:
        return not self._hits(digests).any()

    def leading(self, digests: Sequence[bytes]) -> int:
        """How many leading digests read as seen (at least as many as were sent)."""
        # In growing chunks: most prompts asked about stop early (a node that holds none of it).
        n, size = 0, 16
        while n < len(digests):
            hits = self._hits(digests[n : n + size])
            missing = np.flatnonzero(~hits)
            if missing.size:
                return n + int(missing[0])
            n += len(hits)
            size *= 4
        return n
