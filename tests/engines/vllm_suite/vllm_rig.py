"""The vLLM connector suite's engine: vLLM's own configs and paged KV views on CPU, the
connector's two roles, and one scheduling step driven in vLLM's call order (the module docstring
of test_vllm_connector.py lists it). Runs inside .venv-vllm."""

from __future__ import annotations

import os
import time

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

from dataclasses import dataclass
from typing import Any

import torch
from vllm.config import CacheConfig, KVTransferConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    compute_layout_strides,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.request import Request

from connectors.vllm_connector import KvtierConnector

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


def tp_step(sched: KvtierConnector, ranks: list[Engine], req: Request, block_ids: list[int],
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
