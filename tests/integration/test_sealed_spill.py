"""Write-back spills LMDB records to S3 as the sealed bytes they are: no decrypt and re-encrypt.

Real LMDB, real SeaweedFS, a real key ring. A record sealed again would carry a fresh nonce, so
byte equality between the LMDB record and the S3 object is what proves it was moved as it was.
"""

from __future__ import annotations

from kvtier import codec
from kvtier.security.keyring import KeyRing
from kvtier.security.master_keys import FileKeyProvider, write_master_key
from kvtier.security.wrapped_keys import FileWrappedKeyStore
from kvtier.store.tiered_store import TieredStore
from storage_backends.lmdb import LmdbTier
from tests.helpers import chain_blocks, same_bytes


def _ring(tmp_path, name: str = "ring") -> KeyRing:
    key = tmp_path / f"{name}.key"
    if not key.exists():
        write_master_key(key)
    return KeyRing(FileKeyProvider(key), FileWrappedKeyStore(tmp_path / f"{name}-keys"))


def test_spilled_records_reach_s3_byte_for_byte_and_read_back(tmp_path, make_s3_tier, raw_s3) -> None:
    ring = _ring(tmp_path)
    blocks = chain_blocks(3) + chain_blocks(3, token_base=50_000, seed=1)  # two chains: no parent is protected
    rec = len(codec.encode(blocks[0], ring))
    disk = LmdbTier(tmp_path / "lmdb", 3 * rec + rec // 2, sealer=ring)
    remote = make_s3_tier(sealer=ring)
    store = TieredStore([disk], remote=remote, write_policy="write-back")
    store.put(blocks[:3])
    with disk.env.begin(db=disk._rec) as txn:
        sealed = {b.key: bytes(txn.get(b.key)) for b in blocks[:3]}
    store.put(blocks[3:])  # evicts the first three from LMDB into the write-back queue
    assert store.flush_remote(timeout_s=30)
    for b in blocks[:3]:
        assert disk.contains([b.key]) == 0
        body = raw_s3.get_object(Bucket=remote.config.bucket, Key=remote.namer.name(b.key))["Body"].read()
        assert body == sealed[b.key], "the object is the LMDB record as it was, not a new sealing"
    got = remote.get([b.key for b in blocks[:3]])
    assert all(g is not None and same_bytes(g, b) for g, b in zip(got, blocks[:3], strict=True))
    store.close()


def test_a_remote_tier_with_another_key_ring_gets_the_record_sealed_its_own_way(
    tmp_path, make_s3_tier, raw_s3
) -> None:
    disk_ring, remote_ring = _ring(tmp_path, "disk"), _ring(tmp_path, "remote")
    blocks = chain_blocks(2) + chain_blocks(2, token_base=50_000, seed=1)
    rec = len(codec.encode(blocks[0], disk_ring))
    disk = LmdbTier(tmp_path / "lmdb", 2 * rec + rec // 2, sealer=disk_ring)
    remote = make_s3_tier(sealer=remote_ring)
    store = TieredStore([disk], remote=remote, write_policy="write-back")
    store.put(blocks[:2])
    store.put(blocks[2:])
    assert store.flush_remote(timeout_s=30)
    got = remote.get([b.key for b in blocks[:2]])
    assert all(g is not None and same_bytes(g, b) for g, b in zip(got, blocks[:2], strict=True))
    body = raw_s3.get_object(Bucket=remote.config.bucket, Key=remote.namer.name(blocks[0].key))["Body"].read()
    # Opened with the disk's ring and sealed again with the remote's: the disk's ring cannot open it.
    assert codec.decode(body, sealer=remote_ring).key == blocks[0].key
    store.close()
