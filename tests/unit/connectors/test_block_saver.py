"""BlockSaver stores save jobs off the step, in order, bounded; a bug inside it surfaces."""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest

from connectors.block_saver import BlockSaver
from connectors.identity import HmacSaltMapper
from connectors.provision import LocalSource
from kvtier.cache.kv_cache import KVCache
from kvtier.keys import DomainDeriver
from kvtier.security.policy import Policy
from kvtier.store.tiered_store import TieredStore
from storage_backends.memory import MemoryTier
from tests.helpers import SMALL


def test_jobs_are_stored_in_order_and_counted() -> None:
    lock, stats, seen = threading.Lock(), Counter(), []
    release = threading.Event()

    def save(job, tensors):
        release.wait(5)
        seen.append((job, tensors))
        return Counter(saved_blocks=len(tensors))

    saver = BlockSaver(save, lock, stats, max_queued=2)
    submitter = threading.Thread(target=lambda: [saver.submit(i, [i] * (i + 1)) for i in range(4)])
    submitter.start()
    # Job 0 is held by the saver, 1 and 2 fill the queue: job 3 has to wait, and is counted.
    deadline = time.monotonic() + 10
    while stats["save_backpressure"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    release.set()
    submitter.join()
    saver.flush()
    assert [j for j, _ in seen] == [0, 1, 2, 3] and stats["saved_blocks"] == 10 and saver.pending == 0
    assert stats["save_backpressure"] >= 1, "a full queue made the submitter wait, and said so"
    saver.close()


def test_a_bug_in_the_saver_surfaces_on_the_submitting_thread() -> None:
    def save(job, tensors):
        raise RuntimeError("bug")

    released: list[int] = []
    saver = BlockSaver(save, threading.Lock(), Counter())
    saver.submit(0, [], lambda: released.append(0))
    with pytest.raises(RuntimeError, match="bug"):
        saver.flush()
    assert released == [0], "the job's memory is given back even when storing it failed"
    saver.submit(1, [], lambda: released.append(1))  # the thread is gone: nothing stores job 1
    saver.close()


def test_each_jobs_memory_is_released_once_after_it_was_stored() -> None:
    order: list[str] = []

    def save(job, tensors):
        order.append(f"save {job}")
        return Counter()

    saver = BlockSaver(save, threading.Lock(), Counter())
    for j in range(3):
        saver.submit(j, [], lambda j=j: order.append(f"release {j}"))
    saver.flush()
    assert order == ["save 0", "release 0", "save 1", "release 1", "save 2", "release 2"]
    saver.close()


def test_a_memory_cache_is_not_shared_across_processes_and_says_so() -> None:
    cache = KVCache(TieredStore([MemoryTier(1 << 20)]), SMALL, Policy(DomainDeriver(b"s" * 32)))
    src = LocalSource(cache, HmacSaltMapper(b"k" * 32))
    assert src.shared_across_processes is False
    assert src.for_salt(None) is None
