"""Scopes and load decisions for engines that give kvtier only a token list and a principal.

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

``load_decision`` asks the cost model (when the engine has one) how much of a cached prefix to
reload; engines that cannot compute the front of a prompt while loading its back consider only
the plans without overlap.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtier.cache.kv_cache import RequestSegment
from kvtier.cache.prefix_cache import PrefixCache
from kvtier.errors import AccessDenied, ConfigError
from kvtier.keys import BlockKey, ChainBlock, ScopeKind
from kvtier.layout import KVLayout
from kvtier.planning.cost_model import CostModel
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
    def scope(self, cache: PrefixCache, principal: Principal, tokens: Sequence[int], n_blocks: int) -> ScopedPrompt:
        """Scopes of the first ``n_blocks`` full blocks of ``tokens``."""

    def scoped_lookup(self, cache: PrefixCache, principal: Principal, tokens: Sequence[int],
                      n_blocks: int) -> ScopedLookup:
        """``scope``, then the lookup of the keys it gives (``scoped_chain``): what an engine's
        scheduler asks per request."""
        return _looked_up(cache, principal, self.scope(cache, principal, tokens, n_blocks), n_blocks)


class PrivateRule(ScopeRule):
    name = "private"

    def scope(self, cache: PrefixCache, principal: Principal, tokens: Sequence[int], n_blocks: int) -> ScopedPrompt:
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
    """

    name = "public-registry"
    #: Documents remembered (least recently used first out).
    KNOWN = 4096

    def __init__(self, private_kind: ScopeKind = ScopeKind.USER) -> None:
        super().__init__(private_kind)
        self._known: OrderedDict[BlockKey, tuple[int, BlockKey]] = OrderedDict()
        self._lock = threading.Lock()

    def scope(self, cache: PrefixCache, principal: Principal, tokens: Sequence[int], n_blocks: int) -> ScopedPrompt:
        public = self._public_chain(cache, principal, tokens, n_blocks)
        published = cache.lookup(principal, public).length if public else 0
        return ScopedPrompt(tuple(tokens), published, self.private_kind)

    def scoped_lookup(self, cache: PrefixCache, principal: Principal, tokens: Sequence[int],
                      n_blocks: int) -> ScopedLookup:
        public = self._public_chain(cache, principal, tokens, n_blocks)
        if not public:
            return _looked_up(cache, principal, ScopedPrompt(tuple(tokens), 0, self.private_kind), n_blocks)
        guessed: ScopedLookup | None = None
        with self._lock:
            known = self._known.get(public[0].key)
            if known is not None:
                self._known.move_to_end(public[0].key)
        if known is not None and known[0] <= len(public) and public[known[0] - 1].key == known[1]:
            prompt = ScopedPrompt(tuple(tokens), known[0], self.private_kind)
            found = _looked_up(cache, principal, prompt, n_blocks, public)
            if found.lookup.length != known[0] or known[0] == n_blocks:
                return found
            guessed = found
        published = cache.lookup(principal, public).length
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
        return _looked_up(cache, principal, ScopedPrompt(tuple(tokens), published, self.private_kind), n_blocks,
                          public)

    @staticmethod
    def _public_chain(cache: PrefixCache, principal: Principal, tokens: Sequence[int],
                      n_blocks: int) -> list[ChainBlock]:
        head = tuple(tokens[: n_blocks * cache.layout().block_tokens])
        return cache.chain(principal, [RequestSegment(head, ScopeKind.PUBLIC)]) if head else []


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
               public: Sequence[ChainBlock] = ()) -> ScopedLookup:
    chain = scoped_chain(cache, principal, prompt, n_blocks, public)
    return ScopedLookup(prompt, tuple(chain), cache.lookup(principal, chain))


def scoped_chain(cache: PrefixCache, principal: Principal, prompt: ScopedPrompt, n_blocks: int,
                 public: Sequence[ChainBlock] = ()) -> list[ChainBlock]:
    """Keys of the first ``n_blocks`` blocks; empty when the principal has no scope of the private kind
    (a token minted for public reads only, say), so such a request is simply not cached.
    ``public``: the keys of the same tokens all in the public scope, when the caller has them:
    the public blocks' keys are those, so only the private part is derived."""
    bt = cache.layout().block_tokens
    cut = prompt.public_blocks
    head = ScopedPrompt(prompt.tokens[: n_blocks * bt], cut, prompt.private_kind)
    if 0 < cut <= len(public):
        try:
            rest = cache.chain(principal, [RequestSegment(head.tokens[cut * bt :], prompt.private_kind)],
                               after=public[cut - 1])
        except AccessDenied:
            rest = []
        return [*public[:cut], *rest]
    try:
        return cache.chain(principal, head.segments(bt))
    except AccessDenied:
        if cut == 0:
            return []
        return cache.chain(principal, [RequestSegment(head.tokens[: cut * bt], ScopeKind.PUBLIC)])


@dataclass(slots=True, frozen=True)
class LoadDecision:
    """How many leading cached blocks to reload, and the cost model's plan name (``reload-all``
    without a cost model)."""

    blocks: int
    plan: str
    predicted_ms: dict[str, float]


def load_decision(planner: CostModel | None, lookup: Lookup, new_tokens: int, layout: KVLayout, *,
                  overlap: bool = False) -> LoadDecision:
    """The cost model's choice for a cached prefix ``lookup`` followed by ``new_tokens`` to compute
    (without a ``planner``, the whole hit is reloaded)."""
    cm = planner
    if cm is None or lookup.length == 0:
        return LoadDecision(lookup.length, "reload-all" if lookup.length else "none", {})
    plan = cm.plan(lookup, max(new_tokens, 1), layout)
    options = [o for o in plan.options if overlap or not o.overlapped]
    chosen = plan.chosen if plan.chosen in options else min(options, key=lambda o: o.predicted_ms)
    # A front-only reload is the plan's load runs, which start at block 0 for every non-overlapped option.
    return LoadDecision(chosen.load_blocks, chosen.name, plan.predicted_ms)
