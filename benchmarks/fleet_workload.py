"""The multi-tenant conversation workload of ``kvtier bench fleet`` (real engines), and what each
request may legitimately find cached.

Seeded, so every router replays the same requests at the same offsets:

- ``docs`` public documents (``doc_blocks`` full blocks of token ids each), shared across tenants:
  the deployment publishes them into kvtier's public scope once (the ``public-registry`` rule);
- ``tenants`` x ``users`` conversations; each user is its own principal (its own ``cache_salt``),
  reads one document (drawn), has a private system prompt and ``turns`` turns. Turn ``t``'s prompt
  is ``document + system + (question, answer) * t + question``: the history grows by the earlier
  turns (the answers are seeded text, not the model's, so the workload does not depend on outputs);
- ``probes``: a user of another tenant sends, verbatim, a prompt another user sent before it:
  the requests through which one tenant could be served another's private blocks;
- arrivals: a Poisson process (``rate_per_s``); each arrival is the next turn of a conversation
  drawn among those with turns left; a probe comes after the prompt it copies.

``legit_cached_tokens`` is the most a request may find cached without crossing tenants: its
longest full-block prefix shared with a public document or with anything else its own user sent
or was answered in the run. A cached count above that came from another principal's blocks.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

#: Token ids below this are the tokenizer's specials and the chat roles; the workload avoids them.
FIRST_ID = 10


@dataclass(slots=True, frozen=True)
class WorkloadSpec:
    docs: int = 4
    doc_blocks: int = 8
    tenants: int = 3
    users: int = 2
    turns: int = 4
    system_tokens: int = 48
    question_tokens: int = 40
    answer_tokens: int = 56
    probes: int = 3
    rate_per_s: float = 2.0
    block_tokens: int = 32
    vocab_size: int = 1024
    seed: int = 30

    def as_dict(self) -> dict[str, object]:
        return {f: getattr(self, f) for f in self.__slots__}  # type: ignore[attr-defined]


@dataclass(slots=True, frozen=True)
class FleetRequest:
    """One request: who sends it (``tenant``/``user``), its prompt, when (seconds from the start)."""

    index: int
    tenant: str
    user: str
    tokens: tuple[int, ...]
    at_s: float
    probe_of: int | None = None  # the request whose prompt a probe copies

    @property
    def principal(self) -> tuple[str, str]:
        return (self.tenant, self.user)


@dataclass(slots=True, frozen=True)
class Workload:
    spec: WorkloadSpec
    documents: tuple[tuple[int, ...], ...]
    requests: tuple[FleetRequest, ...]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(r.tokens) for r in self.requests)

    def unique_prompts(self) -> list[tuple[int, ...]]:
        seen: dict[tuple[int, ...], None] = {}
        for r in self.requests:
            seen.setdefault(r.tokens, None)
        return list(seen)


def _ids(rng: random.Random, n: int, vocab: int) -> tuple[int, ...]:
    return tuple(rng.randrange(FIRST_ID, vocab) for _ in range(n))


def build(spec: WorkloadSpec) -> Workload:
    rng = random.Random(spec.seed)
    bt = spec.block_tokens
    docs = tuple(_ids(rng, spec.doc_blocks * bt, spec.vocab_size) for _ in range(spec.docs))
    conversations: list[tuple[str, str, list[tuple[int, ...]]]] = []
    for t in range(spec.tenants):
        for u in range(spec.users):
            doc = docs[rng.randrange(spec.docs)]
            history = doc + _ids(rng, spec.system_tokens, spec.vocab_size)
            prompts = []
            for _ in range(spec.turns):
                question = _ids(rng, spec.question_tokens, spec.vocab_size)
                prompts.append(history + question)
                history = history + question + _ids(rng, spec.answer_tokens, spec.vocab_size)
            conversations.append((f"tenant{t}", f"user{u}", prompts))
    # Arrivals: the next turn of a conversation drawn among those with turns left.
    next_turn = [0] * len(conversations)
    order: list[int] = []
    while len(order) < spec.tenants * spec.users * spec.turns:
        left = [i for i, c in enumerate(conversations) if next_turn[i] < len(c[2])]
        i = rng.choice(left)
        order.append(i)
        next_turn[i] += 1
    seq: list[tuple[str, str, tuple[int, ...], int | None]] = []
    sent = [0] * len(conversations)
    for i in order:
        tenant, user, prompts = conversations[i]
        seq.append((tenant, user, prompts[sent[i]], None))
        sent[i] += 1
    # Probes: a user of another tenant copies a prompt sent earlier (never the first request).
    n_probes = min(spec.probes, len(seq) - len(seq) // 2) if spec.tenants > 1 else 0
    for src in sorted(rng.sample(range(len(seq) // 2, len(seq)), n_probes), reverse=True):
        tenant, _, tokens, _ = seq[src]
        others = [c for c in conversations if c[0] != tenant]
        prober = rng.choice(others)
        at = rng.randrange(src + 1, len(seq) + 1)
        seq.insert(at, (prober[0], prober[1], tokens, src))
        # indexes after the insertion point shifted by one
        seq = [(a, b, c, (d + 1 if d is not None and d >= at else d)) for a, b, c, d in seq]
    t = 0.0
    requests = []
    for k, (tenant, user, tokens, src) in enumerate(seq):
        t += rng.expovariate(spec.rate_per_s)
        requests.append(FleetRequest(k, tenant, user, tokens, round(t, 4), src))
    return Workload(spec, docs, tuple(requests))


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def shareable_cached_tokens(tokens: Sequence[int], sources: Sequence[Sequence[int]], block_tokens: int) -> int:
    """The most of ``tokens`` an engine may serve from cached blocks of ``sources``: the longest
    full-block common prefix, never the prompt's last token (an engine computes at least one)."""
    best = max((_common_prefix(tokens, s) for s in sources), default=0)
    best = min(best, len(tokens) - 1)
    return best // block_tokens * block_tokens


def legit_cached_tokens(w: Workload, index: int, outputs: dict[int, Sequence[int]]) -> int:
    """What request ``index`` may find cached without crossing principals: the public documents,
    and the prompts and prompt+answer of its own user's other requests, earlier or later (arrivals
    are open-loop: a later turn, which extends this one's prompt, may be computed first while
    this one waits in a queue)."""
    r = w.requests[index]
    sources: list[Sequence[int]] = list(w.documents)
    for e in w.requests:
        if e.principal == r.principal and e.index != index:
            sources.append(e.tokens)
            sources.append(tuple(e.tokens) + tuple(outputs.get(e.index, ())))
    return shareable_cached_tokens(r.tokens, sources, w.spec.block_tokens)


def public_cached_tokens(w: Workload, index: int) -> int:
    """What request ``index`` may find cached from the public documents alone (the bound another
    tenant's request for the same prompt would have)."""
    return shareable_cached_tokens(w.requests[index].tokens, w.documents, w.spec.block_tokens)
