"""Small fleets and workloads the fleet-simulation tests share."""

from __future__ import annotations

import pytest

from benchmarks.fleet_sim.multitenant import multitenant
from benchmarks.fleet_sim.pricing import Pricer
from benchmarks.fleet_sim.requests import Workload
from benchmarks.fleet_sim.simulator import SimConfig
from benchmarks.trace import TRACE_BLOCK_TOKENS


@pytest.fixture(scope="session")
def pricer() -> Pricer:
    return Pricer.named("h200-llama3-8b", TRACE_BLOCK_TOKENS)


@pytest.fixture(scope="session")
def tenants_wl() -> Workload:
    """300 requests of the multi-tenant workload, 20x faster than generated (queues form)."""
    return multitenant(1, 300).rescaled(20.0)


@pytest.fixture(scope="session")
def small():
    """A factory of configs with small caches (evictions happen within 300 requests)."""

    def make(**kw) -> SimConfig:
        base = {"gpu_blocks": 40, "ram_blocks": 120, "disk_blocks": 400}
        base.update(kw)
        return SimConfig(**base)

    return make
