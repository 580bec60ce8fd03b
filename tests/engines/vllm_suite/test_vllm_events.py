"""kvtier's tiers in vLLM's KV-event stream, checked against vLLM's own event structs and encoding.

Runs inside .venv-vllm (see tests/engines/test_engine_suites.py), with real tiers (memory, LMDB)
behind an in-process cache; the daemon's side of the watch (gRPC) is tested in
tests/integration/test_held_watch_daemon.py. The connector is driven in vLLM's call order
(get_num_new_matched_tokens -> update_state_after_alloc -> build_connector_meta, the worker's
step, then the scheduler's ``take_events``, which vLLM publishes as one ``KVEventBatch`` per
step); every batch is encoded with msgspec's msgpack encoder, as vLLM's ZMQ publisher does, and
decoded with vLLM's own ``KVEventBatch`` type, so what a router would read is what is checked.
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
import zmq
from vllm.config import KVEventsConfig, VllmConfig
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventPublisherFactory,
    KVEventBatch,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash, maybe_convert_block_hash
from vllm.v1.request import Request

from connectors.identity import mint_salt
from connectors.vllm_connector import KvtierConnector
from connectors.vllm_events import is_local_endpoint
from kvtier.cache.held_watch import HeldWatch
from kvtier.cache.kv_cache import KVCache, RequestSegment
from kvtier.errors import ConfigError
from kvtier.keys import DomainDeriver, ScopeKind
from kvtier.layout import KVLayout
from kvtier.security.policy import ROLE_PUBLISH_PUBLIC, Policy, Principal
from kvtier.store.tiered_store import TieredStore
from storage_backends.memory import MemoryTier
from tests.engines.cache_factory import SERVER_SECRET
from tests.engines.vllm_suite.conftest import SALT_KEY
from tests.engines.vllm_suite.vllm_rig import (
    BLOCK,
    HEAD,
    HEADS,
    LAYERS,
    Engine,
    kv_cache_config,
    make_engine,
    paged_kv,
    prompt,
    run_prefill,
    tp_step,
    vllm_config,
)

init_none_hash(sha256)
HASHER = get_request_block_hasher(BLOCK, sha256)
ENCODE = msgspec.msgpack.Encoder()  # what vLLM's ZmqEventPublisher encodes a batch with
DECODE = msgspec.msgpack.Decoder(type=KVEventBatch)
BLOCK_BYTES = LAYERS * HEADS * BLOCK * 2 * HEAD * 2  # one block of every layer, K and V, fp16




def events_config(salt_key_file: str, endpoint: str = "ipc:///tmp/kvtier-suite-events", *,
                  replay: str | None = None, enabled: bool = True, **extra: Any) -> VllmConfig:
    """The suite's engine with vLLM's KV events on ``endpoint``; synced in every take_events."""
    extra.setdefault("kv_events_interval_s", 0)
    config = vllm_config(salt_key_file, **extra)
    config.kv_events_config = KVEventsConfig(enable_kv_cache_events=enabled, publisher="zmq", endpoint=endpoint,
                                             replay_endpoint=replay)
    return config


class SlowerMemoryTier(MemoryTier):
    """A second, real memory tier under the first: this venv has no LMDB tier (its encoding needs
    protobuf), and what is checked here is how the connector reports a block changing tiers. The
    daemon's LMDB tier is checked behind the real daemon in tests/integration/test_held_watch_daemon.py."""

    name = "memory2"


def two_tier_cache(cfg: Mapping[str, Any], layout: KVLayout) -> KVCache:
    """``kvtier.factory`` for this suite: memory (``memory_bytes``) over a second memory tier."""
    tiers = [MemoryTier(int(cfg.get("memory_bytes", 64 << 20))), SlowerMemoryTier(64 << 20)]
    return KVCache(TieredStore(tiers), layout, Policy(DomainDeriver(SERVER_SECRET)))


def two_tiers(**extra: Any) -> dict[str, Any]:
    """Options for an engine on ``two_tier_cache``, its lower tier reported as the disk medium."""
    return {"factory": "tests.engines.vllm_suite.test_vllm_events:two_tier_cache",
            "kv_events_mediums": "memory=CPU,memory2=DISK", **extra}


def request(req_id: str, tokens: list[int], salt: str) -> Request:
    """A request as vLLM's scheduler holds it: its engine block hashes computed by vLLM's hasher."""
    return Request(req_id, tokens, SamplingParams(max_tokens=4), None, cache_salt=salt, block_hasher=HASHER)


