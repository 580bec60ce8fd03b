"""Scopes for engines that give kvtier only a token list and a principal.

vLLM and SGLang requests carry no segments. A ``ScopeRule`` decides which blocks of such a
request are public and which are private to the principal; it must never put private content
into a shared scope:

- ``private``: every block in the principal's own private scope (``user`` by default). Safe and
  simple; nothing is shared across principals.
- ``public-registry``: the longest prefix of the request that is *already published* in the
  public scope (by a principal holding ``publish:public``, e.g. through the transformers
  connector or the KVCache API) is public; everything after it is private. The public scope
  itself is the registry of known public documents, recognised by their key chain. A request can
  only ever match public blocks whose tokens equal its own, so nothing private is revealed, and
  the engine never writes a public block on a request's behalf (the connector saves only the
  private part). Probing whether a public document is cached is possible by design, as for any
  public content (see docs/security.md and KVCache's timing mitigations). ``scoped_lookup``
  remembers each document's published cut, so a repeated one costs one lookup, not two.

The same rules scope what the daemon's ``Locate`` answers for a request (kvtier/server/locate.py),
so a router is told what the engine's own lookup would find. ``layout`` names the KV layout when
the cache serves several (the daemon's does); an engine's cache serves one.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtier.cache.kv_cache import RequestSegment
from kvtier.cache.prefix_cache import PrefixCache
from kvtier.errors import AccessDenied, ConfigError, ScopeError
from kvtier.keys import BlockKey, ChainBlock, ScopeKind
from kvtier.layout import KVLayout
from kvtier.security.policy import Principal
from kvtier.store.lookup import Lookup


@dataclass(slots=True, frozen=True)
class ScopedPrompt:
    """A request's tokens, how many leading full blocks are public, and the kind of the rest."""

    tokens: tuple[int, ...]
    public_blocks: int
    private_kind: ScopeKind

    def segments(self, block_tokens: int) -> list[RequestSegment]:
        cut = self.public_blocks * block_tokens
        return [RequestSegment(self.tokens[:cut], ScopeKind.PUBLIC),
                RequestSegment(self.tokens[cut:], self.private_kind)]


@dataclass(slots=True, frozen=True)
class ScopedLookup:
    """What a scheduler asks per request: the prompt's scopes, its chain (every block the lookup
    asked about, keys derived once) and what the lookup found."""

    prompt: ScopedPrompt
    chain: tuple[ChainBlock, ...]
    lookup: Lookup


class ScopeRule(ABC):
    """Splits an engine request into public and private parts (see module docstring)."""

    name: str

    def __init__(self, private_kind: ScopeKind = ScopeKind.USER) -> None:
        if private_kind is ScopeKind.PUBLIC:
            raise ConfigError("kvtier.private_scope: the private part of a request cannot be public")
        self.private_kind = private_kind

    @abstractmethod
    def scope(self, cache: PrefixCache, principal: Principal, tokens: Sequence[int], n_blocks: int,
              layout: KVLayout | None = None) -> ScopedPrompt:
        """Scopes of the first ``n_blocks`` full blocks of ``tokens``."""

    def scoped_lookup(self, cache: PrefixCache, principal: Principal, tokens: Sequence[int],
                      n_blocks: int, layout: KVLayout | None = None) -> ScopedLookup:
        """``scope``, then the lookup of the keys it gives (``scoped_chain``): what an engine's
        scheduler asks per request."""
        return _looked_up(cache, principal, self.scope(cache, principal, tokens, n_blocks, layout), n_blocks,
                          layout=layout)


class PrivateRule(ScopeRule):
    name = "private"

    def scope(self, cache: PrefixCache, principal: Principal, tokens: Sequence[int], n_blocks: int,
              layout: KVLayout | None = None) -> ScopedPrompt:
        return ScopedPrompt(tuple(tokens), 0, self.private_kind)


