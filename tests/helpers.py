"""Test data builders shared by the suites (real layouts, real keys, random payloads)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from kvtier.block import Block
from kvtier.keys import DomainDeriver, Scope, Segment, block_chain
from kvtier.layout import KVLayout

SECRET = b"test-server-secret-0123456789abcdef"
DERIVER = DomainDeriver(SECRET)
SMALL = KVLayout("test-model", num_layers=2, num_kv_heads=2, head_dim=8, dtype="bfloat16", block_tokens=4)


def chain_blocks(
    n: int,
    *,
    layout: KVLayout = SMALL,
    scope: Scope | None = None,
    seed: int = 0,
    token_base: int = 0,
) -> list[Block]:
    """``n`` chained blocks of one request; payload bytes are a function of ``seed`` and position."""
    tokens = [token_base + i for i in range(n * layout.block_tokens)]
    chain = block_chain(layout, [Segment(tokens, scope or Scope.public())], DERIVER)
    gen = torch.Generator().manual_seed(seed)
    out = []
    for c in chain:
        data = torch.randn(layout.block_shape, generator=gen).to(layout.torch_dtype)
        out.append(Block.build(layout, c.key, c.domain, data, parent=c.parent, index=c.index))
    return out


def same_bytes(a: Block, b: Block) -> bool:
    return a.equal_bytes(b)


def wait_for(cond: Callable[[], bool], timeout: float = 10.0, every_s: float = 0.02) -> bool:
    """Poll ``cond`` until it holds or ``timeout`` passes; its last answer (for background work)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(every_s)
    return cond()
