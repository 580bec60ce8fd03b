"""Wrapped data keys mirrored on the remote tier's bucket (a ``kvtier.crypto.WrappedKeyStore``).

Objects are named ``<prefix>/_keys/<domain hex>/<DEK id hex>``: beside the block objects of the
same prefix, never parsed as one (``_keys`` is not a layout tag), so every node that shares the
bucket finds the keys of every other node, and a scope's keys are one prefix to list and delete.
Only wrapped keys are stored (the master key never leaves the node). Failures of the endpoint
(connection, timeout, 5xx after botocore's bounded retries, a refusal) raise TierUnavailable.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import botocore.exceptions as bce

from kvtier.crypto import DEK_ID_BYTES, WrappedKey
from kvtier.errors import TierUnavailable
from kvtier.keys import DOMAIN_BYTES, ScopeDomain
from storage_backends.s3 import S3Config

T = TypeVar("T")
_ERRORS = (bce.BotoCoreError, bce.ClientError)
KEYS_DIR = "_keys"


class S3WrappedKeyStore:
    """Wrapped DEKs as small objects in the remote tier's bucket. Stateless apart from the client
    (thread-safe); every call is one or a few S3 requests."""

    def __init__(self, config: S3Config) -> None:
        config.validate()
        self.config = config
        self.root = f"{config.prefix}/{KEYS_DIR}/"
        self._client = config.client()

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except _ERRORS as exc:
            raise TierUnavailable(f"wrapped-key mirror: {what} failed: {type(exc).__name__}") from exc

    def _name(self, key: WrappedKey) -> str:
        return f"{self.root}{key.domain.hex()}/{key.dek_id.hex()}"

    def put_wrapped(self, key: WrappedKey) -> None:
        body = key.encode()
        self._call("put", lambda: self._client.put_object(Bucket=self.config.bucket, Key=self._name(key), Body=body))

    def _names(self, prefix: str) -> list[str]:
        names: list[str] = []
        token: str | None = None
        while True:
            kw: dict[str, Any] = {"Bucket": self.config.bucket, "Prefix": prefix}
            if token:
                kw["ContinuationToken"] = token
            page = self._call("list", lambda kw=kw: self._client.list_objects_v2(**kw))
            names.extend(o["Key"] for o in page.get("Contents") or [] if _well_formed(o["Key"], self.root))
            token = page.get("NextContinuationToken") if page.get("IsTruncated") else None
            if not token:
                return names

    def _get(self, name: str) -> WrappedKey:
        body = self._call("get", lambda: self._client.get_object(Bucket=self.config.bucket, Key=name)["Body"].read())
        return WrappedKey.decode(body)

    def wrapped_for(self, domain: ScopeDomain) -> list[WrappedKey]:
        return [self._get(n) for n in self._names(f"{self.root}{domain.hex()}/")]

    def delete_domain(self, domain: ScopeDomain) -> int:
        names = self._names(f"{self.root}{domain.hex()}/")
        for i in range(0, len(names), 1000):
            chunk = [{"Key": n} for n in names[i : i + 1000]]
            resp = self._call("delete", lambda chunk=chunk: self._client.delete_objects(
                Bucket=self.config.bucket, Delete={"Objects": chunk, "Quiet": True}))
            if resp.get("Errors"):
                raise TierUnavailable(f"wrapped-key mirror: {len(resp['Errors'])} keys could not be deleted")
        return len(names)

    def all_wrapped(self) -> Iterator[WrappedKey]:
        for n in self._names(self.root):
            yield self._get(n)

    def close(self) -> None:
        self._client.close()


def _well_formed(name: str, root: str) -> bool:
    parts = name[len(root):].split("/")
    return len(parts) == 2 and len(parts[0]) == 2 * DOMAIN_BYTES and len(parts[1]) == 2 * DEK_ID_BYTES
