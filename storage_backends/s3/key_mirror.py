"""Wrapped data keys mirrored on the remote tier's bucket (a ``kvtier.crypto.WrappedKeyStore``).

Objects are named ``<prefix>/_keys/<domain hex>/<DEK id hex>``: beside the block objects of the
same prefix, never parsed as one (``_keys`` is not a layout tag), so every node that shares the
bucket finds the keys of every other node, and a scope's keys are one prefix to list and delete.
Only wrapped keys are stored (the master key never leaves the node).

Each object is ``MAGIC || HMAC-SHA256(auth key, label || name || record) || record``, the auth
key derived from the deployment's server secret: a key read from the bucket is adopted only if
its tag verifies and the domain and DEK id inside it are the ones its name says. Someone who can
write the bucket but lacks the secret cannot plant a key (say, one under a master-key id no node
has, which would stop a node at its next start): such an object is refused and counted
(``rejected``), and reading a block under it is a miss. Failures of the endpoint (connection,
timeout, 5xx after botocore's bounded retries, a refusal) raise TierUnavailable.
"""

from __future__ import annotations

import hashlib
import hmac
import threading
from collections.abc import Iterator

from kvtier.errors import CorruptRecord, TierUnavailable
from kvtier.keys import DOMAIN_BYTES, ScopeDomain
from kvtier.security.master_keys import DEK_ID_BYTES
from kvtier.security.wrapped_keys import WrappedKey
from storage_backends.s3.config import S3Config
from storage_backends.s3.objects import S3Objects

KEYS_DIR = "_keys"
MAGIC = b"kvtk2\x00"
_LABEL = b"kvtier-wrapped-key-mirror-v2\x00"
_TAG = 32
#: A wrapped key record is about 100 bytes (more with a KMS); anything larger is not one of ours.
MAX_KEY_OBJECT = 16 << 10


class S3WrappedKeyStore(S3Objects):
    """Wrapped DEKs as small authenticated objects in the remote tier's bucket.

    Invariants: ``rejected`` (under ``_lock``) only grows: objects that failed verification.
    """

    what = "wrapped-key mirror"

    def __init__(self, config: S3Config, *, auth_key: bytes) -> None:
        if len(auth_key) < 32:
            raise ValueError("wrapped-key mirror auth_key must be at least 32 bytes (derive it from the server secret)")
        super().__init__(config, KEYS_DIR)
        self._auth = bytes(auth_key)
        self._lock = threading.Lock()
        self.rejected = 0

    def _rel(self, domain: ScopeDomain, dek_id: bytes) -> str:
        return f"{domain.hex()}/{dek_id.hex()}"

    def _name(self, key: WrappedKey) -> str:
        return self.root + self._rel(key.domain, key.dek_id)

    def _tag(self, rel: str, record: bytes) -> bytes:
        return hmac.new(self._auth, _LABEL + rel.encode() + b"\x00" + record, hashlib.sha256).digest()

    def seal(self, key: WrappedKey) -> bytes:
        record = key.encode()
        return MAGIC + self._tag(self._rel(key.domain, key.dek_id), record) + record

    def open(self, name: str, body: bytes) -> WrappedKey:
        """The key an object holds; CorruptRecord unless its tag verifies under the deployment's
        key and it is the key its name says (domain and DEK id)."""
        rel = name[len(self.root):]
        if len(body) > MAX_KEY_OBJECT or not body.startswith(MAGIC) or len(body) < len(MAGIC) + _TAG:
            raise CorruptRecord("wrapped-key object is not one this deployment wrote")
        tag, record = body[len(MAGIC) : len(MAGIC) + _TAG], body[len(MAGIC) + _TAG :]
        if not hmac.compare_digest(tag, self._tag(rel, record)):
            raise CorruptRecord("wrapped-key object's tag does not verify (not written by a node of this deployment)")
        key = WrappedKey.decode(record)
        if self._rel(key.domain, key.dek_id) != rel:
            raise CorruptRecord("wrapped-key object names another domain or key id")
        return key

    def put_wrapped(self, key: WrappedKey) -> None:
        body = self.seal(key)
        self._call("put", lambda: self._client.put_object(Bucket=self.config.bucket, Key=self._name(key), Body=body))

    def _get(self, name: str) -> WrappedKey | None:
        """The verified key of an object, or None (counted) when it does not verify."""
        def fetch() -> bytes:
            obj = self._client.get_object(Bucket=self.config.bucket, Key=name)
            return obj["Body"].read(MAX_KEY_OBJECT + 1)

        body = self._call("get", fetch)
        try:
            return self.open(name, body)
        except CorruptRecord:
            with self._lock:
                self.rejected += 1
            return None

    def wrapped_for(self, domain: ScopeDomain) -> list[WrappedKey]:
        got = [self._get(n) for n in self._names(f"{self.root}{domain.hex()}/", self._well_formed)]
        return [k for k in got if k is not None]

    def delete_domain(self, domain: ScopeDomain) -> int:
        names = self._names(f"{self.root}{domain.hex()}/")  # every object of the domain, well formed or not
        for i in range(0, len(names), 1000):
            chunk = [{"Key": n} for n in names[i : i + 1000]]
            resp = self._call("delete", lambda chunk=chunk: self._client.delete_objects(
                Bucket=self.config.bucket, Delete={"Objects": chunk, "Quiet": True}))
            if resp.get("Errors"):
                raise TierUnavailable(f"wrapped-key mirror: {len(resp['Errors'])} keys could not be deleted")
        return len([n for n in names if self._well_formed(n)])

    def all_wrapped(self) -> Iterator[WrappedKey]:
        for n in self._names(self.root, self._well_formed):
            k = self._get(n)
            if k is not None:
                yield k

    def _well_formed(self, name: str) -> bool:
        parts = name[len(self.root):].split("/")
        return len(parts) == 2 and len(parts[0]) == 2 * DOMAIN_BYTES and len(parts[1]) == 2 * DEK_ID_BYTES
