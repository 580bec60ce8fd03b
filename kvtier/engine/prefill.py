"""PrefillRunner: run a transformers causal LM on tokens, optionally after a KV prefix made of kvtier blocks.

It converts in both directions between kvtier blocks (``[layers, 2, block_tokens, kv_heads,
head_dim]``) and the model's own cache object (``DynamicCache``: per layer, keys and values of
shape ``[batch=1, kv_heads, tokens, head_dim]``). Keys are cached after rotary embedding, at
their absolute positions, so a block computed in one request is valid in any later request that
starts with the same tokens: the new tokens are positioned after the past and attend to it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import NamedTuple

import torch
from transformers import DynamicCache, PreTrainedModel

from kvtier.block import Block
from kvtier.errors import LayoutMismatch
from kvtier.layout import KVLayout
from kvtier.transfer.device import TransferConfig
from kvtier.transfer.engine import TransferEngine

PastBlock = torch.Tensor | Block


class PrefillTiming(NamedTuple):
    """Wall-clock seconds of one prefill's phases.

    ``assemble_s``: past blocks -> model cache (the host->device step of the cost model);
    ``forward_s``: the model forward over the new tokens; ``extract_s``: new KV -> blocks, which
    happens after the first token exists and is therefore not part of time-to-first-token.
    """

    assemble_s: float
    forward_s: float
    extract_s: float

    @property
    def ttft_s(self) -> float:
        return self.assemble_s + self.forward_s


class PrefillResult(NamedTuple):
    """``logits_last``: float32 ``[vocab]`` logits of the last new token; ``new_blocks``: the KV of
    every *full* block of the new tokens (a partial last block is not cached), in layout block shape."""

    logits_last: torch.Tensor
    new_blocks: list[torch.Tensor]
    timing: PrefillTiming
    #: The model's cache after the call (past + new tokens), only with ``keep_cache=True``: a
    #: generator continues decoding from it (the transformers connector).
    cache: DynamicCache | None = None


class PrefillRunner:
    """Runs one model whose KV cache has the shape of ``layout``.

    Invariants: the layout matches the model config (layers, KV heads, head dim, dtype) — checked
    at construction; past blocks must be block-aligned from position 0, so the new tokens start at
    ``len(past_blocks) * block_tokens``. The runner holds no state between calls and may be used by
    one thread at a time (torch parallelises inside each call).
    """

    def __init__(self, model: PreTrainedModel, layout: KVLayout) -> None:
        cfg = model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        expect = (cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim, model.dtype)
        got = (layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.torch_dtype)
        if expect != got:
            raise LayoutMismatch(f"layout (layers, kv heads, head dim, dtype) {got} does not match the model {expect}")
        if layout.block_shape_override is not None:
            raise LayoutMismatch("PrefillRunner needs the standard block shape, not an engine page override")
        self.model = model
        self.layout = layout
        self.vocab_size: int = cfg.vocab_size
        self.max_positions: int = cfg.max_position_embeddings
        #: Where the model computes: loaded blocks are moved there through the transfer engine.
        self.device: torch.device = next(model.parameters()).device
        self._engine: TransferEngine | None = None

    # -- the call -------------------------------------------------------------------------------
    def prefill(
        self,
        tokens: Sequence[int] | torch.Tensor,
        past_blocks: Sequence[PastBlock] | None = None,
        *,
        extract: bool = True,
        keep_cache: bool = False,
    ) -> PrefillResult:
        """Run the model on ``tokens`` after the KV in ``past_blocks``; return the last logits and new KV.

        Raises ValueError for empty, out-of-vocabulary or too-long input and LayoutMismatch for
        past blocks of another shape or dtype; nothing is computed in either case.
        """
        ids = self._check_tokens(tokens, len(past_blocks or ()))
        past = self._check_blocks(past_blocks or ())
        with torch.no_grad():
            t0 = time.perf_counter()
            cache = self.cache_from_blocks(past) if past else DynamicCache(config=self.model.config)
            t1 = time.perf_counter()
            out = self.model(input_ids=ids.unsqueeze(0), cache=cache, use_cache=True, logits_to_keep=1)
            logits = out.logits[0, -1].float()
            t2 = time.perf_counter()
            start = len(past) * self.layout.block_tokens
            blocks = self.blocks_from_cache(out.cache, start, start + ids.numel()) if extract else []
            t3 = time.perf_counter()
        timing = PrefillTiming(t1 - t0, t2 - t1, t3 - t2)
        return PrefillResult(logits, blocks, timing, out.cache if keep_cache else None)

    # -- blocks <-> cache -----------------------------------------------------------------------
    def cache_from_blocks(self, blocks: Sequence[torch.Tensor]) -> DynamicCache:
        """The model's cache holding ``blocks`` back to back, on the model's device."""
        n_layers, _, bt, heads, dim = self.layout.block_shape
        tokens = len(blocks) * bt
        # [n, L, 2, bt, H, D] -> [L, 2, H, n, bt, D] -> [L, 2, H, T, D]; reshape materialises once.
        kv = self.to_device(blocks).permute(1, 2, 4, 0, 3, 5).reshape(n_layers, 2, heads, tokens, dim)
        layers = [(kv[i, 0].unsqueeze(0), kv[i, 1].unsqueeze(0)) for i in range(n_layers)]
        return DynamicCache(ddp_cache_data=layers, config=self.model.config)

    def to_device(self, blocks: Sequence[torch.Tensor]) -> torch.Tensor:
        """``[n, *block_shape]`` on the model's device, moved through kvtier's TransferEngine: each
        block is written once into (pinned, on CUDA) staging and copied on the engine's h2d stream,
        ending in an event; on a CPU model the same code runs with CPU tensors."""
        n = len(blocks)
        out = torch.empty((n, *self.layout.block_shape), dtype=self.layout.torch_dtype, device=self.device)
        if n == 0:
            return out
        engine = self._transfer_engine()
        page = blocks[0].numel() * blocks[0].element_size()
        per = max(1, engine.config.buffer_bytes // page)
        for a in range(0, n, per):
            chunk = blocks[a : a + per]
            lease = engine.reserve(len(chunk) * page)
            rows = lease.rows(page)
            for i, b in enumerate(chunk):
                rows[i].copy_(b.detach().reshape(-1).view(torch.uint8))
            engine.scatter(lease, out, range(a, a + len(chunk))).wait()
        return out

    def _transfer_engine(self) -> TransferEngine:
        if self._engine is None:
            self._engine = TransferEngine(self.device, TransferConfig(buffer_bytes=16 << 20, n_buffers=2))
        return self._engine

    def blocks_from_cache(self, cache: DynamicCache, start: int, end: int) -> list[torch.Tensor]:
        """KV of the full blocks in token range ``[start, end)`` (``start`` block-aligned) as block tensors."""
        bt = self.layout.block_tokens
        if start % bt:
            raise ValueError(f"block extraction must start on a block boundary, got token {start}")
        n = (end - start) // bt
        if n <= 0:
            return []
        stop = start + n * bt
        kv = torch.stack(
            [torch.stack((layer.keys[0, :, start:stop], layer.values[0, :, start:stop])) for layer in cache.layers]
        )  # [L, 2, H, n*bt, D]
        n_layers, _, heads, _, dim = kv.shape
        out = kv.view(n_layers, 2, heads, n, bt, dim).permute(3, 0, 1, 4, 2, 5).contiguous()
        return list(out.unbind(0))

    # -- calibration helpers (timing only; values are random) ------------------------------------
    def time_forward(self, new_tokens: int, ctx_tokens: int, *, seed: int = 0) -> float:
        """Seconds for a forward over ``new_tokens`` after ``ctx_tokens`` of (random) cached KV."""
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, self.vocab_size, (1, new_tokens), generator=gen)
        lay = self.layout
        with torch.no_grad():
            cache = DynamicCache(config=self.model.config)
            if ctx_tokens:
                kv = torch.randn((lay.num_layers, 2, lay.num_kv_heads, ctx_tokens, lay.head_dim), generator=gen)
                kv = kv.to(lay.torch_dtype)
                cache = DynamicCache(
                    ddp_cache_data=[(kv[i, 0].unsqueeze(0), kv[i, 1].unsqueeze(0)) for i in range(lay.num_layers)],
                    config=self.model.config,
                )
            t0 = time.perf_counter()
            self.model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
            return time.perf_counter() - t0

    def time_assemble(self, n_blocks: int) -> float:
        """Seconds to turn ``n_blocks`` blocks into the model's cache (host-side copy)."""
        blocks = [self.layout.empty_block().zero_() for _ in range(n_blocks)]
        t0 = time.perf_counter()
        self.cache_from_blocks(blocks)
        return time.perf_counter() - t0

    def warmup(self) -> None:
        """One short forward: the first call pays one-time costs (allocator, kernel selection)."""
        self.time_forward(2 * self.layout.block_tokens, 0)
        self.time_forward(self.layout.block_tokens, 2 * self.layout.block_tokens)

    # -- validation -----------------------------------------------------------------------------
    def _check_tokens(self, tokens: Sequence[int] | torch.Tensor, n_past_blocks: int) -> torch.Tensor:
        ids = torch.as_tensor(tokens if isinstance(tokens, torch.Tensor) else list(tokens), dtype=torch.long)
        if ids.dim() != 1:
            raise ValueError(f"tokens must be one sequence (1-D), got shape {tuple(ids.shape)}")
        if ids.numel() == 0:
            raise ValueError("prefill needs at least one token")
        if int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size:
            raise ValueError(f"token ids must be in [0, {self.vocab_size})")
        total = n_past_blocks * self.layout.block_tokens + ids.numel()
        if total > self.max_positions:
            raise ValueError(f"{total} positions exceed the model's maximum of {self.max_positions}")
        return ids

    def _check_blocks(self, blocks: Sequence[PastBlock]) -> list[torch.Tensor]:
        out = []
        shape, dtype = self.layout.block_shape, self.layout.torch_dtype
        for i, b in enumerate(blocks):
            if isinstance(b, Block):
                b.meta.check_layout(self.layout)
                data = b.data
            else:
                data = b
            if tuple(data.shape) != shape or data.dtype != dtype:
                raise LayoutMismatch(
                    f"past block {i} is {tuple(data.shape)} {data.dtype}, the layout needs {shape} {dtype}"
                )
            out.append(data)
        return out
