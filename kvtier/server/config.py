"""Daemon configuration: a TOML file plus ``KVTIER_<SECTION>__<KEY>`` environment overrides.

The schema is the dataclasses below: every field carries its documentation, and a validator
where a type alone does not say what is allowed. ``load_config`` parses, applies environment
overrides, checks types and ranges, then cross-field rules; every failure is a ConfigError whose
message starts with the dotted field name (``tiers.memory.capacity_bytes: must be a positive
integer``). ``field_table()`` lists every field for the operations guide. Building the tree from
a mapping and the environment, and walking it for documentation, is kvtier/server/config_tree.py.

Relative paths are resolved against the directory of the config file, so a config and its key
files can move together.
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from kvtier.errors import ConfigError
from kvtier.server.config_tree import FieldDoc, build, deep_copy, env_overrides, set_path, walk

Check = Callable[[Any], str | None]
"""A field validator: returns a complaint (``must be ...``) or None when the value is fine."""


def _meta(doc: str, *, check: Check | None = None, kind: str | None = None) -> dict[str, Any]:
    return {"doc": doc, "check": check, "kind": kind}


def _f(default: Any = MISSING, doc: str = "", *, check: Check | None = None, kind: str | None = None) -> Any:
    """A schema field: its default, its documentation, and its validator (None: the type says all)."""
    return field(default=default, metadata=_meta(doc, check=check, kind=kind))


# -- validators ------------------------------------------------------------------------------------
def positive(v: Any) -> str | None:
    return None if v > 0 else "must be a positive integer" if isinstance(v, int) else "must be positive"


def in_range(lo: float, hi: float) -> Check:
    def check(v: Any) -> str | None:
        return None if lo <= v <= hi else f"must be in [{lo}, {hi}], got {v}"

    return check


def one_of(choices: Callable[[], list[str]]) -> Check:
    """Choices are looked up when validating, so registries filled at import are seen whole."""

    def check(v: Any) -> str | None:
        options = choices()
        return None if v in options else f"must be one of {options}, got {v!r}"

    return check


def _publishers(v: Any) -> str | None:
    from kvtier.security.public_trust import PublicTrust  # the one parser of the list

    try:
        PublicTrust.parse(v)
    except ConfigError as exc:
        return f"must be a list of trusted publishers: {exc}"
    return None


_HOST_PORT = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})$")


def host_port(v: Any) -> str | None:
    m = _HOST_PORT.match(v)
    if not m or not 0 <= int(m.group(2)) <= 65535:
        return f"must be host:port (e.g. 127.0.0.1:7070 or [::]:7070), got {v!r}"
    return None


def listen_address(v: Any) -> str | None:
    """host:port, or ``unix:/absolute/path`` for a unix socket (engines on the same node)."""
    if isinstance(v, str) and v.startswith("unix:"):
        return None if v[5:].startswith("/") and len(v) > 6 else f"a unix socket must be unix:/absolute/path, got {v!r}"
    return host_port(v)


def http_url(v: Any) -> str | None:
    parts = urlsplit(v)
    try:
        port_ok = parts.port is None or 0 < parts.port < 65536
    except ValueError:
        port_ok = False
    if parts.scheme not in ("http", "https") or not parts.hostname or not port_ok:
        return f"must be an http(s)://host[:port] URL, got {v!r}"
    return None


def bucket_name(v: Any) -> str | None:
    if not re.fullmatch(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]", v) or ".." in v:
        return f"must be a valid S3 bucket name (3-63 of a-z 0-9 . -), got {v!r}"
    return None


def _eviction_policies() -> list[str]:
    from kvtier.store.eviction import POLICIES

    return sorted(POLICIES)


def _write_policies() -> list[str]:
    from kvtier.store.remote_writer import WRITE_POLICIES

    return sorted(WRITE_POLICIES)


def _spill_modes() -> list[str]:
    return ["async", "sync"]


def _log_levels() -> list[str]:
    return ["debug", "info", "warning", "error"]


def _kv_dtypes() -> list[str]:
    from kvtier.layout import DTYPES  # torch: only for a config that has a [locate] section

    return sorted(DTYPES)


# -- schema ----------------------------------------------------------------------------------------
@dataclass(slots=True, frozen=True)
class ServerConfig:
    """The gRPC listener, its limits, TLS, and the metrics endpoint."""

    listen: str = _f("127.0.0.1:7070", "gRPC listen address host:port (port 0: any free port), or "
                     "unix:/absolute/path for a unix socket shared by the engines of the node.", check=listen_address)
    metrics_listen: str | None = _f(
        None,
        "Prometheus /metrics listen address host:port; unset or empty: no endpoint.",
        check=host_port,
    )
    max_message_bytes: int = _f(
        64 << 20,
        "Largest gRPC message either way, in bytes (sent and received).",
        check=in_range(1 << 16, 1 << 30),
    )
    chunk_bytes: int = _f(
        1 << 20,
        "Payload bytes per streamed chunk; blocks larger than this travel as several messages.",
        check=in_range(4096, 1 << 30),
    )
    max_inflight_bytes: int = _f(
        2 << 30,
        "Request and response payload bytes buffered at once, all clients together; more is "
        "RESOURCE_EXHAUSTED.",
        check=positive,
    )
    max_inflight_bytes_per_client: int = _f(512 << 20, "The same bound per client connection.", check=positive)
    max_concurrent_rpcs: int = _f(
        256,
        "Cache RPCs served at once; further calls are RESOURCE_EXHAUSTED (health checks are exempt).",
        check=in_range(1, 10000),
    )
    max_concurrent_rpcs_per_tenant: int = _f(
        0, "Cache RPCs of one tenant's credentials served at once (at most max_concurrent_rpcs); 0: half of "
           "max_concurrent_rpcs, so one tenant never takes every slot.", check=in_range(0, 10000))
    max_concurrent_rpcs_per_principal: int = _f(
        0, "Cache RPCs of one principal served at once, whatever tokens it holds (at most max_concurrent_rpcs); "
           "0: a quarter of max_concurrent_rpcs.", check=in_range(0, 10000))
    max_remote_misses_per_call: int = _f(
        64, "Keys a per-key Get may find absent in the shared tiers (S3, a remote daemon) before it stops asking "
            "them: its remaining keys are misses there, counted as probes_skipped in the tier's errors.",
        check=in_range(1, 1 << 20))
    max_rpc_seconds: float = _f(
        60.0,
        "Deadline applied to every call (a client's shorter deadline wins).",
        check=positive,
    )
    shutdown_grace_s: float = _f(
        30.0,
        "On SIGTERM, how long in-flight calls may finish before they are cancelled.",
        check=in_range(0, 3600),
    )
    reflection: bool = _f(False, "Serve gRPC server reflection (still requires a token).")
    tls_cert: str | None = _f(None, "PEM server certificate chain; with tls_key enables TLS.", kind="path")
    tls_key: str | None = _f(None, "PEM private key of tls_cert.", kind="path")
    tls_client_ca: str | None = _f(
        None,
        "PEM CA bundle; when set, clients must present a certificate it signed (mutual TLS).",
        kind="path",
    )
    log_level: str = _f("info", "Structured (JSON lines) log level on stderr.", check=one_of(_log_levels))
    data_plane: str = _f(
        "auto",
        "Shared-memory data plane for engines on this node: 'auto' (a unix socket beside a unix "
        "listen address, '<path>.data', else in a fresh private directory), 'off', or an absolute "
        "socket path. Clients that cannot attach use the inline gRPC path.",
        check=lambda v: None if v in ("auto", "off") or (isinstance(v, str) and v.startswith("/"))
        else "expected 'auto', 'off' or an absolute path",
    )
    max_region_bytes: int = _f(
        1 << 30, "Largest shared-memory region one client may attach. An engine's host KV pages attach as one "
                 "(vLLM's `kvtier.shared_pages`): raise it to their size, else its loads are copied.",
        check=in_range(1 << 20, 1 << 40))
    max_regions: int = _f(64, "Shared-memory regions attached at once, all clients together.",
                          check=in_range(1, 4096))
    max_regions_per_client: int = _f(4, "Shared-memory regions one credential may attach at once.",
                                     check=in_range(1, 4096))
    max_regions_per_principal: int = _f(0, "Shared-memory regions one principal may attach at once, whatever "
                                           "tokens it holds (at most max_regions); 0: a quarter of max_regions.",
                                        check=in_range(0, 4096))
    max_regions_per_tenant: int = _f(0, "Shared-memory regions the principals of one tenant may attach at once "
                                        "together (at most max_regions); 0: half of max_regions.",
                                     check=in_range(0, 4096))
    huge_pages: bool = _f(True, "`kvtier serve` backs malloc's heaps with transparent huge pages (glibc on "
                                "Linux; it restarts itself once with GLIBC_TUNABLES set): stored and promoted "
                                "blocks land on fresh memory, whose 4 KiB first-touch faults cost more than "
                                "the copies.")


@dataclass(slots=True, frozen=True)
class AuthConfig:
    """How capability tokens are verified. At least one key is required."""

    token_key_file: str | None = _f(
        None,
        "HMAC-SHA256 token secret (at least 32 bytes; surrounding whitespace ignored).",
        kind="path",
    )
    ed25519_public_key_file: str | None = _f(
        None,
        "PEM Ed25519 public key that verifies EdDSA tokens (the daemon cannot mint with it).",
        kind="path",
    )
    audience: str | None = _f(None, "Required token audience (aud claim); unset: tokens without one.")
    salt_key_file: str | None = _f(
        None,
        "Key of the engines' hmac request salts (kvs3:...). With it, a token with the 'engine' role acts "
        "for the principal of the salt each call presents; salts that are kvtier tokens need no key.",
        kind="path",
    )
    salt_max_lifetime_s: float = _f(
        86400.0,
        "hmac salts valid for longer than this (expires - issued) are refused: the longest a stolen salt "
        "can act for its user (one is revoked alone as `credential <its id>`).",
        check=positive,
    )
    max_token_lifetime_s: float = _f(
        86400.0,
        "Tokens valid for longer than this (exp - iat) are refused.",
        check=positive,
    )


@dataclass(slots=True, frozen=True)
class SecurityConfig:
    """Deployment key material and where encryption applies."""

    server_secret_file: str = _f(
        MISSING,
        "Secret that derives opaque scope-domain ids (>= 16 bytes). Identical on every node sharing a "
        "remote tier. Required.",
        kind="path",
    )
    master_key_file: str | None = _f(
        None,
        "Master key (KEK) file, mode 0600 (0640/0440 for Kubernetes fsGroup mounts): 32 raw bytes, 64 hex "
        "digits or base64.",
        kind="path",
    )
    master_key: str | None = _f(
        None,
        "Master key provider spec instead of master_key_file: env:VAR or kms:<client>:<key id>.",
    )
    encrypt_disk: bool = _f(True, "Encrypt records in the disk tier (AES-256-GCM, one data key per scope).")
    encrypt_remote: bool = _f(True, "Encrypt records in the remote tier.")
    key_store_dir: str | None = _f(
        None,
        "Where wrapped data keys are kept (a slot file overwritten in place; an older LMDB store is imported). "
        "Default: <tiers.disk.path>/keys; required when encrypting without a disk tier.",
        kind="path",
    )
    audit_log_file: str | None = _f(
        None,
        "Hash-chained audit log of revocations and purges; also how revocations survive restarts. "
        "Default: <tiers.disk.path>/audit.log when there is a disk tier.",
        kind="path",
    )
    min_public_prefix_blocks: int = _f(
        0,
        "Timing mitigation: a hit lying entirely in public blocks is served only when it covers at least "
        "this many blocks; 0: off. While on, per-key Gets (not prefix Gets) of public blocks return misses.",
        check=in_range(0, 1 << 20),
    )
    miss_limit: int = _f(
        0,
        "Timing mitigation: lookups and gets ending in a miss allowed per principal per miss_window_s; "
        "further reads are refused (RESOURCE_EXHAUSTED) until the window slides. 0: off.",
        check=in_range(0, 1 << 30),
    )
    miss_window_s: float = _f(60.0, "The window of miss_limit, in seconds.", check=positive)
    public_publishers: str = _f(
        "",
        "Who may write the public scope every tenant reads, besides holding publish:public: operators, and "
        "the <tenant>/<user> or <tenant>/* entries named here, comma-separated; empty (the default): operators "
        "only; *: every publish:public holder of every tenant (only where all tenants trust each other; the "
        "daemon warns at start). Only an operator deletes or purges public content.",
        check=_publishers,
    )
    revocation_sync_s: float = _f(
        5.0,
        "How often revocations and grants made on other nodes are read from the remote tier's bucket (this "
        "node's are published there as they happen); 0: off. Without tiers.remote they reach a node at restart.",
        check=in_range(0, 3600),
    )
    revocation_retired_nodes: str = _f(
        "",
        "Revocation-feed node ids (16 hex digits, comma-separated) an operator declared gone for good: their "
        "feed objects that are missing hold nobody. Only for a node whose data directory is lost while the "
        "others hold everyone because its head vanished (docs/security.md 2.5).",
        check=lambda v: None if isinstance(v, str) and all(
            re.fullmatch(r"[0-9a-f]{16}", n.strip()) for n in v.split(",") if n.strip())
        else "expected node ids of 16 lowercase hex digits, comma-separated",
    )


@dataclass(slots=True, frozen=True)
class MemoryTierConfig:
    """The daemon's CPU RAM tier."""

    capacity_bytes: int = _f(MISSING, "Host RAM for cached blocks, in bytes. Required.", check=positive)
    policy: str = _f("adaptive", "Eviction policy.", check=one_of(_eviction_policies))
    prefault: bool = _f(True, "`kvtier serve` faults the tier's capacity of heap memory in at start-up and keeps "
                              "it (glibc; one malloc arena, no trimming), so stored blocks land on pages already "
                              "mapped instead of faulting them in on the Put's path. The daemon holds that RAM "
                              "from the start, as a preallocated pool would.")


