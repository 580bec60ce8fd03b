"""Routing policies, one module each, joined in ``POLICIES`` (name -> class) in report order."""

from benchmarks.fleet_sim.policies.base import POLICIES, Choice, Policy, PolicyContext
from benchmarks.fleet_sim.policies.cache_aware import CacheAware, CacheAwareConfig
from benchmarks.fleet_sim.policies.dynamo import Dynamo, DynamoConfig
from benchmarks.fleet_sim.policies.kvtier import Kvtier
from benchmarks.fleet_sim.policies.least_loaded import LeastLoaded
from benchmarks.fleet_sim.policies.llm_d import LlmD, LlmdConfig
from benchmarks.fleet_sim.policies.round_robin import RoundRobin

#: Every policy, in the order runs and tables list them.
POLICY_ORDER = ("round_robin", "least_loaded", "cache_aware", "llm_d", "dynamo", "kvtier")
assert sorted(POLICY_ORDER) == sorted(POLICIES)
#: Policies whose decisions read the KV-event index (the staleness knobs act on them).
EVENT_FED = ("llm_d", "dynamo")

__all__ = [
    "EVENT_FED",
    "POLICIES",
    "POLICY_ORDER",
    "CacheAware",
    "CacheAwareConfig",
    "Choice",
    "Dynamo",
    "DynamoConfig",
    "Kvtier",
    "LeastLoaded",
    "LlmD",
    "LlmdConfig",
    "Policy",
    "PolicyContext",
    "RoundRobin",
]
