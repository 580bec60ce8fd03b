"""Wrapped data keys and the stores that persist them (LMDB, a directory, a mirror)."""

from __future__ import annotations

import os
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import lmdb
import msgpack

from kvtier.durable import fsync_dir
from kvtier.errors import CorruptRecord, TierUnavailable
from kvtier.keys import DOMAIN_BYTES, ScopeDomain
from kvtier.security.master_keys import DEK_ID_BYTES
from kvtier.security.secrets import private_dir, private_file

WRAPPED_KEY_VERSION = 1
_KEYS_MAP = 8 << 20


# =================================================================================================
# Wrapped data keys and where they live
# =================================================================================================
@dataclass(slots=True, frozen=True)
class WrappedKey:
    """A DEK as stored: wrapped under master key ``kek_id``; the plain DEK is never persisted."""

    domain: ScopeDomain
    dek_id: bytes
    kek_id: str
    wrapped: bytes
    created_at: float

    def encode(self) -> bytes:
        return msgpack.packb([WRAPPED_KEY_VERSION, self.domain, self.dek_id, self.kek_id, self.wrapped,
                              self.created_at])

    @classmethod
    def decode(cls, raw: bytes | memoryview) -> WrappedKey:
        try:
            v, dom, dek_id, kek_id, wrapped, created = msgpack.unpackb(bytes(raw), raw=False)
        except (ValueError, TypeError, msgpack.UnpackException):
            raise CorruptRecord("wrapped key record is malformed") from None
        if v != WRAPPED_KEY_VERSION or not isinstance(dom, bytes) or len(dom) != DOMAIN_BYTES:
            raise CorruptRecord("wrapped key record has a bad version or domain")
        if not isinstance(dek_id, bytes) or len(dek_id) != DEK_ID_BYTES or not isinstance(kek_id, str):
            raise CorruptRecord("wrapped key record has a bad key id")
        if not isinstance(wrapped, bytes) or not isinstance(created, float | int):
            raise CorruptRecord("wrapped key record has a bad body")
        return cls(ScopeDomain(dom), dek_id, kek_id, wrapped, float(created))

    @property
    def name(self) -> bytes:
        """Store key: ``domain || dek id`` (a domain's keys are one contiguous range)."""
        return self.domain + self.dek_id


class WrappedKeyStore(Protocol):
    """Persistence of wrapped DEKs. Implemented by the disk tier's LMDB environment, a directory,
    and the remote tier (objects under ``<prefix>/_keys/<domain-hex>/<dek-id-hex>``).

    ``put_wrapped`` must be durable when it returns (a ciphertext may follow immediately).
    Remote implementations raise TierUnavailable when the service cannot be reached.
    """

    def put_wrapped(self, key: WrappedKey) -> None: ...

    def wrapped_for(self, domain: ScopeDomain) -> list[WrappedKey]: ...

    def delete_domain(self, domain: ScopeDomain) -> int: ...

    def all_wrapped(self) -> Iterator[WrappedKey]: ...