class PublicRegistryRule(ScopeRule):
    """The published prefix, from the registry (a lookup of the request's head as public blocks).

    ``scoped_lookup`` also remembers, per document (its first public key), how far the registry
    said it was published and that block's key; a later request whose head has the same keys up
    to there is looked up with that cut directly, one lookup instead of two. Only an answer that
    ends exactly at the cut is ambiguous (nothing private cached yet, or more of the document
    published since): then the registry is asked, as without a guess. Every hit still comes
    from a lookup of the request's own keys; a stale guess can only cost hits, never widen a scope
    (the guessed blocks are the registry's own public blocks, matched key for key).

    A head it knows no document of is first looked up all private (cut 0): the principal's own
    earlier requests of the same tokens were saved so whenever the registry said their head was
    unpublished, which is the common case of a private conversation's later turns. Any block
    found is the principal's own, for these exact tokens, so the answer stands without the
    registry: one lookup instead of two. Only a miss asks the registry (a document it has not
    seen yet costs three lookups once, then it is known). A document published after the
    principal saved the same head privately is not used for that principal until the rule knows
    the document (from any request the registry answered): its own copy serves it meanwhile, and
    nothing crosses a scope either way.
    """

    name = "public-registry"
    #: Documents remembered (least recently used first out).
    KNOWN = 4096

    def __init__(self, private_kind: ScopeKind = ScopeKind.USER) -> None:
        super().__init__(private_kind)
        self._known: OrderedDict[BlockKey, tuple[int, BlockKey]] = OrderedDict()
        self._lock = threading.Lock()

    def scope(self, cache: PrefixCache, principal: Principal, tokens: Sequence[int], n_blocks: int,
              layout: KVLayout | None = None) -> ScopedPrompt:
        public = self._public_chain(cache, principal, tokens, n_blocks, layout)
        published = cache.lookup(principal, public).length if public else 0
        return ScopedPrompt(tuple(tokens), published, self.private_kind)

    def scoped_lookup(self, cache: PrefixCache, principal: Principal, tokens: Sequence[int],
                      n_blocks: int, layout: KVLayout | None = None) -> ScopedLookup:
        public = self._public_chain(cache, principal, tokens, n_blocks, layout)
        if not public:
            return _looked_up(cache, principal, ScopedPrompt(tuple(tokens), 0, self.private_kind), n_blocks,
                              layout=layout)
        guessed: ScopedLookup | None = None
        with self._lock:
            known = self._known.get(public[0].key)
            if known is not None:
                self._known.move_to_end(public[0].key)
        if known is not None and known[0] <= len(public) and public[known[0] - 1].key == known[1]:
            prompt = ScopedPrompt(tuple(tokens), known[0], self.private_kind)
            found = _looked_up(cache, principal, prompt, n_blocks, public, layout=layout)
            if found.lookup.length != known[0] or known[0] == n_blocks:
                return found
            guessed = found
        elif known is None:
            found = _looked_up(cache, principal, ScopedPrompt(tuple(tokens), 0, self.private_kind), n_blocks,
                               layout=layout)
            if found.lookup.length:
                return found  # the principal's own blocks of these tokens: no registry needed
            guessed = found
        registry = cache.lookup(principal, public)
        published = registry.length
        with self._lock:
            if published:
                self._known[public[0].key] = (published, public[published - 1].key)
                self._known.move_to_end(public[0].key)
                while len(self._known) > self.KNOWN:
                    self._known.popitem(last=False)
            else:
                self._known.pop(public[0].key, None)
        if guessed is not None and guessed.prompt.public_blocks == published:
            return guessed  # the registry agrees with the guess: its lookup stands
        prompt = ScopedPrompt(tuple(tokens), published, self.private_kind)
        if published == n_blocks:  # all of it is published: the registry's lookup is the answer
            return ScopedLookup(prompt, tuple(public), registry)
        return _looked_up(cache, principal, prompt, n_blocks, public, layout=layout)

    @staticmethod
    def _public_chain(cache: PrefixCache, principal: Principal, tokens: Sequence[int],
                      n_blocks: int, layout: KVLayout | None) -> list[ChainBlock]:
        head = tuple(tokens[: n_blocks * cache.layout(layout).block_tokens])
        if not head:
            return []
        try:
            return cache.chain(principal, [RequestSegment(head, ScopeKind.PUBLIC)], layout=layout)
        except AccessDenied:  # a principal that cannot read the public scope: nothing is public
            return []


SCOPE_RULES: dict[str, Callable[[ScopeKind], ScopeRule]] = {
    PrivateRule.name: PrivateRule,
    PublicRegistryRule.name: PublicRegistryRule,
}


def scope_rule(name: str, private_kind: str = "user") -> ScopeRule:
    try:
        kind = ScopeKind[private_kind.upper()]
    except KeyError:
        raise ConfigError(f"kvtier.private_scope: unknown scope kind {private_kind!r}") from None
    try:
        return SCOPE_RULES[name](kind)
    except KeyError:
        raise ConfigError(f"kvtier.scope_rule: unknown {name!r}; one of {sorted(SCOPE_RULES)}") from None


def _looked_up(cache: PrefixCache, principal: Principal, prompt: ScopedPrompt, n_blocks: int,
               public: Sequence[ChainBlock] = (), *, layout: KVLayout | None = None) -> ScopedLookup:
    chain = scoped_chain(cache, principal, prompt, n_blocks, public, layout=layout)
    return ScopedLookup(prompt, tuple(chain), cache.lookup(principal, chain) if chain else Lookup.miss(0))


def scoped_chain(cache: PrefixCache, principal: Principal, prompt: ScopedPrompt, n_blocks: int,
                 public: Sequence[ChainBlock] = (), *, layout: KVLayout | None = None) -> list[ChainBlock]:
    """Keys of the first ``n_blocks`` blocks; empty when the principal has no scope of the private kind
    (a token minted for public reads only, say), so such a request is simply not cached.
    ``public``: the keys of the same tokens all in the public scope, when the caller has them:
    the public blocks' keys are those, so only the private part is derived."""
    bt = cache.layout(layout).block_tokens
    cut = prompt.public_blocks
    head = ScopedPrompt(prompt.tokens[: n_blocks * bt], cut, prompt.private_kind)
    if 0 < cut <= len(public):
        try:
            rest = cache.chain(principal, [RequestSegment(head.tokens[cut * bt :], prompt.private_kind)],
                               layout=layout, after=public[cut - 1])
        except (AccessDenied, ScopeError):  # no scope of the private kind: the public part alone
            rest = []
        return [*public[:cut], *rest]
    try:
        return cache.chain(principal, head.segments(bt), layout=layout)
    except (AccessDenied, ScopeError):
        if cut == 0:
            return []
        return cache.chain(principal, [RequestSegment(head.tokens[: cut * bt], ScopeKind.PUBLIC)], layout=layout)
