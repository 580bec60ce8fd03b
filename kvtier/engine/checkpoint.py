"""A ``ModelSpec``'s seeded weights written as a Hugging Face checkpoint that vLLM loads normally.

The one model recipe of every engine test and benchmark: ``config.json`` (``LlamaForCausalLM``),
``model.safetensors`` (the weights ``ModelSpec.build(seed)`` draws: N(0, 1/fan_in) matrices, norms
at 1, in the spec's dtype) and a word-level tokenizer built here (``<unk>``, ``<s>``, ``</s>`` are
ids 0-2, token ``t<i>`` is id ``i``). vLLM reads it with its default loader (safetensors), so the
engine computes with exactly the weights a transformers model of the same spec and seed has.

Text round-trips exactly through the tokenizer (ids -> text -> the same ids), which clients that
send text, such as ``vllm bench serve``, need: the special tokens are no prefix of any ``t<i>``.

A directory already holding the same recipe (``recipe.json``, written last) is reused as it is.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvtier.engine.models import ModelSpec, weights_digest

RECIPE_FILE = "recipe.json"
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")


def hf_config(spec: ModelSpec) -> dict[str, Any]:
    """``config.json`` of ``spec``: the fields ``ModelSpec.config()`` sets, in the form every
    transformers 5.x (and vLLM's config reader) accepts."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size, "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads, "head_dim": spec.head_dim, "num_hidden_layers": spec.num_layers,
        "vocab_size": spec.vocab_size, "max_position_embeddings": spec.max_positions, "hidden_act": "silu",
        "rms_norm_eps": spec.rms_norm_eps, "rope_theta": spec.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": spec.rope_theta},
        "torch_dtype": spec.dtype, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
        "attention_bias": False, "mlp_bias": False,
    }


def write_checkpoint(spec: ModelSpec, directory: Path, *, seed: int = 0) -> Path:
    """Write (or reuse) the checkpoint of ``spec`` with weights from ``seed`` in ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    recipe = {"spec": asdict(spec), "seed": seed, "format": 1}
    marker = directory / RECIPE_FILE
    if marker.exists():
        if _written_recipe(marker) == recipe:
            return directory
        marker.unlink()  # another recipe, or a damaged marker: write everything again
    from safetensors.torch import save_file

    model = spec.build(seed)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    _replace(directory / "model.safetensors", lambda p: save_file(state, str(p), metadata={"format": "pt"}))
    _replace(directory / "config.json", lambda p: p.write_text(json.dumps(hf_config(spec), indent=1)))
    write_tokenizer(directory, spec.vocab_size)
    _replace(marker, lambda p: p.write_text(json.dumps({**recipe, "weights_sha256": weights_digest(model)})))
    return directory


def write_tokenizer(directory: Path, vocab_size: int) -> None:
    """``tokenizer.json`` and ``tokenizer_config.json``: the word-level vocabulary of the module
    docstring."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {SPECIAL_TOKENS[i] if i < len(SPECIAL_TOKENS) else f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    _replace(directory / "tokenizer.json", lambda p: tok.save(str(p)))
    _replace(directory / "tokenizer_config.json", lambda p: p.write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"})))


def _written_recipe(marker: Path) -> dict[str, Any] | None:
    """The recipe a directory's marker names (without its weights digest); None when unreadable."""
    try:
        written = json.loads(marker.read_text())
    except ValueError:
        return None
    return {k: v for k, v in written.items() if k != "weights_sha256"} if isinstance(written, dict) else None


def _replace(path: Path, write: Any) -> None:
    """Write through a temporary file and rename it into place: a reader sees the whole file or none."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    write(tmp)
    os.replace(tmp, path)
