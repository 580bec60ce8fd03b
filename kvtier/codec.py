"""Self-describing block records for the disk and remote tiers.

Wire layout (little-endian)::

    magic "KVTR" | u8 version | u8 flags | u32 header_len | u64 xxh3 checksum
    header (msgpack map, header_len bytes) | zero padding to a 64-byte boundary | payload

The checksum covers everything after the prefix; for a sealed record it stops at the payload,
which the AES-GCM tag authenticates instead (hashing ciphertext twice buys nothing).

The header holds the block identity (key, scope domain, layout fingerprint, parent, index,
dtype, shape), the payload length, the encryption envelope (key id + nonce) when sealed, the
creation time and, when the writer knew it, the xxh3-64 of the plaintext payload (``x``: the
checksum a wire frame of the block carries, so a reader can frame the block as it decrypts it
instead of hashing it again; a record without it is read the same way otherwise). Readers
verify magic, version, lengths, checksum and identity before use; when sealed, the AES-GCM tag
authenticates the payload under an AAD made of the identity fields, so a record copied under
another key, tenant or layout fails to open. ``x`` is the writer's word, covered by the record
checksum but not by the tag: a wrong one can only make a receiver that verifies the frame refuse
the block, never accept other bytes (the payload itself is authenticated).
"""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import msgpack
import numpy as np
import torch
import xxhash

from kvtier.block import Block, BlockMeta, Described
from kvtier.errors import CorruptRecord, LayoutMismatch, UnsupportedFormat
from kvtier.keys import DOMAIN_BYTES, KEY_BYTES, LAYOUT_TAG_BYTES, BlockKey, ScopeDomain
from kvtier.layout import DTYPES, LayoutFingerprint

MAGIC = b"KVTR"
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<4sBBIQ")
PREFIX_BYTES = _PREFIX.size
ALIGN = 64
MAX_HEADER_BYTES = 4096
FLAG_SEALED = 0x01


class Sealer(Protocol):
    """Authenticated encryption of payloads, per scope domain (implemented in kvtier.crypto)."""

    def seal(self, domain: ScopeDomain, aad: bytes, plaintext: memoryview) -> tuple[dict[str, Any], bytes]:
        """Encrypt; returns the envelope to keep in the header and ciphertext||tag."""
        ...

    def open_into(
        self, domain: ScopeDomain, envelope: dict[str, Any], aad: bytes, sealed: memoryview, out: memoryview
    ) -> None:
        """Decrypt into ``out``; raises CorruptRecord when the tag does not verify."""
        ...


@runtime_checkable
class InPlaceSealer(Protocol):
    """A Sealer that can also encrypt straight into the record buffer (kvtier.crypto.KeyRing):
    ``reserve`` gives the envelope before the header is written, ``seal_into`` then fills the
    body (plaintext length + 16 bytes of tag) without allocating a ciphertext."""

    def reserve(self, domain: ScopeDomain) -> dict[str, Any]: ...

    def seal_into(
        self, domain: ScopeDomain, envelope: dict[str, Any], aad: bytes, plaintext: memoryview, out: memoryview
    ) -> None: ...


@dataclass(slots=True, frozen=True)
class RecordHeader:
    meta: BlockMeta
    payload_len: int
    payload_offset: int
    envelope: dict[str, Any] | None
    created_at: float
    #: xxh3-64 of the plaintext payload, as the writer stated it (None: not recorded).
    payload_checksum: int | None = None


def _aad(meta: BlockMeta) -> bytes:
    return msgpack.packb(
        [FORMAT_VERSION, meta.key, meta.domain, meta.layout_fp, meta.parent, meta.index, meta.dtype, list(meta.shape)]
    )


def _checked_end(flags: int, payload_offset: int, total: int) -> int:
    """Where the checksum stops: a sealed payload is already authenticated by its GCM tag (which
    also binds the identity fields through the AAD), so hashing it again would only cost time."""
    return payload_offset if flags & FLAG_SEALED else total


def compute_checksum(buf: memoryview | bytes | bytearray) -> int:
    """The checksum a whole record should carry (for tools that rewrite headers, and tests)."""
    mv = memoryview(buf)
    flags, hlen = _PREFIX.unpack_from(mv, 0)[2:4]
    payload_offset = PREFIX_BYTES + hlen + _pad(PREFIX_BYTES + hlen)
    return xxhash.xxh3_64_intdigest(mv[PREFIX_BYTES : _checked_end(flags, payload_offset, len(mv))])


def _pad(n: int) -> int:
    return (-n) % ALIGN


def encode(block: Block, sealer: Sealer | None = None) -> bytearray:
    """One whole record in a fresh buffer."""
    buf = bytearray()
    n = encode_into(block, buf, sealer)
    del buf[n:]
    return buf


