"""Write policies of TieredStore with a remote S3 tier: write-through, write-back, none; the bounded
asynchronous uploader; draining on close. Real SeaweedFS, real LMDB, real memory tier."""

from __future__ import annotations

import pytest

from kvtier import codec
from kvtier.errors import ConfigError
from kvtier.store.remote_writer import RemoteWriter, RemoteWriterOptions
from kvtier.store.tiered_store import TieredStore
from storage_backends.lmdb import LmdbTier
from storage_backends.memory import MemoryTier
from tests.helpers import SMALL, chain_blocks, same_bytes

BPB = SMALL.bytes_per_block
REC = max(len(codec.encode(b)) for b in chain_blocks(2))  # an LMDB record: payload + header (+ parent)


def _store(tmp_path, remote, policy: str, *, mem_blocks: int = 64, disk_blocks: int = 64) -> TieredStore:
    return TieredStore(
        [MemoryTier(mem_blocks * BPB), LmdbTier(tmp_path / f"lmdb-{policy}", disk_blocks * REC)],
        remote=remote, write_policy=policy,
    )


def test_write_through_lets_another_node_hit(tmp_path, make_s3_tier) -> None:
    node_a = _store(tmp_path, make_s3_tier(), "write-through")
    blocks = chain_blocks(6)
    keys = [b.key for b in blocks]
    node_a.put(blocks)
    assert node_a.flush_remote(timeout_s=30)
    assert node_a.lookup(keys).blocks_in("memory") == 6  # served locally, uploaded as well

    node_b = TieredStore([MemoryTier(64 * BPB)], remote=make_s3_tier(), write_policy="none")
    lk = node_b.lookup(keys)
    assert lk.length == 6 and lk.blocks_in("s3") == 6
    got = node_b.load(lk)
    assert len(got) == 6 and all(same_bytes(g, b) for g, b in zip(got, blocks, strict=True))
    assert node_b.lookup(keys).blocks_in("memory") == 6  # promoted on hit
    node_a.close()
    node_b.close()


def test_write_through_uploads_a_copy_taken_at_put(tmp_path, make_s3_tier) -> None:
    remote = make_s3_tier()
    store = _store(tmp_path, remote, "write-through")
    blocks = chain_blocks(3)
    reference = chain_blocks(3)
    store.put(blocks)
    for b in blocks:
        b.data.zero_()  # the engine reuses its pages right after put returns
    store.close()  # drains, then closes the tiers
    got = make_s3_tier().get([b.key for b in reference])  # read back as another node
    assert all(g is not None and same_bytes(g, r) for g, r in zip(got, reference, strict=True))


def test_write_back_uploads_only_what_leaves_the_disk_tier(tmp_path, make_s3_tier) -> None:
    remote = make_s3_tier()
    store = _store(tmp_path, remote, "write-back", mem_blocks=2, disk_blocks=3)
    blocks = chain_blocks(8)
    keys = [b.key for b in blocks]
    for b in blocks:
        store.put([b])
    assert store.flush_remote(timeout_s=30)
    in_s3 = [remote.contains([k]) == 1 for k in keys]
    local = [store.tiers[0].contains([k]) == 1 or store.tiers[1].contains([k]) == 1 for k in keys]
    assert sum(local) == 5 and sum(in_s3) == 3
    assert in_s3 == [not x for x in local], "exactly the blocks evicted from disk went to S3"
    lk = store.lookup(keys)
    assert lk.length == 8 and lk.blocks_in("s3") == 3
    got = store.load(lk)
    assert all(same_bytes(g, b) for g, b in zip(got, blocks, strict=True))
    store.close()


def test_policy_none_never_writes_the_remote(tmp_path, make_s3_tier) -> None:
    remote = make_s3_tier()
    store = _store(tmp_path, remote, "none", mem_blocks=1, disk_blocks=1)
    store.put(chain_blocks(4))  # evictions from the 1-block disk tier are dropped, not uploaded
    assert store.flush_remote(30)
    assert remote.metrics.snapshot()["puts"] == 0
    assert remote.usage().blocks == 0
    store.close()


def test_pending_uploads_are_bounded_and_drained_on_close(make_s3_tier) -> None:
    remote = make_s3_tier()
    writer = RemoteWriter(remote, RemoteWriterOptions(max_pending_bytes=2 * BPB, workers=1))
    blocks = chain_blocks(5)
    assert writer.submit(blocks) == 2  # one call: the bound is checked before anything is uploaded
    assert remote.metrics.snapshot()["errors"]["dropped_put"] == 3
    assert writer.stats().pending_bytes <= 2 * BPB
    writer.close()
    s = writer.stats()
    assert (s.submitted, s.uploaded, s.dropped, s.pending_blocks) == (2, 2, 3, 0)
    assert remote.contains([b.key for b in blocks]) == 2


def test_a_block_put_again_is_not_uploaded_again(make_s3_tier) -> None:
    remote = make_s3_tier()
    writer = RemoteWriter(remote)
    blocks = chain_blocks(3)
    writer.submit(blocks)
    writer.flush(30)
    puts = remote.request_counts()["put"]
    assert writer.submit(blocks) == 0
    writer.flush(30)
    assert remote.request_counts()["put"] == puts
    writer.forget([blocks[0].key])  # its remote copy was deleted: the next put uploads it again
    assert writer.submit(blocks) == 1
    writer.close()


def test_purge_cancels_pending_uploads_of_the_scope(tmp_path, make_s3_tier) -> None:
    from kvtier.keys import Scope

    remote = make_s3_tier()
    store = _store(tmp_path, remote, "write-through")
    alice = chain_blocks(4, scope=Scope.user("alice"))
    store.put(alice)
    store.delete_scope(alice[0].meta.domain)
    store.flush_remote(30)
    assert remote.keys_in_scope(alice[0].meta.domain) == []  # nothing landed after the purge
    store.close()


@pytest.mark.parametrize(("policy", "with_remote", "match"), [
    ("write-sideways", True, "unknown 'write-sideways'"),
    ("write-through", False, "needs a remote tier"),
    ("write-back", False, "needs a remote tier"),
])
def test_bad_write_policy_is_a_config_error(make_s3_tier, policy: str, with_remote: bool, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        TieredStore([MemoryTier(BPB)], remote=make_s3_tier() if with_remote else None, write_policy=policy)


def test_bad_writer_options_are_config_errors(make_s3_tier) -> None:
    remote = make_s3_tier()
    for opts in (RemoteWriterOptions(max_pending_bytes=0), RemoteWriterOptions(workers=0),
                 RemoteWriterOptions(batch_blocks=0)):
        with pytest.raises(ConfigError, match="RemoteWriterOptions"):
            RemoteWriter(remote, opts)
