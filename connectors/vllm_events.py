"""kvtier's tiers in vLLM's KV-event stream: what the node holds for this engine, as vLLM events.

vLLM publishes what each engine caches on its GPU (``BlockStored`` / ``BlockRemoved`` /
``AllBlocksCleared``, msgpack over ZMQ, ``--kv-events-config``); routers (vllm-router's
``kv_aware``, llm-d, Dynamo) index them. The scheduler-side connector adds, through vLLM's own
hook (``take_events``, published by the scheduler with its own events on the engine's endpoint
in that vLLM version's encoding), the blocks the node's kvtier holds for this engine, under a
medium per kvtier tier, so a router can weigh "reload from host memory" against "recompute".

How (``KvEventReporter``, scheduler role only):

1. ``follow``: when vLLM allocates a request kvtier looked up (``update_state_after_alloc``), the
   reporter follows its prompt's full blocks: vLLM's engine block hash of each (``request.
   block_hashes``, converted as vLLM converts its own) with kvtier's key of that block for every
   tensor-parallel rank (the scheduler's chains), and asks the node to watch those keys
   (``HeldFeed.watch``, for the request's principal) -- both the blocks a lookup found and the
   ones about to be saved.
2. ``sync`` (every ``kv_events_interval_s`` on a thread, while the engine steps; or in every
   ``take`` with an interval of 0): the node answers which followed keys it holds in which local
   tier, then what changed since (``HeldFeed.changes``, kvtier/cache/held_watch.py). A block is
   held for the engine when every rank's key is, under the medium of the slowest of their tiers.
3. ``take``: the events of what changed: ``BlockStored`` when a block becomes held (runs of a
   chain in one event, parent first), ``BlockRemoved`` with the medium it was reported under when
   it stops being held (evicted, deleted, purged, its principal revoked, gone after a daemon
   restart, the daemon unreachable for ``DOWN_AFTER`` polls, or dropped by this reporter's own
   bound), both when it moves to a tier of another medium.

Rules:

- Token ids and LoRA names are published only for blocks of the public scope. Every other block's
  ``BlockStored`` carries its hashes and nothing else: ``token_ids`` empty, ``lora_*`` and
  ``extra_keys`` None. No event ever carries a salt: vLLM puts the request's ``cache_salt`` in the
  first block's extra keys, and a kvtier salt is a bearer credential.
- Only local tiers are reported (the watch never names the shared remote tier, which lives on no
  node), and only those ``kv_events_mediums`` maps.
- Never ``AllBlocksCleared``: the stream is shared with vLLM's own GPU events, and that event
  clears a router's whole view of the engine, GPU blocks that are still cached included (vLLM does
  not announce them again). When the node's cache is dropped (a daemon restart loses its memory
  tier, a purge) the reporter retracts exactly the blocks it reported that are gone.
- Bounded: ``kv_events_max_blocks`` blocks followed (the least recently followed go first, retracted
  if reported), the node's watch table bounded on its side, one event list per step.

Before any of this, ``check_event_endpoints`` refuses to start an engine whose KV events leave the
host (any endpoint but loopback, ``ipc://`` or ``inproc://``) unless the operator opts in with
``kvtier.allow_remote_kv_events=true``: vLLM's own events carry every prompt's tokens and salt in
clear (docs/security.md, "KV events").
"""

from __future__ import annotations

import ipaddress
import logging
import secrets
import threading
from collections import Counter, OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash, resolve_block_hashes

from connectors.held_feed import HeldFeed
from kvtier.cache.scoping import ScopedPrompt
from kvtier.errors import AccessDenied, ConfigError, KvtierError
from kvtier.keys import BlockKey, ChainBlock, ScopeKind

if TYPE_CHECKING:
    from vllm.v1.request import Request

log = logging.getLogger("kvtier.connector.events")

