"""The transformers connector: a real (random-weight) Llama whose prefix KV comes from kvtier.

For one model and prompt, the greedy tokens are identical and the first-step logits match a
from-scratch computation whether the prefix came from memory, LMDB (plain or encrypted) or was
recomputed, under every plan the cost model knows. S3 and the daemon are in
tests/integration/test_connector_transformers.py.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from connectors.transformers_connector import Generation, TransformersConnector
from kvtier.cache.kv_cache import KVCache, RequestSegment
from kvtier.engine.models import model_spec
from kvtier.engine.prefill import PrefillRunner
from kvtier.errors import AccessDenied, ConfigError, ScopeError
from kvtier.keys import DomainDeriver, ScopeKind
from kvtier.planning.cost_model import CostModel
from kvtier.planning.profiles import PrefillProfile, TierProfile
from kvtier.security.keyring import KeyRing
from kvtier.security.master_keys import LocalKeyProvider
from kvtier.security.policy import ROLE_PUBLISH_PUBLIC, Policy, Principal
from kvtier.security.wrapped_keys import LmdbWrappedKeyStore
from kvtier.store.tier import Tier
from kvtier.store.tiered_store import TieredStore
from storage_backends.lmdb import LmdbTier
from storage_backends.memory import MemoryTier

SPEC = model_spec("tiny").with_dtype("float32")
LAYOUT = SPEC.layout()
BT = LAYOUT.block_tokens
POLICY = Policy(DomainDeriver(b"transformers-connector-test-secret"))
ALICE = Principal("acme", "alice", session="s1", roles=frozenset({ROLE_PUBLISH_PUBLIC}))
BOB = Principal("globex", "bob")
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def runner() -> PrefillRunner:
    torch.manual_seed(0)
    return PrefillRunner(SPEC.build(seed=3), LAYOUT)


def toks(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, SPEC.vocab_size, (n,), generator=g).tolist()


MANUAL = toks(3 * BT, 1)  # public: shared by every tenant
HISTORY = toks(2 * BT + 5, 2)  # the user's own history
QUESTION = toks(13, 3)  # this session's question
TOTAL = len(MANUAL) + len(HISTORY) + len(QUESTION)
FULL = TOTAL // BT  # blocks a cold request saves
REUSABLE = (TOTAL - 1) // BT  # the last token is always computed


def request(history: list[int] = HISTORY, question: list[int] = QUESTION) -> list[RequestSegment]:
    return [RequestSegment(MANUAL, ScopeKind.PUBLIC), RequestSegment(history, ScopeKind.USER),
            RequestSegment(question, ScopeKind.SESSION)]


def bob_request() -> list[RequestSegment]:
    return [RequestSegment(MANUAL, ScopeKind.PUBLIC), RequestSegment(toks(BT + 3, 4), ScopeKind.USER)]


def cost_model(tiers: list[Tier]) -> CostModel:
    return CostModel(PrefillProfile(1e-3, 2e-5, 1e-9, 1e-8),
                     {t.name: TierProfile(t.name, 1e-4, 2e9, encrypted=getattr(t, "sealer", None) is not None)
                      for t in tiers})


def connector(runner: PrefillRunner, tiers: list[Tier], *, with_cost_model: bool = True) -> TransformersConnector:
    cm = cost_model(tiers) if with_cost_model else None
    store = TieredStore(tiers, observer=cm)
    return TransformersConnector(KVCache(store, LAYOUT, POLICY), runner, planner=cm)


def reference(runner: PrefillRunner, segments: list[RequestSegment]) -> Generation:
    """From scratch: nothing cached, nothing saved."""
    conn = TransformersConnector(KVCache(TieredStore([MemoryTier(1 << 20)]), LAYOUT, POLICY), runner, save=False)
    return conn.generate(ALICE, segments, NEW_TOKENS)


def agree(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.std())


@pytest.fixture
def lmdb_dir(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "lmdb"


def keyring(path: Path) -> KeyRing:
    return KeyRing(LocalKeyProvider(os.urandom(32), source="test"), LmdbWrappedKeyStore(path, sync=False))


TIER_SETUPS = ["memory", "lmdb", "lmdb-encrypted", "memory+lmdb"]


def build_tiers(setup: str, path: Path) -> list[Tier]:
    if setup == "memory":
        return [MemoryTier(64 << 20)]
    if setup == "lmdb":
        return [LmdbTier(path / "lmdb", 64 << 20, sync=False)]
    if setup == "lmdb-encrypted":
        return [LmdbTier(path / "lmdb", 64 << 20, sync=False, sealer=keyring(path / "keys"))]
    # A memory tier too small for the prompt: the prefix is split across memory and LMDB.
    return [MemoryTier(3 * LAYOUT.bytes_per_block), LmdbTier(path / "lmdb", 64 << 20, sync=False)]


@pytest.mark.parametrize("setup", TIER_SETUPS)
def test_prefix_from_each_tier_gives_identical_tokens_and_logits(runner: PrefillRunner, setup: str,
                                                                 tmp_path: Path) -> None:
    ref = reference(runner, request())
    conn = connector(runner, build_tiers(setup, tmp_path))
    cold = conn.generate(ALICE, request(), NEW_TOKENS, plan="full-reload")
    assert cold.report.reused_tokens == 0 and cold.report.saved_blocks == FULL
    warm = conn.generate(ALICE, request(), NEW_TOKENS, plan="full-reload")
    assert warm.report.reused_tokens == REUSABLE * BT
    assert warm.report.computed_tokens == TOTAL - REUSABLE * BT
    assert sum(warm.report.loaded_tokens_by_tier.values()) == REUSABLE * BT
    assert warm.tokens == cold.tokens == ref.tokens
    assert agree(warm.first_logits, ref.first_logits) < 1e-4
    assert agree(cold.first_logits, ref.first_logits) < 1e-4
    conn.cache.store.close()


@pytest.mark.parametrize("plan", ["full-recompute", "split", "pipelined"])
def test_every_plan_gives_the_same_tokens(runner: PrefillRunner, plan: str) -> None:
    ref = reference(runner, request())
    conn = connector(runner, [MemoryTier(64 << 20)])
    conn.generate(ALICE, request(), 1)
    got = conn.generate(ALICE, request(), NEW_TOKENS, plan=plan)
    assert got.report.plan == plan
    if plan == "full-recompute":
        assert got.report.reused_tokens == 0
    else:
        assert 0 < got.report.reused_tokens < REUSABLE * BT
    assert got.tokens == ref.tokens
    assert agree(got.first_logits, ref.first_logits) < 1e-4


def test_the_cost_model_chooses_when_no_plan_is_forced(runner: PrefillRunner) -> None:
    conn = connector(runner, [MemoryTier(64 << 20)])
    conn.generate(ALICE, request(), 1)
    got = conn.generate(ALICE, request(), 2)
    assert got.report.plan in got.report.predicted_ms
    assert got.report.predicted_ms[got.report.plan] == min(got.report.predicted_ms.values()) or \
        got.report.plan in ("full-reload", "full-recompute")


def test_public_manual_is_shared_private_history_is_not(runner: PrefillRunner) -> None:
    conn = connector(runner, [MemoryTier(64 << 20)])
    conn.generate(ALICE, request(), 1)
    ref = reference(runner, bob_request())
    got = conn.generate(BOB, bob_request(), NEW_TOKENS, plan="full-reload")
    assert got.report.cached_tokens == 3 * BT  # the public manual; alice's history is hers alone
    assert got.tokens == ref.tokens and agree(got.first_logits, ref.first_logits) < 1e-4
    # Bob may read the manual but not publish it: his own block after it is saved, nothing public.
    assert got.report.saved_blocks == 1
    # Alice's own history, as Bob's: a different key chain, so a miss after the manual.
    as_bob = conn.generate(BOB, [RequestSegment(MANUAL, ScopeKind.PUBLIC), RequestSegment(HISTORY, ScopeKind.USER),
                                 RequestSegment(QUESTION, ScopeKind.USER)], 1, plan="full-reload")
    assert as_bob.report.cached_tokens == 3 * BT


def test_a_block_lost_after_lookup_is_computed_instead(runner: PrefillRunner) -> None:
    ref = reference(runner, request())
    conn = connector(runner, [MemoryTier(64 << 20)], with_cost_model=False)
    conn.generate(ALICE, request(), 1)
    chain = conn.cache.chain(ALICE, request())
    conn.cache.store.delete([chain[3].key])
    got = conn.generate(ALICE, request(), NEW_TOKENS)
    assert got.report.reused_tokens == 3 * BT
    assert got.tokens == ref.tokens and agree(got.first_logits, ref.first_logits) < 1e-4


def test_bad_input_is_refused_and_stores_nothing(runner: PrefillRunner) -> None:
    conn = connector(runner, [MemoryTier(64 << 20)], with_cost_model=False)
    with pytest.raises(ValueError):
        conn.generate(ALICE, [RequestSegment([1, 2, SPEC.vocab_size], ScopeKind.USER)], 1)
    with pytest.raises(ValueError):
        conn.generate(ALICE, [RequestSegment([], ScopeKind.USER)], 1)
    with pytest.raises(ValueError):
        conn.generate(ALICE, request(), 0)
    with pytest.raises((AccessDenied, ScopeError)):
        conn.generate(BOB, request(), 1)  # bob has no session scope
    with pytest.raises((AccessDenied, ScopeError)):
        conn.generate(BOB, [RequestSegment(MANUAL, ScopeKind.ORG)], 1)  # nor an org
    with pytest.raises(ConfigError, match="planner="):
        conn.generate(ALICE, request(), 1, plan="split")  # needs a cost model
    assert conn.cache.store.tiers[0].usage().blocks == 0
    POLICY.revoke("acme/alice")
    try:
        with pytest.raises(AccessDenied):
            conn.generate(ALICE, request(), 1)
    finally:
        POLICY.grant("acme/alice")
    assert conn.cache.store.tiers[0].usage().blocks == 0
