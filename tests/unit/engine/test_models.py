"""Model sizes: configs, derived KV layouts, seeded weights identical across processes."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from kvtier.engine.models import MODEL_SIZES, ModelSpec, model_spec, weights_digest
from kvtier.errors import ConfigError


def test_registry_has_the_sizes_in_increasing_cost() -> None:
    assert list(MODEL_SIZES) == ["tiny", "small", "medium", "large"]
    per_token = [s.layout().bytes_per_token for s in MODEL_SIZES.values()]
    assert per_token == sorted(per_token) and len(set(per_token)) == 4


def test_large_is_at_least_12_layers_by_768_hidden() -> None:
    spec = model_spec("large")
    assert spec.num_layers >= 12 and spec.hidden_size >= 768


@pytest.mark.parametrize("name", list(MODEL_SIZES))
def test_layout_matches_config(name: str) -> None:
    spec = model_spec(name)
    cfg, lay = spec.config(), spec.layout()
    assert (lay.num_layers, lay.num_kv_heads, lay.head_dim) == (
        cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads,
    )
    assert lay.block_shape == (cfg.num_hidden_layers, 2, spec.block_tokens, cfg.num_key_value_heads, lay.head_dim)
    assert lay.bytes_per_token == cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * lay.head_dim * 2  # bf16


def test_dtypes_give_distinct_layouts() -> None:
    spec = model_spec("tiny")
    assert spec.layout().fingerprint != spec.with_dtype("float32").layout().fingerprint
    assert spec.layout().fingerprint != model_spec("small").layout().fingerprint


def test_same_seed_same_weights_other_seed_other_weights() -> None:
    spec = model_spec("tiny")
    assert weights_digest(spec.build(3)) == weights_digest(spec.build(3))
    assert weights_digest(spec.build(3)) != weights_digest(spec.build(4))


def test_weights_identical_in_another_process() -> None:
    code = (
        "from kvtier.engine.models import model_spec, weights_digest;"
        "print(weights_digest(model_spec('tiny').build(7)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == weights_digest(model_spec("tiny").build(7))


def test_unknown_size_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="unknown model size 'huge'"):
        model_spec("huge")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dtype": "uint8"}, "dtype"),
        ({"hidden_size": 130}, "multiple of num_heads"),
        ({"num_kv_heads": 3}, "grouped-query"),
        ({"num_layers": 0}, "num_layers"),
    ],
)
def test_bad_spec_rejected(kwargs: dict, match: str) -> None:
    base = {"name": "x", "hidden_size": 128, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
            "intermediate_size": 64}
    with pytest.raises(ConfigError, match=match):
        ModelSpec(**(base | kwargs))


def _greedy(model: torch.nn.Module, prompt: torch.Tensor, n: int,
            past: object = None) -> tuple[list[int], torch.Tensor]:
    """``n`` greedy tokens after ``prompt`` (continuing ``past`` when given) and their log-probabilities."""
    toks, lps = [], []
    with torch.no_grad():
        out = model(prompt[None], cache=past, use_cache=True)
        for _ in range(n):
            lp = torch.log_softmax(out.logits[0, -1].float(), -1)
            toks.append(int(lp.argmax()))
            lps.append(lp)
            out = model(torch.tensor([[toks[-1]]]), cache=out.cache, use_cache=True)
    return toks, torch.stack(lps)


def test_outputs_depend_on_the_kv_and_a_reused_prefix_gives_the_same_output() -> None:
    """The weights' scale makes the KV matter: the same question after another document, or after
    zeroed KV, gives other tokens from the first one on; the document's KV computed apart and
    reused moves float32 log-probabilities by far less than 1e-3 (benchmarks.output_match)."""
    spec = model_spec("small").with_dtype("float32")
    model = spec.build(0)
    g = torch.Generator().manual_seed(1)
    doc_a, doc_b, q = (torch.randint(3, spec.vocab_size, (n,), generator=g) for n in (256, 256, 24))
    want, want_lp = _greedy(model, torch.cat([doc_a, q]), 16)
    other, other_lp = _greedy(model, torch.cat([doc_b, q]), 16)
    with torch.no_grad():
        past = model(doc_a[None], use_cache=True).cache
    reused, reused_lp = _greedy(model, q, 16, past)
    with torch.no_grad():
        zeroed = model(doc_a[None], use_cache=True).cache
        for layer in zeroed.layers:
            layer.keys.zero_()
            layer.values.zero_()
    blind, _ = _greedy(model, q, 16, zeroed)
    assert reused == want and (reused_lp - want_lp).abs().max() < 1e-4
    assert other[0] != want[0] and blind[0] != want[0]
    assert (other_lp[0] - want_lp[0]).abs().max() > 0.5
    assert len(set(want)) > 4, "not a constant output"
