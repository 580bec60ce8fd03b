"""A trace-driven discrete-event simulation of a fleet of inference nodes behind a router.

``kvtier bench fleet --simulate`` (benchmarks/fleet.py) drives it. What is simulated, module by
module (one concept each):

- ``requests``: the simulated requests (arrival, tenant, scoped block keys, content ids) made from
  a Mooncake-format trace under the replay's tenant rule;
- ``multitenant``: the generated multi-tenant workload (public documents shared across tenants,
  private multi-turn histories, Poisson arrivals);
- ``pricing``: time to first token of a request on a node from kvtier's cost-model profiles
  (kvtier/planning/profiles.py): tier reloads, host-to-device assembly, prefill compute;
- ``node``: one node's GPU prefix cache, kvtier RAM and disk tiers and its prefill queue;
  ``shared``: the S3 tier every node reaches;
- ``events``: the KV-event stream from nodes to an event-fed router's index, with delay, loss and
  indexer restarts as knobs;
- ``approx_tree``: vllm-router's approximate prefix tree (what it sent where);
- ``policies``: the routing policies compared, one module each (``kvtier_index``: kvtier's rule
  on a shared event-fed index instead of ``Locate``, run only when named);
- ``simulator``: the event loop; ``report``: per-run results, the table and the plot;
  ``options``: the command line of ``--simulate``.

Nothing here runs an engine: the figures are a model, priced by the profiles' numbers.
"""
