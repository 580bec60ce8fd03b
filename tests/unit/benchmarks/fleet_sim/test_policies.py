"""Each policy decides as its source says, with its project's defaults."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.fleet_sim.events import STORED, EventChannel, KvEvent, Staleness
from benchmarks.fleet_sim.node import Node
from benchmarks.fleet_sim.policies import (
    POLICIES,
    CacheAware,
    CacheAwareConfig,
    Dynamo,
    DynamoConfig,
    Kvtier,
    KvtierIndex,
    LlmD,
    LlmdConfig,
    PolicyContext,
)
from benchmarks.fleet_sim.pricing import DISK, GPU, RAM
from benchmarks.fleet_sim.requests import make_request
from benchmarks.fleet_sim.view import FleetView
from kvtier.errors import ConfigError


def _ctx(pricer, n: int = 3, locate_s: float = 0.0) -> PolicyContext:
    nodes = [Node(i, gpu_blocks=100, ram_blocks=100, disk_blocks=100, eviction="lru", block_bytes=1)
             for i in range(n)]
    channel = EventChannel(Staleness(), np.random.default_rng(0))
    view = FleetView(nodes, set(), channel, block_tokens=512, metrics_interval_s=0.0)
    return PolicyContext(view, pricer, np.random.default_rng(0), locate_s)


def _req(rid: int, content: tuple[int, ...], tokens: int | None = None):
    return make_request(rid, 0.0, 0, tokens or len(content) * 512, 10, content, len(content))


def test_defaults_are_the_projects_own():
    # vllm-router 0.1.17 --help: --cache-threshold 0.3, --balance-abs/rel-threshold 64 / 1.5,
    # --eviction-interval-secs 120, --max-tree-size 33554432.
    assert CacheAwareConfig() == CacheAwareConfig(0.3, 64, 1.5, 120.0, 33554432)
    assert (LlmdConfig().gpu_weight, LlmdConfig().cpu_weight, LlmdConfig().other_weight) == (1.0, 0.8, 1.0)
    assert (LlmdConfig().prefix_weight, LlmdConfig().kv_utilization_weight, LlmdConfig().queue_weight) == (2, 1, 1)
    d = DynamoConfig()
    assert (d.overlap_score_credit, d.host_cache_hit_weight, d.disk_cache_hit_weight) == (1.0, 0.75, 0.25)
    assert (d.prefill_load_scale, d.decode_active_request_weight) == (1.0, 0.0)
    assert set(POLICIES) == {"round_robin", "least_loaded", "cache_aware", "llm_d", "dynamo", "kvtier", "kvtier_index"}


def test_cache_aware_keeps_a_prefix_with_the_worker_that_first_got_it(pricer):
    pol = CacheAware(_ctx(pricer))
    doc = (11, 12, 13, 14)
    first = _req(0, (*doc, 20))
    c = pol.choose(first, 0.0)
    assert c.node == 0  # nothing matched: the least loaded, first of equals
    pol.routed(first, 0, 0.0)
    pol.view.inflight[0] = 5  # busy, but not imbalanced by vllm-router's thresholds (> 64 apart)
    assert pol.choose(_req(1, (*doc, 30)), 1.0).node == 0
    pol.view.inflight[:] = [70, 0, 3]  # imbalanced: 70 - 0 > 64 and 70 > 1.5 x 0
    assert pol.choose(_req(2, (*doc, 40)), 2.0).node == 1


def test_cache_aware_below_its_threshold_goes_to_the_least_loaded(pricer):
    pol = CacheAware(_ctx(pricer))
    pol.routed(_req(0, (1, 2)), 2, 0.0)
    pol.view.inflight[:] = [4, 0, 1]
    # 1 block of 5 matched = 0.2 <= 0.3: not node 2 but the least loaded
    assert pol.choose(_req(1, (1, 9, 8, 7, 6)), 0.0).node == 1
    pol.view.inflight[:] = [4, 1, 3]
    # 1 block of 2 matched = 0.5 > 0.3: node 2, busier or not
    assert pol.choose(_req(2, (1, 5)), 0.0).node == 2


def test_llm_d_weighs_media_as_its_backend_table(pricer):
    ctx = _ctx(pricer)
    pol = LlmD(ctx)
    req = _req(0, (1, 2, 3, 4))
    # node 0: all four in CPU (0.8 each); node 1: all four on "disk" (not in the table: 1.0)
    ctx.view.channel.send(0.0, 0, [KvEvent(STORED, k, RAM) for k in req.keys])
    ctx.view.channel.send(0.0, 1, [KvEvent(STORED, k, DISK) for k in req.keys])
    scores = pol._scores(ctx.view.channel.index, req, ctx.view.metrics(0.0))
    assert scores[0] == pytest.approx(2 * 0.8 + 1 + 1) and scores[1] == pytest.approx(2 * 1.0 + 1 + 1)
    assert scores[2] == pytest.approx(2.0)
    assert pol.choose(req, 0.0).node == 1


def test_dynamo_credits_tiers_and_charges_active_load(pricer):
    ctx = _ctx(pricer)
    pol = Dynamo(ctx)
    req = _req(0, (1, 2, 3, 4))
    ctx.view.channel.send(0.0, 0, [KvEvent(STORED, k, GPU) for k in req.keys])
    ctx.view.channel.send(0.0, 1, [KvEvent(STORED, k, RAM) for k in req.keys])
    credit, depth = pol._overlaps(ctx.view.channel.index, req)
    assert credit == [4.0, 3.0, 0.0] and depth == [4, 4, 0]
    # cost = max(0, 4 - credit) + (active blocks + the request's 4 new ones)
    assert pol._costs(credit, req) == [4.0, 5.0, 8.0]
    assert pol.choose(req, 0.0).node == 0
    pol.routed(req, 0, 0.0)
    assert pol.active_prefill_tokens[0] == 0 and len(pol.active_blocks[0]) == 4
    other = _req(1, (1, 2, 3, 4, 5, 6, 7, 8, 9, 10))
    costs = pol._costs(pol._overlaps(ctx.view.channel.index, other)[0], other)
    assert costs[0] == 6.0 + 10.0  # its 4 shared blocks are already active there: 4 + 6 new
    pol.first_token(req, 0, 1.0)
    pol.finished(req, 0, 2.0)
    assert len(pol.active_blocks[0]) == 0


def test_kvtier_prices_each_node_and_waits_its_queue(pricer):
    ctx = _ctx(pricer)
    pol = Kvtier(ctx)
    req = _req(0, tuple(range(1, 21)), 20 * 512 + 50)
    ctx.view.nodes[1].ram.keys.update(req.keys)  # node 1's kvtier RAM holds the whole prefix
    c = pol.choose(req, 0.0)
    assert c.node == 1 and c.fresh == 1
    cold = pricer.plan(req, []).seconds
    warm = pricer.plan(req, [RAM] * 20).seconds
    assert pol._predicted == [cold, warm, cold] and warm < cold
    pol.routed(req, 1, 0.0)
    assert pol.wait_s(1, 0.0) == pytest.approx(warm) and pol.wait_s(0, 0.0) == 0.0
    assert pol.wait_s(1, warm / 2) == pytest.approx(warm / 2)
    pol.first_token(req, 1, warm)
    assert pol.wait_s(1, warm) == 0.0


def test_kvtier_decides_with_the_routers_own_rule(pricer):
    """The simulated policy is ``kvtier route``'s Chooser: nodes within its edge of the best are
    tied and the least loaded of them wins (a control: without the tie, node 0's one cached block
    would win)."""
    from kvtier.router.choice import Chooser

    ctx = _ctx(pricer)
    pol = Kvtier(ctx)
    assert type(pol.chooser) is Chooser
    req = _req(0, tuple(range(1, 41)), 40 * 512 + 50)
    ctx.view.nodes[0].ram.keys.update(req.keys[:1])  # node 0 holds the first of 40 blocks: < 5 % cheaper
    ctx.view.inflight[:] = [2, 1, 3]
    assert pol.choose(req, 0.0).node == 1
    assert pol._predicted[0] < pol._predicted[1] == pol._predicted[2]
    ctx.view.nodes[0].ram.keys.update(req.keys[:20])  # half the prefix: a real edge
    assert pol.choose(req, 1.0).node == 0


def test_kvtier_sees_what_kvtier_routes_locate_sees(pricer):
    """By default each node's RAM and disk only, as the real router's local_only Locate to a daemon
    that does not know its engine's GPU cache; the opt-ins see the GPU cache and S3 (controls)."""
    req = _req(0, tuple(range(1, 11)), 10 * 512 + 50)
    seen = {}
    for gpu, s3 in ((False, False), (True, False), (False, True)):
        nodes = [Node(i, gpu_blocks=100, ram_blocks=100, disk_blocks=100, eviction="lru", block_bytes=1)
                 for i in range(3)]
        nodes[0].gpu.update(dict.fromkeys(req.keys))
        nodes[1].ram.keys.update(req.keys[:4])
        view = FleetView(nodes, set(req.keys), EventChannel(Staleness(), np.random.default_rng(0)),
                         block_tokens=512, metrics_interval_s=0.0, locate_gpu=gpu, locate_s3=s3)
        seen[gpu, s3] = [len(t) for t in view.locate(req)]
    assert seen[False, False] == [0, 4, 0]
    assert seen[True, False] == [10, 4, 0]
    assert seen[False, True] == [10, 10, 10]  # node 0's GPU blocks are unseen; S3 holds them all


