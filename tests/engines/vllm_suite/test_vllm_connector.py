"""The kvtier vLLM connector against the real vLLM package (pinned in tests/engines/vllm-requirements.txt).

Runs inside .venv-vllm (see tests/engines/test_engine_suites.py). vLLM's own factory resolves the
connector from a KVTransferConfig; both roles are driven in vLLM's call order (scheduler:
get_num_new_matched_tokens -> update_state_after_alloc -> build_connector_meta; worker:
bind_connector_metadata -> start_load_kv -> per layer wait_for_layer_load / save_kv_layer ->
wait_for_save -> get_finished / get_block_ids_with_load_errors -> clear_connector_metadata;
scheduler: request_finished) on CPU tensors laid out by vLLM's own ``create_kv_cache_views``.
The connector's counters: test_vllm_connector_stats.py; tensor-parallel ranks: test_vllm_connector_tp.py.
"""

from __future__ import annotations

import os
import threading

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

from typing import Any

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

from connectors.identity import mint_salt
from connectors.provision import forget_shared_caches
from connectors.vllm_connector import KvtierConnector
from connectors.vllm_pages import PagedKV
from kvtier.cache.kv_cache import RequestSegment
from kvtier.errors import ConfigError, LayoutMismatch
from kvtier.keys import ScopeKind
from kvtier.security.policy import ROLE_PUBLISH_PUBLIC, Principal
from tests.engines.vllm_suite.conftest import SALT_KEY
from tests.engines.vllm_suite.vllm_rig import (
    BLOCK,
    HEAD,
    HEADS,
    LAYER_NAMES,
    LAYERS,
    NUM_BLOCKS,
    Engine,
    blocks_of,
    kv_cache_config,
    make_engine,
    matched_tokens,
    paged_kv,
    pages,
    prompt,
    request,
    run_prefill,
    same_bytes,
    vllm_config,
)


# -- the tests --------------------------------------------------------------------------------------
def test_factory_resolves_the_connector_for_both_roles(salt_key_file: str) -> None:
    eng = make_engine(vllm_config(salt_key_file))
    assert eng.scheduler.layout == eng.worker.layout
    assert eng.worker.layout.block_shape == (LAYERS, HEADS, BLOCK, 2 * HEAD)


def test_saved_pages_come_back_byte_identical_into_other_block_ids(salt_key_file: str) -> None:
    eng = make_engine(vllm_config(salt_key_file))
    salt = mint_salt(SALT_KEY, "acme", "alice")
    tokens = prompt(100)  # 6 full blocks + 4 tokens
    first = run_prefill(eng, request("r1", tokens, salt), list(range(0, 7)), fill_seed=1)
    assert first.matched == 0
    saved = pages(eng, list(range(6)))

    second_ids = list(range(20, 27))
    res = run_prefill(eng, request("r2", tokens, salt), second_ids)
    assert res.matched == 6 * BLOCK and not res.load_async
    assert res.invalid == set()
    assert same_bytes(pages(eng, second_ids[:6]), saved)
    assert eng.worker.stats["saved_blocks"] == 6
    assert eng.scheduler.request_finished(request("r2", tokens, salt), second_ids) == (False, None)


def test_every_kv_cache_layout_round_trips(salt_key_file: str) -> None:
    for i, layout in enumerate(KVCacheLayout):
        forget_shared_caches()
        eng = make_engine(vllm_config(salt_key_file), layout)
        salt = mint_salt(SALT_KEY, "acme", f"user{i}")
        tokens = prompt(3 * BLOCK + 1, base=i)
        run_prefill(eng, request("a", tokens, salt), [5, 9, 2, 11], fill_seed=i)
        saved = pages(eng, [5, 9, 2])
        res = run_prefill(eng, request("b", tokens, salt), [30, 31, 40, 41])
        assert res.matched == 3 * BLOCK, layout
        assert same_bytes(pages(eng, [30, 31, 40]), saved), layout


