"""Named failures. Expected outcomes (miss, partial hit, no room) are return values, not these."""


class KvtierError(Exception):
    """Base of every failure kvtier raises on purpose."""


class LayoutMismatch(KvtierError):
    """A block's layout fingerprint, dtype or shape does not match the layout it is used with."""


class BlockSizeError(LayoutMismatch):
    """A block's byte size is not the layout's bytes_per_block."""


class CorruptRecord(KvtierError):
    """A stored record failed verification (magic, length, checksum/tag, header fields)."""


class UnsupportedFormat(CorruptRecord):
    """A record written by a format version this reader does not understand."""


class ScopeError(KvtierError):
    """A malformed scope string or a request that mixes incompatible scopes."""


class AccessDenied(KvtierError):
    """The policy refused this principal the operation on this scope."""


class AuthError(AccessDenied):
    """A credential is missing, forged, tampered with or expired."""


class TierUnavailable(KvtierError):
    """A tier's backing service cannot be reached (S3 down, daemon unreachable)."""


class ConfigError(KvtierError):
    """Invalid configuration; the message names the offending field."""


class RateLimited(AccessDenied):
    """A principal exceeded a configured rate (e.g. lookups that end in misses) and is refused for now."""


class KeyUnavailable(TierUnavailable):
    """A data key exists but cannot be unwrapped now (wrong master key, KMS unreachable).

    Distinct from CorruptRecord on purpose: records under such a key are intact and must not be
    quarantined; they become readable again once the master key or KMS is back.
    """


class TransferError(KvtierError):
    """A host<->device transfer request is malformed or cannot be served: page ids out of range or
    duplicated as scatter targets, a batch larger than a staging buffer, mismatched page sizes, a
    staging buffer used after release, or back-pressure that did not clear within its timeout."""


class InvalidRequest(KvtierError):
    """A request is malformed: a key of the wrong width, chunks out of order, a payload whose size,
    shape or checksum disagrees with its metadata. Nothing of the request is stored."""


class Overloaded(KvtierError):
    """A service is at a configured limit (in-flight bytes, concurrent calls) and refuses more for
    now; the caller may retry later. Nothing was lost."""


class DeadlineExceeded(TierUnavailable):
    """A call ran past its deadline (the client's, or the server's own limit)."""


class HeldOff(TierUnavailable):
    """Not asked: the daemon left a recent call unanswered, and its client holds off until a
    probe gets an answer (storage_backends/circuit_breaker.py). Never sent on the wire."""


class DataPlaneUnavailable(KvtierError):
    """Shared memory cannot be used with this daemon from this process (the reason says why)."""


class RegionUnavailable(KvtierError):
    """A call named a shared-memory region the daemon does not hold (detached, or the daemon
    restarted): the client attaches a new region or sends its bytes inline."""


class SpillFailed(TierUnavailable):
    """Spilling evicted blocks into the tier below failed (those blocks are lost, and counted), or
    the spill thread stopped; raised by ``flush``/``close`` and by a durable put that waited."""