#: kvtier tier -> vLLM event medium, fastest first. vllm-router 0.1.17 matches a medium without
#: case: GPU/DEVICE, CPU/HOST (--kv-penalty-host, 0.8), DISK/STORAGE (--kv-penalty-disk, 0.3);
#: llm-d lowercases it and weighs "cpu" 0.8 by default (its backendConfigs; docs/connectors.md).
DEFAULT_MEDIUMS: tuple[tuple[str, str], ...] = (("memory", "CPU"), ("lmdb", "DISK"))
#: Failed polls in a row after which the node's blocks count as gone for this engine.
DOWN_AFTER = 3
#: Keys per watch call (the daemon takes up to its max_keys per request).
WATCH_BATCH = 4096
#: Hosts a tcp:// endpoint may name and stay on this host.
_LOOPBACK_NAMES = ("localhost",)


@dataclass(slots=True, frozen=True)
class KvEventsOptions:
    """The reporter's settings (``kvtier.kv_events_*``)."""

    mediums: tuple[tuple[str, str], ...] = DEFAULT_MEDIUMS
    #: Seconds between syncs with the node (0: one in every ``take``, on the scheduler's thread).
    interval_s: float = 1.0
    max_blocks: int = 65536

    def medium(self, tier: str | None) -> int | None:
        """The position of ``tier``'s medium in ``mediums`` (slower is larger), None if unmapped."""
        for i, (name, _) in enumerate(self.mediums):
            if name == tier:
                return i
        return None


# -- configuration ----------------------------------------------------------------------------------
def flag(options: Mapping[str, Any], name: str, default: bool) -> bool:
    """A boolean ``kvtier.<name>``: true/false (JSON), or the strings true/false/1/0/yes/no/on/off."""
    value = options.get(name, default)
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes", "on"):
        return True
    if text in ("false", "0", "no", "off"):
        return False
    raise ConfigError(f"kvtier.{name}: expected true or false, got {value!r}")


def vllm_publishes(kv_events_config: Any) -> bool:
    """Whether vLLM publishes KV events at all (``--kv-events-config`` enables a publisher)."""
    return (kv_events_config is not None and bool(getattr(kv_events_config, "enable_kv_cache_events", False))
            and getattr(kv_events_config, "publisher", "null") not in (None, "null"))


def is_local_endpoint(endpoint: str) -> bool:
    """Whether a ZMQ endpoint stays on this host: ``ipc://``, ``inproc://``, or ``tcp://`` on a
    loopback address or ``localhost``. A wildcard bind (``tcp://*:5557``, vLLM's default) or any
    other host is not."""
    scheme, sep, rest = endpoint.partition("://")
    if not sep:
        return False
    if scheme in ("ipc", "inproc"):
        return True
    if scheme != "tcp":
        return False
    host = rest.rsplit(":", 1)[0] if ":" in rest else rest
    host = host.strip("[]")
    if host.lower() in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_event_endpoints(kv_events_config: Any, allow_remote: bool) -> None:
    """Refuse (ConfigError) vLLM KV events that leave this host, unless ``allow_remote``."""
    if not vllm_publishes(kv_events_config) or allow_remote:
        return
    named = {"endpoint": getattr(kv_events_config, "endpoint", None),
             "replay_endpoint": getattr(kv_events_config, "replay_endpoint", None)}
    remote = {k: v for k, v in named.items() if v and not is_local_endpoint(str(v))}
    if remote:
        where = ", ".join(f"{k}={v!r}" for k, v in remote.items())
        raise ConfigError(
            f"kvtier: vLLM's KV events would leave this host ({where}). vLLM's own events carry every "
            "prompt's token ids and its cache_salt in clear, and a kvtier salt is the user's credential. "
            "Publish on this host (e.g. --kv-events-config '{\"enable_kv_cache_events\": true, "
            "\"publisher\": \"zmq\", \"endpoint\": \"ipc:///run/vllm/engine0.events\"}') and let routers "
            "subscribe there or through a tunnel, or accept the exposure by name: "
            "kvtier.allow_remote_kv_events=true (docs/security.md 2.13, docs/operations.md)")


