"""SliceAllocator: disjoint aligned slices, a best effort when the region is busy, merging on release."""

from __future__ import annotations

import random
from itertools import pairwise

from kvtier.dataplane.slices import ALIGN, MIN_SLICE, SliceAllocator


def test_slices_are_disjoint_aligned_and_merge_back() -> None:
    a = SliceAllocator(1 << 20)
    s1, s2 = a.take(100), a.take(3 * ALIGN + 1)
    assert s1 is not None and s2 is not None
    assert (s1.offset, s1.nbytes) == (0, ALIGN) and (s2.offset, s2.nbytes) == (ALIGN, 4 * ALIGN)
    a.release(s1)
    a.release(s2)
    assert a.free_bytes() == 1 << 20 and a.take(1 << 20) is not None


def test_a_busy_region_gives_the_largest_free_part_or_nothing() -> None:
    a = SliceAllocator(1 << 20)
    whole = a.take(1 << 20)
    assert whole is not None and a.take(ALIGN) is None
    a.release(whole)
    first = a.take((1 << 20) - MIN_SLICE)
    assert first is not None
    rest = a.take(1 << 20)
    assert rest is not None and rest.nbytes == MIN_SLICE, "the largest free part, though smaller than asked"
    assert a.take(ALIGN) is None


def test_random_take_and_release_never_overlap() -> None:
    rng = random.Random(3)
    a = SliceAllocator(64 * ALIGN)
    held = []
    for _ in range(2000):
        if held and rng.random() < 0.5:
            a.release(held.pop(rng.randrange(len(held))))
        else:
            s = a.take(rng.randint(1, 8) * ALIGN)
            if s is not None:
                held.append(s)
        spans = sorted((s.offset, s.offset + s.nbytes) for s in held)
        assert all(x[1] <= y[0] for x, y in pairwise(spans))
        assert a.free_bytes() + sum(s.nbytes for s in held) == 64 * ALIGN


def test_a_lease_trims_to_what_was_used_and_releases_on_the_last_drop() -> None:
    import gc

    import numpy as np

    from kvtier.dataplane.slices import SliceLease

    a = SliceAllocator(1 << 20)
    s = a.take(1 << 20)
    assert s is not None
    lease = SliceLease(a, s)
    lease.trim(3 * ALIGN - 5)
    assert lease.slice.nbytes == 3 * ALIGN and a.free_bytes() == (1 << 20) - 3 * ALIGN
    view = np.zeros(8)
    lease.hold(view)
    lease.drop()  # the call ends; the view still holds the slice
    assert a.free_bytes() == (1 << 20) - 3 * ALIGN
    del view
    gc.collect()
    assert a.free_bytes() == 1 << 20
