"""Devices, transfer options and completions (the CUDA event a transfer ends in)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvtier.errors import ConfigError
from kvtier.transfer.copiers import COPIERS

MiB = 1 << 20

PageIds = Sequence[int] | np.ndarray | torch.Tensor


def resolve_device(device: str | torch.device | None = None) -> torch.device:
    """The device to use: CUDA (with an explicit index) when present and not overridden, else CPU."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device {dev} requested but CUDA is not available")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    elif dev.type != "cpu":
        raise ConfigError(f"unsupported transfer device {dev}: use cuda or cpu")
    return dev


@dataclass(slots=True, frozen=True)
class TransferConfig:
    """Sizing of a TransferEngine. All staging memory is allocated once, at engine construction."""

    #: Bytes of one staging buffer: the largest batch (or layer of a layerwise load) one transfer moves.
    buffer_bytes: int = 64 * MiB
    #: Number of staging buffers, hence of transfers that can hold staging at once.
    n_buffers: int = 4
    #: Bound on staged bytes not yet consumed (lent, or released but still being copied).
    #: None means n_buffers * buffer_bytes.
    max_inflight_bytes: int | None = None
    #: Page ids per batch (sizes the preallocated id staging next to each buffer).
    max_pages: int = 16384
    #: Page copier from COPIERS, or "auto" (fused cupy kernel when usable, torch indexing otherwise).
    copier: str = "auto"
    #: How long a submitter waits for staging before TransferError; None waits forever.
    acquire_timeout_s: float | None = 60.0
    #: Layers a LayerwiseLoad queues ahead of the one being waited for.
    prefetch_layers: int = 2

    def __post_init__(self) -> None:
        if self.buffer_bytes <= 0:
            raise ConfigError("TransferConfig.buffer_bytes must be positive")
        if self.n_buffers <= 0:
            raise ConfigError("TransferConfig.n_buffers must be positive")
        if self.max_pages <= 0:
            raise ConfigError("TransferConfig.max_pages must be positive")
        if self.max_inflight_bytes is not None and self.max_inflight_bytes < self.buffer_bytes:
            raise ConfigError("TransferConfig.max_inflight_bytes must allow at least one full buffer")
        if self.acquire_timeout_s is not None and self.acquire_timeout_s <= 0:
            raise ConfigError("TransferConfig.acquire_timeout_s must be positive (or None)")
        if self.prefetch_layers < 0:
            raise ConfigError("TransferConfig.prefetch_layers must be >= 0")
        if self.copier != "auto" and self.copier not in COPIERS:
            raise ConfigError(f"TransferConfig.copier: unknown {self.copier!r}; one of auto, {sorted(COPIERS)}")

    @property
    def inflight_limit(self) -> int:
        return self.max_inflight_bytes if self.max_inflight_bytes is not None else self.n_buffers * self.buffer_bytes


class Completion:
    """A point in one stream's queued work: done once everything queued before it has run.

    Immutable and shareable between threads. Work that ran synchronously (every CPU transfer) has
    no event and is done from the start. Waiting blocks the host on this event only.
    """

    __slots__ = ("_event",)

    def __init__(self, event: torch.cuda.Event | None = None) -> None:
        self._event = event

    @classmethod
    def record(cls, stream: torch.cuda.Stream | None) -> Completion:
        """A completion after the work queued so far on ``stream`` (None: nothing to wait for)."""
        if stream is None:
            return DONE
        ev = torch.cuda.Event()
        ev.record(stream)
        return cls(ev)

    def done(self) -> bool:
        return self._event is None or bool(self._event.query())

    def wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()

    def block_stream(self, stream: torch.cuda.Stream | None) -> None:
        """Make ``stream`` wait for this point without blocking the host."""
        if self._event is not None and stream is not None:
            stream.wait_event(self._event)


DONE = Completion()
