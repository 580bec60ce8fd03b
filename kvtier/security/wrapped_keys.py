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
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.env = lmdb.open(str(self.path), map_size=_KEYS_MAP, max_dbs=2, sync=sync, metasync=sync,
                             readahead=False, lock=True)
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
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True, mode=0o700)

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
                self.primary.put_wrapped(k)
                local.append(k)
        return local

    def delete_domain(self, domain: ScopeDomain) -> int:
        n = self.primary.delete_domain(domain)
        with self._lock:
            for name in [n_ for n_ in self.pending if n_[:DOMAIN_BYTES] == domain]:
                del self.pending[name]
        return max(n, self.mirror.delete_domain(domain))

    def all_wrapped(self) -> Iterator[WrappedKey]:
        return self.primary.all_wrapped()
