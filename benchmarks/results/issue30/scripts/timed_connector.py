"""The kvtier vLLM connector with every scheduler- and worker-side call timed (fleet_inside.py).

Loaded by the engines in place of ``connectors.vllm_connector:KvtierConnector`` when
fleet_inside.py runs with ``TIMED=1``. Each process appends every call over ``SLOW_S`` to
``$TIMED_OUT.slow.<pid>`` (wall-clock time, method, milliseconds) as it happens, and writes its
totals (count, total, mean, max per method) to ``$TIMED_OUT.<pid>`` every 200 calls and at exit.
"""

from __future__ import annotations

import atexit
import collections
import functools
import os
import time
from collections.abc import Callable
from typing import Any

from connectors.vllm_connector import KvtierConnector

SLOW_S = 0.2
PATH = os.environ.get("TIMED_OUT", "/tmp/kvtier-timed")
_totals: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0])
_calls = [0]


def _dump() -> None:
    with open(f"{PATH}.{os.getpid()}", "w") as f:
        for name, (n, total, worst) in sorted(_totals.items(), key=lambda kv: -kv[1][1]):
            f.write(f"{name:34s} n {int(n):7d} total_ms {total * 1e3:10.2f} mean_ms {total * 1e3 / max(n, 1):8.3f} "
                    f"max_ms {worst * 1e3:8.2f}\n")


atexit.register(_dump)


def _timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            took = time.perf_counter() - t0
            entry = _totals[name]
            entry[0] += 1
            entry[1] += took
            entry[2] = max(entry[2], took)
            if took > SLOW_S:
                with open(f"{PATH}.slow.{os.getpid()}", "a") as f:
                    f.write(f"{time.strftime('%H:%M:%S')} {name} {took * 1e3:.1f} ms\n")
            _calls[0] += 1
            if _calls[0] % 200 == 0:
                _dump()

    return call


class TimedConnector(KvtierConnector):
    """KvtierConnector, every method below timed."""


for _name in ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
              "update_connector_output", "take_events", "request_finished", "start_load_kv", "wait_for_layer_load",
              "save_kv_layer", "wait_for_save", "get_finished", "get_kv_connector_stats",
              "get_block_ids_with_load_errors", "bind_connector_metadata", "clear_connector_metadata"):
    if hasattr(KvtierConnector, _name):
        setattr(TimedConnector, _name, _timed(_name, getattr(KvtierConnector, _name)))