@dataclass(slots=True, frozen=True)
class DiskTierConfig:
    """The daemon's local disk tier (LMDB)."""

    path: str = _f(MISSING, "Directory of the LMDB environment (created if missing). Required.", kind="path")
    capacity_bytes: int = _f(MISSING, "Record bytes kept on disk. Required.", check=positive)
    policy: str = _f("lru", "Eviction policy.", check=one_of(_eviction_policies))
    sync: bool = _f(True, "fsync every committed batch (crash-safe across power loss, not only process crashes).")


@dataclass(slots=True, frozen=True)
class RemoteTierConfig:
    """The shared S3-compatible tier. Credentials come from AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY."""

    endpoint: str = _f(MISSING, "S3 endpoint URL. Required.", check=http_url)
    bucket: str = _f(MISSING, "Bucket (must exist). Required.", check=bucket_name)
    prefix: str = _f("kv", "Object name prefix inside the bucket.")
    region: str = _f("us-east-1", "Signing region.")
    write_policy: str = _f("write-through", "When blocks are uploaded.", check=one_of(_write_policies))
    connect_timeout_s: float = _f(1.0, "Connect timeout per S3 request.", check=positive)
    read_timeout_s: float = _f(5.0, "Read timeout per S3 request.", check=positive)
    vacuum_url: str | None = _f(
        None,
        "SeaweedFS master URL (http://host:9333). A purge then vacuums the volumes before it counts as done, so "
        "the objects it deleted leave the volume files (docs/security.md 2.6); unset: compaction is the service's.",
        check=http_url,
    )


