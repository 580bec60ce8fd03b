"""Locate: where this node holds a request's prefix, and what serving the request here would cost.

A router asks every node's daemon (kvtier/server/fleet_view.py) and sends the request where its
first token comes soonest. One answer (``Located``) says, for one request and its principal:
which tiers of this node hold how much of the prompt's prefix, the cost model's predicted time
to first token of serving it on this node (reload what the tiers hold, recompute the rest), and
what the shared remote tier holds (reachable from every node) at its measured price.

Protocol, per query (``Locator.locate``), in call order:

1. the query's shape: token ids or keys (not both), sizes, the node's model and layout;
2. the end principal (``end_principal``): a ``router`` credential acts for the principal of the
   request's ``cache_salt``, verified by the daemon's salt mapper exactly as an engine's salt is,
   or, without a salt, for a public-only principal of its own (revocations of the router and
   its credential still apply); any other credential acts for the call's own principal and may
   not present a salt. A revoked end principal is refused like any call of its own;
3. the keys: from token ids as the node's engines derive them (the [locate] section's layout and
   scope rule, through the daemon's KVCache, so with the domains of that principal only), or
   the keys given;
4. the lookup: ``KVCache.lookup`` / ``AccessGate.lookup`` for the end principal: the gate that
   serves every read of the daemon, so the prefix ends at the first key that principal may not
   read or whose scope is being purged, and the timing mitigations (minimum public prefix, miss
   limit) count against that principal. Nothing reads a block;
5. the shared tier's prefix: only among the keys that lookup returned (the gate already cleared
   them), one batched ``contains`` on the remote tier where a local tier served them;
6. prices: ``CostModel.plan`` over the lookup, with the tiers' measured profiles
   (kvtier/server/tier_costs.py) and the node's configured prefill profile.

Guarantee: every number in the answer is a function of the keys the end principal may read.
Another tenant's private prefix is never derived (token ids) or ends the prefix before any tier
is asked (keys), so it is answered exactly as a prefix nobody cached.

The scope rules are the engines' own (kvtier/cache/scoping.py, ``private`` or ``public-registry``),
so the keys looked up here are the keys the engine's connector would look up.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import cast

from kvtier.cache.kv_cache import KVCache, RequestSegment
from kvtier.cache.prefix_cache import PrefixCache
from kvtier.cache.scoping import SCOPE_RULES, ScopeRule, scope_rule
from kvtier.errors import AccessDenied, AuthError, InvalidRequest
from kvtier.keys import LAYOUT_TAG_BYTES, BlockKey, ChainBlock, ScopeKind, Segment, key_layout_tag
from kvtier.layout import KVLayout
from kvtier.planning.cost_model import CostModel
from kvtier.planning.load_decision import engine_choice
from kvtier.planning.plans import Plan, PlanOption
from kvtier.planning.profiles import HostToDeviceProfile, PrefillProfile
from kvtier.security.policy import ROLE_ROUTER, Principal, acted_for, confined
from kvtier.security.salts import ROLE_ENGINE, SaltMapper
from kvtier.server.config import LocateConfig
from kvtier.server.tier_costs import MeasuredTiers
from kvtier.store.lookup import Lookup, TierRun

UINT32_MAX = 0xFFFFFFFF


class _OwnTiers:
    """The daemon's KVCache as a scope rule sees it, with every lookup in the node's own tiers
    (``LocateQuery.local_only``). Only what a rule's ``scoped_lookup`` calls."""

    def __init__(self, cache: KVCache) -> None:
        self._cache = cache

    def layout(self, which: KVLayout | str | None = None) -> KVLayout:
        return self._cache.layout(which)

    def chain(self, principal: Principal, segments: Iterable[RequestSegment | Segment], *,
              layout: KVLayout | str | None = None, after: ChainBlock | None = None) -> list[ChainBlock]:
        return self._cache.chain(principal, segments, layout=layout, after=after)

    def lookup(self, principal: Principal, chain: Sequence[ChainBlock]) -> Lookup:
        return self._cache.lookup(principal, chain, local_only=True)


