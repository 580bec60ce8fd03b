"""`kvtier bench reload-vs-recompute` end to end on real tiers and a real (tiny) transformer, kept lean:
the plan executor against a full recompute, a two-case sweep through the CLI, and its bad input."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from benchmarks import reload_vs_recompute as rvr
from benchmarks.output_match import LOGPROB_TOLERANCE
from benchmarks.sweep_output import crossover
from benchmarks.throttle import ThrottledTier
from kvtier.block import Block
from kvtier.cli.main import main
from kvtier.engine.models import model_spec
from kvtier.engine.prefill import PrefillRunner
from kvtier.errors import ConfigError
from kvtier.keys import Scope, Segment, block_chain
from kvtier.planning.cost_model import CostModel
from kvtier.planning.probes import probe_host_to_device, probe_prefill
from kvtier.planning.profiles import TierProfile
from kvtier.store.tiered_store import TieredStore
from storage_backends.lmdb import LmdbTier
from storage_backends.memory import MemoryTier
from tests.helpers import DERIVER


@pytest.fixture(scope="module")
def engine() -> PrefillRunner:
    spec = model_spec("tiny").with_dtype("float32")
    return PrefillRunner(spec.build(0), spec.layout())


def test_every_plan_executes_to_the_same_logits(engine: PrefillRunner, tmp_path) -> None:
    """Mixed tiers (memory front, LMDB behind a link): each plan's real execution, pipelined included,
    yields the logits of computing everything from scratch."""
    lay = engine.layout
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, engine.vocab_size, (8 * lay.block_tokens + 5,), generator=gen)
    prefix, new = tokens[: 8 * lay.block_tokens], tokens[8 * lay.block_tokens :]
    kv = engine.prefill(prefix).new_blocks
    chain = block_chain(lay, [Segment(prefix.tolist(), Scope.public())], DERIVER)
    blocks = [Block.build(lay, c.key, c.domain, d, parent=c.parent, index=c.index)
              for c, d in zip(chain, kv, strict=True)]
    front, back = MemoryTier(1 << 24), ThrottledTier(LmdbTier(tmp_path / "db", 1 << 26), bandwidth_Bps=None, name="far")
    profiles = {"memory": TierProfile("memory", 1e-5, 1e10), "far": TierProfile("far", 1e-3, 1e8)}
    cm = CostModel(probe_prefill(engine, points=((16, 0), (64, 0), (16, 64)), repeats=1), profiles,
                   host_to_device=probe_host_to_device(engine, (2, 8)))
    store = TieredStore([front, back], promote=False, observer=cm)
    front.put(blocks[:3])
    back.put(blocks)
    keys = [b.key for b in blocks]
    plan = cm.plan(store.lookup(keys), new.numel(), lay)
    assert [o.name for o in plan.options] == list(rvr.PLANS)
    assert [r.tier for r in plan.option("full-reload").load] == ["memory", "far"]
    reference = engine.prefill(tokens, extract=False).logits_last
    executor = rvr.PlanExecutor(store, engine, cm)
    for opt in plan.options:
        out = executor.run(opt, keys, prefix, new)
        torch.testing.assert_close(out.logits, reference, atol=1e-4, rtol=0, msg=opt.name)
        assert out.ttft_s > 0
    assert cm.profile("far").observations > 0  # the store fed its reads to the model
    store.close()


def _args(**kw) -> argparse.Namespace:
    base = {"json": None, "plot": None, "quick": False, "models": "tiny", "tiers": "memory,lmdb",
            "prefixes": "32,64", "link_mbps": None, "link_latency_ms": None, "no_s3": True, "workdir": None,
            "threads": 1, "sweeps": None}
    return argparse.Namespace(**(base | kw))


def test_sweep_writes_the_promised_json_and_plot(tmp_path, capsys) -> None:
    """Two independent sweeps by default; each case's plans ran equally often, in at least three
    rounds; regret is the median paired ratio with its band; the noise section pairs every case
    across the sweeps."""
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    assert rvr.run(_args(json=str(out), plot=str(png), workdir=str(tmp_path / "wd"))) == 0
    res = json.loads(out.read_text())
    assert len(res["sweeps"]) == 2 == res["summary"]["sweeps"] == res["config"]["sweeps"]
    for sw in res["sweeps"]:
        assert sw["summary"]["cases"] == 4 == len(sw["cases"])
        for c in sw["cases"]:
            assert {"model", "prefix_tokens", "new_tokens", "tier", "encrypted", "measured_ms", "predicted_ms",
                    "chosen", "best", "regret", "regret_band", "regret_of_minima", "reason", "runs"} <= set(c)
            assert set(c["measured_ms"]) == set(c["predicted_ms"]) == set(c["runs"]) == set(rvr.PLANS)
            assert len(set(c["runs"].values())) == 1  # every plan of a case ran the same number of times
            assert min(c["runs"].values()) >= rvr.MIN_ROUNDS
            assert c["best"] == min(c["measured_ms"], key=c["measured_ms"].get)
            lo, hi = c["regret_band"]
            assert lo <= c["regret"] <= hi
            if c["chosen"] == c["best"]:
                assert c["regret"] == lo == hi == 0.0
            assert c["reason"] in ("fastest", "simpler")  # every plan ran: no re-probe needed
            assert c["max_logprob_diff"] <= LOGPROB_TOLERANCE["bfloat16"]
        regrets = sorted(c["regret"] for c in sw["cases"])
        assert sw["summary"]["max_regret"] == regrets[-1]
        assert sw["summary"]["median_regret"] == pytest.approx((regrets[1] + regrets[2]) / 2)
        lows = [max(c["regret_band"][0], 0.0) for c in sw["cases"]]
        assert sw["summary"]["max_regret_beyond_noise"] == max(lows)
        assert len(sw["summary"]["misses"]) == sum(c["regret_band"][0] > rvr.REGRET_TARGET for c in sw["cases"])
    noise = res["noise"]
    assert len(noise["cases"]) == 4 == noise["summary"]["cases"]
    for n in noise["cases"]:
        same = [c for sw in res["sweeps"] for c in sw["cases"]
                if (c["model"], c["prefix_tokens"], c["tier"]) == (n["model"], n["prefix_tokens"], n["tier"])]
        assert n["regret"] == [c["regret"] for c in same]
        assert n["regret_spread"] == pytest.approx(max(n["regret"]) - min(n["regret"]))
        assert n["chosen"] == [c["chosen"] for c in same] and set(n["time_spread"]) == set(rvr.PLANS)
    assert noise["summary"]["max_regret_spread"] == max(n["regret_spread"] for n in noise["cases"])
    per_sweep_max = res["summary"]["max_regret_per_sweep"]
    assert per_sweep_max == [sw["summary"]["max_regret"] for sw in res["sweeps"]]
    assert noise["summary"]["max_regret_spread_across_sweeps"] == pytest.approx(max(per_sweep_max) - min(per_sweep_max))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = capsys.readouterr().out
    assert "median regret" in table and "lmdb" in table and "regret spread" in table and "sweep 2 of 2" in table
    assert "noise band" in table and "beyond its noise band" in table


def test_regret_is_paired_by_round_with_its_band() -> None:
    """A round where the machine was slow slows both plans of it: the paired ratio stays put."""
    chosen = [0.12, 0.24, 0.13]  # round 2 ran under contention
    best = [0.10, 0.20, 0.10]
    regret, band = rvr.paired_regret(chosen, best)
    assert regret == pytest.approx(0.2) and band == pytest.approx((0.2, 0.3))
    # Control: unpaired, the slow round makes the chosen plan look 2.4x slower than the best.
    assert max(chosen) / min(best) - 1 > 1.0
    assert rvr.paired_regret(best, best) == (0.0, (0.0, 0.0))


def test_every_plan_of_a_case_gets_the_same_number_of_runs() -> None:
    """The count is one per case, from the whole round's prediction: a plan predicted fast gets no
    more runs than a slow one (that biased regret towards 0)."""
    assert rvr.runs_per_plan([1.0, 400.0, 200.0, 150.0], budget_s=1.5) == int(1.5 * 4 / 0.751)
    assert rvr.runs_per_plan([0.1, 0.2, 0.1, 0.1], budget_s=1.5) == 9
    assert rvr.runs_per_plan([50.0, 2000.0, 1500.0, 1200.0], budget_s=1.5) == rvr.MIN_ROUNDS == 3
    assert rvr.runs_per_plan([50.0, 9000.0, 6000.0, 5000.0], budget_s=1.5) == rvr.MIN_ROUNDS


def test_one_sweep_reports_no_noise(tmp_path) -> None:
    out = tmp_path / "r.json"
    assert rvr.run(_args(json=str(out), sweeps=1, prefixes="32", tiers="memory")) == 0
    res = json.loads(out.read_text())
    assert len(res["sweeps"]) == 1 and res["noise"] == {"cases": [], "summary": {}}


def test_crossover_is_where_reload_gets_cheaper() -> None:
    xs = [100, 1000, 10000]
    recompute = [1.0, 10.0, 1000.0]
    reload = [5.0, 50.0, 500.0]
    x = crossover(xs, reload, recompute)
    assert x is not None and 1000 < x < 10000
    assert crossover(xs, recompute, reload) is None  # recompute never gets cheaper again


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"tiers": "memory,floppy"}, "unknown"),
        ({"models": "huge"}, "unknown model size"),
        ({"prefixes": "32,40"}, "multiples of 16"),
        ({"prefixes": "16"}, "at least 32"),
        ({"prefixes": "a,b"}, "comma-separated integers"),
        ({"link_mbps": 0.0}, "link-mbps"),
        ({"link_latency_ms": -1.0}, "link-latency-ms"),
        ({"plot": "x.jpg"}, r"\.png"),
        ({"threads": 0}, "threads"),
        ({"sweeps": 0}, "sweeps"),
    ],
)
def test_bad_arguments_are_clear_errors(kw: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        rvr.run(_args(**kw))


def test_cli_reports_bad_input_in_one_line(capsys) -> None:
    rc = main(["bench", "reload-vs-recompute", "--tiers", "nope", "--no-s3"])
    err = capsys.readouterr().err
    assert rc == 1 and "kvtier: error:" in err and "Traceback" not in err