def encode_into(block: Block, buf: bytearray, sealer: Sealer | None = None) -> int:
    """Write one whole record at the start of ``buf`` (grown if needed); returns its length.

    Reusing one scratch buffer per writer avoids faulting in fresh pages for every block, which
    otherwise costs more than the copy itself; the payload is copied exactly once.
    """
    meta = block.meta
    plain = block.as_bytes_view()
    envelope = None
    body: bytes | memoryview = plain
    # An in-place sealer encrypts into the (reused) record buffer below: no ciphertext allocation,
    # which costs more than the encryption itself for large blocks.
    in_place = sealer is not None and isinstance(sealer, InPlaceSealer)
    body_len = len(plain)
    if in_place:
        envelope = sealer.reserve(meta.domain)
        body_len += 16
    elif sealer is not None:
        envelope, body = sealer.seal(meta.domain, _aad(meta), plain)
        body_len = len(body)
    header = msgpack.packb(
        {
            "k": meta.key,
            "d": meta.domain,
            "l": meta.layout_fp,
            "p": meta.parent,
            "i": meta.index,
            "t": meta.dtype,
            "s": list(meta.shape),
            "n": body_len,
            "e": envelope,
            "c": time.time(),
            **({"x": block.checksum} if block.checksum is not None else {}),
        }
    )
    if len(header) > MAX_HEADER_BYTES:
        raise ValueError("record header too large")
    flags = FLAG_SEALED if envelope is not None else 0
    start = PREFIX_BYTES + len(header)
    pad = _pad(start)
    total = start + pad + body_len
    if len(buf) < total:
        buf.extend(bytes(total - len(buf)))
    mv = memoryview(buf)
    mv[PREFIX_BYTES:start] = header
    mv[start : start + pad] = bytes(pad)
    if in_place:
        sealer.seal_into(meta.domain, envelope, _aad(meta), plain, mv[start + pad : total])
    else:
        mv[start + pad : total] = body
    digest = xxhash.xxh3_64_intdigest(mv[PREFIX_BYTES : _checked_end(flags, start + pad, total)])
    _PREFIX.pack_into(buf, 0, MAGIC, FORMAT_VERSION, flags, len(header), digest)
    return total


def _field(h: dict[str, Any], name: str, typ: type | tuple[type, ...]) -> Any:
    v = h.get(name)
    if not isinstance(v, typ):
        raise CorruptRecord(f"record header field {name!r} missing or of the wrong type")
    return v


def parse_header(buf: memoryview | bytes) -> RecordHeader:
    """Parse and sanity-check the prefix and header; the payload is not touched yet."""
    mv = memoryview(buf)
    if len(mv) < PREFIX_BYTES:
        raise CorruptRecord("record shorter than its fixed prefix")
    magic, version, flags, hlen, _ = _PREFIX.unpack_from(mv, 0)
    if magic != MAGIC:
        raise CorruptRecord("bad record magic")
    if flags & ~FLAG_SEALED:
        raise CorruptRecord(f"unknown record flags {flags:#x}")
    if version != FORMAT_VERSION:
        raise UnsupportedFormat(f"record format version {version} is not readable by version {FORMAT_VERSION}")
    if hlen > MAX_HEADER_BYTES or PREFIX_BYTES + hlen > len(mv):
        raise CorruptRecord("record header length out of range")
    try:
        h = msgpack.unpackb(mv[PREFIX_BYTES : PREFIX_BYTES + hlen], raw=False, strict_map_key=True)
    except (ValueError, msgpack.UnpackException, TypeError) as exc:
        raise CorruptRecord(f"record header is not valid msgpack: {exc}") from None
    if not isinstance(h, dict):
        raise CorruptRecord("record header is not a map")
    key = _field(h, "k", bytes)
    dom = _field(h, "d", bytes)
    lfp = _field(h, "l", bytes)
    parent = h.get("p")
    if len(key) != KEY_BYTES or len(dom) != DOMAIN_BYTES or len(lfp) != 32:
        raise CorruptRecord("record identity fields have the wrong width")
    if key[:DOMAIN_BYTES] != dom or key[DOMAIN_BYTES : DOMAIN_BYTES + LAYOUT_TAG_BYTES] != lfp[:LAYOUT_TAG_BYTES]:
        raise CorruptRecord("record key's routing prefix disagrees with its domain or layout")
    if parent is not None and (not isinstance(parent, bytes) or len(parent) != KEY_BYTES):
        raise CorruptRecord("record parent field malformed")
    index = _field(h, "i", int)
    dtype = _field(h, "t", str)
    shape = _field(h, "s", list)
    n = _field(h, "n", int)
    env = h.get("e")
    created = _field(h, "c", (float, int))
    payload_checksum = h.get("x")
    if payload_checksum is not None and (not isinstance(payload_checksum, int) or not 0 <= payload_checksum < 1 << 64):
        raise CorruptRecord("record payload checksum field malformed")
    if dtype not in DTYPES or not all(isinstance(d, int) and d > 0 for d in shape) or index < 0:
        raise CorruptRecord("record dtype/shape/index malformed")
    if bool(flags & FLAG_SEALED) != (env is not None) or (env is not None and not isinstance(env, dict)):
        raise CorruptRecord("record sealed flag disagrees with its envelope")
    meta = BlockMeta(BlockKey(key), ScopeDomain(dom), LayoutFingerprint(lfp), parent, index, dtype, tuple(shape))
    offset = PREFIX_BYTES + hlen + _pad(PREFIX_BYTES + hlen)
    if offset + n != len(mv):
        raise CorruptRecord(f"record length {len(mv)} != header's {offset + n} (truncated or padded)")
    expected_body = meta.nbytes + (16 if env is not None else 0)
    if n != expected_body:
        raise CorruptRecord("record payload length disagrees with its dtype and shape")
    return RecordHeader(meta, n, offset, env, float(created), payload_checksum)


