"""JSON from an untrusted peer, parsed only after its size and nesting depth are known to be small.

Python's ``json`` recurses once per nesting level: a few kilobytes of ``[`` raise RecursionError
(not a ValueError) in whatever thread parses them, and a long document costs time in proportion.
``loads_bounded`` measures both first, with a flat scan that does not recurse, and refuses with
``JsonRefused`` (a ValueError) before ``json`` sees a byte; every other way the bytes can fail to
be JSON is a JsonRefused too. Callers turn it into their own named error (AuthError for a token,
InvalidRequest for a data-plane message).
"""

from __future__ import annotations

import json
from typing import Any

_OPEN = frozenset(b"[{")
_CLOSE = frozenset(b"]}")
_QUOTE = ord('"')
_BACKSLASH = ord("\\")


class JsonRefused(ValueError):
    """Bytes that are too large, nested too deep, not UTF-8 or not JSON (the message says which)."""


def nesting_depth(raw: bytes) -> int:
    """The deepest nesting of arrays and objects in ``raw``, brackets inside strings not counted.

    A flat scan (no recursion), meant for bytes already known to be short; malformed input gets
    a number, not an error (``json`` judges the rest).
    """
    depth = deepest = 0
    in_string = escaped = False
    for b in raw:
        if in_string:
            if escaped:
                escaped = False
            elif b == _BACKSLASH:
                escaped = True
            elif b == _QUOTE:
                in_string = False
        elif b == _QUOTE:
            in_string = True
        elif b in _OPEN:
            depth += 1
            deepest = max(deepest, depth)
        elif b in _CLOSE:
            depth -= 1
    return deepest


def loads_bounded(raw: bytes, *, max_bytes: int, max_depth: int) -> Any:
    """``json.loads(raw)``, once ``raw`` is at most ``max_bytes`` long and nested at most ``max_depth`` deep."""
    if len(raw) > max_bytes:
        raise JsonRefused(f"{len(raw)} bytes of JSON exceed the bound of {max_bytes}")
    depth = nesting_depth(raw)
    if depth > max_depth:
        raise JsonRefused(f"JSON nested {depth} deep exceeds the bound of {max_depth}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise JsonRefused("not UTF-8") from None
    try:
        return json.loads(text)
    except ValueError as exc:  # JSONDecodeError, and an integer too long to convert
        raise JsonRefused(f"not JSON ({type(exc).__name__})") from None
