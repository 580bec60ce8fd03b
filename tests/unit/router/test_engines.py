"""Engines as flags give them (kvtier/router/engines.py)."""

from __future__ import annotations

import pytest

from kvtier.errors import ConfigError
from kvtier.router.engines import EngineSpec, parse_engines


def test_engines_are_named_after_their_node() -> None:
    got = parse_engines(["n1=http://10.0.0.1:8000/", "n1=http://10.0.0.1:8001", "n2=https://h:443"])
    assert got == [EngineSpec("n1", "http://10.0.0.1:8000", "n1"), EngineSpec("n1/2", "http://10.0.0.1:8001", "n1"),
                   EngineSpec("n2", "https://h:443", "n2")]


@pytest.mark.parametrize(("spec", "words"), [
    ("n1", "expected NODE=URL"), ("=http://h:1", "expected NODE=URL"), ("-x=http://h:1", "node name"),
    ("n1=h:1", "http(s)://HOST:PORT"), ("n1=http://h:1/v1", "without a path"), ("n1=http://h:99999", "port"),
])
def test_bad_engines_are_refused_by_name(spec: str, words: str) -> None:
    with pytest.raises(ConfigError, match="--engine") as exc:
        parse_engines([spec])
    assert words in str(exc.value)


def test_no_engine_and_a_repeated_url_are_refused() -> None:
    with pytest.raises(ConfigError, match="at least one"):
        parse_engines([])
    with pytest.raises(ConfigError, match="given twice"):
        parse_engines(["a=http://h:1", "b=http://h:1"])
