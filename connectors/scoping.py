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
  public content (see docs/security.md and KVCache's timing mitigations).

``load_decision`` asks the cost model (when the engine has one) how much of a cached prefix to
reload; engines that cannot compute the front of a prompt while loading its back consider only
the plans without overlap.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtier.cache.kv_cache import KVCache, RequestSegment
from kvtier.errors import AccessDenied, ConfigError
from kvtier.keys import ChainBlock, ScopeKind
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


class ScopeRule(ABC):
    """Splits an engine request into public and private parts (see module docstring)."""

    name: str

    def __init__(self, private_kind: ScopeKind = ScopeKind.USER) -> None:
        if private_kind is ScopeKind.PUBLIC:
            raise ConfigError("kvtier.private_scope: the private part of a request cannot be public")
        self.private_kind = private_kind

    @abstractmethod
    def scope(self, cache: KVCache, principal: Principal, tokens: Sequence[int], n_blocks: int) -> ScopedPrompt:
        """Scopes of the first ``n_blocks`` full blocks of ``tokens``."""


class PrivateRule(ScopeRule):
    name = "private"

    def scope(self, cache: KVCache, principal: Principal, tokens: Sequence[int], n_blocks: int) -> ScopedPrompt:
        return ScopedPrompt(tuple(tokens), 0, self.private_kind)


class PublicRegistryRule(ScopeRule):
    name = "public-registry"

    def scope(self, cache: KVCache, principal: Principal, tokens: Sequence[int], n_blocks: int) -> ScopedPrompt:
        bt = cache.layout().block_tokens
        head = tuple(tokens[: n_blocks * bt])
        if not head:
            return ScopedPrompt(tuple(tokens), 0, self.private_kind)
        public = cache.chain(principal, [RequestSegment(head, ScopeKind.PUBLIC)])
        published = cache.lookup(principal, public).length
        return ScopedPrompt(tuple(tokens), published, self.private_kind)


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


def scoped_chain(cache: KVCache, principal: Principal, prompt: ScopedPrompt, n_blocks: int) -> list[ChainBlock]:
    """Keys of the first ``n_blocks`` blocks; empty when the principal has no scope of the private kind
    (a token minted for public reads only, say), so such a request is simply not cached."""
    bt = cache.layout().block_tokens
    head = ScopedPrompt(prompt.tokens[: n_blocks * bt], prompt.public_blocks, prompt.private_kind)
    try:
        return cache.chain(principal, head.segments(bt))
    except AccessDenied:
        if prompt.public_blocks == 0:
            return []
        return cache.chain(principal, [RequestSegment(head.tokens[: prompt.public_blocks * bt], ScopeKind.PUBLIC)])


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
