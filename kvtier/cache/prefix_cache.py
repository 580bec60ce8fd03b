"""PrefixCache: what an engine's connector needs from kvtier, whichever side holds the store.

Two implementations: ``KVCache`` (the store in this process, behind the access gate) and the
engine's client of a node daemon (``DaemonCache``, beside the connectors: the daemon holds the
store and the gate; the client only derives keys and moves blocks). A connector is written
against this protocol and works with either.

Protocol, per request, in call order: ``chain`` -> ``lookup`` -> ``load_found`` (reads what the
lookup found, possibly in another process, with no second lookup) or ``load`` -> the engine
computes the rest -> ``save``. ``record_request`` counts the request's token hit rate.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from kvtier.block import Block
from kvtier.keys import ChainBlock, Segment
from kvtier.layout import KVLayout
from kvtier.security.policy import Principal
from kvtier.store.layer_sink import LayerSink
from kvtier.store.lookup import Lookup

if TYPE_CHECKING:
    from kvtier.cache.kv_cache import RequestSegment, SaveReport


class PrefixCache(Protocol):
    def layout(self, which: KVLayout | str | None = None) -> KVLayout: ...

    def chain(self, principal: Principal, segments: Iterable[RequestSegment | Segment], *,
              layout: KVLayout | str | None = None, after: ChainBlock | None = None) -> list[ChainBlock]: ...

    def lookup(self, principal: Principal, chain: Sequence[ChainBlock]) -> Lookup: ...

    def load(self, principal: Principal, chain: Sequence[ChainBlock], n: int | None = None, *,
             lookup: Lookup | None = None, sink: LayerSink | None = None) -> list[Block]: ...

    def load_found(self, principal: Principal, lookup: Lookup, *, start: int = 0, end: int | None = None,
                   sink: LayerSink | None = None) -> list[Block]: ...

    def save(self, principal: Principal, chain: Sequence[ChainBlock], tensors: Sequence[torch.Tensor], *,
             start: int = 0) -> SaveReport: ...

    def record_request(self, input_tokens: int, hit_tokens: int) -> None: ...

    def traffic(self) -> list[dict[str, object]]:
        """The counters of each tier this cache reads and writes (``TierMetrics.snapshot``)."""
        ...