@dataclass(slots=True, frozen=True)
class SpillConfig:
    """How blocks evicted from the memory tier reach the disk tier (docs/architecture.md, "Spilling")."""

    mode: str = _f(
        "async",
        "async: a Put returns once its blocks are in the memory tier, and what they evict is written to disk by a "
        "background thread; sync: the Put writes its evictions to disk (encrypt, write, fsync) before it returns.",
        check=one_of(_spill_modes),
    )
    queue_bytes: int = _f(
        256 << 20,
        "async: evicted blocks waiting for the disk at most, in bytes (a Put waits for room beyond it); also the "
        "most a crash can lose of blocks already evicted from RAM.",
        check=positive,
    )


@dataclass(slots=True, frozen=True)
class TiersConfig:
    """The daemon's tiers, fastest first. At least one is required."""

    memory: MemoryTierConfig | None = field(default=None, metadata=_meta("CPU RAM tier; absent: none."))
    disk: DiskTierConfig | None = field(default=None, metadata=_meta("Disk tier; absent: none."))
    remote: RemoteTierConfig | None = field(default=None, metadata=_meta("Remote tier; absent: none."))
    spill: SpillConfig = field(default_factory=SpillConfig, metadata=_meta("Spilling from memory to disk."))


@dataclass(slots=True, frozen=True)
class LocateConfig:
    """Locate (docs/operations.md, "Locate"): what the engines of this node are, so the daemon can
    derive a request's keys from its token ids as they do and price serving it here. The prefill
    defaults are the analytic Llama-3-8B on one H200 of docs/cost-model.md: measure your engine's."""

    model_id: str = _f(MISSING, "Model id of the node's engines, as their connector names the layout. Required.")
    num_layers: int = _f(MISSING, "Layers of the model's KV cache. Required.", check=positive)
    num_kv_heads: int = _f(MISSING, "KV heads per layer (per tensor-parallel rank). Required.", check=positive)
    head_dim: int = _f(MISSING, "Head dimension. Required.", check=positive)
    revision: str = _f("main", "Model revision, as the connector names it.")
    dtype: str = _f("bfloat16", "KV cache dtype.", check=one_of(_kv_dtypes))
    block_tokens: int = _f(16, "Tokens per block (the engine's block size).", check=in_range(1, 1 << 16))
    tp_size: int = _f(1, "Tensor-parallel size of the engines (rank 0's keys are looked up).",
                      check=in_range(1, 1024))
    block_shape: str = _f("vllm", "How the engines' connector lays out a block (part of the layout's fingerprint): "
                          "vllm ([layers, kv_heads, block_tokens, 2 x head_dim], the vLLM connector's pages) or "
                          "kvtier ([layers, 2, block_tokens, kv_heads, head_dim]: transformers, SGLang).",
                          check=one_of(lambda: ["vllm", "kvtier"]))
    scope_rule: str = _f("public-registry", "How the engines' connector scopes a request (kvtier.scope_rule): "
                         "public-registry or private.", check=one_of(lambda: ["public-registry", "private"]))
    private_scope: str = _f("user", "Scope kind of a request's private part (kvtier.private_scope).",
                            check=one_of(lambda: ["org", "user", "session"]))
    prefill_fixed_ms: float = _f(8.0, "Engine prefill: fixed cost per forward pass, ms.", check=in_range(0, 1e6))
    prefill_per_token_us: float = _f(32.0, "Engine prefill: cost per computed token, us.", check=in_range(0, 1e9))
    prefill_per_pair_ns: float = _f(1.3, "Engine prefill: cost per causal query-key pair, ns.",
                                    check=in_range(0, 1e9))
    prefill_per_ctx_token_ns: float = _f(0.0, "Engine prefill: cost per cached context token, ns.",
                                         check=in_range(0, 1e9))
    host_to_device_GBps: float = _f(10.0, "Loaded blocks into the engine's cache (shared memory, then host to "
                                    "device), GB/s.", check=in_range(1e-3, 1e4))
    load_fixed_ms: float = _f(0.0, "Fixed cost of serving a request with blocks loaded through the connector, "
                              "beyond their bytes (its round trips to the daemon, the engine step that waits for "
                              "them), ms: the TTFT of a prompt loaded from kvtier less that of the same prompt "
                              "from the engine's own cache.", check=in_range(0, 1e6))
    overlap: bool = _f(False, "The engines compute a prompt's front while its back loads (pipelined plans).")
    max_tokens: int = _f(131072, "Token ids accepted in one Locate.", check=in_range(1, 1 << 24))
    node: str | None = _f(None, "This node's name in answers; unset: the host name.")
    http_listen: str | None = _f(None, "host:port of Locate's HTTP/JSON twin (POST /v1/locate, bearer token); "
                                 "unset or empty: none. TLS as server.tls_*.", check=host_port)


