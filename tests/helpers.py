"""Test data builders shared by the suites (real layouts, real keys, random payloads)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

import torch

from kvtier.block import Block
from kvtier.keys import DomainDeriver, Scope, Segment, block_chain
from kvtier.layout import KVLayout

SECRET = b"test-server-secret-0123456789abcdef"
DERIVER = DomainDeriver(SECRET)
SMALL = KVLayout("test-model", num_layers=2, num_kv_heads=2, head_dim=8, dtype="bfloat16", block_tokens=4)


def chain_blocks(
    n: int,
    *,
    layout: KVLayout = SMALL,
    scope: Scope | None = None,
    seed: int = 0,
    token_base: int = 0,
) -> list[Block]:
    """``n`` chained blocks of one request; payload bytes are a function of ``seed`` and position."""
    tokens = [token_base + i for i in range(n * layout.block_tokens)]
    chain = block_chain(layout, [Segment(tokens, scope or Scope.public())], DERIVER)
    gen = torch.Generator().manual_seed(seed)
    out = []
    for c in chain:
        data = torch.randn(layout.block_shape, generator=gen).to(layout.torch_dtype)
        out.append(Block.build(layout, c.key, c.domain, data, parent=c.parent, index=c.index))
    return out


def same_bytes(a: Block, b: Block) -> bool:
    return a.equal_bytes(b)


def wait_for(cond: Callable[[], bool], timeout: float = 10.0, every_s: float = 0.02) -> bool:
    """Poll ``cond`` until it holds or ``timeout`` passes; its last answer (for background work)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(every_s)
    return cond()


def _state(pid: int, tid: int) -> str | None:
    """A thread's state letter from /proc (None: it is gone)."""
    try:
        with open(f"/proc/{pid}/task/{tid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return None


def _threads_stopped(pid: int) -> bool:
    """Whether every thread of ``pid`` is stopped (state T), ended, or the process is gone."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return True
    return all(_state(pid, int(tid)) in (None, "T", "t", "Z", "X") for tid in tids)


def _group(pgid: int) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.getpgid(int(name)) == pgid:
                    out.append(int(name))
            except ProcessLookupError:
                pass
    return out


def freeze(pid: int, *, group: bool = False, timeout_s: float = 10.0) -> None:
    """SIGSTOP ``pid`` (with ``group``, its process group) and return once every thread has
    stopped. The kernel stops a process when the thread that takes the signal next runs; one
    waiting for a CPU on a loaded host (or in an uninterruptible wait) holds the stop off while the
    other threads go on serving: in CI a daemon frozen this way answered ``Locate`` 7 ms after the
    signal. A process that died instead is an error here, not a freeze."""
    if group:
        os.killpg(pid, signal.SIGSTOP)
    else:
        os.kill(pid, signal.SIGSTOP)
    pids = _group(pid) if group else [pid]
    assert wait_for(lambda: all(_threads_stopped(p) for p in pids), timeout_s, every_s=0.005), \
        f"process {pid} not stopped {timeout_s} s after SIGSTOP"
    state = _state(pid, pid)
    assert state in ("T", "t"), f"process {pid} is {state or 'gone'} after SIGSTOP, not stopped"


class ManualClock:
    """A clock a test moves by hand (``clock.now += 5``): pass it where code takes ``clock=``."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def refused_on_the_wire(address: str, token: str, **config: object) -> bool:
    """Whether the daemon at ``address`` turns the holder of ``token`` away (an access check
    failed or the credential is no longer valid), as an engine's tier meets it: one Contains call.
    ``config``: more of the tier's settings (``max_attempts=1``: no retries). Any other failure is
    raised."""
    from kvtier.errors import AccessDenied, AuthError
    from storage_backends.grpc import GrpcTier
    from storage_backends.grpc_config import GrpcTierConfig

    tier = GrpcTier(GrpcTierConfig(address, token, **config))  # type: ignore[arg-type]
    try:
        tier.contains([chain_blocks(1)[0].key])
        return False
    except (AccessDenied, AuthError):
        return True
    finally:
        tier.close()