def decode(
    buf: memoryview | bytes,
    *,
    expect_key: BlockKey | None = None,
    expect_layout: LayoutFingerprint | None = None,
    sealer: Sealer | None = None,
    out: torch.Tensor | None = None,
) -> Block:
    """Verify a whole record and return its block; the payload is copied once, into ``out``.

    Raises CorruptRecord (or its subclass UnsupportedFormat) for anything that does not verify
    and LayoutMismatch when the record is well-formed but belongs to another layout.
    """
    hdr = verify_record(buf, expect_key=expect_key)
    if expect_layout is not None and hdr.meta.layout_fp != expect_layout:
        raise LayoutMismatch("record belongs to another KV layout")
    return open_payload(buf, hdr, sealer=sealer, out=out)


def open_payload(buf: memoryview | bytes, hdr: RecordHeader, *, sealer: Sealer | None = None,
                 out: torch.Tensor | None = None) -> Block:
    """The block of a record ``verify_record`` checked (``hdr``): its payload decrypted (and
    authenticated) or copied once, into ``out``. The block carries the header's payload checksum."""
    mv = memoryview(buf)
    meta = hdr.meta
    body = mv[hdr.payload_offset :]
    torch_dtype = DTYPES[meta.dtype][0]
    if out is None:
        out = torch.empty(meta.shape, dtype=torch_dtype)
    elif out.dtype != torch_dtype or tuple(out.shape) != meta.shape or not out.is_contiguous():
        raise LayoutMismatch("destination tensor does not match the record's dtype/shape")
    dst = memoryview(out.view(torch.uint8).reshape(-1).numpy()).cast("B")
    if hdr.envelope is not None:
        if sealer is None:
            raise CorruptRecord("record is encrypted but this tier has no key ring")
        sealer.open_into(meta.domain, hdr.envelope, _aad(meta), body, dst)
    else:
        np.copyto(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(body, dtype=np.uint8))
    return Block(meta, out, hdr.payload_checksum)


def verify_record(buf: memoryview | bytes, *, expect_key: BlockKey | None = None) -> RecordHeader:
    """Check a record's header, identity, length and checksum without opening its payload (no
    decryption): what a tier needs before it hands a record on as it is. Raises CorruptRecord."""
    mv = memoryview(buf)
    hdr = parse_header(mv)
    if expect_key is not None and hdr.meta.key != expect_key:
        raise CorruptRecord("record key differs from the key it was stored under")
    end = _checked_end(_PREFIX.unpack_from(mv, 0)[2], hdr.payload_offset, len(mv))
    if xxhash.xxh3_64_intdigest(mv[PREFIX_BYTES:end]) != _PREFIX.unpack_from(mv, 0)[4]:
        raise CorruptRecord("record checksum mismatch")
    return hdr


@dataclass(slots=True, frozen=True)
class SealedRecord(Described):
    """A block as its whole, checked record (header and payload, sealed by ``sealer`` or plain when
    it is None), moved from one tier to another without being opened: tiers that keep the same
    record format under the same key ring store these bytes as they are, so an evicted block is
    not decrypted by one tier only to be encrypted again by the next. Others ``open`` it.
    """

    meta: BlockMeta
    raw: bytes
    sealer: Sealer | None

    @classmethod
    def checked(cls, raw: bytes, key: BlockKey, sealer: Sealer | None) -> SealedRecord:
        return cls(verify_record(raw, expect_key=key).meta, raw, sealer)

    def open(self) -> Block:
        return decode(self.raw, expect_key=self.key, sealer=self.sealer)

    def for_sealer(self, sealer: Sealer | None) -> bytes | bytearray:
        """This record's bytes as a tier sealing with ``sealer`` stores them: the same bytes when
        the key ring is the same, else opened and encoded again."""
        return self.raw if sealer is self.sealer else encode(self.open(), sealer)


def peek_meta(buf: memoryview | bytes) -> RecordHeader:
    """Header only (no checksum): used to rebuild indexes on open; data is verified on read."""
    return parse_header(buf)
