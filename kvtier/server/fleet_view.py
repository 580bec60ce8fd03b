"""The fleet view: one Locate scattered to every node's daemon and gathered within a deadline.

No distributed state of its own: each daemon answers for what it holds (kvtier/server/locate.py)
and this view asks them all at once. Membership is a list of named addresses, from a TOML file
(``read_members``), a flag (``parse_members``), or a Kubernetes Service's endpoints
(kvtier/server/k8s_membership.py; the caller refreshes it through ``set_members``). A node that
does not answer within the deadline (stopped, frozen, partitioned) is reported ``unavailable``
with the reason, never dropped, so a router can tell "no cache there" from "no answer from there".

The calls to every node are in flight at once on the caller's event loop, with no thread in
between: a router asks on most requests' path, on cores its engines keep busy, where each hand-over
from the loop to a thread and back cost it more than the daemons took to answer.

Protocol: ``FleetView(members, connect, deadline_s)`` builds one client per member (``connect``:
a kvtier daemon client with an async ``locate`` method, e.g. storage_backends' GrpcLocateClient,
found by the caller through the backend registry; it opens its channel on first use) ->
``await locate(query)`` any number of times, and ``await set_members(...)`` when the membership
changes, all from one event loop -> ``await close()``.

Membership file::

    deadline_ms = 300            # optional; a flag may override it
    [nodes]
    node-a = "10.0.0.11:7070"
    node-b = "10.0.0.12:7070"
"""

from __future__ import annotations

import asyncio
import re
import time
import tomllib
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from kvtier.errors import AccessDenied, ConfigError, KvtierError, TierUnavailable
from kvtier.rpc import kvtier_pb2 as pb
from kvtier.server.config import host_port
from kvtier.server.locate import Located, LocateQuery, SharedShare
from kvtier.server.locate_wire import located_from_msg, located_json, query_to_msg

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
#: What a node's answer was: its Locate, or why there is none (``skipped``: the caller left it out;
#: ``pending``: still asked when the caller stopped waiting, before the deadline).
OK, UNAVAILABLE, REFUSED, ERROR, SKIPPED, PENDING = "ok", "unavailable", "refused", "error", "skipped", "pending"


class LocateClient(Protocol):
    async def locate(self, request: bytes, *, timeout_s: float | None = None) -> pb.LocateResponse:
        """``request``: a serialized ``LocateRequest`` (the same bytes for every member)."""
        ...

    async def close(self) -> None: ...


@dataclass(slots=True, frozen=True)
class Member:
    """A node of the fleet: its name in answers and its daemon's gRPC address."""

    name: str
    address: str

    def __post_init__(self) -> None:
        if not _NAME.fullmatch(self.name):
            raise ConfigError(f"node name {self.name!r}: 1-63 letters, digits and ._- "
                              "(starting with a letter or digit)")
        complaint = host_port(self.address)
        if complaint is not None:
            raise ConfigError(f"node {self.name}: address {complaint}")


def parse_members(specs: Sequence[str]) -> list[Member]:
    """Members from ``NAME=HOST:PORT`` strings (a flag's values)."""
    out = []
    for spec in specs:
        name, sep, address = spec.partition("=")
        if not sep:
            raise ConfigError(f"--node {spec!r}: expected NAME=HOST:PORT")
        out.append(Member(name.strip(), address.strip()))
    return _unique(out)


def read_members(path: str | Path) -> tuple[list[Member], float | None]:
    """Members and the optional ``deadline_ms`` (as seconds) of a membership file (module docstring)."""
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text())
    except OSError as exc:
        raise ConfigError(f"membership file {p}: cannot read ({exc.strerror})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"membership file {p}: invalid TOML: {exc}") from None
    unknown = sorted(set(data) - {"nodes", "deadline_ms"})
    if unknown:
        raise ConfigError(f"membership file {p}: unknown field(s) {unknown}; known: deadline_ms, [nodes]")
    nodes = data.get("nodes")
    if not isinstance(nodes, dict) or not nodes:
        raise ConfigError(f"membership file {p}: [nodes] must map each node's name to its host:port")
    members = []
    for name, address in nodes.items():
        if not isinstance(address, str):
            raise ConfigError(f"membership file {p}: nodes.{name} must be a \"host:port\" string")
        members.append(Member(name, address))
    deadline = data.get("deadline_ms")
    if deadline is not None and (isinstance(deadline, bool) or not isinstance(deadline, int | float)
                                 or not deadline > 0):
        raise ConfigError(f"membership file {p}: deadline_ms must be a positive number")
    return _unique(members), None if deadline is None else float(deadline) / 1e3


def _unique(members: list[Member]) -> list[Member]:
    names = [m.name for m in members]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ConfigError(f"node names must be unique; repeated: {dupes}")
    return members


@dataclass(slots=True, frozen=True)
class NodeAnswer:
    """One node's part of a fleet answer: ``located`` when ``status`` is ``ok``, else ``reason``."""

    member: Member
    status: str
    elapsed_ms: float
    located: Located | None = None
    reason: str = ""

    def json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"status": self.status, "address": self.member.address,
                               "elapsed_ms": round(self.elapsed_ms, 3)}
        if self.located is not None:
            out["answer"] = located_json(self.located)
        else:
            out["reason"] = self.reason
        return out


