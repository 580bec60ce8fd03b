"""Generated request traces for replay: documented generators with fixed seeds.

Each generator writes requests in the Mooncake JSONL format the replay reads (``timestamp`` in ms,
``input_length``, ``output_length``, ``hash_ids`` of 512-token prefix-chained blocks), so a
generated trace goes through exactly the same validation, tenant rule, key derivation and tiers as
the bundled Mooncake trace. They exist to check eviction policies on workloads they were not tuned
on; every random choice comes from ``numpy.random.default_rng(seed)``, so a (name, seed) pair always
gives the same file, byte for byte.

A request is a list of *segments* (a system prompt, a tool catalogue, a document, a user turn, an
answer...), each with an identity and a length. Block ``i`` covers tokens ``[512 i, 512 (i+1))``; its
id is interned from (id of block ``i-1``, the pieces of segments it covers), so two requests share
block ``i`` exactly when they agree on every token up to its end, the prefix-chain property of the
real traces. A partial last block never matches the longer block a follow-up request has there.

Generators (``WORKLOADS``):

- ``conversations``: multi-turn chats with growing prefixes. Conversations arrive as a Poisson
  process (1.2 per second); each opens with one of 6 system prompts (Zipf popularity, 300-2,500
  tokens), has a geometric number of turns (mean 4, capped at 30), user messages of lognormal
  length (median 250 tokens, 1 % pasted documents of 2-12k), answers of lognormal length (median
  350) and think times of lognormal length (median 45 s). Turn t's prompt is the whole history plus
  the new message. 8,000 requests.
- ``toolagent``: agents whose prompts share long tool definitions. 12 agent kinds, each a
  system prompt plus a tool catalogue of 3,000-14,000 tokens (Zipf popularity); tasks arrive at 0.6
  per second; each task runs a loop of a geometric number of steps (mean 6, capped at 25), each step
  appending a tool call (30-200 tokens) and a tool result (lognormal, median 600 tokens) a few
  seconds after the previous step. 8,000 requests.
- ``shared-docs``: the seed article's scenario at scale. 300 documents of 2,000-16,000 tokens
  (Zipf popularity, exponent 1.0) behind one shared 400-token instruction; 150 users ask questions
  (100-800 tokens) about a document drawn by popularity at 3 per second; 25 % of questions get a
  follow-up by the same user 5-120 s later (history + answer + new question). 8,000 requests.
"""

from __future__ import annotations

import argparse
import heapq
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks.trace import TRACE_BLOCK_TOKENS, MooncakeTrace, TraceRequest
from kvtier.errors import ConfigError

Segment = tuple[int, int]  # (segment identity, length in tokens)


class BlockInterner:
    """Prefix-chained block ids: block i's id from (block i-1's id, the segment pieces it covers)."""

    def __init__(self) -> None:
        self._ids: dict[tuple, int] = {}

    def hash_ids(self, segments: list[Segment]) -> tuple[int, list[int]]:
        """(input length, hash ids) of a request made of ``segments``."""
        ids: list[int] = []
        prev = -1
        pieces: list[tuple[int, int, int]] = []
        fill = 0
        for seg, length in segments:
            off = 0
            while off < length:
                take = min(length - off, TRACE_BLOCK_TOKENS - fill)
                pieces.append((seg, off, off + take))
                off += take
                fill += take
                if fill == TRACE_BLOCK_TOKENS:
                    prev = self._intern(prev, pieces)
                    ids.append(prev)
                    pieces, fill = [], 0
        if pieces:
            ids.append(self._intern(prev, pieces))
        return sum(n for _, n in segments), ids

    def _intern(self, prev: int, pieces: list[tuple[int, int, int]]) -> int:
        sig = (prev, tuple(pieces))
        got = self._ids.get(sig)
        if got is None:
            got = self._ids[sig] = len(self._ids)
        return got


