"""Block keys and scopes: isolation is part of the key.

``block_key[i] = sha256(block_key[i-1] || scope_domain[i] || tokens[i])`` with the root seeded
by the layout fingerprint. Tokens are encoded as fixed-width little-endian uint32, so keys are
identical across processes, machines and Python versions (no builtin ``hash()``, no pickle).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import NewType, Protocol

import numpy as np

from kvtier.errors import ScopeError
from kvtier.layout import KVLayout

BlockKey = NewType("BlockKey", bytes)
"""56 bytes: ``scope domain (16) || layout tag (8) || chained sha256 digest (32)``.

The digest identifies the block's content and, through the chain, everything before it. The
routing prefix makes every key self-describing: a tier or server can tell a key's scope domain
(to check access, to delete a scope by prefix) and layout (to name remote objects) without a
side table, and two layouts or two scopes can never collide.
"""

ScopeDomain = NewType("ScopeDomain", bytes)
"""16-byte opaque id of a scope: HMAC(server secret, scope). Reveals no tenant name."""

DOMAIN_BYTES = 16
LAYOUT_TAG_BYTES = 8
DIGEST_BYTES = 32
KEY_BYTES = DOMAIN_BYTES + LAYOUT_TAG_BYTES + DIGEST_BYTES


def key_domain(key: BlockKey) -> ScopeDomain:
    return ScopeDomain(key[:DOMAIN_BYTES])


def key_layout_tag(key: BlockKey) -> bytes:
    return key[DOMAIN_BYTES : DOMAIN_BYTES + LAYOUT_TAG_BYTES]


def key_digest(key: BlockKey) -> bytes:
    return key[DOMAIN_BYTES + LAYOUT_TAG_BYTES :]


def key_prefix(domain: ScopeDomain, layout_tag: bytes) -> bytes:
    """What every key of one scope domain and layout starts with (``make_key``)."""
    assert len(domain) == DOMAIN_BYTES and len(layout_tag) == LAYOUT_TAG_BYTES
    return domain + layout_tag


def make_key(domain: ScopeDomain, layout_tag: bytes, digest: bytes) -> BlockKey:
    assert len(digest) == DIGEST_BYTES
    return BlockKey(key_prefix(domain, layout_tag) + digest)


class ScopeKind(IntEnum):
    """Ordered by restrictiveness: a larger value is more private."""

    PUBLIC = 0
    ORG = 1
    USER = 2
    SESSION = 3


@dataclass(frozen=True, slots=True)
class Scope:
    """Who may reuse a segment's KV: ``public``, ``org:<id>``, ``user:<id>``, ``session:<id>``."""

    kind: ScopeKind
    ident: str = ""

    def __post_init__(self) -> None:
        if (self.kind is ScopeKind.PUBLIC) != (self.ident == ""):
            raise ScopeError("public scope has no id; every other scope needs one")
        if ":" in self.ident or any(c.isspace() for c in self.ident):
            raise ScopeError(f"scope id {self.ident!r} may not contain ':' or whitespace")

    @classmethod
    def parse(cls, text: str) -> Scope:
        if text == "public":
            return PUBLIC
        kind, sep, ident = text.partition(":")
        if not sep or not ident:
            raise ScopeError(f"malformed scope {text!r}: expected public, org:<id>, user:<id> or session:<id>")
        try:
            return cls(ScopeKind[kind.upper()], ident)
        except KeyError:
            raise ScopeError(f"unknown scope kind {kind!r} in {text!r}") from None

    @classmethod
    def public(cls) -> Scope:
        return PUBLIC

    @classmethod
    def org(cls, ident: str) -> Scope:
        return cls(ScopeKind.ORG, ident)

    @classmethod
    def user(cls, ident: str) -> Scope:
        return cls(ScopeKind.USER, ident)

    @classmethod
    def session(cls, ident: str) -> Scope:
        return cls(ScopeKind.SESSION, ident)

    def __str__(self) -> str:
        return "public" if self.kind is ScopeKind.PUBLIC else f"{self.kind.name.lower()}:{self.ident}"


PUBLIC = Scope(ScopeKind.PUBLIC)


def narrower(a: Scope, b: Scope) -> Scope:
    """The more restrictive of two scopes; two different scopes of one kind cannot be combined."""
    if a.kind != b.kind:
        return a if a.kind > b.kind else b
    if a != b:
        raise ScopeError(f"a request cannot mix {a} and {b}: neither contains the other")
    return a


@dataclass(frozen=True, slots=True)
class Segment:
    """A run of tokens that share one scope (e.g. a public manual, a user's private history)."""

    tokens: Sequence[int]
    scope: Scope = PUBLIC


