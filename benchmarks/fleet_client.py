"""The client side of ``kvtier bench fleet`` (real engines): a workload replayed through one
router at its arrival times, every request streamed.

Each request is ``POST /v1/completions`` with the prompt as token ids, the user's ``cache_salt``,
greedy, ``OUTPUT_TOKENS`` tokens past any end token, the top ``TOP_LOGPROBS`` log-probabilities
of each, and ``stream_options.include_usage`` (the engine's ``prompt_tokens_details.cached_tokens``:
what its prefix cache and kvtier served). TTFT is the time from sending to the first streamed
chunk that carries a token. Requests are open-loop: each is sent at its offset whether or not the
ones before it have been answered.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from benchmarks.fleet_workload import FleetRequest, Workload
from benchmarks.output_match import Generation

OUTPUT_TOKENS = 32
TOP_LOGPROBS = 5


@dataclass(slots=True, frozen=True)
class Answer:
    index: int
    ttft_ms: float
    prompt_tokens: int
    cached_tokens: int
    output: Generation
    error: str | None = None


def stream_completion(url: str, tokens: list[int], salt: str | None, *, max_tokens: int = OUTPUT_TOKENS,
                      logprobs: int = TOP_LOGPROBS, timeout_s: float = 600) -> Answer:
    """One streamed request (see the module docstring); an HTTP error or an error event is an
    Answer with ``error`` set, never an exception (the run reports it)."""
    body: dict[str, Any] = {"model": "m", "prompt": tokens, "max_tokens": max_tokens, "temperature": 0.0,
                            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    if logprobs:
        body["logprobs"] = logprobs
    if salt is not None:
        body["cache_salt"] = salt
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    first: float | None = None
    toks: list[str] = []
    tops: list[dict[str, float]] = []
    usage: dict[str, Any] = {}
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if "error" in chunk:
                    return Answer(-1, 0.0, len(tokens), 0, Generation.of([]), f"error event: {str(chunk)[:300]}")
                if chunk.get("usage"):
                    usage = chunk["usage"]
                if not chunk.get("choices"):
                    continue
                choice = chunk["choices"][0]
                lp = choice.get("logprobs") or {}
                got = lp.get("tokens") or []
                if first is None and (got or choice.get("text")):
                    first = time.perf_counter() - t0
                for tok, chosen, top in zip(got, lp.get("token_logprobs") or [], lp.get("top_logprobs") or [],
                                            strict=False):
                    toks.append(tok)
                    tops.append({**(top or {}), tok: chosen})
    except urllib.error.HTTPError as exc:
        return Answer(-1, 0.0, len(tokens), 0, Generation.of([]), f"HTTP {exc.code}: {exc.read()[:300]!r}")
    except (OSError, ValueError) as exc:
        return Answer(-1, 0.0, len(tokens), 0, Generation.of([]), f"{type(exc).__name__}: {exc}")
    if first is None:
        return Answer(-1, 0.0, len(tokens), 0, Generation.of([]), "the stream carried no token")
    details = usage.get("prompt_tokens_details") or {}
    return Answer(-1, first * 1e3, int(usage.get("prompt_tokens") or len(tokens)),
                  int(details.get("cached_tokens") or 0), Generation.of(toks, tops))


def replay(url: str, w: Workload, salts: dict[tuple[str, str], str],
           on_answer: Callable[[Answer], None] | None = None) -> list[Answer]:
    """Send every request of ``w`` through ``url`` at its offset; the answers in request order."""
    start = time.monotonic() + 0.05

    def one(r: FleetRequest) -> Answer:
        delay = start + r.at_s - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        a = stream_completion(url, list(r.tokens), salts[r.principal])
        a = Answer(r.index, a.ttft_ms, a.prompt_tokens, a.cached_tokens, a.output, a.error)
        if on_answer is not None:
            on_answer(a)
        return a

    with ThreadPoolExecutor(max_workers=max(1, len(w.requests))) as pool:
        return list(pool.map(one, w.requests))


def replay_alone(url: str, w: Workload, salts: dict[tuple[str, str], str]) -> list[Answer]:
    """Send every request of ``w`` to ``url`` in order, each when the one before it has been
    answered: no request ever waits behind another (the arrival times are not kept)."""
    out = []
    for r in w.requests:
        a = stream_completion(url, list(r.tokens), salts[r.principal])
        out.append(Answer(r.index, a.ttft_ms, a.prompt_tokens, a.cached_tokens, a.output, a.error))
    return out
