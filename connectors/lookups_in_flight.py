"""Scheduler-side lookups off vLLM's scheduling step.

vLLM asks the connector how much of a waiting request's prompt it can load
(``get_num_new_matched_tokens``) from inside ``schedule()``: while that call waits for the
cache (a daemon's Lookup, which may probe S3), no request of the engine is scheduled, and a
lookup that took 200-570 ms on a busy host stalled every request in the batch. vLLM's answer
``None`` means "not known yet, ask me again at a later step": the scheduler skips that request
only. So each request's lookup runs in a small pool; the call waits at most ``inline_wait_s``
for it (a usual lookup is then answered in the same step, as a blocking call would be) and
otherwise answers ``None`` until the lookup is done.

Protocol (scheduler thread only): ``ask(request_id, fn)`` per call of
``get_num_new_matched_tokens`` -> ``fn``'s result once it is done (its exception re-raised), or
None while it runs -> ``forget(request_id)`` when the request finishes (an answer not yet taken
is dropped) -> ``close()``.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Generic, TypeVar

T = TypeVar("T")


class LookupsInFlight(Generic[T]):
    """One lookup in flight per request id (module docstring). ``fn`` must not return None."""

    def __init__(self, workers: int, inline_wait_s: float) -> None:
        assert workers >= 1 and inline_wait_s >= 0
        self.inline_wait_s = inline_wait_s
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvtier-lookup")
        self._pending: dict[str, Future[T]] = {}

    def ask(self, request_id: str, fn: Callable[[], T]) -> T | None:
        fut = self._pending.get(request_id)
        if fut is None:
            fut = self._pending[request_id] = self._pool.submit(fn)
            wait([fut], timeout=self.inline_wait_s)  # returns on success or failure alike
        if not fut.done():
            return None
        del self._pending[request_id]
        out = fut.result()
        assert out is not None, "a lookup's result must not be None (vLLM reads None as 'not yet')"
        return out

    def forget(self, request_id: str) -> None:
        fut = self._pending.pop(request_id, None)
        if fut is not None:
            fut.cancel()

    def __len__(self) -> int:
        return len(self._pending)

    def close(self) -> None:
        self._pending.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)
