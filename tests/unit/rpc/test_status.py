"""kvtier errors survive the wire: every class of the status table comes back as itself through a
real gRPC server (unary and streaming), RateLimited stays apart from Overloaded, and answers that
carry no usable class name are mapped by their status code alone."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from benchmarks.localdeploy import LocalDeployment
from kvtier.errors import (
    AccessDenied,
    AuthError,
    KvtierError,
    Overloaded,
    RateLimited,
    TierUnavailable,
    TransferError,
)
from kvtier.keys import Segment, block_chain
from kvtier.rpc.status import ERROR_METADATA, STATUS_OF, abort_rpc, error_from, status_of
from kvtier.server.daemon import Daemon
from storage_backends.grpc import GrpcTier, GrpcTierConfig
from tests.helpers import SECRET, SMALL


class MyOverload(Overloaded):
    """A kvtier error defined outside kvtier.errors: it travels as its nearest class in the table."""


RAISABLE: dict[str, type[KvtierError]] = {
    **{cls.__name__: cls for cls, _ in STATUS_OF},
    "KvtierError": KvtierError,
    "TransferError": TransferError,
    "MyOverload": MyOverload,
}


def _raise(request: bytes, context: grpc.ServicerContext) -> bytes:
    abort_rpc(context, RAISABLE[request.decode()]("refused: details"))


def _raise_stream(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
    yield b"first"
    abort_rpc(context, RAISABLE[request.decode()]("refused: details"))


def _forge(request: bytes, context: grpc.ServicerContext) -> bytes:
    """``CODE`` or ``CODE name``: abort with that code and (maybe) that class name, bypassing the table."""
    code, _, name = request.decode().partition(" ")
    if name:
        context.set_trailing_metadata(((ERROR_METADATA, name),))
    context.abort(grpc.StatusCode[code], "forged")


@pytest.fixture(scope="module")
def target() -> Iterator[str]:
    server = grpc.server(ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("kvtier.test.Errors", {
        "Raise": grpc.unary_unary_rpc_method_handler(_raise),
        "RaiseStream": grpc.unary_stream_rpc_method_handler(_raise_stream),
        "Forge": grpc.unary_unary_rpc_method_handler(_forge),
    }),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(None)


@pytest.fixture(scope="module")
def channel(target: str) -> Iterator[grpc.Channel]:
    ch = grpc.insecure_channel(target)
    try:
        yield ch
    finally:
        ch.close()


def _unary(ch: grpc.Channel, method: str, request: str) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as exc:
        ch.unary_unary(f"/kvtier.test.Errors/{method}")(request.encode(), timeout=10)
    return exc.value


def _streamed(ch: grpc.Channel, request: str) -> grpc.RpcError:
    got = []
    with pytest.raises(grpc.RpcError) as exc:
        for msg in ch.unary_stream("/kvtier.test.Errors/RaiseStream")(request.encode(), timeout=10):
            got.append(msg)
    assert got == [b"first"]
    return exc.value


@pytest.mark.parametrize("cls", [cls for cls, _ in STATUS_OF], ids=lambda c: c.__name__)
def test_every_class_in_the_table_round_trips(channel: grpc.Channel, cls: type[KvtierError]) -> None:
    for rpc_error in (_unary(channel, "Raise", cls.__name__), _streamed(channel, cls.__name__)):
        assert rpc_error.code() == status_of(cls("x"))
        err = error_from(rpc_error)
        assert type(err) is cls
        assert str(err) == f"daemon answered {rpc_error.code().name}: refused: details"


def test_rate_limited_and_overloaded_share_a_code_but_not_a_class(channel: grpc.Channel) -> None:
    limited, overloaded = _unary(channel, "Raise", "RateLimited"), _unary(channel, "Raise", "Overloaded")
    assert limited.code() == overloaded.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert type(error_from(limited)) is RateLimited
    assert type(error_from(overloaded)) is Overloaded


@pytest.mark.parametrize("name,code,arrives_as", [
    ("MyOverload", grpc.StatusCode.RESOURCE_EXHAUSTED, Overloaded),  # nearest class in the table
    ("TransferError", grpc.StatusCode.INTERNAL, TierUnavailable),  # not in the table: the daemon failed
    ("KvtierError", grpc.StatusCode.INTERNAL, TierUnavailable),
])
def test_classes_outside_the_table(channel: grpc.Channel, name: str, code: grpc.StatusCode,
                                   arrives_as: type[KvtierError]) -> None:
    rpc_error = _unary(channel, "Raise", name)
    assert rpc_error.code() == code
    assert type(error_from(rpc_error)) is arrives_as


@pytest.mark.parametrize("forged,arrives_as", [
    ("RESOURCE_EXHAUSTED", Overloaded),  # gRPC's own (message too large): no name, the general class
    ("RESOURCE_EXHAUSTED NoSuchError", Overloaded),  # unknown name
    ("RESOURCE_EXHAUSTED KvtierError", Overloaded),  # a kvtier class, but not one of the table
    ("UNAVAILABLE AuthError", TierUnavailable),  # a table class sent with another class's code
    ("PERMISSION_DENIED RateLimited", AccessDenied),
    ("UNAUTHENTICATED AuthError", AuthError),
    ("INTERNAL", TierUnavailable),
    ("CANCELLED", TierUnavailable),
])
def test_answers_without_a_usable_name_map_by_code(channel: grpc.Channel, forged: str,
                                                   arrives_as: type[KvtierError]) -> None:
    assert type(error_from(_unary(channel, "Forge", forged))) is arrives_as


def test_an_asyncio_calls_error_maps_like_a_blocking_ones(target: str) -> None:
    """grpc.aio's errors (the router's Locate client) are no grpc.Call: the class still travels."""

    async def fail(request: str) -> grpc.RpcError:
        async with grpc.aio.insecure_channel(target) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await ch.unary_unary("/kvtier.test.Errors/Raise")(request.encode(), timeout=10)
        return exc.value

    # RateLimited and Overloaded share a code: only the class name in the trailers tells them apart.
    for cls in (RateLimited, Overloaded, AccessDenied):
        err = error_from(asyncio.run(fail(cls.__name__)))
        assert type(err) is cls and str(err).endswith("refused: details")
    assert type(error_from(asyncio.run(fail("TransferError")))) is TierUnavailable


def test_a_non_call_rpc_error_is_an_unavailable_daemon() -> None:
    err = error_from(grpc.RpcError("socket closed"))
    assert type(err) is TierUnavailable and "socket closed" in str(err)


def test_the_daemon_sends_rate_limited_and_the_tier_keeps_it(tmp_path: Path) -> None:
    """Through CallGate and GrpcTier: admin-style calls raise RateLimited, engine reads are counted misses."""
    dep = LocalDeployment(tmp_path / "dep", server_secret=SECRET)
    dep.write_config(memory_bytes=1 << 20, security={"miss_limit": 1, "miss_window_s": 600})
    with Daemon(dep.config()) as d:
        tier = GrpcTier(GrpcTierConfig(d.address, dep.token(), max_attempts=1))
        try:
            own = tier.domains().own("user")
            absent = [c.key for c in block_chain(SMALL, [Segment(range(2 * SMALL.block_tokens), own)], tier.domains())]
            assert tier.lookup_response(absent).length == 0  # the one miss allowed
            with pytest.raises(RateLimited, match="missed lookups"):
                tier.lookup_response(absent)
            assert tier.contains(absent) == 0
            assert tier.lookup(absent).length == 0  # the engine's lookup: a counted miss
            assert tier.get(absent) == [None, None]  # Get is a server stream
            errors = tier.metrics.snapshot()["errors"]
            assert errors == {"rate_limited": 3}
        finally:
            tier.close()
