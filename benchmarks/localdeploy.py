"""A daemon deployment in one local directory: key files, a config file, tokens.

Used by the tests, ``kvtier bench daemon`` and anyone trying the daemon on one machine. The key
files are created fresh (mode 0600) unless given; the config is ordinary TOML that
``kvtier serve --config`` reads, listening on loopback.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvtier.security.master_keys import write_master_key
from kvtier.security.policy import Principal
from kvtier.security.salts import DEFAULT_SALT_TTL_S, mint_salt
from kvtier.security.tokens import MintRequest, mint
from kvtier.server.auth import hmac_key_from_file
from kvtier.server.config import DaemonConfig, load_config

Sections = Mapping[str, Mapping[str, Any]]


def _write_secret(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    path.chmod(0o600)
    return path


def toml_text(sections: Sections) -> str:
    """TOML for ``{"server": {...}, "tiers.memory": {...}}``: flat tables of str/int/float/bool."""
    out = []
    for name, table in sections.items():
        out.append(f"[{name}]")
        for k, v in table.items():
            if isinstance(v, bool):
                out.append(f"{k} = {'true' if v else 'false'}")
            elif isinstance(v, int | float):
                out.append(f"{k} = {v!r}")
            elif isinstance(v, str):
                out.append(f"{k} = {_quote(v)}")
            else:
                raise TypeError(f"toml_text: {name}.{k} has unsupported type {type(v).__name__}")
        out.append("")
    return "\n".join(out)


def _quote(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


class LocalDeployment:
    """Key material and a config for one daemon under ``root``.

    ``server_secret`` decides the scope domains: pass the same one to two deployments (or to a
    local DomainDeriver) and they derive identical keys. Not thread-safe; build once, then read.
    """

    def __init__(self, root: str | Path, *, server_secret: bytes | None = None) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.server_secret = server_secret or secrets.token_hex(32).encode()
        self.token_key_file = _write_secret(self.root / "token.key", secrets.token_hex(32).encode())
        self.server_secret_file = _write_secret(self.root / "server.secret", self.server_secret)
        self.master_key_file = self.root / "master.key"
        if not self.master_key_file.exists():
            write_master_key(self.master_key_file)
        self.config_file = self.root / "kvtier.toml"
        self._key = hmac_key_from_file(str(self.token_key_file))
        #: The key of the engines' request salts; the daemon verifies salts with it.
        self.salt_key = secrets.token_bytes(32)
        self.salt_key_file = _write_secret(self.root / "salt.key", self.salt_key.hex().encode())

    def write_config(
        self,
        *,
        memory_bytes: int | None = 64 << 20,
        disk_bytes: int | None = None,
        remote: Mapping[str, Any] | None = None,
        server: Mapping[str, Any] | None = None,
        security: Mapping[str, Any] | None = None,
        memory: Mapping[str, Any] | None = None,
        auth: Mapping[str, Any] | None = None,
    ) -> Path:
        """Write ``kvtier.toml``: the given tiers (disk under ``root/lmdb``), loopback listener on a
        free port, these key files; ``server``/``security``/``memory`` (``tiers.memory``)/``auth``
        entries override the defaults."""
        sections: dict[str, dict[str, Any]] = {
            "server": {"listen": "127.0.0.1:0", "max_concurrent_rpcs": 64, "shutdown_grace_s": 5.0,
                       **(server or {})},
            "auth": {"token_key_file": str(self.token_key_file), "salt_key_file": str(self.salt_key_file),
                     **(auth or {})},
            "security": {"server_secret_file": str(self.server_secret_file),
                         "master_key_file": str(self.master_key_file), **(security or {})},
        }
        if memory_bytes is not None:
            sections["tiers.memory"] = {"capacity_bytes": memory_bytes, **(memory or {})}
        if disk_bytes is not None:
            sections["tiers.disk"] = {"path": str(self.root / "lmdb"), "capacity_bytes": disk_bytes}
        if remote is not None:
            sections["tiers.remote"] = dict(remote)
        self.config_file.write_text(toml_text(sections))
        return self.config_file

    def config(self) -> DaemonConfig:
        return load_config(self.config_file, env={})

    def salt(self, tenant: str, user: str, *, ttl_s: float = DEFAULT_SALT_TTL_S) -> str:
        """A new request salt for ``tenant``/``user``, as the deployment's gateway would mint it
        (valid ``ttl_s`` seconds, under an id of its own)."""
        return mint_salt(self.salt_key, tenant, user, ttl_s=ttl_s)

    def token(self, tenant: str = "acme", user: str = "alice", *, roles: tuple[str, ...] = (),
              ttl_s: float = 3600.0, **principal: Any) -> str:
        p = Principal(tenant=tenant, user=user, roles=frozenset(roles), **principal)
        return mint(self._key, MintRequest(p, ttl_s))
