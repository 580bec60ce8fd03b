"""A request that stops waiting for ``Locate`` (kvtier/router/locate_budget.py): it goes on with
the answers that came within its budget; a node still asked then is not asked again until its call
ends, is judged then, by the deadline, as if the request had waited, and an answer that comes
after the budget still reaches the router.

Real daemons (``kvtier serve`` processes): one answers at once; one is frozen (SIGSTOP), for
good or until it is let go (SIGCONT) within the deadline.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator, Mapping

import pytest

from kvtier.router.cache_view import CacheView
from kvtier.router.metrics import RouterMetrics
from kvtier.security.policy import ROLE_ROUTER
from kvtier.server.fleet_view import OK, PENDING, UNAVAILABLE, FleetView, Member
from kvtier.server.locate import Located, LocateQuery
from storage_backends.grpc import GrpcTierConfig
from storage_backends.grpc_locate import GrpcLocateClient
from tests.helpers import freeze
from tests.integration.locate_rig import BT, DaemonProcess, deployment

DEADLINE_S = 1.0
BUDGET_S = 0.1
TOKENS = tuple(range(40_000, 40_000 + 2 * BT + 1))


def _fleet(a: DaemonProcess, b: DaemonProcess, token: str) -> FleetView:
    return FleetView([Member("a", a.address), Member("b", b.address)], lambda m: GrpcLocateClient(
        GrpcTierConfig(m.address, token, max_attempts=1, data_plane="tcp", name=m.name)), DEADLINE_S)


def _count(metrics: RouterMetrics) -> float:
    return metrics.locate_budget_ended._value.get()


@pytest.fixture(scope="module")
def daemons(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DaemonProcess, DaemonProcess, str]]:
    """Node a's and node b's daemons (b is let go after every test), and a router's token."""
    root = tmp_path_factory.mktemp("budget")
    da = deployment(root / "a", node="a", memory_bytes=1 << 20)
    db = deployment(root / "b", node="b", memory_bytes=1 << 20, like=da)
    a, b = DaemonProcess(da), DaemonProcess(db)
    try:
        yield a, b, da.token("fleet", "router", roles=(ROLE_ROUTER,))
    finally:
        a.stop()
        b.stop()


def test_a_request_goes_on_after_its_budget_and_the_frozen_node_is_judged_at_the_deadline(daemons) -> None:
    a, b, token = daemons
    metrics = RouterMetrics()

    async def run() -> None:
        view = CacheView(_fleet(a, b, token), metrics, probe_s=0.2)
        probes = asyncio.create_task(view.run_probes())
        try:
            assert set(await view.locate(TOKENS, "")) == {"a", "b"}  # both answer: connected, up
            # The fleet view's own reading: the frozen node is pending within the budget ...
            freeze(b.proc.pid)
            query = view.fleet.start(LocateQuery(tokens=TOKENS, local_only=True))
            early = await query.answer(BUDGET_S)
            assert [n.status for n in early.nodes] == [OK, PENDING]
            # ... and unavailable at the deadline.
            final = await query.final()
            assert [n.status for n in final.nodes] == [OK, UNAVAILABLE]
            assert final.nodes[1].elapsed_ms >= DEADLINE_S * 1e3

            t0 = time.monotonic()
            got = await view.locate(TOKENS, "", budget_s=BUDGET_S)
            waited = time.monotonic() - t0
            assert set(got) == {"a"} and waited < DEADLINE_S / 2, waited
            assert _count(metrics) == 1
            assert view.up("b")  # not judged by the budget ...
            # ... but in doubt until its call ends: the next request does not ask it.
            t0 = time.monotonic()
            assert set(await view.locate(TOKENS, "", budget_s=BUDGET_S)) == {"a"}
            assert time.monotonic() - t0 < BUDGET_S and _count(metrics) == 1
            await asyncio.sleep(DEADLINE_S)
            assert not view.up("b")  # ... but by its deadline, off the request's path
            assert view.up("a")

            # Control: without a budget the request waits for the deadline (b, being down, is not
            # asked: it is let go and the probe brings it back first).
            os.kill(b.proc.pid, signal.SIGCONT)
            for _ in range(100):
                if view.up("b"):
                    break
                await asyncio.sleep(0.1)
            assert view.up("b")
            freeze(b.proc.pid)
            t0 = time.monotonic()
            got = await view.locate(TOKENS, "")
            assert set(got) == {"a"} and time.monotonic() - t0 >= DEADLINE_S
            assert not view.up("b") and _count(metrics) == 1
        finally:
            os.kill(b.proc.pid, signal.SIGCONT)
            probes.cancel()
            await asyncio.gather(probes, return_exceptions=True)
            await view.close()

    asyncio.run(run())


def test_an_answer_after_the_budget_reaches_the_router_and_its_node_stays_up(daemons) -> None:
    a, b, token = daemons
    metrics = RouterMetrics()
    late: list[Mapping[str, Located]] = []

    async def run() -> None:
        view = CacheView(_fleet(a, b, token), metrics, probe_s=60)
        try:
            assert set(await view.locate(TOKENS, "")) == {"a", "b"}
            freeze(b.proc.pid)
            loop = asyncio.get_running_loop()
            loop.call_later(3 * BUDGET_S, os.kill, b.proc.pid, signal.SIGCONT)  # b answers, late
            got = await view.locate(TOKENS, "", budget_s=BUDGET_S, on_late=late.append)
            assert set(got) == {"a"} and _count(metrics) == 1
            for _ in range(int(DEADLINE_S / 0.05) + 20):
                if late:
                    break
                await asyncio.sleep(0.05)
            assert [set(m) for m in late] == [{"b"}]
            assert late[0]["b"].requested_blocks == 2  # its answer, for the same prompt
            assert view.up("b") and view.up("a")
            # Control: an answer within the budget is the request's own, and nothing comes late.
            got = await view.locate(TOKENS, "", budget_s=DEADLINE_S / 2, on_late=late.append)
            assert set(got) == {"a", "b"} and len(late) == 1 and _count(metrics) == 1
        finally:
            os.kill(b.proc.pid, signal.SIGCONT)
            await view.close()

    asyncio.run(run())
