"""`kvtier bench peer --lmcache`: kvtier's daemon side by side with LMCache 0.5.6's MP server.

Workload (both sides, identical bytes and token ids, ``benchmarks/peer_payload.py``): 32 layers x
8 KV heads x 128, fp16; requests of 2,048 tokens (256 MiB of KV), in chunks/blocks of 256 tokens
(32 MiB). ``--quick``: 3 rounds of 3 requests of 512 tokens (64 MiB). Cases (``peer_cases.py``):

* store, warm retrieve (RAM): a server with a 2 GiB RAM tier (LMCache: L1), no disk; kvtier in
  two layouts: its blocks as contiguous tensors, and (``_paged``) vLLM-style pages of 16 tokens,
  moved as the vLLM connector moves an engine's pages. LMCache always moves its client's pages (16
  tokens, vLLM's NHD layout), so its figures stand beside both;
* disk_store: the same RAM with the encrypted disk behind it; each request stored once;
* disk_cold, disk_page_cache: requests put on the encrypted disk by one server are read by a
  freshly started one, first with the data files dropped from the page cache
  (``posix_fadvise(DONTNEED)`` on kvtier's ``data.mdb`` and on LMCache's L2 files, checked with
  ``mincore``), then again by another fresh server with the page cache warm.

Preparation, the same for both (``peer_cases.py``; the JSON's ``untimed`` says what each side got in
its own terms): the client's set-up, one warm-up request stored and read back, ``--warmup-passes``
untimed read passes before the timed warm retrieve. The RAM phase runs once per first-touch state
(``--first-touch``, both by default): ``prefaulted`` (every page of the RAM tier / L1 touched before
timing) and ``cold`` (as a freshly started server has it); the disk phases start both cold.

Rules: every phase starts fresh servers; in each round both systems run each phase back to back,
and the system that goes first alternates from phase to phase and round to round; destinations are
zeroed before every retrieve; a request counts as retrieved when its bytes are in the client's own
buffer, and every byte is compared with its source, stores included (they are read back). A round
in which a system lost or damaged a request has no GB/s for that case (``peer_report.py``).

What each side does per byte
----------------------------
kvtier (``peer_kvtier.py``; the client is ``GrpcTier``, an engine's view of the daemon). The
client and daemon negotiate the node-local shared-memory data plane (a sealed memfd region the
client maps and hands the daemon; gRPC stays the control plane); the harness uses whichever path
the client picks and reports it. Over shared memory: a store copies each block into the client's
region and hashes it (xxh3) piece by piece as it copies; the daemon copies it once out of the
region, straight into the ready-to-send frame its RAM tier keeps, hashing as it copies, and
verifies the hash. The daemon faulted its RAM tier's capacity of heap in at start-up
(``tiers.memory.prefault``), as a pool allocated at start-up would be. A warm retrieve copies
each frame's payload into the client's region (no hash: the daemon verified it on admission) and
the client copies it into the destination tensor. Inline (no shared memory), a store frames
chunk messages that the kernel copies through a loopback socket, and a retrieve sends the frame
as it is and the client verifies the xxh3. Disk: a spill or a put into LMDB encodes the record,
stating the payload's xxh3, and seals it with AES-256-GCM under the scope's data key (one pass
that reads the payload and writes ciphertext), writes it in an LMDB transaction and fsyncs
(``tiers.disk.sync``, on by default; ``--no-fsync`` turns it off to match LMCache). Spills from
the RAM tier run on a background thread; a put the RAM tier cannot hold goes to LMDB before the
Put returns. A disk read verifies the record header, decrypts and authenticates the payload (one
pass) straight into a new frame (the stated xxh3 is its checksum), which the RAM tier keeps, then
copies it into the client's region as above. (``storage_backends/lmdb.py``, ``kvtier/codec.py``
and ``kvtier/rpc/framed_block.py`` have the details.)

LMCache (``peer_lmcache.py``, ``peer_lmcache_driver.py``; the client is LMCache's own CPU worker
path, ``lmcache_driven`` transfer). The client's paged KV cache is in POSIX shared memory that the
server maps, so no KV byte crosses a socket: a store is one server-side copy from the client's
pages into L1 (token ids are hashed with blake3, no payload hashing), a warm retrieve is one copy
from L1 into the client's pages. Disk (fs L2 adapter with the aesgcm serde): in the background
after a store, each chunk is copied out of L1, encrypted with AES-256-GCM (AES-GCM's one pass,
into a new buffer that is copied into a serde buffer in L1) and written to its own file, without
fsync; a disk read loads the file into L1, copies it, decrypts (one pass) and copies the plaintext
into an L1 buffer, then copies it into the client's pages. LMCache has no payload checksum beyond
the GCM tag on disk. Stores that do not fit in L1 are skipped, and the STORE is still reported as
successful: the harness finds them when it reads them back.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import progress, write_json
from benchmarks.peer_cases import FIRST_TOUCH, CaseRun, Side, Workload
from benchmarks.peer_report import data_planes, medians, notes, ratios, render
from benchmarks.progress import Phase, Progress, advance
from kvtier.errors import ConfigError

#: Phase -> the first-touch state it runs in (the RAM phase: each one asked for).
DISK_PHASES = ("disk_store", "disk_read")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lmcache", action="store_true", help="compare with LMCache 0.5.6 (needs `make peer-venvs`)")
    p.add_argument("--quick", action="store_true", help="3 rounds of 3 requests of 512 tokens (a few minutes)")
    p.add_argument("--json", metavar="PATH", help="write results as JSON to PATH")
    p.add_argument("--only", choices=("kvtier", "lmcache"), help="run one side only (no ratios)")
    p.add_argument("--rounds", type=int, help="interleaved rounds (default 5, quick 3)")
    p.add_argument("--requests", type=int, help="requests per case per round (default 4, quick 3)")
    p.add_argument("--request-tokens", type=int, help="tokens per request (default 2048, quick 512)")
    p.add_argument("--layers", type=int, default=32, help="model layers (default 32)")
    p.add_argument("--kv-heads", type=int, default=8, help="KV heads (default 8)")
    p.add_argument("--head-dim", type=int, default=128, help="head dimension (default 128)")
    p.add_argument("--chunk-tokens", type=int, default=256, help="tokens per block / LMCache chunk (default 256)")
    p.add_argument("--memory-mib", type=float, default=2048, help="RAM tier / LMCache L1 (default 2048)")
    p.add_argument("--first-touch", choices=("both", *FIRST_TOUCH), default="both",
                   help="first-touch state of the servers' memory in the RAM phase (default both)")
    p.add_argument("--warmup-passes", type=int, default=1,
                   help="untimed read passes before the timed warm retrieve, both sides (default 1)")
    p.add_argument("--no-fsync", action="store_true",
                   help="kvtier's disk tier without fsync (tiers.disk.sync=false), as LMCache's fs L2 writes")
    p.add_argument("--workdir", metavar="DIR", help="where servers keep their disk tiers (default: a temp dir)")
    p.add_argument("--lmcache-python", metavar="PATH", help="python of the LMCache venv (default .venv-lmcache)")


def workload(args: argparse.Namespace) -> Workload:
    quick = args.quick
    mib = 1 << 20
    try:
        return Workload(layers=args.layers, kv_heads=args.kv_heads, head_dim=args.head_dim,
                        chunk_tokens=args.chunk_tokens,
                        request_tokens=args.request_tokens or (512 if quick else 2048),
                        requests=args.requests or (3 if quick else 4), rounds=args.rounds or (3 if quick else 5),
                        memory_bytes=int(args.memory_mib * mib), warmup_passes=args.warmup_passes,
                        page_tokens=min(16, args.chunk_tokens))
    except ValueError as exc:
        raise ConfigError(f"kvtier bench peer: {exc}") from None


def sides(args: argparse.Namespace, w: Workload, workdir: Path) -> list[Side]:
    if not args.lmcache and args.only != "kvtier":
        raise ConfigError("kvtier bench peer: name the peer to compare with (--lmcache)")
    out: list[Side] = []
    if args.only != "lmcache":
        from benchmarks.peer_kvtier import KvtierSide

        out.append(KvtierSide(w, workdir, disk_sync=not args.no_fsync))
    if args.only != "kvtier":
        from benchmarks.peer_lmcache import VENV_PYTHON, LmcacheSide

        python = Path(args.lmcache_python) if args.lmcache_python else VENV_PYTHON
        out.append(LmcacheSide(w, workdir, python=python))
    return out


def touches(args: argparse.Namespace) -> tuple[str, ...]:
    return tuple(FIRST_TOUCH) if args.first_touch == "both" else (args.first_touch,)


def measure(systems: list[Side], w: Workload, ram_touches: tuple[str, ...]) -> list[dict[str, Any]]:
    """Every round: each phase by every system, back to back; who goes first alternates from
    phase to phase and round to round. A round's record holds, per first-touch state, each
    system's cases (the disk phases under ``cold``)."""
    rounds = []
    steps = [("ram", t) for t in ram_touches] + [(p, "cold") for p in DISK_PHASES]
    for i in range(w.rounds):
        rec: dict[str, Any] = {"round": i, "order": {}}
        for k, (phase, touch) in enumerate(steps):
            seed = 1 + 10 * i + (k if phase == "ram" else 5 + DISK_PHASES.index(phase))  # same bytes both sides
            order = systems if (i + k) % 2 == 0 else systems[::-1]
            rec["order"][f"{phase}/{touch}"] = [s.name for s in order]
            for side in order:
                progress(f"round {i + 1}/{w.rounds}: {side.name} {phase} ({touch})")
                t0 = time.monotonic()
                runs: dict[str, CaseRun] = (side.ram(seed, touch) if phase == "ram" else getattr(side, phase)(seed))
                rec.setdefault(touch, {}).setdefault(side.name, {}).update({k2: v.as_dict() for k2, v in runs.items()})
                progress(f"  {side.name} {phase}: " + ", ".join(
                    f"{k2} {'-' if v.gbps is None else f'{v.gbps:.3f}'} GB/s" for k2, v in runs.items())
                    + f" ({time.monotonic() - t0:.0f}s)")
        rec["raw_copy_gbps"] = round(raw_copy_gbps(w), 4)
        rounds.append(rec)
        advance(f"{len(steps)} phases x {len(systems)} systems")
    return rounds


