"""``kvtier keys``: master-key operations and audit-log checks (docs/security.md, Operations).

- ``new-master PATH``: write a fresh random master key (hex, mode 0600); never overwrites.
- ``rewrap``: re-wrap every stored data key under a new master key (master-key rotation). The
  node's daemon is stopped meanwhile; rerunnable after a crash (keys already under the new key
  are skipped). With ``--config`` of a daemon that has a remote tier, the bucket's key mirror is
  rewritten as well.
- ``audit PATH``: verify an audit log's hash chain and print its events (or the first bad line).

Master keys are named by ``--*-master-key-file`` (mode 0600; add ``--group-readable`` for a
Kubernetes ``fsGroup`` mount) or by a provider spec (``env:VAR``, ``kms:<client>:<key id>``).
Output is one line per fact on stdout; failures are one line on stderr and exit status 1.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvtier.errors import ConfigError
from kvtier.security.audit import AuditLog
from kvtier.security.keyring import KeyRing
from kvtier.security.master_keys import FileKeyProvider, KeyProvider, key_provider, write_master_key
from kvtier.security.wrapped_keys import (
    SLOT_FILE,
    LmdbWrappedKeyStore,
    MirroredKeyStore,
    SlotFileKeyStore,
    WrappedKeyStore,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="keys_command", metavar="ACTION", required=True)
    new = sub.add_parser("new-master", help="write a new random master key file (mode 0600)")
    new.add_argument("path", help="where to write it (must not exist)")
    rw = sub.add_parser("rewrap", help="re-wrap every stored data key under a new master key")
    rw.add_argument("--key-store", metavar="DIR", help="the node's wrapped-key store (default: from --config)")
    rw.add_argument("--config", metavar="FILE", help="daemon config: key store path and remote key mirror")
    for which in ("master", "previous-master"):
        g = rw.add_mutually_exclusive_group(required=True)
        g.add_argument(f"--{which}-key-file", metavar="PATH", help=f"{which.replace('-', ' ')} key file")
        g.add_argument(f"--{which}-key", metavar="SPEC", help=f"{which.replace('-', ' ')} key provider spec")
    rw.add_argument("--group-readable", action="store_true",
                    help="accept group-readable key files (Kubernetes fsGroup secret mounts)")
    au = sub.add_parser("audit", help="verify an audit log's hash chain and print its events")
    au.add_argument("path")
    au.add_argument("--json", action="store_true", help="one JSON object per event")


def _provider(path: str | None, spec: str | None, group_readable: bool) -> KeyProvider:
    if path is not None:
        return FileKeyProvider(path, allow_group_read=group_readable)
    assert spec is not None
    return key_provider(spec)


def _rewrap(args: argparse.Namespace) -> int:
    new = _provider(args.master_key_file, args.master_key, args.group_readable)
    old = _provider(args.previous_master_key_file, args.previous_master_key, args.group_readable)
    config = None
    if args.config:
        from kvtier.server.config import load_config

        config = load_config(args.config)
    path = args.key_store or (config.key_store_path if config is not None else None)
    if path is None:
        raise ConfigError("keys rewrap: name the key store with --key-store or --config")
    if not Path(path).is_dir():
        raise ConfigError(f"keys rewrap: key store {path} does not exist")
    # The store as the daemon left it: slots, or an LMDB store a daemon has not imported yet.
    primary: LmdbWrappedKeyStore | SlotFileKeyStore
    if (Path(path) / "data.mdb").exists() and not (Path(path) / SLOT_FILE).exists():
        primary = LmdbWrappedKeyStore(path)
    else:
        primary = SlotFileKeyStore(path)
    closers = [primary.close]
    store: WrappedKeyStore = primary
    try:
        if config is not None and config.tiers.remote is not None:
            from kvtier.keys import DomainDeriver
            from kvtier.plugins import backend
            from kvtier.server.backend import mirror_auth_key, read_server_secret, s3_config

            deriver = DomainDeriver(read_server_secret(config.security.server_secret_file))
            mirror = backend("s3").S3WrappedKeyStore(s3_config(config), auth_key=mirror_auth_key(deriver))
            closers.append(mirror.close)
            store = MirroredKeyStore(primary, mirror)
        ring = KeyRing(new, store, previous=[old])
        n = ring.rewrap()
        if isinstance(store, MirroredKeyStore):
            # Every local key again, in the mirror's authenticated format (keys mirrored by an
            # earlier release carry no tag and are refused by the other nodes until rewritten).
            print(f"re-mirrored {store.remirror()} data keys to the remote tier")
        left = sum(1 for k in primary.all_wrapped() if k.kek_id != new.kek_id)
        print(f"rewrapped {n} data keys under {new.kek_id}; {left} left under other master keys")
        if isinstance(store, MirroredKeyStore) and store.pending:
            print(f"{len(store.pending)} keys could not be written to the remote mirror yet; rerun to retry")
            return 1
        return 0 if left == 0 else 1
    finally:
        for close in reversed(closers):
            close()


def _audit(args: argparse.Namespace) -> int:
    try:
        events = AuditLog.read(args.path)  # read-only: a verifier never writes the log
    except FileNotFoundError as exc:
        raise ConfigError(str(exc)) from None
    for e in events:
        if args.json:
            print(json.dumps({"seq": e.seq, "at": e.at, "actor": e.actor, "action": e.action,
                              "target": e.target, "detail": e.detail, "digest": e.digest}))
        else:
            print(f"{e.seq}\t{e.at:.3f}\t{e.actor}\t{e.action}\t{e.target}\t{json.dumps(e.detail)}")
    return 0


def run(args: argparse.Namespace) -> int:
    if args.keys_command == "new-master":
        path = write_master_key(args.path)
        print(f"wrote {path} (mode 0600); its id is {FileKeyProvider(path).kek_id}")
        return 0
    if args.keys_command == "rewrap":
        return _rewrap(args)
    return _audit(args)
