"""KV events: the index a perfect stream builds is exactly what the nodes hold; delay, loss and
restarts make a router's index differ from it."""

from __future__ import annotations

import numpy as np

from benchmarks.fleet_sim.events import MEDIUM_BIT, REMOVED, STORED, EventChannel, KvEvent, Staleness
from benchmarks.fleet_sim.node import Node
from benchmarks.fleet_sim.pricing import GPU, RAM


def _node_masks(nodes: list[Node], keys: set[int]) -> dict[int, dict[int, int]]:
    out: dict[int, dict[int, int]] = {}
    for n in nodes:
        for k in keys:
            mask = sum(bit for bit, held in zip(MEDIUM_BIT, n.media(k), strict=True) if held)
            if mask:
                out.setdefault(k, {})[n.idx] = mask
    return out


def test_a_perfect_stream_mirrors_the_nodes_exactly(tenants_wl, pricer):
    nodes = [Node(i, gpu_blocks=20, ram_blocks=30, disk_blocks=50, eviction="lru", block_bytes=1) for i in range(3)]
    channel = EventChannel(Staleness(), np.random.default_rng(0))
    s3: set[int] = set()
    seen: set[int] = set()
    for i, req in enumerate(tenants_wl.requests[:200]):
        node = nodes[i % 3]
        node.enqueue(req)
        tiers = node.tiers_for(req, s3)
        node.start(pricer.plan(req, tiers), tiers)
        done, events, new_s3 = node.finish_prefill(s3)
        s3.update(new_s3)
        channel.send(float(i), node.idx, events)
        node.finish_decode(done)
        seen.update(req.keys)
    assert channel.truth.holders == _node_masks(nodes, seen)
    assert channel.index.holders == channel.truth.holders
    assert all(len(n.gpu) <= 20 and len(n.ram.keys) <= 30 and len(n.disk.keys) <= 50 for n in nodes)
    assert sum(len(n.disk.keys) for n in nodes) > 0  # RAM spilled


def test_delay_loss_and_restarts():
    ev = [KvEvent(STORED, 7, GPU), KvEvent(STORED, 7, RAM)]
    delayed = EventChannel(Staleness(delay_s=1.0), np.random.default_rng(0))
    delayed.send(0.0, 0, ev)
    delayed.advance(0.5)
    assert delayed.index.holders == {} and delayed.truth.holders == {7: {0: 3}}
    delayed.advance(1.0)
    assert delayed.index.holders == {7: {0: 3}}
    delayed.send(2.0, 0, [KvEvent(REMOVED, 7, GPU)])
    delayed.advance(3.0)
    assert delayed.index.holders == {7: {0: 2}}

    lossy = EventChannel(Staleness(loss=1.0), np.random.default_rng(0))
    lossy.send(0.0, 1, ev)
    lossy.advance(10.0)
    assert lossy.index.holders == {} and lossy.lost == 1 and lossy.truth.holders == {7: {1: 3}}

    restarting = EventChannel(Staleness(restart_every_s=5.0), np.random.default_rng(0))
    restarting.send(1.0, 0, ev)
    restarting.advance(4.0)
    assert restarting.index.holders == {7: {0: 3}}
    restarting.send(6.0, 1, [KvEvent(STORED, 8, GPU)])  # after the restart at 5 s
    restarting.advance(6.0)
    assert restarting.index.holders == {8: {1: 1}} and restarting.restarts == 1