def published(eng: Engine) -> list[Any]:
    """The scheduler's events of one step, through vLLM's wire format and back."""
    batch = KVEventBatch(ts=time.time(), events=list(eng.scheduler.take_events()))
    return DECODE.decode(ENCODE.encode(batch)).events


def engine_hashes(req: Request, n: int, start: int = 0) -> list[Any]:
    return [maybe_convert_block_hash(h) for h in req.block_hashes[start:n]]


def stored(events: list[Any]) -> list[BlockStored]:
    return [e for e in events if isinstance(e, BlockStored)]


def removed(events: list[Any]) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    for e in events:
        if isinstance(e, BlockRemoved):
            out.setdefault(e.medium, []).extend(e.block_hashes)
    return out


def keys_of(eng: Engine, user: str, req: Request, n: int) -> list[Any]:
    """kvtier's keys of the first ``n`` blocks of ``req`` (a private request of acme/<user>)."""
    cache = eng.scheduler.source.cache
    segment = RequestSegment(req.prompt_token_ids[: n * BLOCK], ScopeKind.USER)
    return [c.key for c in cache.chain(Principal("acme", user), [segment])]


def publish_document(eng: Engine, doc: list[int]) -> None:
    cache = eng.scheduler.source.cache
    publisher = Principal("ops", "publisher", roles=frozenset({ROLE_PUBLISH_PUBLIC}))
    chain = cache.chain(publisher, [RequestSegment(doc, ScopeKind.PUBLIC)])
    gen = torch.Generator().manual_seed(9)
    cache.save(publisher, chain, [torch.randn(cache.layout().block_shape, generator=gen).half() for _ in chain])


# -- what a BlockStored says ------------------------------------------------------------------------
def test_private_blocks_carry_no_tokens_or_salt_and_public_ones_carry_their_tokens(salt_key_file: str) -> None:
    eng = make_engine(events_config(salt_key_file, scope_rule="public-registry"))
    doc = prompt(4 * BLOCK, base=11)
    publish_document(eng, doc)
    bob = mint_salt(SALT_KEY, "globex", "bob")
    req = request("b1", doc + prompt(2 * BLOCK + 3, base=999), bob)  # 4 public blocks, 2 private
    run_prefill(eng, req, list(range(8)), fill_seed=6)
    events = published(eng)
    assert not any(isinstance(e, AllBlocksCleared) for e in events)
    public, private = stored(events)
    # Control: the public blocks carry their tokens (a router can hash them), under kvtier's medium.
    assert public.block_hashes == engine_hashes(req, 4) and public.parent_block_hash is None
    assert public.token_ids == doc and public.block_size == BLOCK and public.medium == "CPU"
    # Bob's private blocks (saved by this step) carry their engine hashes and nothing else.
    assert private.block_hashes == engine_hashes(req, 6, 4)
    assert private.parent_block_hash == maybe_convert_block_hash(req.block_hashes[3])
    assert private.token_ids == [] and private.extra_keys is None
    assert private.lora_id is None and private.lora_name is None and private.medium == "CPU"
    # The salt is nowhere in what leaves the engine: vLLM's own event of these blocks would carry it.
    wire = ENCODE.encode(KVEventBatch(ts=0.0, events=events))
    assert bob.encode() not in wire
    theirs = BlockStored(block_hashes=private.block_hashes, parent_block_hash=None, token_ids=req.prompt_token_ids,
                         block_size=BLOCK, lora_id=None, medium="GPU", lora_name=None, extra_keys=[(bob,)])
    assert bob.encode() in ENCODE.encode(KVEventBatch(ts=0.0, events=[theirs]))  # the check can fail
    assert eng.scheduler.stats["events_stored_blocks"] == 6


def test_a_lookup_hit_is_reported_and_nothing_is_reported_twice(salt_key_file: str) -> None:
    eng = make_engine(events_config(salt_key_file))
    alice = mint_salt(SALT_KEY, "acme", "alice")
    tokens = prompt(5 * BLOCK + 2)
    first = request("r1", tokens, alice)
    run_prefill(eng, first, list(range(6)), fill_seed=1)
    (ev,) = published(eng)
    assert isinstance(ev, BlockStored) and ev.block_hashes == engine_hashes(first, 5)
    # The same prompt again: found in kvtier, already reported; nothing new to say.
    run_prefill(eng, request("r2", tokens, alice), list(range(10, 16)))
    assert published(eng) == []
    # Another request sharing the first 3 blocks, then 2 of its own: only those 2 are new.
    other = request("r3", tokens[: 3 * BLOCK] + prompt(2 * BLOCK + 1, base=5), alice)
    run_prefill(eng, other, list(range(20, 26)), fill_seed=3)
    (ev,) = published(eng)
    assert ev.block_hashes == engine_hashes(other, 5, 3)
    assert ev.parent_block_hash == maybe_convert_block_hash(other.block_hashes[2])


