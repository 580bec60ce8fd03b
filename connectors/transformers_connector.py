"""Generation with a Hugging Face transformers causal LM whose prefix KV is served by kvtier.

Per request (``TransformersConnector.generate``):

1. the request's segments (public manual, private history, question: each with a scope relative
   to the principal) become a key chain through the KVCache, which checks the policy;
2. the chain's longest cached prefix is looked up, and the connector's cost model (``planner``)
   picks a plan (``full-reload``, ``full-recompute``, ``split``, ``pipelined``; without a cost
   model, the whole hit is reloaded);
3. the planned blocks are loaded through the KVCache (verified; a block that vanished shortens
   the load and its tokens are computed instead) into the model's cache object;
4. the model runs only on what must be computed; the first token's logits are the TTFT point;
5. the new full blocks are saved (blocks the principal may read but not publish are skipped by
   the KVCache), then greedy decoding continues from the model's cache.

The connector holds no storage logic and no block data between calls. It may be used by one
thread at a time (the model is); the KVCache underneath is shared and thread-safe.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from kvtier.cache.kv_cache import RequestSegment
from kvtier.cache.prefix_cache import PrefixCache
from kvtier.engine.prefill import PrefillRunner, PrefillTiming
from kvtier.errors import ConfigError
from kvtier.keys import ChainBlock
from kvtier.planning.cost_model import CostModel
from kvtier.security.policy import Principal
from kvtier.store.lookup import Lookup

PURE_PLANS = ("full-reload", "full-recompute")


@dataclass(slots=True, frozen=True)
class Execution:
    """What a plan means for this engine: load blocks ``[load_start, load_end)``; compute the
    ``front`` blocks first (concurrently with the load when ``overlapped``); then the rest."""

    name: str
    load_start: int
    load_end: int
    front: int
    overlapped: bool


@dataclass(slots=True)
class PrefillReport:
    """One request's prefill: what was reused, computed and saved, and how long each phase took."""

    plan: str
    prompt_tokens: int
    cached_tokens: int
    reused_tokens: int
    computed_tokens: int
    loaded_tokens_by_tier: dict[str, int]
    saved_blocks: int
    not_published_blocks: int
    ttft_s: float
    phases_ms: dict[str, float]
    predicted_ms: dict[str, float] = field(default_factory=dict)


@dataclass(slots=True, frozen=True)
class Generation:
    """Greedy tokens after the prompt, the first step's logits (float32 ``[vocab]``) and the prefill report."""

    tokens: list[int]
    first_logits: torch.Tensor
    report: PrefillReport


