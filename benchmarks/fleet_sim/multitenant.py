"""The generated multi-tenant workload: public documents shared across tenants, private histories.

``multitenant`` (every random choice from ``numpy.random.default_rng(seed)``, so a (seed,
requests) pair always gives the same requests):

- one public system prompt (600 tokens) in front of every request;
- 16 public documents of 3,000-24,000 tokens, Zipf popularity (exponent 1.0); 80 % of sessions
  open one of them right after the system prompt;
- 32 tenants; sessions arrive as a Poisson process (1.5 per second), each owned by a tenant drawn
  uniformly;
- a session is a multi-turn conversation: a geometric number of turns (mean 5, at most 20), user
  messages of lognormal length (median 200 tokens), answers of lognormal length (median 300, the
  request's output length) appended to the history, think times of lognormal length (median
  20 s). Turn t's prompt is the whole history plus the new message;
- 30 % of first messages are one of 8 template messages of 600-1,500 tokens that many tenants
  paste word for word (a standard contract, a checklist, a form): private text identical across
  tenants, long enough to fill whole blocks, so isolation is what keeps one tenant from hitting
  another's copy (tests/unit/benchmarks/fleet_sim/test_simulator.py).

Public material is the system prompt and the document; a block is public when all its tokens are.
Everything after (the conversation) is private to the session's tenant.
"""

from __future__ import annotations

from benchmarks.fleet_sim.requests import Workload, make_request
from benchmarks.trace import TRACE_BLOCK_TOKENS
from benchmarks.workloads import _Builder
from kvtier.errors import ConfigError

TENANTS = 32
DOCUMENTS = 16
SESSION_RATE_PER_S = 1.5
TEMPLATES = 8
TEMPLATE_SHARE = 0.3
DOC_SHARE = 0.8
SYSTEM_TOKENS = 600


def multitenant(seed: int = 1, requests: int = 4000, *, isolated: bool = True) -> Workload:
    if requests <= 0:
        raise ConfigError(f"workload requests must be positive, got {requests}")
    b = _Builder(seed)
    rng = b.rng
    system = b.segment(SYSTEM_TOKENS)
    docs = [b.segment(int(rng.integers(3000, 24001))) for _ in range(DOCUMENTS)]
    doc_weights = b.zipf_weights(DOCUMENTS, 1.0)
    templates = [b.segment(int(rng.integers(600, 1501))) for _ in range(TEMPLATES)]
    out = []

    def emit(t: float, tenant: int, public_tokens: int, segments: list, answer: int) -> None:
        n_in, ids = b.blocks.hash_ids(segments)
        out.append(make_request(len(out), t, tenant, n_in, answer, tuple(ids), public_tokens // TRACE_BLOCK_TOKENS,
                                isolated=isolated))

    def turn(t: float, tenant: int, public_tokens: int, history: list, left: int) -> None:
        if len(out) >= requests:
            return
        answer = b.lognormal(300, 0.8, 10, 2000)
        emit(t, tenant, public_tokens, history, answer)
        if left > 1:
            nxt = [*history, b.segment(answer), b.segment(b.lognormal(200, 0.9, 5, 4000))]
            b.at(t + b.lognormal(20, 0.8, 2, 600), lambda t2: turn(t2, tenant, public_tokens, nxt, left - 1))

    def start(t: float) -> None:
        if len(out) >= requests:
            return
        tenant = int(rng.integers(TENANTS))
        prefix = [system]
        if rng.random() < DOC_SHARE:
            prefix.append(docs[int(rng.choice(DOCUMENTS, p=doc_weights))])
        public_tokens = sum(n for _, n in prefix)
        first = (templates[int(rng.integers(TEMPLATES))] if rng.random() < TEMPLATE_SHARE
                 else b.segment(b.lognormal(200, 0.9, 5, 4000)))
        turn(t, tenant, public_tokens, [*prefix, first], min(int(rng.geometric(1 / 5)), 20))
        b.at(t + rng.exponential(1 / SESSION_RATE_PER_S), start)

    b.at(0.0, start)
    b.run(requests)
    out.sort(key=lambda r: (r.arrival_s, r.rid))
    reqs = tuple(make_request(i, r.arrival_s, r.tenant, r.input_tokens, r.output_tokens, r.content,
                              r.public_blocks, isolated=isolated) for i, r in enumerate(out))
    return Workload(f"multitenant-seed{seed}", reqs, TRACE_BLOCK_TOKENS, TENANTS)
