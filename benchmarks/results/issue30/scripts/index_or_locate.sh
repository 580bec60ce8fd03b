#!/bin/bash
# Scatter-gather Locate or a shared index? (docs/operations.md, "No shared index")
# Every source of docs/benchmarks.md's simulated table, at 8 and 32 nodes, at its own rate and at
# --load 0.5; kvtier with Locate at several latencies, and kvtier_index (the same rule on an
# event-fed index, 1 ms a lookup) under each staleness knob alone and all three together.
# usage: index_or_locate.sh OUTDIR   (two runs at a time: about 15 minutes on 2 cores)
set -u
out=${1:?usage: index_or_locate.sh OUTDIR}
mkdir -p "$out"
common=(--simulate --nodes 8,32 --trace mooncake --workload multitenant --workload conversations
        --workload shared-docs --workload toolagent --requests 16000)
run() {  # NAME ARGS...
  local name=$1; shift
  for load in own 0.5; do
    local extra=(); [ "$load" != own ] && extra=(--load "$load")
    kvtier bench fleet "${common[@]}" "${extra[@]}" "$@" --json "$out/$name-$load.json" \
      > "$out/$name-$load.log" 2>&1 || echo "FAILED: $name $load" >&2
  done
}
run locate-0 --policies kvtier --locate-ms 0 &
run locate-10 --policies kvtier --locate-ms 10
wait
run locate-30 --policies kvtier --locate-ms 30 &
run index-perfect --policies kvtier_index --index-ms 1
wait
run index-delay --policies kvtier_index --index-ms 1 --event-delay-ms 200 &
run index-loss --policies kvtier_index --index-ms 1 --event-loss 0.05
wait
run index-restart --policies kvtier_index --index-ms 1 --indexer-restart-s 300 &
run index-stale --policies kvtier_index --index-ms 1 --event-delay-ms 200 --event-loss 0.05 --indexer-restart-s 300
wait
run locate-100 --policies kvtier --locate-ms 100
# The 2 ms runs again, for their lookup counts (their other figures are fleet_sim*-before-copies.json's).
run locate-2 --policies kvtier --locate-ms 2
# The per-daemon Locate rate beyond 32 nodes (Mooncake under load): lookup_rate at 64 and 128 nodes.
kvtier bench fleet --simulate --nodes 64,128 --trace mooncake --requests 16000 --policies kvtier --load 0.5 \
  --json "$out/locate-2-0.5-64-128.json" > "$out/locate-2-0.5-64-128.log" 2>&1
