"""A frozen daemon, seen from an engine's side of it (``kvtier serve`` as a real process, SIGSTOP):
one call waits out its deadline, then calls fail at once until a probe finds the daemon again
(``kvtier.daemon_hold_off_s``, storage_backends/circuit_breaker.py). Without the hold-off
(the control) every call waits its deadline, which is what each request of an engine beside a
frozen daemon would pay."""

from __future__ import annotations

from pathlib import Path

import torch

from benchmarks.localdeploy import LocalDeployment
from connectors.provision import DaemonSource, _daemon_root
from kvtier.keys import Scope
from kvtier.layout import KVLayout
from kvtier.store.layer_sink import LayerSink
from storage_backends.circuit_breaker import BreakerState
from tests.helpers import SECRET, chain_blocks, wait_for
from tests.integration.route_rig import daemon as daemon_process

MID = KVLayout("hold-off-test", num_layers=2, num_kv_heads=2, head_dim=64, dtype="bfloat16", block_tokens=16)
DEADLINE_S = 1.0
HOLD_OFF_S = 2.0
WARM_UP_DEADLINE_S = 30.0


class Layers(LayerSink):
    """Counts the layers a read hands over (a worker's layer-by-layer load)."""

    def take(self, index: int, positions: tuple[int, ...], rows: torch.Tensor | None) -> None:
        pass


def _source(dep: LocalDeployment, address: str, tmp_path: Path, hold_off_s: float,
            deadline_s: float = DEADLINE_S) -> DaemonSource:
    tok = tmp_path / "engine.token"
    tok.write_text(dep.token("kvtier", "engine", roles=("engine",)))
    tok.chmod(0o600)
    return DaemonSource(_daemon_root({"daemon": address, "daemon_token_file": str(tok), "data_plane": "auto",
                                      "daemon_timeout_s": deadline_s, "daemon_hold_off_s": hold_off_s}), MID)


def test_a_frozen_daemon_costs_one_call_its_deadline_and_is_asked_again_once_it_answers(tmp_path: Path) -> None:
    dep = LocalDeployment(tmp_path / "d", server_secret=SECRET)
    dep.write_config(memory_bytes=64 << 20)
    proc = daemon_process(dep, "daemon")
    salt = dep.salt("acme", "alice")
    sources = {hold: _source(dep, proc.address, tmp_path, hold) for hold in (0.0, HOLD_OFF_S)}
    blocks = chain_blocks(3, layout=MID, scope=Scope.user("acme/alice"))
    keys = [b.key for b in blocks]
    try:
        # The daemon's first put on a shared-memory link (its first decryption, its first region
        # read) can outlast the short deadline on a loaded machine; it is made, with another
        # engine's generous deadline, before the calls this test counts.
        warm = _source(dep, proc.address, tmp_path, 0.0, WARM_UP_DEADLINE_S)
        try:
            other = chain_blocks(3, layout=MID, scope=Scope.user("acme/alice"), token_base=10_000)
            assert len(warm.client_for(salt).put(other, degrade=False).stored) == 3
        finally:
            warm.close()
        clients = {hold: src.client_for(salt) for hold, src in sources.items()}  # the salts resolved
        assert list(clients[HOLD_OFF_S].put(blocks, degrade=False).stored) == keys
        for c in clients.values():
            assert c.lookup(keys).length == 3
        sink = Layers(MID.num_layers)
        assert all(b is not None for b in clients[HOLD_OFF_S].get_layers(keys, sink))
        assert sink.delivered == MID.num_layers  # through the shared-memory region, layer by layer
        proc.freeze()
        try:
            for c in clients.values():
                for _ in range(4):
                    assert c.lookup(keys).length == 0  # a miss, never an exception
                assert c.get(keys) == [None] * 3
                assert c.put(blocks).rejected == keys
            # A layer-by-layer read held off: nothing laid out, no layer handed over, all misses.
            sink = Layers(MID.num_layers)
            assert clients[HOLD_OFF_S].get_layers(keys, sink) == [None] * 3 and sink.delivered == 0
        finally:
            proc.thaw()
        # The control waited out every call's deadline; with the hold-off only the first call did,
        # the rest failed at once (the window outlasts the calls that follow the first).
        assert sources[0.0].errors() == {"timeout": 6, "dropped_put": 3}
        assert sources[HOLD_OFF_S].errors() == {"timeout": 1, "held_off": 6, "dropped_put": 3}
        breaker = clients[HOLD_OFF_S].breaker
        assert breaker is not None and breaker.state is BreakerState.OPEN and breaker.opened_count == 1
        assert clients[0.0].breaker is None
        # Thawed: once the window has passed, a call probes, finds the daemon, and calls go through.
        assert wait_for(lambda: clients[HOLD_OFF_S].lookup(keys).length == 3, timeout=15, every_s=0.2)
        assert breaker.state is BreakerState.CLOSED
        assert [b is not None for b in clients[HOLD_OFF_S].get(keys)] == [True] * 3
        assert clients[0.0].lookup(keys).length == 3
    finally:
        for src in sources.values():
            src.close()
        proc.stop()