def test_kvtier_prices_the_gpu_cache_by_what_it_sent_there(pricer):
    """As kvtier route does (kvtier/router/engine_cache.py): the node that computed a prefix for it
    is priced with that prefix in its GPU cache, though no Locate reports it; beyond the node's GPU
    capacity the least recently computed keys are forgotten (control)."""
    ctx = _ctx(pricer)
    pol = Kvtier(ctx)
    req = _req(0, tuple(range(1, 21)), 20 * 512 + 50)
    cold = pricer.plan(req, []).seconds
    pol.choose(req, 0.0)
    assert pol._predicted == [cold, cold, cold]
    pol.routed(req, 2, 0.0)
    pol.first_token(req, 2, cold)
    again = _req(1, req.content, req.input_tokens)
    assert pol.choose(again, 100.0).node == 2
    assert pol._predicted[2] == pricer.plan(again, [GPU] * 20).seconds < cold
    pol.routed(again, 2, 100.0)
    pol.first_token(again, 2, 100.0)
    other = _req(2, tuple(range(1000, 1100)), 100 * 512)  # 100 blocks through a 100-block cache
    pol.routed(other, 2, 200.0)
    pol.choose(again, 250.0)
    assert pol._predicted[2] < cold, "a request still queued is no cache yet"
    pol.first_token(other, 2, 260.0)
    pol.choose(again, 300.0)
    assert pol._predicted[2] == cold


