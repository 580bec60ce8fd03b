"""Start-up probes that seed the cost model: prefill, host-to-device, decrypt and tier timings."""

from __future__ import annotations

import hashlib
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from kvtier.block import Block
from kvtier.errors import TierUnavailable
from kvtier.keys import LAYOUT_TAG_BYTES, ScopeDomain, make_key
from kvtier.layout import KVLayout
from kvtier.planning.profiles import HostToDeviceProfile, PrefillProfile, TierProfile

if TYPE_CHECKING:
    from kvtier.store.tier import Tier


# -- start-up probe ---------------------------------------------------------------------------------
class ForwardTimer(Protocol):
    """What the probe needs from an engine (kvtier.prefill.PrefillRunner implements it)."""

    layout: KVLayout

    def time_forward(self, new_tokens: int, ctx_tokens: int, *, seed: int = 0) -> float: ...

    def time_assemble(self, n_blocks: int) -> float: ...


#: A fixed scope domain for probe blocks: probes never touch tenant data, and an encrypting tier
#: creates at most one data key for them.
PROBE_DOMAIN = ScopeDomain(hashlib.sha256(b"kvtier-cost-probe-v1").digest()[:16])

#: (new tokens, context tokens) the prefill probe measures: fresh prompts, short and long
#: questions after a cache, and long computations after a cache (a recompute behind a reloaded
#: front), which separate an engine's masked-attention cost (PrefillProfile). About a second per
#: repeat for the ``small`` model on one CPU thread.
PREFILL_PROBE_POINTS: tuple[tuple[int, int], ...] = (
    (16, 0), (64, 0), (256, 0), (1024, 0), (2048, 0), (16, 1024), (16, 4096), (256, 1024), (512, 4096),
    (1024, 1024), (2048, 64),
)


def probe_prefill(engine: ForwardTimer, points: Sequence[tuple[int, int]] = PREFILL_PROBE_POINTS,
                  repeats: int = 2) -> PrefillProfile:
    """Measure the engine at a few (new, ctx) points and fit a PrefillProfile to them."""
    prof = PrefillProfile(1e-3, 1e-5, 1e-9, 1e-8)
    engine.time_forward(engine.layout.block_tokens, engine.layout.block_tokens)  # one-time costs
    for _ in range(repeats):
        for i, (new, ctx) in enumerate(points):
            prof.observe(new, ctx, engine.time_forward(new, ctx, seed=i), calibrate=True)
    return prof


def probe_host_to_device(engine: ForwardTimer, block_counts: Sequence[int] = (4, 64, 256)) -> HostToDeviceProfile:
    prof = HostToDeviceProfile(5e9)
    bpb = engine.layout.bytes_per_block
    for n in (*block_counts, *block_counts):
        prof.observe(n * bpb, engine.time_assemble(n), calibrate=True)
    return prof


