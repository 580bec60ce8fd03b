"""LMCache's side of ``kvtier bench peer --lmcache``: LMCache 0.5.6's MP server and a CPU client.

Everything LMCache runs in ``.venv-lmcache`` (``make peer-venvs``; the pinned package set is
``benchmarks/peers/lmcache-requirements.txt``), with ``LMCACHE_TRACK_USAGE=false`` so it reports
nothing home. Each phase starts fresh servers::

    python -m lmcache.v1.multiprocess.http_server --l1-size-gb <memory> --eviction-policy LRU
        [--l2-adapter '{"type": "fs", "base_path": ..., "serde": {"type": "aesgcm", "aes_bits": 256, ...}}']

on free loopback ports, and drives each with ``peer_lmcache_driver.py`` (the client, see there).
The disk is LMCache's ``fs`` L2 adapter with its ``aesgcm`` serde: AES-256-GCM like kvtier's disk,
its key derived (HKDF-SHA256) from a master key file written here, mode 0600. The serde gets one
worker per CPU, so decryption may use every core.

LMCache writes L2 in the background and skips what does not fit in L1, so every store is verified
by a later read: the RAM stores by the warm retrieves, the disk_store stores by a fresh server
reading them from L2.

Preparation (untimed, as kvtier's side gets it): the client's registration and a lookup of a key
nobody stored; in the RAM and disk_store phases one warm-up request stored and read back; before
the timed warm retrieve, ``warmup_passes`` read passes. ``prefaulted`` (RAM phase): LMCache has no
setting that touches L1 at start-up on CPU (its pool is a lazily faulted ``torch.empty``), so the
driver stores filler requests until L1's capacity has been written once, then empties L1 through
the server's ``POST /cache/clear``: the pool keeps the pages it touched. LMCache has one layout, the
client's pages, so its store and warm retrieve are also the figures of the ``_paged`` cases.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from benchmarks.common import free_port, progress, stop_process
from benchmarks.peer_cases import CaseRun, Workload
from benchmarks.peer_pagecache import drop, resident_fraction
from kvtier.errors import KvtierError

ROOT = Path(__file__).resolve().parents[1]
VENV_PYTHON = ROOT / ".venv-lmcache" / "bin" / "python"
DRIVER = Path(__file__).resolve().parent / "peer_lmcache_driver.py"
LMCACHE_VERSION = "0.5.6"
#: How long L2 may stay unchanged before the harness stops waiting for background writes.
L2_QUIET_S = 5.0


class LmcacheUnavailable(KvtierError):
    """``.venv-lmcache`` is missing or holds another LMCache: build it with ``make peer-venvs``."""


class LmcacheRunError(KvtierError):
    """The LMCache server or the driver failed; the message carries the tail of its output."""


def lmcache_env() -> dict[str, str]:
    return {**os.environ, "LMCACHE_TRACK_USAGE": "false"}


def check_venv(python: Path = VENV_PYTHON) -> str:
    """The installed LMCache version; LmcacheUnavailable unless it is the pinned one."""
    if not python.exists():
        raise LmcacheUnavailable(f"{python} not found: build it with `make peer-venvs`")
    proc = subprocess.run([str(python), "-c", "import importlib.metadata as m; print(m.version('lmcache'))"],
                          capture_output=True, text=True, env=lmcache_env(), timeout=120)
    if proc.returncode != 0:
        raise LmcacheUnavailable(f"{python} cannot report its lmcache version: {proc.stderr.strip()[-500:]}")
    version = proc.stdout.strip()
    if version != LMCACHE_VERSION:
        raise LmcacheUnavailable(f"{python} has lmcache {version}, the benchmark pins {LMCACHE_VERSION}")
    return version


class LmcacheSide:
    """Fresh LMCache MP servers per phase under ``workdir``."""

    name = "lmcache"

    def __init__(self, workload: Workload, workdir: Path, *, python: Path = VENV_PYTHON) -> None:
        self.w = workload
        self.workdir = workdir
        self.python = python
        self.version = check_venv(python)
        #: The client process, started at the first session and kept for the following ones.
        self._client: _Driver | None = None
        self.master_key = workdir / "lmcache-master.key"
        fd = os.open(self.master_key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(32))

    def describe(self) -> dict[str, Any]:
        return {"server": f"LMCache {self.version} multiprocess http_server (zmq)",
                "client": "lmcache_driven transfer over POSIX shared memory (peer_lmcache_driver.py)",
                "l1_bytes": self.w.memory_bytes, "layout": "paged (its only one): the _paged cases reuse "
                "its store and warm retrieve figures",
                "eviction_policy": "LRU", "chunk_tokens": self.w.chunk_tokens, "page_tokens": self.w.page_tokens,
                "disk": "fs L2 adapter, aesgcm serde (AES-256-GCM, HKDF-SHA256 per cache_salt)",
                "serde_workers": os.cpu_count() or 1, "disk_fsync": False, "LMCACHE_TRACK_USAGE": "false"}

    def untimed(self, touch: str) -> list[str]:
        out = ["client set-up: registration of its paged KV cache and a lookup of a key nobody stored",
               "RAM and disk_store phases: one warm-up request (not measured) stored and read back",
               f"warm retrieve: {self.w.warmup_passes} untimed read pass(es) over the stored requests first"]
        out.append("RAM phase: L1 written once over with filler stores, then emptied (POST /cache/clear)"
                   if touch == "prefaulted" else "RAM phase: L1 as the server allocated it")
        out.append("disk phases: L1 as the server allocated it")
        return out

    # -- phases -----------------------------------------------------------------------------------
    def ram(self, seed: int, touch: str) -> dict[str, CaseRun]:
        with self._server(self.w.memory_bytes, None) as (url, http):
            ops = ["warmup", *(["fill"] if touch == "prefaulted" else []), "store",
                   *(["read_pass"] * self.w.warmup_passes), "retrieve"]
            out = self._session(url, seed, ops, http=http)
        store = self._timed(out["store"], out.get("store_visible_s"))
        warm = self._reads(out["retrieve"])
        store.verified = warm.verified  # the warm reads are what prove the stores
        # One layout (the client's pages): the same figures are the paged cases'.
        return {"store": store, "warm_retrieve": warm, "store_paged": store, "warm_retrieve_paged": warm}

    def disk_store(self, seed: int) -> dict[str, CaseRun]:
        l2 = self.workdir / f"l2-store-{seed}"
        l2.mkdir()
        try:
            with self._server(self.w.memory_bytes, l2) as (url, _):
                stored = self._session(url, seed, ["warmup", "store"])
                case = self._timed(stored["store"], stored.get("store_visible_s"))
                landed = self._wait_l2(l2)
            expected = (self.w.requests + 1) * self.w.chunks_per_request  # the warm-up request too
            if landed < expected:
                case.notes.append(f"{landed} of {expected} chunks reached L2 (LMCache skips stores "
                                  "that do not fit in L1 and still reports them stored)")
            with self._server(self.w.memory_bytes, l2) as (url, _):
                case.verified = self._reads(self._session(url, seed, ["retrieve"])["retrieve"]).verified
        finally:
            shutil.rmtree(l2)
        return {"disk_store": case}

    def disk_read(self, seed: int) -> dict[str, CaseRun]:
        l2 = self.workdir / f"l2-read-{seed}"
        l2.mkdir()
        try:
            with self._server(self.w.memory_bytes, l2) as (url, _):
                self._session(url, seed, ["store"])
                landed = self._wait_l2(l2)
            if landed < self.w.requests * self.w.chunks_per_request:
                raise LmcacheRunError(f"only {landed} of {self.w.requests * self.w.chunks_per_request} chunks "
                                      "reached LMCache's L2 with a full-size L1")
            files = sorted(l2.glob("*.data"))
            drop(files)
            out = {}
            for case in ("disk_cold", "disk_page_cache"):
                with self._server(self.w.memory_bytes, l2) as (url, _):
                    resident = resident_fraction(files)
                    out[case] = self._reads(self._session(url, seed, ["retrieve"])["retrieve"])
                    out[case].page_cache_resident = resident
        finally:
            shutil.rmtree(l2)
        return out

    # -- results ----------------------------------------------------------------------------------
    def _case(self) -> CaseRun:
        return CaseRun(self.w.request_bytes, self.w.requests, data_plane="shm (lmcache_driven, CPU)")

    def _timed(self, rows: list[dict[str, Any]], visible_s: float | None = None) -> CaseRun:
        case = self._case()
        case.seconds = [float(r["seconds"]) for r in rows]
        if visible_s is not None:
            case.notes.append(f"a LOOKUP found the last request {visible_s * 1e3:.0f} ms after its STORE "
                              "resolved (untimed wait)")
        return case

    def _reads(self, rows: list[dict[str, Any]]) -> CaseRun:
        case = self._case()
        for r in rows:
            if r["seconds"] is not None:
                case.seconds.append(float(r["seconds"]))
            if r["verified"]:
                case.verified += 1
            else:
                case.notes.append(f"request {r['request']}: {r['hit_chunks']} of {self.w.chunks_per_request} "
                                  "chunks found" + ("" if r["seconds"] is None else ", bytes differ"))
        return case

    # -- processes --------------------------------------------------------------------------------
    @contextmanager
    def _server(self, l1_bytes: int, l2: Path | None) -> Iterator[tuple[str, str]]:
        """A fresh MP server: its request URL (zmq) and its HTTP URL."""
        port, http_port = free_port(), free_port()
        cmd = [str(self.python), "-m", "lmcache.v1.multiprocess.http_server",
               "--l1-size-gb", repr(l1_bytes / (1 << 30)), "--eviction-policy", "LRU",
               "--host", "127.0.0.1", "--port", str(port), "--http-host", "127.0.0.1", "--http-port", str(http_port),
               "--chunk-size", str(self.w.chunk_tokens), "--disable-metrics"]
        if l2 is not None:
            l2.mkdir(parents=True, exist_ok=True)
            cmd += ["--l2-adapter", json.dumps({
                "type": "fs", "base_path": str(l2),
                "serde": {"type": "aesgcm", "aes_bits": 256, "master_key_path": str(self.master_key),
                          "max_workers": os.cpu_count() or 1}})]
        log = self.workdir / f"lmcache-server-{port}.log"
        with open(log, "ab") as f:
            proc = subprocess.Popen(cmd, cwd=self.workdir, env=lmcache_env(), stdout=f, stderr=f)
        try:
            _wait_healthy(f"http://127.0.0.1:{http_port}/healthcheck", proc, log)
            yield f"tcp://127.0.0.1:{port}", f"http://127.0.0.1:{http_port}"
        finally:
            stop_process(proc)
            log.unlink()

    def _session(self, url: str, seed: int, ops: list[str], *, http: str = "") -> dict[str, Any]:
        w = self.w
        plan = {"rpc_url": url, "http_url": http, "layers": w.layers, "kv_heads": w.kv_heads,
                "head_dim": w.head_dim, "chunk_tokens": w.chunk_tokens, "page_tokens": w.page_tokens,
                "request_tokens": w.request_tokens, "requests": w.requests, "seed": seed, "ops": ops,
                "timeout_s": w.timeout_s, "l1_bytes": w.memory_bytes}
        return self._driver().session(plan)

    def _driver(self) -> _Driver:
        if self._client is None:
            self._client = _Driver(self.python, self.workdir / "lmcache-driver.log")
        return self._client

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def _wait_l2(self, l2: Path) -> int:
        """Wait for LMCache's background L2 writes: every chunk file present, or L2 unchanged for
        ``L2_QUIET_S``. The number of chunk files written."""
        expected = self.w.requests * self.w.chunks_per_request
        last, since = (-1, -1), time.monotonic()
        end = time.monotonic() + self.w.timeout_s
        while time.monotonic() < end:
            state = (len(list(l2.glob("*.data"))), len(list(l2.glob("*.tmp"))))
            if state[0] >= expected and state[1] == 0:
                return state[0]
            if state != last:
                last, since = state, time.monotonic()
            elif state[1] == 0 and time.monotonic() - since > L2_QUIET_S:
                return state[0]
            time.sleep(0.1)
        raise LmcacheRunError(f"LMCache's L2 writes did not settle in {self.w.timeout_s:g}s ({last[0]} chunk files)")


class _Driver:
    """``peer_lmcache_driver.py`` running in the LMCache venv: a plan line in, a result line out."""

    def __init__(self, python: Path, log: Path) -> None:
        self.log = log
        with open(log, "ab") as f:
            self.proc = subprocess.Popen([str(python), str(DRIVER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=f, text=True, env=lmcache_env())

    def session(self, plan: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(json.dumps(plan) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise self._died(plan) from None
        line = self.proc.stdout.readline()
        if not line:
            raise self._died(plan)
        return dict(json.loads(line))

    def _died(self, plan: dict[str, Any]) -> LmcacheRunError:
        rc = self.proc.wait(30)
        return LmcacheRunError(f"LMCache driver ({', '.join(plan['ops'])}) exited with {rc}:\n"
                               f"{self.log.read_text(errors='replace')[-3000:]}")

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()  # end of sessions: the driver exits
        try:
            rc = self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise LmcacheRunError("LMCache driver did not exit within 60s of its last session") from None
        if rc != 0:
            raise LmcacheRunError(f"LMCache driver exited with {rc}:\n{self.log.read_text(errors='replace')[-3000:]}")


def _wait_healthy(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 240.0) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise LmcacheRunError(f"LMCache server exited with {proc.returncode}:\n"
                                  f"{log.read_text(errors='replace')[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass  # not listening yet: keep polling until the deadline
        time.sleep(0.2)
    progress(f"LMCache server log tail:\n{log.read_text(errors='replace')[-2000:]}")
    raise LmcacheRunError(f"LMCache server not healthy after {timeout_s:.0f}s")
