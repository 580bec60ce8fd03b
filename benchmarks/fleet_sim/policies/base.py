"""The routing-policy contract and the registry every policy joins.

Call order, per request (the simulator's): ``choose`` at arrival; ``routed`` with the node it went
to; ``first_token`` when its prefill ends on that node; ``finished`` when it leaves. A policy keeps
its own state (a tree, load counters, predictions) and reads the fleet only through ``FleetView``.

``choose`` answers the node, and, for a policy that decides on an index of the fleet's caches,
the node it would have chosen with that index up to date (``Choice.fresh``): the two differ when
stale information misrouted the request.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from benchmarks.fleet_sim.pricing import Pricer
from benchmarks.fleet_sim.requests import SimRequest
from benchmarks.fleet_sim.view import FleetView


@dataclass(slots=True, frozen=True)
class Choice:
    node: int
    fresh: int  # the same policy's choice on up-to-date information (== node when it had it)
    #: Seconds this decision took (None: the policy's ``decision_delay_s``).
    delay_s: float | None = None
    #: Whether it asked every node (``Locate``) or the shared index: kvtier's, where its held
    #: rule could not decide without.
    asked: bool = False


@dataclass(slots=True, frozen=True)
class PolicyContext:
    """What a policy is built with."""

    view: FleetView
    pricer: Pricer
    rng: np.random.Generator
    #: Seconds kvtier's scatter-gather ``Locate`` adds to each request it routes.
    locate_s: float = 0.0
    #: kvtier asks Locate for every request (``kvtier route --locate-every-request``).
    locate_every_request: bool = False
    #: Seconds one lookup in a shared index adds to each request ``kvtier_index`` routes by it.
    index_s: float = 0.0


class Policy(ABC):
    name: ClassVar[str] = ""
    #: Seconds between a request's arrival and its arrival at the chosen node (router work).
    decision_delay_s: float = 0.0

    def __init__(self, ctx: PolicyContext) -> None:
        self.view = ctx.view
        self.ctx = ctx

    @abstractmethod
    def choose(self, req: SimRequest, now: float) -> Choice: ...

    def routed(self, req: SimRequest, node: int, now: float) -> None:  # noqa: B027 - optional hook
        """The request was sent to ``node``."""

    def first_token(self, req: SimRequest, node: int, now: float) -> None:  # noqa: B027
        """The request's prefill ended on ``node``."""

    def finished(self, req: SimRequest, node: int, now: float) -> None:  # noqa: B027
        """The request left ``node``."""

    def tiebreak(self) -> list[float]:
        """One random number per node: ties go to the smallest (both of a Choice's decisions use
        the same draw, so a tie is never counted as a misroute)."""
        return self.ctx.rng.random(len(self.view)).tolist()


POLICIES: dict[str, type[Policy]] = {}


def register(cls: type[Policy]) -> type[Policy]:
    POLICIES[cls.name] = cls
    return cls


def argmin(values: list[float], tie: list[float]) -> int:
    return min(range(len(values)), key=lambda i: (values[i], tie[i]))


def argmax(values: list[float], tie: list[float]) -> int:
    return min(range(len(values)), key=lambda i: (-values[i], tie[i]))
