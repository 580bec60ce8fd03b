"""A daemon's ``Locate`` from an asyncio loop: the client a router's fleet view asks each node with.

A router answers HTTP on an event loop and asks every node's daemon where a prompt is cached on
most requests' path. Over the blocking client (``GrpcTier.locate``) each such call crossed from
the loop to a worker thread and back, and the fleet view fanned out through a thread per node:
on a host whose cores the engines keep busy, those hand-overs (each one waiting for the GIL and a
core) cost the router several times what the daemons took to answer. This client is
``grpc.aio`` on the router's own loop: the calls to every node are in flight at once with no
thread of ours in between.

The channel is opened on the first call, so on the loop that runs the calls (a grpc.aio channel
belongs to one loop; the client may be built before that loop runs, as a command's set-up does).

Protocol: ``GrpcLocateClient(config)`` -> ``await locate(request, timeout_s=...)`` any number of
times, from one event loop -> ``await close()``. Every failure raises its kvtier exception, as
``GrpcTier.locate`` does (kvtier/rpc/status.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import grpc

from kvtier.errors import TierUnavailable
from kvtier.rpc import kvtier_pb2 as pb
from kvtier.rpc.names import AUTH_METADATA, SERVICE_NAME
from kvtier.rpc.status import error_from


class LocateChannelConfig(Protocol):
    """What the client reads of storage_backends/grpc.py's ``GrpcTierConfig`` (named by its
    shape: that module imports this one, to offer the client under the backend's name)."""

    @property
    def target(self) -> str: ...

    @property
    def token(self) -> str | Callable[[], str]: ...

    @property
    def timeout_s(self) -> float: ...

    def validate(self) -> None: ...

    def aio_channel(self) -> grpc.aio.Channel: ...


def _serialized(request: pb.LocateRequest | bytes) -> bytes:
    # Serialized once by a caller that asks many nodes: 131,072 token ids take 1.2 ms to
    # serialize, on the router's loop, for every node of the fleet.
    return request if isinstance(request, bytes) else request.SerializeToString()


class GrpcLocateClient:
    """``Locate`` on one daemon over a grpc.aio channel (module docstring). The config's salt, data
    plane and payload settings do not apply: a Locate carries its salt in the request."""

    def __init__(self, config: LocateChannelConfig) -> None:
        config.validate()
        self.config = config
        self._channel: grpc.aio.Channel | None = None
        self._call: grpc.aio.UnaryUnaryMultiCallable | None = None
        self._closed = False

    def _open(self) -> grpc.aio.UnaryUnaryMultiCallable:
        if self._closed:
            raise TierUnavailable(f"daemon {self.config.target}: this Locate client is closed")
        if self._call is None:
            self._channel = self.config.aio_channel()
            self._call = self._channel.unary_unary(f"/{SERVICE_NAME}/Locate", request_serializer=_serialized,
                                                   response_deserializer=pb.LocateResponse.FromString)
        return self._call

    async def locate(self, request: pb.LocateRequest | bytes, *, timeout_s: float | None = None) -> pb.LocateResponse:
        """The daemon's answer (kvtier/server/locate.py); ``timeout_s`` replaces the configured
        deadline for this call. ``request`` may come serialized (``SerializeToString``): a fleet
        view sends one query to every node."""
        call = self._open()
        token = self.config.token() if callable(self.config.token) else self.config.token
        try:
            return await call(request, timeout=self.config.timeout_s if timeout_s is None else timeout_s,
                              metadata=((AUTH_METADATA, f"Bearer {token}"),))
        except grpc.RpcError as exc:
            raise error_from(exc) from None

    async def close(self) -> None:
        self._closed = True
        if self._channel is not None:
            await self._channel.close()
            self._channel = self._call = None