def test_another_tenant_and_forged_or_missing_salts_get_nothing(salt_key_file: str) -> None:
    eng = make_engine(vllm_config(salt_key_file))
    tokens = prompt(80)
    run_prefill(eng, request("r1", tokens, mint_salt(SALT_KEY, "acme", "alice")), list(range(6)), fill_seed=2)
    other = matched_tokens(eng.scheduler, request("r2", tokens, mint_salt(SALT_KEY, "globex", "bob")), 0)
    assert other == (0, False)
    forged = "kvs2:acme:alice:" + "0" * 32  # names alice, but the MAC is not the deployment's
    assert matched_tokens(eng.scheduler, request("r3", tokens, forged), 0) == (0, False)
    wrong_key = mint_salt(b"another-deployment-salt-key-0123456789ab", "acme", "alice")
    assert matched_tokens(eng.scheduler, request("r4", tokens, wrong_key), 0) == (0, False)
    assert matched_tokens(eng.scheduler, request("r5", tokens, "not a salt"), 0) == (0, False)
    assert matched_tokens(eng.scheduler, request("r6", tokens, None), 0) == (0, False)
    assert eng.scheduler.stats["salt_rejected"] == 3 and eng.scheduler.stats["no_salt"] == 1
    # The rightful owner still hits.
    assert matched_tokens(eng.scheduler, request("r7", tokens, mint_salt(SALT_KEY, "acme", "alice")),
                                                    0) == (4 * BLOCK, False)


