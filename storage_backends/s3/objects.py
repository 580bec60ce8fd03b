"""Small control objects kept beside the blocks in the remote tier's bucket, under
``<prefix>/<dir>/`` (``_keys``, ``_revocations``: never a layout tag, so never parsed as blocks).

``S3Objects`` is what the wrapped-key mirror and the revocation feed share: the client, the
listing of a prefix, and the one rule for failures: a failure of the endpoint (connection,
timeout, 5xx after botocore's bounded retries, a refusal) raises TierUnavailable naming what
was being done.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import botocore.exceptions as bce

from kvtier.errors import TierUnavailable
from storage_backends.s3.config import S3Config

T = TypeVar("T")
_ERRORS = (bce.BotoCoreError, bce.ClientError)


class S3Objects:
    """The objects under ``<prefix>/<dir>/`` of one bucket. Stateless apart from the client
    (thread-safe); every call is one or a few S3 requests."""

    #: What the objects are, for error messages.
    what = "objects"

    def __init__(self, config: S3Config, directory: str) -> None:
        config.validate()
        self.config = config
        self.root = f"{config.prefix}/{directory}/"
        self._client = config.client()

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except _ERRORS as exc:
            raise TierUnavailable(f"{self.what}: {what} failed: {type(exc).__name__}") from exc

    def _objects(self, prefix: str) -> Iterator[dict[str, Any]]:
        """Every object listed under ``prefix`` (all pages), as the listing describes it."""
        token: str | None = None
        while True:
            kw: dict[str, Any] = {"Bucket": self.config.bucket, "Prefix": prefix}
            if token:
                kw["ContinuationToken"] = token
            page = self._call("list", lambda kw=kw: self._client.list_objects_v2(**kw))
            yield from page.get("Contents") or []
            token = page.get("NextContinuationToken") if page.get("IsTruncated") else None
            if not token:
                return

    def _names(self, prefix: str, keep: Callable[[str], bool] = lambda _name: True) -> list[str]:
        """Every object name under ``prefix`` that ``keep`` accepts (all pages)."""
        return [o["Key"] for o in self._objects(prefix) if keep(o["Key"])]

    def close(self) -> None:
        self._client.close()
