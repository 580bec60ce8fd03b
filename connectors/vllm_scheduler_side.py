"""The scheduler side of kvtier's vLLM connector: which tokens kvtier can serve a request, which
blocks to load into and save from, and what the node holds for the engine (KV events).

Called by vLLM's scheduler, through ``KvtierConnector`` (connectors/vllm_connector.py), in this
order for each request: ``get_num_new_matched_tokens`` (look up the request's chain, ask the cost
model how much to reload; the lookup may run off the step and answer "not yet"), then
``update_state_after_alloc`` (the vLLM block ids to load into), then per step
``build_connector_meta`` (the step's load and save jobs for the workers), ``update_connector_output``
(blocks whose load failed are saved again once recomputed), ``take_events``; and
``request_finished`` when vLLM is done with it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from connectors.lookups_in_flight import LookupsInFlight
from connectors.provision import CacheSource, Tenant
from connectors.scoping import ScopedLookup, ScopedPrompt, ScopeRule, load_decision, scoped_chain
from connectors.vllm_connector_metadata import BlockJob, KvtierConnectorMetadata
from connectors.vllm_events import KvEventReporter
from kvtier.errors import AccessDenied, LayoutMismatch, TierUnavailable
from kvtier.keys import ChainBlock
from kvtier.layout import KVLayout
from kvtier.planning.cost_model import CostModel
from kvtier.store.lookup import Lookup

if TYPE_CHECKING:
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

#: vLLM's ``CacheHitSource`` value for the tiers kvtier names (a daemon's and an in-process store's);
#: any other tier (S3, a plug-in) counts as external.
TIER_SOURCES: dict[str, str] = {"memory": "host", "lmdb": "disk"}


def tokens_by_tier(lookup: Lookup, start: int, end: int, block_tokens: int) -> dict[str, int]:
    """Tokens of chain blocks ``[start, end)`` per tier that ``lookup`` found them in."""
    out: dict[str, int] = {}
    for run in lookup.runs:
        n = max(0, min(end, run.start + run.count) - max(start, run.start))
        if n:
            out[run.tier] = out.get(run.tier, 0) + n * block_tokens
    return out


@dataclass(slots=True)
class _Match:
    """What get_num_new_matched_tokens decided for a request (kept until it is scheduled)."""

    salt: str
    tenant: Tenant
    prompt: ScopedPrompt
    local_tokens: int
    #: Rank 0's lookup (hit sources, planning); ``found`` holds every rank's, by layout fingerprint.
    lookup: Lookup
    load_blocks: int
    plan: str
    #: The leading blocks every rank's lookup found (what kvtier already holds for all of them).
    cached_blocks: int
    found: dict[bytes, Lookup]
    #: The chains the scheduler derived for its lookups, by layout fingerprint.
    chains: dict[bytes, tuple[ChainBlock, ...]]


@dataclass(slots=True, frozen=True)
class _LookedUp:
    """A request's lookup, made off the step maybe: the principal and what its cache holds, or
    why there is no lookup (``skipped``: the counter to add, or ``short`` for a prompt of at most
    one block, counted nowhere)."""

    tenant: Tenant | None = None
    found: ScopedLookup | None = None
    skipped: str = ""


@dataclass(slots=True)
class _Tracked:
    """A running request whose prompt blocks are saved as vLLM computes them."""

    salt: str
    prompt: ScopedPrompt
    block_ids: list[int]
    saved_upto: int
    prompt_blocks: int
    #: The chains the scheduler derived for its lookups (keys of the first blocks of the prompt),
    #: by layout fingerprint: one per tensor-parallel rank.
    chains: dict[bytes, tuple[ChainBlock, ...]] = field(default_factory=dict)


@dataclass(slots=True, frozen=True)
class SchedulerConfig:
    """What the scheduler side is to do, from the connector's options and vLLM's transfer config."""

    load: bool
    save: bool
    #: Loads run between steps (``kvtier.load_async``).
    load_async: bool
    #: The cost model that decides how much of a hit to reload (``kvtier.planner``); None: all of it.
    planner: CostModel | None


class SchedulerSide:
    """The scheduler side (module docstring has the call order).

    Invariants: every method runs on vLLM's scheduler thread, the only one touching ``_matched``,
    ``_loads_pending``, ``_tracked`` and ``_hit_sources``; a lookup made off the step (``lookups``)
    counts nothing itself, its outcome is counted here, in the connector's ``stats``.
    """

    def __init__(self, layout: KVLayout, source: CacheSource, ranks: list[tuple[KVLayout, CacheSource]],
                 rule: ScopeRule, config: SchedulerConfig, stats: Counter[str], *,
                 lookups: LookupsInFlight[_LookedUp] | None, kv_events: KvEventReporter | None) -> None:
        self.layout = layout
        self.block_tokens = layout.block_tokens
        self.source = source
        #: Tensor parallelism: every other rank's layout and source, so one lookup per rank is
        #: made here and travels with the load (workers of ranks above 0 look up nothing).
        self.ranks = ranks
        self.rule = rule
        self.config = config
        self.stats = stats
        #: Lookups off the scheduling step (connectors/lookups_in_flight.py), or None: blocking.
        self.lookups = lookups
        #: With vLLM's KV events on: what the node holds for this engine, as events.
        self.kv_events = kv_events
        self._matched: dict[str, _Match] = {}
        self._loads_pending: list[BlockJob] = []
        self._tracked: dict[str, _Tracked] = {}
        #: Tokens each request's load takes from each kind of tier (get_external_cache_hit_sources).
        self._hit_sources: dict[str, dict[str, int]] = {}

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        self._matched.pop(request.request_id, None)
        if not self.config.load:
            return 0, False
        salt = getattr(request, "cache_salt", None)
        if not salt:  # no identity: served without kvtier, and counted (docs/connectors.md)
            self.stats["no_salt"] += 1
            return 0, False
        tokens = list(request.prompt_token_ids or ())
        if self.lookups is None:
            looked = self._look_up(salt, tokens)
        else:
            asked = self.lookups.ask(request.request_id, lambda: self._look_up(salt, tokens))
            if asked is None:  # still running: vLLM asks again at a later step, the batch goes on
                self.stats["lookup_deferred"] += 1
                return None, False
            looked = asked
        if looked.skipped:
            if looked.skipped != "short":
                self.stats[looked.skipped] += 1
            return 0, False
        tenant, found = looked.tenant, looked.found
        assert tenant is not None and found is not None
        n_blocks = (len(tokens) - 1) // self.block_tokens
        prompt, lookup = found.prompt, found.lookup
        lookups, chains = {self.layout.fingerprint: lookup}, {self.layout.fingerprint: found.chain}
        held = self._rank_lookups(salt, prompt, n_blocks, lookup.length, lookups, chains)
        planned = lookup if held == lookup.length else lookup.slice(0, held)
        decision = load_decision(self.config.planner, planned, len(tokens) - held * self.block_tokens, self.layout)
        hit_tokens = decision.blocks * self.block_tokens
        self._matched[request.request_id] = _Match(salt, tenant, prompt, num_computed_tokens, lookup,
                                                   decision.blocks, decision.plan, held, lookups, chains)
        self.stats[f"plan:{decision.plan}"] += 1
        if hit_tokens <= num_computed_tokens:
            return 0, False
        return hit_tokens - num_computed_tokens, self.config.load_async

    def _look_up(self, salt: str, tokens: list[int]) -> _LookedUp:
        """The request's principal and what its cache holds of the prompt: the step's I/O (the
        salt resolved, the daemon's Lookup), which may run off the step. Counts nothing itself:
        its outcome is counted on the scheduler's thread."""
        try:
            tenant = self.source.for_salt(salt)
        except AccessDenied:  # AuthError included: a forged or expired salt is refused, not served
            return _LookedUp(skipped="salt_rejected")
        except TierUnavailable:  # the daemon is down: recompute, never crash the engine
            return _LookedUp(skipped="source_unavailable")
        if tenant is None or len(tokens) <= self.block_tokens:
            return _LookedUp(skipped="short")
        # The first output token needs a forward pass over at least one prompt token.
        n_blocks = (len(tokens) - 1) // self.block_tokens
        try:
            found = self.rule.scoped_lookup(tenant.cache, tenant.principal, tokens, n_blocks)
        except AccessDenied:  # revoked or rate-limited principal: served without kvtier
            return _LookedUp(skipped="lookup_refused")
        return _LookedUp(tenant=tenant, found=found)

    def _rank_lookups(self, salt: str, prompt: ScopedPrompt, n_blocks: int, held: int,
                      lookups: dict[bytes, Lookup], chains: dict[bytes, tuple[ChainBlock, ...]]) -> int:
        """Tensor parallelism: look up every other rank's chain (as far as rank 0 found), into
        ``lookups`` and ``chains`` by layout fingerprint; the blocks every rank holds. A rank whose
        lookup fails holds nothing: its blocks are recomputed by all (counted)."""
        for lay, src in self.ranks:
            try:
                tenant = src.for_salt(salt)
                if tenant is None:
                    raise AccessDenied("the salt no longer resolves for this rank")
                chain = scoped_chain(tenant.cache, tenant.principal, prompt, n_blocks)
                found = tenant.cache.lookup(tenant.principal, chain[:held]) if held else Lookup.miss(0)
            except (AccessDenied, TierUnavailable):
                self.stats["rank_lookup_failed"] += 1
                return 0
            lookups[lay.fingerprint], chains[lay.fingerprint] = found, tuple(chain)
            held = min(held, found.length)
        return held

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        match = self._matched.pop(request.request_id, None)
        if match is None:
            return
        block_ids = list(blocks.get_block_ids()[0])
        if num_external_tokens > 0:
            start = match.local_tokens // self.block_tokens
            end = (match.local_tokens + num_external_tokens) // self.block_tokens
            if end > len(block_ids) or start >= end:
                raise LayoutMismatch(f"request {request.request_id}: {len(block_ids)} blocks allocated, "
                                     f"kvtier planned blocks [{start}, {end})")
            self._loads_pending.append(BlockJob(request.request_id, match.salt, match.prompt, start, end,
                                                tuple(block_ids[start:end]), match.found))
            self._hit_sources[request.request_id] = tokens_by_tier(match.lookup, start, end, self.block_tokens)
            self.stats["load_jobs"] += 1
            self.stats["load_tokens"] += num_external_tokens
        if self.kv_events is not None:
            self.kv_events.follow(request, match.salt, match.prompt, match.chains)
        if self.config.save and request.request_id not in self._tracked:
            prompt_blocks = len(match.prompt.tokens) // self.block_tokens
            # Blocks kvtier already holds need no save; the rest are saved once vLLM has computed them.
            self._tracked[request.request_id] = _Tracked(match.salt, match.prompt, [], match.cached_blocks,
                                                         prompt_blocks, match.chains)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KvtierConnectorMetadata:
        meta = KvtierConnectorMetadata(loads=self._loads_pending, async_loads=self.config.load_async)
        self._loads_pending = []
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            tr = self._tracked.get(new.req_id)
            if tr is not None:
                tr.block_ids = list(new.block_ids[0])
                self._plan_save(meta, new.req_id, tr, new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tr = self._tracked.get(req_id)
            if tr is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                tr.block_ids = list(new_ids[0]) if new_ids is not None else []
            elif new_ids is not None:
                tr.block_ids.extend(new_ids[0])
            self._plan_save(meta, req_id, tr, cached.num_computed_tokens[i] + scheduled.get(req_id, 0))
        return meta

    def _plan_save(self, meta: KvtierConnectorMetadata, req_id: str, tr: _Tracked, computed_after: int) -> None:
        end = min(computed_after // self.block_tokens, tr.prompt_blocks, len(tr.block_ids))
        if end <= tr.saved_upto:
            return
        start = tr.saved_upto
        after = {fp: chain[start - 1] for fp, chain in tr.chains.items() if 0 < start <= len(chain)}
        meta.saves.append(BlockJob(req_id, tr.salt, tr.prompt, start, end, tuple(tr.block_ids[start:end]),
                                   after=after))
        tr.saved_upto = end
        self.stats["save_jobs"] += 1

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Blocks whose load failed are recomputed by vLLM (``kv_load_failure_policy="recompute"``):
        save them again once they are, from the first failed block of each request on."""
        bad = connector_output.invalid_block_ids
        if not bad:
            return
        for tr in self._tracked.values():
            first = next((i for i, b in enumerate(tr.block_ids[: tr.saved_upto]) if b in bad), None)
            if first is not None:
                self.stats["resave_blocks"] += tr.saved_upto - first
                tr.saved_upto = first

    def take_events(self) -> Iterable[KVCacheEvent]:
        """What the node's kvtier holds for this engine, as vLLM KV events since the last call
        (``connectors.vllm_events``); vLLM publishes them with its own after each step."""
        return self.kv_events.take() if self.kv_events is not None else ()

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[Any, int]:
        """The tokens of this request's load by the kind of tier that holds them (vLLM's
        ``CacheHitSource``: host memory, disk, or external for a remote tier), from the lookup."""
        by_tier = self._hit_sources.pop(request.request_id, {})
        if num_external_tokens == 0:
            return {}
        from vllm.v1.metrics.cache_hit_source import CacheHitSource

        out: dict[Any, int] = {}
        for tier, n in by_tier.items():
            # A daemon's tiers come as ``daemon/<its tier>``: the kind is the daemon's tier's.
            kind = tier.rsplit("/", 1)[-1]
            source = CacheHitSource(TIER_SOURCES.get(kind, CacheHitSource.EXTERNAL_UNSPECIFIED.value))
            out[source] = out.get(source, 0) + n
        if sum(out.values()) != num_external_tokens:  # vLLM loaded another count than planned
            return {CacheHitSource.EXTERNAL_UNSPECIFIED: num_external_tokens}
        return out

    def request_finished(self, request: Request) -> None:
        # Saves complete inside the step that computed the blocks (the worker's wait_for_save), so
        # vLLM may free the blocks right away.
        self._hit_sources.pop(request.request_id, None)
        self._tracked.pop(request.request_id, None)
        self._matched.pop(request.request_id, None)
        if self.lookups is not None:
            self.lookups.forget(request.request_id)

    def close(self) -> None:
        if self.lookups is not None:
            self.lookups.close()
        if self.kv_events is not None:
            self.kv_events.close()


__all__ = ["TIER_SOURCES", "SchedulerConfig", "SchedulerSide", "tokens_by_tier"]
