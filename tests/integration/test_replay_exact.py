"""Replay through the real key derivation, policies and store: exact hit counts, the trace README's
figures, metadata mode agreeing with payload mode, and privacy of private blocks across users."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import pytest

from benchmarks.replay_reference import BeladyReference
from benchmarks.replay_workload import MODES, Capacity, TierSpec, build_workload, make_block, parse_tiers
from benchmarks.replayer import ReplayConfig, Replayer, replay
from benchmarks.trace import (
    MooncakeScenario,
    MooncakeTrace,
    Part,
    Scenario,
    ScenarioRequest,
    SeedScenario,
    default_trace_path,
)
from benchmarks.trace import token_stream as tokens
from kvtier.errors import CorruptRecord
from kvtier.store.eviction import POLICIES
from kvtier.store.tiered_store import TieredStore
from storage_backends.gpu import GpuTier

TRACE = default_trace_path()
README_SHA256 = "bd070915a98fc0ed264d7cfef2ce746002eb3076a695ec31ba2674c0111ec131"


@pytest.fixture(scope="module")
def trace() -> MooncakeTrace:
    # Always present here and in CI (../shared/data beside the checkout): a missing trace is a failure.
    assert TRACE.is_file(), f"Mooncake trace missing at {TRACE}"
    return MooncakeTrace.load(TRACE)


def seed_run(isolation: str, config: ReplayConfig | None = None, mode: str = "meta") -> dict:
    wl = build_workload(SeedScenario(), f"seed-{isolation}", isolation, 16, MODES[mode], show_progress=False)
    return replay(wl, config or ReplayConfig(mode=mode), show_progress=False)


# -- seed scenarios, unbounded ----------------------------------------------------------------------
def test_seed_shared_exact():
    r = seed_run("shared")
    assert (r["requests"], r["input_tokens"], r["hit_tokens"]) == (100, 1_050_000, 990_000)
    assert r["hit_tokens"] == r["ideal_hit_tokens"]
    # 625 document blocks, 99 times; the 31 full question blocks of each request never repeat.
    assert (r["hit_blocks"], r["blocks"]) == (99 * 625, 100 * 656)
    assert r["per_tier"]["memory"]["evictions"] == 0
    assert r["verified_blocks"] == r["hit_blocks"]


def test_seed_isolated_exact():
    r = seed_run("isolated")
    assert (r["input_tokens"], r["hit_tokens"]) == (1_050_000, 900_000)
    assert r["cross_user_hits"] == 0 and r["cross_user_private_hits"] == 0


def test_seed_segmented_reaches_shared_without_private_hits_across_users():
    r = seed_run("segmented")
    assert r["hit_tokens"] == 990_000
    assert r["cross_user_hits"] == 90 * 625  # the public document, read by other users
    assert r["cross_user_private_hits"] == 0


class RepeatedQuestions(Scenario):
    """3 users each ask the same 2 questions twice after a public document: private blocks could
    match across users if scopes leaked into nothing; they must hit only within a user."""

    name = "repeated"

    def __len__(self) -> int:
        return 12

    def __iter__(self) -> Iterator[ScenarioRequest]:
        doc = tokens([7], 64)
        for _round in range(2):
            for q in range(2):
                for u in range(3):
                    yield ScenarioRequest(f"u{u}", (Part(doc, True), Part(tokens([100 + q], 48), False)))


def test_private_blocks_hit_only_within_their_user():
    wl = build_workload(RepeatedQuestions(), "repeated", "segmented", 16, MODES["meta"], show_progress=False)
    r = replay(wl, ReplayConfig(), show_progress=False)
    doc_hits = 11 * 64  # every request but the first reads the public document
    own_question_hits = 6 * 48  # second round: each user re-reads their own two questions
    assert r["hit_tokens"] == doc_hits + own_question_hits
    # the 8 requests of users other than u0 read u0's 4 public document blocks, nothing private
    assert r["cross_user_private_hits"] == 0 and r["cross_user_hits"] == 8 * 4
    shared = replay(build_workload(RepeatedQuestions(), "repeated", "shared", 16, MODES["meta"], show_progress=False),
                    ReplayConfig(), show_progress=False)
    assert shared["hit_tokens"] == 11 * 64 + (12 - 2) * 48  # one trust group: questions shared too


# -- the Mooncake trace -----------------------------------------------------------------------------
def test_trace_readme_facts(trace: MooncakeTrace):
    assert hashlib.sha256(TRACE.read_bytes()).hexdigest() == README_SHA256
    s = trace.stats()
    assert (s.requests, s.blocks, s.unique_ids, s.repeated_blocks) == (3_993, 121_877, 43_924, 77_953)
    assert round(s.duration_s / 60, 1) == 17.0
    assert round(s.block_hit_rate, 4) == 0.6396
    assert round(s.token_hit_rate_partial, 4) == 0.6512
    assert round(s.token_hit_rate_full, 4) == 0.6504


def test_trace_unbounded_replay_gives_readme_full_block_figure(trace: MooncakeTrace):
    wl = build_workload(MooncakeScenario(trace), "mooncake", "shared", 512, MODES["meta"], show_progress=False)
    r = replay(wl, ReplayConfig(), show_progress=False)
    stats = trace.stats()
    assert r["requests"] == 3_993 and r["input_tokens"] == stats.input_tokens
    assert r["hit_tokens"] == stats.hit_tokens_full == r["ideal_hit_tokens"]
    assert round(r["token_hit_rate"], 4) == 0.6504
    # Full blocks only: 117,888 of the 121,877 trace blocks are full; 40,148 distinct ones.
    assert (r["blocks"], r["hit_blocks"], r["unique_blocks"]) == (117_888, 77_740, 40_148)
    assert r["per_tier"]["memory"]["blocks_written"] == 40_148


# -- metadata mode == payload mode ------------------------------------------------------------------
@pytest.mark.parametrize("tiers", ["memory:3%", "memory:3%,lmdb:inf"])
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_meta_and_payload_modes_agree_on_trace_prefix(trace: MooncakeTrace, policy: str, tiers: str):
    scenario = MooncakeScenario(trace, limit=250)
    results = {}
    for mode in ("meta", "payload"):
        wl = build_workload(scenario, "mooncake", "shared", 512, MODES[mode], show_progress=False)
        results[mode] = replay(wl, ReplayConfig(policy, parse_tiers(tiers), mode), show_progress=False)
    meta, payload = results["meta"], results["payload"]
    # The comparison means something only where the (first) tier's capacity binds.
    assert meta["per_tier"]["memory"]["evictions"] > 0
    for key in ("hit_tokens", "hit_blocks", "evictions", "cross_user_hits"):
        assert meta[key] == payload[key], key
    for tier in meta["per_tier"]:
        for key in ("hit_blocks", "blocks_written", "evictions"):
            assert meta["per_tier"][tier][key] == payload["per_tier"][tier][key], (tier, key)
    assert payload["verified_blocks"] == payload["hit_blocks"] > 0


@pytest.mark.parametrize("policy", ["adaptive", "arc", "s3-fifo", "chain-arc"])
def test_gpu_tier_runs_the_policy_with_the_same_hits_as_replay(trace: MooncakeTrace, policy: str, tmp_path):
    """The policy inside a GpuTier (its CPU fallback here; the same class on a device) gives the
    hit counts of the replay's metadata tier: the policy, not the tier, decides what stays."""
    scenario = MooncakeScenario(trace, limit=250)
    meta_wl = build_workload(scenario, "mooncake", "shared", 512, MODES["meta"], show_progress=False)
    cfg = ReplayConfig(policy, parse_tiers("memory:3%"), "meta")
    meta = replay(meta_wl, cfg, show_progress=False)
    wl = build_workload(scenario, "mooncake", "shared", 512, MODES["payload"], show_progress=False)
    rep = Replayer(wl, ReplayConfig(policy, parse_tiers("memory:3%"), "payload"), tmp_path)
    rep.store.close()
    cap = Capacity(percent=3.0).resolve(wl.unique_blocks)
    rep.store = TieredStore([GpuTier(n_slots=cap, slot_bytes=wl.layout.bytes_per_block, policy=policy, device="cpu")])
    gpu = rep.run()
    assert meta["per_tier"]["memory"]["evictions"] > 0
    assert (gpu["hit_tokens"], gpu["hit_blocks"], gpu["evictions"]) == (
        meta["hit_tokens"], meta["hit_blocks"], meta["evictions"])
    assert gpu["verified_blocks"] == gpu["hit_blocks"] > 0


