"""Start-up objects out of full collections (kvtier/gc_freeze.py), in a fresh interpreter: freezing
is process-wide, and a frozen cycle stays until ``gc.unfreeze()``."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

SCRIPT = textwrap.dedent("""
    import gc, weakref
    from kvtier.gc_freeze import freeze_start_up_objects

    class Node:
        pass

    def cycle():
        a, b = Node(), Node()
        a.other, b.other = b, a
        return weakref.ref(a)

    gc.disable()  # no collection but the ones below
    assert gc.get_freeze_count() == 0
    start_up_garbage = cycle()
    frozen = freeze_start_up_objects()
    assert frozen > 0 and gc.get_freeze_count() == frozen
    assert start_up_garbage() is None, "garbage left at start-up became permanent"
    # Control: freezing without the collection first keeps a dropped cycle alive for good.
    kept = cycle()
    gc.freeze()
    gc.collect()
    assert kept() is not None
    # What start-up froze is skipped from then on; what comes after is still collected.
    later = cycle()
    gc.collect()
    assert later() is None
    print("ok", frozen)
""")


def test_start_up_garbage_is_collected_and_the_rest_frozen() -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok ")
