"""`kvtier bench daemon`: load test of the gRPC daemon with byte-for-byte verification.

Processes: the daemon (``kvtier serve``, its own process), a raw gRPC byte-streaming server (its
own process), and client worker processes (so no two of them share a GIL). Phases:

1. populate: one worker stores the shared chains (public scope, deterministic payloads).
2. mix: N client threads spread over the workers run, for S seconds, a mix of lookups (the whole
   chain must be found), prefix gets (every byte compared with the expected payload) and puts
   (each client re-saves its own chains: stored or present, never rejected). Reports ops/s and
   p50/p99 latency per op, errors (any failed call) and mismatches (wrong bytes or a lookup
   that lost a stored chain). Both must be 0.
3. get throughput: the same client threads stream prefix gets from the daemon, then the same
   number of bytes per request from the raw server (same chunk size, same message limits, same
   loopback), alternating twice; reports GB/s of each and the ratio (target >= 0.6).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from benchmarks.common import progress, table, wait_ready_file, write_json
from kvtier.errors import ConfigError, KvtierError

ROOT = Path(__file__).resolve().parents[1]
RAW_METHOD = "/kvtier.bench.RawBytes/Stream"
#: Client threads per worker process at most; more workers when more clients.
THREADS_PER_WORKER = 8


@dataclass(slots=True, frozen=True)
class Plan:
    """What every process needs to know, picklable."""

    # layout (a Llama-3.2-1B-like model: 16 layers, 8 KV heads x 64, bf16)
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_tokens: int
    chain_blocks: int
    shared_chains: int
    own_chains: int
    chunk_bytes: int
    mix: tuple[tuple[str, float], ...]
    server_secret: bytes
    address: str = ""
    raw_address: str = ""
    token: str = ""
    #: The clients' payload path (GrpcTierConfig.data_plane).
    data_plane: str = "tcp"

    def layout(self) -> Any:
        from kvtier.layout import KVLayout

        return KVLayout("bench-llama-3.2-1b", num_layers=self.num_layers, num_kv_heads=self.num_kv_heads,
                        head_dim=self.head_dim, dtype="bfloat16", block_tokens=self.block_tokens)

    @property
    def block_bytes(self) -> int:
        return self.num_layers * 2 * self.block_tokens * self.num_kv_heads * self.head_dim * 2


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--clients", type=int, default=32, help="concurrent client threads (default 32)")
    p.add_argument("--seconds", type=float, default=60.0, help="length of the mixed phase (default 60)")
    p.add_argument("--json", metavar="PATH", help="write results as JSON to PATH")
    p.add_argument("--quick", action="store_true", help="4 clients x 3 s with small blocks (a smoke run)")
    p.add_argument("--workers", type=int, help="client processes (default: clients / 8, at least 2)")
    p.add_argument("--block-tokens", type=int, default=16, help="tokens per block (16: 512 KiB blocks)")
    p.add_argument("--chunk-kib", type=int, default=1024, help="payload bytes per streamed message (KiB)")
    p.add_argument("--throughput-seconds", type=float, help="length of each get-throughput round")
    p.add_argument("--mix", default="lookup=0.4,get=0.4,put=0.2", help="operation mix (weights)")
    p.add_argument("--data-plane", choices=("tcp", "shm", "auto"), default="tcp",
                   help="the clients' payload path (default tcp: the baseline is a raw gRPC byte stream, so "
                        "the daemon is measured inline too; shm measures the shared-memory data plane against it)")


def _mix(text: str) -> tuple[tuple[str, float], ...]:
    out = []
    for part in text.split(","):
        name, sep, w = part.partition("=")
        if not sep or name.strip() not in ("lookup", "get", "put"):
            raise ConfigError(f"--mix: expected lookup=W,get=W,put=W, got {text!r}")
        try:
            out.append((name.strip(), float(w)))
        except ValueError:
            raise ConfigError(f"--mix: weight of {name!r} is not a number") from None
    if not out or sum(w for _, w in out) <= 0:
        raise ConfigError("--mix: weights must add up to more than 0")
    return tuple(out)


# -- payloads (identical in every process) --------------------------------------------------------
class Payloads:
    """Deterministic chains: chain ``c`` has ``chain_blocks`` blocks whose bytes depend only on ``c``.

    Chains 0..shared-1 are shared by everyone; chains 1000 + 16 * client + i are one client's own.
    Expected payloads are generated once per process and kept for comparison.
    """

    def __init__(self, plan: Plan) -> None:
        from kvtier.keys import DomainDeriver

        self.plan = plan
        self.layout = plan.layout()
        self.deriver = DomainDeriver(plan.server_secret)
        self._cache: dict[int, list[Any]] = {}
        self._lock = threading.Lock()

    def chain(self, c: int) -> list[Any]:
        with self._lock:
            got = self._cache.get(c)
        if got is not None:
            return got
        import torch

        from kvtier.block import Block
        from kvtier.keys import Scope, Segment, block_chain

        lay = self.layout
        tokens = list(range(c * 4096, c * 4096 + self.plan.chain_blocks * lay.block_tokens))
        gen = torch.Generator().manual_seed(c)
        blocks = [
            Block.build(lay, cb.key, cb.domain,
                        torch.randint(-(2**15), 2**15, lay.block_shape, generator=gen, dtype=torch.int16)
                        .view(lay.torch_dtype), parent=cb.parent, index=cb.index)
            for cb in block_chain(lay, [Segment(tokens, Scope.public())], self.deriver)
        ]
        with self._lock:
            self._cache[c] = blocks
        return blocks


def _own_chain(client: int, i: int) -> int:
    return 1_000 + 16 * client + i


# -- worker side ----------------------------------------------------------------------------------
@dataclass(slots=True)
class ClientResult:
    ops: dict[str, int]
    latencies: dict[str, list[float]]
    errors: int
    mismatches: int
    error_samples: list[str]


def _tier(plan: Plan) -> Any:
    from storage_backends.grpc import GrpcTier, GrpcTierConfig

    return GrpcTier(GrpcTierConfig(plan.address, plan.token, chunk_bytes=plan.chunk_bytes,
                                   max_message_bytes=max(64 << 20, 2 * plan.chunk_bytes), timeout_s=60,
                                   data_plane=plan.data_plane))


def _same(a: Any, b: Any) -> bool:
    return a.equal_bytes(b)


def _one_client(plan: Plan, payloads: Payloads, client: int, seconds: float, seed: int) -> ClientResult:
    rng = random.Random(seed)
    tier = _tier(plan)
    names = [n for n, _ in plan.mix]
    weights = [w for _, w in plan.mix]
    res = ClientResult({n: 0 for n in names}, {n: [] for n in names}, 0, 0, [])
    own = [_own_chain(client, i) for i in range(plan.own_chains)]
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            op = rng.choices(names, weights)[0]
            c = rng.randrange(plan.shared_chains)
            t0 = time.perf_counter()
            try:
                if op == "lookup":
                    blocks = payloads.chain(c)
                    t0 = time.perf_counter()
                    n = tier.contains([b.key for b in blocks])
                    if n != len(blocks):
                        res.mismatches += 1
                        res.error_samples.append(f"lookup of stored chain {c}: {n}/{len(blocks)}")
                elif op == "get":
                    blocks = payloads.chain(c)
                    t0 = time.perf_counter()
                    got = tier.get_prefix([b.key for b in blocks])
                    dt = time.perf_counter() - t0
                    if len(got) != len(blocks) or not all(_same(g, b) for g, b in zip(got, blocks, strict=True)):
                        res.mismatches += 1
                        res.error_samples.append(f"get of chain {c}: {len(got)} blocks, bytes differ or missing")
                    res.ops[op] += 1
                    res.latencies[op].append(dt)
                    continue
                else:
                    blocks = payloads.chain(rng.choice(own))
                    t0 = time.perf_counter()
                    r = tier.put(blocks)
                    if r.rejected or len(r.stored) + len(r.present) != len(blocks):
                        res.errors += 1
                        res.error_samples.append(f"put rejected {len(r.rejected)} blocks")
            except KvtierError as exc:
                res.errors += 1
                res.error_samples.append(f"{op}: {type(exc).__name__}: {exc}")
                continue
            res.latencies[op].append(time.perf_counter() - t0)
            res.ops[op] += 1
        # A degraded call (daemon unreachable or overloaded) is a miss, not an exception: count it.
        degraded = sum(tier.metrics.snapshot()["errors"].values())
        if degraded:
            res.errors += degraded
            res.error_samples.append(f"{degraded} degraded calls: {tier.metrics.snapshot()['errors']}")
    finally:
        tier.close()
    res.error_samples = res.error_samples[:5]
    return res


def _worker_setup() -> None:
    """Client processes run many threads: torch's own intra-op threads would only contend."""
    import torch

    torch.set_num_threads(1)


