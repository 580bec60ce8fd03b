"""Shared pytest configuration: fixture plugins used across the suites."""

from importlib.util import find_spec

#: Third-party packages the S3 fixtures import (boto3 through kvtier.embedded_s3 and
#: storage_backends.s3, msgpack and xxhash through kvtier.codec).
_S3_FIXTURE_DEPS = ("boto3", "msgpack", "xxhash")


def _installed(name: str) -> bool:
    try:
        return find_spec(name) is not None
    except (ImportError, ValueError):  # an import hook refuses it, or sys.modules blocks it with None
        return False


# A GPU box carries only torch (+ cupy, pytest), and a plugin that fails to import stops pytest
# before it collects anything, so `pytest -m gpu` could not even start there. Where these are
# missing no test can use the S3 fixtures anyway: one that asks for them errors, "fixture not found".
pytest_plugins = ["tests.fixtures_s3"] if all(_installed(m) for m in _S3_FIXTURE_DEPS) else []
