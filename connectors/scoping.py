"""The engines' import path for scope rules and load decisions, which live in kvtier itself:
``kvtier.cache.scoping`` (the rules, shared with the daemon's Locate) and
``kvtier.planning.load_decision`` (how much of a hit to reload)."""

from kvtier.cache.scoping import (
    SCOPE_RULES,
    PrivateRule,
    PublicRegistryRule,
    ScopedLookup,
    ScopedPrompt,
    ScopeRule,
    scope_rule,
    scoped_chain,
)
from kvtier.planning.load_decision import LoadDecision, engine_choice, load_decision

__all__ = ["SCOPE_RULES", "LoadDecision", "PrivateRule", "PublicRegistryRule", "ScopeRule", "ScopedLookup",
           "ScopedPrompt", "engine_choice", "load_decision", "scope_rule", "scoped_chain"]
