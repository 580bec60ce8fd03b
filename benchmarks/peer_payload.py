"""The bytes and tokens of ``kvtier bench peer``: one definition both sides generate from.

Imported by kvtier's side as ``benchmarks.peer_payload`` and by the LMCache driver (which runs in
``.venv-lmcache``, without kvtier) as the sibling module ``peer_payload``; it needs only torch,
pinned to the same version in both virtual environments, so both sides store identical bytes.
"""

from __future__ import annotations

import torch


def chunk_payload(seed: int, request: int, chunk: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Chunk ``chunk`` of request ``request``: random int16 viewed as fp16 (every bit pattern,
    NaNs included, so comparisons must be bytewise)."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + request * 1_009 + chunk)
    return torch.randint(-(2**15), 2**15, shape, generator=gen, dtype=torch.int16).view(torch.float16)


def request_tokens(seed: int, request: int, n: int) -> list[int]:
    """Token ids of a request: distinct per (seed, request), so no two requests share a prefix."""
    base = 1_000 + (seed % 1_000) * 100_000 + request * 10_000
    return [base + (i % 10_000) for i in range(n)]


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bytewise equality (a float compare would call NaN != NaN and +0 == -0)."""
    return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))
