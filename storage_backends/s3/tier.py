"""Remote tier on an S3-compatible object store (SeaweedFS, MinIO, Ceph RGW, AWS S3).

Object names are derived from the key alone (keys are ``domain || layout tag || digest``)::

    <prefix>/<layout tag hex>/<scope domain hex>/<digest hex>

The "layout-fp" path component is the 16-hex-char *layout tag*: the first 8 bytes of the layout
fingerprint, which every key already carries. Deleting a scope is a prefix delete per layout tag,
and a bucket policy can be written per scope domain. Every object is one self-describing record
(kvtier.codec): a GET is verified (length, checksum, identity, layout, format version) before it
is used, so a corrupt object can only ever become a counted miss, never wrong bytes.

Failure model: the engine-facing calls (contains, holds, get, get_into, put) never raise for an
unreachable, refusing or slow endpoint; they return misses / rejected puts, count the cause in
``metrics.errors`` and feed a circuit breaker that short-circuits calls while the endpoint is
down and lets a probe through after a cooldown. Administrative calls (delete, delete_scope,
keys_in_scope, usage) raise TierUnavailable instead, because a purge must know it did not happen.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from enum import Enum
from typing import Any, TypeVar

import botocore.exceptions as bce
import torch

from kvtier import codec
from kvtier.block import Block
from kvtier.codec import SealedRecord, Sealer
from kvtier.errors import ConfigError, CorruptRecord, KeyUnavailable, LayoutMismatch, TierUnavailable, UnsupportedFormat
from kvtier.keys import DOMAIN_BYTES, BlockKey, ScopeDomain
from kvtier.store.pin_table import PinTable
from kvtier.store.tier import NO_PINS, PutResult, Tier, TierUsage
from storage_backends.circuit_breaker import CircuitBreaker
from storage_backends.s3.config import MAX_OBJECT_BYTES, ObjectNamer, S3Config
from storage_backends.s3.probes import PROBES

T = TypeVar("T")
#: Error codes that mean "the service is not healthy", not "your request is wrong".
_SERVER_FAULT_CODES = frozenset({"SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout", "503", "500"})
_TIMEOUTS = (bce.ConnectTimeoutError, bce.ReadTimeoutError)
_CONNECTION_ERRORS = (bce.ConnectionError, bce.HTTPClientError, bce.IncompleteReadError)


# -- the tier -----------------------------------------------------------------------------------


class S3Unreachable(TierUnavailable):
    """The endpoint refused, reset, failed with 5xx after retries, or the circuit is open."""

    cause = "unavailable"


class S3Timeout(S3Unreachable):
    """The endpoint did not answer within the configured connect/read timeout (after retries)."""

    cause = "timeout"


class _Verdict(Enum):
    """Outcome of one object read; every non-HIT verdict is a miss with a counted cause."""

    HIT = "hit"
    ABSENT = "absent"
    CORRUPT = "corrupt"  # deleted
    STALE_FORMAT = "unsupported_format"  # older writer: deleted, a current writer will replace it
    NEWER_FORMAT = "newer_format"  # newer writer shares the bucket: left for it
    SEALED_NO_KEYRING = "sealed_no_keyring"  # this node has no key ring: intact, left alone
    KEY_UNAVAILABLE = "key_unavailable"  # the data key cannot be unwrapped now: intact, left alone
    S3_ERROR = "s3_error"  # the endpoint answered with a client error (e.g. 403)
    UNAVAILABLE = "unavailable"
    TIMEOUT = "timeout"


_DELETE_VERDICTS = frozenset({_Verdict.CORRUPT, _Verdict.STALE_FORMAT})


def _status(exc: bce.ClientError) -> tuple[int, str]:
    err = exc.response.get("Error", {})
    meta = exc.response.get("ResponseMetadata", {})
    return int(meta.get("HTTPStatusCode") or 0), str(err.get("Code", ""))


class S3Tier(Tier):
    """The shared remote tier: one object per block, named by its key.

    Concurrency: a read pool (HEAD/GET) and a write pool (PUT/DELETE), each of
    ``config.concurrency`` threads, share one thread-safe boto3 client. A batch call fans out
    over its pool and joins before returning, so no work outlives the call; callers never share
    mutable state with the workers except the metrics and request counters (locked).

    Invariants: a block is returned only after its record verified against the key it was
    asked for; a record that fails verification is deleted and counted; a record this node
    cannot read but another node could (newer format, sealed without our key ring, data key
    temporarily unavailable) is counted and left alone. ``usage()`` lists the prefix (one LIST
    per 1000 objects), so it is exact for a shared bucket and costs accordingly.

    Counters: ``errors["unavailable"]``/``errors["timeout"]`` count tier calls that hit an
    unreachable/slow endpoint (or an open circuit), once per call; ``errors["dropped_put"]``
    counts blocks not uploaded (endpoint trouble, or a refusal also counted as ``s3_error``);
    ``errors["corrupt"]``, ``["unsupported_format"]`` etc. count objects.
    """

    shared_across_processes = True

    name = "s3"

    def __init__(self, config: S3Config, *, sealer: Sealer | None = None) -> None:
        super().__init__()
        config.validate()
        self.config = config
        self.sealer = sealer
        self.namer = ObjectNamer(config.prefix)
        self.breaker = CircuitBreaker(config.breaker_failures, config.breaker_cooldown_s)
        self.probe = PROBES[config.probe](config.concurrency)
        self._req_lock = threading.Lock()
        self._requests: Counter[str] = Counter()
        self._client = config.client()
        self._reads = ThreadPoolExecutor(config.concurrency, thread_name_prefix="kvtier-s3-read")
        self._writes = ThreadPoolExecutor(config.concurrency, thread_name_prefix="kvtier-s3-write")
        self._local = threading.local()
        self._closed = False
        try:
            self._check_bucket()
        except BaseException:
            self.close()
            raise

    # -- start-up ---------------------------------------------------------------------------------
    def _check_bucket(self) -> None:
        """Fail at start-up, not at the first request, when the bucket is missing or forbidden."""
        where = f"bucket {self.config.bucket!r} at {self.config.endpoint_url}"
        try:
            self._call("head_bucket", lambda: self._client.head_bucket(Bucket=self.config.bucket))
        except S3Unreachable as exc:
            raise TierUnavailable(f"S3 endpoint unreachable at start-up ({where}): {exc}") from exc
        except bce.ClientError as exc:
            status, code = _status(exc)
            if status == 404 or code in ("NoSuchBucket", "404"):
                raise ConfigError(
                    f"S3Config.bucket: {where} does not exist; create it (e.g. `kvtier s3 up --bucket "
                    f"{self.config.bucket}`) or fix the name"
                ) from None
            if status == 403:
                raise ConfigError(f"S3Config.access_key: access to {where} denied ({code})") from None
            raise ConfigError(f"S3Config: {where} answered {status} {code} at start-up") from None

    # -- the guarded call ---------------------------------------------------------------------------
    def _call(self, op: str, fn: Callable[[], T]) -> T:
        """Run one S3 request through the circuit breaker; the only place botocore errors are mapped.

        Connection failures, timeouts and server faults (after botocore's bounded retries) count
        against the breaker and become S3Unreachable/S3Timeout. Any other ClientError means the
        endpoint answered, so it counts as a success for the breaker and propagates unchanged.
        """
        if self._closed:
            raise TierUnavailable("S3Tier is closed")
        if not self.breaker.allow():
            raise S3Unreachable("circuit open: the endpoint failed recently")
        ok = True
        t0 = time.perf_counter()
        try:
            return fn()
        except _TIMEOUTS as exc:
            ok = False
            raise S3Timeout(f"{op} timed out: {exc}") from exc
        except _CONNECTION_ERRORS as exc:
            ok = False
            raise S3Unreachable(f"{op} failed: {exc}") from exc
        except bce.ClientError as exc:
            status, code = _status(exc)
            if status >= 500 or code in _SERVER_FAULT_CODES:
                ok = False
                raise S3Unreachable(f"{op} failed with server fault {status} {code}") from exc
            raise
        finally:
            self.breaker.record(ok)
            self.metrics.observe(op, time.perf_counter() - t0)
            with self._req_lock:
                self._requests[op] += 1

    def request_counts(self) -> dict[str, int]:
        """S3 requests issued so far by operation (plus ``probe_rounds``): how costs are checked."""
        with self._req_lock:
            return dict(self._requests)

    def _count(self, what: str, n: int = 1) -> None:
        with self._req_lock:
            self._requests[what] += n

    def _fan_out(self, pool: ThreadPoolExecutor, fn: Callable[[Any], T], items: Sequence[Any]) -> list[T]:
        """Run ``fn`` over ``items`` in ``pool`` and join all of them before returning or raising."""
        try:
            futures: list[Future[T]] = [pool.submit(fn, it) for it in items]
        except RuntimeError:  # the pool was shut down: close() ran
            raise TierUnavailable("S3Tier is closed") from None
        first_exc: BaseException | None = None
        out: list[T] = []
        for f in futures:
            try:
                out.append(f.result())
            except BaseException as exc:  # re-raised below, after every worker has finished
                first_exc = first_exc or exc
        if first_exc is not None:
            raise first_exc
        return out

    # -- contains ---------------------------------------------------------------------------------
    def _head(self, key: BlockKey) -> tuple[bool, str | None]:
        try:
            self._call("head", lambda: self._client.head_object(Bucket=self.config.bucket, Key=self.namer.name(key)))
            return True, None
        except S3Unreachable as exc:
            return False, exc.cause
        except bce.ClientError as exc:
            status, _ = _status(exc)
            return False, None if status == 404 else _Verdict.S3_ERROR.value

    def contains(self, keys: Sequence[BlockKey]) -> int:
        """Longest present prefix; concurrent HEADs in waves (see ChainProbe), never one per round trip."""
        if not keys:
            return 0
        causes: Counter[str] = Counter()

        def exists(idx: Sequence[int]) -> list[bool]:
            self._count("probe_rounds")
            res = self._fan_out(self._reads, self._head, [keys[i] for i in idx])
            for _, cause in res:
                if cause is not None:
                    causes[cause] += 1
            return [present for present, _ in res]

        n = self.probe.prefix_length(len(keys), exists)
        for cause in causes:
            self.metrics.error(cause)
        return n

    def holds(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Which of ``keys`` exist: one round of concurrent HEADs over the read pool (a key asked
        twice is asked once), never a round trip per key in sequence. Like ``contains`` it never
        raises for endpoint trouble: a key it cannot check counts as absent, the cause counted
        once per call."""
        if not keys:
            return []
        self._count("probe_rounds")
        heads = self._heads(keys)
        for cause in {cause for _, cause in heads.values() if cause is not None}:
            self.metrics.error(cause)
        return [heads[k][0] for k in keys]

    def _heads(self, keys: Sequence[BlockKey]) -> dict[BlockKey, tuple[bool, str | None]]:
        """``_head`` of each distinct key, concurrently over the read pool."""
        unique = list(dict.fromkeys(keys))
        return dict(zip(unique, self._fan_out(self._reads, self._head, unique), strict=True))

    # -- get --------------------------------------------------------------------------------------
    def get(self, keys: Sequence[BlockKey]) -> list[Block | None]:
        return self._read(keys, None)

    def get_into(self, keys: Sequence[BlockKey], outs: Sequence[torch.Tensor]) -> list[Block | None]:
        if len(outs) != len(keys):
            raise ValueError("get_into needs one destination tensor per key")
        return self._read(keys, outs)

    def _fetch(self, key: BlockKey) -> bytes | None:
        """The whole object; None when it is implausibly large (never read, never ours)."""

        def once() -> bytes | None:
            resp = self._client.get_object(Bucket=self.config.bucket, Key=self.namer.name(key))
            body = resp["Body"]
            if int(resp["ContentLength"]) > MAX_OBJECT_BYTES:
                body.close()
                return None
            # read() checks the length against Content-Length (IncompleteReadError when short).
            # (urllib3's readinto is read + copy, so a reused buffer would cost one more copy.)
            return body.read()

        return self._call("get", once)

    def _get_one(self, item: tuple[BlockKey, torch.Tensor | None]) -> tuple[Block | None, _Verdict]:
        key, out = item
        try:
            raw = self._fetch(key)
        except S3Unreachable as exc:
            return None, _Verdict(exc.cause)
        except bce.ClientError as exc:
            status, _ = _status(exc)
            return None, _Verdict.ABSENT if status == 404 else _Verdict.S3_ERROR
        if raw is None:
            return None, _Verdict.CORRUPT
        try:
            if self.sealer is None and codec.parse_header(raw).envelope is not None:
                return None, _Verdict.SEALED_NO_KEYRING
            blk = codec.decode(raw, expect_key=key, sealer=self.sealer, out=out)
        except UnsupportedFormat:
            return None, _Verdict.NEWER_FORMAT if raw[4] > codec.FORMAT_VERSION else _Verdict.STALE_FORMAT
        except CorruptRecord:
            return None, _Verdict.CORRUPT
        except KeyUnavailable:
            return None, _Verdict.KEY_UNAVAILABLE
        except LayoutMismatch:
            if out is not None:
                raise  # the caller's destination is wrong: its error, the object is intact
            return None, _Verdict.CORRUPT
        return blk, _Verdict.HIT

    def _read(self, keys: Sequence[BlockKey], outs: Sequence[torch.Tensor] | None) -> list[Block | None]:
        t0 = time.perf_counter()
        items = list(zip(keys, outs if outs is not None else [None] * len(keys), strict=True))
        results = self._fan_out(self._reads, self._get_one, items)
        verdicts = Counter(v for _, v in results)
        hits = verdicts[_Verdict.HIT]
        self.metrics.hit(hits, sum(b.nbytes for b, _ in results if b is not None))
        self.metrics.miss(len(keys) - hits)
        for v, n in verdicts.items():
            if v in (_Verdict.HIT, _Verdict.ABSENT):
                continue
            # Endpoint trouble is counted once per call; bad objects once per object.
            self.metrics.error(v.value, 1 if v in (_Verdict.UNAVAILABLE, _Verdict.TIMEOUT) else n)
        bad = [k for k, (_, v) in zip(keys, results, strict=True) if v in _DELETE_VERDICTS]
        if bad:
            self._quarantine(bad)
        self.metrics.observe("get_batch", time.perf_counter() - t0)
        return [b for b, _ in results]

    def _quarantine(self, keys: list[BlockKey]) -> None:
        """Delete records that failed verification; if the endpoint is gone, the next read retries."""
        try:
            self._delete_names([self.namer.name(k) for k in dict.fromkeys(keys)])
        except TierUnavailable:
            self.metrics.error("quarantine_failed")

    # -- put --------------------------------------------------------------------------------------
    def _put_one(self, block: Block | SealedRecord) -> str:
        if not self.config.conditional_put:
            present, cause = self._head(block.key)
            if present:
                return "present"
            if cause is not None:
                return cause
        # Each worker thread encodes into its own reused buffer: faulting in fresh pages for every
        # multi-MiB record costs more than the copy itself. It is trimmed to the record because
        # boto3 takes a whole bytearray, not a view.
        body: bytes | bytearray | None = getattr(self._local, "put_buffer", None)
        if isinstance(block, SealedRecord):
            # A record spilled from a tier sealing with the same key ring goes up as it is.
            try:
                body = block.for_sealer(self.sealer)
            except (CorruptRecord, LayoutMismatch):
                return _Verdict.CORRUPT.value
        elif body is None:
            body = self._local.put_buffer = bytearray()
        if isinstance(block, Block):
            assert isinstance(body, bytearray)
            try:
                del body[codec.encode_into(block, body, self.sealer) :]
            except BufferError:  # a view of the buffer is still alive somewhere, so it cannot resize
                body = codec.encode(block, self.sealer)
                self._local.put_buffer = bytearray()
        kw: dict[str, Any] = {"Bucket": self.config.bucket, "Key": self.namer.name(block.key), "Body": body,
                              "ContentType": "application/octet-stream"}
        if self.config.conditional_put:
            # If-None-Match makes "a present key is left as it is" one atomic request, not HEAD+PUT.
            kw["IfNoneMatch"] = "*"
        try:
            self._call("put", lambda: self._client.put_object(**kw))
        except S3Unreachable as exc:
            return exc.cause
        except bce.ClientError as exc:
            status, code = _status(exc)
            return "present" if status == 412 or code == "PreconditionFailed" else _Verdict.S3_ERROR.value
        return "stored"

    def put(
        self, blocks: Sequence[Block | SealedRecord], *, pins: PinTable = NO_PINS, spill: bool = False
    ) -> PutResult:
        t0 = time.perf_counter()
        res = PutResult()
        unique: dict[BlockKey, Block | SealedRecord] = {}
        for b in blocks:
            if b.key in unique:
                res.present.append(b.key)
            else:
                unique[b.key] = b
        todo = list(unique.values())
        outcomes = self._fan_out(self._writes, self._put_one, todo)
        causes: Counter[str] = Counter()
        stored_bytes = 0
        for b, outcome in zip(todo, outcomes, strict=True):
            if outcome == "stored":
                res.stored.append(b.key)
                stored_bytes += b.nbytes
            elif outcome == "present":
                res.present.append(b.key)
            else:
                res.rejected.append(b.key)
                causes[outcome] += 1
        for cause in causes:
            self.metrics.error(cause)
        if causes:
            self.metrics.error("dropped_put", sum(causes.values()))
        self.metrics.stored(len(res.stored), stored_bytes)
        self.metrics.observe("put_batch", time.perf_counter() - t0)
        return res

    # -- delete / listing (administrative: failures raise TierUnavailable) ------------------------
    def delete(self, keys: Sequence[BlockKey]) -> int:
        heads = self._heads(keys)
        for _, cause in heads.values():
            if cause is not None:
                raise S3Unreachable(f"delete: cannot check which objects exist ({cause})")
        present = [k for k, (ok, _) in heads.items() if ok]
        self._delete_names([self.namer.name(k) for k in present])
        return len(present)

    def delete_scope(self, domain: ScopeDomain) -> int:
        names = [self.namer.name(k) for k in self.keys_in_scope(domain)]
        self._delete_names(names)
        return len(names)

    def _delete_names(self, names: Sequence[str]) -> None:
        """Multi-object delete, ``delete_batch`` names per request, batches in parallel."""
        step = self.config.delete_batch
        chunks = [list(names[i : i + step]) for i in range(0, len(names), step)]

        def one(chunk: list[str]) -> None:
            try:
                resp = self._call("delete", lambda: self._client.delete_objects(
                    Bucket=self.config.bucket, Delete={"Objects": [{"Key": n} for n in chunk], "Quiet": True},
                ))
            except bce.ClientError as exc:
                status, code = _status(exc)
                raise TierUnavailable(f"S3 refused a multi-object delete: {status} {code}") from exc
            errors = resp.get("Errors") or []
            if errors:
                first = errors[0]
                raise TierUnavailable(
                    f"S3 could not delete {len(errors)} of {len(chunk)} objects "
                    f"(first: {first.get('Key')}: {first.get('Code')} {first.get('Message')})"
                )

        self._fan_out(self._writes, one, chunks)

    def _list(self, prefix: str, delimiter: str | None = None) -> Iterator[dict[str, Any]]:
        """Pages of ListObjectsV2 (1000 entries each) under ``prefix``."""
        token: str | None = None
        while True:
            kw: dict[str, Any] = {"Bucket": self.config.bucket, "Prefix": prefix}
            if delimiter:
                kw["Delimiter"] = delimiter
            if token:
                kw["ContinuationToken"] = token
            try:
                page = self._call("list", lambda kw=kw: self._client.list_objects_v2(**kw))
            except bce.ClientError as exc:
                status, code = _status(exc)
                raise TierUnavailable(f"S3 refused a listing of {prefix!r}: {status} {code}") from exc
            yield page
            if not page.get("IsTruncated"):
                return
            token = page.get("NextContinuationToken")
            if not token:
                raise TierUnavailable(f"S3 listing of {prefix!r} is truncated but has no continuation token")

    def _layout_tags(self) -> list[str]:
        tags: list[str] = []
        for page in self._list(self.namer.root(), "/"):
            for cp in page.get("CommonPrefixes") or []:
                tag = ObjectNamer.tag_of(cp.get("Prefix", ""))
                if tag is not None:
                    tags.append(tag)
        return tags

    def keys_in_scope(self, domain: ScopeDomain) -> list[BlockKey]:
        """One LIST for the layout tags, then one LIST per 1000 objects of the scope per tag."""
        keys: list[BlockKey] = []
        for tag in self._layout_tags():
            for page in self._list(self.namer.scope_prefix(tag, domain)):
                for obj in page.get("Contents") or []:
                    k = self.namer.parse(obj["Key"])
                    if k is not None and k[:DOMAIN_BYTES] == domain:
                        keys.append(k)
        return keys

    def usage(self) -> TierUsage:
        """Exact for the shared bucket: lists the whole prefix (one LIST per 1000 objects)."""
        blocks = total = 0
        by_domain: Counter[ScopeDomain] = Counter()
        blocks_by_domain: Counter[ScopeDomain] = Counter()
        for page in self._list(self.namer.root()):
            for obj in page.get("Contents") or []:
                k = self.namer.parse(obj["Key"])
                if k is None:
                    continue
                size = int(obj.get("Size", 0))
                blocks += 1
                total += size
                by_domain[ScopeDomain(k[:DOMAIN_BYTES])] += size
                blocks_by_domain[ScopeDomain(k[:DOMAIN_BYTES])] += 1
        return TierUsage(blocks, total, None, dict(by_domain), dict(blocks_by_domain))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._reads.shutdown(wait=True)
        self._writes.shutdown(wait=True)
        self._client.close()
