"""One gRPC channel to a ``kvtier serve`` daemon, shared by every client on it (the engine's own
and those acting for each request's salt): its stubs, its shared-memory session, and its breaker,
which decides whether a call goes to the daemon at all (``GrpcTierConfig.hold_off_s``)."""

from __future__ import annotations

import logging

import grpc

from kvtier.dataplane.session import DataPlaneSession
from kvtier.errors import HeldOff, KvtierError, TierUnavailable
from kvtier.rpc import kvtier_pb2 as pb
from kvtier.rpc import kvtier_pb2_grpc as pb_grpc
from kvtier.rpc.names import SERVICE_NAME
from kvtier.rpc.wire import decode_message, encode_frame
from storage_backends.circuit_breaker import BreakerState, CircuitBreaker
from storage_backends.grpc_config import MAX_HOLD_OFF_S, PROBE_TIMEOUT_S, GrpcTierConfig

log = logging.getLogger("kvtier.daemon_client")


class DaemonChannel:
    """The channel, its method stubs, its session and its breaker.

    Protocol of a call: ``admit`` (the deadline to use, or HeldOff: not sent), the call, then
    ``ended`` with how it ended (every admitted call, exactly once). Thread-safe, as the channel,
    the session and the breaker are.
    """

    def __init__(self, target: str, channel: grpc.Channel, session: DataPlaneSession,
                 breaker: CircuitBreaker | None) -> None:
        self.target = target
        self.channel = channel
        #: The shared-memory region of this channel, used by every client on it.
        self.session = session
        #: Whether calls go to the daemon now: every client on the channel holds off together.
        self.breaker = breaker
        self.stub = pb_grpc.KvCacheStub(channel)
        # Payload-carrying calls use the frame codec (one copy of each payload byte per side).
        self.get = channel.unary_stream(f"/{SERVICE_NAME}/Get", request_serializer=pb.GetRequest.SerializeToString,
                                        response_deserializer=decode_message)
        self.put = channel.stream_unary(f"/{SERVICE_NAME}/Put", request_serializer=encode_frame,
                                        response_deserializer=pb.PutResponse.FromString)

    @classmethod
    def open(cls, config: GrpcTierConfig) -> DaemonChannel:
        """A new channel as ``config`` says (validated by the caller)."""
        breaker = CircuitBreaker(1, config.hold_off_s, max_cooldown_s=MAX_HOLD_OFF_S) if config.hold_off_s else None
        return cls(config.target, config.channel(), DataPlaneSession(config.data_plane, config.region_bytes), breaker)

    def admit(self, timeout_s: float) -> float:
        """The deadline of a call the breaker lets go (a probe's at most PROBE_TIMEOUT_S: a daemon
        that answers at all answers well within it); HeldOff when it holds calls off."""
        b = self.breaker
        if b is None:
            return timeout_s
        state = b.admit()
        if state is None:
            wait = b.retry_in_s()
            raise HeldOff(f"daemon {self.target}: not asked, a call found it unreachable; "
                          + (f"a probe goes in {wait:.1f} s" if wait else "a probe is out"))
        return min(timeout_s, PROBE_TIMEOUT_S) if state is BreakerState.HALF_OPEN else timeout_s

    def ended(self, err: KvtierError | None) -> None:
        """How an admitted call ended (``err`` None: answered). Only ``TierUnavailable`` counts
        against the daemon: any answer, a refusal included, shows it is there."""
        b = self.breaker
        if b is None:
            return
        before = b.state
        b.record(not isinstance(err, TierUnavailable))
        after = b.state
        if before is BreakerState.CLOSED and after is BreakerState.OPEN:
            log.warning("daemon %s: %s; calls fail at once for %.1f s, then one probes",
                        self.target, err, b.retry_in_s())
        elif before is not BreakerState.CLOSED and after is BreakerState.CLOSED:
            log.warning("daemon %s answers again: calls go through", self.target)

    def close(self) -> None:
        self.session.close()
        self.channel.close()


__all__ = ["DaemonChannel"]
