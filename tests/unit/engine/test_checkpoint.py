"""kvtier.engine.checkpoint: the model recipe as a checkpoint other engines load normally."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from kvtier.engine.checkpoint import hf_config, write_checkpoint
from kvtier.engine.models import model_spec, weights_digest

SPEC = replace(model_spec("tiny"), dtype="float32", vocab_size=512)


def test_transformers_loads_the_same_weights_and_config(tmp_path: Path) -> None:
    d = write_checkpoint(SPEC, tmp_path / "m", seed=3)
    loaded = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    assert weights_digest(loaded) == weights_digest(SPEC.build(3))
    assert json.loads((d / "recipe.json").read_text())["weights_sha256"] == weights_digest(loaded)
    cfg = json.loads((d / "config.json").read_text())
    assert cfg == hf_config(SPEC) and cfg["architectures"] == ["LlamaForCausalLM"]
    ids = torch.tensor([[5, 9, 77, 300, 2, 41]])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, SPEC.build(3)(ids).logits)


def test_the_tokenizer_round_trips_text_exactly(tmp_path: Path) -> None:
    tok = PreTrainedTokenizerFast.from_pretrained(str(write_checkpoint(SPEC, tmp_path / "m")))
    ids = [3, 4, 511, 100, 10, 1]
    text = tok.decode(ids)
    assert tok.encode(text, add_special_tokens=False) == ids
    assert tok.convert_ids_to_tokens([0, 1, 2, 3]) == ["<unk>", "<s>", "</s>", "t3"]


def test_a_written_recipe_is_reused_and_another_one_rewritten(tmp_path: Path) -> None:
    d = write_checkpoint(SPEC, tmp_path / "m", seed=0)
    weights = d / "model.safetensors"
    first = weights.stat().st_mtime_ns
    write_checkpoint(SPEC, d, seed=0)
    assert weights.stat().st_mtime_ns == first
    write_checkpoint(SPEC, d, seed=1)
    loaded = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32)
    assert weights_digest(loaded) == weights_digest(SPEC.build(1))
    (d / "recipe.json").write_text("{not json")  # a damaged marker: everything is written again
    write_checkpoint(SPEC, d, seed=1)
    assert json.loads((d / "recipe.json").read_text())["seed"] == 1
