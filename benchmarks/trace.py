"""Request traces and built-in scenarios for replay: who asks for which tokens, under which scope.

A *scenario* is a sequence of requests; each request belongs to a user and is a run of *parts*
(token arrays) that are either declared public material or private to the user. An *isolation
rule* turns that declaration into scopes (one trust group, per-user isolation, or
segment-level sharing), and ``derive_chains`` runs the real key derivation
(``kvtier.keys.block_chain``) over every request. Nothing here knows about tiers or policies.

Sources:
- ``seed-shared`` / ``seed-isolated`` / ``seed-segmented``: 10 users x 10 requests, each the same
  10,000-token document followed by a different 500-token question (DESIGN background, section 8),
  users interleaved round-robin; the three names differ only in the isolation rule.
- a Mooncake JSONL trace (``hash_ids`` are prefix-chained 512-token block ids). Each id expands into
  512 deterministic token ids seeded by the id, so equal ids give equal tokens and equal keys.

Tenant rule for traces (documented in ``MooncakeScenario``): a request that extends an earlier
request's full-block chain continues that request's *conversation*; any other request starts a
new conversation. Conversations are dealt to ``users`` users round-robin in order of arrival.
Material contained in requests of two or more conversations is declared public (a shared system
prompt or document); the rest of a request is private to its user.
"""

from __future__ import annotations

import json
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvtier.errors import ConfigError
from kvtier.keys import BlockKey, ChainBlock, DomainDeriver, Scope, Segment, block_chain
from kvtier.layout import KVLayout

#: Tokens per Mooncake block id (the trace's own block size).
TRACE_BLOCK_TOKENS = 512
#: Token ids are drawn from a Llama-3-sized vocabulary; any size works, collisions of whole
#: blocks are what matters and they are astronomically unlikely at this size.
VOCAB = 128_256
_M64 = (1 << 64) - 1
#: Seeds of the synthetic seed scenario live far above any trace id.
_SEED_NAMESPACE = 1 << 40


def default_trace_path() -> Path:
    """The Mooncake trace beside the checkout: ``<repo root>/../shared/data/mooncake/...``."""
    return Path(__file__).resolve().parents[2] / "shared" / "data" / "mooncake" / "synthetic_trace.jsonl"


