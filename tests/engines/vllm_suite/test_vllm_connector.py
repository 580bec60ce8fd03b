"""The kvtier vLLM connector against the real vLLM package (pinned in tests/engines/vllm-requirements.txt).

Runs inside .venv-vllm (see tests/engines/test_engine_suites.py). vLLM's own factory resolves the
connector from a KVTransferConfig; both roles are driven in vLLM's call order (scheduler:
get_num_new_matched_tokens -> update_state_after_alloc -> build_connector_meta; worker:
bind_connector_metadata -> start_load_kv -> per layer wait_for_layer_load / save_kv_layer ->
wait_for_save -> get_finished / get_block_ids_with_load_errors -> clear_connector_metadata;
scheduler: request_finished) on CPU tensors laid out by vLLM's own ``create_kv_cache_views``.
"""

from __future__ import annotations

import os
import threading
import time

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

from dataclasses import dataclass
from typing import Any

import pytest
import torch
from vllm.config import CacheConfig, KVTransferConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    compute_layout_strides,
    create_kv_cache_views,
)
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

BLOCK = 16
HEADS = 2
HEAD = 8
LAYERS = 3
NUM_BLOCKS = 48
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


def kv_cache_config() -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float16)
    return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(LAYER_NAMES, spec)])


def vllm_config(salt_key_file: str, **extra: Any) -> VllmConfig:
    cfg = {"kvtier.cache": "factory", "kvtier.factory": "tests.engines.cache_factory:memory_cache",
           "kvtier.salt_mapper": "hmac", "kvtier.salt_key_file": salt_key_file, "kvtier.model_id": "suite-model"}
    cfg.update({f"kvtier.{k}": v for k, v in extra.items()})
    kt = KVTransferConfig(kv_connector="KvtierConnector", kv_connector_module_path="connectors.vllm_connector",
                          kv_role="kv_both", kv_connector_extra_config=cfg)
    config = VllmConfig(kv_transfer_config=kt, cache_config=CacheConfig(block_size=BLOCK))
    # The connector supports one full-attention KV group, as vLLM requires of non-HMA connectors.
    config.scheduler_config.disable_hybrid_kv_cache_manager = True
    # This suite builds both connector roles in one process, as vLLM's uniprocess executor does
    # (the in-memory factory cache is refused under the multiprocess one: see the test below).
    config.parallel_config.distributed_executor_backend = "uni"
    return config


def paged_kv(layout: KVCacheLayout = KVCacheLayout.BLHNC) -> dict[str, torch.Tensor]:
    """vLLM's per-layer [B, H, N, C] views over one raw buffer; BLHNC interleaves layers per block,
    so every view is strided (as on a real GPU with that layout)."""
    cfg = kv_cache_config()
    spec = cfg.kv_cache_groups[0].kv_cache_spec
    strides = compute_layout_strides(spec, NUM_BLOCKS, LAYERS, layout)
    size = NUM_BLOCKS * LAYERS * spec.page_size_bytes
    raw = torch.zeros(size, dtype=torch.int8)
    tensor = KVCacheTensor(size=size, layers=LAYER_NAMES, layer_stride=strides[0], block_stride=strides[1])
    views = create_kv_cache_views(raw, spec, NUM_BLOCKS, layout, tensor)
    return dict(zip(LAYER_NAMES, views, strict=True))


@dataclass
class Engine:
    """Both connector roles as vLLM creates them, plus the worker's paged KV."""

    scheduler: KvtierConnector
    worker: KvtierConnector
    kv: dict[str, torch.Tensor]


def make_engine(config: VllmConfig, layout: KVCacheLayout = KVCacheLayout.BLHNC) -> Engine:
    kcc = kv_cache_config()
    sched = KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER, kcc)
    worker = KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, kcc)
    assert isinstance(sched, KvtierConnector) and isinstance(worker, KvtierConnector)
    kv = paged_kv(layout)
    worker.register_kv_caches(kv)
    return Engine(sched, worker, kv)


def request(req_id: str, tokens: list[int], salt: str | None) -> Request:
    return Request(req_id, tokens, SamplingParams(max_tokens=4), None, cache_salt=salt)


