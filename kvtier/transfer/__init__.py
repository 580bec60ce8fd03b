"""The transfer engine: page copies between device memory and host staging buffers.

The names below were importable from the single module ``kvtier.transfer`` before it became this
package; they stay importable from here. Only torch and numpy are imported (cupy lazily).
"""

from kvtier.transfer.copiers import PageCopier, make_copier, page_rows
from kvtier.transfer.device import DONE, Completion, TransferConfig, resolve_device
from kvtier.transfer.engine import LayerwiseLoad, Transfer, TransferEngine
from kvtier.transfer.staging import StagingBuffer, StagingLease, StagingPool

__all__ = [
    "DONE",
    "Completion",
    "LayerwiseLoad",
    "PageCopier",
    "StagingBuffer",
    "StagingLease",
    "StagingPool",
    "Transfer",
    "TransferConfig",
    "TransferEngine",
    "make_copier",
    "page_rows",
    "resolve_device",
]