@dataclass(slots=True, frozen=True)
class FleetAnswer:
    """Every member's answer, in membership order."""

    nodes: tuple[NodeAnswer, ...]
    deadline_ms: float

    def answered(self) -> list[NodeAnswer]:
        return [n for n in self.nodes if n.located is not None]

    def best(self) -> NodeAnswer | None:
        """The answering node with the lowest predicted time to first token (first on ties)."""
        ok = self.answered()
        return min(ok, key=lambda n: n.located.ttft_ms) if ok else None  # type: ignore[union-attr]

    def shared(self) -> SharedShare | None:
        """What the shared tier holds, as the answering nodes saw it (the longest prefix, then the
        cheapest): every node reaches the same bucket, so they differ only by timing."""
        seen = [n.located.shared for n in self.answered() if n.located is not None and n.located.shared is not None]
        return min(seen, key=lambda s: (-s.blocks, s.ttft_ms)) if seen else None

    def json(self) -> dict[str, Any]:
        best, shared = self.best(), self.shared()
        return {
            "deadline_ms": self.deadline_ms,
            "best": None if best is None else best.member.name,
            "shared": None if shared is None else {"tier": shared.tier, "blocks": shared.blocks,
                                                   "ttft_ms": shared.ttft_ms},
            "nodes": {n.member.name: n.json() for n in self.nodes},
        }


@dataclass(slots=True, frozen=True)
class _Outcome:
    """One member's call, as it ended: its answer or the failure it reported, and when."""

    msg: pb.LocateResponse | None
    failure: KvtierError | None
    elapsed_ms: float


class FleetQuery:
    """One fleet Locate in flight (``FleetView.start``): ``answer(within_s)`` reads what has come
    so far, as often as wanted; ``final()`` waits for the rest until the deadline. A router that
    stops waiting early decides on the first and judges the nodes by the second.

    Invariants: every call ends by the deadline (its own timeout is what is left of it) or is
    cancelled; an answer names every member, ``pending`` only before the deadline.
    """

    def __init__(self, members: tuple[Member, ...], calls: tuple[asyncio.Task[_Outcome] | None, ...],
                 t0: float, deadline_s: float) -> None:
        self._members = members
        self._calls = calls
        self._asked = [c for c in calls if c is not None]
        self.t0 = t0
        self.deadline_s = deadline_s

    async def answer(self, within_s: float) -> FleetAnswer:
        """What came within ``within_s`` of the start; a member still asked is ``pending``
        (``within_s`` at or past the deadline: the final answer)."""
        if within_s >= self.deadline_s:
            return await self.final()
        await self._wait(within_s)
        return self._read(final=False)

    async def final(self) -> FleetAnswer:
        """Every member's answer: a member that did not answer within the deadline is
        ``unavailable`` (its call is cancelled)."""
        await self._wait(self.deadline_s)
        return self._read(final=True)

    def cancel(self) -> None:
        """Stop every call still in flight (the caller will not read this query again)."""
        for c in self._asked:
            if not c.cancel() and not c.cancelled():
                c.exception()  # read: a failure nobody waits for is not an unretrieved exception

    async def _wait(self, until_s: float) -> None:
        pending = [c for c in self._asked if not c.done()]
        left = until_s - (time.monotonic() - self.t0)
        if not pending or left <= 0:
            return
        try:
            await asyncio.wait(pending, timeout=left)
        except BaseException:  # the caller was cancelled: so are its calls, and their outcomes are read
            self.cancel()
            raise

    def _read(self, *, final: bool) -> FleetAnswer:
        out = []
        now_ms = (time.monotonic() - self.t0) * 1e3
        for m, c in zip(self._members, self._calls, strict=True):
            if c is None:
                out.append(NodeAnswer(m, SKIPPED, 0.0, reason="not asked (left out by the caller)"))
                continue
            if not c.done():
                if not final:
                    out.append(NodeAnswer(m, PENDING, now_ms, reason=f"no answer yet after {now_ms:.0f} ms "
                                          f"(deadline {self.deadline_s * 1e3:g} ms)"))
                    continue
                c.cancel()
                out.append(NodeAnswer(m, UNAVAILABLE, now_ms,
                                      reason=f"no answer within the deadline ({self.deadline_s * 1e3:g} ms)"))
                continue
            if c.cancelled():  # only by ``cancel``, after which nobody reads: not an answer
                out.append(NodeAnswer(m, UNAVAILABLE, now_ms, reason="cancelled by the caller"))
                continue
            got = c.result()  # raises a bug's exception: not a node's answer
            if got.failure is not None:
                out.append(NodeAnswer(m, _status(got.failure), got.elapsed_ms, reason=str(got.failure)))
            else:
                assert got.msg is not None
                out.append(NodeAnswer(m, OK, got.elapsed_ms, located=located_from_msg(got.msg)))
        return FleetAnswer(tuple(out), self.deadline_s * 1e3)