@dataclass(slots=True, frozen=True)
class DaemonConfig:
    """Everything ``kvtier serve`` needs. Immutable once loaded."""

    # Sections have no dataclass defaults: a missing section is built from an empty table, so its
    # required fields are reported by name instead of by a TypeError.
    server: ServerConfig = field(metadata=_meta("gRPC server."))
    auth: AuthConfig = field(metadata=_meta("Token verification."))
    security: SecurityConfig = field(metadata=_meta("Key material and encryption."))
    tiers: TiersConfig = field(metadata=_meta("Storage tiers."))
    locate: LocateConfig | None = field(default=None, metadata=_meta("Locate; absent: the daemon answers no Locate."))

    def validate(self) -> None:
        """Cross-field rules; per-field rules ran while loading."""
        for rule in CROSS_FIELD_RULES:
            complaint = rule(self)
            if complaint is not None:
                raise ConfigError(complaint)

    @property
    def audit_log_path(self) -> str | None:
        if self.security.audit_log_file:
            return self.security.audit_log_file
        return str(Path(self.tiers.disk.path) / "audit.log") if self.tiers.disk else None

    @property
    def key_store_path(self) -> str | None:
        if self.security.key_store_dir:
            return self.security.key_store_dir
        return str(Path(self.tiers.disk.path) / "keys") if self.tiers.disk else None

    @property
    def revocation_feed_dir(self) -> str | None:
        """The revocation feed's durable state lives beside the audit log (none without one)."""
        audit = self.audit_log_path
        return str(Path(audit).parent / "revocation-feed") if audit else None

    @property
    def purge_journal_path(self) -> str | None:
        """Unfinished purges are journaled beside the disk tier (resumed on the next start)."""
        return str(Path(self.tiers.disk.path) / "purges") if self.tiers.disk else None

    @property
    def encrypting(self) -> bool:
        s, t = self.security, self.tiers
        return (s.encrypt_disk and t.disk is not None) or (s.encrypt_remote and t.remote is not None)


