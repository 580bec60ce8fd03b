"""Replay inputs: capacity and tier syntax, trace validation, tenant rule, token expansion, scopes."""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks.replay_workload import Capacity, TierSpec, parse_tiers
from benchmarks.replayer import ReplayConfig
from benchmarks.trace import (
    TRACE_BLOCK_TOKENS,
    VOCAB,
    MooncakeScenario,
    MooncakeTrace,
    SeedScenario,
    derive_chains,
    expand_hash_ids,
    isolation_rule,
    open_source,
)
from kvtier.errors import ConfigError
from kvtier.keys import DomainDeriver, Scope, ScopeKind
from kvtier.layout import KVLayout

LAYOUT = KVLayout("replay-test", num_layers=1, num_kv_heads=1, head_dim=1, dtype="uint8", block_tokens=16)
DERIVER = DomainDeriver(b"replay-unit-test-secret-0123456789")


# -- capacities and tiers ---------------------------------------------------------------------------
def test_capacity_forms_and_resolution():
    assert Capacity.parse("inf").resolve(1000) is None
    assert Capacity.parse("400").resolve(1000) == 400
    assert Capacity.parse("5%").resolve(40_148) == 2007
    assert Capacity.parse("0.1%").resolve(100) == 1  # never rounds down to an empty tier
    assert str(Capacity.parse("5%")) == "5%" and str(Capacity.parse("inf")) == "inf"


@pytest.mark.parametrize("bad", ["", "0", "-3", "abc", "0%", "101%", "x%", "5%%", "nan%", "1.5"])
def test_capacity_rejects_bad_input(bad):
    with pytest.raises(ConfigError):
        Capacity.parse(bad)


def test_tier_specs():
    assert parse_tiers("memory:5%,lmdb:inf") == (
        TierSpec("memory", Capacity(percent=5.0)),
        TierSpec("lmdb", Capacity()),
    )
    assert parse_tiers(" memory:400 ") == (TierSpec("memory", Capacity(blocks=400)),)


@pytest.mark.parametrize("bad", ["memory", "memory:", ":5%", "gpu:5%", "memory:5%,memory:10%", "memory:5%,"])
def test_tier_specs_reject_bad_input(bad):
    with pytest.raises(ConfigError) as err:
        parse_tiers(bad)
    assert "--tiers" in str(err.value)


def test_replay_config_rejects_unknown_policy_and_mode():
    with pytest.raises(ConfigError, match="policy"):
        ReplayConfig(policy="random")
    with pytest.raises(ConfigError, match="mode"):
        ReplayConfig(mode="nope")
    with pytest.raises(ConfigError):
        ReplayConfig(tiers=())


# -- Mooncake trace parsing -------------------------------------------------------------------------
def line(ts=0, n_in=1024, n_out=1, ids=(0, 1)) -> str:
    return json.dumps({"timestamp": ts, "input_length": n_in, "output_length": n_out, "hash_ids": list(ids)})


def test_trace_parse_roundtrip_and_blank_lines():
    tr = MooncakeTrace.parse([line(), "", line(ts=5, n_in=1500, ids=(0, 1, 2))], source="t")
    assert len(tr) == 2
    assert tr.requests[1].hash_ids == (0, 1, 2) and tr.requests[1].full_blocks == 2


@pytest.mark.parametrize(
    ("lines", "needle"),
    [
        (["{not json"], "not JSON"),
        (["[1, 2]"], "JSON object"),
        ([json.dumps({"timestamp": 0, "input_length": 10, "output_length": 1})], "hash_ids"),
        ([line(n_in=0)], "input_length"),
        ([line(ts=-1)], "timestamp"),
        ([json.dumps({"timestamp": True, "input_length": 512, "output_length": 1, "hash_ids": [0]})], "timestamp"),
        ([line(ids=(0,))], "expected ceil"),
        ([line(ids=(0, -1))], "hash_ids"),
        ([line(ids=(0, "1"))], "hash_ids"),
        ([line(ids=(0, 1)), line(ids=(1, 0))], "prefix chain"),
        ([line(ids=(0, 1)), line(ids=(2, 1))], "prefix chain"),
        ([], "no requests"),
    ],
)
def test_trace_parse_rejects_bad_input_with_line_number(lines, needle):
    with pytest.raises(ConfigError) as err:
        MooncakeTrace.parse(lines, source="bad.jsonl")
    assert needle in str(err.value)
    if lines and needle != "no requests":
        assert f"bad.jsonl:{len(lines)}" in str(err.value)


