"""Where the remote tier lives (endpoint, bucket, prefix, timeouts) and how keys name objects."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import boto3
from botocore.config import Config

from kvtier.errors import ConfigError
from kvtier.keys import DIGEST_BYTES, DOMAIN_BYTES, LAYOUT_TAG_BYTES, BlockKey, ScopeDomain, make_key
from storage_backends.s3.probes import PROBES

#: S3 allows at most this many keys per DeleteObjects call.
MAX_DELETE_BATCH = 1000
#: No record is this large; a bigger object under our names is not ours and is never read.
MAX_OBJECT_BYTES = 1 << 30
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_PREFIX_SEGMENT_RE = re.compile(r"^[A-Za-z0-9._-]+$")
_HEX_RE = re.compile(r"^[0-9a-f]+$")


# -- configuration ------------------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class S3Config:
    """Where the remote tier lives and how hard it tries. Every timeout and retry is explicit.

    ``concurrency`` bounds each of the two worker pools (reads: HEAD/GET, writes: PUT/DELETE), so
    a burst of write-through uploads never queues ahead of an engine's lookup; the HTTP connection
    pool is sized to both pools plus a few connections for listing and control calls.
    """

    endpoint_url: str
    bucket: str
    prefix: str = "kvtier"
    access_key: str = "kvtier"
    secret_key: str = "kvtier-secret"
    region: str = "us-east-1"
    connect_timeout_s: float = 1.0
    read_timeout_s: float = 5.0
    #: Total attempts per request, first one included (botocore "standard" retry mode).
    max_attempts: int = 2
    concurrency: int = 16
    breaker_failures: int = 3
    breaker_cooldown_s: float = 2.0
    #: How contains() walks a chain: a name from PROBES.
    probe: str = "front"
    delete_batch: int = MAX_DELETE_BATCH
    #: PUT with ``If-None-Match: *`` (AWS S3, SeaweedFS, MinIO, Ceph RGW). False for a store that
    #: lacks it: a HEAD then a PUT, where a concurrent writer of the same key may win (same bytes,
    #: since keys are content hashes).
    conditional_put: bool = True

    def validate(self) -> None:
        """Raise ConfigError naming the first bad field; touches no network."""
        parts = urlsplit(self.endpoint_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"S3Config.endpoint_url: expected http(s)://host[:port], got {self.endpoint_url!r}")
        try:
            _ = parts.port
        except ValueError:
            raise ConfigError(f"S3Config.endpoint_url: bad port in {self.endpoint_url!r}") from None
        if not _BUCKET_RE.match(self.bucket) or ".." in self.bucket:
            raise ConfigError(
                f"S3Config.bucket: {self.bucket!r} is not a valid bucket name "
                "(3-63 characters: lowercase letters, digits, '.', '-'; starting and ending alphanumeric)"
            )
        segments = self.prefix.split("/")
        if len(self.prefix) > 256 or not all(_PREFIX_SEGMENT_RE.match(s) for s in segments):
            raise ConfigError(
                f"S3Config.prefix: {self.prefix!r} must be non-empty '/'-separated segments of "
                "letters, digits, '.', '_', '-' (no leading, trailing or doubled '/'), at most 256 characters"
            )
        if not self.access_key or not self.secret_key:
            raise ConfigError("S3Config.access_key/secret_key: both must be non-empty")
        for name in ("connect_timeout_s", "read_timeout_s", "breaker_cooldown_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"S3Config.{name} must be positive")
        for name, lo, hi in (("max_attempts", 1, 10), ("concurrency", 1, 256), ("breaker_failures", 1, 1000),
                             ("delete_batch", 1, MAX_DELETE_BATCH)):
            v = getattr(self, name)
            if not isinstance(v, int) or not lo <= v <= hi:
                raise ConfigError(f"S3Config.{name} must be an integer in [{lo}, {hi}], got {v!r}")
        if self.probe not in PROBES:
            raise ConfigError(f"S3Config.probe: unknown {self.probe!r}; one of {sorted(PROBES)}")

    def botocore_config(self) -> Config:
        return Config(
            connect_timeout=self.connect_timeout_s,
            read_timeout=self.read_timeout_s,
            retries={"max_attempts": self.max_attempts, "mode": "standard"},
            max_pool_connections=2 * self.concurrency + 4,
            s3={"addressing_style": "path"},
            signature_version="s3v4",
            tcp_keepalive=True,
            # Records carry their own xxh3 checksum, verified on every GET; a second CRC over
            # each body on both ends would only spend CPU.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )

    def client(self) -> Any:
        return boto3.session.Session().client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name=self.region,
            config=self.botocore_config(),
        )


# -- object names -------------------------------------------------------------------------------


class ObjectNamer:
    """Maps keys to object names and back: ``<prefix>/<tag hex>/<domain hex>/<digest hex>``.

    Pure and immutable; the name is a function of the key alone, so any node finds any block.
    """

    __slots__ = ("prefix",)

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    def name(self, key: BlockKey) -> str:
        dom = key[:DOMAIN_BYTES]
        tag = key[DOMAIN_BYTES : DOMAIN_BYTES + LAYOUT_TAG_BYTES]
        digest = key[DOMAIN_BYTES + LAYOUT_TAG_BYTES :]
        return f"{self.prefix}/{tag.hex()}/{dom.hex()}/{digest.hex()}"

    def root(self) -> str:
        return f"{self.prefix}/"

    def scope_prefix(self, tag_hex: str, domain: ScopeDomain) -> str:
        return f"{self.prefix}/{tag_hex}/{domain.hex()}/"

    def parse(self, name: str) -> BlockKey | None:
        """The key an object name encodes, or None for a name this namer did not produce."""
        if not name.startswith(self.root()):
            return None
        parts = name[len(self.root()) :].split("/")
        if len(parts) != 3:
            return None
        tag, dom, digest = parts
        widths = (LAYOUT_TAG_BYTES * 2, DOMAIN_BYTES * 2, DIGEST_BYTES * 2)
        if any(len(p) != w or not _HEX_RE.match(p) for p, w in zip(parts, widths, strict=True)):
            return None
        return make_key(ScopeDomain(bytes.fromhex(dom)), bytes.fromhex(tag), bytes.fromhex(digest))

    @staticmethod
    def tag_of(common_prefix: str) -> str | None:
        """``<prefix>/<tag>/`` -> tag, or None when it is not a layout-tag directory."""
        tag = common_prefix.rstrip("/").rsplit("/", 1)[-1]
        return tag if len(tag) == LAYOUT_TAG_BYTES * 2 and _HEX_RE.match(tag) else None
