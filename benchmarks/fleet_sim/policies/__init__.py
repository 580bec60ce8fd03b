"""Routing policies, one module each, joined in ``POLICIES`` (name -> class) in report order."""

from benchmarks.fleet_sim.policies.base import POLICIES, Choice, Policy, PolicyContext
from benchmarks.fleet_sim.policies.cache_aware import CacheAware, CacheAwareConfig
from benchmarks.fleet_sim.policies.dynamo import Dynamo, DynamoConfig
from benchmarks.fleet_sim.policies.kvtier import Kvtier
from benchmarks.fleet_sim.policies.kvtier_index import KvtierIndex
from benchmarks.fleet_sim.policies.least_loaded import LeastLoaded
from benchmarks.fleet_sim.policies.llm_d import LlmD, LlmdConfig
from benchmarks.fleet_sim.policies.round_robin import RoundRobin

#: The policies a run compares by default (issue 30's list), in the order runs and tables list them.
POLICY_ORDER = ("round_robin", "least_loaded", "cache_aware", "llm_d", "dynamo", "kvtier")
#: kvtier's own design alternatives: run when ``--policies`` names them, never counted among the
#: others in a verdict (report.py).
VARIANTS = ("kvtier_index",)
assert sorted(POLICY_ORDER + VARIANTS) == sorted(POLICIES)
#: Policies whose decisions read the KV-event index (the staleness knobs act on them).
EVENT_FED = ("llm_d", "dynamo", "kvtier_index")

__all__ = [
    "EVENT_FED",
    "POLICIES",
    "POLICY_ORDER",
    "VARIANTS",
    "CacheAware",
    "CacheAwareConfig",
    "Choice",
    "Dynamo",
    "DynamoConfig",
    "Kvtier",
    "KvtierIndex",
    "LeastLoaded",
    "LlmD",
    "LlmdConfig",
    "Policy",
    "PolicyContext",
    "RoundRobin",
]
