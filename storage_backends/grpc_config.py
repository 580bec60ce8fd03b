"""How a client reaches a ``kvtier serve`` daemon (``GrpcTierConfig``): its address, credential,
TLS, deadlines, data plane and hold-off, and the gRPC channel built from them."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from kvtier.dataplane.session import DataPlaneSession
from kvtier.errors import ConfigError
from kvtier.rpc.names import SERVICE_NAME

TokenSource = str | Callable[[], str]

#: The longest a client holds off an unreachable daemon between probes, and a probe's deadline.
MAX_HOLD_OFF_S = 8.0
PROBE_TIMEOUT_S = 1.0


@dataclass(slots=True, frozen=True)
class GrpcTierConfig:
    """How to reach a daemon. ``token`` may be a callable so long-running engines can refresh it."""

    target: str
    token: TokenSource
    #: PEM CA bundle that signed the daemon's certificate; None: plaintext (loopback, trusted nets).
    tls_ca: bytes | None = None
    #: PEM client certificate and key for mutual TLS.
    tls_cert: bytes | None = None
    tls_key: bytes | None = None
    #: Expected name in the daemon's certificate when it differs from the target host.
    tls_server_name: str | None = None
    chunk_bytes: int = 1 << 20
    max_message_bytes: int = 64 << 20
    #: Deadline of each call (a whole Get or Put stream included).
    timeout_s: float = 30.0
    #: Attempts of a call that failed with UNAVAILABLE before any response arrived (gRPC retries).
    max_attempts: int = 3
    name: str = "daemon"
    #: A request salt this client acts for (an engine credential's calls: see kvtier.security.salts).
    salt: str | None = None
    #: Payload path: ``auto`` (shared memory with a daemon on this node when it can be had, else
    #: inline gRPC), ``shm`` (required), ``tcp`` (always inline). See kvtier/dataplane/session.py.
    data_plane: str = "auto"
    #: Size of the shared-memory region (the daemon may cap it); blocks beyond a call's share go inline.
    region_bytes: int = 256 << 20
    #: Every Put returns only once its blocks are on the daemon's disk tier (else: once in its RAM).
    durable: bool = False
    #: After a call found the daemon unreachable (no answer within its deadline, or no
    #: connection), every call on the channel fails at once (HeldOff) for this long; then one
    #: probes, with a deadline of at most PROBE_TIMEOUT_S, and each probe that fails doubles the
    #: wait, up to MAX_HOLD_OFF_S. 0: never (each call waits its own deadline).
    hold_off_s: float = 0.0

    def validate(self) -> None:
        if not self.target or ":" not in self.target:
            raise ConfigError(f"GrpcTierConfig.target: expected host:port, got {self.target!r}")
        if not 4096 <= self.chunk_bytes <= self.max_message_bytes - (64 << 10):
            raise ConfigError("GrpcTierConfig.chunk_bytes: must be >= 4096 and 64 KiB below max_message_bytes")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("GrpcTierConfig.tls_cert: tls_cert and tls_key go together")
        if self.tls_cert is not None and self.tls_ca is None:
            raise ConfigError("GrpcTierConfig.tls_ca: mutual TLS needs the daemon's CA too")
        if not self.timeout_s > 0:
            raise ConfigError("GrpcTierConfig.timeout_s must be positive")
        if not 1 <= self.max_attempts <= 5:
            raise ConfigError("GrpcTierConfig.max_attempts must be in [1, 5]")
        if not 0 <= self.hold_off_s <= MAX_HOLD_OFF_S:
            raise ConfigError(f"GrpcTierConfig.hold_off_s must be in [0, {MAX_HOLD_OFF_S:g}] seconds")
        if self.data_plane not in DataPlaneSession.MODES:
            raise ConfigError(f"GrpcTierConfig.data_plane must be one of {DataPlaneSession.MODES}")
        if not 1 << 20 <= self.region_bytes <= 1 << 40:
            raise ConfigError("GrpcTierConfig.region_bytes must be between 1 MiB and 1 TiB")

    def channel(self) -> grpc.Channel:
        options, creds = self._channel_args()
        if creds is None:
            return grpc.insecure_channel(self.target, options=options)
        return grpc.secure_channel(self.target, creds, options=options)

    def aio_channel(self) -> grpc.aio.Channel:
        """The same channel for an asyncio loop (a router's Locate client); open it on that loop."""
        options, creds = self._channel_args()
        if creds is None:
            return grpc.aio.insecure_channel(self.target, options=options)
        return grpc.aio.secure_channel(self.target, creds, options=options)

    def _channel_args(self) -> tuple[list[tuple[str, Any]], grpc.ChannelCredentials | None]:
        options: list[tuple[str, Any]] = [
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.keepalive_time_ms", 30_000),
        ]
        if self.max_attempts > 1:  # gRPC's retry policy needs at least two attempts
            retry = {"methodConfig": [{
                "name": [{"service": SERVICE_NAME}],
                "retryPolicy": {"maxAttempts": self.max_attempts, "initialBackoff": "0.05s", "maxBackoff": "0.5s",
                                "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]},
            }]}
            options += [("grpc.enable_retries", 1), ("grpc.service_config", json.dumps(retry))]
        else:
            options.append(("grpc.enable_retries", 0))
        if self.tls_server_name:
            options.append(("grpc.ssl_target_name_override", self.tls_server_name))
        if self.tls_ca is None:
            return options, None
        return options, grpc.ssl_channel_credentials(self.tls_ca, self.tls_key, self.tls_cert)


__all__ = ["MAX_HOLD_OFF_S", "PROBE_TIMEOUT_S", "GrpcTierConfig", "TokenSource"]
