"""Generated replay workloads: deterministic per seed, valid prefix-chained traces, the shape each
generator documents (growing conversations, shared tool catalogues, shared documents)."""

from __future__ import annotations

import pytest

from benchmarks.trace import TRACE_BLOCK_TOKENS, MooncakeTrace
from benchmarks.workloads import WORKLOADS, BlockInterner, generate, main, to_jsonl
from kvtier.errors import ConfigError


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_same_seed_same_trace_other_seed_other_trace(name):
    a, b, c = generate(name, 1, 300), generate(name, 1, 300), generate(name, 2, 300)
    assert a.requests == b.requests and a.requests != c.requests
    assert len(a) == 300
    # what the generator writes is what the replay reads back (validation included)
    again = MooncakeTrace.parse(list(to_jsonl(list(a.requests))))
    assert again.requests == a.requests
    assert 0.2 < a.stats().token_hit_rate_full < 0.98


def test_interner_shares_exactly_the_common_full_blocks():
    b = BlockInterner()
    sys_prompt, q1, a1, q2 = (1, 700), (2, 300), (3, 600), (4, 50)
    n1, first = b.hash_ids([sys_prompt, q1])
    n2, second = b.hash_ids([sys_prompt, q1, a1, q2])
    assert (n1, n2) == (1000, 1650) and len(first) == 2 and len(second) == 4
    assert second[0] == first[0]  # the full first block is shared
    assert second[1] != first[1]  # turn 1's partial block differs from the full block turn 2 has there
    _, other = b.hash_ids([(9, 512)])
    assert other[0] not in first


def test_conversations_grow_their_prefixes():
    reqs = generate("conversations", 1, 400).requests
    ends = {r.hash_ids[r.input_length // TRACE_BLOCK_TOKENS - 1] for r in reqs if r.input_length >= TRACE_BLOCK_TOKENS}
    followups = sum(1 for r in reqs if any(i in ends for i in r.hash_ids[:-1]))
    assert followups > 100  # many requests extend an earlier request's whole full-block chain


def test_cli_writes_jsonl(tmp_path, capsys):
    out = tmp_path / "t.jsonl"
    assert main(["toolagent", str(out), "--requests", "50", "--seed", "3"]) == 0
    assert MooncakeTrace.load(out).requests == generate("toolagent", 3, 50).requests
    assert "unbounded" in capsys.readouterr().out


def test_unknown_workload():
    with pytest.raises(ConfigError, match="unknown workload"):
        generate("nope")