# -- boundary objects -------------------------------------------------------------------------------
@dataclass(slots=True, frozen=True)
class LocateQuery:
    """One request as a router knows it: its token ids (or kvtier keys) and its salt."""

    tokens: tuple[int, ...] = ()
    keys: tuple[BlockKey, ...] = ()
    salt: str = ""
    model: str = ""
    #: Keys only: tokens after the last key's block that every plan computes (0 counts as 1).
    tail_tokens: int = 0
    #: Leave out the shared tier's share (``Located.shared`` is None): it costs a probe of the
    #: remote tier, and a router that prices each node by ``ttft_ms`` does not use it.
    omit_shared: bool = False
    #: This node's own tiers only: the shared tier is not asked at all (its share is None, and
    #: the prefix, ``tiers`` and ``ttft_ms`` are the local tiers'). What sets one node apart from
    #: another (the shared tier serves every node alike) without a remote probe in the answer's time.
    local_only: bool = False


@dataclass(slots=True, frozen=True)
class TierShare:
    """Blocks of the matched prefix one tier of this node would serve."""

    tier: str
    level: int
    blocks: int


@dataclass(slots=True, frozen=True)
class SharedShare:
    """The shared tier's own prefix and the predicted TTFT of serving the request from it alone."""

    tier: str
    blocks: int
    ttft_ms: float


@dataclass(slots=True, frozen=True)
class Located:
    """One node's answer to a LocateQuery (the RPC's LocateResponse, the HTTP twin's JSON)."""

    node: str
    model: str
    block_tokens: int
    requested_blocks: int
    new_tokens: int
    matched_blocks: int
    tiers: tuple[TierShare, ...]
    runs: tuple[TierRun, ...]
    ttft_ms: float
    plan: str
    recompute_ms: float
    shared: SharedShare | None
    #: Predicted TTFT when the engine itself already holds the requested blocks (its own prefix
    #: cache, which no daemon sees): the new tokens alone computed, after that context. What a
    #: router that knows what it sent there prices such an engine at (kvtier/router/engine_cache.py).
    tail_ms: float = 0.0
    #: Of ``matched_blocks``, the leading ones in the public scope: what the same query without a
    #: salt finds, the same for every principal (0 for a query by keys, which names no scope).
    public_blocks: int = 0

    def block_ms(self) -> float | None:
        """The cost model's price of computing one requested block here: ``(recompute_ms -
        tail_ms) / requested_blocks`` (None: nothing requested, or a daemon from before
        ``tail_ms``)."""
        if not self.requested_blocks or not self.recompute_ms > self.tail_ms > 0:
            return None
        return (self.recompute_ms - self.tail_ms) / self.requested_blocks


@dataclass(slots=True, frozen=True)
class LocateSettings:
    """What the node's engines are (the daemon's [locate] section): their layout, how their
    connector scopes a request, and what their prefill costs."""

    node: str
    layout: KVLayout
    scope_rule: str
    private_kind: ScopeKind
    prefill: PrefillProfile
    host_to_device: HostToDeviceProfile
    #: Whether the engines compute a prompt's front while loading its back (pipelined plans).
    overlap: bool = False
    max_tokens: int = 131072
    max_keys: int = 65536

    def __post_init__(self) -> None:
        assert self.scope_rule in SCOPE_RULES, self.scope_rule
        assert self.private_kind is not ScopeKind.PUBLIC


#: How a connector lays out a block, by the name ``locate.block_shape`` gives it: (layers, kv
#: heads, block tokens, head dim) -> the layout's ``block_shape_override`` (None: kvtier's own).
BLOCK_SHAPES: dict[str, Callable[[int, int, int, int], tuple[int, ...] | None]] = {
    "vllm": lambda layers, heads, bt, dim: (layers, heads, bt, 2 * dim),
    "kvtier": lambda layers, heads, bt, dim: None,
}


