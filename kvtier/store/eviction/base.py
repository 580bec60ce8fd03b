"""The eviction contract and the registry every policy joins.

Each policy tracks the entries of one tier and answers one question: which unpinned entry goes
next. The owning tier serialises all calls (it holds its lock), so policies are not thread-safe.

Call order a policy can rely on (MemoryTier, MetaTier, GpuTier, LmdbTier): ``insert`` for a key the
tier stored, ``touch`` for a key it holds and read (or was asked to store again), ``remove`` when a
key left for another reason than ``pop_victim`` (delete, purge, a failed check). A tier calls
``pop_victim`` when it needs room, *before* inserting the block that needs it; the predicate names
keys that must stay (the batch being put, the parents it hangs from, keys an in-flight load or
store holds). A policy never learns the tier's capacity: the ones that need it (ARC, S3-FIFO) take
it to be the number of entries held when the tier first asks for room, and follow it after that.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

from kvtier.keys import BlockKey


@dataclass(slots=True, frozen=True)
class EntryInfo:
    key: BlockKey
    parent: BlockKey | None
    index: int
    nbytes: int


IsPinned = Callable[[BlockKey], bool]


def never_pinned(key: BlockKey) -> bool:
    return False


class EvictionPolicy(ABC):
    name: str = ""

    @abstractmethod
    def insert(self, info: EntryInfo) -> None: ...

    @abstractmethod
    def touch(self, key: BlockKey) -> None:
        """The entry was read (a hit)."""

    @abstractmethod
    def remove(self, key: BlockKey) -> None:
        """The entry left the tier for any reason other than pop_victim."""

    @abstractmethod
    def pop_victim(self, is_pinned: IsPinned) -> BlockKey | None:
        """Remove and return the next entry to evict, skipping pinned ones; None if none is evictable."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __contains__(self, key: object) -> bool:
        """Whether the policy tracks ``key`` as a cached entry (ghost entries do not count)."""


class CapacityEstimate:
    """The tier's capacity in entries, as a policy can know it: the number of entries held when the
    tier asks for room. Only the first request for room after an insert counts, because a tier that
    frees room for a whole batch first (LmdbTier) asks several times before inserting."""

    __slots__ = ("_asking", "value")

    def __init__(self) -> None:
        self.value = 0
        self._asking = False

    def asked(self, held: int) -> int:
        if not self._asking and held:
            self.value = held
        self._asking = True
        return self.value

    def inserted(self) -> None:
        self._asking = False


POLICIES: dict[str, type[EvictionPolicy]] = {}

#: The policy a tier gets when its configuration names none.
DEFAULT_POLICY = "adaptive"


def register(cls: type[EvictionPolicy]) -> type[EvictionPolicy]:
    POLICIES[cls.name] = cls
    return cls


def make_policy(name: str = DEFAULT_POLICY) -> EvictionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; one of {sorted(POLICIES)}") from None