# -- removals ---------------------------------------------------------------------------------------
def test_a_purge_retracts_exactly_the_purged_blocks(salt_key_file: str) -> None:
    eng = make_engine(events_config(salt_key_file))
    alice, bob = mint_salt(SALT_KEY, "acme", "alice"), mint_salt(SALT_KEY, "globex", "bob")
    ra, rb = request("a", prompt(3 * BLOCK + 1), alice), request("b", prompt(2 * BLOCK + 1, base=3), bob)
    run_prefill(eng, ra, list(range(4)), fill_seed=1)
    run_prefill(eng, rb, list(range(10, 13)), fill_seed=2)
    assert sum(len(e.block_hashes) for e in stored(published(eng))) == 5
    cache = eng.scheduler.source.cache
    cache.purge(Principal("acme", "alice"), "user", reason="suite")
    events = published(eng)
    assert removed(events) == {"CPU": engine_hashes(ra, 3)}  # bob's blocks stay reported
    assert not any(isinstance(e, (AllBlocksCleared, BlockStored)) for e in events)
    assert published(eng) == []  # told once


def test_a_revoked_principals_blocks_are_retracted(salt_key_file: str) -> None:
    eng = make_engine(events_config(salt_key_file))
    alice, bob = mint_salt(SALT_KEY, "acme", "alice"), mint_salt(SALT_KEY, "globex", "bob")
    ra, rb = request("a", prompt(2 * BLOCK + 1), alice), request("b", prompt(2 * BLOCK + 1, base=3), bob)
    run_prefill(eng, ra, list(range(3)), fill_seed=1)
    run_prefill(eng, rb, list(range(10, 13)), fill_seed=2)
    published(eng)
    eng.scheduler.source.cache.policy.revoke("acme/alice", reason="suite")
    assert removed(published(eng)) == {"CPU": engine_hashes(ra, 2)}


def test_eviction_moves_a_block_to_the_disk_medium_or_retracts_it(salt_key_file: str) -> None:
    eng = make_engine(events_config(salt_key_file, **two_tiers(memory_bytes=4 * BLOCK_BYTES)))
    alice = mint_salt(SALT_KEY, "acme", "alice")
    old = request("old", prompt(3 * BLOCK + 1), alice)
    run_prefill(eng, old, list(range(4)), fill_seed=1)
    assert [e.medium for e in stored(published(eng))] == ["CPU"]
    # Four newer blocks push the old ones out of memory, down into the slower tier.
    run_prefill(eng, request("new", prompt(4 * BLOCK + 1, base=7), alice), list(range(10, 15)), fill_seed=2)
    events = published(eng)
    moved = engine_hashes(old, 3)
    assert removed(events) == {"CPU": moved}
    assert set(moved) <= {h for e in stored(events) if e.medium == "DISK" for h in e.block_hashes}
    # Once that tier loses them too, they are retracted from the disk medium.
    eng.scheduler.source.cache.store.tiers[1].delete(keys_of(eng, "alice", old, 3))
    assert removed(published(eng)) == {"DISK": moved}


def test_a_restarted_node_that_lost_its_memory_retracts_only_what_is_gone(salt_key_file: str) -> None:
    eng = make_engine(events_config(salt_key_file, **two_tiers()))
    alice = mint_salt(SALT_KEY, "acme", "alice")
    mem, disk = request("m", prompt(2 * BLOCK + 1), alice), request("d", prompt(2 * BLOCK + 1, base=5), alice)
    run_prefill(eng, mem, list(range(3)), fill_seed=1)
    run_prefill(eng, disk, list(range(10, 13)), fill_seed=2)
    assert [e.medium for e in stored(published(eng))] == ["CPU", "CPU"]
    store = eng.scheduler.source.cache.store
    memory, lower = store.tiers
    # One request's blocks also reached the lower tier; then the node restarts: its memory tier
    # comes back empty and its watch table is a new one (as a restarted daemon's).
    lower.put([b for b in memory.get(keys_of(eng, "alice", disk, 2)) if b is not None])
    memory.delete(keys_of(eng, "alice", mem, 2) + keys_of(eng, "alice", disk, 2))
    reporter = eng.scheduler.kv_events
    assert reporter is not None
    reporter.nodes[0].feed.watcher = HeldWatch(store, eng.scheduler.source.cache.policy)
    events = published(eng)
    # Precisely: both are gone from memory; the second is on disk; no AllBlocksCleared (it would also
    # wipe the engine's GPU blocks from a router's view).
    assert {m: sorted(hs) for m, hs in removed(events).items()} == {"CPU": sorted(engine_hashes(mem, 2) +
                                                                              engine_hashes(disk, 2))}
    assert [(e.medium, e.block_hashes) for e in stored(events)] == [("DISK", engine_hashes(disk, 2))]
    assert not any(isinstance(e, AllBlocksCleared) for e in events)
    assert eng.scheduler.stats["events_rewatch"] == 1