# -- cross-field rules (strategies: each returns a complaint naming its field, or None) ------------
def _tls_pair(c: DaemonConfig) -> str | None:
    s = c.server
    if (s.tls_cert is None) != (s.tls_key is None):
        return "server.tls_cert: tls_cert and tls_key must be set together"
    if s.tls_client_ca is not None and s.tls_cert is None:
        return "server.tls_client_ca: mutual TLS needs server.tls_cert and server.tls_key"
    return None


def _limits(c: DaemonConfig) -> str | None:
    s = c.server
    if s.max_inflight_bytes_per_client > s.max_inflight_bytes:
        return "server.max_inflight_bytes_per_client: must not exceed server.max_inflight_bytes"
    if s.chunk_bytes + (64 << 10) > s.max_message_bytes:
        return "server.chunk_bytes: must be at least 64 KiB below server.max_message_bytes (room for headers)"
    return None


def _has_tier(c: DaemonConfig) -> str | None:
    t = c.tiers
    if t.memory is None and t.disk is None and t.remote is None:
        return "tiers: configure at least one of [tiers.memory], [tiers.disk], [tiers.remote]"
    return None


def _token_key(c: DaemonConfig) -> str | None:
    if c.auth.token_key_file is None and c.auth.ed25519_public_key_file is None:
        return "auth.token_key_file: set token_key_file and/or ed25519_public_key_file (calls must be authenticated)"
    return None


