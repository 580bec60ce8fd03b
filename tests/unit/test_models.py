"""Model sizes: configs, derived KV layouts, seeded weights identical across processes."""

from __future__ import annotations

import subprocess
import sys

import pytest

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
