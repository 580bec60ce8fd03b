"""Envelope encryption: key providers, the key ring, nonce discipline, rotation, shredding."""

from __future__ import annotations

import base64
import os
import pickle
import struct
import threading

import pytest
import torch

from kvtier import codec
from kvtier.errors import ConfigError, CorruptRecord, KeyUnavailable, TierUnavailable
from kvtier.keys import Scope, ScopeDomain
from kvtier.security.keyring import KeyRing, KeyRingOptions
from kvtier.security.master_keys import (
    KEY_PROVIDERS,
    NONCE_BYTES,
    EnvKeyProvider,
    FileKeyProvider,
    KmsKeyProvider,
    LocalKeyProvider,
    key_provider,
    register_kms_client,
    write_master_key,
)
from kvtier.security.wrapped_keys import FileWrappedKeyStore, LmdbWrappedKeyStore, MirroredKeyStore, WrappedKey
from tests.helpers import DERIVER, chain_blocks, same_bytes

KEK = bytes(range(32))
DOM_A = DERIVER.domain(Scope.user("acme/alice"))
DOM_B = DERIVER.domain(Scope.user("globex/bob"))


def provider(kek: bytes = KEK) -> LocalKeyProvider:
    return LocalKeyProvider(kek, source="test")


@pytest.fixture(params=["lmdb", "files"])
def key_store(request, tmp_path):
    if request.param == "lmdb":
        store = LmdbWrappedKeyStore(tmp_path / "keys")
        yield store
        store.close()
    else:
        yield FileWrappedKeyStore(tmp_path / "keys")


def reopen(store, tmp_path):
    if isinstance(store, LmdbWrappedKeyStore):
        store.close()
        return LmdbWrappedKeyStore(tmp_path / "keys")
    return FileWrappedKeyStore(tmp_path / "keys")


def reseal_checksum(rec: bytearray) -> None:
    """Recompute a record's (unkeyed) checksum, as an attacker would: only the GCM tag is left to object."""
    struct.pack_into("<Q", rec, codec.PREFIX_BYTES - 8, codec.compute_checksum(rec))


def seal_block(ring: KeyRing, seed: int = 0, scope: Scope | None = None):
    blk = chain_blocks(1, seed=seed, scope=scope or Scope.user("acme/alice"))[0]
    return blk, bytes(codec.encode(blk, ring))


# -- master keys ----------------------------------------------------------------------------------
@pytest.mark.parametrize("encoding", ["raw", "hex", "b64"])
def test_file_provider_reads_0600_key_in_any_encoding(tmp_path, encoding: str) -> None:
    data = {"raw": KEK, "hex": KEK.hex().encode() + b"\n", "b64": base64.b64encode(KEK)}[encoding]
    path = tmp_path / "master.key"
    path.write_bytes(data)
    path.chmod(0o600)
    assert FileKeyProvider(path).kek_id == provider().kek_id


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660, 0o666])
def test_file_provider_refuses_readable_by_others(tmp_path, mode: int) -> None:
    path = tmp_path / "master.key"
    path.write_bytes(KEK.hex().encode())
    path.chmod(mode)
    with pytest.raises(ConfigError, match=f"mode {mode:04o}"):
        FileKeyProvider(path)


@pytest.mark.parametrize("mode,ok", [(0o640, True), (0o440, True), (0o660, False), (0o644, False), (0o604, False)])
def test_group_read_only_when_asked(tmp_path, mode: int, ok: bool) -> None:
    path = tmp_path / "master.key"
    path.write_bytes(KEK.hex().encode())
    path.chmod(mode)
    with pytest.raises(ConfigError, match="mode"):
        FileKeyProvider(path)  # never by default
    if ok:
        assert FileKeyProvider(path, allow_group_read=True).kek_id == provider().kek_id
    else:
        with pytest.raises(ConfigError, match="no group write"):
            FileKeyProvider(path, allow_group_read=True)


