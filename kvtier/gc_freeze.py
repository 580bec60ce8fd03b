"""A long-lived server's start-up objects, kept out of the garbage collector's full passes.

A full (generation 2) collection walks every tracked object. ``kvtier serve`` and ``kvtier route``
import torch, grpc and aiohttp (and the router a tokenizer): 190-320 thousand objects that live as
long as the process, which a full pass took 40 ms (daemon) and 60-78 ms (router) to walk on an idle
core, longer on a busy one. Allocation triggers those passes at any moment, so each stalled
whichever RPC or routed request was in flight: on the router's one event loop, every request.
``gc.freeze()`` moves what exists at the end of start-up to the permanent generation, which
collections skip (0.5 ms a pass after it). Reference counting still frees a frozen object; a
reference cycle among frozen objects is never collected (until ``gc.unfreeze()``), so only the
process's own entry point calls this, never a test suite calling ``run`` in process.
"""

from __future__ import annotations

import gc


def freeze_start_up_objects() -> int:
    """Collect once (start-up's garbage should not become permanent), then freeze what is left;
    the number of objects frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
