"""Wrapped data keys mirrored on the remote tier's bucket (a ``kvtier.crypto.WrappedKeyStore``).

Objects are named ``<prefix>/_keys/<domain hex>/<DEK id hex>``: beside the block objects of the
same prefix, never parsed as one (``_keys`` is not a layout tag), so every node that shares the
bucket finds the keys of every other node, and a scope's keys are one prefix to list and delete.
Only wrapped keys are stored (the master key never leaves the node). Failures of the endpoint
(connection, timeout, 5xx after botocore's bounded retries, a refusal) raise TierUnavailable.
"""

from __future__ import annotations

from collections.abc import Iterator

from kvtier.errors import TierUnavailable
from kvtier.keys import DOMAIN_BYTES, ScopeDomain
from kvtier.security.master_keys import DEK_ID_BYTES
from kvtier.security.wrapped_keys import WrappedKey
from storage_backends.s3_config import S3Config
from storage_backends.s3_objects import S3Objects

KEYS_DIR = "_keys"


class S3WrappedKeyStore(S3Objects):
    """Wrapped DEKs as small objects in the remote tier's bucket."""

    what = "wrapped-key mirror"

    def __init__(self, config: S3Config) -> None:
        super().__init__(config, KEYS_DIR)

    def _name(self, key: WrappedKey) -> str:
        return f"{self.root}{key.domain.hex()}/{key.dek_id.hex()}"

    def put_wrapped(self, key: WrappedKey) -> None:
        body = key.encode()
        self._call("put", lambda: self._client.put_object(Bucket=self.config.bucket, Key=self._name(key), Body=body))

    def _get(self, name: str) -> WrappedKey:
        body = self._call("get", lambda: self._client.get_object(Bucket=self.config.bucket, Key=name)["Body"].read())
        return WrappedKey.decode(body)

    def wrapped_for(self, domain: ScopeDomain) -> list[WrappedKey]:
        return [self._get(n) for n in self._names(f"{self.root}{domain.hex()}/", self._well_formed)]

    def delete_domain(self, domain: ScopeDomain) -> int:
        names = self._names(f"{self.root}{domain.hex()}/", self._well_formed)
        for i in range(0, len(names), 1000):
            chunk = [{"Key": n} for n in names[i : i + 1000]]
            resp = self._call("delete", lambda chunk=chunk: self._client.delete_objects(
                Bucket=self.config.bucket, Delete={"Objects": chunk, "Quiet": True}))
            if resp.get("Errors"):
                raise TierUnavailable(f"wrapped-key mirror: {len(resp['Errors'])} keys could not be deleted")
        return len(names)

    def all_wrapped(self) -> Iterator[WrappedKey]:
        for n in self._names(self.root, self._well_formed):
            yield self._get(n)

    def _well_formed(self, name: str) -> bool:
        parts = name[len(self.root):].split("/")
        return len(parts) == 2 and len(parts[0]) == 2 * DOMAIN_BYTES and len(parts[1]) == 2 * DEK_ID_BYTES