def blocks_of(ids: list[int]) -> KVCacheBlocks:
    return KVCacheBlocks((tuple(KVCacheBlock(i) for i in ids),))


@dataclass
class StepResult:
    matched: int
    load_async: bool
    invalid: set[int]
    finished_recving: set[str] | None


def matched_tokens(sched: KvtierConnector, req: Request, computed: int) -> tuple[int | None, bool]:
    """``get_num_new_matched_tokens`` once it has an answer: while the connector's lookup runs off
    the step it answers None, and vLLM's scheduler asks again at a later step, as here."""
    deadline = time.monotonic() + 30
    while (got := sched.get_num_new_matched_tokens(req, computed))[0] is None:
        assert time.monotonic() < deadline, "the lookup never finished"
        time.sleep(0.001)
    return got


def schedule(sched: KvtierConnector, req: Request, block_ids: list[int]) -> tuple[SchedulerOutput, int, bool]:
    """The scheduler's side of one step that admits ``req``: its output (with the connector's
    metadata), the tokens kvtier matched and whether they load asynchronously."""
    matched, is_async = matched_tokens(sched, req, 0)
    assert matched is not None
    sched.update_state_after_alloc(req, blocks_of(block_ids), matched)
    computed = 0 if is_async else matched
    out = SchedulerOutput.make_empty()
    out.scheduled_new_reqs = [NewRequestData(req_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
                                             mm_features=[], sampling_params=req.sampling_params,
                                             pooling_params=None, block_ids=(block_ids,),
                                             num_computed_tokens=computed, lora_request=None)]
    todo = 0 if is_async else req.num_tokens - computed
    out.num_scheduled_tokens = {req.request_id: todo}
    out.total_num_scheduled_tokens = todo
    out.has_sync_kv_loads = matched > 0 and not is_async
    out.kv_connector_metadata = sched.build_connector_meta(out)
    return out, matched, is_async


def worker_step(eng: Engine, out: SchedulerOutput, computed_ids: list[int], fill_seed: int | None) -> None:
    """The worker's side of one step: "the model" writes KV for the blocks it computes
    (``computed_ids``, when ``fill_seed`` is given), the connector loads and saves around it."""
    if fill_seed is not None:
        gen = torch.Generator().manual_seed(fill_seed)
        ids = torch.tensor(computed_ids)
        for t in eng.kv.values():
            t[ids] = torch.randn((len(ids), *t.shape[1:]), generator=gen).to(t.dtype)
    w = eng.worker
    w.bind_connector_metadata(out.kv_connector_metadata)
    w.start_load_kv(None)
    for name in LAYER_NAMES:
        w.wait_for_layer_load(name)
        w.save_kv_layer(name, eng.kv[name], None)
    w.wait_for_save()
    w.flush_saves()  # saves are stored off the step, on the saver thread


