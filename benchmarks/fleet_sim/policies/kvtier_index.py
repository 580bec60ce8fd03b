"""``kvtier_index``: kvtier's policy with a shared index in place of the scatter-gather ``Locate``.

Issue 30 asks for a fleet view without a home-made distributed system, and for a shared index
(Valkey/Redis or NATS JetStream) only if one is needed, chosen with numbers from this simulator.
This policy is that alternative, so the two can be run side by side: the same rule as ``kvtier``
(policies/kvtier.py: kvtier route's ``Chooser``, its view of what it sent each engine, the held
rule), but each node's answer is read from an index that the nodes' KV events keep, as a shared
index fed by the daemons' events would be, at ``index_s`` a lookup instead of ``locate_s``.

What the index knows is what the events say (benchmarks/fleet_sim/events.py): each node's RAM
and disk tiers (its GPU cache too when ``locate_gpu``, as for ``Locate``), never the shared S3
tier, and it goes stale under the run's staleness knobs, as llm-d's and Dynamo's indexes do. A
decision taken on the stale index that differs from the same policy's decision on a perfect one
is a misroute. It is not one of the issue's policies: ``--policies`` names it to run it, and the
verdicts never count it among the others (benchmarks/fleet_sim/report.py).
"""

from __future__ import annotations

import copy

from benchmarks.fleet_sim.events import BlockIndex
from benchmarks.fleet_sim.policies.base import Choice, PolicyContext, register
from benchmarks.fleet_sim.policies.kvtier import Kvtier
from benchmarks.fleet_sim.policies.prefix import leading_masks
from benchmarks.fleet_sim.pricing import DISK, GPU, RAM
from benchmarks.fleet_sim.requests import SimRequest
from kvtier.errors import ConfigError

#: Index media bits (events.MEDIUM_BIT) in the order a reload prefers them.
_GPU_BIT, _RAM_BIT, _DISK_BIT = 1, 2, 4


@register
class KvtierIndex(Kvtier):
    name = "kvtier_index"

    def __init__(self, ctx: PolicyContext) -> None:
        if ctx.view.locate_s3:
            raise ConfigError("kvtier_index cannot see the shared S3 tier (no event reports it as on a node): "
                              "compare it with kvtier without --locate-s3")
        super().__init__(ctx)
        self.decision_delay_s = ctx.index_s
        self._delay = self.decision_delay_s

    def answers(self, index: BlockIndex, req: SimRequest) -> list[list[int]]:
        """Per node, the tier the index says would serve each leading block, up to the first it
        does not hold: what ``FleetView.locate`` answers (``Node.locate``), read from ``index``.
        As there, the engine's GPU cache serves only its leading run of the prompt (with
        ``locate_gpu``); from the first block it lacks, RAM, else disk."""
        out: list[list[int]] = [[] for _ in range(len(self.view))]
        gpu = self.view.locate_gpu
        for node, masks in leading_masks(index, req.keys).items():
            tiers = out[node]
            in_gpu_run = gpu
            for m in masks:
                if in_gpu_run and m & _GPU_BIT:
                    tiers.append(GPU)
                    continue
                in_gpu_run = False
                if m & _RAM_BIT:
                    tiers.append(RAM)
                elif m & _DISK_BIT:
                    tiers.append(DISK)
                else:
                    break  # past the GPU's leading run, in its cache only: the engine cannot load it
        return out

    def choose(self, req: SimRequest, now: float) -> Choice:
        fast = self._held(req, now)
        if fast is not None:
            return fast
        self._delay = self.decision_delay_s
        channel = self.view.channel
        stale = self.answers(channel.index, req)
        true = self.answers(channel.truth, req)
        # The what-if runs first, on a copy: the real decision moves the chooser's rotation and rate.
        fresh = None if stale == true else self._decide(req, now, true, copy.deepcopy(self.chooser))
        node = self._decide(req, now, stale)
        return Choice(node, node if fresh is None else fresh, asked=True)
