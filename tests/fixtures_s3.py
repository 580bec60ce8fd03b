"""pytest fixtures for the remote tier: one real SeaweedFS per test session, a fresh prefix per test.

Loaded from tests/conftest.py (``pytest_plugins``) where boto3 is installed (a GPU box has none).
Nothing here mocks S3: every test talks HTTP
to a ``weed mini`` bound to loopback on free ports in a temporary directory.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvtier.server.embedded_s3 import EmbeddedS3
from storage_backends.s3 import S3Tier
from storage_backends.s3.config import S3Config

#: Small volumes: a test session writes a few MiB, and many small volume slots leave room for
#: the few tests that create extra buckets (each bucket is its own SeaweedFS collection).
VOLUME_MB = 64


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedS3]:
    """The session's SeaweedFS. Tests must not stop it; fault tests start their own."""
    srv = EmbeddedS3(tmp_path_factory.mktemp("seaweedfs"), bucket="kvtier-test", volume_size_limit_mb=VOLUME_MB)
    srv.start()
    yield srv
    srv.kill()


@pytest.fixture
def s3_prefix() -> str:
    """A prefix no other test uses, so each test sees an empty remote tier."""
    return f"t-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def s3_config(s3_server: EmbeddedS3, s3_prefix: str) -> S3Config:
    return s3_server.s3_config(s3_prefix)


@pytest.fixture
def make_s3_tier(s3_server: EmbeddedS3, s3_prefix: str) -> Iterator[Callable[..., S3Tier]]:
    """Factory for S3 tiers on the session server (same fresh prefix unless given); all closed after."""
    tiers: list[S3Tier] = []

    def make(prefix: str | None = None, sealer: Any = None, **overrides: Any) -> S3Tier:
        t = S3Tier(s3_server.s3_config(prefix or s3_prefix, **overrides), sealer=sealer)
        tiers.append(t)
        return t

    yield make
    for t in tiers:
        t.close()


@pytest.fixture
def fresh_bucket(s3_server: EmbeddedS3) -> str:
    """A new, empty bucket on the session server (use sparingly: each is a SeaweedFS collection)."""
    return s3_server.create_bucket(f"kvt-{uuid.uuid4().hex[:12]}")


@pytest.fixture
def raw_s3(s3_server: EmbeddedS3) -> Any:
    """A plain boto3 client on the session server, for inspecting and planting objects."""
    return s3_server.client()
