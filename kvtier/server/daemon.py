"""``kvtier serve``: the per-node gRPC cache daemon, and the ``Daemon`` class tests embed.

Lifecycle: ``Daemon(config)`` opens the backend (tiers, keys, policy) -> ``start()`` binds the
gRPC port (plus /metrics when configured) and reports SERVING on the standard health service ->
``stop()`` reports NOT_SERVING, refuses new calls, lets in-flight calls (puts included) finish
within the grace period, then closes the store (which drains pending remote uploads) and the
rest of the backend. ``kvtier serve`` runs that on the main thread and stops on SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvtier.dataplane.listener import DataPlaneListener
from kvtier.dataplane.region_table import RegionLimits, RegionTable
from kvtier.errors import ConfigError
from kvtier.gc_freeze import freeze_start_up_objects
from kvtier.hostmem import prefault_heap, tune_malloc_for_large_blocks, with_huge_page_malloc
from kvtier.keys import PUBLIC
from kvtier.rpc import kvtier_pb2 as pb
from kvtier.security.public_trust import PublicTrust
from kvtier.security.salts import HmacSaltMapper, RequestSalts, read_salt_key
from kvtier.security.secrets import read_public_file, read_secret_file
from kvtier.security.tokens import TokenVerifier
from kvtier.security.wrapped_keys import MirroredKeyStore
from kvtier.server.auth import CallGate, GateOptions, verify_keys
from kvtier.server.backend import Backend
from kvtier.server.config import DaemonConfig, load_config
from kvtier.server.limits import ByteBudget, ConcurrencyLimit, DeadlineReaper, share
from kvtier.server.locate import Locator, locate_settings
from kvtier.server.locate_http import HttpLocate, LocateHttpServer, tls_context
from kvtier.server.observability import (
    DaemonCollector,
    MetricsEndpoint,
    ServerGauges,
    ServerMetrics,
    configure_logging,
)
from kvtier.server.service import SERVICE_NAME, KvCacheService, ServiceLimits, ServiceParts, service_handler
from kvtier.server.tier_costs import MeasuredTiers

log = logging.getLogger("kvtier.server")

#: Worker threads beyond the cache-call limit: health probes and refusals must never queue
#: behind cache calls.
HEADROOM_THREADS = 8

#: How often ``kvtier serve``'s main thread looks for a signal caught by another thread: the most
#: a SIGTERM waits before the drain starts.
SIGNAL_POLL_S = 0.25


def server_options(max_message_bytes: int) -> list[tuple[str, Any]]:
    """Channel arguments of the daemon (and, mirrored, of its clients): explicit size limits."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        # Two daemons must not share a port silently (SO_REUSEPORT would split the traffic).
        ("grpc.so_reuseport", 0),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.keepalive_permit_without_calls", 1),
    ]