class _Builder:
    """Shared machinery: fresh segment identities, lognormal lengths, an event queue by time."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self._next_seg = 0
        self.blocks = BlockInterner()
        self._events: list[tuple[float, int, Callable[[float], None]]] = []
        self._tick = 0
        self.out: list[TraceRequest] = []

    def segment(self, length: int) -> Segment:
        self._next_seg += 1
        return (self._next_seg, max(1, int(length)))

    def lognormal(self, median: float, sigma: float, lo: int, hi: int) -> int:
        return int(np.clip(self.rng.lognormal(np.log(median), sigma), lo, hi))

    def zipf_weights(self, n: int, exponent: float) -> np.ndarray:
        w = 1.0 / np.arange(1, n + 1) ** exponent
        return w / w.sum()

    def at(self, t: float, fn: Callable[[float], None]) -> None:
        self._tick += 1
        heapq.heappush(self._events, (t, self._tick, fn))

    def emit(self, t: float, segments: list[Segment], output: int) -> None:
        n_in, ids = self.blocks.hash_ids(segments)
        self.out.append(TraceRequest(int(t * 1000), n_in, int(output), tuple(ids)))

    def run(self, requests: int) -> list[TraceRequest]:
        while self._events and len(self.out) < requests:
            t, _, fn = heapq.heappop(self._events)
            fn(t)
        return self.out[:requests]


def conversations(seed: int = 1, requests: int = 8000) -> list[TraceRequest]:
    b = _Builder(seed)
    rng = b.rng
    prompts = [b.segment(rng.integers(300, 2500)) for _ in range(6)]
    pw = b.zipf_weights(len(prompts), 1.0)

    def message() -> Segment:
        if rng.random() < 0.01:
            return b.segment(rng.integers(2000, 12000))  # a pasted document
        return b.segment(b.lognormal(250, 0.9, 10, 4000))

    def start(t: float) -> None:
        turns = min(int(rng.geometric(1 / 4)), 30)
        history = [prompts[rng.choice(len(prompts), p=pw)]]
        turn(t, history, turns)
        b.at(t + rng.exponential(1 / 1.2), start)

    def turn(t: float, history: list[Segment], left: int) -> None:
        history = [*history, message()]
        answer = b.lognormal(350, 0.8, 5, 3000)
        b.emit(t, history, answer)
        if left > 1:
            history = [*history, b.segment(answer)]
            b.at(t + b.lognormal(45, 1.0, 2, 1800), lambda t2: turn(t2, history, left - 1))

    b.at(0.0, start)
    return b.run(requests)


def toolagent(seed: int = 1, requests: int = 8000) -> list[TraceRequest]:
    b = _Builder(seed)
    rng = b.rng
    agents = [[b.segment(rng.integers(200, 800)), b.segment(rng.integers(3000, 14000))] for _ in range(12)]
    aw = b.zipf_weights(len(agents), 1.0)

    def start(t: float) -> None:
        steps = min(int(rng.geometric(1 / 6)), 25)
        history = [*agents[rng.choice(len(agents), p=aw)], b.segment(b.lognormal(150, 0.7, 20, 2000))]
        step(t, history, steps)
        b.at(t + rng.exponential(1 / 0.6), start)

    def step(t: float, history: list[Segment], left: int) -> None:
        call = int(rng.integers(30, 200))
        b.emit(t, history, call)
        if left > 1:
            history = [*history, b.segment(call), b.segment(b.lognormal(600, 1.0, 20, 8000))]
            b.at(t + b.lognormal(4, 0.8, 0.5, 120), lambda t2: step(t2, history, left - 1))

    b.at(0.0, start)
    return b.run(requests)


def shared_docs(seed: int = 1, requests: int = 8000) -> list[TraceRequest]:
    b = _Builder(seed)
    rng = b.rng
    instruction = b.segment(400)
    docs = [b.segment(rng.integers(2000, 16000)) for _ in range(300)]
    dw = b.zipf_weights(len(docs), 1.0)

    def ask(t: float) -> None:
        history = [instruction, docs[rng.choice(len(docs), p=dw)], b.segment(rng.integers(100, 800))]
        answer = b.lognormal(300, 0.7, 20, 2000)
        b.emit(t, history, answer)
        if rng.random() < 0.25:
            follow = [*history, b.segment(answer), b.segment(rng.integers(100, 800))]
            b.at(t + rng.uniform(5, 120), lambda t2: b.emit(t2, follow, b.lognormal(300, 0.7, 20, 2000)))
        b.at(t + rng.exponential(1 / 3.0), ask)

    b.at(0.0, ask)
    return b.run(requests)


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    name: str
    make: Callable[[int, int], list[TraceRequest]]
    description: str


WORKLOADS: dict[str, WorkloadSpec] = {
    w.name: w
    for w in (
        WorkloadSpec("conversations", conversations, "multi-turn chats with growing prefixes"),
        WorkloadSpec("toolagent", toolagent, "agent loops sharing long tool definitions"),
        WorkloadSpec("shared-docs", shared_docs, "the seed's shared-document scenario at scale"),
    )
}
#: The seed every documented figure uses.
DEFAULT_SEED = 1


def generate(name: str, seed: int = DEFAULT_SEED, requests: int | None = None) -> MooncakeTrace:
    """The named workload as a validated trace (the same object a JSONL file of it loads to)."""
    spec = WORKLOADS.get(name)
    if spec is None:
        raise ConfigError(f"unknown workload {name!r}; one of {sorted(WORKLOADS)}")
    if requests is not None and requests <= 0:
        raise ConfigError(f"workload requests must be positive, got {requests}")
    reqs = spec.make(seed, requests or 8000)
    return MooncakeTrace.parse(list(to_jsonl(reqs)), source=f"{name}-seed{seed}")


def to_jsonl(requests: list[TraceRequest]) -> Iterator[str]:
    for r in requests:
        yield json.dumps({"timestamp": r.timestamp_ms, "input_length": r.input_length,
                          "output_length": r.output_length, "hash_ids": list(r.hash_ids)})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.workloads", description="write a generated trace as JSONL")
    p.add_argument("name", choices=sorted(WORKLOADS))
    p.add_argument("out", type=Path)
    p.add_argument("--seed", type=int, default=DEFAULT_SEED)
    p.add_argument("--requests", type=int)
    a = p.parse_args(argv)
    trace = generate(a.name, a.seed, a.requests)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text("".join(line + "\n" for line in to_jsonl(list(trace.requests))))
    s = trace.stats()
    print(f"{a.out}: {s.requests:,} requests, {s.unique_ids:,} unique blocks, "
          f"unbounded full-block token hit rate {s.token_hit_rate_full:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
