"""kvtier errors on the wire: the one table between kvtier exceptions and gRPC status codes.

Server side, ``abort_rpc`` ends a call with ``status_of(exc)`` and names the exception's class in
the trailing metadata ``kvtier-error``. Client side, ``error_from`` rebuilds that class, so errors
that share a status code (RateLimited and Overloaded are both RESOURCE_EXHAUSTED) stay apart. Only
names of classes in ``STATUS_OF`` are accepted, and only with the status code the table gives
them; any other answer (no name, an unknown one, a status gRPC itself produced) is mapped by its
code alone, to the most general class of that code. Codes kvtier never sends on purpose (INTERNAL,
UNKNOWN, CANCELLED, ...) mean the server failed: TierUnavailable.
"""

from __future__ import annotations

from typing import NoReturn

import grpc

from kvtier.errors import (
    AccessDenied,
    AuthError,
    BlockSizeError,
    ConfigError,
    CorruptRecord,
    DeadlineExceeded,
    InvalidRequest,
    KeyUnavailable,
    KvtierError,
    LayoutMismatch,
    Overloaded,
    RateLimited,
    RegionUnavailable,
    ScopeError,
    TierUnavailable,
    UnsupportedFormat,
)

#: Trailing metadata key naming the kvtier exception class a call failed with.
ERROR_METADATA = "kvtier-error"

#: kvtier exception -> status code. Most specific first: an exception takes the first entry it is
#: an instance of. Within one code the most general class comes last; it stands for the code alone.
#: Other kvtier errors (bugs, TransferError) are INTERNAL and carry no name.
STATUS_OF: tuple[tuple[type[KvtierError], grpc.StatusCode], ...] = (
    (AuthError, grpc.StatusCode.UNAUTHENTICATED),
    (RateLimited, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (AccessDenied, grpc.StatusCode.PERMISSION_DENIED),
    (ScopeError, grpc.StatusCode.INVALID_ARGUMENT),
    (BlockSizeError, grpc.StatusCode.INVALID_ARGUMENT),
    (LayoutMismatch, grpc.StatusCode.INVALID_ARGUMENT),
    (InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (Overloaded, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (DeadlineExceeded, grpc.StatusCode.DEADLINE_EXCEEDED),
    (KeyUnavailable, grpc.StatusCode.UNAVAILABLE),
    (TierUnavailable, grpc.StatusCode.UNAVAILABLE),
    (UnsupportedFormat, grpc.StatusCode.DATA_LOSS),
    (CorruptRecord, grpc.StatusCode.DATA_LOSS),
    (RegionUnavailable, grpc.StatusCode.FAILED_PRECONDITION),
    (ConfigError, grpc.StatusCode.FAILED_PRECONDITION),
)
_BY_NAME = {cls.__name__: (cls, code) for cls, code in STATUS_OF}
_BY_CODE = {code: cls for cls, code in STATUS_OF}  # later (more general) entries win


def _entry(exc: KvtierError) -> tuple[type[KvtierError] | None, grpc.StatusCode]:
    for cls, code in STATUS_OF:
        if isinstance(exc, cls):
            return cls, code
    return None, grpc.StatusCode.INTERNAL


def status_of(exc: KvtierError) -> grpc.StatusCode:
    """The status code a call failing with ``exc`` ends with."""
    return _entry(exc)[1]


def abort_rpc(context: grpc.ServicerContext, exc: KvtierError) -> NoReturn:
    """End the call (unary or streaming) with ``exc``: its status code, its message, its class name."""
    cls, code = _entry(exc)
    if cls is not None:
        context.set_trailing_metadata(((ERROR_METADATA, cls.__name__),))
    context.abort(code, str(exc))
    raise AssertionError("unreachable: abort raises")


def error_from(exc: grpc.RpcError) -> KvtierError:
    """The kvtier exception a failed call stands for (see the module docstring)."""
    # A blocking call's error is a grpc.Call; an asyncio one's (grpc.aio) is an AioRpcError.
    if not isinstance(exc, grpc.Call | grpc.aio.AioRpcError):
        return TierUnavailable(f"daemon answered {grpc.StatusCode.UNKNOWN.name}: {exc}")
    code = exc.code()
    named = _BY_NAME.get(dict(exc.trailing_metadata() or ()).get(ERROR_METADATA))
    cls = named[0] if named is not None and named[1] == code else _BY_CODE.get(code, TierUnavailable)
    return cls(f"daemon answered {code.name}: {exc.details()}")