class Daemon:
    """One cache daemon. See the module docstring for its lifecycle.

    Invariants: ``start`` and ``stop`` are called from one thread (the owner); ``stop`` is
    idempotent; after ``stop`` returns no call is running and every tier is closed. The backend
    is opened by the constructor, so a bad configuration or unreadable key fails before any port
    is bound.
    """

    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        s = config.server
        self.metrics = ServerMetrics()
        #: What each tier's reads cost, measured as the store serves them (Locate's prices).
        self.tier_costs = MeasuredTiers()
        locate = locate_settings(config.locate) if config.locate is not None else None
        # The access gate (built by the backend's KVCache) counts into this daemon's metrics.
        self.backend = Backend.open(config, on_count=self.metrics.gate, observer=self.tier_costs,
                                    layouts=() if locate is None else (locate.layout,))
        try:
            a = config.auth
            self.verifier = TokenVerifier(verify_keys(a.token_key_file, a.ed25519_public_key_file),
                                          audience=a.audience, max_lifetime_s=a.max_token_lifetime_s)
        except BaseException:
            self.backend.close()
            raise
        self.budget = ByteBudget(s.max_inflight_bytes, s.max_inflight_bytes_per_client)
        self.concurrency = ConcurrencyLimit(
            s.max_concurrent_rpcs, per_tenant=share(s.max_concurrent_rpcs, s.max_concurrent_rpcs_per_tenant, 2),
            per_principal=share(s.max_concurrent_rpcs, s.max_concurrent_rpcs_per_principal, 4))
        self.reaper = DeadlineReaper()
        salt_key = config.auth.salt_key_file
        hmac_salts = (HmacSaltMapper(read_salt_key(salt_key), max_lifetime_s=config.auth.salt_max_lifetime_s)
                      if salt_key else None)
        salts = RequestSalts(hmac_salts, self.verifier)
        self.gate = CallGate(self.verifier, self.backend.policy, self.budget, self.concurrency,
                             GateOptions(s.max_rpc_seconds, self.metrics, self.reaper), salts)
        self.regions = (None if s.data_plane == "off" else
                        RegionTable(RegionLimits(s.max_region_bytes, s.max_regions, s.max_regions_per_client,
                                                 share(s.max_regions, s.max_regions_per_principal, 4),
                                                 share(s.max_regions, s.max_regions_per_tenant, 2))))
        self._data_plane: DataPlaneListener | None = None
        self._data_plane_dir: str | None = None
        # The remote tier, when there is one, is the store's last: the one every node reaches.
        shared = self.backend.store.tiers[-1].name if config.tiers.remote is not None else None
        self.locator = (None if locate is None else
                        Locator(self.backend.cache, salts, self.tier_costs, locate, shared))
        self._locate_http: LocateHttpServer | None = None
        self.service = KvCacheService(ServiceParts(
            store=self.backend.store, gate=self.backend.cache.gate,
            purge=self.backend.purge, budget=self.budget, concurrency=self.concurrency, metrics=self.metrics,
            # A put commits well before its buffered blocks approach the per-client budget.
            limits=ServiceLimits(chunk_bytes=s.chunk_bytes, max_remote_misses=s.max_remote_misses_per_call,
                                 put_batch_bytes=max(1, min(16 << 20, s.max_inflight_bytes_per_client // 4))),
            regions=self.regions, data_plane=self._data_plane_offer, locator=self.locator,
        ))
        self.health = health.HealthServicer()
        self._server: grpc.Server | None = None
        self._metrics_endpoint: MetricsEndpoint | None = None
        self._stopped = threading.Event()
        self.port = 0

    def _region_counts(self) -> tuple[int, int]:
        return (0, 0) if self.regions is None else self.regions.snapshot()

    def _data_plane_counts(self) -> dict[str, int]:
        return {} if self._data_plane is None else self._data_plane.counts()

    def _key_mirror_counts(self) -> dict[str, int]:
        ring = self.backend.keyring
        store = None if ring is None else ring.store
        return store.counts() if isinstance(store, MirroredKeyStore) else {}

    def _revocation_counts(self) -> dict[str, int]:
        sync = self.backend.revocations
        return {} if sync is None else sync.snapshot()

    @property
    def store(self) -> Any:
        return self.backend.store

    @property
    def address(self) -> str:
        if self.config.server.listen.startswith("unix:"):
            return self.config.server.listen
        host = self.config.server.listen.rsplit(":", 1)[0]
        if host in ("0.0.0.0", "[::]", ""):
            host = "127.0.0.1"
        return f"{host}:{self.port}"

    @property
    def metrics_port(self) -> int | None:
        return self._metrics_endpoint.port if self._metrics_endpoint is not None else None

    @property
    def locate_http_port(self) -> int | None:
        return self._locate_http.port if self._locate_http is not None else None

    def _region_credential(self, token: str) -> Any:
        """The data-plane socket's check: the token's verified principal, if its role may use the
        data plane at all (a router may not)."""
        credential = self.gate.credential(token)
        self.backend.cache.gate.require_method(credential, "DataPlane")
        return credential

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self) -> Daemon:
        s = self.config.server
        workers = s.max_concurrent_rpcs + HEADROOM_THREADS
        server = grpc.server(
            ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvtier-rpc"),
            interceptors=[self.gate],
            options=server_options(s.max_message_bytes),
            # gRPC's own limit is a backstop at the pool size: beyond it calls would only queue.
            maximum_concurrent_rpcs=workers,
        )
        server.add_generic_rpc_handlers((service_handler(self.service),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        if s.reflection:
            reflection.enable_server_reflection(
                (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
                server,
            )
        try:
            self.port = self._bind(server)
            if self.regions is not None:
                self._data_plane = DataPlaneListener(self._data_plane_path(), self.regions, self._region_credential)
            self._locate_http = self._open_locate_http()
        except BaseException:
            if self._data_plane is not None:
                self._data_plane.close()
            if self._data_plane_dir is not None:
                shutil.rmtree(self._data_plane_dir, ignore_errors=True)
            self.reaper.close()
            self.backend.close()
            self._stopped.set()
            raise
        server.start()
        self._server = server
        trust = PublicTrust.parse(self.config.security.public_publishers)
        if trust.everyone:
            log.warning("security.public_publishers is '*': every publish:public holder of every tenant writes "
                        "the public scope all tenants read, so one tenant can change what another's model computes",
                        extra={"event": "public_publishers_everyone"})
        if s.metrics_listen:
            host, port = s.metrics_listen.rsplit(":", 1)
            collector = DaemonCollector(self.backend.store.tiers, {t.name for t in self.backend.local_tiers},
                                        self.metrics, ServerGauges(lambda: self.budget.in_flight,
                                                                   lambda: self.concurrency.active,
                                                                   lambda: self.budget.refused,
                                                                   lambda: self.concurrency.refused,
                                                                   self._revocation_counts,
                                                                   self._region_counts,
                                                                   self._data_plane_counts,
                                                                   self._key_mirror_counts,
                                                                   (trust.mode, len(trust.publishers))),
                                        # /metrics is unauthenticated: it names the public domain only.
                                        labelled_domains=frozenset({self.backend.policy.domain(PUBLIC)}))
            self._metrics_endpoint = MetricsEndpoint(collector, host.strip("[]"), int(port))
        for name in ("", SERVICE_NAME):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("serving", extra={"event": "serving", "address": self.address, "port": self.port,
                                   "metrics_port": self.metrics_port, "locate_http_port": self.locate_http_port,
                                   "tls": s.tls_cert is not None,
                                   "mtls": s.tls_client_ca is not None,
                                   "tiers": [t.name for t in self.backend.store.tiers],
                                   "public_publishers": str(trust)})
        return self

    def _bind(self, server: grpc.Server) -> int:
        s = self.config.server
        if s.tls_cert is not None and s.tls_key is not None:
            ca = read_public_file(s.tls_client_ca, "server.tls_client_ca") if s.tls_client_ca else None
            creds = grpc.ssl_server_credentials(
                [(read_secret_file(s.tls_key, "server.tls_key"), read_public_file(s.tls_cert, "server.tls_cert"))],
                root_certificates=ca, require_client_auth=ca is not None,
            )
            port = server.add_secure_port(s.listen, creds)
        else:
            port = server.add_insecure_port(s.listen)
        if not port:
            raise ConfigError(f"server.listen: cannot listen on {s.listen} (in use or not a local address)")
        return port

    def _open_locate_http(self) -> LocateHttpServer | None:
        """Locate's HTTP/JSON twin on ``locate.http_listen`` (TLS as the gRPC port), if configured."""
        loc, s = self.config.locate, self.config.server
        if loc is None or not loc.http_listen or self.locator is None:
            return None
        host, port = loc.http_listen.rsplit(":", 1)
        tls = tls_context(s.tls_cert, s.tls_key, s.tls_client_ca) if s.tls_cert and s.tls_key else None
        try:
            return LocateHttpServer(HttpLocate(self.gate, self.backend.cache.gate, self.locator), host.strip("[]"),
                                    int(port), tls)
        except OSError as exc:
            raise ConfigError(f"locate.http_listen: cannot listen on {loc.http_listen} ({exc.strerror})") from None

    def _data_plane_path(self) -> Path:
        """Where the data-plane socket goes (``server.data_plane``)."""
        s = self.config.server
        if s.data_plane.startswith("/"):
            return Path(s.data_plane)
        if s.listen.startswith("unix:"):
            return Path(s.listen.removeprefix("unix:") + ".data")
        self._data_plane_dir = tempfile.mkdtemp(prefix="kvtier-dp-")  # 0700, this daemon's alone
        return Path(self._data_plane_dir) / "data.sock"

    def _data_plane_offer(self) -> pb.DataPlaneResponse:
        dp = self._data_plane
        if dp is None:
            return pb.DataPlaneResponse()
        return pb.DataPlaneResponse(socket=str(dp.path), instance=dp.instance,
                                    max_region_bytes=dp.table.limits.max_region_bytes)

    def stop(self, grace_s: float | None = None) -> None:
        """Drain and close. In-flight calls get ``grace_s`` (default: server.shutdown_grace_s)."""
        if self._stopped.is_set():
            return
        grace = self.config.server.shutdown_grace_s if grace_s is None else grace_s
        t0 = time.monotonic()
        self.health.enter_graceful_shutdown()
        self.gate.drain()
        if self._locate_http is not None:
            self._locate_http.close()
        if self._server is not None:
            self._server.stop(grace).wait()
        self.reaper.close()
        if self._data_plane is not None:
            self._data_plane.close()
        if self._data_plane_dir is not None:
            shutil.rmtree(self._data_plane_dir, ignore_errors=True)
        if self._metrics_endpoint is not None:
            self._metrics_endpoint.close()
        self.backend.close()
        self._stopped.set()
        log.info("stopped", extra={"event": "stopped", "drain_s": round(time.monotonic() - t0, 3)})

    def wait(self, timeout_s: float | None = None) -> bool:
        return self._stopped.wait(timeout_s)

    def __enter__(self) -> Daemon:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop(grace_s=0)


# -- CLI --------------------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, metavar="FILE", help="daemon configuration (TOML)")
    p.add_argument("--ready-file", metavar="PATH",
                   help="once serving, write {pid, port, address, metrics_port, locate_http_port} as JSON to PATH "
                        "(for scripts and tests)")
    p.add_argument("--check", action="store_true", help="validate the configuration and exit")


def run(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    if args.check:
        print(f"{args.config}: ok")
        return 0
    argv = getattr(args, "_argv", None)  # None: called in process (tests), never re-executed
    env = with_huge_page_malloc(dict(os.environ)) if config.server.huge_pages and argv is not None else None
    if env is not None:
        # Once, before anything is allocated or bound: the same process (pid) with malloc on huge
        # pages. GLIBC_TUNABLES then holds the tunable, so the new image does not come back here.
        os.execve(sys.executable, [sys.executable, "-m", "kvtier.cli", *argv], env)
    handler = configure_logging(config.server.log_level)
    # The daemon's parallelism is its RPC threads. Torch's intra-op threads on top of them only
    # contend for the same cores (measured: a 512 KiB block copy 0.9 -> 6 GB/s with one thread),
    # and fresh multi-MiB buffers per block are cheaper recycled than page-faulted in again.
    torch.set_num_threads(1)
    tune_malloc_for_large_blocks()
    memory = config.tiers.memory
    # Before any RPC thread exists: they must all allocate from the heap touched here.
    if memory is not None and memory.prefault and not prefault_heap(memory.capacity_bytes):
        log.warning("memory tier not prefaulted (not glibc, or malloc refused): first stores fault it in",
                    extra={"event": "prefault_skipped", "bytes": memory.capacity_bytes})
    try:
        daemon = Daemon(config).start()
        caught: list[str] = []

        def on_signal(signum: int, _frame: object) -> None:
            # Python runs this on the main thread between any two of its bytecodes, perhaps while
            # that thread holds a lock (logging's, an Event's): it only records the signal.
            caught.append(signal.Signals(signum).name)

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        if argv is not None:
            freeze_start_up_objects()
        if args.ready_file:
            _write_ready(Path(args.ready_file), daemon)
        # Sleep in slices: the kernel may hand SIGTERM to any thread (one that is not blocking it;
        # seen right after a SIGCONT), and Python then runs ``on_signal`` only once the main thread
        # runs bytecode again. An untimed wait never returned (a daemon deaf to SIGTERM); an
        # Event set by the handler deadlocked when the signal came while the main thread held
        # the Event's own lock in its timed wait.
        while not caught:
            time.sleep(SIGNAL_POLL_S)
        log.info("signal", extra={"event": "signal", "signal": caught[0]})
        daemon.stop()
        return 0
    finally:
        logging.getLogger("kvtier").removeHandler(handler)


def _write_ready(path: Path, daemon: Daemon) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps({"pid": os.getpid(), "port": daemon.port, "address": daemon.address,
                               "metrics_port": daemon.metrics_port, "locate_http_port": daemon.locate_http_port}))
    os.replace(tmp, path)  # readers never see a half-written file