def parse_mediums(value: Any) -> tuple[tuple[str, str], ...]:
    """``kvtier.kv_events_mediums``: a mapping tier -> medium (fastest tier first), or the string
    ``memory=CPU,lmdb=DISK``."""
    if isinstance(value, Mapping):
        pairs = [(str(k), str(v)) for k, v in value.items()]
    else:
        pairs = []
        for part in str(value).split(","):
            tier, sep, medium = part.partition("=")
            if not sep:
                raise ConfigError(f"kvtier.kv_events_mediums: expected tier=MEDIUM pairs, got {part!r}")
            pairs.append((tier.strip(), medium.strip()))
    if not pairs or any(not t or not m for t, m in pairs) or len({t for t, _ in pairs}) != len(pairs):
        raise ConfigError(f"kvtier.kv_events_mediums: each tier once, each with a medium, got {value!r}")
    return tuple(pairs)


def kv_events_options(options: Mapping[str, Any], kv_events_config: Any) -> KvEventsOptions | None:
    """The reporter's settings, or None when kvtier adds no events (vLLM publishes none, or
    ``kvtier.kv_events=false``). Checks the endpoints first (``check_event_endpoints``)."""
    check_event_endpoints(kv_events_config, flag(options, "allow_remote_kv_events", False))
    mode = str(options.get("kv_events", "auto")).strip().lower()
    if mode == "auto":
        on = vllm_publishes(kv_events_config)
    else:
        on = flag(options, "kv_events", False)
        if on and not vllm_publishes(kv_events_config):
            raise ConfigError("kvtier.kv_events=true, but vLLM publishes no KV events: enable them with "
                              "--kv-events-config (enable_kv_cache_events, publisher zmq)")
    if not on:
        return None
    interval = float(options.get("kv_events_interval_s", 1.0))
    max_blocks = int(options.get("kv_events_max_blocks", 65536))
    if interval < 0 or max_blocks <= 0:
        raise ConfigError("kvtier.kv_events_interval_s must be >= 0 and kvtier.kv_events_max_blocks positive")
    mediums = parse_mediums(options["kv_events_mediums"]) if "kv_events_mediums" in options else DEFAULT_MEDIUMS
    return KvEventsOptions(mediums, interval, max_blocks)


# -- the reporter -----------------------------------------------------------------------------------
@dataclass(slots=True)
class _Block:
    """One followed engine block: its kvtier key per rank, and what was last reported for it."""

    hash: Any  # vLLM's ExternalBlockHash (bytes or int)
    parent: Any
    pos: int
    keys: tuple[BlockKey, ...]
    #: The salt it is watched for (watched again with it after the node forgot).
    salt: str
    #: Public-scope blocks only: its token ids and the request's LoRA (name, id).
    tokens: tuple[int, ...] | None
    lora: tuple[str, int] | None
    #: The medium it was last reported under (None: not reported held).
    medium: str | None = None
    #: Followed as the reporter's ``seq``-th block (ties in position are told in that order).
    seq: int = 0


@dataclass(slots=True)
class _Node:
    """One watch stream on a node (a daemon, or an in-process store) and where it stands."""

    feed: HeldFeed
    #: Keys waiting to be watched, by the salt they are watched for.
    to_watch: dict[str, list[BlockKey]] = field(default_factory=dict)
    #: The node's watch table that told us what we know (None: none yet).
    instance: str | None = None
    ack: int = 0
    failures: int = 0
    down: bool = False


@dataclass(slots=True)
class _Run:
    blocks: list[_Block] = field(default_factory=list)
    medium: str = ""