@pytest.mark.parametrize("policy", ["adaptive", "arc", "s3-fifo", "chain-arc"])
def test_lmdb_tier_runs_the_policy_under_pressure(trace: MooncakeTrace, policy: str):
    # LmdbTier asks for all of a batch's room before inserting it: the policies' capacity estimate
    # must survive that (and every hit is still checked byte for byte).
    wl = build_workload(MooncakeScenario(trace, limit=120), "mooncake", "shared", 512, MODES["payload"],
                        show_progress=False)
    r = replay(wl, ReplayConfig(policy, parse_tiers("memory:1%,lmdb:4%"), "payload"), show_progress=False)
    assert r["per_tier"]["lmdb"]["evictions"] > 0 and r["per_tier"]["lmdb"]["hit_blocks"] > 0
    assert r["verified_blocks"] == r["hit_blocks"] and r["hit_tokens"] <= r["ideal_hit_tokens"]


def test_meta_and_payload_modes_agree_on_seed_under_pressure():
    # 660 blocks: the 625-block public document plus one private question (31 blocks); every new
    # question evicts the previous one's tail, never the document it hangs from.
    cfg = {m: ReplayConfig("prefix-aware", (TierSpec("memory", Capacity(blocks=660)),), m) for m in ("meta", "payload")}
    meta, payload = seed_run("segmented", cfg["meta"]), seed_run("segmented", cfg["payload"], mode="payload")
    assert meta["hit_tokens"] == payload["hit_tokens"] == 990_000
    assert meta["evictions"] == payload["evictions"] > 0


