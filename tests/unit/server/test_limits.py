"""Admission limits: in-flight byte budget, concurrency, and the deadline reaper."""

from __future__ import annotations

import threading
import time

import pytest

from kvtier.errors import Overloaded
from kvtier.server.limits import ByteBudget, ConcurrencyLimit, DeadlineReaper, share


def test_budget_per_client_and_global() -> None:
    b = ByteBudget(limit=100, per_client=60)
    a1 = b.lease("a")
    a1.reserve(50)
    with pytest.raises(Overloaded, match="per-client"):
        b.lease("a").reserve(20)  # a second call of the same client shares its share
    c = b.lease("c")
    with pytest.raises(Overloaded, match="server in-flight"):
        c.reserve(60)
    c.reserve(50)
    assert b.in_flight == 100 and b.held_by("a") == 50 and b.refused == 2
    a1.release(20)
    assert b.in_flight == 80
    a1.close()
    a1.close()  # idempotent
    c.close()
    assert b.in_flight == 0 and b.held_by("a") == 0 and b.held_by("c") == 0
    with pytest.raises(Overloaded):
        a1.reserve(1)  # a finished call cannot take more


def test_lease_close_from_another_thread_returns_everything() -> None:
    b = ByteBudget(limit=1 << 20, per_client=1 << 20)
    leases = [b.lease(f"c{i % 3}") for i in range(30)]
    for lease in leases:
        lease.reserve(1000)
    threads = [threading.Thread(target=lease.close) for lease in leases]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert b.in_flight == 0


def test_concurrency_limit() -> None:
    lim = ConcurrencyLimit(2)
    lim.try_enter()
    lim.try_enter()
    with pytest.raises(Overloaded):
        lim.try_enter()
    lim.exit()
    lim.try_enter()
    assert lim.active == 2 and lim.refused == 1


def test_concurrency_limit_per_tenant_and_principal() -> None:
    lim = ConcurrencyLimit(6, per_tenant=3, per_principal=2)
    lim.try_enter("acme", "acme/alice")
    lim.try_enter("acme", "acme/alice")
    with pytest.raises(Overloaded, match="principal acme/alice"):
        lim.try_enter("acme", "acme/alice")  # however many tokens alice holds
    lim.try_enter("acme", "acme/bob")
    with pytest.raises(Overloaded, match="tenant acme"):
        lim.try_enter("acme", "acme/carol")
    lim.try_enter("globex", "globex/dave")  # another tenant is served
    assert lim.active == 4 and lim.refused == 2 and lim.held_by("acme") == 3 and lim.held_by(principal="acme/bob") == 1
    lim.exit("acme", "acme/alice")
    lim.try_enter("acme", "acme/carol")  # a slot of the tenant came back
    for who in ("acme/alice", "acme/bob", "acme/carol"):
        lim.exit("acme", who)
    lim.exit("globex", "globex/dave")
    assert lim.active == 0 and lim.held_by("acme") == 0 and lim.held_by("globex") == 0


def test_share_defaults_to_a_fraction_and_never_exceeds_the_total() -> None:
    assert share(256, 0, 2) == 128 and share(256, 0, 4) == 64 and share(3, 0, 4) == 1
    assert share(16, 6, 2) == 6 and share(16, 40, 2) == 16


def test_reaper_cancels_only_overdue_calls() -> None:
    reaper = DeadlineReaper(slack_s=0.0)
    fired: list[str] = []
    try:
        now = time.monotonic()
        reaper.watch(now + 0.05, lambda: fired.append("late"))
        done = reaper.watch(now + 0.05, lambda: fired.append("finished in time"))
        reaper.done(done)
        reaper.watch(now + 60, lambda: fired.append("far"))
        end = time.monotonic() + 5
        while not fired and time.monotonic() < end:
            time.sleep(0.01)
        time.sleep(0.1)
        assert fired == ["late"] and reaper.reaped == 1
    finally:
        reaper.close()
