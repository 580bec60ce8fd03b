"""`kvtier bench reload-vs-recompute` end to end on real tiers and a real (tiny) transformer, kept lean:
the plan executor against a full recompute, a two-case sweep through the CLI, and its bad input."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from benchmarks import reload_vs_recompute as rvr
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
            "threads": 1}
    return argparse.Namespace(**(base | kw))


def test_sweep_writes_the_promised_json_and_plot(tmp_path, capsys) -> None:
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    assert rvr.run(_args(json=str(out), plot=str(png), workdir=str(tmp_path / "wd"))) == 0
    res = json.loads(out.read_text())
    assert res["summary"]["cases"] == 4 == len(res["cases"])
    for c in res["cases"]:
        assert {"model", "prefix_tokens", "new_tokens", "tier", "encrypted", "measured_ms", "predicted_ms", "chosen",
                "best", "regret"} <= set(c)
        assert set(c["measured_ms"]) == set(c["predicted_ms"]) == set(rvr.PLANS)
        assert c["best"] == min(c["measured_ms"], key=c["measured_ms"].get)
        assert c["regret"] == pytest.approx(c["measured_ms"][c["chosen"]] / c["measured_ms"][c["best"]] - 1)
        assert c["max_logit_diff"] <= rvr.LOGIT_TOLERANCE
    regrets = sorted(c["regret"] for c in res["cases"])
    assert res["summary"]["max_regret"] == regrets[-1]
    assert res["summary"]["median_regret"] == pytest.approx((regrets[1] + regrets[2]) / 2)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = capsys.readouterr().out
    assert "median regret" in table and "lmdb" in table


def test_crossover_is_where_reload_gets_cheaper() -> None:
    xs = [100, 1000, 10000]
    recompute = [1.0, 10.0, 1000.0]
    reload = [5.0, 50.0, 500.0]
    x = rvr.crossover(xs, reload, recompute)
    assert x is not None and 1000 < x < 10000
    assert rvr.crossover(xs, recompute, reload) is None  # recompute never gets cheaper again


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
    ],
)
def test_bad_arguments_are_clear_errors(kw: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        rvr.run(_args(**kw))


def test_cli_reports_bad_input_in_one_line(capsys) -> None:
    rc = main(["bench", "reload-vs-recompute", "--tiers", "nope", "--no-s3"])
    err = capsys.readouterr().err
    assert rc == 1 and "kvtier: error:" in err and "Traceback" not in err
