"""Issue 17, point 3: keys read from the bucket are authenticated before they are adopted.

A bucket writer without the secret planted a wrapped key under ``_keys/<domain>/`` with a
master-key id no node has; one ordinary publisher Put copied it into the daemon's local key
store, and the next start refused to run. Now every mirrored key carries an HMAC tag under a key
derived from the server secret, bound to its name (domain and DEK id): a planted or altered key
is refused and counted, a read under it is a miss, and the daemon starts.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

from benchmarks.localdeploy import LocalDeployment
from kvtier.keys import Scope
from kvtier.security.wrapped_keys import WrappedKey
from kvtier.server.daemon import Daemon
from kvtier.server.embedded_s3 import EmbeddedS3
from storage_backends.grpc import GrpcTier, GrpcTierConfig
from tests.helpers import DERIVER, SECRET, chain_blocks

PUBLISH = ("publish:public",)
#: acme/pub publishes the public blocks below (the default trusts operators only).
PUBLISHERS = "acme/pub"


def _deploy(root: Path, s3: EmbeddedS3, prefix: str, **tiers) -> LocalDeployment:
    dep = LocalDeployment(root, server_secret=SECRET)
    dep.write_config(remote={"endpoint": s3.endpoint_url, "bucket": s3.bucket, "prefix": prefix},
                     security={"key_store_dir": str(root / "keys"), "public_publishers": PUBLISHERS}, **tiers)
    return dep


def test_a_planted_key_is_refused_and_never_stops_a_start(s3_server: EmbeddedS3, raw_s3, tmp_path: Path) -> None:
    prefix = f"t-{uuid.uuid4().hex[:12]}"
    public = DERIVER.domain(Scope.public())
    planted = WrappedKey(public, os.urandom(8), "kek-nobody-has", os.urandom(60), time.time())
    raw_s3.put_object(Bucket=s3_server.bucket, Key=f"{prefix}/_keys/{public.hex()}/{planted.dek_id.hex()}",
                      Body=planted.encode())
    dep = _deploy(tmp_path / "a", s3_server, prefix, memory_bytes=None, disk_bytes=1 << 24)
    blocks = chain_blocks(3)
    with Daemon(dep.config()) as d:
        pub = GrpcTier(GrpcTierConfig(d.address, dep.token("acme", "pub", roles=PUBLISH)))
        try:
            assert len(pub.put(blocks).stored) == 3  # creates the public DEK: reads the mirror
        finally:
            pub.close()
        mirror = d.backend.keyring.store.mirror
    with Daemon(dep.config()) as d:  # the next start (refused before the fix)
        pub = GrpcTier(GrpcTierConfig(d.address, dep.token("acme", "pub", roles=PUBLISH)))
        try:
            assert len(pub.get_prefix([b.key for b in blocks])) == 3
        finally:
            pub.close()
        assert all(k.kek_id != "kek-nobody-has" for k in d.backend.keyring.store.primary.all_wrapped())
    assert mirror.rejected >= 1  # the planted key was refused and counted, not adopted


def test_an_altered_key_is_a_counted_miss_on_another_node(s3_server: EmbeddedS3, raw_s3, tmp_path: Path) -> None:
    prefix = f"t-{uuid.uuid4().hex[:12]}"
    dep_a = _deploy(tmp_path / "a", s3_server, prefix, memory_bytes=None, disk_bytes=1 << 24)
    blocks = chain_blocks(2, seed=5)
    with Daemon(dep_a.config()) as a:
        pub = GrpcTier(GrpcTierConfig(a.address, dep_a.token("acme", "pub", roles=PUBLISH)))
        try:
            pub.put(blocks)
        finally:
            pub.close()
        a.backend.store.flush_remote()
    # Node B shares the bucket, the master key and the secret (a copy of A's key files).
    (tmp_path / "b").mkdir()
    for f in ("master.key",):
        (tmp_path / "b" / f).write_bytes((tmp_path / "a" / f).read_bytes())
        os.chmod(tmp_path / "b" / f, 0o600)
    dep_b = _deploy(tmp_path / "b", s3_server, prefix, memory_bytes=1 << 20)
    # The bucket writer replaces A's mirrored key with its own bytes (no valid tag).
    keys = [o["Key"] for o in raw_s3.list_objects_v2(Bucket=s3_server.bucket, Prefix=f"{prefix}/_keys/")["Contents"]]
    assert keys
    for k in keys:
        body = raw_s3.get_object(Bucket=s3_server.bucket, Key=k)["Body"].read()
        raw_s3.put_object(Bucket=s3_server.bucket, Key=k, Body=body[-80:])
    with Daemon(dep_b.config()) as b:
        reader = GrpcTier(GrpcTierConfig(b.address, dep_b.token("globex", "reader")))
        try:
            assert reader.get_prefix([x.key for x in blocks]) == []  # a miss, not an outage
            assert b.backend.keyring.store.mirror.rejected >= 1
            assert reader.contains([blocks[0].key]) == 0
        finally:
            reader.close()


def test_refused_mirror_keys_are_on_metrics(s3_server: EmbeddedS3, raw_s3, tmp_path: Path) -> None:
    """Issue 32: a planted key the mirror refused, and a verified key under a master key this node
    lacks (not adopted), are counted on /metrics (``kvtier_key_mirror_total``), where an
    operator's alerting sees them; before any was read, the counts are zero (the control)."""
    import urllib.request

    prefix = f"t-{uuid.uuid4().hex[:12]}"
    public = DERIVER.domain(Scope.public())
    dep = LocalDeployment(tmp_path / "a", server_secret=SECRET)
    dep.write_config(memory_bytes=None, disk_bytes=1 << 24, server={"metrics_listen": "127.0.0.1:0"},
                     remote={"endpoint": s3_server.endpoint_url, "bucket": s3_server.bucket, "prefix": prefix},
                     security={"key_store_dir": str(tmp_path / "a" / "keys"), "public_publishers": PUBLISHERS})
    with Daemon(dep.config()) as d:
        def scrape() -> str:
            with urllib.request.urlopen(f"http://127.0.0.1:{d.metrics_port}/metrics", timeout=10) as resp:
                return resp.read().decode()

        assert 'kvtier_key_mirror_total{what="rejected"} 0.0' in scrape()
        # A planted key (no valid tag) and, sealed with the deployment's own mirror key (as a node
        # that had another master key would write it), a key under a master key nobody here has.
        planted = WrappedKey(public, os.urandom(8), "kek-nobody-has", os.urandom(60), time.time())
        raw_s3.put_object(Bucket=s3_server.bucket, Key=f"{prefix}/_keys/{public.hex()}/{planted.dek_id.hex()}",
                          Body=planted.encode())
        mirror = d.backend.keyring.store.mirror
        foreign = WrappedKey(public, os.urandom(8), "kek-of-another-node", os.urandom(60), time.time())
        raw_s3.put_object(Bucket=s3_server.bucket, Key=f"{prefix}/_keys/{public.hex()}/{foreign.dek_id.hex()}",
                          Body=mirror.seal(foreign))
        pub = GrpcTier(GrpcTierConfig(d.address, dep.token("acme", "pub", roles=PUBLISH)))
        try:
            assert len(pub.put(chain_blocks(2, seed=9)).stored) == 2  # creates the public DEK: reads the mirror
        finally:
            pub.close()
        text = scrape()
        assert f'kvtier_key_mirror_total{{what="rejected"}} {float(mirror.rejected)}' in text and mirror.rejected >= 1
        assert 'kvtier_key_mirror_total{what="unknown_master_key"} 1.0' in text