def test_the_reporter_is_bounded_and_retracts_what_it_stops_following(salt_key_file: str) -> None:
    eng = make_engine(events_config(salt_key_file, kv_events_max_blocks=4))
    alice = mint_salt(SALT_KEY, "acme", "alice")
    first, second = request("a", prompt(3 * BLOCK + 1), alice), request("b", prompt(3 * BLOCK + 1, base=4), alice)
    run_prefill(eng, first, list(range(4)), fill_seed=1)
    published(eng)
    run_prefill(eng, second, list(range(10, 14)), fill_seed=2)
    events = published(eng)
    assert removed(events) == {"CPU": engine_hashes(first, 2)}  # the two least recently followed
    assert eng.scheduler.kv_events is not None and eng.scheduler.kv_events.followed() == 4


def test_with_tensor_parallelism_a_block_is_held_while_every_ranks_key_is(salt_key_file: str) -> None:
    kcc = kv_cache_config()

    def config(rank: int) -> VllmConfig:
        cfg = events_config(salt_key_file)
        cfg.parallel_config.tensor_parallel_size = 2
        cfg.parallel_config.rank = rank
        return cfg

    sched = KVConnectorFactory.create_connector(config(0), KVConnectorRole.SCHEDULER, kcc)
    assert isinstance(sched, KvtierConnector)
    ranks = []
    for rank in range(2):
        worker = KVConnectorFactory.create_connector(config(rank), KVConnectorRole.WORKER, kcc)
        assert isinstance(worker, KvtierConnector)
        kv = paged_kv()
        worker.register_kv_caches(kv)
        ranks.append(Engine(sched, worker, kv))
    salt = mint_salt(SALT_KEY, "acme", "alice")
    req = request("r1", prompt(4 * BLOCK + 1), salt)
    tp_step(sched, ranks, req, [0, 1, 2, 3, 4], fill_seed=3)
    eng = Engine(sched, ranks[0].worker, ranks[0].kv)
    events = published(eng)
    assert [h for e in stored(events) for h in e.block_hashes] == engine_hashes(req, 4), dict(sched.stats)
    # Rank 1 loses its last two blocks; rank 0 still holds them: the engine cannot load them.
    tenant = ranks[1].worker.source.for_salt(salt)
    chain = tenant.cache.chain(tenant.principal, [RequestSegment(req.prompt_token_ids[: 4 * BLOCK], ScopeKind.USER)])
    assert tenant.cache.store.delete([cb.key for cb in chain[2:]]) == {"memory": 2}
    assert removed(published(eng)) == {"CPU": engine_hashes(req, 4, 2)}


