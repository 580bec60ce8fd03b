"""The fleet's members as `kvtier locate` and `kvtier route` are told them, read one way for both.

``--members FILE`` (the fleet view's membership file, kvtier/server/fleet_view.py), ``--members
k8s://NAMESPACE/SERVICE:PORT`` (a Service's ready endpoints, kvtier/server/k8s_membership.py), or
``--node NAME=HOST:PORT`` repeated. ``FleetMembers.source`` is the Kubernetes source, which a
long-running caller reads again (``kvtier route``); a one-shot caller (``kvtier locate``) reads it once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.errors import ConfigError
from kvtier.server.fleet_view import Member, parse_members, read_members
from kvtier.server.k8s_membership import ApiAccess, K8sEndpoints, is_k8s_source


@dataclass(slots=True, frozen=True)
class FleetMembers:
    members: tuple[Member, ...]
    #: The membership file's ``deadline_ms`` as seconds (None: it set none, or there is no file).
    deadline_s: float | None = None
    #: Where the members come from when they change (None: they are fixed).
    source: K8sEndpoints | None = None


def fleet_members(members: str | None, nodes: Sequence[str] | None, api: ApiAccess | None = None) -> FleetMembers:
    """The members named by ``--members`` or ``--node`` (exactly one of them given). ``api``: the
    Kubernetes API to ask (None: the pod's own, ``ApiAccess.in_cluster``). ConfigError for a bad
    file, flag or source, and for a Service with no ready endpoint; the source's own named
    errors (MembershipDenied, MembershipUnavailable) when the API refuses or cannot answer."""
    assert (members is None) != (not nodes), "exactly one of --members and --node"
    if members is not None and is_k8s_source(members):
        source = K8sEndpoints.parse(members, api)
        found = asyncio.run(source.fetch())
        if not found:
            raise ConfigError(f"--members {source.source}: the Service has no ready endpoint on that port")
        return FleetMembers(tuple(found), None, source)
    if members is not None:
        listed, deadline_s = read_members(members)
        return FleetMembers(tuple(listed), deadline_s)
    return FleetMembers(tuple(parse_members(list(nodes or ()))))