class TransformersConnector:
    """A transformers model (through a PrefillRunner) whose prompt KV comes from a KVCache.

    Invariants: the runner's layout is the KVCache's layout (checked at construction); every read
    and write names the principal, so the policy decides each of them. ``planner`` (optional)
    chooses each request's plan and learns from what the connector measures (prefill, assembly);
    for it to learn tier speeds too, build the cache's store with it as ``observer``.
    """

    def __init__(self, cache: PrefixCache, runner: PrefillRunner, *, save: bool = True,
                 planner: CostModel | None = None) -> None:
        if cache.layout(runner.layout) != runner.layout:
            raise ConfigError("the KVCache does not serve the runner's layout")
        self.cache = cache
        self.runner = runner
        self.planner = planner
        self.layout = runner.layout
        self.save = save

    # -- planning ---------------------------------------------------------------------------------
    def _execution(self, lookup: Lookup, new_tokens: int, plan: str | None) -> tuple[Execution, dict[str, float]]:
        n = lookup.length
        cm = self.planner
        if cm is None or n == 0:
            name = plan or ("full-reload" if n else "full-recompute")
            if name not in PURE_PLANS:
                raise ConfigError(f"plan {name!r} needs a cost model: pass TransformersConnector(..., planner=)")
            return (Execution(name, 0, n if name == "full-reload" else 0, 0, False), {})
        p = cm.plan(lookup, new_tokens, self.layout)
        opt = p.option(plan) if plan is not None else p.chosen
        bt = self.layout.block_tokens
        if opt.overlapped:
            front = opt.recompute_tokens // bt
            return Execution(opt.name, front, front + opt.load_blocks, front, True), p.predicted_ms
        return Execution(opt.name, 0, opt.load_blocks, 0, False), p.predicted_ms

    # -- the request ------------------------------------------------------------------------------
    def prefill(
        self, principal: Principal, segments: Sequence[RequestSegment], *, plan: str | None = None
    ) -> tuple[torch.Tensor, DynamicCache, PrefillReport]:
        """Logits of the last prompt token, the model's cache after the prompt, and the report.

        ``plan`` forces one of the cost model's options by name (tests, benchmarks); by default
        the cost model chooses. Raises AccessDenied for scopes the principal may not use and
        ValueError/LayoutMismatch for bad tokens; nothing is computed or stored then.
        """
        t0 = time.perf_counter()
        tokens = [int(t) for seg in segments for t in seg.tokens]
        bt = self.layout.block_tokens
        if not tokens:
            raise ValueError("a request needs at least one token")
        self._check_tokens(tokens)
        # The first output token needs a forward pass, so at least the last prompt token is computed.
        n_req = (len(tokens) - 1) // bt
        chain = self.cache.chain(principal, segments)
        lookup = self.cache.lookup(principal, chain[:n_req])
        t_lookup = time.perf_counter()
        ex, predicted = self._execution(lookup, len(tokens) - lookup.length * bt, plan)
        t_plan = time.perf_counter()
        front_blocks: list[torch.Tensor] = []
        loaded, load_s, front_s = self._load_and_front(principal, chain, lookup, ex, tokens)
        if ex.overlapped:
            front_blocks, loaded = loaded[: ex.front], loaded[ex.front :]
        t_load = time.perf_counter()
        past = [*front_blocks, *loaded]
        start = len(past) * bt
        res = self.runner.prefill(tokens[start:], past_blocks=past, keep_cache=True)
        t_first = time.perf_counter()
        saved, skipped = self._save(principal, chain, res.new_blocks, start // bt, lookup.length)
        t_saved = time.perf_counter()
        assert res.cache is not None
        reused = len(loaded) * bt
        report = PrefillReport(
            plan=ex.name, prompt_tokens=len(tokens), cached_tokens=lookup.length * bt, reused_tokens=reused,
            computed_tokens=len(tokens) - reused, loaded_tokens_by_tier=self._by_tier(lookup, ex, len(loaded)),
            saved_blocks=saved, not_published_blocks=skipped, ttft_s=t_first - t0,
            phases_ms={"lookup": (t_lookup - t0) * 1e3, "plan": (t_plan - t_lookup) * 1e3,
                       "load": load_s * 1e3, "front_compute": front_s * 1e3, "load_phase": (t_load - t_plan) * 1e3,
                       "compute": (t_first - t_load) * 1e3, "save": (t_saved - t_first) * 1e3},
            predicted_ms=predicted,
        )
        self._observe(len(tokens) - start, start, res.timing)
        # Token hit rate (DESIGN 3.9): input tokens whose KV came from the cache, over all input tokens.
        self.cache.record_request(len(tokens), reused)
        return res.logits_last, res.cache, report

    def generate(self, principal: Principal, segments: Sequence[RequestSegment], max_new_tokens: int, *,
                 plan: str | None = None) -> Generation:
        """Greedy decoding of ``max_new_tokens`` tokens after the prompt."""
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        logits, cache, report = self.prefill(principal, segments, plan=plan)
        out = [int(torch.argmax(logits))]
        with torch.no_grad():
            for _ in range(max_new_tokens - 1):
                step = self.runner.model(input_ids=torch.tensor([[out[-1]]]), cache=cache, use_cache=True,
                                         logits_to_keep=1)
                cache = step.cache
                out.append(int(torch.argmax(step.logits[0, -1])))
        return Generation(out, logits, report)

    # -- internals --------------------------------------------------------------------------------
    def _load_and_front(self, principal: Principal, chain: Sequence[ChainBlock], lookup: Lookup,
                        ex: Execution, tokens: Sequence[int]) -> tuple[list[torch.Tensor], float, float]:
        """Blocks for ``[0, load_end)``: computed front (pipelined) then loaded blocks.

        A load that comes back short (a block vanished or failed verification) stops there: the
        blocks after it are computed with the tail. The blocks are read as ``lookup`` found them
        (no second lookup).
        """
        if ex.load_end <= ex.load_start:
            return [], 0.0, 0.0
        want = chain[ex.load_start : ex.load_end]
        found = lookup.slice(ex.load_start, ex.load_end)
        if not ex.overlapped:
            t0 = time.perf_counter()
            blocks = self.cache.load(principal, want, lookup=found)
            return [b.data for b in blocks], time.perf_counter() - t0, 0.0
        got: list[torch.Tensor] = []
        errors: list[BaseException] = []
        load_s = [0.0]
        cm = self.planner

        def loader() -> None:
            t = time.perf_counter()
            try:
                if cm is not None:
                    with cm.overlapped():
                        got.extend(b.data for b in self.cache.load(principal, want, lookup=found))
                else:
                    got.extend(b.data for b in self.cache.load(principal, want, lookup=found))
            except BaseException as exc:  # re-raised on the caller's thread below
                errors.append(exc)
            load_s[0] = time.perf_counter() - t

        th = threading.Thread(target=loader, name="kvtier-transformers-load")
        t0 = time.perf_counter()
        th.start()
        front = self.runner.prefill(tokens[: ex.front * self.layout.block_tokens]).new_blocks
        front_s = time.perf_counter() - t0
        th.join()
        if errors:
            raise errors[0]
        if len(got) < len(want):  # a short load: what follows the gap is computed with the tail
            return front, load_s[0], front_s
        return [*front, *got], load_s[0], front_s

    def _save(self, principal: Principal, chain: Sequence[ChainBlock], new: Sequence[torch.Tensor], first: int,
              cached: int) -> tuple[int, int]:
        """Store the computed full blocks the store does not already hold."""
        if not self.save:
            return 0, 0
        skip = max(cached - first, 0)
        todo = list(new[skip : len(chain) - first])
        if not todo:
            return 0, 0
        rep = self.cache.save(principal, chain, todo, start=first + skip)
        return rep.offered, len(rep.not_published)

    def _by_tier(self, lookup: Lookup, ex: Execution, n_loaded: int) -> dict[str, int]:
        out: dict[str, int] = {}
        lo, hi = ex.load_start, ex.load_start + n_loaded
        for r in lookup.runs:
            cnt = min(hi, r.start + r.count) - max(lo, r.start)
            if cnt > 0:
                out[r.tier] = out.get(r.tier, 0) + cnt * self.layout.block_tokens
        return out

    def _check_tokens(self, tokens: Sequence[int]) -> None:
        """Refuse bad input before any lookup (nothing is touched for a request that cannot run)."""
        if min(tokens) < 0 or max(tokens) >= self.runner.vocab_size:
            raise ValueError(f"token ids must be in [0, {self.runner.vocab_size})")
        if len(tokens) > self.runner.max_positions:
            raise ValueError(f"{len(tokens)} tokens exceed the model's maximum of {self.runner.max_positions}")

    def _observe(self, new_tokens: int, ctx_tokens: int, timing: PrefillTiming) -> None:
        """Feed the cost model what this request measured (online calibration)."""
        cm = self.planner
        if cm is None:
            return
        cm.observe_prefill(new_tokens, ctx_tokens, timing.forward_s)
        if ctx_tokens:
            cm.observe_assemble(ctx_tokens * self.layout.bytes_per_token, timing.assemble_s)