# -- deterministic token expansion ------------------------------------------------------------------
def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser over uint64 arrays (wrapping arithmetic): a fixed, portable mixer."""
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def token_stream(seeds: Sequence[int] | np.ndarray, length: int) -> np.ndarray:
    """``length`` token ids for each seed, concatenated: row s is a function of seeds[s] only."""
    base = _splitmix64(np.asarray(seeds, dtype=np.uint64))
    with np.errstate(over="ignore"):
        grid = base[:, None] + np.arange(length, dtype=np.uint64)[None, :]
    return (_splitmix64(grid) % np.uint64(VOCAB)).astype(np.uint32).reshape(-1)


def expand_hash_ids(hash_ids: Sequence[int]) -> np.ndarray:
    """512 token ids per Mooncake block id, seeded by the id (equal ids -> equal tokens)."""
    return token_stream(hash_ids, TRACE_BLOCK_TOKENS)


# -- scenario model ---------------------------------------------------------------------------------
@dataclass(slots=True, frozen=True)
class Part:
    """A run of tokens a request declares as public material or as private to its user."""

    tokens: np.ndarray
    public: bool


@dataclass(slots=True, frozen=True)
class ScenarioRequest:
    """One request: its user and its parts in prompt order (public parts should come first)."""

    user: str
    parts: tuple[Part, ...]

    @property
    def input_tokens(self) -> int:
        return sum(len(p.tokens) for p in self.parts)


class Scenario(ABC):
    """A replayable, deterministic sequence of requests. Iterating twice yields the same requests."""

    name: str = ""

    @abstractmethod
    def __iter__(self) -> Iterator[ScenarioRequest]: ...

    @abstractmethod
    def __len__(self) -> int: ...


class SeedScenario(Scenario):
    """``users`` x ``per_user`` requests: one shared document + a distinct question each.

    Request r belongs to user ``u{r % users}`` (users interleaved, as concurrent tenants would
    be) and carries question r; every question differs from every other. The document is
    declared public and the question private, so the isolation rule alone decides what is shared.
    """

    def __init__(
        self, *, users: int = 10, per_user: int = 10, doc_tokens: int = 10_000, question_tokens: int = 500
    ) -> None:
        for field, v in (("users", users), ("per_user", per_user), ("doc_tokens", doc_tokens)):
            if v <= 0:
                raise ConfigError(f"seed scenario: {field} must be positive, got {v}")
        if question_tokens < 0:
            raise ConfigError(f"seed scenario: question_tokens must be >= 0, got {question_tokens}")
        self.name = "seed"
        self.users = users
        self.per_user = per_user
        self.doc = token_stream([_SEED_NAMESPACE], doc_tokens)
        self.question_tokens = question_tokens

    def __len__(self) -> int:
        return self.users * self.per_user

    def __iter__(self) -> Iterator[ScenarioRequest]:
        for r in range(len(self)):
            question = token_stream([_SEED_NAMESPACE + 1 + r], self.question_tokens)
            yield ScenarioRequest(f"u{r % self.users}", (Part(self.doc, True), Part(question, False)))


# -- Mooncake traces --------------------------------------------------------------------------------
@dataclass(slots=True, frozen=True)
class TraceRequest:
    """One line of a Mooncake trace."""

    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    @property
    def full_blocks(self) -> int:
        """Trace blocks holding a full 512 tokens (a partial last block is never cached)."""
        return self.input_length // TRACE_BLOCK_TOKENS


@dataclass(slots=True, frozen=True)
class TraceStats:
    """Id-level facts of a trace with an unbounded cache (what the trace's README states).

    ``repeated_blocks`` counts block ids seen in an earlier request (prefix-chained ids make every
    repeat a prefix hit). Token hit rates: ``partial`` stores a partial last block and counts it
    by its real length; ``full`` stores and counts only full 512-token blocks.
    """

    requests: int
    blocks: int
    unique_ids: int
    duration_s: float
    repeated_blocks: int
    input_tokens: int
    hit_tokens_partial: int
    hit_tokens_full: int

    @property
    def block_hit_rate(self) -> float:
        return self.repeated_blocks / self.blocks

    @property
    def token_hit_rate_partial(self) -> float:
        return self.hit_tokens_partial / self.input_tokens

    @property
    def token_hit_rate_full(self) -> float:
        return self.hit_tokens_full / self.input_tokens


def _field_int(obj: dict, name: str, where: str, *, minimum: int) -> int:
    v = obj.get(name)
    if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
        raise ConfigError(f"{where}: field {name!r} must be an integer >= {minimum}, got {v!r}")
    return v


class MooncakeTrace:
    """A loaded, validated Mooncake trace (immutable after load).

    Validation refuses, with the line number: non-JSON lines, missing or mistyped fields,
    ``len(hash_ids) != ceil(input_length / 512)``, and ids that break the prefix-chain property
    (an id must always sit at the same position after the same predecessor), because a replay
    of such a trace would silently mean something else than the file says.
    """

    def __init__(self, requests: Sequence[TraceRequest], source: str = "<memory>") -> None:
        if not requests:
            raise ConfigError(f"{source}: trace has no requests")
        self.requests: tuple[TraceRequest, ...] = tuple(requests)
        self.source = source

    @classmethod
    def load(cls, path: str | Path) -> MooncakeTrace:
        p = Path(path)
        try:
            text = p.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ConfigError(f"trace file not found: {p}") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read trace {p}: {exc}") from None
        return cls.parse(text.splitlines(), source=str(p))

    @classmethod
    def parse(cls, lines: Sequence[str], source: str = "<memory>") -> MooncakeTrace:
        out: list[TraceRequest] = []
        place: dict[int, tuple[int, int | None]] = {}  # id -> (position, predecessor id)
        for lineno, line in enumerate(lines, 1):
            if not line.strip():
                continue
            where = f"{source}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{where}: not JSON ({exc.msg})") from None
            if not isinstance(obj, dict):
                raise ConfigError(f"{where}: expected a JSON object")
            ts = _field_int(obj, "timestamp", where, minimum=0)
            n_in = _field_int(obj, "input_length", where, minimum=1)
            n_out = _field_int(obj, "output_length", where, minimum=0)
            ids = obj.get("hash_ids")
            if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
                raise ConfigError(f"{where}: field 'hash_ids' must be a list of integers")
            if any(i < 0 or i >= 1 << 40 for i in ids):
                raise ConfigError(f"{where}: 'hash_ids' must lie in [0, 2**40)")
            if len(ids) != math.ceil(n_in / TRACE_BLOCK_TOKENS):
                raise ConfigError(
                    f"{where}: {len(ids)} hash_ids for input_length {n_in}; "
                    f"expected ceil({n_in}/{TRACE_BLOCK_TOKENS}) = {math.ceil(n_in / TRACE_BLOCK_TOKENS)}"
                )
            for pos, i in enumerate(ids):
                seen = place.setdefault(i, (pos, ids[pos - 1] if pos else None))
                if seen != (pos, ids[pos - 1] if pos else None):
                    raise ConfigError(
                        f"{where}: hash id {i} at position {pos} breaks the prefix chain "
                        f"(first seen at position {seen[0]} after {seen[1]})"
                    )
            out.append(TraceRequest(ts, n_in, n_out, tuple(ids)))
        return cls(out, source)

    def __len__(self) -> int:
        return len(self.requests)

    def stats(self) -> TraceStats:
        seen: set[int] = set()
        seen_full: set[int] = set()
        repeated = hit_partial = hit_full = n_in = blocks = 0
        for r in self.requests:
            n_in += r.input_length
            blocks += len(r.hash_ids)
            lead = 0
            while lead < len(r.hash_ids) and r.hash_ids[lead] in seen:
                lead += 1
            repeated += sum(1 for i in r.hash_ids if i in seen)
            # Partial rule: a hit on the last (partial) block counts its real length.
            hit_partial += min(lead * TRACE_BLOCK_TOKENS, r.input_length)
            full = r.full_blocks
            lead_full = 0
            while lead_full < full and r.hash_ids[lead_full] in seen_full:
                lead_full += 1
            hit_full += lead_full * TRACE_BLOCK_TOKENS
            seen.update(r.hash_ids)
            seen_full.update(r.hash_ids[:full])
        duration = (self.requests[-1].timestamp_ms - self.requests[0].timestamp_ms) / 1000
        return TraceStats(len(self.requests), blocks, len(seen), duration, repeated, n_in, hit_partial, hit_full)


class MooncakeScenario(Scenario):
    """A Mooncake trace as tenant-attributed requests.

    Tenant rule (stated, deterministic, uses only the trace):
    - *Conversation*: a request whose full-block id chain starts with the whole full-block chain of
      an earlier request continues that request's conversation (a multi-turn follow-up); every
      other request opens a new conversation.
    - *User*: conversations are dealt to ``users`` users round-robin in order of arrival, so one
      user owns each conversation and reuse inside a conversation survives per-user isolation.
    - *Public material*: the leading blocks of a request that also occur in a request of another
      conversation (anywhere in the trace: the operator knows which documents and system prompts
      are shared; this is a declaration of content, not knowledge a cache policy may use). The
      rest of the request, including its partial last block, is private to its user.
    """

    def __init__(self, trace: MooncakeTrace, *, users: int = 10, limit: int | None = None) -> None:
        if users <= 0:
            raise ConfigError(f"trace scenario: users must be positive, got {users}")
        if limit is not None and limit <= 0:
            raise ConfigError(f"trace scenario: limit must be positive, got {limit}")
        self.name = Path(trace.source).name
        self.trace = trace
        self.users = users
        self.requests = trace.requests[:limit] if limit else trace.requests
        self.conversation, self.public_blocks = self._attribute(self.requests)

    @staticmethod
    def _attribute(requests: Sequence[TraceRequest]) -> tuple[list[int], list[int]]:
        conv: list[int] = []
        opened = 0
        ends: dict[int, int] = {}  # last full-block id of a request -> that request's index
        for idx, r in enumerate(requests):
            full = r.hash_ids[: r.full_blocks]
            parent = None
            for pos in range(len(full) - 1, -1, -1):
                q = ends.get(full[pos])
                if q is not None and requests[q].hash_ids[: requests[q].full_blocks] == full[: pos + 1]:
                    parent = q
                    break
            if parent is None:
                conv.append(opened)
                opened += 1
            else:
                conv.append(conv[parent])
            if full:
                ends[full[-1]] = idx
        first_conv: dict[int, int] = {}
        shared: set[int] = set()
        for idx, r in enumerate(requests):
            for i in r.hash_ids:
                c = first_conv.setdefault(i, conv[idx])
                if c != conv[idx]:
                    shared.add(i)
        public: list[int] = []
        for r in requests:
            n = 0
            while n < len(r.hash_ids) and r.hash_ids[n] in shared:
                n += 1
            public.append(n)
        return conv, public

    def __len__(self) -> int:
        return len(self.requests)

    def user_of(self, index: int) -> str:
        return f"u{self.conversation[index] % self.users}"

    def __iter__(self) -> Iterator[ScenarioRequest]:
        for idx, r in enumerate(self.requests):
            tokens = expand_hash_ids(r.hash_ids)[: r.input_length]
            cut = min(self.public_blocks[idx] * TRACE_BLOCK_TOKENS, r.input_length)
            parts = (Part(tokens[:cut], True), Part(tokens[cut:], False))
            yield ScenarioRequest(self.user_of(idx), tuple(p for p in parts if len(p.tokens)))


# -- isolation rules --------------------------------------------------------------------------------
class IsolationRule(ABC):
    """Maps a request's declared parts to scopes; the key derivation does the rest."""

    name: str = ""

    @abstractmethod
    def scope(self, request: ScenarioRequest, part: Part) -> Scope: ...


ISOLATIONS: dict[str, IsolationRule] = {}


def _register(cls: type[IsolationRule]) -> type[IsolationRule]:
    ISOLATIONS[cls.name] = cls()
    return cls


def isolation_rule(name: str) -> IsolationRule:
    try:
        return ISOLATIONS[name]
    except KeyError:
        raise ConfigError(f"unknown isolation rule {name!r}; one of {sorted(ISOLATIONS)}") from None


@_register
class TrustGroup(IsolationRule):
    """Every request is in one trust group (one org scope): everything is shareable."""

    name = "shared"
    GROUP = Scope.org("trust-group")

    def scope(self, request: ScenarioRequest, part: Part) -> Scope:
        return self.GROUP


@_register
class PerUser(IsolationRule):
    """Each user's whole request is scoped to the user (a salt on the whole chain)."""

    name = "isolated"

    def scope(self, request: ScenarioRequest, part: Part) -> Scope:
        return Scope.user(request.user)


@_register
class SegmentLevel(IsolationRule):
    """Declared public parts are public; private parts (and, by the cumulative rule, all that
    follows them) are scoped to the user."""

    name = "segmented"

    def scope(self, request: ScenarioRequest, part: Part) -> Scope:
        return Scope.public() if part.public else Scope.user(request.user)


# -- key derivation ---------------------------------------------------------------------------------
@dataclass(slots=True, frozen=True)
class RequestChain:
    """A request as the cache sees it: its user, its input length, and its full blocks' keys."""

    user: str
    input_tokens: int
    blocks: tuple[ChainBlock, ...]

    @property
    def keys(self) -> list[BlockKey]:
        return [b.key for b in self.blocks]


def derive_chains(
    scenario: Scenario,
    rule: IsolationRule,
    layout: KVLayout,
    deriver: DomainDeriver,
    progress: Callable[[int], None] | None = None,
) -> list[RequestChain]:
    """Run the real key derivation (``block_chain``) over every request of the scenario."""
    out: list[RequestChain] = []
    for n, req in enumerate(scenario, 1):
        segments = [Segment(p.tokens, rule.scope(req, p)) for p in req.parts]
        out.append(RequestChain(req.user, req.input_tokens, tuple(block_chain(layout, segments, deriver))))
        if progress is not None:
            progress(n)
    return out


SEED_SOURCES: dict[str, str] = {
    "seed-shared": "shared",
    "seed-isolated": "isolated",
    "seed-segmented": "segmented",
}


def open_source(source: str, *, users: int = 10, limit: int | None = None) -> tuple[Scenario, str]:
    """A scenario and its default isolation rule for a ``--trace`` argument.

    ``seed-*`` names are the built-in scenarios; ``mooncake`` is the bundled trace beside the
    checkout; anything else is a path to a Mooncake JSONL file.
    """
    if source in SEED_SOURCES:
        if limit is not None:
            raise ConfigError(f"--limit applies to traces, not to the built-in scenario {source}")
        return SeedScenario(), SEED_SOURCES[source]
    path = default_trace_path() if source == "mooncake" else Path(source)
    return MooncakeScenario(MooncakeTrace.load(path), users=users, limit=limit), "shared"
