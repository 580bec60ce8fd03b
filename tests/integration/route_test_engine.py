"""A TEST ENGINE for the router's fast tests: an OpenAI-shaped HTTP server, not vLLM, not a model.

It stands in for an engine's HTTP surface only, so that the router's routing, retries, streaming
and faults can be tested in seconds on real sockets and real processes (it can be killed and
frozen): ``/health``, ``/metrics`` (vLLM's ``vllm:num_requests_running`` and
``vllm:num_requests_waiting`` gauges, through prometheus-client), ``/v1/models``,
``/v1/completions`` and ``/v1/chat/completions`` (streamed or not). Claims about vLLM itself are
tested against real ``vllm serve`` (tests/engines/vllm_engine/test_router_vllm.py).

Its answer is a function of the prompt's token ids alone (``OUTPUT_TOKENS`` ids drawn from their
SHA-256), so every engine answers a prompt with the same bytes apart from ``engine``; it also
reports the prompt's token ids as it tokenized them and a digest of the ``cache_salt`` it
received. One prefill at a time: ``--prefill-ms`` per request behind a lock (requests queued
behind it are ``waiting``), then ``--token-ms`` per streamed token.

Run: ``python -m tests.integration.route_test_engine --name a --ready-file PATH [--tokenizer DIR]``.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Gauge, generate_latest

OUTPUT_TOKENS = 8
VOCAB = 4096


def output_ids(prompt: list[int]) -> list[int]:
    digest = hashlib.sha256(json.dumps(prompt).encode()).digest()
    return [int.from_bytes(digest[2 * i : 2 * i + 2], "big") % VOCAB for i in range(OUTPUT_TOKENS)]


def salt_digest(salt: str | None) -> str | None:
    return None if salt is None else hashlib.sha256(salt.encode()).hexdigest()[:16]


class TestEngine:
    __test__ = False  # not a pytest class

    def __init__(self, name: str, prefill_s: float, token_s: float, tokenizer_dir: str | None) -> None:
        self.name = name
        self.prefill_s = prefill_s
        self.health_s = 0.0
        self.token_s = token_s
        # Added to a prefill when the engine finished nothing in the last second (a vLLM engine
        # stops busy-polling a second after its last message and sleeps until the next).
        self.wake_s = 0.0
        self.last_end: float | None = None
        # Its own tokenization, not the router's code nor transformers': the tokenizer file read by
        # the tokenizers library and the chat template rendered by jinja2, as a model directory has them.
        self.tok = None
        self.template = None
        if tokenizer_dir:
            import jinja2
            from tokenizers import Tokenizer

            self.tok = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
            cfg = json.loads((Path(tokenizer_dir) / "tokenizer_config.json").read_text())
            if "chat_template" in cfg:
                self.template = jinja2.Environment().from_string(cfg["chat_template"])
        self.registry = CollectorRegistry()
        self.running = Gauge("vllm:num_requests_running", "running", ["model_name"], registry=self.registry)
        self.waiting = Gauge("vllm:num_requests_waiting", "waiting", ["model_name"], registry=self.registry)
        self.lock = asyncio.Lock()
        self.served: list[dict[str, Any]] = []

    def prompt_ids(self, kind: str, body: dict[str, Any]) -> list[int]:
        if kind == "completions":
            p = body["prompt"]
            if isinstance(p, list):
                return p if all(isinstance(t, int) for t in p) else [t for x in p for t in self.prompt_ids(
                    kind, {"prompt": x})]  # a batch: all its prompts' ids, for the record
            assert self.tok is not None
            return self.tok.encode(p, add_special_tokens=body.get("add_special_tokens", True)).ids
        assert self.tok is not None and self.template is not None
        text = self.template.render(messages=body["messages"],
                                    add_generation_prompt=body.get("add_generation_prompt", True))
        return self.tok.encode(text, add_special_tokens=body.get("add_special_tokens", False)).ids

    async def completion(self, request: web.Request) -> web.StreamResponse:
        kind = "chat" if request.path.endswith("/chat/completions") else "completions"
        body = await request.json()
        if body.get("prompt") == "bad" or body.get("messages") == "bad":
            return web.json_response({"error": {"message": "bad prompt", "type": "BadRequestError", "code": 400}},
                                     status=400)
        ids = self.prompt_ids(kind, body)
        out = output_ids(ids)
        m = self.waiting.labels("m")
        m.inc()
        try:
            async with self.lock:
                m.dec()
                self.running.labels("m").inc()
                now = asyncio.get_running_loop().time()
                if self.wake_s and (self.last_end is None or now - self.last_end >= 1.0):
                    await asyncio.sleep(self.wake_s)
                await asyncio.sleep(self.prefill_s)
        except BaseException:
            m.dec()
            raise
        try:
            self.served.append({"kind": kind, "tokens": len(ids), "salt": salt_digest(body.get("cache_salt"))})
            extra = {"engine": self.name, "prompt_token_ids": ids, "salt_digest": salt_digest(body.get("cache_salt"))}
            if body.get("stream") is True:
                resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await resp.prepare(request)
                for i, t in enumerate(out):
                    piece = {"text": f" t{t}"} if kind == "completions" else {"delta": {"content": f" t{t}"}}
                    finish = None if i + 1 < len(out) else "length"
                    chunk = {"id": "x", "object": "chunk", "model": "m",
                             "choices": [{"index": 0, **piece, "finish_reason": finish}]}
                    if i == 0:
                        chunk["kvtier_test_engine"] = extra
                    await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                    await asyncio.sleep(self.token_s)
                await resp.write(b"data: [DONE]\n\n")
                await resp.write_eof()
                return resp
            text = "".join(f" t{t}" for t in out)
            choice = {"index": 0, "text": text} if kind == "completions" else {
                "index": 0, "message": {"role": "assistant", "content": text}}
            return web.json_response({"id": "x", "object": kind, "model": "m", "choices": [choice],
                                      "usage": {"prompt_tokens": len(ids)}, "kvtier_test_engine": extra})
        finally:
            self.running.labels("m").dec()
            self.last_end = asyncio.get_running_loop().time()

    async def health(self, request: web.Request) -> web.Response:
        await asyncio.sleep(self.health_s)  # a busy engine answers its polls late
        return web.Response(text="")

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.registry), content_type="text/plain")

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m", "object": "model"}]})

    async def served_list(self, request: web.Request) -> web.Response:
        return web.json_response(self.served)

    async def set_prefill(self, request: web.Request) -> web.Response:
        """The test's knob: this engine's prefill time (and time per streamed token, how late it
        answers /health, and how much longer a prefill takes after a second idle) from now on."""
        body = await request.json()
        self.prefill_s = float(body["ms"]) / 1e3
        self.token_s = float(body.get("token_ms", 0)) / 1e3
        self.health_s = float(body.get("health_ms", 0)) / 1e3
        self.wake_s = float(body.get("wake_ms", 0)) / 1e3
        return web.json_response({"prefill_ms": self.prefill_s * 1e3})


async def main(args: argparse.Namespace) -> None:
    engine = TestEngine(args.name, args.prefill_ms / 1e3, args.token_ms / 1e3, args.tokenizer)
    app = web.Application()
    app.router.add_post("/v1/completions", engine.completion)
    app.router.add_post("/v1/chat/completions", engine.completion)
    app.router.add_get("/health", engine.health)
    app.router.add_get("/metrics", engine.metrics)
    app.router.add_get("/v1/models", engine.models)
    app.router.add_get("/test/served", engine.served_list)
    app.router.add_post("/test/prefill", engine.set_prefill)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", args.port)
    await site.start()
    port = runner.addresses[0][1]
    ready = Path(args.ready_file)
    tmp = ready.with_suffix(".tmp")
    tmp.write_text(json.dumps({"url": f"http://127.0.0.1:{port}", "pid": os.getpid(), "started": time.time()}))
    os.replace(tmp, ready)
    await asyncio.Event().wait()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--name", required=True)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--ready-file", required=True)
    p.add_argument("--tokenizer")
    p.add_argument("--prefill-ms", type=float, default=0.0)
    p.add_argument("--token-ms", type=float, default=0.0)
    asyncio.run(main(p.parse_args()))
