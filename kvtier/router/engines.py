"""The engines behind the router: a name, an OpenAI-compatible base URL, and the node whose
kvtier daemon serves it (the ``Locate`` answer that prices a request on that engine).

Flag form: ``NODE=URL`` (``--engine``); several engines may share a node (one daemon per host,
one engine per GPU). An engine is named after its node, ``NODE/2``, ``NODE/3`` ... for a node's
second and later engines.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from kvtier.errors import ConfigError

_NODE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")


@dataclass(slots=True, frozen=True)
class EngineSpec:
    """One engine: ``url`` is its base (``http://host:port``, no path); ``node`` names its daemon."""

    name: str
    url: str
    node: str


def parse_engines(specs: Sequence[str]) -> list[EngineSpec]:
    """Engines from ``NODE=URL`` strings; ConfigError naming the flag value for any mistake."""
    if not specs:
        raise ConfigError("--engine: at least one engine (NODE=URL) is needed")
    out: list[EngineSpec] = []
    seen_urls: set[str] = set()
    per_node: dict[str, int] = {}
    for spec in specs:
        node, sep, url = spec.partition("=")
        node, url = node.strip(), url.strip().rstrip("/")
        if not sep or not node or not url:
            raise ConfigError(f"--engine {spec!r}: expected NODE=URL, e.g. node-a=http://10.0.0.11:8000")
        if not _NODE.fullmatch(node):
            raise ConfigError(f"--engine {spec!r}: node name: 1-63 letters, digits and ._- "
                              "(starting with a letter or digit)")
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.path or parts.query:
            raise ConfigError(f"--engine {spec!r}: the URL must be http(s)://HOST:PORT, without a path "
                              "(the router adds /v1/...)")
        try:
            parts.port  # noqa: B018 - raises on a port out of range
        except ValueError:
            raise ConfigError(f"--engine {spec!r}: the URL's port is not a port number") from None
        if url in seen_urls:
            raise ConfigError(f"--engine: {url} is given twice")
        seen_urls.add(url)
        per_node[node] = per_node.get(node, 0) + 1
        name = node if per_node[node] == 1 else f"{node}/{per_node[node]}"
        out.append(EngineSpec(name, url, node))
    return out
