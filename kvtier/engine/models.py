"""Llama-style transformers models with seeded random weights, in named sizes, and their KV layouts.

No weights are downloaded: a model is built from a ``LlamaConfig`` and its parameters are drawn
from a seeded generator in a fixed order, so two processes (or two machines) that build the same
size with the same seed get bit-identical weights, and therefore bit-identical KV for the same
tokens. That is what makes blocks cached by one process reusable by another.

The weights have a proper scale: every matrix is drawn from N(0, 1/fan_in) (fan_in = its input
width, so each layer keeps its activations at unit scale) and every norm weight is 1. With this
scale the output depends on the whole context: the same question after another document, or after
zeroed KV, gives other tokens from the first one on, while a prefix computed apart and reused moves
float32 log-probabilities by about 1e-5 (``tests/unit/engine/test_models.py`` checks both). Weights of
about +-1e-3 (vLLM's ``load_format="dummy"``) would not: its outputs hardly depend on the KV.
``kvtier.engine.checkpoint`` writes the same weights as a safetensors checkpoint for vLLM.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvtier.errors import ConfigError
from kvtier.layout import DTYPES, KVLayout


@dataclass(slots=True, frozen=True)
class ModelSpec:
    """One model size. Immutable; the KV layout and the transformers config are derived from it.

    bfloat16 is the default dtype: on CPUs with AVX512-BF16 its prefill is faster than float32
    and it halves the KV bytes; tests that compare logits across cache paths use float32 twins
    (``with_dtype``) for tight tolerances.
    """

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int = 4096
    dtype: str = "bfloat16"
    block_tokens: int = 16
    max_positions: int = 65536
    #: Llama's defaults are 1e-6 and 10,000; stated here so the checkpoint's config says the same.
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"ModelSpec.dtype: {self.dtype!r} is not a float dtype torch can run")
        if self.hidden_size % self.num_heads:
            raise ConfigError("ModelSpec.hidden_size must be a multiple of num_heads")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError("ModelSpec.num_heads must be a multiple of num_kv_heads (grouped-query attention)")
        for name in ("num_layers", "num_kv_heads", "intermediate_size", "vocab_size", "block_tokens"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"ModelSpec.{name} must be positive")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def model_id(self) -> str:
        # The id names the architecture, size and dtype: blocks of two specs never share a layout.
        return f"kvtier-random-llama/{self.name}-{self.dtype}"

    def with_dtype(self, dtype: str) -> ModelSpec:
        return replace(self, dtype=dtype)

    def config(self) -> LlamaConfig:
        return LlamaConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            max_position_embeddings=self.max_positions,
            rms_norm_eps=self.rms_norm_eps,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
            tie_word_embeddings=False,
            attn_implementation="sdpa",
        )

    def layout(self, *, revision: str = "seed-0") -> KVLayout:
        """The KV layout of this model: the cached blocks are the model's own KV, so it must match."""
        return KVLayout(
            model_id=self.model_id,
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=self.dtype,
            block_tokens=self.block_tokens,
            revision=revision,
        )

    def build(self, seed: int = 0) -> LlamaForCausalLM:
        """The model in eval mode with weights drawn from ``seed`` (identical in every process)."""
        model = LlamaForCausalLM(self.config())
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            # Our own init, in sorted-name order from a private generator: independent of the
            # library's init internals and of the global RNG state, hence reproducible anywhere.
            for name, param in sorted(model.named_parameters(), key=lambda kv: kv[0]):
                if name.endswith("norm.weight"):
                    param.fill_(1.0)
                else:
                    param.copy_(torch.randn(param.shape, generator=gen, dtype=torch.float32) * init_std(param.shape))
        return model.to(DTYPES[self.dtype][0]).eval()


def init_std(shape: torch.Size | tuple[int, ...]) -> float:
    """The standard deviation a matrix of ``shape`` (``[out, in]``, embeddings ``[vocab, hidden]``)
    is drawn with: 1/sqrt(fan_in), its last dimension."""
    return float(shape[-1]) ** -0.5


#: The model sizes. ``small`` prefills 4,000 tokens in well under a second on two CPU cores;
#: ``medium`` is about five times the work per token. ``large`` (12 layers x 768 hidden, the shape
#: of GPT-2 base and of the model ``kvtier bench vllm`` serves) is the smallest size whose TTFT is
#: not a toy's; reload-vs-recompute does not sweep it by default (its prefills are too slow for 2 cores).
MODEL_SIZES: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec("tiny", hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=344),
        ModelSpec("small", hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=688),
        ModelSpec("medium", hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=1376),
        ModelSpec("large", hidden_size=768, num_layers=12, num_heads=12, num_kv_heads=4, intermediate_size=2048),
    )
}


def model_spec(name: str) -> ModelSpec:
    try:
        return MODEL_SIZES[name]
    except KeyError:
        raise ConfigError(f"unknown model size {name!r}; one of {sorted(MODEL_SIZES)}") from None


def weights_digest(model: torch.nn.Module) -> str:
    """sha256 over every parameter's name and bytes, in sorted order (compares builds across processes)."""
    h = hashlib.sha256()
    for name, param in sorted(model.state_dict().items(), key=lambda kv: kv[0]):
        h.update(name.encode())
        h.update(param.detach().contiguous().view(torch.uint8).reshape(-1).numpy().tobytes())
    return h.hexdigest()
