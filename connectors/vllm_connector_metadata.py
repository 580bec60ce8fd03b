"""What vLLM's scheduler-side connector hands its workers each step (``KVConnectorMetadata``):
the blocks to load and the blocks to save, as jobs (connectors/vllm_connector.py has the protocol)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from connectors.scoping import ScopedPrompt
from kvtier.keys import ChainBlock
from kvtier.store.lookup import Lookup


@dataclass(slots=True, frozen=True)
class BlockJob:
    """Load or save blocks ``[start, end)`` of a request's chain to/from vLLM blocks ``block_ids``.

    Carries tokens and scopes, not keys: each worker derives keys with its own layout. A load also
    carries the scheduler's lookups (``found``), one per tensor-parallel rank's layout, keyed by
    the layout's fingerprint: each worker reads its ``[start, end)`` of its own rank's lookup
    without looking up again (through a daemon, the lookup carries the daemon's ticket and the
    daemon walks no tier for it).
    """

    req_id: str
    #: The request's salt: each worker resolves it to the same principal and cache itself.
    salt: str
    prompt: ScopedPrompt
    start: int
    end: int
    block_ids: tuple[int, ...]
    found: Mapping[bytes, Lookup] = field(default_factory=dict)
    #: A save: the chain block before ``start`` as the scheduler derived it, per rank's layout
    #: fingerprint, so each worker derives only the blocks it saves.
    after: Mapping[bytes, ChainBlock] = field(default_factory=dict)


@dataclass
class KvtierConnectorMetadata(KVConnectorMetadata):
    loads: list[BlockJob] = field(default_factory=list)
    saves: list[BlockJob] = field(default_factory=list)
    #: Loads that run between steps (``kvtier.load_async``); reported through get_finished.
    async_loads: bool = False