def worker_mix(plan: Plan, clients: list[int], seconds: float, start_at: float) -> list[ClientResult]:
    """Run ``clients`` as threads in this process, all starting at ``start_at`` (wall clock)."""
    payloads = Payloads(plan)
    for c in range(plan.shared_chains):  # expected bytes ready before the clock starts
        payloads.chain(c)
    for client in clients:
        for i in range(plan.own_chains):
            payloads.chain(_own_chain(client, i))
    out: list[ClientResult | None] = [None] * len(clients)

    def run(i: int, client: int) -> None:
        out[i] = _one_client(plan, payloads, client, seconds, seed=client)

    time.sleep(max(0.0, start_at - time.time()))
    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [r for r in out if r is not None]


def worker_populate(plan: Plan) -> int:
    payloads = Payloads(plan)
    tier = _tier(plan)
    try:
        n = 0
        for c in range(plan.shared_chains):
            r = tier.put(payloads.chain(c))
            if r.rejected:
                raise KvtierError(f"populate: the daemon rejected {len(r.rejected)} blocks (memory tier too small?)")
            n += len(r.stored) + len(r.present)
        return n
    finally:
        tier.close()


def worker_throughput(plan: Plan, threads: int, seconds: float, target: str, start_at: float) -> tuple[int, float]:
    """Prefix gets of whole shared chains (``daemon``) or the same bytes per request (``raw``)."""
    import grpc

    request = f"{plan.chain_blocks},{plan.block_bytes}".encode()
    payloads = Payloads(plan)
    keys = [[b.key for b in payloads.chain(c)] for c in range(plan.shared_chains)]
    total = [0] * threads

    def run_daemon(i: int) -> None:
        tier = _tier(plan)
        rng = random.Random(i)
        end = time.monotonic() + seconds
        try:
            while time.monotonic() < end:
                got = tier.get_prefix(keys[rng.randrange(len(keys))])
                total[i] += sum(b.nbytes for b in got)
        finally:
            tier.close()

    def run_raw(i: int) -> None:
        ch = grpc.insecure_channel(plan.raw_address, options=_channel_options(plan))
        call = ch.unary_stream(RAW_METHOD)
        end = time.monotonic() + seconds
        try:
            while time.monotonic() < end:
                for msg in call(request, timeout=60):
                    total[i] += len(msg)
        finally:
            ch.close()

    fn = run_daemon if target == "daemon" else run_raw
    time.sleep(max(0.0, start_at - time.time()))
    t0 = time.perf_counter()
    ts = [threading.Thread(target=fn, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return sum(total), time.perf_counter() - t0


def _channel_options(plan: Plan) -> list[tuple[str, int]]:
    limit = max(64 << 20, 2 * plan.chunk_bytes)
    return [("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit)]


# -- the raw baseline server ----------------------------------------------------------------------
def raw_server_main(port_file: str, chunk_bytes: int, max_message_bytes: int) -> None:
    """A trivial gRPC server: each request names a chain (blocks x block bytes); it streams that many
    random bytes cut into messages exactly as the daemon cuts a chain (at most ``chunk_bytes``,
    never across blocks). Messages are prebuilt, so what is measured is gRPC's own cost."""
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    payload = os.urandom(chunk_bytes)

    pieces: dict[int, bytes] = {chunk_bytes: payload}

    def stream(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        # "<blocks>,<block bytes>": the messages the daemon sends for such a chain, same sizes.
        blocks, block_bytes = (int(x) for x in request.split(b","))
        for _ in range(blocks):
            n = block_bytes
            while n > 0:
                m = min(n, chunk_bytes)
                piece = pieces.get(m)
                if piece is None:
                    piece = pieces[m] = payload[:m]
                yield piece
                n -= m

    server = grpc.server(ThreadPoolExecutor(max_workers=64), options=[
        ("grpc.max_send_message_length", max_message_bytes), ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.so_reuseport", 0)])
    handler = grpc.method_handlers_generic_handler("kvtier.bench.RawBytes", {
        "Stream": grpc.unary_stream_rpc_method_handler(stream)})
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    Path(port_file).write_text(str(port))
    server.wait_for_termination()


# -- orchestration --------------------------------------------------------------------------------

def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run(args: argparse.Namespace) -> int:
    from benchmarks.localdeploy import LocalDeployment

    quick = args.quick
    clients = 4 if quick else args.clients
    seconds = 3.0 if quick else args.seconds
    if clients < 1 or seconds <= 0:
        raise ConfigError("--clients and --seconds must be positive")
    block_tokens = 4 if quick else args.block_tokens
    plan = Plan(num_layers=16, num_kv_heads=8, head_dim=64, block_tokens=block_tokens, chain_blocks=8,
                shared_chains=4 if quick else 16, own_chains=2, chunk_bytes=args.chunk_kib << 10,
                mix=_mix(args.mix), server_secret=os.urandom(32).hex().encode(), data_plane=args.data_plane)
    workers = args.workers or max(2, min(8, -(-clients // THREADS_PER_WORKER)))
    tput_s = args.throughput_seconds or (1.0 if quick else max(3.0, min(10.0, seconds / 6)))
    data_bytes = (plan.shared_chains + clients * plan.own_chains) * plan.chain_blocks * plan.block_bytes
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-daemon-") as tmp:
        dep = LocalDeployment(Path(tmp) / "daemon", server_secret=plan.server_secret)
        dep.write_config(memory_bytes=2 * data_bytes + (64 << 20), server={
            "chunk_bytes": plan.chunk_bytes, "max_message_bytes": max(64 << 20, 2 * plan.chunk_bytes),
            # Every client is one load generator's principal: it may use the whole call limit.
            "max_concurrent_rpcs": max(64, 4 * clients), "max_concurrent_rpcs_per_tenant": max(64, 4 * clients),
            "max_concurrent_rpcs_per_principal": max(64, 4 * clients), "log_level": "warning"},
            # The load generator publishes the shared chains (the default trusts operators only).
            security={"public_publishers": "bench/loadgen"})
        procs: list[subprocess.Popen[bytes]] = []
        try:
            progress(f"starting the daemon and the raw gRPC server ({plan.block_bytes >> 10} KiB blocks, "
                     f"{plan.chunk_bytes >> 10} KiB chunks)")
            ready = Path(tmp) / "ready.json"
            procs.append(subprocess.Popen([sys.executable, "-m", "kvtier.cli", "serve", "--config",
                                           str(dep.config_file), "--ready-file", str(ready)], cwd=ROOT))
            raw_port = Path(tmp) / "raw.port"
            procs.append(subprocess.Popen([sys.executable, "-c",
                                           "import sys; from benchmarks.daemon import raw_server_main; "
                                           "raw_server_main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))",
                                           str(raw_port), str(plan.chunk_bytes),
                                           str(max(64 << 20, 2 * plan.chunk_bytes))], cwd=ROOT))
            address = json.loads(wait_ready_file(ready, procs[0], "daemon"))["address"]
            raw_address = f"127.0.0.1:{wait_ready_file(raw_port, procs[1], 'raw server')}"
            plan = Plan(**{**asdict(plan), "address": address, "raw_address": raw_address,
                           "token": dep.token("bench", "loadgen", roles=("publish:public",), ttl_s=3600 + seconds)})
            result = _measure(plan, clients, seconds, workers, tput_s)
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
    result["command"] = ("kvtier bench daemon --quick" if quick else
                         f"kvtier bench daemon --clients {clients} --seconds {seconds:g}")
    _report(result)
    write_json(args.json, result)
    return 0 if result["errors"] == 0 and result["mismatches"] == 0 else 1


def _measure(plan: Plan, clients: int, seconds: float, workers: int, tput_s: float) -> dict[str, Any]:
    ctx = get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_worker_setup) as pool:
        progress(f"populating {plan.shared_chains} shared chains")
        stored = pool.submit(worker_populate, plan).result()
        groups = [list(range(clients))[i::workers] for i in range(workers)]
        groups = [g for g in groups if g]
        progress(f"mixed phase: {clients} clients in {len(groups)} processes for {seconds:g}s")
        start_at = time.time() + 3.0 + 0.01 * clients  # every worker has its payloads ready by then
        futs = [pool.submit(worker_mix, plan, g, seconds, start_at) for g in groups]
        per_client = [r for f in futs for r in f.result()]
        tput_threads = max(1, clients // len(groups))
        progress(f"get throughput: {len(groups)} x {tput_threads} streams, daemon vs raw gRPC, "
                 f"{tput_s:g}s per round, 2 rounds")
        rounds: dict[str, list[tuple[int, float]]] = {"daemon": [], "raw": []}
        for _ in range(2):
            for target in ("daemon", "raw"):
                at = time.time() + 1.0
                fs = [pool.submit(worker_throughput, plan, tput_threads, tput_s, target, at) for _ in groups]
                outs = [f.result() for f in fs]
                rounds[target].append((sum(b for b, _ in outs), max(t for _, t in outs)))
    ops: dict[str, int] = {}
    lat: dict[str, list[float]] = {}
    for r in per_client:
        for k, v in r.ops.items():
            ops[k] = ops.get(k, 0) + v
        for k, v in r.latencies.items():
            lat.setdefault(k, []).extend(v)
    rows = []
    for name in ops:
        rows.append({"op": name, "ops": ops[name], "ops_per_s": round(ops[name] / seconds, 1),
                     "p50_ms": _ms(_pct(lat[name], 0.50)), "p99_ms": _ms(_pct(lat[name], 0.99))})
    gbps = {k: statistics.median(b / t / 1e9 for b, t in v) for k, v in rounds.items()}
    return {
        "benchmark": "daemon",
        "clients": clients,
        "seconds": seconds,
        "client_processes": len(groups),
        "block_bytes": plan.block_bytes,
        "chain_blocks": plan.chain_blocks,
        "chunk_bytes": plan.chunk_bytes,
        "data_plane": plan.data_plane,
        "mix": dict(plan.mix),
        "populated_blocks": stored,
        "ops": rows,
        "total_ops_per_s": round(sum(ops.values()) / seconds, 1),
        "errors": sum(r.errors for r in per_client),
        "mismatches": sum(r.mismatches for r in per_client),
        "error_samples": [s for r in per_client for s in r.error_samples][:10],
        "get_gbps": round(gbps["daemon"], 3),
        "raw_grpc_gbps": round(gbps["raw"], 3),
        "get_vs_raw": round(gbps["daemon"] / gbps["raw"], 3) if gbps["raw"] else None,
        "throughput_rounds": {k: [round(b / t / 1e9, 3) for b, t in v] for k, v in rounds.items()},
        "machine": {"cpus": os.cpu_count(), "load_avg_1m": os.getloadavg()[0]},
        "time": time.time(),
    }


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1e3, 2)


def _report(r: dict[str, Any]) -> None:
    print(f"kvtier daemon load test: {r['clients']} clients x {r['seconds']:g}s, "
          f"{r['block_bytes'] >> 10} KiB blocks x {r['chain_blocks']} per chain, "
          f"{r['chunk_bytes'] >> 10} KiB chunks, {r['client_processes']} client processes")
    print(table(r["ops"], [("op", "op", ""), ("ops", "ops", "d"), ("ops_per_s", "ops/s", ".1f"),
                           ("p50_ms", "p50 ms", ".2f"), ("p99_ms", "p99 ms", ".2f")]))
    print(f"total {r['total_ops_per_s']:.1f} ops/s   errors {r['errors']}   mismatches {r['mismatches']}")
    print(f"get throughput {r['get_gbps']:.3f} GB/s vs raw gRPC {r['raw_grpc_gbps']:.3f} GB/s "
          f"= {r['get_vs_raw']}x (target >= 0.6)")
    for s in r["error_samples"]:
        print(f"  error: {s}")