def test_a_slow_lookup_is_answered_at_a_later_step_and_holds_up_no_other_request(
        salt_key_file: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's scheduler skips a request whose connector answers None and asks again at a later
    step: a slow lookup (a daemon probing S3 on a busy host took 200-570 ms) no longer holds up
    the step and every request in it."""
    eng = make_engine(vllm_config(salt_key_file))
    sched = eng.scheduler
    salt = mint_salt(SALT_KEY, "acme", "alice")
    tokens = prompt(80)
    run_prefill(eng, request("r1", tokens, salt), list(range(6)), fill_seed=5)
    entered, release = threading.Event(), threading.Event()
    looked_up = sched.rule.scoped_lookup

    def held(*args, **kwargs):  # the cache's real lookup, held until the test lets it finish
        entered.set()
        assert release.wait(30)
        return looked_up(*args, **kwargs)

    monkeypatch.setattr(sched.rule, "scoped_lookup", held)
    try:
        slow = request("r2", tokens, salt)
        assert sched.get_num_new_matched_tokens(slow, 0) == (None, False)  # not known yet: a later step
        assert entered.wait(10)
        assert sched.get_num_new_matched_tokens(slow, 0) == (None, False)  # still running
        # Meanwhile the step goes on: a request without a salt, and one whose salt is refused.
        assert sched.get_num_new_matched_tokens(request("r3", tokens, None), 0) == (0, False)
        assert matched_tokens(sched, request("r4", tokens, "not a salt"), 0) == (0, False)
        # A request that finishes while its lookup runs leaves nothing behind.
        gone = request("r5", tokens, salt)
        assert sched.get_num_new_matched_tokens(gone, 0) == (None, False)
        sched.request_finished(gone, [])
        release.set()
        assert matched_tokens(sched, slow, 0) == (4 * BLOCK, False)  # the answer, once it is there
        assert sched.stats["lookup_deferred"] >= 3 and len(sched.scheduler_side.lookups) == 0
    finally:
        release.set()
    # Control: with kvtier.lookup_async off, the step waits for the lookup and answers at once.
    blocking = make_engine(vllm_config(salt_key_file, lookup_async=False)).scheduler
    assert blocking.scheduler_side.lookups is None
    assert blocking.get_num_new_matched_tokens(request("r6", tokens, salt), 0) == (4 * BLOCK, False)


@pytest.mark.parametrize("bad", [-1, 5000, "5", True])
def test_a_bad_lookup_wait_is_refused(salt_key_file: str, bad: object) -> None:
    with pytest.raises(ConfigError, match="lookup_wait_ms"):
        make_engine(vllm_config(salt_key_file, lookup_wait_ms=bad))


def test_local_prefix_hit_loads_only_the_blocks_after_it(salt_key_file: str) -> None:
    eng = make_engine(vllm_config(salt_key_file))
    salt = mint_salt(SALT_KEY, "acme", "alice")
    tokens = prompt(5 * BLOCK + 3)
    run_prefill(eng, request("r1", tokens, salt), list(range(6)), fill_seed=3)
    saved = pages(eng, [2, 3, 4])
    # vLLM already holds 2 blocks locally: kvtier offers the 3 after them.
    req = request("r2", tokens, salt)
    assert matched_tokens(eng.scheduler, req, 2 * BLOCK) == (3 * BLOCK, False)
    eng.scheduler.update_state_after_alloc(req, blocks_of([0, 1, 40, 41, 42, 43]), 3 * BLOCK)
    out = SchedulerOutput.make_empty()
    meta = eng.scheduler.build_connector_meta(out)
    assert [(j.start, j.end, j.block_ids) for j in meta.loads] == [(2, 5, (40, 41, 42))]
    eng.worker.bind_connector_metadata(meta)
    eng.worker.start_load_kv(None)
    for name in LAYER_NAMES:
        eng.worker.wait_for_layer_load(name)
    eng.worker.wait_for_save()
    eng.worker.flush_saves()
    assert eng.worker.get_block_ids_with_load_errors() == set()
    eng.worker.clear_connector_metadata()
    assert same_bytes(pages(eng, [40, 41, 42]), saved)


def lookup_then_lose_blocks(eng: Engine, seed: int) -> tuple[Request, list[int]]:
    """alice's 4-block prompt, saved, then looked up again (4 blocks planned); between that lookup
    and the worker's load, blocks 2.. vanish from every tier. The request and its block ids."""
    salt = mint_salt(SALT_KEY, "acme", "alice")
    tokens = prompt(4 * BLOCK + 1)
    run_prefill(eng, request("r1", tokens, salt), list(range(5)), fill_seed=seed)
    req = request("r2", tokens, salt)
    assert matched_tokens(eng.scheduler, req, 0) == (4 * BLOCK, False)
    cache = eng.scheduler.source.cache
    chain = cache.chain(Principal("acme", "alice"), [RequestSegment(tokens[: 4 * BLOCK], ScopeKind.USER)])
    cache.store.delete([c.key for c in chain[2:]])
    ids = [30, 31, 32, 33, 34]
    eng.scheduler.update_state_after_alloc(req, blocks_of(ids), 4 * BLOCK)
    return req, ids


def test_blocks_lost_after_lookup_are_reported_and_not_written(salt_key_file: str) -> None:
    eng = make_engine(vllm_config(salt_key_file))
    lookup_then_lose_blocks(eng, 4)
    meta = eng.scheduler.build_connector_meta(SchedulerOutput.make_empty())
    eng.worker.bind_connector_metadata(meta)
    eng.worker.start_load_kv(None)
    for name in LAYER_NAMES:
        eng.worker.wait_for_layer_load(name)
    eng.worker.wait_for_save()
    eng.worker.flush_saves()
    assert eng.worker.get_block_ids_with_load_errors() == {32, 33}
    eng.worker.clear_connector_metadata()
    assert all(not t[torch.tensor([32, 33])].any() for t in eng.kv.values())  # untouched zeros
    assert all(t[torch.tensor([30, 31])].any() for t in eng.kv.values())


def test_blocks_that_failed_to_load_are_saved_again_once_recomputed(salt_key_file: str) -> None:
    """vLLM (kv_load_failure_policy="recompute") recomputes from the first block that failed to
    load; the scheduler side hears of them (update_connector_output) and plans their save."""
    eng = make_engine(vllm_config(salt_key_file))
    req, ids = lookup_then_lose_blocks(eng, 5)
    out = SchedulerOutput.make_empty()
    out.scheduled_new_reqs = [NewRequestData(req_id="r2", prompt_token_ids=req.prompt_token_ids, mm_features=[],
                                             sampling_params=req.sampling_params, pooling_params=None,
                                             block_ids=(ids,), num_computed_tokens=4 * BLOCK, lora_request=None)]
    out.num_scheduled_tokens = {"r2": 1}
    meta = eng.scheduler.build_connector_meta(out)
    assert meta.saves == []  # kvtier held all 4 at lookup
    eng.worker.bind_connector_metadata(meta)
    eng.worker.start_load_kv(None)
    for name in LAYER_NAMES:
        eng.worker.wait_for_layer_load(name)
    eng.worker.wait_for_save()
    invalid = eng.worker.get_block_ids_with_load_errors()
    eng.worker.clear_connector_metadata()
    assert invalid == {32, 33}
    eng.scheduler.update_connector_output(KVConnectorOutput(invalid_block_ids=invalid))
    assert eng.scheduler.stats["resave_blocks"] == 2
    # vLLM truncated the request to its first failed block and computes from there.
    out2 = SchedulerOutput.make_empty()
    out2.scheduled_cached_reqs = CachedRequestData(
        req_ids=["r2"], resumed_req_ids=set(), new_token_ids=[[]], all_token_ids={},
        new_block_ids=[None], num_computed_tokens=[2 * BLOCK], num_output_tokens=[0])
    out2.num_scheduled_tokens = {"r2": 2 * BLOCK + 1}
    assert [(j.start, j.end, j.block_ids) for j in eng.scheduler.build_connector_meta(out2).saves] == [
        (2, 4, (32, 33))]
    # Another request's failed blocks leave this one alone.
    eng.scheduler.update_connector_output(KVConnectorOutput(invalid_block_ids={7}))
    assert eng.scheduler.stats["resave_blocks"] == 2


def test_a_failing_load_policy_is_warned_about_at_start_up(salt_key_file: str,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    config = vllm_config(salt_key_file)
    with caplog.at_level("WARNING", logger="kvtier.connector"):
        make_engine(config)
    assert any("kv_load_failure_policy='fail'" in r.getMessage() for r in caplog.records)
    caplog.clear()
    config.kv_transfer_config.kv_load_failure_policy = "recompute"
    with caplog.at_level("WARNING", logger="kvtier.connector"):
        make_engine(config)
    assert not any("kv_load_failure_policy" in r.getMessage() for r in caplog.records)


def test_async_load_reports_through_get_finished(salt_key_file: str) -> None:
    eng = make_engine(vllm_config(salt_key_file, load_async=True))
    salt = mint_salt(SALT_KEY, "acme", "alice")
    tokens = prompt(3 * BLOCK + 5)
    run_prefill(eng, request("r1", tokens, salt), list(range(4)), fill_seed=5)
    saved = pages(eng, [0, 1, 2])
    res = run_prefill(eng, request("r2", tokens, salt), [10, 11, 12, 13])
    assert res.load_async and res.matched == 3 * BLOCK
    finished = res.finished_recving or set()
    if "r2" not in finished:  # the load thread may still run: the next step reports it
        eng.worker.worker_side._load_thread.join()
        _, later = eng.worker.get_finished(set())
        finished |= later or set()
    assert finished == {"r2"}
    assert same_bytes(pages(eng, [10, 11, 12]), saved)


def test_public_registry_shares_a_published_document_across_tenants(salt_key_file: str) -> None:
    eng = make_engine(vllm_config(salt_key_file, scope_rule="public-registry"))
    cache = eng.scheduler.source.cache
    doc = prompt(4 * BLOCK, base=11)
    publisher = Principal("ops", "publisher", roles=frozenset({ROLE_PUBLISH_PUBLIC}))
    chain = cache.chain(publisher, [RequestSegment(doc, ScopeKind.PUBLIC)])
    gen = torch.Generator().manual_seed(9)
    published = [torch.randn(cache.layout().block_shape, generator=gen).half() for _ in chain]
    cache.save(publisher, chain, published)

    question = prompt(BLOCK + 3, base=999)
    bob = mint_salt(SALT_KEY, "globex", "bob")
    res = run_prefill(eng, request("b1", doc + question, bob), list(range(6)), fill_seed=6)
    assert res.matched == 4 * BLOCK
    for li, name in enumerate(LAYER_NAMES):
        got = eng.kv[name][torch.arange(4)]
        assert torch.equal(got, torch.stack([p[li] for p in published]))
    # Bob's private block (after the document) was saved in his own scope, never in public.
    assert eng.worker.stats["saved_blocks"] == 1
    carol = mint_salt(SALT_KEY, "initech", "carol")
    assert matched_tokens(eng.scheduler, request("c1", doc + question, carol), 0) == (4 * BLOCK, False)
    assert matched_tokens(eng.scheduler, request("b2", doc + question, bob), 0) == (5 * BLOCK, False)


def test_chunked_prefill_saves_each_block_once(salt_key_file: str) -> None:
    eng = make_engine(vllm_config(salt_key_file))
    salt = mint_salt(SALT_KEY, "acme", "alice")
    tokens = prompt(4 * BLOCK + 2)
    req = request("r1", tokens, salt)
    assert matched_tokens(eng.scheduler, req, 0) == (0, False)
    eng.scheduler.update_state_after_alloc(req, blocks_of([0, 1]), 0)
    out = SchedulerOutput.make_empty()
    out.scheduled_new_reqs = [NewRequestData(req_id="r1", prompt_token_ids=tokens, mm_features=[],
                                             sampling_params=req.sampling_params, pooling_params=None,
                                             block_ids=([0, 1],), num_computed_tokens=0, lora_request=None)]
    out.num_scheduled_tokens = {"r1": 2 * BLOCK + 5}
    meta = eng.scheduler.build_connector_meta(out)
    assert [(j.start, j.end) for j in meta.saves] == [(0, 2)]
    out2 = SchedulerOutput.make_empty()
    out2.scheduled_cached_reqs = CachedRequestData(
        req_ids=["r1"], resumed_req_ids=set(), new_token_ids=[[]], all_token_ids={},
        new_block_ids=[([2, 3, 4],)], num_computed_tokens=[2 * BLOCK + 5], num_output_tokens=[0])
    out2.num_scheduled_tokens = {"r1": 2 * BLOCK - 3}
    meta2 = eng.scheduler.build_connector_meta(out2)
    assert [(j.start, j.end, j.block_ids) for j in meta2.saves] == [(2, 4, (2, 3))]
    # The worker stores both steps; the second derives only its own two keys, continuing the chain.
    w = eng.worker
    for m in (meta, meta2):
        w.bind_connector_metadata(m)
        w.start_load_kv(None)
        for name in LAYER_NAMES:
            w.save_kv_layer(name, eng.kv[name], None)
        w.wait_for_save()
        w.flush_saves()
        w.clear_connector_metadata()
    assert w.stats["saved_blocks"] == 4 and w.stats["keys_derived"] == 4
    # Control: keys derived from scratch (another request, same tokens) find all four blocks.
    assert matched_tokens(eng.scheduler, request("r2", tokens, salt), 0) == (4 * BLOCK, False)
    w.get_finished({"r1"})
    assert "r1" not in w.worker_side._chains


def test_wrong_paged_kv_shape_is_refused(salt_key_file: str) -> None:
    config = vllm_config(salt_key_file)
    worker = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, kv_cache_config())
    bad = {n: torch.zeros(NUM_BLOCKS, HEADS, BLOCK, HEAD, dtype=torch.float16) for n in LAYER_NAMES}
    with pytest.raises(LayoutMismatch):
        worker.register_kv_caches(bad)
    with pytest.raises(LayoutMismatch):
        worker.register_kv_caches({LAYER_NAMES[0]: paged_kv()[LAYER_NAMES[0]]})


def test_an_in_process_cache_is_refused_under_the_multiprocess_executor(salt_key_file: str) -> None:
    """The scheduler and the workers would each open their own memory cache: refused at start-up,
    with the fix named, instead of silently finding nothing."""
    config = vllm_config(salt_key_file)
    config.parallel_config.distributed_executor_backend = "mp"
    with pytest.raises(ConfigError, match=r"kvtier\.cache=daemon"):
        KvtierConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config())


