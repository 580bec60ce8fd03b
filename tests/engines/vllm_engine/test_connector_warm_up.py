"""The vLLM connector pays its first-use costs at engine start (issue 31), and a daemon that is not
up yet costs engine start one bounded wait and a counted warning, not a failure: the engine
starts, and its requests connect when the daemon is back (the running engines in
test_vllm_engine.py show the warmed path: the worker's one region attach is its warm-up's)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
import torch
from vllm.config import CacheConfig, KVTransferConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

from connectors.provision import forget_shared_caches
from connectors.vllm_connector import KvtierConnector

LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]


def _config(token_file: Path, **extra: object) -> VllmConfig:
    cfg = {"kvtier.cache": "daemon", "kvtier.daemon": "127.0.0.1:1", "kvtier.daemon_token_file": str(token_file),
           "kvtier.model_id": "warm-up-test", "kvtier.daemon_timeout_s": 30.0}
    cfg.update({f"kvtier.{k}": v for k, v in extra.items()})
    kt = KVTransferConfig(kv_connector="KvtierConnector", kv_connector_module_path="connectors.vllm_connector",
                          kv_role="kv_both", kv_connector_extra_config=cfg)
    config = VllmConfig(kv_transfer_config=kt, cache_config=CacheConfig(block_size=16))
    config.scheduler_config.disable_hybrid_kv_cache_manager = True
    return config


def _kv_cache_config() -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float16)
    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(LAYERS, spec)])


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    p = tmp_path / "engine.token"
    p.write_text("not-a-real-token")
    p.chmod(0o600)
    yield p
    forget_shared_caches()


@pytest.mark.parametrize("role", [KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER])
def test_an_unreachable_daemon_at_start_is_a_bounded_counted_warning(token_file, role, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="kvtier.connector")
    t0 = time.monotonic()
    conn = KvtierConnector(_config(token_file, warm_up_timeout_s=0.3), role, _kv_cache_config())
    took = time.monotonic() - t0
    try:
        assert conn.stats["warm_up_failed"] == 1 and "warm_up_us" not in conn.stats
        assert any("not warmed up at engine start" in r.getMessage() and "not reachable within 0.3 s"
                   in r.getMessage() for r in caplog.records)
        # Bounded by kvtier.warm_up_timeout_s, not by the daemon's per-call deadline (30 s here);
        # the control is the engine suite, where the same start takes the warm-up's milliseconds.
        assert took < 3, took
        role_name = "worker" if role == KVConnectorRole.WORKER else "scheduler"
        stats = conn.get_kv_connector_stats()
        assert stats is not None and stats.data[f"{role_name}.warm_up_failed"] == 1
        # No region could be attached, and none is claimed.
        assert not any(k.endswith(("data_plane_attaches", "warm_up_us", "warm_up_region_bytes")) for k in stats.data)
    finally:
        conn.shutdown()


def test_tensor_parallel_ranks_wait_for_an_unreachable_daemon_once(token_file, caplog) -> None:
    """The scheduler of a TP=4 engine has one source per rank, all on the node's one daemon: one
    bounded wait and one warning for the daemon, every rank's source counted (the control is the
    TP=1 scheduler above: one source, one count)."""
    caplog.set_level(logging.WARNING, logger="kvtier.connector")
    config = _config(token_file, warm_up_timeout_s=0.3)
    config.parallel_config.tensor_parallel_size = 4
    conn = KvtierConnector(config, KVConnectorRole.SCHEDULER, _kv_cache_config())
    try:
        assert conn.stats["warm_up_failed"] == 4
        assert sum("not warmed up at engine start" in r.getMessage() for r in caplog.records) == 1
    finally:
        conn.shutdown()