class LmdbWrappedKeyStore:
    """Wrapped DEKs in a small LMDB environment of their own, normally ``<disk tier path>/keys``.

    Its own environment (not a sub-database of the tier's) so that growing its map never races
    the tier's transactions; ordering is what matters and is kept: a key is committed (synced)
    before the first record under it is written. Keys are ``domain || DEK id``, so a domain is
    one contiguous range. ``_lock`` serialises writers and map growth.
    """

    def __init__(self, path: str | os.PathLike[str], *, sync: bool = True) -> None:
        self.path = private_dir(path)  # 0700 (and its files 0600) whatever the umask
        self.env = lmdb.open(str(self.path), map_size=_KEYS_MAP, max_dbs=2, sync=sync, metasync=sync,
                             readahead=False, lock=True, mode=0o600)
        for f in ("data.mdb", "lock.mdb"):
            private_file(self.path / f)
        self._db = self.env.open_db(b"keys")
        self._lock = threading.Lock()

    def _write(self, fn: Callable[[lmdb.Transaction], int]) -> int:
        with self._lock:
            for _ in range(16):  # each retry doubles the map; 16 doublings is far beyond any key count
                try:
                    with self.env.begin(write=True, db=self._db) as txn:
                        return fn(txn)
                except lmdb.MapFullError:
                    self.env.set_mapsize(self.env.info()["map_size"] * 2)
        raise TierUnavailable(f"wrapped-key store {self.path} cannot grow its map")

    def put_wrapped(self, key: WrappedKey) -> None:
        self._write(lambda txn: int(txn.put(key.name, key.encode())))

    def wrapped_for(self, domain: ScopeDomain) -> list[WrappedKey]:
        return [WrappedKey.decode(v) for _, v in self._range(domain)]

    def _range(self, domain: ScopeDomain, txn: lmdb.Transaction | None = None) -> list[tuple[bytes, bytes]]:
        if txn is None:
            with self.env.begin(db=self._db) as rtxn:
                return self._range(domain, rtxn)
        out = []
        cur = txn.cursor(db=self._db)
        if cur.set_range(domain):
            for k, v in cur:
                if k[:DOMAIN_BYTES] != domain:
                    break
                out.append((bytes(k), bytes(v)))
        return out

    def delete_domain(self, domain: ScopeDomain) -> int:
        def drop(txn: lmdb.Transaction) -> int:
            names = [k for k, _ in self._range(domain, txn)]
            for k in names:
                txn.delete(k)
            return len(names)

        return self._write(drop)

    def all_wrapped(self) -> Iterator[WrappedKey]:
        with self.env.begin(db=self._db) as txn:
            items = [bytes(v) for _, v in txn.cursor()]
        for v in items:
            yield WrappedKey.decode(v)

    def count(self) -> int:
        with self.env.begin(db=self._db) as txn:
            return txn.stat(self._db)["entries"]

    def close(self) -> None:
        with self._lock:
            self.env.close()


