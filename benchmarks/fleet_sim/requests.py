"""Simulated requests: who asks, when, for which blocks, under which scope.

A request's KV blocks are the trace's 512-token blocks. Only full blocks are ever cached (the
partial last block never is), the rule the replay uses. Each full block has a *key* that carries
its scope, as kvtier's keys do: public material has the public scope (shared by every tenant), the
rest is private to the request's tenant. Two tenants asking for the same private text get
different keys, so one can never hit the other's private block: the isolation tests check it,
with ``isolated=False`` as the control under which they would.

Requests also keep their *content* ids (every block, the partial last one too, without scope):
what a router that sees only the prompt text, such as vllm-router's approximate tree, can key on.

Tenant rule for traces: ``benchmarks.trace.MooncakeScenario`` (conversations dealt to users
round-robin; leading blocks that occur in another conversation are public). It loses no reuse the
unscoped trace has: a block shared by two conversations is public together with its whole prefix.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from benchmarks.trace import TRACE_BLOCK_TOKENS, MooncakeScenario, MooncakeTrace
from kvtier.errors import ConfigError

#: Content ids stay below this (the trace validator's bound); a key is ``scope << SCOPE_SHIFT | id``.
SCOPE_SHIFT = 40
PUBLIC_SCOPE = 0


def scoped_key(scope: int, content_id: int) -> int:
    """The cache key of a block: its content under a scope (0 is public)."""
    assert 0 <= content_id < 1 << SCOPE_SHIFT
    return scope << SCOPE_SHIFT | content_id


def key_scope(key: int) -> int:
    return key >> SCOPE_SHIFT


@dataclass(slots=True, frozen=True)
class SimRequest:
    """One request. Invariant: ``len(keys) == input_tokens // block_tokens <= len(content)``;
    ``keys[i]`` is public for ``i < public_blocks`` and private to ``tenant`` after."""

    rid: int
    arrival_s: float
    tenant: int
    input_tokens: int
    output_tokens: int
    keys: tuple[int, ...]
    content: tuple[int, ...]
    public_blocks: int


@dataclass(slots=True, frozen=True)
class Workload:
    """A named, time-ordered list of requests, and the block size its ids stand for."""

    name: str
    requests: tuple[SimRequest, ...]
    block_tokens: int = TRACE_BLOCK_TOKENS
    tenants: int = 1

    def __post_init__(self) -> None:
        if not self.requests:
            raise ConfigError(f"workload {self.name!r} has no requests")
        times = [r.arrival_s for r in self.requests]
        if any(b < a for a, b in itertools.pairwise(times)):
            raise ConfigError(f"workload {self.name!r}: arrivals must be in time order")

    def rescaled(self, factor: float) -> Workload:
        """The same requests with every arrival time divided by ``factor`` (a faster replay)."""
        if not factor > 0:
            raise ConfigError(f"speed-up must be positive, got {factor}")
        t0 = self.requests[0].arrival_s
        reqs = tuple(SimRequest(r.rid, t0 + (r.arrival_s - t0) / factor, r.tenant, r.input_tokens, r.output_tokens,
                                r.keys, r.content, r.public_blocks) for r in self.requests)
        return Workload(self.name, reqs, self.block_tokens, self.tenants)

    @property
    def duration_s(self) -> float:
        return self.requests[-1].arrival_s - self.requests[0].arrival_s


def make_request(rid: int, arrival_s: float, tenant: int, input_tokens: int, output_tokens: int,
                 content: tuple[int, ...], public_blocks: int, *, block_tokens: int = TRACE_BLOCK_TOKENS,
                 isolated: bool = True) -> SimRequest:
    """A request whose private blocks take the tenant's scope (``tenant + 1``) when ``isolated``."""
    full = input_tokens // block_tokens
    if len(content) < full:
        raise ConfigError(f"request {rid}: {len(content)} content ids for {full} full blocks")
    public = min(public_blocks, full)
    private_scope = tenant + 1 if isolated else PUBLIC_SCOPE
    keys = tuple(scoped_key(PUBLIC_SCOPE if i < public else private_scope, content[i]) for i in range(full))
    return SimRequest(rid, arrival_s, tenant, input_tokens, output_tokens, keys, tuple(content), public)


def from_trace(trace: MooncakeTrace, *, users: int = 10, limit: int | None = None,
               isolated: bool = True) -> Workload:
    """A Mooncake-format trace as tenant-attributed requests (see the module docstring)."""
    scen = MooncakeScenario(trace, users=users, limit=limit)
    out = []
    for idx, r in enumerate(scen.requests):
        tenant = scen.conversation[idx] % users
        out.append(make_request(idx, r.timestamp_ms / 1000.0, tenant, r.input_length, r.output_length,
                                r.hash_ids, scen.public_blocks[idx], isolated=isolated))
    return Workload(scen.name, tuple(out), TRACE_BLOCK_TOKENS, users)