def test_pages_move_through_the_transfer_engine_where_the_layout_allows(salt_key_file: str) -> None:
    """Layouts whose pages are one contiguous [H, N, C] run go through kvtier's TransferEngine
    (staging, events); the others through torch indexing, said in the worker's counters."""
    direct = make_engine(vllm_config(salt_key_file), KVCacheLayout.BLHNC)
    assert direct.worker.stats["pages_direct"] == 1 and direct.worker.worker_side._paged.direct
    other = make_engine(vllm_config(salt_key_file), KVCacheLayout.LBNHC)
    assert other.worker.stats["pages_by_torch_indexing"] == 1 and not other.worker.worker_side._paged.direct


def test_a_load_larger_than_one_staging_buffer_goes_in_batches() -> None:
    """A load covers a whole cached prefix, which may be far more pages than one step saves (what
    the staging buffers are sized for): it is queued in batches, and every page lands."""
    kv = paged_kv()
    views = [kv[n] for n in LAYER_NAMES]
    paged = PagedKV(views, tuple(views[0].shape[1:]), views[0].dtype, max_step_pages=2)
    per = paged.engine.config.buffer_bytes // paged.page_bytes
    n = 3 * per + 1  # four batches
    gen = torch.Generator().manual_seed(3)
    data = [torch.randn((LAYERS, *paged.page_shape), generator=gen).to(paged.dtype) for _ in range(n)]
    paged.load(data, list(range(1, n + 1))).wait()
    for layer, name in enumerate(LAYER_NAMES):
        assert all(torch.equal(kv[name][1 + i], d[layer]) for i, d in enumerate(data))
    paged.close()