def locate_settings(c: LocateConfig) -> LocateSettings:
    """The daemon's [locate] section as the Locator's settings."""
    layout = KVLayout(c.model_id, num_layers=c.num_layers, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                      dtype=c.dtype, block_tokens=c.block_tokens, revision=c.revision, tp_rank=0, tp_size=c.tp_size,
                      block_shape_override=BLOCK_SHAPES[c.block_shape](c.num_layers, c.num_kv_heads,
                                                                        c.block_tokens, c.head_dim))
    prefill = PrefillProfile(c.prefill_fixed_ms * 1e-3, c.prefill_per_token_us * 1e-6, c.prefill_per_pair_ns * 1e-9,
                             c.prefill_per_ctx_token_ns * 1e-9)
    h2d = HostToDeviceProfile(c.host_to_device_GBps * 1e9, fixed_s=c.load_fixed_ms * 1e-3)
    return LocateSettings(node=c.node or socket.gethostname(), layout=layout, scope_rule=c.scope_rule,
                          private_kind=ScopeKind[c.private_scope.upper()], prefill=prefill,
                          host_to_device=h2d, overlap=c.overlap, max_tokens=c.max_tokens)


# -- the locator ------------------------------------------------------------------------------------
class Locator:
    """Answers LocateQuery for the daemon's store (see the module docstring for the protocol).

    Invariants: it reads no block and writes nothing; every tier probe goes through the cache's
    access gate for the end principal, except the shared tier's ``contains`` of keys that probe
    returned. Stateless apart from the shared, thread-safe tier profiles: safe from any thread.
    """

    def __init__(self, cache: KVCache, salts: SaltMapper, costs: MeasuredTiers, settings: LocateSettings,
                 shared_tier: str | None) -> None:
        self.cache = cache
        self.gate = cache.gate
        self.store = cache.store
        self.salts = salts
        self.costs = costs
        self.settings = settings
        self.shared_tier = shared_tier
        #: The engines' own scope rule (kvtier/cache/scoping.py).
        self.rule: ScopeRule = scope_rule(settings.scope_rule, settings.private_kind.name.lower())
        if shared_tier is not None:
            self.store.tier(shared_tier)  # KeyError now, not at the first query

    # -- principal ----------------------------------------------------------------------------------
    def end_principal(self, credential: Principal, acting: Principal, salt: str) -> Principal:
        """Who the answer is computed for (step 2 of the module docstring)."""
        if ROLE_ROUTER not in credential.roles:
            if salt:
                raise AccessDenied(f"credential {credential.id} is not a router's: it may not present a request's "
                                   "cache_salt to Locate (an engine sends the salt as its call's kvtier-salt)")
            return acting
        if not salt:
            # The public scope only; the router's id, so its revocation and miss budget apply.
            return Principal(tenant=credential.tenant, user=credential.user, credential_id=credential.credential_id,
                             scope_kinds=frozenset({ScopeKind.PUBLIC}))
        try:
            end = self.salts.principal(salt)
        except AuthError as exc:
            raise InvalidRequest(f"cache_salt: {exc}") from None
        assert end is not None
        if ROLE_ENGINE in end.roles or confined(end):
            raise InvalidRequest("cache_salt: names an engine's or a router's credential, not a request's principal")
        return acted_for(end)  # a role the salt claims widens nothing

    # -- the query ----------------------------------------------------------------------------------
    def locate(self, credential: Principal, acting: Principal, query: LocateQuery) -> Located:
        s = self.settings
        layout = s.layout
        bt = layout.block_tokens
        self._check(query)
        p = self.end_principal(credential, acting, query.salt)
        self.gate.policy.require_active(p)  # also for a query too short to look up
        public = 0
        if query.keys:
            requested, new_tokens = len(query.keys), max(1, query.tail_tokens)
            lookup = self.gate.lookup(p, list(query.keys), local_only=query.local_only).lookup
        else:
            n = len(query.tokens)
            requested = (n - 1) // bt if n else 0  # the last token is always computed
            new_tokens = max(1, n - requested * bt)
            lookup, public = (self._scoped_lookup(p, query.tokens, requested, query.local_only) if requested
                              else (Lookup.miss(0), 0))
        model = CostModel(s.prefill, self.costs.profiles(t.name for t in self.store.tiers),
                          host_to_device=s.host_to_device, front_copies=0)
        planned = model.plan(lookup, new_tokens, layout)
        chosen = self._chosen(planned)
        return Located(
            node=s.node, model=layout.model_id, block_tokens=bt, requested_blocks=requested, new_tokens=new_tokens,
            matched_blocks=lookup.length,
            tiers=tuple(TierShare(t.name, level, lookup.blocks_in(t.name)) for level, t in enumerate(self.store.tiers)),
            runs=tuple(lookup.runs), ttft_ms=chosen.predicted_ms, plan=chosen.name,
            recompute_ms=planned.option("full-recompute").predicted_ms,
            tail_ms=float(s.prefill.predict(new_tokens, requested * bt)) * 1e3,
            shared=None if query.omit_shared or query.local_only else self._shared(lookup, model, new_tokens),
            # The scope rule's public part, as far as the lookup reached. A public run shorter than
            # the minimum public prefix is hidden from every other principal and keyed in the
            # caller's own scope: the rule counts none of it public.
            public_blocks=min(public, lookup.length),
        )

    def _check(self, q: LocateQuery) -> None:
        """Bad input is refused before any principal is resolved or any tier is asked."""
        s = self.settings
        if bool(q.tokens) == bool(q.keys):
            raise InvalidRequest("locate takes token_ids or keys (one of them, not both)")
        if q.model and q.model != s.layout.model_id:
            raise InvalidRequest(f"model: this node serves {s.layout.model_id!r}, not {q.model!r}")
        if len(q.tokens) > s.max_tokens:
            raise InvalidRequest(f"token_ids: at most {s.max_tokens} per request, got {len(q.tokens)}")
        if len(q.keys) > s.max_keys:
            raise InvalidRequest(f"keys: at most {s.max_keys} per request, got {len(q.keys)}")
        if not 0 <= q.tail_tokens <= UINT32_MAX:
            raise InvalidRequest(f"tail_tokens: must be in [0, {UINT32_MAX}], got {q.tail_tokens}")
        # The range in C first (per id in Python it was 2 ms of a 15,000-token Locate); the
        # offending index only for the error.
        if q.tokens and (min(q.tokens) < 0 or max(q.tokens) > UINT32_MAX):
            i, t = next((i, t) for i, t in enumerate(q.tokens) if not 0 <= t <= UINT32_MAX)
            raise InvalidRequest(f"token_ids[{i}]: must be in [0, {UINT32_MAX}], got {t}")
        tag = s.layout.fingerprint[:LAYOUT_TAG_BYTES]
        for i, k in enumerate(q.keys):
            if key_layout_tag(k) != tag:
                raise InvalidRequest(f"keys[{i}]: not a key of this node's layout ({s.layout.model_id})")

    def _scoped_lookup(self, p: Principal, tokens: Sequence[int], n_blocks: int,
                       local_only: bool) -> tuple[Lookup, int]:
        """The engine's keys of the first ``n_blocks`` blocks, scoped by the engines' own rule and
        looked up, and how many leading blocks the rule put in the public scope. Blocks beyond a
        shorter chain (a principal without a scope of the private kind gets the public part
        alone) are requested all the same: the engine computes them."""
        cache = cast(PrefixCache, _OwnTiers(self.cache)) if local_only else self.cache
        found = self.rule.scoped_lookup(cache, p, tokens, n_blocks, self.settings.layout)
        return replace(found.lookup, requested=n_blocks), found.prompt.public_blocks

    def _chosen(self, plan: Plan) -> PlanOption:
        """The plan the node's engines would run (``engine_choice``, as their connector decides)."""
        return engine_choice(plan, self.settings.overlap)

    def _shared(self, lookup: Lookup, model: CostModel, new_tokens: int) -> SharedShare | None:
        name = self.shared_tier
        if name is None:
            return None
        level = next(i for i, t in enumerate(self.store.tiers) if t.name == name)
        own = next((r for r in lookup.runs if r.tier == name), None)
        upto = own.start if own is not None else lookup.length
        # Only keys the gate returned as hits are probed: the shared tier cannot hold a longer
        # prefix than the lookup found (it was asked where the local tiers stopped).
        held = self.store.tier(name).contains(list(lookup.keys[:upto])) if upto else 0
        blocks = held if held < upto else upto + (own.count if own is not None else 0)
        alone = Lookup((TierRun(level, name, 0, blocks),) if blocks else (), lookup.requested)
        ttft = self._chosen(model.plan(alone, new_tokens, self.settings.layout)).predicted_ms
        return SharedShare(name, blocks, ttft)
