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

from collections.abc import Iterable

from kvtier.router.engine_cache import DIGEST_BYTES

PROBES = 4


class SeenBlocks:
    """A Bloom filter over block digests (module docstring). Invariant: every digest ``add``-ed
    reads as seen."""

    def __init__(self, bits: int = 1 << 24) -> None:
        assert bits > 0 and bits % 8 == 0
        assert PROBES * 4 <= DIGEST_BYTES
        self.bits = bits
        self._array = bytearray(bits // 8)

    def _probes(self, digest: bytes) -> list[int]:
        assert len(digest) == DIGEST_BYTES, len(digest)
        return [int.from_bytes(digest[4 * i : 4 * i + 4], "little") % self.bits for i in range(PROBES)]

    def add(self, digests: Iterable[bytes]) -> None:
        a = self._array
        for d in digests:
            for p in self._probes(d):
                a[p >> 3] |= 1 << (p & 7)

    def seen(self, digest: bytes) -> bool:
        a = self._array
        return all(a[p >> 3] & (1 << (p & 7)) for p in self._probes(digest))

    def none_seen(self, digests: Iterable[bytes]) -> bool:
        return not any(self.seen(d) for d in digests)

    def leading(self, digests: Iterable[bytes]) -> int:
        """How many leading digests read as seen (at least as many as were sent)."""
        n = 0
        for d in digests:
            if not self.seen(d):
                break
            n += 1
        return n
