"""Authentication and call admission for the daemon: the one gate every RPC passes.

``CallGate`` is a gRPC server interceptor. For every method except the standard health service it
(1) verifies the capability token in ``authorization: Bearer <token>`` and checks the principal
is not revoked, (2) admits the call under the concurrency limit, (3) gives it a ``Call``: the
principal, a lease on the in-flight byte budget, and a deadline, and (4) maps kvtier's named
exceptions to status codes on the way out. Request messages that do not parse become
INVALID_ARGUMENT (gRPC's default would be INTERNAL). Servicer methods receive the ``Call`` in
place of the raw context, so none of them can run unauthenticated by mistake.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import grpc
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from kvtier.errors import AuthError, ConfigError, DeadlineExceeded, InvalidRequest, KvtierError, TierUnavailable
from kvtier.rpc.names import AUTH_METADATA, SALT_METADATA
from kvtier.rpc.status import abort_rpc, status_of
from kvtier.security.acting_log import ActingLog
from kvtier.security.policy import Policy, Principal
from kvtier.security.salts import RequestSalts, SaltMapper, acting_principal
from kvtier.security.secrets import read_public_file, read_secret_file
from kvtier.security.tokens import Ed25519SigningKey, Ed25519VerifyKey, HmacKey, TokenVerifier, VerifyKey
from kvtier.server.limits import ByteBudget, ConcurrencyLimit, DeadlineReaper, Lease
from kvtier.server.observability import ServerMetrics

log = logging.getLogger("kvtier.server")

BEARER = "Bearer "
#: Methods anyone may call: the kubelet's gRPC probes carry no token.
UNAUTHENTICATED_METHODS = frozenset({"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"})
MIN_HMAC_SECRET = 32


# -- token keys -----------------------------------------------------------------------------------
def hmac_key_from_file(path: str, field_name: str = "auth.token_key_file") -> HmacKey:
    """The HMAC token key; its kid is a hash of the secret, so minter and daemon agree without config."""
    secret = read_secret_file(path, field_name).strip()
    if len(secret) < MIN_HMAC_SECRET:
        raise ConfigError(f"{field_name}: the token secret must be at least {MIN_HMAC_SECRET} bytes, got {len(secret)}")
    kid = "hs-" + hashlib.sha256(b"kvtier-token-kid-v1\x00" + secret).hexdigest()[:16]
    return HmacKey(kid, secret)


def _ed25519_kid(public: Ed25519PublicKey) -> str:
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return "ed-" + hashlib.sha256(b"kvtier-token-kid-v1\x00" + raw).hexdigest()[:16]


def ed25519_verify_key_from_file(path: str, field_name: str = "auth.ed25519_public_key_file") -> Ed25519VerifyKey:
    pem = read_public_file(path, field_name)
    try:
        public = serialization.load_pem_public_key(pem)
    except ValueError:
        raise ConfigError(f"{field_name}: {path} is not a PEM public key") from None
    if not isinstance(public, Ed25519PublicKey):
        raise ConfigError(f"{field_name}: {path} holds a {type(public).__name__}, not an Ed25519 public key")
    return Ed25519VerifyKey(_ed25519_kid(public), public)


def ed25519_signing_key_from_file(path: str, field_name: str = "--ed25519-private-key") -> Ed25519SigningKey:
    pem = read_secret_file(path, field_name)
    try:
        private = serialization.load_pem_private_key(pem, password=None)
    except (ValueError, TypeError):
        raise ConfigError(f"{field_name}: {path} is not an unencrypted PEM private key") from None
    if not isinstance(private, Ed25519PrivateKey):
        raise ConfigError(f"{field_name}: {path} holds a {type(private).__name__}, not an Ed25519 private key")
    return Ed25519SigningKey(_ed25519_kid(private.public_key()), private)


def verify_keys(token_key_file: str | None, ed25519_public_key_file: str | None) -> list[VerifyKey]:
    keys: list[VerifyKey] = []
    if token_key_file:
        keys.append(hmac_key_from_file(token_key_file))
    if ed25519_public_key_file:
        keys.append(ed25519_verify_key_from_file(ed25519_public_key_file))
    if not keys:
        raise ConfigError("auth.token_key_file: no token verification key configured")
    return keys


# -- the per-call context -------------------------------------------------------------------------
@dataclass(slots=True)
class Call:
    """What a servicer method knows about its call. Created by CallGate, one per RPC, and used
    only by the thread serving that RPC (the lease is the one part safe from other threads)."""

    method: str
    principal: Principal
    peer: str
    lease: Lease
    deadline: float
    context: grpc.ServicerContext
    started: float = field(default_factory=time.monotonic)
    ticket: int = -1
    #: The token's own principal (``principal`` differs for an engine acting for a salt): what
    #: owns the call's shared-memory region.
    credential: Principal | None = None

    def check_deadline(self) -> None:
        if time.monotonic() > self.deadline:
            raise DeadlineExceeded(f"{self.method} ran past its deadline")

    def active(self) -> bool:
        return self.context.is_active()


class Malformed:
    """What the gate's deserializers return for bytes that do not parse (gRPC treats a raised
    error or None as INTERNAL; this lets the call end as INVALID_ARGUMENT instead)."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _safe(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserialize is None:
        return None

    def parse(raw: bytes) -> Any:
        try:
            return deserialize(raw)
        except Exception as exc:
            return Malformed(type(exc).__name__)

    return parse


