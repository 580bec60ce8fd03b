"""The kvtier vLLM connector under tensor parallelism: one scheduler, the workers of several ranks
(each with its own pages), each loading its own keys of the scheduler's lookup. Runs inside
.venv-vllm.
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import torch
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from connectors.identity import mint_salt
from connectors.vllm_connector import KvtierConnector
from kvtier.cache.kv_cache import RequestSegment
from kvtier.keys import ScopeKind
from tests.engines.vllm_suite.conftest import SALT_KEY
from tests.engines.vllm_suite.vllm_rig import (
    BLOCK,
    LAYER_NAMES,
    Engine,
    kv_cache_config,
    paged_kv,
    prompt,
    request,
    tp_step,
    vllm_config,
)


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


def test_tensor_parallel_ranks_load_the_schedulers_lookup_of_their_own_keys(salt_key_file: str) -> None:
    """With TP=2 the scheduler looks up both ranks' chains; each worker loads its own rank's blocks
    from that lookup (no worker looks up), byte for byte, and derives only the keys it saves."""
    sched, ranks = _tp_engine(salt_key_file)
    assert ranks[0].worker.layout.fingerprint != ranks[1].worker.layout.fingerprint
    salt = mint_salt(SALT_KEY, "acme", "alice")
    tokens = prompt(4 * BLOCK + 1)
    assert tp_step(sched, ranks, request("r1", tokens, salt), [0, 1, 2, 3, 4], fill_seed=11) == 0
    assert [e.worker.stats["keys_derived"] for e in ranks] == [4, 4]
    assert tp_step(sched, ranks, request("r2", tokens, salt), [10, 11, 12, 13, 14]) == 4 * BLOCK
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
    tp_step(sched, ranks, request("r1", tokens, salt), [0, 1, 2, 3, 4], fill_seed=3)
    # Drop rank 1's last two blocks from its cache (the scheduler's rank-1 source is the same one).
    tenant = ranks[1].worker.source.for_salt(salt)
    chain = tenant.cache.chain(tenant.principal, [RequestSegment(tuple(tokens[: 4 * BLOCK]), ScopeKind.USER)])
    assert tenant.cache.store.delete([cb.key for cb in chain[2:]]) == {"memory": 2}
    assert tp_step(sched, ranks, request("r2", tokens, salt), [10, 11, 12, 13, 14]) == 2 * BLOCK
    assert [e.worker.stats["loaded_blocks"] for e in ranks] == [2, 2]
