"""What ``kvtier bench peer`` measures: the workload, the cases, the preparation, one case's result.

Both sides run the same ``Workload`` and report a ``CaseRun`` per case per round. A case's GB/s
counts a round only when every request of it was verified byte for byte; a round in which a
system lost or damaged any request has no GB/s for that case (the failure is reported instead),
so a system cannot look fast by dropping work.

Both sides get the same preparation before anything is timed (``Side.untimed`` says, per side,
what that was in its terms): the client's one-time set-up and one warm-up request stored and
read back; before the timed warm retrieve, ``warmup_passes`` untimed read passes over the same
requests. The servers' memory starts in one first-touch state on both sides (``FIRST_TOUCH``):
``prefaulted`` (every page of the RAM tier / L1 touched before timing) or ``cold`` (as a freshly
started server has it); a run measures the RAM cases in both unless told otherwise. The disk
phases always start both sides cold: a prefaulted L1 would take filler stores that LMCache writes
on to its L2 in the background, during the timed reads.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

#: Case name -> the row label of the report, in report order.
CASES: dict[str, str] = {
    "store": "store (RAM)",
    "warm_retrieve": "warm retrieve (RAM)",
    "store_paged": "store (RAM), kvtier from vLLM-style pages",
    "warm_retrieve_paged": "warm retrieve (RAM), kvtier into vLLM-style pages",
    "disk_page_cache": "retrieve from encrypted disk, in page cache",
    "disk_cold": "retrieve from encrypted disk, page cache dropped",
    "disk_store": "store with the encrypted disk tier behind RAM",
}
#: Cases measured in the RAM phase, once per first-touch state.
RAM_CASES = ("store", "warm_retrieve", "store_paged", "warm_retrieve_paged")
#: The first-touch states of the servers' memory a run can measure (module docstring).
FIRST_TOUCH: dict[str, str] = {
    "prefaulted": "every page of the RAM tier (LMCache: L1) touched before timing",
    "cold": "the RAM tier (LMCache: L1) as a freshly started server has it",
}


@dataclass(frozen=True)
class Workload:
    """Sizes shared by both sides. A chunk (LMCache) is a block (kvtier): ``chunk_tokens`` tokens
    of every layer's K and V."""

    layers: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    chunk_tokens: int = 256
    #: Tokens per page of LMCache's paged client KV cache (vLLM's default block size).
    page_tokens: int = 16
    request_tokens: int = 2048
    requests: int = 4
    rounds: int = 5
    #: Both sides' RAM tier (LMCache: L1).
    memory_bytes: int = 2 << 30
    #: Untimed read passes over the stored requests before the timed warm retrieve (both sides).
    warmup_passes: int = 1
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.request_tokens % self.chunk_tokens or self.chunk_tokens % self.page_tokens:
            raise ValueError("request_tokens must be a multiple of chunk_tokens, and chunk_tokens of page_tokens")
        if min(self.layers, self.kv_heads, self.head_dim, self.requests, self.rounds) < 1:
            raise ValueError("layers, kv_heads, head_dim, requests and rounds must be positive")
        if self.warmup_passes < 0:
            raise ValueError("warmup_passes must not be negative")

    @property
    def chunks_per_request(self) -> int:
        return self.request_tokens // self.chunk_tokens

    @property
    def chunk_shape(self) -> tuple[int, int, int, int, int]:
        """kvtier's block shape, and the order in which the driver lays a chunk into LMCache's pages."""
        return (self.layers, 2, self.chunk_tokens, self.kv_heads, self.head_dim)

    @property
    def pages_per_chunk(self) -> int:
        return self.chunk_tokens // self.page_tokens

    @property
    def pages_per_request(self) -> int:
        return self.request_tokens // self.page_tokens

    @property
    def chunk_bytes(self) -> int:
        return self.layers * 2 * self.chunk_tokens * self.kv_heads * self.head_dim * 2  # fp16

    @property
    def request_bytes(self) -> int:
        return self.chunk_bytes * self.chunks_per_request

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class CaseRun:
    """One case of one system in one round: a time per request and how many came back intact."""

    request_bytes: int
    requests: int
    #: Seconds of each request that was timed (a request lost before timing has none).
    seconds: list[float] = field(default_factory=list)
    #: Requests whose every byte was read back equal to what was stored.
    verified: int = 0
    #: Fraction of the data files in the page cache when the timed reads began (disk reads only).
    page_cache_resident: float | None = None
    #: How the payload bytes moved between client and server (as the client reports it).
    data_plane: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return self.verified == self.requests and len(self.seconds) == self.requests

    @property
    def gbps(self) -> float | None:
        """A request's bytes over the median request time, only when every request was verified.
        The median keeps one stall of a shared machine (or a first call's one-time set-up) from
        deciding a round."""
        if not self.complete or statistics.median(self.seconds) <= 0:
            return None
        return self.request_bytes / statistics.median(self.seconds) / 1e9

    def as_dict(self) -> dict[str, Any]:
        g = self.gbps
        return {"gbps": None if g is None else round(g, 4),
                "ms_per_request": [round(s * 1e3, 2) for s in self.seconds],
                "requests": self.requests, "verified_requests": self.verified,
                "verified_bytes": self.verified * self.request_bytes,
                "page_cache_resident": (None if self.page_cache_resident is None
                                        else round(self.page_cache_resident, 4)),
                "data_plane": self.data_plane, "notes": self.notes}


class Side(Protocol):
    """One system under test. Each phase starts its own fresh server(s) and stops them; ``touch``
    (RAM phase) is one of ``FIRST_TOUCH``; the disk phases start cold."""

    name: str

    def describe(self) -> dict[str, Any]:
        """The configuration the report records (versions, tiers, encryption, durability)."""
        ...

    def untimed(self, touch: str) -> list[str]:
        """What this side was given before timing, in its own terms (the report records it)."""
        ...

    def close(self) -> None:
        """Stop whatever the side keeps between phases (servers never outlive their phase)."""
        ...

    def ram(self, seed: int, touch: str) -> dict[str, CaseRun]:
        """``store``, ``warm_retrieve`` and their ``_paged`` twins against a RAM tier of ``memory_bytes``."""
        ...

    def disk_store(self, seed: int) -> dict[str, CaseRun]:
        """``disk_store``: stores into ``memory_bytes`` of RAM with the encrypted disk behind."""
        ...

    def disk_read(self, seed: int) -> dict[str, CaseRun]:
        """``disk_cold`` and ``disk_page_cache``: reads of requests on the encrypted disk by a
        freshly started server, once with the page cache dropped and once with it warm."""
        ...