def test_trace_load_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        MooncakeTrace.load(tmp_path / "absent.jsonl")
    with pytest.raises(ConfigError, match="not found"):
        open_source(str(tmp_path / "absent.jsonl"))


def test_limit_applies_to_traces_only():
    with pytest.raises(ConfigError, match="--limit"):
        open_source("seed-shared", limit=5)


# -- tenant rule ------------------------------------------------------------------------------------
def test_tenant_rule_conversations_users_and_public_material():
    full = 3 * TRACE_BLOCK_TOKENS
    tr = MooncakeTrace.parse(
        [
            line(ts=0, n_in=full, ids=(1, 2, 3)),  # opens conversation 0
            line(ts=1, n_in=full + TRACE_BLOCK_TOKENS + 7, ids=(1, 2, 3, 4, 5)),  # extends it: conversation 0
            line(ts=2, n_in=full, ids=(1, 2, 6)),  # shares 1,2 only: conversation 1; 1,2 are public
            line(ts=3, n_in=100, ids=(7,)),  # conversation 2
            line(ts=4, n_in=full + 1, ids=(1, 2, 3, 8)),  # extends request 0 (its full chain): conversation 0
        ]
    )
    sc = MooncakeScenario(tr, users=2)
    assert sc.conversation == [0, 0, 1, 2, 0]
    assert [sc.user_of(i) for i in range(5)] == ["u0", "u0", "u1", "u0", "u0"]
    assert sc.public_blocks == [2, 2, 2, 0, 2]
    reqs = list(sc)
    assert [len(p.tokens) for p in reqs[1].parts] == [2 * TRACE_BLOCK_TOKENS, 2 * TRACE_BLOCK_TOKENS + 7]
    assert [p.public for p in reqs[1].parts] == [True, False]
    assert reqs[3].parts[0].public is False and reqs[3].input_tokens == 100
    with pytest.raises(ConfigError):
        MooncakeScenario(tr, users=0)
    with pytest.raises(ConfigError):
        MooncakeScenario(tr, limit=0)


# -- tokens and scopes ------------------------------------------------------------------------------
def test_token_expansion_is_deterministic_and_id_seeded():
    a = expand_hash_ids([5, 9])
    assert a.shape == (2 * TRACE_BLOCK_TOKENS,) and a.dtype == np.uint32
    assert int(a.max()) < VOCAB
    assert np.array_equal(a[TRACE_BLOCK_TOKENS:], expand_hash_ids([9]))
    assert np.array_equal(a, expand_hash_ids([5, 9]))
    assert not np.array_equal(expand_hash_ids([5]), expand_hash_ids([6]))


def test_seed_scenario_shape():
    sc = SeedScenario()
    reqs = list(sc)
    assert len(reqs) == len(sc) == 100
    assert all(r.input_tokens == 10_500 for r in reqs)
    assert [r.user for r in reqs[:11]] == [f"u{i}" for i in range(10)] + ["u0"]
    assert all(np.array_equal(r.parts[0].tokens, reqs[0].parts[0].tokens) for r in reqs)
    assert len({r.parts[1].tokens.tobytes() for r in reqs}) == 100
    with pytest.raises(ConfigError):
        SeedScenario(users=0)


def test_isolation_rules_shape_the_keys():
    sc = SeedScenario(users=2, per_user=1, doc_tokens=64, question_tokens=32)
    doc_blocks = 64 // LAYOUT.block_tokens

    def chains(rule):
        return derive_chains(sc, isolation_rule(rule), LAYOUT, DERIVER)

    shared, isolated, segmented = chains("shared"), chains("isolated"), chains("segmented")
    assert shared[0].keys[:doc_blocks] == shared[1].keys[:doc_blocks]
    assert not set(isolated[0].keys) & set(isolated[1].keys)
    assert segmented[0].keys[:doc_blocks] == segmented[1].keys[:doc_blocks]
    assert not set(segmented[0].keys[doc_blocks:]) & set(segmented[1].keys[doc_blocks:])
    assert {b.scope.kind for b in segmented[0].blocks[doc_blocks:]} == {ScopeKind.USER}
    assert {b.scope for b in shared[0].blocks} == {Scope.org("trust-group")}
    with pytest.raises(ConfigError):
        isolation_rule("none")