@pytest.mark.parametrize(
    "content,what", [(b"too short", "32 bytes"), (b"zz" * 32, "32 bytes"), (base64.b64encode(b"x" * 31), "32 bytes")]
)
def test_file_provider_refuses_bad_content_without_echoing_it(tmp_path, content: bytes, what: str) -> None:
    path = tmp_path / "master.key"
    path.write_bytes(content)
    path.chmod(0o600)
    with pytest.raises(ConfigError, match=what) as exc:
        FileKeyProvider(path)
    assert content.decode() not in str(exc.value)


def test_file_provider_missing_or_not_a_file(tmp_path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        FileKeyProvider(tmp_path / "nope")
    with pytest.raises(ConfigError, match="not a regular file"):
        FileKeyProvider(tmp_path)


def test_write_master_key_is_0600_and_never_overwrites(tmp_path) -> None:
    path = write_master_key(tmp_path / "k")
    assert oct(path.stat().st_mode & 0o777) == oct(0o600)
    first = FileKeyProvider(path).kek_id
    with pytest.raises(ConfigError, match="already exists"):
        write_master_key(path)
    assert FileKeyProvider(path).kek_id == first


def test_env_provider(monkeypatch) -> None:
    monkeypatch.setenv("KVT_TEST_KEY", KEK.hex())
    assert EnvKeyProvider("KVT_TEST_KEY").kek_id == provider().kek_id
    assert key_provider("env:KVT_TEST_KEY").kek_id == provider().kek_id
    monkeypatch.setenv("KVT_TEST_KEY", "not-a-key")
    with pytest.raises(ConfigError, match="KVT_TEST_KEY"):
        EnvKeyProvider("KVT_TEST_KEY")
    monkeypatch.delenv("KVT_TEST_KEY")
    with pytest.raises(ConfigError, match="not set"):
        EnvKeyProvider("KVT_TEST_KEY")


class LocalKms:
    """A KMS plug-in that keeps its keys in process (the shape of a real one: wraps by key id,
    binds the encryption context, never reveals a key). ``outages`` simulates unreachable calls."""

    def __init__(self) -> None:
        self._keys: dict[str, LocalKeyProvider] = {}
        self.outages = 0
        self.calls = 0

    def _key(self, key_id: str) -> LocalKeyProvider:
        return self._keys.setdefault(key_id, LocalKeyProvider(os.urandom(32), source=f"kms {key_id}"))

    def _maybe_down(self) -> None:
        self.calls += 1
        if self.outages > 0:
            self.outages -= 1
            raise TierUnavailable("KMS unreachable")

    def encrypt(self, key_id: str, plaintext: bytes, context: bytes) -> bytes:
        self._maybe_down()
        return self._key(key_id).wrap(plaintext, context)

    def decrypt(self, key_id: str, blob: bytes, context: bytes) -> bytes:
        self._maybe_down()
        return self._key(key_id).unwrap(blob, context)


def test_kms_plugin_through_the_registry(tmp_path) -> None:
    kms = LocalKms()
    register_kms_client("local-test", lambda key_id: kms)
    prov = key_provider("kms:local-test:tenant-master")
    assert isinstance(prov, KmsKeyProvider) and prov.kek_id == "kms:tenant-master"
    ring = KeyRing(prov, FileWrappedKeyStore(tmp_path / "k"))
    blk, rec = seal_block(ring)
    ring2 = KeyRing(key_provider("kms:local-test:tenant-master"), FileWrappedKeyStore(tmp_path / "k"))
    assert same_bytes(codec.decode(rec, sealer=ring2), blk)
    with pytest.raises(ConfigError, match="no KMS client"):
        key_provider("kms:nope:k")
    with pytest.raises(ConfigError, match="expected one of"):
        key_provider("vault:x")
    assert set(KEY_PROVIDERS) >= {"file", "env", "kms"}


def test_kms_transient_failures_are_retried_with_a_bound() -> None:
    kms = LocalKms()
    prov = KmsKeyProvider(kms, "k", attempts=3, backoff_s=0)
    kms.outages = 2
    wrapped = prov.wrap(b"\x01" * 32, b"ctx")
    assert kms.calls == 3
    kms.outages = 5
    with pytest.raises(TierUnavailable):
        prov.unwrap(wrapped, b"ctx")
    assert kms.calls == 6
    kms.outages = 0
    with pytest.raises(KeyUnavailable):  # an answer, not an outage: not retried
        prov.unwrap(wrapped, b"other ctx")
    assert kms.calls == 7


def test_providers_never_show_or_pickle_the_key() -> None:
    p = provider()
    ring = KeyRing(p, FileWrappedKeyStore(os.path.join(os.environ.get("TMPDIR", "/tmp"), f"kvt-{os.getpid()}")))
    for obj in (p, ring):
        assert KEK.hex() not in repr(obj)
        with pytest.raises(TypeError, match="pickle"):
            pickle.dumps(obj)


# -- the ring -------------------------------------------------------------------------------------
def test_roundtrip_and_ciphertext_hides_plaintext(key_store) -> None:
    ring = KeyRing(provider(), key_store)
    blk, rec = seal_block(ring)
    plain = bytes(blk.as_bytes_view())
    assert plain[:64] not in rec and plain[-64:] not in rec
    assert same_bytes(codec.decode(rec, expect_key=blk.key, sealer=ring), blk)
    assert ring.snapshot()["encryptions"] == 1 and ring.snapshot()["decryptions"] == 1


def test_tampered_ciphertext_fails_and_leaves_no_plaintext_in_out(key_store) -> None:
    ring = KeyRing(provider(), key_store)
    blk, rec = seal_block(ring)
    hdr = codec.parse_header(rec)
    bad = bytearray(rec)
    bad[hdr.payload_offset + 5] ^= 1
    reseal_checksum(bad)
    out = torch.full(blk.meta.shape, 7, dtype=blk.data.dtype)
    with pytest.raises(CorruptRecord, match="authentication"):
        codec.decode(bytes(bad), sealer=ring, out=out)
    assert not out.view(torch.uint8).any(), "unauthenticated bytes must be wiped from the caller's buffer"
    assert ring.snapshot()["auth_failures"] == 1


def test_aad_binds_key_scope_and_layout(key_store) -> None:
    ring = KeyRing(provider(), key_store)
    blk, rec = seal_block(ring)
    env = codec.parse_header(rec).envelope
    hdr = codec.parse_header(rec)
    sealed = memoryview(rec)[hdr.payload_offset :]
    out = memoryview(bytearray(blk.nbytes))
    good = codec._aad(blk.meta)
    ring.open_into(DOM_A, env, good, sealed, out)
    other = chain_blocks(2, scope=Scope.user("acme/alice"))[1].meta  # same domain, other key
    with pytest.raises(CorruptRecord, match="authentication"):
        ring.open_into(DOM_A, env, codec._aad(other), sealed, out)
    with pytest.raises(CorruptRecord, match="does not exist"):
        ring.open_into(DOM_B, env, good, sealed, out)  # B's domain has no such key


@pytest.mark.parametrize(
    "env", [{"a": "A128CBC", "k": b"\x00" * 8, "n": b"\x00" * 12}, {"a": "A256GCM", "k": b"\x00", "n": b"\x00" * 12},
            {"a": "A256GCM", "k": b"\x00" * 8, "n": b"short"}, {"a": "A256GCM"}],
)
def test_malformed_envelopes_are_corrupt(key_store, env) -> None:
    ring = KeyRing(provider(), key_store)
    with pytest.raises(CorruptRecord):
        ring.open_into(DOM_A, env, b"", memoryview(bytes(32)), memoryview(bytearray(16)))


def test_nonces_never_repeat_and_counters_increase(key_store) -> None:
    ring = KeyRing(provider(), key_store)
    seen: list[bytes] = []
    lock = threading.Lock()

    def work() -> None:
        for _ in range(250):
            env, _ = ring.seal(DOM_A, b"aad", memoryview(b"x" * 32))
            with lock:
                seen.append(env["n"])

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(seen) == 1000 and len(set(seen)) == 1000
    counters = sorted(int.from_bytes(n[:8], "big") for n in seen)
    assert counters == list(range(1000)), "the counter half of the nonce is each invocation number exactly once"
    assert all(len(n) == NONCE_BYTES for n in seen)


def test_rotation_after_bound_old_keys_still_decrypt(key_store, tmp_path) -> None:
    ring = KeyRing(provider(), key_store, options=KeyRingOptions(max_encryptions=3))
    recs = [seal_block(ring, seed=i) for i in range(7)]
    ids = [codec.parse_header(r).envelope["k"] for _, r in recs]
    assert ids[0] == ids[1] == ids[2] != ids[3] == ids[4] == ids[5] != ids[6]
    snap = ring.snapshot()
    assert snap["deks_created"] == 3 and snap["rotations"] == 2
    # After a restart every generation still opens; the new process writes with a fresh key.
    ring2 = KeyRing(provider(), reopen(key_store, tmp_path))
    for blk, rec in recs:
        assert same_bytes(codec.decode(rec, sealer=ring2), blk)
    _, rec = seal_block(ring2, seed=99)
    assert codec.parse_header(rec).envelope["k"] not in ids


def test_forked_child_never_continues_the_parents_counter(tmp_path) -> None:
    ring = KeyRing(provider(), FileWrappedKeyStore(tmp_path / "k"))
    parent_env, _ = ring.seal(DOM_A, b"", memoryview(b"p" * 16))
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        try:
            env, _ = ring.seal(DOM_A, b"", memoryview(b"c" * 16))
            os.write(w, env["k"] + env["n"])
        finally:
            os._exit(0)
    os.close(w)
    data = os.read(r, 64)
    os.waitpid(pid, 0)
    os.close(r)
    assert len(data) == 20
    assert data[:8] != parent_env["k"], "the child must create its own data key"


def test_destroy_shreds_a_domain_only(key_store, tmp_path) -> None:
    ring = KeyRing(provider(), key_store)
    _, rec_a = seal_block(ring, scope=Scope.user("acme/alice"))
    blk_b, rec_b = seal_block(ring, scope=Scope.user("globex/bob"))
    assert ring.destroy(DOM_A) == 1
    assert ring.destroy(DOM_A) == 0  # idempotent

    def check(r: KeyRing) -> None:
        with pytest.raises(CorruptRecord, match="does not exist"):
            codec.decode(rec_a, sealer=r)
        assert same_bytes(codec.decode(rec_b, sealer=r), blk_b)
        assert DOM_A not in r.known_domains()

    check(ring)
    check(KeyRing(provider(), reopen(key_store, tmp_path)))  # and after a restart


def test_wrong_master_key_refuses_to_start_and_rotation_rewraps(key_store, tmp_path) -> None:
    old, new = provider(KEK), provider(bytes(reversed(KEK)))
    ring = KeyRing(old, key_store)
    recs = [seal_block(ring, seed=i, scope=s) for i, s in enumerate([Scope.user("acme/alice"), Scope.public()])]
    with pytest.raises(ConfigError, match="wrapped by master key") as exc:
        KeyRing(new, key_store)
    assert KEK.hex() not in str(exc.value)
    rotating = KeyRing(new, key_store, previous=[old])
    assert rotating.rewrap() == 2
    assert rotating.rewrap() == 0  # rerunnable after a crash: nothing left to do
    ring_new = KeyRing(new, reopen(key_store, tmp_path))  # the old key is no longer needed
    for blk, rec in recs:
        assert same_bytes(codec.decode(rec, sealer=ring_new), blk)
    assert all(k.kek_id == new.kek_id for k in ring_new.store.all_wrapped())


def test_wrapped_key_moved_to_another_domain_does_not_unwrap(key_store) -> None:
    ring = KeyRing(provider(), key_store)
    _, rec = seal_block(ring)
    wk = next(iter(key_store.all_wrapped()))
    key_store.put_wrapped(WrappedKey(DOM_B, wk.dek_id, wk.kek_id, wk.wrapped, wk.created_at))
    fresh = KeyRing(provider(), key_store)
    env = codec.parse_header(rec).envelope
    with pytest.raises(KeyUnavailable, match="does not unwrap"):
        fresh.open_into(DOM_B, env, b"", memoryview(bytes(32)), memoryview(bytearray(16)))


@pytest.mark.parametrize("raw", [b"", b"\x93\x01\x02\x03", WrappedKey(DOM_A, b"\x00" * 3, "k", b"", 0.0).encode()])
def test_malformed_wrapped_key_records_are_corrupt(raw: bytes) -> None:
    with pytest.raises(CorruptRecord):
        WrappedKey.decode(raw)


def test_key_stores_persist_and_list_by_domain(key_store, tmp_path) -> None:
    a1 = WrappedKey(DOM_A, b"1" * 8, "k", b"w1", 1.0)
    a2 = WrappedKey(DOM_A, b"2" * 8, "k", b"w2", 2.0)
    b1 = WrappedKey(DOM_B, b"1" * 8, "k", b"w3", 3.0)
    for k in (a1, a2, b1):
        key_store.put_wrapped(k)
    store = reopen(key_store, tmp_path)
    assert sorted(store.wrapped_for(DOM_A), key=lambda k: k.dek_id) == [a1, a2]
    assert store.delete_domain(DOM_A) == 2
    assert store.wrapped_for(DOM_A) == []
    assert list(store.all_wrapped()) == [b1]
    if isinstance(store, LmdbWrappedKeyStore):
        store.close()


class Unreachable:
    """A mirror whose service is down (a remote outage), for the degradation path."""

    def put_wrapped(self, key: WrappedKey) -> None:
        raise TierUnavailable("down")

    def wrapped_for(self, domain: ScopeDomain) -> list[WrappedKey]:
        raise TierUnavailable("down")

    def delete_domain(self, domain: ScopeDomain) -> int:
        raise TierUnavailable("down")

    def all_wrapped(self):
        raise TierUnavailable("down")


def test_mirror_serves_other_nodes_keys_and_degrades_visibly(tmp_path) -> None:
    shared = FileWrappedKeyStore(tmp_path / "remote")
    node1 = KeyRing(provider(), MirroredKeyStore(FileWrappedKeyStore(tmp_path / "n1"), shared))
    node2 = KeyRing(provider(), MirroredKeyStore(FileWrappedKeyStore(tmp_path / "n2"), shared))
    blk, rec = seal_block(node1)
    assert same_bytes(codec.decode(rec, sealer=node2), blk)  # found through the mirror
    assert len(FileWrappedKeyStore(tmp_path / "n2").wrapped_for(DOM_A)) == 1  # and copied locally
    # A mirror outage: writes still work locally, the key waits in `pending`, flush delivers it.
    mirrored = MirroredKeyStore(FileWrappedKeyStore(tmp_path / "n3"), Unreachable())
    node3 = KeyRing(provider(), mirrored)
    blk3, rec3 = seal_block(node3, seed=3)
    assert same_bytes(codec.decode(rec3, sealer=node3), blk3)
    assert len(mirrored.pending) == 1 and mirrored.errors["mirror_put"] == 1
    with pytest.raises(TierUnavailable):
        mirrored.flush()
    mirrored.mirror = shared
    assert mirrored.flush() == 0
    assert len(shared.wrapped_for(DOM_A)) == 2
    # A purge must reach the mirror or fail loudly (so its journal retries it).
    mirrored.mirror = Unreachable()
    with pytest.raises(TierUnavailable):
        node3.destroy(DOM_A)


def test_in_place_seal_matches_open(key_store) -> None:
    ring = KeyRing(provider(), key_store)
    plain = memoryview(os.urandom(1000))
    env = ring.reserve(DOM_A)
    out = bytearray(1016)
    ring.seal_into(DOM_A, env, b"aad", plain, memoryview(out))
    back = bytearray(1000)
    ring.open_into(DOM_A, env, b"aad", memoryview(out), memoryview(back))
    assert back == plain
    with pytest.raises(ValueError, match="len"):
        ring.seal_into(DOM_A, ring.reserve(DOM_A), b"", plain, memoryview(bytearray(10)))


def test_bad_options_are_refused(key_store) -> None:
    with pytest.raises(ConfigError, match="max_encryptions"):
        KeyRing(provider(), key_store, options=KeyRingOptions(max_encryptions=0))
    with pytest.raises(ConfigError, match="32 bytes"):
        LocalKeyProvider(b"short", source="test")


class SealOnly:
    """A Sealer with only the two protocol methods (no in-place sealing): the codec's other path."""

    def __init__(self, ring: KeyRing) -> None:
        self.ring = ring

    def seal(self, domain, aad, plaintext):
        return self.ring.seal(domain, aad, plaintext)

    def open_into(self, domain, envelope, aad, sealed, out):
        return self.ring.open_into(domain, envelope, aad, sealed, out)


def test_codec_in_place_and_allocating_seal_paths_agree(key_store) -> None:
    ring = KeyRing(provider(), key_store)
    blk = chain_blocks(1, scope=Scope.user("acme/alice"))[0]
    in_place = bytes(codec.encode(blk, ring))
    allocating = bytes(codec.encode(blk, SealOnly(ring)))
    assert len(in_place) == len(allocating)
    for rec in (in_place, allocating):
        assert same_bytes(codec.decode(rec, expect_key=blk.key, sealer=ring), blk)
        assert same_bytes(codec.decode(rec, expect_key=blk.key, sealer=SealOnly(ring)), blk)
    assert codec.parse_header(in_place).envelope["n"] != codec.parse_header(allocating).envelope["n"]


class GatedStore(FileWrappedKeyStore):
    """A real file store whose writes for one domain wait on an event (a slow KMS or mirror)."""

    def __init__(self, path, gated: ScopeDomain) -> None:
        super().__init__(path)
        self.gated = gated
        self.entered = threading.Event()
        self.release = threading.Event()

    def put_wrapped(self, key: WrappedKey) -> None:
        if key.domain == self.gated:
            self.entered.set()
            assert self.release.wait(30)
        super().put_wrapped(key)


def test_slow_key_creation_does_not_block_other_domains(tmp_path) -> None:
    store = GatedStore(tmp_path / "k", DOM_A)
    ring = KeyRing(provider(), store)
    t = threading.Thread(target=ring.seal, args=(DOM_A, b"", memoryview(b"a" * 16)))
    t.start()
    try:
        assert store.entered.wait(30)
        env, _ = ring.seal(DOM_B, b"", memoryview(b"b" * 16))  # would deadlock if creation held the ring lock
        assert env["k"]
    finally:
        store.release.set()
        t.join(30)
    assert ring.snapshot()["deks_created"] == 2


class ShreddingStore(FileWrappedKeyStore):
    """Destroys the domain right after a reader fetched its wrapped key: the purge races a read."""

    ring: KeyRing

    def wrapped_for(self, domain: ScopeDomain) -> list[WrappedKey]:
        found = super().wrapped_for(domain)
        if found and getattr(self, "armed", False):
            self.armed = False
            self.ring.destroy(domain)
        return found


def test_a_read_racing_a_destroy_never_caches_the_shredded_key(tmp_path) -> None:
    writer = KeyRing(provider(), FileWrappedKeyStore(tmp_path / "k"))
    _, rec = seal_block(writer)
    store = ShreddingStore(tmp_path / "k")
    reader = KeyRing(provider(), store)
    store.ring, store.armed = reader, True
    with pytest.raises(CorruptRecord, match="destroyed while"):
        codec.decode(rec, sealer=reader)
    with pytest.raises(CorruptRecord, match="does not exist"):
        codec.decode(rec, sealer=reader)
    assert reader.snapshot()["cached_keys"] == 0
