"""Shared pytest configuration: fixture plugins used across the suites."""

import os
import sys
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


# -- the engine suites (tests/engines/suite_runs.py) ---------------------------------------------------
_ENGINE_SUITE_TEST = "tests/engines/test_engine_suites.py::test_engine_suite_passes_in_its_venv["


def pytest_collection_modifyitems(session, config, items) -> None:
    """The engine-suite tests go last: they wait for suites that run beside the rest of the session."""
    items.sort(key=lambda item: item.nodeid.startswith(_ENGINE_SUITE_TEST))  # stable: the order is kept otherwise


def pytest_collection_finish(session) -> None:
    """Start the collected engine suites in the background (KVTIER_ENGINE_SUITES_EARLY=0: don't)."""
    if os.environ.get("KVTIER_ENGINE_SUITES_EARLY", "1") == "0" or session.config.option.collectonly:
        return
    engines = [item.nodeid[len(_ENGINE_SUITE_TEST):-1] for item in session.items
               if item.nodeid.startswith(_ENGINE_SUITE_TEST)]
    if engines:
        from tests.engines.suite_runs import RUNS

        RUNS.start(engines)


def pytest_sessionfinish(session, exitstatus) -> None:
    runs = sys.modules.get("tests.engines.suite_runs")
    if runs is not None:
        runs.RUNS.stop()