class FileWrappedKeyStore:
    """Wrapped DEKs as small files ``<domain-hex>.<dek-id-hex>.key`` (0600) in a directory, written
    atomically (temp file, fsync, rename, fsync of the directory)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = private_dir(path)

    def _file(self, key: WrappedKey) -> Path:
        return self.path / f"{key.domain.hex()}.{key.dek_id.hex()}.key"

    def put_wrapped(self, key: WrappedKey) -> None:
        final = self._file(key)
        tmp = final.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, key.encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, final)
        fsync_dir(self.path)

    def wrapped_for(self, domain: ScopeDomain) -> list[WrappedKey]:
        return [WrappedKey.decode(f.read_bytes()) for f in sorted(self.path.glob(f"{domain.hex()}.*.key"))]

    def delete_domain(self, domain: ScopeDomain) -> int:
        n = 0
        for f in self.path.glob(f"{domain.hex()}.*"):
            f.unlink(missing_ok=True)
            n += f.suffix == ".key"
        fsync_dir(self.path)
        return n

    def all_wrapped(self) -> Iterator[WrappedKey]:
        for f in sorted(self.path.glob("*.key")):
            yield WrappedKey.decode(f.read_bytes())


class MirroredKeyStore:
    """A local primary plus a mirror on the remote tier (shared by every node).

    Invariants: the primary is written first and its failures propagate. A mirror that cannot be
    reached on put leaves the key in ``pending`` (counted) and ``flush()`` retries it; a read that
    misses locally falls back to the mirror and copies what it finds into the primary (another
    node's DEK). ``delete_domain`` must reach both, or it raises: a purge is not done while the
    remote still holds the key (the purge journal then retries it).
    """

    def __init__(self, primary: WrappedKeyStore, mirror: WrappedKeyStore) -> None:
        self.primary = primary
        self.mirror = mirror
        self._lock = threading.Lock()
        self.pending: dict[bytes, WrappedKey] = {}
        self.errors: Counter[str] = Counter()
        #: Master-key ids a key from the mirror must be wrapped under to be copied into the
        #: primary (set by the KeyRing: its own and previous keys). A key under another id is
        #: still handed to the ring (which counts it as a miss) but never persisted locally, so
        #: it cannot stop this node's next start. None: copy every verified key.
        self.adopt_keks: frozenset[str] | None = None

    def put_wrapped(self, key: WrappedKey) -> None:
        self.primary.put_wrapped(key)
        try:
            self.mirror.put_wrapped(key)
        except TierUnavailable:
            with self._lock:
                self.pending[key.name] = key
                self.errors["mirror_put"] += 1

    def flush(self) -> int:
        """Retry pending mirror writes; returns how many are still pending."""
        with self._lock:
            todo = list(self.pending.values())
        for key in todo:
            self.mirror.put_wrapped(key)
            with self._lock:
                self.pending.pop(key.name, None)
        return len(self.pending)

    def wrapped_for(self, domain: ScopeDomain) -> list[WrappedKey]:
        local = self.primary.wrapped_for(domain)
        try:
            remote = self.mirror.wrapped_for(domain)
        except TierUnavailable:
            with self._lock:
                self.errors["mirror_get"] += 1
            return local
        have = {k.dek_id for k in local}
        for k in remote:
            if k.dek_id not in have:
                if self.adopt_keks is None or k.kek_id in self.adopt_keks:
                    self.primary.put_wrapped(k)
                else:
                    with self._lock:
                        self.errors["mirror_unknown_master_key"] += 1
                local.append(k)
        return local

    #: ``counts`` names: the counters of ``errors``, as /metrics shows them.
    COUNTED = {"mirror_unknown_master_key": "unknown_master_key", "mirror_put": "put_failed",
               "mirror_get": "get_failed"}

    def counts(self) -> dict[str, int]:
        """What the daemon's /metrics shows (``kvtier_key_mirror_total{what}``): keys from the
        bucket refused because they did not verify (``rejected``: planted or altered by a bucket
        writer without the secret; counted by a mirror that verifies, S3WrappedKeyStore),
        verified keys not adopted because this node lacks their master key
        (``unknown_master_key``), and mirror writes and reads that failed. Every name is
        present, zero until it happens, so an alert can be written before the first one."""
        with self._lock:
            out = {name: self.errors[key] for key, name in self.COUNTED.items()}
        out["rejected"] = int(getattr(self.mirror, "rejected", 0))
        return out

    def remirror(self) -> int:
        """Write every local key to the mirror again (in the mirror's current, authenticated
        format: what ``kvtier keys rewrap`` does after an upgrade); returns how many."""
        n = 0
        for k in list(self.primary.all_wrapped()):
            self.mirror.put_wrapped(k)
            n += 1
        return n

    def delete_domain(self, domain: ScopeDomain) -> int:
        n = self.primary.delete_domain(domain)
        with self._lock:
            for name in [n_ for n_ in self.pending if n_[:DOMAIN_BYTES] == domain]:
                del self.pending[name]
        return max(n, self.mirror.delete_domain(domain))

    def all_wrapped(self) -> Iterator[WrappedKey]:
        return self.primary.all_wrapped()


# =================================================================================================
# A key store whose deletions are real
# =================================================================================================
SLOT_BYTES = 1024
_SLOT_MAGIC = b"KS"
SLOT_FILE = "wrapped.keys"


class SlotFileKeyStore:
    """Wrapped DEKs in one file of fixed-size slots, ``<dir>/wrapped.keys`` (0600): a key is
    written into a slot in place, and deleting it overwrites the whole slot with zeros and
    fsyncs before returning.

    Why: a purge's promise rests on destroying the scope's DEKs. LMDB (the earlier store) is
    copy-on-write: a deleted key stays in a freed page until the page is reused, so someone who
    later had the master key and a copy of the file could unwrap it and decrypt every record of
    the purged scope. Overwriting a slot in place leaves no copy in the file. It does not reach
    below the file system: a copy-on-write file system (btrfs, ZFS), snapshots, backups, or an
    SSD's remapping can keep the old block (docs/security.md, 2.6).

    Slot layout: ``b"KS" || length (2 bytes, big-endian) || WrappedKey.encode() || zeros``; an
    all-zero slot is free and reused. An existing LMDB key store in the same directory (from an
    earlier release) is imported on open and then scrubbed (its files overwritten with zeros,
    fsynced and removed). One process opens a directory at a time (the daemon, or ``kvtier keys
    rewrap`` while the daemon is stopped). Invariants (under ``_lock``): ``_slots`` maps each
    stored key's name to its slot and ``_keys`` to its decoded value; ``_free`` lists zeroed slots.
    """

    def __init__(self, path: str | os.PathLike[str], *, sync: bool = True) -> None:
        self.path = private_dir(path)
        self.sync = sync
        self._lock = threading.Lock()
        self._file = self.path / SLOT_FILE
        created = not self._file.exists()
        self._fd = os.open(self._file, os.O_RDWR | os.O_CREAT, 0o600)
        os.fchmod(self._fd, 0o600)
        if created:
            fsync_dir(self.path)
        self._slots: dict[bytes, int] = {}
        self._keys: dict[bytes, WrappedKey] = {}
        self._free: list[int] = []
        self._n = 0
        self._load()
        if (self.path / "data.mdb").exists():
            self._import_lmdb()

    # -- protocol -------------------------------------------------------------------------------------
    def put_wrapped(self, key: WrappedKey) -> None:
        raw = key.encode()
        if len(raw) > SLOT_BYTES - 4:
            raise ValueError(f"wrapped key record of {len(raw)} bytes does not fit a {SLOT_BYTES}-byte slot")
        slot = _SLOT_MAGIC + len(raw).to_bytes(2, "big") + raw
        with self._lock:
            i = self._slots.get(key.name)
            if i is None:
                i = self._free.pop() if self._free else self._n
                self._n = max(self._n, i + 1)
            self._write(i, slot.ljust(SLOT_BYTES, b"\0"))
            self._slots[key.name] = i
            self._keys[key.name] = key

    def wrapped_for(self, domain: ScopeDomain) -> list[WrappedKey]:
        with self._lock:
            return [k for name, k in sorted(self._keys.items()) if name[:DOMAIN_BYTES] == domain]

    def delete_domain(self, domain: ScopeDomain) -> int:
        """Overwrite every slot of ``domain`` with zeros (fsynced): the keys are gone from the file."""
        with self._lock:
            names = [n for n in self._slots if n[:DOMAIN_BYTES] == domain]
            for n in names:
                i = self._slots.pop(n)
                del self._keys[n]
                os.pwrite(self._fd, bytes(SLOT_BYTES), i * SLOT_BYTES)
                self._free.append(i)
            if names:
                os.fsync(self._fd)
            return len(names)

    def all_wrapped(self) -> Iterator[WrappedKey]:
        with self._lock:
            keys = [k for _, k in sorted(self._keys.items())]
        yield from keys

    def count(self) -> int:
        with self._lock:
            return len(self._keys)

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    # -- internals ------------------------------------------------------------------------------------
    def _write(self, i: int, data: bytes) -> None:
        os.pwrite(self._fd, data, i * SLOT_BYTES)
        if self.sync:
            os.fsync(self._fd)

    def _load(self) -> None:
        size = os.fstat(self._fd).st_size
        data = os.pread(self._fd, size, 0) if size else b""
        self._n = -(-size // SLOT_BYTES)
        for i in range(self._n):
            slot = data[i * SLOT_BYTES : (i + 1) * SLOT_BYTES]
            if not slot.startswith(_SLOT_MAGIC):
                self._free.append(i)  # zeroed (deleted) or torn by a crash before its fsync
                continue
            n = int.from_bytes(slot[2:4], "big")
            try:
                key = WrappedKey.decode(slot[4 : 4 + n])
            except CorruptRecord:
                self._free.append(i)
                continue
            self._slots[key.name] = i
            self._keys[key.name] = key
        self._free.reverse()

    def _import_lmdb(self) -> None:
        """Move the keys of an LMDB key store in this directory into slots, then scrub its files."""
        old = LmdbWrappedKeyStore(self.path)
        try:
            keys = list(old.all_wrapped())
        finally:
            old.close()
        for k in keys:
            self.put_wrapped(k)
        os.fsync(self._fd)
        for name in ("data.mdb", "lock.mdb"):
            scrub_file(self.path / name)
        fsync_dir(self.path)


def scrub_file(path: Path) -> None:
    """Overwrite a file with zeros in place (fsynced), then remove it."""
    if not path.exists():
        return
    fd = os.open(path, os.O_WRONLY)
    try:
        size = os.fstat(fd).st_size
        zeros = bytes(1 << 20)
        for off in range(0, size, len(zeros)):
            os.pwrite(fd, zeros[: min(len(zeros), size - off)], off)
        os.fsync(fd)
    finally:
        os.close(fd)
    path.unlink()


def open_key_store(path: str | os.PathLike[str], *, sync: bool = True) -> WrappedKeyStore:
    """The local key store of a daemon: slots (``SlotFileKeyStore``), importing an earlier LMDB store."""
    return SlotFileKeyStore(path, sync=sync)
