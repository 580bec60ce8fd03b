"""`kvtier bench replay`: replay a request trace through the real key derivation, eviction
policies and tiered store; report hit rates, hits and bytes per tier, evictions, the unbounded
ideal, a policy sweep under capacity pressure, and the hit-rate price of isolation.

Counting rule (DESIGN 3.1, 3.9): only full blocks are cached (a partial last block never is);
a request's hit tokens are ``block_tokens`` x the number of leading blocks found in the store;
token hit rate = hit tokens / input tokens (every input token counts, partial blocks included);
block hit rate = hit blocks / full blocks looked up.

Two modes give identical hit counts (a test checks it): ``meta`` (default) stands a block-counted
MetaTier in for every level and stores 2 bytes per token; ``--payload`` uses the real MemoryTier
and LmdbTier with small bf16 blocks under byte budgets. Both verify the bytes of every hit.
Bytes moved are reported for a reference model (``--bytes-per-token``, default that of a
Llama-3-8B-shaped model: 32 layers x K,V x 8 KV heads x 128 x bf16 = 128 KiB per token).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.replay_report import format_isolation, format_run, format_sweep, isolation_table, plot_sweep, sweep
from benchmarks.replay_workload import (
    MODES,
    REFERENCE_BYTES_PER_TOKEN,
    SEED_BLOCK_TOKENS,
    Capacity,
    TierSpec,
    build_workload,
    parse_tiers,
)
from benchmarks.replayer import ReplayConfig, replay
from benchmarks.trace import (
    ISOLATIONS,
    SEED_SOURCES,
    TRACE_BLOCK_TOKENS,
    MooncakeScenario,
    Scenario,
    SeedScenario,
    open_source,
)
from benchmarks.workloads import DEFAULT_SEED, WORKLOADS, generate
from kvtier.errors import ConfigError
from kvtier.store.eviction import POLICIES


# -- CLI --------------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = (
        "SOURCE: a Mooncake JSONL trace path, 'mooncake' (the bundled trace at\n"
        "<repo>/../shared/data/mooncake/synthetic_trace.jsonl), or a built-in scenario:\n"
        "  seed-shared     10 users x 10 requests, same 10,000-token document + distinct 500-token\n"
        "                  question, one trust group\n"
        "  seed-isolated   the same requests, each user's cache isolated\n"
        "  seed-segmented  the same requests, document public, questions private\n"
        "--workload NAME replays a generated trace instead (benchmarks/workloads.py, seed --seed):\n"
        "  conversations   multi-turn chats with growing prefixes\n"
        "  toolagent       agent loops sharing long tool definitions\n"
        "  shared-docs     the seed's shared-document scenario at scale (300 documents, 150 users)\n"
        "Capacities (--capacity-blocks, --tiers) are a block count, a percentage of the workload's\n"
        "unique blocks (e.g. 5%), or inf. --tiers lists levels fastest first, KIND:CAPACITY,\n"
        "comma-separated, e.g. memory:5%,lmdb:20%. Kinds: memory, lmdb.\n"
        "Rule: only full blocks are cached; hit tokens = block_tokens x leading blocks found.\n"
    )
    parser.add_argument("--trace", default="mooncake", metavar="SOURCE", help="trace file or scenario (see below)")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), help="a generated trace instead of --trace")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help=f"--workload seed (default {DEFAULT_SEED})")
    parser.add_argument("--json", required=True, type=Path, metavar="PATH", help="write results as JSON here")
    parser.add_argument("--policy", default="lru", help=f"eviction policy: {', '.join(sorted(POLICIES))}")
    cap = parser.add_mutually_exclusive_group()
    cap.add_argument("--capacity-blocks", metavar="N|P%|inf", help="one memory tier of this size (default inf)")
    cap.add_argument("--tiers", metavar="SPEC", help="several tiers, e.g. memory:5%%,lmdb:20%%")
    parser.add_argument("--block-tokens", type=int, metavar="N",
                        help=f"tokens per block (default {SEED_BLOCK_TOKENS} for seed-*, {TRACE_BLOCK_TOKENS} "
                             "for traces)")
    parser.add_argument("--isolation", choices=sorted(ISOLATIONS),
                        help="isolation rule (default: from the seed name; shared for traces)")
    parser.add_argument("--users", type=int, default=10, help="users the trace's conversations are dealt to")
    parser.add_argument("--limit", type=int, metavar="N", help="replay only the first N trace requests")
    parser.add_argument("--payload", action="store_true",
                        help="real MemoryTier/LmdbTier with small bf16 blocks instead of block-counted MetaTiers")
    parser.add_argument("--bytes-per-token", type=int, default=REFERENCE_BYTES_PER_TOKEN,
                        help="model KV bytes per token for 'bytes moved' (default: Llama-3-8B shape, 131072)")
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--sweep", action="store_true",
                      help="every eviction policy and Belady MIN at 1, 5, 20, 50%% of unique blocks")
    what.add_argument("--isolation-table", action="store_true",
                      help="token hit rate of the seed scenario and the trace under each isolation rule")
    parser.add_argument("--plot", type=Path, metavar="PNG", help="sweep plot (default: next to the JSON)")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")


def _tiers_from(args: argparse.Namespace) -> tuple[TierSpec, ...]:
    if args.tiers:
        return parse_tiers(args.tiers)
    if args.capacity_blocks:
        return (TierSpec("memory", Capacity.parse(args.capacity_blocks, "--capacity-blocks")),)
    return (TierSpec("memory"),)


def _block_tokens(args: argparse.Namespace, source: str) -> int:
    if args.block_tokens is not None:
        if args.block_tokens <= 0:
            raise ConfigError(f"--block-tokens must be positive, got {args.block_tokens}")
        return args.block_tokens
    return SEED_BLOCK_TOKENS if source in SEED_SOURCES else TRACE_BLOCK_TOKENS


def run(args: argparse.Namespace) -> int:
    mode = "payload" if args.payload else "meta"
    config = ReplayConfig(args.policy, _tiers_from(args), mode, args.bytes_per_token)
    if args.users <= 0:
        raise ConfigError(f"--users must be positive, got {args.users}")
    if args.plot is not None and not args.sweep:
        raise ConfigError("--plot applies to --sweep only")
    if args.workload and args.isolation_table:
        raise ConfigError("--isolation-table compares the seed scenario and --trace; drop --workload")
    if args.isolation is not None and args.isolation_table:
        raise ConfigError("--isolation-table compares every isolation rule; drop --isolation")
    show = not args.quiet
    out: dict[str, object]
    if args.isolation_table:
        trace_source = "mooncake" if args.trace in SEED_SOURCES else args.trace
        trace_scenario, _ = open_source(trace_source, users=args.users, limit=args.limit)
        sources: list[tuple[str, Scenario, int]] = [
            ("seed (10 users x 10)", SeedScenario(), _block_tokens(args, "seed-shared")),
            (Path(trace_source).name, trace_scenario, _block_tokens(args, trace_source)),
        ]
        out = {"isolation_table": isolation_table(sources, config, show_progress=show)}
        text = format_isolation(out["isolation_table"])  # type: ignore[arg-type]
    else:
        if args.workload:
            trace = generate(args.workload, args.seed)
            scenario, default_iso = MooncakeScenario(trace, users=args.users, limit=args.limit), "shared"
            name = trace.source
        else:
            scenario, default_iso = open_source(args.trace, users=args.users, limit=args.limit)
            name = args.trace if args.trace in SEED_SOURCES else Path(args.trace).name
        wl = build_workload(scenario, name, args.isolation or default_iso, _block_tokens(args, args.trace),
                            MODES[mode], show_progress=show)
        if args.sweep:
            out = {"sweep": sweep(wl, mode=mode, bytes_per_token=args.bytes_per_token, show_progress=show)}
            plot = args.plot or args.json.with_suffix(".png")
            plot_sweep(out["sweep"], plot)  # type: ignore[arg-type]
            out["plot"] = str(plot)
            text = format_sweep(out["sweep"]) + f"\nplot: {plot}"  # type: ignore[arg-type]
        else:
            out = replay(wl, config, show_progress=show)
            text = format_run(out)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"benchmark": "replay", **out}, indent=2) + "\n")
    print(text)
    print(f"json: {args.json}")
    return 0