class FleetView:
    """Scatter-gather Locate over a membership, fixed or replaced by ``set_members`` (module docstring).

    Invariants: one client per member; a query waits at most the deadline (plus scheduling), and
    every member of the membership it started with appears in its answer. Event-loop only: the
    clients belong to the loop of their first call, and a query reads the membership once, as it
    starts, so ``set_members`` never changes what a query in flight reports.
    """

    def __init__(self, members: Sequence[Member], connect: Callable[[Member], LocateClient],
                 deadline_s: float) -> None:
        if not members:
            raise ConfigError("a fleet view needs at least one node")
        if not deadline_s > 0:
            raise ConfigError("the fleet view's deadline must be positive")
        self.deadline_s = deadline_s
        self._connect = connect
        self._retired: list[LocateClient] = []
        # (member, client) pairs, replaced as a whole by set_members: a query reads one snapshot.
        self._nodes: tuple[tuple[Member, LocateClient], ...] = tuple((m, connect(m)) for m in _unique(list(members)))

    @property
    def members(self) -> list[Member]:
        return [m for m, _ in self._nodes]

    async def set_members(self, members: Sequence[Member]) -> tuple[list[str], list[str]]:
        """Adopt a new membership (a refreshed source): a client is opened for each new member (or
        one whose address changed), and the clients of members gone are closed at the next call or
        at ``close`` (by then every query that could use them is past its deadline). Returns the
        names (added, removed); a member whose address changed is in both."""
        if not members:
            raise ConfigError("a fleet view needs at least one node")
        members = _unique(list(members))
        retired, self._retired = self._retired, []
        await _close_all(retired)
        old = {m.name: (m, c) for m, c in self._nodes}
        nodes: list[tuple[Member, LocateClient]] = []
        added: list[str] = []
        removed = sorted(old.keys() - {m.name for m in members})
        for m in members:
            kept = old.pop(m.name, None)
            if kept is not None and kept[0] == m:
                nodes.append(kept)
                continue
            if kept is not None:  # the same name at another address
                self._retired.append(kept[1])
                removed.append(m.name)
            nodes.append((m, self._connect(m)))
            added.append(m.name)
        self._retired.extend(c for _, c in old.values())
        self._nodes = tuple(nodes)
        return added, sorted(removed)

    async def locate(self, query: LocateQuery, only: Collection[str] | None = None) -> FleetAnswer:
        """Every member's answer; with ``only``, the members not named there are not asked and are
        reported ``skipped`` (a router leaves out the nodes it knows to be down, so that a frozen one
        does not cost every request the deadline)."""
        return await self.start(query, only).final()

    def start(self, query: LocateQuery, only: Collection[str] | None = None) -> FleetQuery:
        """The query in flight to every member (or those in ``only``), from now: read it with
        ``FleetQuery.answer`` and ``final`` (a caller that will not wait for the deadline)."""
        # Serialized once for every member (a long prompt's token ids take milliseconds each time).
        request = query_to_msg(query).SerializeToString()
        t0 = time.monotonic()
        nodes = self._nodes
        calls: list[asyncio.Task[_Outcome] | None] = [
            asyncio.ensure_future(self._ask(client, request, t0)) if only is None or m.name in only else None
            for m, client in nodes]
        return FleetQuery(tuple(m for m, _ in nodes), tuple(calls), t0, self.deadline_s)

    async def _ask(self, client: LocateClient, request: bytes, t0: float) -> _Outcome:
        # The call's own deadline is what is left of the fleet's: a late answer is not waited for.
        left = self.deadline_s - (time.monotonic() - t0)
        try:
            if left <= 0:
                raise TierUnavailable("no time left before the deadline")
            msg = await client.locate(request, timeout_s=left)
        except KvtierError as exc:  # the node's answer (or its absence); anything else is a bug
            return _Outcome(None, exc, (time.monotonic() - t0) * 1e3)
        return _Outcome(msg, None, (time.monotonic() - t0) * 1e3)

    async def close(self) -> None:
        retired, self._retired = self._retired, []
        await _close_all([c for _, c in self._nodes] + retired)


async def _close_all(clients: Sequence[LocateClient]) -> None:
    await asyncio.gather(*(c.close() for c in clients))


def _status(exc: KvtierError) -> str:
    if isinstance(exc, TierUnavailable):  # unreachable, deadline exceeded, shutting down
        return UNAVAILABLE
    if isinstance(exc, AccessDenied):  # credential, role, revoked principal, miss limit
        return REFUSED
    return ERROR  # bad input, no [locate] section: the same on every node