def test_hit_sources_name_the_tier_each_loaded_token_came_from(salt_key_file: str) -> None:
    """vLLM's ``get_external_cache_hit_sources``: the load's tokens by kind of tier, from the
    lookup's runs (memory is host memory), summing to what vLLM loads."""
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    eng = make_engine(vllm_config(salt_key_file))
    salt = mint_salt(SALT_KEY, "acme", "alice")
    tokens = prompt(5 * BLOCK + 3)
    run_prefill(eng, request("r1", tokens, salt), list(range(6)), fill_seed=5)
    req = request("r2", tokens, salt)
    assert matched_tokens(eng.scheduler, req, 2 * BLOCK) == (3 * BLOCK, False)
    eng.scheduler.update_state_after_alloc(req, blocks_of([0, 1, 40, 41, 42, 43]), 3 * BLOCK)
    assert eng.scheduler.get_external_cache_hit_sources(req, 3 * BLOCK) == {CacheHitSource.HOST: 3 * BLOCK}
    # Control: a count other than the planned one is not attributed to a tier.
    req3 = request("r3", tokens, salt)
    matched_tokens(eng.scheduler, req3, 0)
    eng.scheduler.update_state_after_alloc(req3, blocks_of(list(range(10, 16))), 5 * BLOCK)
    assert eng.scheduler.get_external_cache_hit_sources(req3, 4 * BLOCK) == {
        CacheHitSource.EXTERNAL_UNSPECIFIED: 4 * BLOCK}


