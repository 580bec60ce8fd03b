"""Issue 17, point 1: after a purge, someone who later has the master key and a copy of the
storage decrypts nothing of the purged scopes.

The attacker's view, against real LMDB and the real embedded SeaweedFS: tenant A stores marked
blocks in its user, session and org scopes through every tier (memory, encrypted LMDB, encrypted
S3); the scopes are purged; the node restarts. Then every byte of the LMDB files, the key store
and the SeaweedFS data directory is scanned for wrapped data keys of the purged scopes, each
candidate is unwrapped with the master key, and every record found is opened with whatever was
unwrapped. Before the purge the same scan recovers the keys and decrypts the markers (it is a
working attack); after it, nothing of the purged scopes unwraps or decrypts, while another
tenant's scope still does (the scan still works).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kvtier import codec
from kvtier.cache.kv_cache import RequestSegment
from kvtier.errors import CorruptRecord, KvtierError
from kvtier.keys import ScopeDomain
from kvtier.security.master_keys import FileKeyProvider, _wrap_context
from kvtier.security.policy import ROLE_PUBLISH_ORG, Principal
from kvtier.security.wrapped_keys import WrappedKey
from kvtier.server.embedded_s3 import EmbeddedS3
from storage_backends.s3 import SeaweedVacuum
from tests.helpers import SMALL
from tests.security.builders import ACME_ADMIN, ALICE, BOB, CacheRig, files_under

BT = SMALL.block_tokens
#: Alice, with the role to write her org's scope too.
WRITER = Principal(ALICE.tenant, ALICE.user, org=ALICE.org, session=ALICE.session, roles={ROLE_PUBLISH_ORG})
MARK = 7.25  # every element of a marker block


def marker_tensors(n: int) -> list[torch.Tensor]:
    return [torch.full(SMALL.block_shape, MARK + i, dtype=SMALL.torch_dtype) for i in range(n)]


class Attacker:
    """Raw bytes of storage plus the master key: recover data keys, then open records."""

    def __init__(self, master_key: Path, roots: list[Path]) -> None:
        self.provider = FileKeyProvider(master_key)
        self.blobs = [f.read_bytes() for r in roots for f in files_under(r) if f.is_file()]

    def data_keys(self, domain: ScopeDomain) -> dict[bytes, bytes]:
        """Every DEK of ``domain`` whose wrapped form is anywhere in the bytes and unwraps."""
        found: dict[bytes, bytes] = {}
        pattern = b"\x96\x01\xc4\x10" + domain  # msgpack of a WrappedKey record: [1, domain, ...]
        for data in self.blobs:
            at = data.find(pattern)
            while at >= 0:
                try:
                    unpacker = msgpack.Unpacker(io.BytesIO(data[at : at + 4096]), raw=False)
                    wk = WrappedKey.decode(msgpack.packb(next(unpacker)))
                    found[wk.dek_id] = self.provider.unwrap(wk.wrapped, _wrap_context(wk.domain, wk.dek_id))
                except (ValueError, StopIteration, KvtierError, InvalidTag, TypeError, msgpack.UnpackException):
                    pass
                at = data.find(pattern, at + 1)
        return found

    def decrypted(self, domain: ScopeDomain, deks: dict[bytes, bytes]) -> list[torch.Tensor]:
        """Every record of ``domain`` in the bytes that opens with one of ``deks``."""
        out = []
        sealer = _Sealer(deks)
        for data in self.blobs:
            at = data.find(codec.MAGIC)
            while at >= 0:
                if domain in data[at : at + 512]:
                    rec = _record_at(data, at)
                    if rec is not None:
                        try:
                            out.append(codec.decode(rec, sealer=sealer).data)
                        except (KvtierError, ValueError):
                            pass
                at = data.find(codec.MAGIC, at + 1)
        return out


class _Sealer:
    def __init__(self, deks: dict[bytes, bytes]) -> None:
        self.deks = deks

    def open_into(self, domain: Any, envelope: dict[str, Any], aad: bytes, sealed: memoryview, out: memoryview) -> None:
        dek = self.deks.get(envelope.get("k"))
        if dek is None:
            raise CorruptRecord("no key")
        try:
            out[:] = AESGCM(dek).decrypt(envelope["n"], bytes(sealed), aad)
        except InvalidTag:
            raise CorruptRecord("tag") from None


def _record_at(data: bytes, at: int) -> bytes | None:
    """The whole record starting at ``at`` (its length read from its own header), or None."""
    try:
        _, _, _, hlen, _ = codec._PREFIX.unpack_from(data, at)
        p = codec.PREFIX_BYTES
        h = msgpack.unpackb(data[at + p : at + p + hlen], raw=False)
        total = p + hlen + codec._pad(p + hlen) + int(h["n"])
    except Exception:  # any garbage is simply not a record
        return None
    return data[at : at + total] if at + total <= len(data) else None


@pytest.fixture
def rig(tmp_path: Path, make_s3_tier, s3_server: EmbeddedS3):
    vacuum = SeaweedVacuum(s3_server.master_url)
    r = CacheRig(tmp_path, ("memory", "lmdb", "s3"), make_s3=make_s3_tier, compactors=(vacuum,))
    yield r
    r.close()


def test_a_purge_leaves_nothing_that_decrypts_for_someone_with_the_master_key(
    rig: CacheRig, s3_server: EmbeddedS3
) -> None:
    scopes = {"user": ALICE.user_scope(), "session": ALICE.session_scope(), "org": ALICE.org_scope()}
    domains = {k: rig.policy.domain(s) for k, s in scopes.items()}
    for i, kind in enumerate(scopes):
        chain = rig.cache.chain(WRITER, [RequestSegment(list(range(10_000 * (i + 1), 10_000 * (i + 1) + 4 * BT)),
                                                       kind)])
        rig.cache.save(WRITER, chain, marker_tensors(4))
        blocks = rig.cache.load(ALICE, chain)
        assert len(blocks) == 4
        for tier in ("lmdb", "s3"):  # every tier holds every marker block
            rig.tier(tier).put(blocks)
    bob = rig.cache.chain(BOB, [RequestSegment(list(range(90_000, 90_000 + 2 * BT)), "user")])
    rig.cache.save(BOB, bob, marker_tensors(2))
    rig.tier("lmdb").put(rig.cache.load(BOB, bob))
    bob_domain = rig.policy.domain(BOB.user_scope())
    roots = [rig.root, s3_server.data_dir]

    before = Attacker(rig.master_key_path, roots)
    for kind, dom in domains.items():
        deks = before.data_keys(dom)
        assert deks, f"control: the {kind} key is recoverable before the purge"
        opened = before.decrypted(dom, deks)
        assert opened and all(float(t.reshape(-1)[0]) >= MARK for t in opened), f"control: {kind} markers decrypt"

    reports = [rig.cache.purge(ALICE, "user", reason="forensic"), rig.cache.purge(ALICE, "session"),
               rig.cache.purge(ACME_ADMIN, "org:acme/eng")]
    for report in reports:
        assert report.total >= 4 and report.keys_destroyed >= 1
        assert report.compacted["seaweedfs_vacuum"].startswith("vacuumed")
    rig.restart()

    after = Attacker(rig.master_key_path, roots)
    volumes = Attacker(rig.master_key_path, [s3_server.data_dir])
    for kind, dom in domains.items():
        assert after.data_keys(dom) == {}, f"a data key of the purged {kind} scope still unwraps"
        assert after.decrypted(dom, after.data_keys(dom)) == []
        # Even with the keys as they were before the purge (stolen earlier), the SeaweedFS volumes
        # hold no record of the scope any more: the purge vacuumed them.
        assert volumes.decrypted(dom, before.data_keys(dom)) == [], f"{kind} records are still in the volumes"
    # The scan still works: the other tenant's scope is recoverable (the attack is not blind).
    kept = after.data_keys(bob_domain)
    assert kept and after.decrypted(bob_domain, kept)


def test_the_daemon_vacuums_after_a_purge_when_configured(s3_server: EmbeddedS3, tmp_path: Path) -> None:
    """``tiers.remote.vacuum_url`` wires the same compaction into the daemon's purges."""
    import uuid

    from benchmarks.localdeploy import LocalDeployment
    from kvtier.server.daemon import Daemon
    from storage_backends.grpc import GrpcTier, GrpcTierConfig
    from tests.helpers import SECRET, chain_blocks

    dep = LocalDeployment(tmp_path / "d", server_secret=SECRET)
    dep.write_config(memory_bytes=1 << 20, disk_bytes=1 << 24,
                     remote={"endpoint": s3_server.endpoint_url, "bucket": s3_server.bucket,
                             "prefix": f"t-{uuid.uuid4().hex[:12]}", "vacuum_url": s3_server.master_url})
    with Daemon(dep.config()) as d:
        alice = GrpcTier(GrpcTierConfig(d.address, dep.token("acme", "alice")))
        try:
            scope = alice.domains().own("user")
            alice.put(chain_blocks(2, scope=scope, seed=3))
            d.backend.store.flush_remote()
            alice.purge("user", reason="forensic")
        finally:
            alice.close()
        [done] = [e for e in d.backend.audit.events("purge.done") if e.actor == "acme/alice"]
        assert done.detail["compacted"]["seaweedfs_vacuum"].startswith("vacuumed")
