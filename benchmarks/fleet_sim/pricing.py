"""Time to first token of a request on a node, from kvtier's cost-model profiles.

The profiles are the cost model's own (kvtier/planning/profiles.py, read-only here): a run of
``n`` blocks from tier ``t`` costs ``TierProfile.predict`` (latency + per block + bytes /
bandwidth, plus decryption for an encrypted tier, as ``CostModel`` charges it); blocks loaded from a
host tier are assembled into the engine's cache at ``HostToDeviceProfile.predict``; the tokens not
reused are computed at ``PrefillProfile.predict(new, ctx)``. A block in the engine's GPU prefix
cache costs nothing to reuse.

A request's plan is the cost model's ``split``: reuse its first ``k`` blocks (the best tier
holding each), compute the rest after them; ``k`` is the cheapest cut. So a cached block is not
reused when loading it is slower than computing it (a deep S3 run on an idle fast GPU), the
same choice the node's kvtier connector would make.

Simulated tiers map to profile names: ``ram`` -> ``cpu``, ``disk`` -> ``nvme``, ``s3`` -> ``s3``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from benchmarks.fleet_sim.requests import SimRequest
from kvtier.errors import ConfigError
from kvtier.layout import KVLayout
from kvtier.planning.cost_model import CostModel, h200_llama3_8b

#: Tier codes, fastest first. GPU is the engine's own prefix cache; the others are kvtier's.
GPU, RAM, DISK, S3 = 0, 1, 2, 3
TIER_NAMES = ("gpu", "ram", "disk", "s3")
#: Which cost-model profile prices each kvtier tier.
PROFILE_OF = {RAM: "cpu", DISK: "nvme", S3: "s3"}
#: Named cost models a run can be priced with.
PROFILES = {"h200-llama3-8b": h200_llama3_8b}


@dataclass(slots=True, frozen=True)
class Plan:
    """What serving a request costs on one node: ``seconds`` to its first token (queue excluded),
    ``reused`` leading blocks, and how many of them came from each tier (indexed by tier code)."""

    seconds: float
    reused: int
    by_tier: tuple[int, int, int, int]


class Pricer:
    """Prices plans for one cost model and block size. Tables are filled lazily and kept, so one
    Pricer serves every run of a workload; the profiles are only read."""

    def __init__(self, model: CostModel, layout: KVLayout, block_tokens: int) -> None:
        if block_tokens % layout.block_tokens:
            raise ConfigError(f"block of {block_tokens} tokens is not a whole number of "
                              f"{layout.block_tokens}-token layout blocks")
        self.model = model
        self.block_tokens = block_tokens
        self.layout_blocks = block_tokens // layout.block_tokens
        self.block_bytes = block_tokens * layout.bytes_per_token
        self._runs: dict[int, list[float]] = {t: [0.0] for t in PROFILE_OF}
        self._assemble: list[float] = [0.0]
        self._prefill: dict[int, list[float]] = {}  # input tokens -> curve (a function of them only)

    @classmethod
    def named(cls, name: str, block_tokens: int) -> Pricer:
        make = PROFILES.get(name)
        if make is None:
            raise ConfigError(f"unknown cost profile {name!r}; one of {sorted(PROFILES)}")
        model, layout = make()
        return cls(model, layout, block_tokens)

    # -- the profiles, tabulated ----------------------------------------------------------------
    def _grow(self, n: int) -> None:
        while len(self._assemble) <= n:
            k = len(self._assemble)
            nbytes = k * self.block_bytes
            self._assemble.append(float(self.model.host_to_device.predict(nbytes)))
            for tier, table in self._runs.items():
                prof = self.model.profile(PROFILE_OF[tier])
                dec = nbytes / self.model.decrypt_Bps if prof.encrypted else 0.0
                table.append(prof.predict(k * self.layout_blocks, nbytes) + dec)

    def run_seconds(self, tier: int, blocks: int) -> float:
        """Loading a run of ``blocks`` blocks from ``tier`` (GPU: free)."""
        if tier == GPU or blocks <= 0:
            return 0.0
        self._grow(blocks)
        return self._runs[tier][blocks]

    def prefill_curve(self, req: SimRequest) -> list[float]:
        """Seconds of compute when the first ``k`` blocks are reused, for k = 0..len(keys). At
        least one token is computed: the first output token needs a forward pass."""
        curve = self._prefill.get(req.input_tokens)
        if curve is None:
            k = np.arange(req.input_tokens // self.block_tokens + 1, dtype=np.float64)
            ctx = k * self.block_tokens
            new = np.maximum(req.input_tokens - ctx, 1.0)
            curve = np.asarray(self.model.prefill.predict(new, ctx), dtype=np.float64).tolist()
            self._prefill[req.input_tokens] = curve
        return curve

    # -- plans ----------------------------------------------------------------------------------
    def plan(self, req: SimRequest, tiers: Sequence[int]) -> Plan:
        """The cheapest split for a request whose leading blocks are held in ``tiers`` (one tier
        code per block, from block 0, as far as the prefix is held anywhere)."""
        curve = self.prefill_curve(req)
        m = len(tiers)
        self._grow(m)
        best, best_k = curve[0], 0
        done = 0.0  # completed runs
        run_tier, run_len, host_blocks = -1, 0, 0
        runs, assemble = self._runs, self._assemble
        for i in range(m):
            t = tiers[i]
            if t != run_tier:
                if run_tier > GPU:
                    done += runs[run_tier][run_len]
                run_tier, run_len = t, 0
            run_len += 1
            load = done + (runs[t][run_len] if t > GPU else 0.0)
            if t > GPU:
                host_blocks += 1
            cost = load + assemble[host_blocks] + curve[i + 1]
            if cost < best:
                best, best_k = cost, i + 1
        counts = [0, 0, 0, 0]
        for t in tiers[:best_k]:
            counts[t] += 1
        return Plan(best, best_k, (counts[0], counts[1], counts[2], counts[3]))
