"""The LMCache half of ``kvtier bench peer --lmcache``: a client of LMCache MP server sessions.

Runs inside ``.venv-lmcache`` (LMCache 0.5.6 and its own torch), never inside kvtier's venv, so it
imports nothing from kvtier; only the sibling ``peer_payload`` (torch alone). ``peer_lmcache.py``
starts this file once and, for every freshly started server, writes a JSON plan line on its stdin;
per-request timings and verification results come back as one JSON line on stdout (LMCache logs
to stderr).

The client works as an engine worker does on LMCache's CPU path (``lmcache_driven`` transfer):
its paged KV cache (one ``(2, pages, page_tokens, heads, head_dim)`` tensor per layer, vLLM's NHD
layout) is registered with the server, which moves it into POSIX shared memory and maps the same
pages. A STORE sends only page ids; the server copies those pages into its L1 memory. A retrieve is
LOOKUP (the server pins the chunks, loading them from L2 into L1 when L1 lacks them), a blocking
wait for that prefetch (as LMCache's SGLang adapter does; no client-side polling interval), then
RETRIEVE, which copies L1 into the client's pages. Sources live in pages ``1 ..`` (page 0 is
LMCache's null block), one slot per request plus one for the warm-up request, destinations in a
second range, zeroed before every retrieve.

Operations of a session, in the order the plan lists them: ``warmup`` (store and read back, verified,
one request outside the measured ones), ``fill`` (filler stores of the request pages under other
token ids until L1's capacity has been written once, then ``POST /cache/clear``: L1 empty, its pages
touched), ``store`` (timed stores), ``read_pass`` (an untimed, verified read of every request) and
``retrieve`` (timed, verified reads). Every session starts with the client's set-up: registration and
a lookup of a key nobody stored.

LMCache skips chunks it cannot place in L1 and still reports the STORE as successful, so a store
proves nothing by itself: every request is verified by retrieving it (here or in a later session)
and comparing every byte with its source.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, replace
from typing import Any

import torch
from peer_payload import chunk_payload, request_tokens, same_bytes

MODEL = "kvtier-peer-bench"
INSTANCE_ID = 4242
#: The warm-up request's index (never one of the measured ones); fillers are 2000, 2001, ...
WARM_UP = 999
FILLER = 2000


class DriverError(RuntimeError):
    """An LMCache call failed or timed out; the message says which request and why."""


@dataclass(frozen=True)
class Plan:
    rpc_url: str
    http_url: str
    l1_bytes: int
    layers: int
    kv_heads: int
    head_dim: int
    chunk_tokens: int
    page_tokens: int
    request_tokens: int
    requests: int
    seed: int
    #: "store" (timed STOREs of whole requests) and/or "retrieve" (timed, verified retrieves).
    ops: tuple[str, ...]
    timeout_s: float

    @property
    def pages_per_request(self) -> int:
        return self.request_tokens // self.page_tokens

    @property
    def pages_per_chunk(self) -> int:
        return self.chunk_tokens // self.page_tokens

    @property
    def chunks_per_request(self) -> int:
        return self.request_tokens // self.chunk_tokens


class Client:
    """One registered worker: a paged KV cache in shared memory and a request client."""

    def __init__(self, plan: Plan) -> None:
        import zmq
        from lmcache.utils import EngineType
        from lmcache.v1.multiprocess.group_view import EngineGroupInfo
        from lmcache.v1.multiprocess.transfer_context import create_transfer_context
        from lmcache.v1.multiprocess.transport.factory import RequestClientFactory

        self.plan = plan
        self.zmq = zmq.Context()
        self.zmq.setsockopt(zmq.LINGER, 0)
        self.rpc = RequestClientFactory.create(plan.rpc_url, context=self.zmq)
        chunk = self.rpc.get_chunk_size().result(timeout=plan.timeout_s)
        if chunk != plan.chunk_tokens:
            raise DriverError(f"server chunk size {chunk} != planned {plan.chunk_tokens}")
        pages = 1 + 2 * (plan.requests + 1) * plan.pages_per_request
        shape = (2, pages, plan.page_tokens, plan.kv_heads, plan.head_dim)
        self.kv = {f"layer.{i}": torch.zeros(shape, dtype=torch.float16) for i in range(plan.layers)}
        self.ctx = create_transfer_context(self.kv, mode="lmcache_driven", instance_id=INSTANCE_ID,
                                           req_client=self.rpc)
        groups = [EngineGroupInfo(engine_group_id=0, layer_indices=tuple(range(plan.layers)),
                                  tokens_per_block=plan.page_tokens)]
        # Registration re-points each layer tensor at a POSIX shared-memory segment the server maps.
        self.ctx.register(self.kv, MODEL, 1, plan.pages_per_chunk, plan.timeout_s,
                          layout_hints={"kv_layout": "NHD"}, engine_group_infos=groups,
                          engine_type=EngineType.VLLM)

    # -- pages -------------------------------------------------------------------------------------
    def _first_page(self, r: int, *, dst: bool) -> int:
        slot = self.plan.requests if r == WARM_UP else r % self.plan.requests
        return 1 + ((self.plan.requests + 1 if dst else 0) + slot) * self.plan.pages_per_request

    def pages(self, r: int, *, dst: bool) -> list[int]:
        first = self._first_page(r, dst=dst)
        return list(range(first, first + self.plan.pages_per_request))

    def _span(self, t: torch.Tensor, r: int, *, dst: bool) -> torch.Tensor:
        first = self._first_page(r, dst=dst)
        return t[:, first:first + self.plan.pages_per_request]

    def fill_sources(self) -> None:
        p = self.plan
        shape = (p.layers, 2, p.chunk_tokens, p.kv_heads, p.head_dim)
        for r in [*range(p.requests), WARM_UP]:
            for c in range(p.chunks_per_request):
                data = chunk_payload(p.seed, r, c, shape)
                first = self._first_page(r, dst=False) + c * p.pages_per_chunk
                for layer in range(p.layers):
                    # [2, chunk_tokens, H, D] -> [2, pages, page_tokens, H, D]: token order is kept.
                    view = data[layer].reshape(2, p.pages_per_chunk, p.page_tokens, p.kv_heads, p.head_dim)
                    self.kv[f"layer.{layer}"][:, first:first + p.pages_per_chunk].copy_(view)

    def zero_destination(self, r: int) -> None:
        for t in self.kv.values():
            self._span(t, r, dst=True).zero_()

    def destination_matches(self, r: int) -> bool:
        return all(same_bytes(self._span(t, r, dst=False), self._span(t, r, dst=True)) for t in self.kv.values())

    # -- calls -------------------------------------------------------------------------------------
    def request_id(self, r: int) -> str:
        return f"peer-{self.plan.seed}-{r}"

    def _key(self, r: int, *, worker: int | None) -> Any:
        from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey

        toks = tuple(request_tokens(self.plan.seed, r, self.plan.request_tokens))
        return IPCCacheServerKey(model_name=MODEL, world_size=1, worker_id=worker, token_ids=toks, start=0,
                                 end=len(toks), request_id=self.request_id(r), num_kv_readers=1)

    def store(self, r: int) -> None:
        """Store request ``r`` from its source pages (a filler ``r`` >= FILLER reuses the pages of
        request ``r % requests`` under its own token ids)."""
        event = self.ctx.create_recorded_event()
        fut = self.ctx.submit_store(self.request_id(r), self._key(r, worker=0), self.kv,
                                    [self.pages(r, dst=False)], event, self.plan.pages_per_chunk)
        if not fut.result(timeout=self.plan.timeout_s):
            raise DriverError(f"STORE of request {r} failed")

    def wait_visible(self, r: int) -> float:
        """Seconds until a LOOKUP finds every chunk of request ``r`` (polled; DriverError after the timeout)."""
        t0 = time.perf_counter()
        while True:
            hits = self.lookup(r)
            self.release(r, hits)
            if hits == self.plan.chunks_per_request:
                return time.perf_counter() - t0
            if time.perf_counter() - t0 > self.plan.timeout_s:
                raise DriverError(f"request {r} was stored but a lookup finds {hits} of its chunks")
            time.sleep(0.001)

    def set_up(self) -> None:
        """The client's first call, untimed: a lookup of a key nobody stored."""
        if self.lookup(WARM_UP + 1) != 0:
            raise DriverError("a fresh server found a request nobody stored")
        self.release(WARM_UP + 1, 0)

    def fill_and_clear(self) -> None:
        """Write L1's capacity once with filler stores, then empty it (its pages stay touched)."""
        import urllib.request

        request_bytes = self.plan.request_tokens * self.plan.layers * 2 * self.plan.kv_heads * self.plan.head_dim * 2
        for k in range(-(-self.plan.l1_bytes // request_bytes)):
            self.store(FILLER + k)
            self.rpc.end_session(self.request_id(FILLER + k)).result(timeout=self.plan.timeout_s)
        req = urllib.request.Request(self.plan.http_url + "/cache/clear", data=b'{"force": true}',
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=self.plan.timeout_s) as resp:
            if resp.status != 200:
                raise DriverError(f"POST /cache/clear answered {resp.status}")

    def lookup(self, r: int) -> int:
        """LOOKUP and wait for its prefetch (L2 -> L1); the chunks found, now read-locked."""
        key = self._key(r, worker=None)
        self.rpc.lookup(key, 1).result(timeout=self.plan.timeout_s)
        hits = self.rpc.wait_prefetch_status(key.request_id, self.plan.timeout_s).result(
            timeout=self.plan.timeout_s + 5)
        if hits is None:
            raise DriverError(f"the prefetch of request {r} did not finish in {self.plan.timeout_s:g}s")
        return int(hits)

    def retrieve_into_destination(self, r: int) -> None:
        event = self.ctx.create_recorded_event()
        fut = self.ctx.submit_retrieve(self.request_id(r), self._key(r, worker=0), self.kv, [self.pages(r, dst=True)],
                                       event, self.plan.pages_per_chunk, skip_first_n_tokens=0)
        if not fut.result(timeout=self.plan.timeout_s):
            raise DriverError(f"RETRIEVE of request {r} failed")

    def release(self, r: int, hits: int) -> None:
        """Drop the lookup's read locks when no RETRIEVE consumed them, then end the session."""
        if hits > 0:
            key = replace(self._key(r, worker=None), end=hits * self.plan.chunk_tokens)
            self.rpc.free_lookup_locks(key, 1).result(timeout=self.plan.timeout_s)
        self.rpc.end_session(self.request_id(r)).result(timeout=self.plan.timeout_s)

    def close(self) -> None:
        # Unregister first so the server drops its mapping of our pages, then release ours.
        fut = self.ctx.unregister()
        if fut is not None:
            fut.result(timeout=self.plan.timeout_s)
        self.ctx.close()
        self.kv.clear()
        self.rpc.close()
        self.zmq.term()


def _retrieve(client: Client, r: int) -> dict[str, Any]:
    """One timed retrieve: LOOKUP + prefetch wait + RETRIEVE; a partial hit is reported, not timed."""
    client.zero_destination(r)
    t0 = time.perf_counter()
    hits = client.lookup(r)
    if hits != client.plan.chunks_per_request:
        client.release(r, hits)
        return {"request": r, "seconds": None, "hit_chunks": hits, "verified": False}
    client.retrieve_into_destination(r)
    seconds = time.perf_counter() - t0
    client.rpc.end_session(client.request_id(r)).result(timeout=client.plan.timeout_s)
    return {"request": r, "seconds": seconds, "hit_chunks": hits, "verified": client.destination_matches(r)}


def run(plan: Plan) -> dict[str, Any]:
    out: dict[str, Any] = {"store": [], "retrieve": []}
    client = Client(plan)
    try:
        client.fill_sources()
        client.set_up()
        for op in plan.ops:
            if op == "warmup":
                client.store(WARM_UP)
                client.wait_visible(WARM_UP)
                got = _retrieve(client, WARM_UP)
                if not got["verified"]:
                    raise DriverError(f"the warm-up request did not come back intact: {got}")
            elif op == "fill":
                client.fill_and_clear()
            elif op == "store":
                for r in range(plan.requests):
                    t0 = time.perf_counter()
                    client.store(r)
                    out["store"].append({"request": r, "seconds": time.perf_counter() - t0})
                # Untimed: a STORE resolves shortly before a LOOKUP finds what it stored.
                out["store_visible_s"] = client.wait_visible(plan.requests - 1)
            elif op == "read_pass":
                for r in range(plan.requests):
                    _retrieve(client, r)
            elif op == "retrieve":
                out["retrieve"] += [_retrieve(client, r) for r in range(plan.requests)]
            else:
                raise DriverError(f"unknown op {op!r}: warmup, fill, store, read_pass or retrieve")
    finally:
        client.close()
    return out


def main() -> int:
    """One session per JSON line on stdin (each against its own, freshly started server), one
    result line on stdout per session; exits at the end of stdin. The process lives across
    sessions as an engine's worker does, so each session pays no interpreter or import start-up."""
    for line in sys.stdin:
        if not line.strip():
            continue
        raw = json.loads(line)
        result = run(Plan(**{**raw, "ops": tuple(raw["ops"])}))
        sys.stdout.write(json.dumps(result) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