def _secrets(c: DaemonConfig) -> str | None:
    s = c.security
    if s.master_key_file is not None and s.master_key is not None:
        return "security.master_key: set master_key_file or master_key, not both"
    encrypting = c.encrypting
    if encrypting and s.master_key_file is None and s.master_key is None:
        return "security.master_key_file: required while encrypt_disk/encrypt_remote applies to a configured tier"
    if encrypting and s.key_store_dir is None and c.tiers.disk is None:
        return "security.key_store_dir: required when encrypting without a disk tier (wrapped data keys live there)"
    if s.master_key is not None and not re.match(r"^(env|kms):", s.master_key):
        return f"security.master_key: expected env:VAR or kms:<client>:<key id>, got {s.master_key.split(':')[0]!r}:..."
    return None


def _write_policy_needs_local(c: DaemonConfig) -> str | None:
    r = c.tiers.remote
    if r is not None and r.write_policy == "write-back" and c.tiers.memory is None and c.tiers.disk is None:
        return "tiers.remote.write_policy: write-back needs a local tier to write back from"
    return None


CROSS_FIELD_RULES: tuple[Callable[[DaemonConfig], str | None], ...] = (
    _has_tier, _tls_pair, _limits, _token_key, _secrets, _write_policy_needs_local,
)


# -- loading ---------------------------------------------------------------------------------------
def load_config(path: str | os.PathLike[str] | None, *, env: Mapping[str, str] | None = None) -> DaemonConfig:
    """Read ``path`` (None: defaults only), apply ``KVTIER_*__*`` overrides from ``env``, validate."""
    raw: dict[str, Any] = {}
    base = Path.cwd()
    if path is not None:
        p = Path(path)
        try:
            text = p.read_text()
        except OSError as exc:
            raise ConfigError(f"config file {p}: cannot read ({exc.strerror})") from None
        try:
            raw = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {p}: invalid TOML: {exc}") from None
        base = p.resolve().parent
    return config_from_dict(raw, env=os.environ if env is None else env, base_dir=base)


def config_from_dict(
    raw: Mapping[str, Any], *, env: Mapping[str, str] | None = None, base_dir: Path | None = None
) -> DaemonConfig:
    data = deep_copy(raw)
    for dotted, value in env_overrides(env or {}):
        set_path(data, dotted, value)
    cfg = build(DaemonConfig, data, "", base_dir or Path.cwd())
    cfg.validate()
    return cfg


# -- documentation (kvtier/server/config_tree.py walks the schema) ----------------------------------
def field_table() -> list[FieldDoc]:
    """Every configuration field, in file order, for docs/operations.md."""
    rows: list[FieldDoc] = []
    walk(DaemonConfig, "", rows)
    return rows


def field_table_markdown() -> str:
    lines = ["| field | type | default | environment | meaning |", "|---|---|---|---|---|"]
    for r in field_table():
        lines.append(f"| `{r.path}` | {r.type} | `{r.default}` | `{r.env}` | {r.doc} |")
    return "\n".join(lines) + "\n"