def run_prefill(eng: Engine, req: Request, block_ids: list[int], *, fill_seed: int | None = None) -> StepResult:
    """One scheduling step that admits ``req`` and prefills it, in vLLM's call order."""
    out, matched, is_async = schedule(eng.scheduler, req, block_ids)
    computed = 0 if is_async else matched
    w = eng.worker
    worker_step(eng, out, block_ids[computed // BLOCK :], fill_seed)
    invalid = w.get_block_ids_with_load_errors()
    _, recving = w.get_finished(set())
    w.clear_connector_metadata()
    return StepResult(matched, is_async, invalid, recving)


def prompt(n: int, base: int = 0) -> list[int]:
    return [(base + 7 * i) % 30000 for i in range(n)]


def pages(eng: Engine, ids: list[int]) -> list[torch.Tensor]:
    idx = torch.tensor(ids)
    return [eng.kv[n][idx].clone() for n in LAYER_NAMES]


def same_bytes(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a, b, strict=True))


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


# -- the connector's counters through vLLM's KV-connector stats --------------------------------------
def _expected_deltas(role: str, before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {f"{role}.{k}": v - before.get(k, 0) for k, v in after.items() if v > before.get(k, 0)}


def test_get_kv_connector_stats_reports_what_grew_since_the_last_call(salt_key_file: str) -> None:
    """Each role reports exactly the growth of its counters since vLLM last asked, keyed
    ``<role>.<name>``, and None when nothing grew; the saver's jobs show as submitted and stored."""
    eng = make_engine(vllm_config(salt_key_file))
    sched, worker = eng.scheduler, eng.worker
    assert sched.get_kv_connector_stats() is None
    first = worker.get_kv_connector_stats()
    assert first is not None and first.data == {"worker.pages_direct": 1}  # register_kv_caches
    assert worker.get_kv_connector_stats() is None

    salt = mint_salt(SALT_KEY, "acme", "alice")
    tokens = prompt(100)  # 6 full blocks
    s0, w0 = dict(sched.stats), dict(worker.stats)
    run_prefill(eng, request("r1", tokens, salt), list(range(7)), fill_seed=1)
    got_s, got_w = sched.get_kv_connector_stats(), worker.get_kv_connector_stats()
    assert got_s is not None and got_w is not None
    assert got_s.data == _expected_deltas("scheduler", s0, dict(sched.stats))
    want_w = _expected_deltas("worker", w0, dict(worker.stats))
    assert got_w.data == {**want_w, "worker.save_jobs_submitted": 1}
    assert got_w.data["worker.saved_blocks"] == 6 and got_w.data["worker.save_jobs_stored"] == 1
    assert sched.get_kv_connector_stats() is None and worker.get_kv_connector_stats() is None

    run_prefill(eng, request("r2", tokens, salt), list(range(20, 27)))
    got_s, got_w = sched.get_kv_connector_stats(), worker.get_kv_connector_stats()
    assert got_s is not None and got_w is not None
    assert got_s.data["scheduler.load_tokens"] == 6 * BLOCK and got_s.data["scheduler.load_jobs"] == 1
    assert got_w.data["worker.loaded_blocks"] == 6 and "worker.saved_blocks" not in got_w.data
    assert sched.get_kv_connector_stats() is None and worker.get_kv_connector_stats() is None


def test_tier_errors_are_reported_as_deltas_once_per_process(salt_key_file: str) -> None:
    """The tiers' error counts are cumulative; the connector reports their growth. Both roles in one
    process share the tiers: an error is reported once, by the role that asks first."""
    import time

    from connectors.vllm_stats import TIER_ERRORS_EVERY_S

    eng = make_engine(vllm_config(salt_key_file))
    tier = eng.scheduler.source.cache.store.tiers[0]
    eng.scheduler.get_kv_connector_stats()
    eng.worker.get_kv_connector_stats()
    tier.metrics.error("unavailable", 2)  # as the tier counts a failure it turned into a miss
    time.sleep(TIER_ERRORS_EVERY_S)
    got = eng.scheduler.get_kv_connector_stats()
    assert got is not None and got.data == {"scheduler.tier_error:unavailable": 2}
    time.sleep(TIER_ERRORS_EVERY_S)
    assert eng.worker.get_kv_connector_stats() is None, "the scheduler reported them already"
    tier.metrics.error("unavailable")
    time.sleep(TIER_ERRORS_EVERY_S)
    got = eng.worker.get_kv_connector_stats()
    assert got is not None and got.data == {"worker.tier_error:unavailable": 1}


def test_stats_round_trip_through_build_aggregate_reduce_and_vllm_logging(salt_key_file: str) -> None:
    """What vLLM does with the stats: pickled from worker to engine core, summed over workers and
    the scheduler, sent on as ``to_dict()``, rebuilt with ``build_kv_connector_stats``, summed over
    a logging interval and logged as ``reduce()``."""
    import pickle

    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging

    from connectors.vllm_stats import KvtierConnectorStats

    a = KvtierConnector.build_kv_connector_stats({"worker.loaded_blocks": 3, "worker.tier_error:timeout": 1})
    b = KvtierConnector.build_kv_connector_stats({"worker.loaded_blocks": 2, "scheduler.load_tokens": 80})
    assert isinstance(a, KvtierConnectorStats) and pickle.loads(pickle.dumps(a)) == a
    total = a.aggregate(b)
    assert total.to_dict() == {"worker.loaded_blocks": 5, "worker.tier_error:timeout": 1, "scheduler.load_tokens": 80}
    assert a.data == {"worker.loaded_blocks": 3, "worker.tier_error:timeout": 1}, "aggregate leaves its operands"
    assert KvtierConnector.build_kv_connector_stats(total.to_dict()) == total
    assert list(total.reduce()) == sorted(total.data) and total.reduce() == total.data
    assert KvtierConnector.build_kv_connector_stats(None).is_empty()
    assert KvtierConnector.build_kv_connector_stats({"worker.saved_blocks": 0}).is_empty()
    total.reset()
    assert total.is_empty()
    with pytest.raises(ValueError, match="counters only grow"):
        KvtierConnector.build_kv_connector_stats({"worker.saved_blocks": -1})
    with pytest.raises(ValueError, match=r"<role>\.<name>"):
        KvtierConnector.build_kv_connector_stats({"saved_blocks": 1})

    logging_ = KVConnectorLogging(vllm_config(salt_key_file).kv_transfer_config)
    logging_.observe(a.to_dict())
    logging_.observe(b.to_dict())
    lines: list[str] = []
    logging_.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
    assert lines == ["KV Transfer metrics: scheduler.load_tokens=80, worker.loaded_blocks=5, "
                     "worker.tier_error:timeout=1"]


def test_prom_metrics_count_events_per_engine_role_and_event(salt_key_file: str) -> None:
    """``build_prom_metrics`` through vLLM's own KVConnectorProm (as vLLM's Prometheus logger
    creates it), with prometheus_client's metric classes bound to a registry of the test's own:
    one counter family, ``observe`` adds each step's deltas; the bench parses vLLM's exposition of it."""
    from functools import partial

    from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm

    from benchmarks.vllm_server import EVENTS_METRIC, parse_connector_counters
    from connectors.vllm_stats import EVENTS_METRIC as REGISTERED
    from connectors.vllm_stats import KvtierPromMetrics

    registry = CollectorRegistry()

    class TestProm(KVConnectorProm):
        _gauge_cls = partial(Gauge, registry=registry)
        _counter_cls = partial(Counter, registry=registry)
        _histogram_cls = partial(Histogram, registry=registry)

    labels = {0: ["suite-model", "0"], 1: ["suite-model", "1"]}
    prom = TestProm(vllm_config(salt_key_file), ["model_name", "engine"], labels)
    assert isinstance(prom.prom_metrics, KvtierPromMetrics)
    prom.observe({"worker.loaded_blocks": 3, "scheduler.load_tokens": 96}, 0)
    prom.observe({"worker.loaded_blocks": 2}, 0)
    prom.observe({"worker.loaded_blocks": 7}, 1)

    def value(engine: str, role: str, event: str) -> float | None:
        return registry.get_sample_value(f"{REGISTERED}_total", {"model_name": "suite-model", "engine": engine,
                                                                 "role": role, "event": event})

    assert value("0", "worker", "loaded_blocks") == 5 and value("1", "worker", "loaded_blocks") == 7
    assert value("0", "scheduler", "load_tokens") == 96 and value("1", "scheduler", "load_tokens") is None
    assert REGISTRY.get_sample_value(f"{REGISTERED}_total", {"model_name": "suite-model", "engine": "0",
                                                             "role": "worker", "event": "loaded_blocks"}) is None
    # What `kvtier bench vllm` reads from `vllm serve`'s /metrics: summed over engines, by role.
    assert EVENTS_METRIC == REGISTERED
    assert parse_connector_counters(generate_latest(registry).decode()) == {
        "worker": {"loaded_blocks": 12}, "scheduler": {"load_tokens": 96}}


def test_a_stats_file_is_refused_with_where_the_counters_went(salt_key_file: str) -> None:
    with pytest.raises(ConfigError, match=r"kvtier\.stats_file.*vllm:kvtier_connector_events_total"):
        make_engine(vllm_config(salt_key_file, stats_file="/tmp/kvtier-stats"))


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


def _tp_engine(salt_key_file: str) -> tuple[KvtierConnector, list[Engine]]:
    """One scheduler and the workers of two tensor-parallel ranks (each with its own pages)."""
    kcc = kv_cache_config()
    base = vllm_config(salt_key_file)
    base.parallel_config.tensor_parallel_size = 2
    sched = KVConnectorFactory.create_connector(base, KVConnectorRole.SCHEDULER, kcc)
    ranks = []
    for rank in range(2):
        cfg = vllm_config(salt_key_file)
        cfg.parallel_config.tensor_parallel_size = 2
        cfg.parallel_config.rank = rank
        worker = KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER, kcc)
        kv = paged_kv()
        worker.register_kv_caches(kv)
        ranks.append(Engine(sched, worker, kv))
    assert isinstance(sched, KvtierConnector)
    return sched, ranks


def _tp_step(sched: KvtierConnector, ranks: list[Engine], req: Request, block_ids: list[int],
             fill_seed: int | None = None) -> int:
    """One step of ``req`` through the scheduler and both ranks' workers (each rank's model writes
    its own KV: a rank's heads differ from the other's)."""
    out, matched, _ = schedule(sched, req, block_ids)
    for rank, eng in enumerate(ranks):
        w = eng.worker
        worker_step(eng, out, block_ids[matched // BLOCK :], None if fill_seed is None else fill_seed + rank)
        assert not w.get_block_ids_with_load_errors()
        w.clear_connector_metadata()
    sched.request_finished(req, block_ids)
    return matched


def test_tensor_parallel_ranks_load_the_schedulers_lookup_of_their_own_keys(salt_key_file: str) -> None:
    """With TP=2 the scheduler looks up both ranks' chains; each worker loads its own rank's blocks
    from that lookup (no worker looks up), byte for byte, and derives only the keys it saves."""
    sched, ranks = _tp_engine(salt_key_file)
    assert ranks[0].worker.layout.fingerprint != ranks[1].worker.layout.fingerprint
    salt = mint_salt(SALT_KEY, "acme", "alice")
    tokens = prompt(4 * BLOCK + 1)
    assert _tp_step(sched, ranks, request("r1", tokens, salt), [0, 1, 2, 3, 4], fill_seed=11) == 0
    assert [e.worker.stats["keys_derived"] for e in ranks] == [4, 4]
    assert _tp_step(sched, ranks, request("r2", tokens, salt), [10, 11, 12, 13, 14]) == 4 * BLOCK
    for eng in ranks:
        w = eng.worker.stats
        assert w["loaded_blocks"] == 4 and w.get("load_looked_up_by_worker", 0) == 0
        for name in LAYER_NAMES:
            assert torch.equal(eng.kv[name][[10, 11, 12, 13]], eng.kv[name][[0, 1, 2, 3]])
    assert not torch.equal(ranks[0].kv[LAYER_NAMES[0]][0], ranks[1].kv[LAYER_NAMES[0]][0]), \
        "control: the ranks' KV differ, so a rank reading the other's blocks would be caught"
    assert sched.stats.get("rank_lookup_failed", 0) == 0


def test_tensor_parallel_load_offers_only_what_every_rank_holds(salt_key_file: str) -> None:
    """A block rank 1 lacks (evicted, say) is offered to no rank: the hit is the shorter lookup."""
    sched, ranks = _tp_engine(salt_key_file)
    salt = mint_salt(SALT_KEY, "acme", "alice")
    tokens = prompt(4 * BLOCK + 1)
    _tp_step(sched, ranks, request("r1", tokens, salt), [0, 1, 2, 3, 4], fill_seed=3)
    # Drop rank 1's last two blocks from its cache (the scheduler's rank-1 source is the same one).
    tenant = ranks[1].worker.source.for_salt(salt)
    chain = tenant.cache.chain(tenant.principal, [RequestSegment(tuple(tokens[: 4 * BLOCK]), ScopeKind.USER)])
    assert tenant.cache.store.delete([cb.key for cb in chain[2:]]) == {"memory": 2}
    assert _tp_step(sched, ranks, request("r2", tokens, salt), [10, 11, 12, 13, 14]) == 2 * BLOCK
    assert [e.worker.stats["loaded_blocks"] for e in ranks] == [2, 2]
