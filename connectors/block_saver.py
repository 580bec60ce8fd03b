"""BlockSaver: stores the blocks of a step's save jobs on a thread of its own, off the step.

The worker's ``wait_for_save`` hands over host blocks whose pages have already left vLLM's memory
(so vLLM may reuse the blocks at once); storing them (encryption, a daemon round trip) then runs
here while the engine computes the next step. The queue is bounded: when saves fall behind, the
step waits at ``submit`` (counted as ``save_backpressure``) rather than holding ever more memory.
"""

from __future__ import annotations

import queue
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

SaveFn = Callable[[Any, list[Any]], Counter[str]]


class BlockSaver:
    """One saver thread, started on first use.

    Invariants: ``pending`` counts jobs submitted and not yet stored; counters returned by
    ``save`` are added to ``stats`` under ``lock``; an exception escaping ``save`` (a bug) stops
    the thread and is raised on the submitting thread at the next ``submit`` or ``close``.
    """

    def __init__(self, save: SaveFn, lock: threading.Lock, stats: Counter[str], *, max_queued: int = 32,
                 on_done: Callable[[], None] | None = None) -> None:
        self._save = save
        self._lock = lock
        self._stats = stats
        self._on_done = on_done
        self._queue: queue.Queue[tuple[Any, list[Any], Callable[[], None] | None] | None] = \
            queue.Queue(maxsize=max_queued)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._pending = 0

    @property
    def pending(self) -> int:
        with self._lock:
            return self._pending

    def submit(self, job: Any, tensors: list[Any], release: Callable[[], None] | None = None) -> None:
        """Queue ``job``; ``release`` (if any) is called once it was stored or given up on: the
        tensors' memory (a slice of the daemon's region, say) may then be reused."""
        try:
            self._raise_error()
        except BaseException:
            if release is not None:
                release()
            raise
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvtier-vllm-save", daemon=True)
            self._thread.start()
        with self._lock:
            self._pending += 1
            if self._queue.full():
                self._stats["save_backpressure"] += 1
        self._queue.put((job, tensors, release))

    def flush(self) -> None:
        """Wait until every submitted job has been stored."""
        if self._thread is not None:
            self._queue.join()
        self._raise_error()

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
        self._raise_error()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                job, tensors, release = item
                try:
                    counts = self._save(job, tensors)
                finally:
                    if release is not None:
                        release()
                with self._lock:
                    self._stats.update(counts)
                    self._pending -= 1
                if self._on_done is not None:
                    self._on_done()
            except BaseException as exc:  # a bug: surfaces on the submitting thread
                with self._lock:
                    self._error = exc
                return
            finally:
                self._queue.task_done()

    def _raise_error(self) -> None:
        with self._lock:
            exc, self._error = self._error, None
        if exc is not None:
            raise exc