def test_bounded_capacity_never_beats_the_ideal_and_grows_with_capacity(trace: MooncakeTrace):
    wl = build_workload(MooncakeScenario(trace, limit=400), "mooncake", "shared", 512, MODES["meta"],
                        show_progress=False)
    rates = [replay(wl, ReplayConfig("lru", (TierSpec("memory", Capacity(percent=p)),)), show_progress=False)
             for p in (5.0, 50.0, 100.0)]
    hits = [r["hit_tokens"] for r in rates]
    assert hits[0] < hits[1] <= hits[2] == wl.ideal.hit_tokens
    assert rates[0]["evictions"] > rates[1]["evictions"]


def test_belady_reference_bounds_the_online_policies(trace: MooncakeTrace):
    wl = build_workload(MooncakeScenario(trace, limit=400), "mooncake", "shared", 512, MODES["meta"],
                        show_progress=False)
    oracle = BeladyReference(wl)
    assert oracle.hit_tokens(wl.unique_blocks) == wl.ideal.hit_tokens
    cap = Capacity(percent=5.0)
    best_online = max(
        replay(wl, ReplayConfig(p, (TierSpec("memory", cap),)), show_progress=False)["hit_tokens"]
        for p in sorted(POLICIES)
    )
    assert best_online < oracle.hit_tokens(cap.resolve(wl.unique_blocks) or 0) <= wl.ideal.hit_tokens


# -- never wrong bytes ------------------------------------------------------------------------------
def test_replay_refuses_wrong_bytes(tmp_path):
    wl = build_workload(SeedScenario(users=1, per_user=2, doc_tokens=64, question_tokens=16), "tiny", "shared", 16,
                        MODES["meta"], show_progress=False)
    rep = Replayer(wl, ReplayConfig(), tmp_path)
    first = wl.chains[0].blocks[0]
    forged = make_block(wl.layout, first)
    forged.data.fill_(0)  # same key and metadata, other bytes
    rep.store.put([forged])
    with pytest.raises(CorruptRecord, match="wrong bytes"):
        rep.run()