def _parsed(request: Any) -> Any:
    if isinstance(request, Malformed):
        raise InvalidRequest(f"request message does not parse ({request.reason})")
    return request


@dataclass(slots=True, frozen=True)
class GateOptions:
    max_rpc_seconds: float
    metrics: ServerMetrics
    reaper: DeadlineReaper


class CallGate(grpc.ServerInterceptor):
    """Authenticates, admits and accounts every call; see the module docstring.

    Invariants: a method outside UNAUTHENTICATED_METHODS runs only with a verified, unrevoked
    principal; every admitted call leaves the concurrency limit and closes its lease exactly
    once, however it ends (return, error, cancellation: the lease is also closed from gRPC's
    termination callback). Shared state (limits, metrics) carries its own locks.
    """

    def __init__(
        self,
        verifier: TokenVerifier,
        policy: Policy,
        budget: ByteBudget,
        limit: ConcurrencyLimit,
        options: GateOptions,
        salts: SaltMapper | None = None,
    ) -> None:
        self.verifier = verifier
        #: Verifies the request salts that engine credentials present (``acting_principal``).
        self.salts = salts if salts is not None else RequestSalts(None, verifier)
        self.policy = policy
        #: Audits which engine credential acted for which salt's principal (once per pair).
        self.acting = ActingLog(policy.audit)
        self.budget = budget
        self.limit = limit
        self.options = options
        self.metrics = options.metrics
        self._draining = False

    def drain(self) -> None:
        """Refuse new calls (UNAVAILABLE) while in-flight ones finish."""
        self._draining = True

    # -- interceptor ------------------------------------------------------------------------------
    def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(details)
        if handler is None or details.method in UNAUTHENTICATED_METHODS:
            return handler
        method = details.method
        deser = _safe(handler.request_deserializer)
        ser = handler.response_serializer
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(self._unary(method, handler.unary_unary), deser, ser)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(self._server_stream(method, handler.unary_stream), deser, ser)
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(self._client_stream(method, handler.stream_unary), deser, ser)
        return grpc.stream_stream_rpc_method_handler(self._bidi(method, handler.stream_stream), deser, ser)

    def _unary(self, method: str, inner: Callable[..., Any]) -> Callable[..., Any]:
        def behavior(request: Any, context: grpc.ServicerContext) -> Any:
            call = self._begin(method, context)
            with self._guarded(call):
                return inner(_parsed(request), call)

        return behavior

    def _server_stream(self, method: str, inner: Callable[..., Iterator[Any]]) -> Callable[..., Iterator[Any]]:
        def behavior(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            call = self._begin(method, context)
            with self._guarded(call):
                yield from inner(_parsed(request), call)

        return behavior

    def _client_stream(self, method: str, inner: Callable[..., Any]) -> Callable[..., Any]:
        def behavior(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
            call = self._begin(method, context)
            with self._guarded(call):
                return inner(self._requests(requests, call), call)

        return behavior

    def _bidi(self, method: str, inner: Callable[..., Iterator[Any]]) -> Callable[..., Iterator[Any]]:
        def behavior(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
            call = self._begin(method, context)
            with self._guarded(call):
                yield from inner(self._requests(requests, call), call)

        return behavior

    @contextmanager
    def _guarded(self, call: Call) -> Iterator[None]:
        """How every admitted call ends: kvtier errors become their status code, a vanished client
        is counted as cancelled, anything else is a bug (logged, UNKNOWN); the call's lease and
        concurrency slot are returned in every case (a closed stream raises GeneratorExit here)."""
        try:
            yield
        except KvtierError as exc:
            self._fail(call, exc)
        except grpc.RpcError:
            # The client went away while we read its stream: not a crash, nothing to answer.
            self.metrics.call_failed(call.method, grpc.StatusCode.CANCELLED.name)
            raise
        except Exception:
            self._crashed(call)
            raise
        finally:
            self._end(call)

    @staticmethod
    def _requests(requests: Iterator[Any], call: Call) -> Iterator[Any]:
        for r in requests:
            call.check_deadline()
            yield _parsed(r)

    # -- the gate ---------------------------------------------------------------------------------
    def _begin(self, method: str, context: grpc.ServicerContext) -> Call:
        self.metrics.call_started(method)
        try:
            if self._draining:
                raise TierUnavailable("the daemon is shutting down")
            credential, principal = self._authenticated(method, context.invocation_metadata())
            # Bounded per tenant and per principal of the token too: many tokens take no more.
            self.limit.try_enter(credential.tenant, credential.id)
        except KvtierError as exc:
            self.metrics.call_failed(method, status_of(exc).name)
            self._log_refusal(method, context.peer(), exc)
            abort_rpc(context, exc)
        now = time.monotonic()
        remaining = context.time_remaining()
        budget = self.options.max_rpc_seconds
        if remaining is not None:
            budget = min(budget, remaining)
        call = Call(method, principal, context.peer(), self.budget.lease(context.peer()), now + budget, context,
                    credential=credential)
        # Runs when the RPC terminates for any reason, including a client that vanished while
        # its handler was blocked: in-flight bytes must not outlive the call.
        context.add_callback(call.lease.close)
        call.ticket = self.options.reaper.watch(call.deadline, context.cancel)
        return call

    def _authenticated(self, method: str, metadata: Any) -> tuple[Principal, Principal]:
        """``authenticate``, failing closed: a credential whose check itself fails (a bug) is
        AuthError, so the call is UNAUTHENTICATED; the traceback goes to the log, never to the
        caller, and /metrics counts it (``kvtier_access_gate{what="credential_check_crashed"}``)."""
        try:
            return self.authenticate(metadata, method=method.rsplit("/", 1)[-1])
        except KvtierError:
            raise
        except Exception:
            self.metrics.gate("credential_check_crashed")
            log.exception("credential check crashed", extra={"event": "credential_check_crashed", "method": method})
            raise AuthError("the credential could not be verified") from None

    def authenticate(self, metadata: Any, *, method: str = "") -> tuple[Principal, Principal]:
        """The credential a call's token names and the principal the call acts for: the token's
        own, or, for an engine's token, the principal of the request salt it presents (verified
        here, where the salt key lives). ``method``: the call's short name (``acting_principal``)."""
        token = salt = None
        for k, v in metadata or ():
            if k == AUTH_METADATA:
                token = v
            elif k == SALT_METADATA:
                salt = v
        if not isinstance(token, str) or not token.startswith(BEARER):
            raise AuthError("missing credential: send 'authorization: Bearer <token>'")
        credential = self.credential(token[len(BEARER) :].strip())
        principal = acting_principal(credential, salt if isinstance(salt, str) else None, self.salts, method)
        if principal is not credential:
            self.policy.require_active(principal)
            self.acting.acted(credential, principal)
        return credential, principal

    def credential(self, token: str) -> Principal:
        """The verified, unrevoked principal a bearer token names (also the data-plane socket's check)."""
        credential = self.verifier.principal(token)
        self.policy.require_active(credential)
        return credential

    def _fail(self, call: Call, exc: KvtierError) -> None:
        code = status_of(exc)
        self.metrics.call_failed(call.method, code.name)
        if code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.DATA_LOSS):
            log.error("call failed", extra={"event": "call_failed", "method": call.method,
                                            "principal": call.principal.id, "code": code.name, "error": str(exc)})
        else:
            log.info("call refused", extra={"event": "call_refused", "method": call.method,
                                            "principal": call.principal.id, "code": code.name, "error": str(exc)})
        abort_rpc(call.context, exc)

    def _crashed(self, call: Call) -> None:
        # A bug, not a refusal: gRPC answers UNKNOWN; the traceback goes to the log once, here.
        self.metrics.call_failed(call.method, grpc.StatusCode.UNKNOWN.name)
        log.exception("call crashed", extra={"event": "call_crashed", "method": call.method,
                                             "principal": call.principal.id})

    def _end(self, call: Call) -> None:
        self.options.reaper.done(call.ticket)
        call.lease.close()
        holder = call.credential if call.credential is not None else call.principal
        self.limit.exit(holder.tenant, holder.id)
        self.metrics.call_finished(call.method, time.monotonic() - call.started)

    @staticmethod
    def _log_refusal(method: str, peer: str, exc: KvtierError) -> None:
        log.info("call refused", extra={"event": "call_refused", "method": method, "peer": peer,
                                        "code": status_of(exc).name, "error": str(exc)})