def raw_copy_gbps(w: Workload) -> float:
    """This machine's raw limit for moving a request once: one copy of its bytes between two
    preallocated, already-touched buffers (torch, as both sides' clients use), median of 5."""
    src = torch.randint(-(2**15), 2**15, (w.request_bytes // 2,), dtype=torch.int16)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return w.request_bytes / statistics.median(times) / 1e9


def run(args: argparse.Namespace) -> int:
    w = workload(args)
    ram_touches = touches(args)
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-peer-", dir=args.workdir) as tmp, ExitStack() as stack:
        prog = stack.enter_context(Progress("kvtier bench peer", peer_plan(args, w)))
        prog.phase("start-up")
        systems = sides(args, w, Path(tmp))
        for side in systems:
            stack.callback(side.close)
        progress(f"{' vs '.join(s.name for s in systems)}: {w.rounds} rounds x {w.requests} requests of "
                 f"{w.request_tokens} tokens ({w.request_bytes / (1 << 20):.0f} MiB each)")
        config = {"workload": w.as_dict(), **{s.name: s.describe() for s in systems},
                  "order": "each phase back to back per round; who goes first alternates from phase to phase "
                           "and round to round",
                  "first_touch": {t: FIRST_TOUCH[t] for t in dict.fromkeys((*ram_touches, "cold"))},
                  "machine": {"cpus": os.cpu_count(), "load_avg_1m": os.getloadavg()[0]}}
        untimed = {s.name: {t: s.untimed(t) for t in dict.fromkeys((*ram_touches, "cold"))} for s in systems}
        prog.phase("rounds")
        rounds = measure(systems, w, ram_touches)
    names = [s.name for s in systems]
    peer = "lmcache"
    variants: dict[str, Any] = {}
    for touch in dict.fromkeys((*ram_touches, "cold")):
        per_system = {name: medians(rounds, name, touch) for name in names}
        variants[touch] = {
            "ratios": (ratios(per_system["kvtier"], per_system[peer]) if len(names) == 2
                       else dict.fromkeys(per_system[names[0]])),
            "medians": per_system}
    result: dict[str, Any] = {
        "benchmark": "peer", "peer": peer, "command": _command(args), "variants": variants, "untimed": untimed,
        # One copy of a request's bytes between two touched buffers: the limit for moving it once.
        "raw_copy_gbps": round(statistics.median(r["raw_copy_gbps"] for r in rounds), 4),
        "data_planes": {name: data_planes(rounds, name) for name in names},
        "rounds": rounds, "config": config, "time": time.time(),
    }
    print(f"kvtier vs {peer}: {w.rounds} rounds x {w.requests} requests of {w.request_tokens} tokens "
          f"({w.request_bytes / (1 << 20):.0f} MiB), every byte verified; median GB/s (median ms per request)")
    print(render(result))
    print(f"  raw limit: one copy of a request's bytes {result['raw_copy_gbps']:.3f} GB/s")
    for name, planes in result["data_planes"].items():
        print(f"  {name} data plane: {'; '.join(planes) or 'unknown'}")
    for line in notes(result):
        print(f"  note: {line}")
    write_json(args.json, result)
    kvtier_lost = any(m["rounds_failed"] for v in variants.values() for m in v["medians"].get("kvtier", {}).values())
    return 1 if kvtier_lost else 0


def peer_plan(args: argparse.Namespace, w: Workload) -> list[Phase]:
    """The phases and rough expected times (the display's estimates until the first round is done,
    then the rounds measured take over): each side's start-up, then every round's phases on both
    sides. A --quick round of kvtier alone took 5:25 at load average 10 on the 2-core development
    machine; these assume an idle one."""
    both = args.only is None
    return [Phase("start-up", 30 if both else 5), Phase("rounds", (120 if both else 60) * w.rounds, rounds=w.rounds)]


def _command(args: argparse.Namespace) -> str:
    parts = ["kvtier bench peer"]
    if args.lmcache:
        parts.append("--lmcache")
    if args.quick:
        parts.append("--quick")
    if args.only:
        parts.append(f"--only {args.only}")
    if args.no_fsync:
        parts.append("--no-fsync")
    if args.first_touch != "both":
        parts.append(f"--first-touch {args.first_touch}")
    for flag in ("rounds", "requests", "request_tokens"):
        v = getattr(args, flag)
        if v:
            parts.append(f"--{flag.replace('_', '-')} {v}")
    return " ".join(parts)