def never_reload(layout: Any) -> Any:
    """A cost model under which recomputing always wins: loading is absurdly slow."""
    from kvtier.planning.cost_model import CostModel
    from kvtier.planning.profiles import PrefillProfile, TierProfile

    slow = TierProfile("memory", latency_s=10.0, bandwidth_Bps=1.0)
    return CostModel(PrefillProfile(0.0, 1e-9, 0.0), {"memory": slow})


def test_the_connector_passes_its_planner(salt_key_file: str) -> None:
    """``kvtier.planner``: the cost model decides how much of a hit to reload."""
    eng = make_engine(vllm_config(salt_key_file, planner=f"{__name__}:never_reload"))
    salt = mint_salt(SALT_KEY, "acme", "alice")
    tokens = prompt(4 * BLOCK + 3)
    run_prefill(eng, request("r1", tokens, salt), list(range(5)), fill_seed=6)
    assert matched_tokens(eng.scheduler, request("r2", tokens, salt), 0) == (0, False)
    assert eng.scheduler.stats["plan:full-recompute"] == 1
    # Control: without a planner the same hit is reloaded in full.
    plain = make_engine(vllm_config(salt_key_file))
    assert matched_tokens(plain.scheduler, request("r3", tokens, salt), 0) == (4 * BLOCK, False)
    with pytest.raises(ConfigError, match=r"kvtier\.planner"):
        make_engine(vllm_config(salt_key_file, planner="no_such_module:f"))


def test_a_save_after_a_hit_derives_only_the_blocks_it_saves(salt_key_file: str) -> None:
    """The scheduler's chain travels with the save (the block before it, ``after``): the worker
    derives the keys of the blocks it stores and no others."""
    eng = make_engine(vllm_config(salt_key_file))
    salt = mint_salt(SALT_KEY, "acme", "alice")
    doc = prompt(3 * BLOCK)
    run_prefill(eng, request("r1", [*doc, 1], salt), list(range(4)), fill_seed=7)
    assert eng.worker.stats["keys_derived"] == 3
    longer = doc + prompt(2 * BLOCK + 1, base=500)
    res = run_prefill(eng, request("r2", longer, salt), list(range(10, 16)), fill_seed=8)
    assert res.matched == 3 * BLOCK
    assert eng.worker.stats["saved_blocks"] == 5 and eng.worker.stats["keys_derived"] == 3 + 2
    # The keys continued from the scheduler's block are the chain's own: a fresh request finds all 5.
    assert matched_tokens(eng.scheduler, request("r3", longer, salt), 0) == (5 * BLOCK, False)