def _index_ctx(pricer, staleness: Staleness, locate_gpu: bool = False) -> PolicyContext:
    nodes = [Node(i, gpu_blocks=100, ram_blocks=100, disk_blocks=100, eviction="lru", block_bytes=1)
             for i in range(3)]
    channel = EventChannel(staleness, np.random.default_rng(0))
    view = FleetView(nodes, set(), channel, block_tokens=512, metrics_interval_s=0.0, locate_gpu=locate_gpu)
    return PolicyContext(view, pricer, np.random.default_rng(0), locate_s=0.002, index_s=0.0005)


def _hold(ctx: PolicyContext, node: int, keys, medium: int, now: float = 0.0) -> None:
    """``node`` holds ``keys`` in ``medium`` and says so in one event message."""
    n = ctx.view.nodes[node]
    {GPU: n.gpu, RAM: n.ram.keys, DISK: n.disk.keys}[medium].update(dict.fromkeys(keys))
    ctx.view.channel.send(now, node, [KvEvent(STORED, k, medium) for k in keys])


def test_kvtier_index_reads_from_the_index_what_locate_asks_the_nodes(pricer):
    """Fed every event at once, the index answers as Locate does: per node its RAM and disk (the
    cheaper of the two where both hold a block), the GPU cache only when Locate would see it;
    a lookup costs ``index_s``, not ``locate_s``."""
    req = _req(0, tuple(range(1, 11)), 10 * 512 + 50)
    for gpu in (False, True):
        ctx = _index_ctx(pricer, Staleness(), locate_gpu=gpu)
        _hold(ctx, 0, req.keys, GPU)
        _hold(ctx, 1, req.keys[:6], DISK)
        _hold(ctx, 1, req.keys[:3], RAM)
        _hold(ctx, 2, req.keys[1:], RAM)  # not the first block: no prefix
        pol = KvtierIndex(ctx)
        assert pol.answers(ctx.view.channel.index, req) == ctx.view.locate(req)
        assert pol.answers(ctx.view.channel.index, req)[1] == [RAM] * 3 + [DISK] * 3
        assert pol.decision_delay_s == 0.0005
    assert ctx.view.locate(req)[0] == [GPU] * 10  # the last context saw the GPU cache


