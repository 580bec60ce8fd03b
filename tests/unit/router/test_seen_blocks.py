"""The router's record of the blocks it sent (kvtier/router/seen_blocks.py): never a false
"unseen"; a false "seen" only as the filter fills."""

from __future__ import annotations

import os

from kvtier.router.engine_cache import DIGEST_BYTES
from kvtier.router.seen_blocks import SeenBlocks


def _digests(n: int) -> list[bytes]:
    return [os.urandom(DIGEST_BYTES) for _ in range(n)]


def test_every_digest_added_reads_as_seen_and_others_as_unseen() -> None:
    s = SeenBlocks(bits=1 << 20)
    sent, other = _digests(1000), _digests(1000)
    assert s.none_seen(sent)  # control: empty
    s.add(sent)
    assert all(s.seen(d) for d in sent)
    assert not s.none_seen(other + sent[-1:])
    # 1,000 digests in 2^20 bits: a false positive in 1,000 is unlikely (about 1e-10 each).
    assert s.none_seen(other)


def test_a_full_filter_errs_towards_seen() -> None:
    """Filled far beyond its size, it says "seen" of most digests it never had: the router then
    asks Locate, never skips it wrongly."""
    s = SeenBlocks(bits=1 << 10)
    s.add(_digests(2000))
    fresh = _digests(200)
    assert sum(s.seen(d) for d in fresh) > 150


def test_leading_counts_the_seen_prefix() -> None:
    s = SeenBlocks(bits=1 << 20)
    chain = _digests(5)
    s.add(chain[:3])
    assert s.leading(chain) == 3
    assert s.leading(chain[3:]) == 0
    assert s.leading([]) == 0
    # Longer chains are probed in growing chunks (16, 64, 256, ...): a prefix ending past a chunk.
    long = _digests(400)
    s.add(long[:300])
    assert s.leading(long) == 300
    assert s.leading(long[:300]) == 300
    assert s.leading(long[:16]) == 16


def test_digests_added_together_are_each_seen_where_their_probes_share_a_byte() -> None:
    """One ``add`` of many digests into a small filter: probes of different digests land in the
    same byte, and every one of their bits must stay set (a plain indexed ``|=`` keeps one)."""
    s = SeenBlocks(bits=64)
    chain = _digests(50)
    s.add(chain)
    assert all(s.seen(d) for d in chain)
    assert s.leading(chain) == 50
    assert not s.none_seen(chain)
