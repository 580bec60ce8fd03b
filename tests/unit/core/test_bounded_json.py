"""bounded_json: size and nesting are measured without recursion before ``json`` parses a byte."""

from __future__ import annotations

import pytest

from kvtier.bounded_json import JsonRefused, loads_bounded, nesting_depth


@pytest.mark.parametrize(("raw", "depth"), [
    (b"1", 0), (b'"["', 0), (b"[]", 1), (b'{"a":[1,[2]]}', 3), (b'["\\"[[["]', 1), (b'["\\\\",[]]', 2),
    (b"[" * 100_000, 100_000), (b'{"k":"}}}]]]"}', 1),
])
def test_depth_counts_brackets_outside_strings_only(raw: bytes, depth: int) -> None:
    assert nesting_depth(raw) == depth


def test_within_bounds_parses_like_json() -> None:
    assert loads_bounded(b'{"a":["x",1]}', max_bytes=64, max_depth=2) == {"a": ["x", 1]}


@pytest.mark.parametrize(("raw", "max_bytes", "max_depth", "reason"), [
    (b"[" * 5000 + b"]" * 5000, 16 << 10, 64, "nested 5000 deep"),  # json itself: RecursionError
    (b'{"a":{"b":1}}', 64, 1, "nested 2 deep"),
    (b'"' + b"x" * 100 + b'"', 64, 4, "102 bytes of JSON exceed the bound of 64"),
    (b"\xff\xfe", 64, 4, "not UTF-8"),
    (b"{", 64, 4, "not JSON"),
    (b"[1,]", 64, 4, "not JSON"),
])
def test_refusals_name_their_reason(raw: bytes, max_bytes: int, max_depth: int, reason: str) -> None:
    with pytest.raises(JsonRefused, match=reason):
        loads_bounded(raw, max_bytes=max_bytes, max_depth=max_depth)


def test_an_integer_too_long_to_convert_is_refused_not_raised() -> None:
    with pytest.raises(JsonRefused, match="not JSON"):
        loads_bounded(b"1" * 5000, max_bytes=16 << 10, max_depth=1)