def probe_decrypt(nbytes: int = 4 << 20, repeats: int = 3) -> float:
    """AES-256-GCM decryption throughput of this host (the cipher kvtier.crypto uses), bytes/s."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    aead = AESGCM(AESGCM.generate_key(bit_length=256))
    nonce = os.urandom(12)
    sealed = aead.encrypt(nonce, os.urandom(nbytes), b"probe")
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        aead.decrypt(nonce, sealed, b"probe")
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


@dataclass(slots=True, frozen=True)
class TierProbe:
    """Parameters of a tier probe: payload sizes, batch sizes, repeats (probe blocks are deleted after)."""

    block_bytes: tuple[int, ...] = (8 << 10, 128 << 10)
    counts: tuple[int, ...] = (1, 8, 32)
    repeats: int = 2
    #: Upper bound on blocks read by the overlap probe (keeps it short on slow tiers).
    overlap_max_blocks: int = 256


def _probe_blocks(nbytes: int, n: int, seed: int, domain: ScopeDomain = PROBE_DOMAIN) -> list[Block]:
    layout = KVLayout("kvtier-probe", num_layers=1, num_kv_heads=1, head_dim=nbytes // 2, dtype="uint8",
                      block_tokens=1, revision=f"{nbytes}")
    tag = layout.fingerprint[:LAYOUT_TAG_BYTES]
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        key = make_key(domain, tag, os.urandom(32))
        data = torch.randint(0, 256, layout.block_shape, generator=gen, dtype=torch.uint8)
        out.append(Block.build(layout, key, domain, data))
    return out


def probe_tier(
    tier: Tier,
    *,
    decrypt_Bps: float,
    compute: Callable[[], float] | None = None,
    spec: TierProbe | None = None,
    name: str | None = None,
    domain: ScopeDomain = PROBE_DOMAIN,
) -> TierProfile:
    """Measure a tier with probe blocks of two sizes and fit its TierProfile.

    With ``compute`` (a callable that runs a prefill and returns its seconds) the overlap penalty
    is measured too: compute alone, a load of similar duration alone, then both at once. Raises
    TierUnavailable when the tier does not hold or return the probe blocks. ``domain`` is the scope
    domain the probe blocks are written under (a tier that checks access, such as the daemon,
    needs one the caller may write).
    """
    spec = spec or TierProbe()
    encrypted = getattr(tier, "sealer", None) is not None
    prof = TierProfile(name or tier.name, 1e-3, 1e9, encrypted=encrypted)
    written: list[Block] = []
    try:
        for si, size in enumerate(spec.block_bytes):
            blocks = _probe_blocks(size, sum(spec.counts) * spec.repeats, seed=si, domain=domain)
            _put_all(tier, blocks)
            written += blocks
            it = iter(blocks)
            for _ in range(spec.repeats):
                for c in spec.counts:
                    batch = [next(it) for _ in range(c)]
                    t0 = time.perf_counter()
                    got = tier.get([b.key for b in batch])
                    dt = time.perf_counter() - t0
                    _check_all(tier, got)
                    nbytes = c * size
                    dec = nbytes / decrypt_Bps if encrypted else 0.0
                    prof.observe(c, nbytes, max(dt - dec, 0.0), calibrate=True)
        if compute is not None:
            written += _probe_overlap(tier, prof, compute, spec, decrypt_Bps, domain)
    finally:
        if written:
            tier.delete([b.key for b in written])
    return prof


def _probe_overlap(tier: Tier, prof: TierProfile, compute: Callable[[], float], spec: TierProbe,
                   decrypt_Bps: float, domain: ScopeDomain) -> list[Block]:
    size = spec.block_bytes[-1]
    c_alone = min(compute(), compute())
    per_block = prof.predict(2, 2 * size) - prof.predict(1, size) + (size / decrypt_Bps if prof.encrypted else 0)
    n = int(min(spec.overlap_max_blocks, max(4, (c_alone - prof.latency_s) / max(per_block, 1e-9))))
    blocks = _probe_blocks(size, n, seed=99, domain=domain)
    _put_all(tier, blocks)
    keys = [b.key for b in blocks]
    t0 = time.perf_counter()
    _check_all(tier, tier.get(keys))
    l_alone = time.perf_counter() - t0
    errors: list[BaseException] = []

    def load() -> None:
        try:
            _check_all(tier, tier.get(keys))
        except BaseException as exc:  # re-raised in the probing thread below
            errors.append(exc)

    th = threading.Thread(target=load, name="kvtier-overlap-probe")
    t0 = time.perf_counter()
    th.start()
    compute()
    th.join()
    both = time.perf_counter() - t0
    if errors:
        raise errors[0]
    lo, hi = min(c_alone, l_alone), max(c_alone, l_alone)
    prof.observe_overlap((both - hi) / lo, calibrate=True)
    return blocks


def _put_all(tier: Tier, blocks: Sequence[Block]) -> None:
    res = tier.put(blocks)
    if len(res.stored) + len(res.present) != len(blocks):
        raise TierUnavailable(f"probe could not store its blocks in tier {tier.name!r} "
                              f"({len(res.rejected)} rejected): too little room or tier failing")


def _check_all(tier: Tier, got: Sequence[Block | None]) -> None:
    if any(b is None for b in got):
        raise TierUnavailable(f"tier {tier.name!r} lost probe blocks during the probe")
