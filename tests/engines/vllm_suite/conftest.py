"""Fixtures of the vLLM connector suite: a fresh process cache per test and the salt key file."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from connectors.provision import forget_shared_caches

SALT_KEY = b"salt-key-for-the-vllm-suite-0123456789abcdef"


@pytest.fixture(autouse=True)
def _fresh_caches() -> Iterator[None]:
    forget_shared_caches()
    yield
    forget_shared_caches()


@pytest.fixture
def salt_key_file(tmp_path: Path) -> str:
    p = tmp_path / "salt.key"
    p.write_bytes(SALT_KEY.hex().encode())
    p.chmod(0o600)  # a key file: the secret-file rule applies
    return str(p)