class DomainDeriver:
    """Maps scopes to opaque scope-domain ids with a server secret (HMAC-SHA256, truncated).

    The secret is deployment key material: identical on every node sharing a remote tier and
    stable across restarts, or nothing stored earlier is ever found again.
    """

    __slots__ = ("_secret",)

    def __init__(self, secret: bytes) -> None:
        if len(secret) < 16:
            raise ValueError("server secret must be at least 16 bytes")
        self._secret = bytes(secret)

    def domain(self, scope: Scope) -> ScopeDomain:
        mac = hmac.new(self._secret, b"kvtier-scope-v1\x00" + str(scope).encode(), hashlib.sha256)
        return ScopeDomain(mac.digest()[:DOMAIN_BYTES])

    def subkey(self, label: str) -> bytes:
        """A 32-byte key for another purpose of the same deployment (``label`` names it), so
        nodes that share the secret share the key and nothing else can make it."""
        return hmac.new(self._secret, b"kvtier-subkey-v1\x00" + label.encode(), hashlib.sha256).digest()

    def __repr__(self) -> str:  # never print the secret
        return "DomainDeriver(<secret>)"


@dataclass(frozen=True, slots=True)
class ChainBlock:
    """One full block of a request's key chain."""

    index: int
    key: BlockKey
    parent: BlockKey | None
    scope: Scope
    domain: ScopeDomain
    start_token: int


def root_digest(layout: KVLayout) -> bytes:
    return hashlib.sha256(b"kvtier-root-v1\x00" + layout.fingerprint).digest()


def encode_tokens(tokens: Sequence[int] | np.ndarray) -> bytes:
    arr = np.asarray(tokens, dtype=np.int64)
    if arr.size and (arr.min() < 0 or arr.max() > 0xFFFFFFFF):
        raise ValueError("token ids must fit in uint32")
    return arr.astype("<u4").tobytes()


def chain_step(parent_digest: bytes, domain: ScopeDomain, token_bytes: bytes) -> bytes:
    """``sha256(parent digest || domain || tokens)``: the 256-bit chained hash of one block."""
    h = hashlib.sha256(parent_digest)
    h.update(domain)
    h.update(token_bytes)
    return h.digest()


class DomainSource(Protocol):
    """Where a chain's scope domains come from: a ``DomainDeriver`` (holds the server secret) or
    a daemon's answer for one caller (``kvtier.security.domain_table.DomainTable``)."""

    def domain(self, scope: Scope) -> ScopeDomain: ...


def block_chain(layout: KVLayout, segments: Iterable[Segment], deriver: DomainSource,
                after: ChainBlock | None = None) -> list[ChainBlock]:
    """Chained keys of every *full* block of a request; a partial last block is not cached.

    The scope of block i is the most restrictive scope of any token in blocks 0..i. ``after``:
    the segments continue a chain whose last block (so far) is ``after``; the blocks come out as
    that longer chain's would, from ``after.index + 1`` (a chain is computed once, then extended).
    """
    # Scopes are folded per segment, not per token: long prompts (tens of thousands of tokens)
    # then cost one numpy encode plus one hash per block, with no Python work per token.
    runs: list[tuple[int, Scope]] = []  # (first token, scope) of each non-empty segment, in order
    encoded: list[bytes] = []
    n_tokens = 0
    for seg in segments:
        if len(seg.tokens) == 0:
            continue
        runs.append((n_tokens, seg.scope))
        encoded.append(encode_tokens(seg.tokens))
        n_tokens += len(seg.tokens)
    bt = layout.block_tokens
    out: list[ChainBlock] = []
    prev = root_digest(layout) if after is None else key_digest(after.key)
    tag = layout.fingerprint[:LAYOUT_TAG_BYTES]
    parent: BlockKey | None = None if after is None else after.key
    scope = PUBLIC if after is None else after.scope
    first = 0 if after is None else after.index + 1
    assert after is None or key_layout_tag(after.key) == tag, "a chain continues only in its own layout"
    domains: dict[Scope, ScopeDomain] = {}
    enc = memoryview(b"".join(encoded))
    step = bt * 4
    next_run = 0
    dom, prefix = ScopeDomain(b""), b""
    for i in range(n_tokens // bt):
        started = next_run
        while next_run < len(runs) and runs[next_run][0] < (i + 1) * bt:
            scope = narrower(scope, runs[next_run][1])
            next_run += 1
        if next_run != started:
            # The scope changes only in a block where a segment starts (block 0 always): the domain
            # and the keys' prefix are looked up there, not per block (a tenth of a long chain's time).
            known = domains.get(scope)
            dom = domains[scope] = deriver.domain(scope) if known is None else known
            prefix = key_prefix(dom, tag)
        prev = chain_step(prev, dom, enc[i * step : (i + 1) * step])
        key = BlockKey(prefix + prev)
        out.append(ChainBlock(first + i, key, parent, scope, dom, (first + i) * bt))
        parent = key
    return out