def test_kvtier_index_counts_the_gpu_only_for_its_leading_run(pricer):
    """As Locate does, the index answers GPU only while the engine's cache holds every block from
    the first: once a leading block has left the GPU for RAM, the later blocks are served from RAM
    though the GPU still holds them, and a block past that run held in the GPU alone ends the prefix."""
    req = _req(0, tuple(range(1, 7)), 6 * 512 + 50)
    ctx = _index_ctx(pricer, Staleness(), locate_gpu=True)
    _hold(ctx, 0, req.keys[:4], RAM)
    _hold(ctx, 0, req.keys[1:], GPU)  # block 0 left the GPU; blocks 4 and 5 are there alone
    _hold(ctx, 1, req.keys[:2], GPU)
    _hold(ctx, 1, req.keys[:3], DISK)
    pol = KvtierIndex(ctx)
    answers = pol.answers(ctx.view.channel.index, req)
    assert answers == ctx.view.locate(req)
    assert answers[0] == [RAM] * 4 and answers[1] == [GPU, GPU, DISK]


def test_kvtier_index_refuses_to_be_compared_with_a_locate_that_sees_s3(pricer):
    nodes = [Node(i, gpu_blocks=100, ram_blocks=100, disk_blocks=100, eviction="lru", block_bytes=1) for i in range(2)]
    view = FleetView(nodes, set(), EventChannel(Staleness(), np.random.default_rng(0)), block_tokens=512,
                     metrics_interval_s=0.0, locate_s3=True)
    with pytest.raises(ConfigError, match="S3"):
        KvtierIndex(PolicyContext(view, pricer, np.random.default_rng(0)))


def test_kvtier_index_on_a_stale_index_decides_otherwise_and_counts_it(pricer):
    """A message the index has not had yet hides node 1's copy: the request goes elsewhere, and
    the decision the same policy takes on the perfect index (node 1) makes it a misroute. Control:
    on a perfect stream the two agree."""
    req = _req(0, tuple(range(1, 21)), 20 * 512 + 50)
    for staleness, node, fresh in ((Staleness(delay_s=1.0), None, 1), (Staleness(), 1, 1)):
        ctx = _index_ctx(pricer, staleness)
        _hold(ctx, 1, req.keys, RAM)
        ctx.view.channel.advance(0.5)
        c = KvtierIndex(ctx).choose(req, 0.5)
        assert c.fresh == fresh
        assert c.node == node if node is not None else c.node != 1