class KvEventReporter:
    """See the module docstring for what it reports and when.

    Invariants (under ``lock``): ``_blocks`` holds at most ``max_blocks`` followed blocks; every
    key of a followed block is in ``_owners`` (its blocks) and ``_tiers`` (where the node said it
    is; None: not held); a block's ``medium`` is what the router was last told; ``_out`` is what
    the next ``take`` returns. ``follow`` and ``take`` run on vLLM's scheduler thread, ``sync`` on
    the reporter's thread (or inside ``take``); node calls are made outside the lock. An error
    that is not a named kvtier failure (a bug) stops the thread and is raised by the next ``take``.
    Each tensor-parallel rank's keys are watched on its rank's node (``rank_feed``): one node for
    every rank through a daemon, a store per rank for in-process caches.
    """

    def __init__(self, feeds: Sequence[HeldFeed], options: KvEventsOptions, *, fingerprints: Sequence[bytes],
                 rank_feed: Sequence[int], block_tokens: int, hash_block_size: int, stats: Counter[str],
                 lock: threading.Lock) -> None:
        if len(rank_feed) != len(fingerprints) or not all(0 <= i < len(feeds) for i in rank_feed):
            raise ValueError("rank_feed names one of the feeds for each fingerprint")
        self.nodes = [_Node(f) for f in feeds]
        self.rank_feed = tuple(rank_feed)
        self.options = options
        self.fingerprints = tuple(fingerprints)
        self.block_tokens = block_tokens
        self.hash_block_size = hash_block_size
        self.stats = stats
        self.lock = lock
        self._blocks: OrderedDict[Any, _Block] = OrderedDict()
        self._owners: dict[BlockKey, set[Any]] = {}
        self._tiers: dict[BlockKey, str | None] = {}
        self._changed: set[Any] = set()
        self._refused: set[Any] = set()
        self._out: list[KVCacheEvent] = []
        self._stepped = False
        self._seq = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._thread_exc: BaseException | None = None
        self._sync_lock = threading.Lock()  # one sync at a time (the thread, or a test's direct call)

    # -- the scheduler's side ---------------------------------------------------------------------
    def follow(self, request: Request, salt: str, prompt: ScopedPrompt,
               chains: Mapping[bytes, Sequence[ChainBlock]]) -> None:
        """Follow the prompt's full blocks whose keys the scheduler derived for every rank."""
        if any(fp not in chains for fp in self.fingerprints):
            with self.lock:
                self.stats["events_rank_chain_missing"] += 1
            return
        hashes = resolve_block_hashes(request.block_hashes, self.hash_block_size, self.block_tokens)
        n = min(len(hashes), *(len(chains[fp]) for fp in self.fingerprints))
        lora = getattr(request, "lora_request", None)
        bt = self.block_tokens
        with self.lock:
            for i in range(n):
                h = maybe_convert_block_hash(hashes[i])
                if h in self._blocks:
                    self._blocks.move_to_end(h)
                    continue
                cbs = [chains[fp][i] for fp in self.fingerprints]
                public = all(cb.scope.kind is ScopeKind.PUBLIC for cb in cbs)
                b = _Block(h, maybe_convert_block_hash(hashes[i - 1]) if i else None, i, tuple(cb.key for cb in cbs),
                           salt, tuple(prompt.tokens[i * bt : (i + 1) * bt]) if public else None,
                           (lora.name, lora.adapter_id) if public and lora is not None else None)
                self._seq += 1
                b.seq = self._seq
                self._blocks[h] = b
                for k in b.keys:
                    self._owners.setdefault(k, set()).add(h)
                    self._tiers.setdefault(k, None)
                self._queue(b)
            while len(self._blocks) > self.options.max_blocks:
                _, old = self._blocks.popitem(last=False)
                self.stats["events_dropped_for_room"] += 1
                if old.medium is not None:
                    self._out.append(BlockRemoved(block_hashes=[old.hash], medium=old.medium))
                    self.stats["events_removed_blocks"] += 1
                self._unlink(old)

    def take(self) -> list[KVCacheEvent]:
        """The events since the last call (vLLM's ``take_events``, once per scheduler step)."""
        if self.options.interval_s <= 0:
            self.sync()
        with self.lock:
            exc, self._thread_exc = self._thread_exc, None
            self._stepped = True
            out, self._out = self._out, []
        if exc is not None:
            raise exc
        return out

    def start(self) -> None:
        """Sync on a thread every ``interval_s`` while the engine steps (none with an interval of 0)."""
        if self.options.interval_s <= 0 or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="kvtier-kv-events", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def followed(self) -> int:
        with self.lock:
            return len(self._blocks)

    # -- the node's side --------------------------------------------------------------------------
    def sync(self) -> None:
        """One round with the node: what changed since the last answer, then the keys waiting to be
        watched (twice when a watch shows the node forgot everything), then their events."""
        with self._sync_lock:
            for node in self.nodes:
                self._poll(node)
            for node in self.nodes:
                for _ in range(2):
                    if not self._flush(node):
                        break
            with self.lock:
                self._emit()

    def _run(self) -> None:
        while not self._stop.wait(self.options.interval_s):
            with self.lock:
                stepped, self._stepped = self._stepped, False
            if not stepped:
                continue  # vLLM publishes only while it steps: an idle engine is not polled
            try:
                self.sync()
            except BaseException as exc:  # a bug: raised on the scheduler's thread by the next take
                with self.lock:
                    self._thread_exc = exc
                return

    def _poll(self, node: _Node) -> None:
        with self.lock:
            ack = node.ack
        try:
            ch = node.feed.changes(ack)
        except KvtierError as exc:
            self._failed(node, "poll", exc)
            return
        with self.lock:
            node.failures = 0
            node.down = False
            if ch.instance != node.instance:
                self._new_instance(node, ch.instance)
            node.ack = ch.cursor
            self._apply(ch.changes)

    def _flush(self, node: _Node) -> bool:
        """Watch what waits to be watched on ``node``; True when an answer came from a node that
        forgot this stream (its keys are all queued again)."""
        with self.lock:
            batches, node.to_watch = node.to_watch, {}
        forgot = False
        pending = [(salt, list(dict.fromkeys(keys))) for salt, keys in batches.items()]
        for i, (salt, keys) in enumerate(pending):
            for start in range(0, len(keys), WATCH_BATCH):
                chunk = keys[start : start + WATCH_BATCH]
                try:
                    w = node.feed.watch(salt, chunk)
                except AccessDenied:  # AuthError included: the salt is refused now (a revoked principal)
                    with self.lock:
                        self.stats["events_watch_refused"] += 1
                        for k in chunk:
                            self._refused |= self._owners.get(k, set())
                    continue
                except KvtierError as exc:  # unreachable: everything not yet watched waits
                    with self.lock:
                        node.to_watch.setdefault(salt, []).extend(keys[start:])
                        for s, ks in pending[i + 1 :]:
                            node.to_watch.setdefault(s, []).extend(ks)
                    self._failed(node, "watch", exc)
                    return False
                with self.lock:
                    if w.instance != node.instance:
                        forgot = forgot or node.instance is not None
                        self._new_instance(node, w.instance)
                    self._apply(zip(chunk, w.tiers, strict=True))
        return forgot

    def _failed(self, node: _Node, what: str, exc: KvtierError) -> None:
        with self.lock:
            self.stats[f"events_{what}_failed"] += 1
            node.failures += 1
            if node.failures < DOWN_AFTER or node.down:
                return
            node.down = True
            self.stats["events_node_down"] += 1
            self._forget()  # the engine cannot load what it cannot reach
        log.warning("kvtier: the node has not answered %d times (%s): its blocks are reported gone until it "
                    "answers again", DOWN_AFTER, exc)

    # -- internals (under ``lock``) ---------------------------------------------------------------
    def _queue(self, b: _Block, only: _Node | None = None) -> None:
        """Queue each rank's key of ``b`` to be watched on its rank's node (or on ``only``)."""
        for rank, k in enumerate(b.keys):
            node = self.nodes[self.rank_feed[rank]]
            if only is None or node is only:
                node.to_watch.setdefault(b.salt, []).append(k)

    def _new_instance(self, node: _Node, instance: str) -> None:
        """The node's watch table is not the one that told us what we know (a restarted daemon, or
        our stream dropped for room): what it told stands until the keys it had are watched again,
        whose answers then say precisely what changed."""
        if node.instance is not None:
            self.stats["events_rewatch"] += 1
            for b in self._blocks.values():
                self._queue(b, node)
        node.instance = instance
        node.ack = 0

    def _forget(self) -> None:
        """Retract every reported block and queue every followed block to be watched again."""
        removed: dict[str, list[Any]] = {}
        for b in self._blocks.values():
            if b.medium is not None:
                removed.setdefault(b.medium, []).append(b.hash)
                b.medium = None
            self._queue(b)
        for k in self._tiers:
            self._tiers[k] = None
        self._retract(removed)

    def _apply(self, pairs: Any) -> None:
        for k, tier in pairs:
            owners = self._owners.get(k)
            if owners is not None:
                self._tiers[k] = tier
                self._changed |= owners

    def _held_medium(self, b: _Block) -> str | None:
        """Where the engine can load the block from: every rank's key held in a mapped tier; the
        medium of the slowest of those tiers."""
        worst = -1
        for k in b.keys:
            at = self.options.medium(self._tiers.get(k))
            if at is None:
                return None
            worst = max(worst, at)
        return self.options.mediums[worst][1]

    def _emit(self) -> None:
        removed: dict[str, list[Any]] = {}
        stored: list[tuple[_Block, str]] = []
        gone: list[_Block] = []
        touched = [b for h in self._changed | self._refused if (b := self._blocks.get(h)) is not None]
        for b in sorted(touched, key=lambda b: (b.pos, b.seq)):  # each chain's blocks parent first
            h = b.hash
            now = None if h in self._refused else self._held_medium(b)
            if now == b.medium:
                if h in self._refused:
                    gone.append(b)
                continue
            if b.medium is not None:
                removed.setdefault(b.medium, []).append(h)
                if now is None:
                    gone.append(b)  # the node follows a key no more once it told it gone
            if now is not None:
                stored.append((b, now))
            b.medium = now
        self._changed.clear()
        self._refused.clear()
        self._retract(removed)
        for run in self._runs(stored):
            first = run.blocks[0]
            self._out.append(BlockStored(
                block_hashes=[b.hash for b in run.blocks], parent_block_hash=first.parent,
                token_ids=[t for b in run.blocks for t in b.tokens] if first.tokens is not None else [],
                block_size=self.block_tokens, lora_id=first.lora[1] if first.lora else None, medium=run.medium,
                lora_name=first.lora[0] if first.lora else None, extra_keys=None))
            self.stats["events_stored_blocks"] += len(run.blocks)
        for b in gone:
            if self._blocks.get(b.hash) is b:
                del self._blocks[b.hash]
                self._unlink(b)

    def _retract(self, removed: Mapping[str, list[Any]]) -> None:
        for medium, hashes in removed.items():
            self._out.append(BlockRemoved(block_hashes=list(hashes), medium=medium))
            self.stats["events_removed_blocks"] += len(hashes)

    @staticmethod
    def _runs(stored: list[tuple[_Block, str]]) -> list[_Run]:
        """Newly held blocks as runs of one chain (each block's parent the one before it), of one
        medium and one kind (public with its LoRA, or not), parents first."""
        runs: list[_Run] = []
        open_at: dict[Any, _Run] = {}
        for b, medium in stored:  # in position order (``_emit``)
            run = open_at.pop(b.parent, None) if b.parent is not None else None
            last = run.blocks[-1] if run is not None else None
            if run is None or last is None or run.medium != medium or (last.tokens is None) != (b.tokens is None) \
                    or last.lora != b.lora:
                run = _Run([], medium)
                runs.append(run)
            run.blocks.append(b)
            open_at[b.hash] = run
        return runs

    def _unlink(self, b: _Block) -> None:
        for k in b.keys:
            owners = self._owners.get(k)
            if owners is None:
                continue
            owners.discard(b.hash)
            if not owners:
                del self._owners[k]
                self._tiers.pop(k, None)


def new_stream() -> str:
    """A watch stream name for one scheduler (several share the engine's credential)."""
    return f"vllm.{secrets.token_hex(6)}"


__all__ = ["DEFAULT_MEDIUMS", "KvEventReporter", "KvEventsOptions", "check_event_endpoints", "is_local_endpoint",
           "kv_events_options", "new_stream", "parse_mediums", "vllm_publishes"]