# -- the real publisher ----------------------------------------------------------------------------
def test_events_reach_a_subscriber_of_vllms_own_zmq_publisher(salt_key_file: str, tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path}/kv-events"
    config = events_config(salt_key_file, endpoint)
    eng = make_engine(config)
    alice = mint_salt(SALT_KEY, "acme", "alice")
    req = request("r1", prompt(2 * BLOCK + 1), alice)
    run_prefill(eng, req, list(range(3)), fill_seed=1)
    publisher = EventPublisherFactory.create(config.kv_events_config)  # what vLLM's scheduler builds
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.connect(endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    try:
        # A PUB socket drops what it sends before a subscriber has joined: knock until one lands.
        deadline = time.monotonic() + 10
        while not sub.poll(50):
            assert time.monotonic() < deadline, "the subscriber never joined"
            publisher.publish(KVEventBatch(ts=time.time(), events=[]))
        while sub.poll(50):
            sub.recv_multipart()
        publisher.publish(KVEventBatch(ts=time.time(), events=list(eng.scheduler.take_events())))
        assert sub.poll(5000)
        topic, seq, payload = sub.recv_multipart()
        (ev,) = DECODE.decode(payload).events
        assert isinstance(ev, BlockStored) and ev.block_hashes == engine_hashes(req, 2) and ev.medium == "CPU"
        assert int.from_bytes(seq, "big") >= 1 and topic == b""
    finally:
        sub.close(linger=0)
        publisher.shutdown()


# -- configuration ---------------------------------------------------------------------------------
@pytest.mark.parametrize("endpoint,replay", [
    ("tcp://*:5557", None),            # vLLM's default: every interface
    ("tcp://0.0.0.0:5557", None),
    ("tcp://10.1.2.3:5557", None),     # vLLM connects its PUB socket to another host
    ("tcp://[::]:5557", None),
    ("tcp://127.0.0.1:5557", "tcp://*:5558"),  # replays serve the same batches
])
def test_events_that_would_leave_the_host_refuse_to_start(salt_key_file: str, endpoint: str,
                                                          replay: str | None) -> None:
    with pytest.raises(ConfigError, match="allow_remote_kv_events"):
        KVConnectorFactory.create_connector(events_config(salt_key_file, endpoint, replay=replay),
                                            KVConnectorRole.SCHEDULER, kv_cache_config())
    with pytest.raises(ConfigError, match="leave this host"):  # the worker refuses too
        KVConnectorFactory.create_connector(events_config(salt_key_file, endpoint, replay=replay),
                                            KVConnectorRole.WORKER, kv_cache_config())


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1:5557", "tcp://localhost:5557", "tcp://[::1]:5557",
                                      "ipc:///tmp/kvtier-events", "inproc://events"])
def test_loopback_and_ipc_endpoints_start(salt_key_file: str, endpoint: str) -> None:
    c = KVConnectorFactory.create_connector(events_config(salt_key_file, endpoint), KVConnectorRole.SCHEDULER,
                                            kv_cache_config())
    assert isinstance(c, KvtierConnector) and c.kv_events is not None
    assert is_local_endpoint(endpoint)


def test_a_remote_endpoint_starts_when_the_operator_opts_in_by_name(salt_key_file: str) -> None:
    c = KVConnectorFactory.create_connector(events_config(salt_key_file, "tcp://*:5557", allow_remote_kv_events=True),
                                            KVConnectorRole.SCHEDULER, kv_cache_config())
    assert isinstance(c, KvtierConnector) and c.kv_events is not None


def test_without_vllm_events_there_is_no_reporter_and_no_endpoint_rule(salt_key_file: str) -> None:
    off = events_config(salt_key_file, "tcp://*:5557", enabled=False)
    c = KVConnectorFactory.create_connector(off, KVConnectorRole.SCHEDULER, kv_cache_config())
    assert isinstance(c, KvtierConnector) and c.kv_events is None and list(c.take_events()) == []
    mine_off = events_config(salt_key_file, kv_events=False)  # vLLM's own events only
    c = KVConnectorFactory.create_connector(mine_off, KVConnectorRole.SCHEDULER, kv_cache_config())
    assert isinstance(c, KvtierConnector) and c.kv_events is None


@pytest.mark.parametrize("extra,match", [
    ({"kv_events": True, "_off": True}, "publishes no KV events"),
    ({"kv_events": "maybe"}, "expected true or false"),
    ({"allow_remote_kv_events": "sure"}, "expected true or false"),
    ({"kv_events_mediums": "memory"}, "tier=MEDIUM"),
    ({"kv_events_mediums": {"memory": "CPU", "lmdb": ""}}, "each with a medium"),
    ({"kv_events_interval_s": -1}, "interval_s"),
    ({"kv_events_max_blocks": 0}, "max_blocks"),
])
def test_bad_event_options_are_refused_by_name(salt_key_file: str, extra: dict[str, Any], match: str) -> None:
    off = extra.pop("_off", False)
    with pytest.raises(ConfigError, match=match):
        KVConnectorFactory.create_connector(events_config(salt_key_file, enabled=not off, **extra),
                                            KVConnectorRole.SCHEDULER, kv_cache_config())


def test_mediums_are_configurable(salt_key_file: str) -> None:
    eng = make_engine(events_config(salt_key_file, kv_events_mediums="memory=cpu_pinned"))
    run_prefill(eng, request("r", prompt(BLOCK + 1), mint_salt(SALT_KEY, "acme", "alice")), [0, 1], fill_seed=1)
    assert [e.medium for e in stored(published(eng))] == ["cpu_pinned"]

