"""An allocation cap for the current process: provoke a real out-of-memory error on a CPU.

A GPU has a fixed amount of memory; a CPU process normally has the whole machine's RAM and swap.
`memory_cap(limit)` makes the CPU behave like a small GPU: for the duration of the block, the
process may map at most `limit` more bytes of address space (RLIMIT_AS, counted from what it uses
when the block starts), so a batch that does not fit fails in torch's CPU allocator with
"DefaultCPUAllocator: can't allocate memory: you tried to allocate N bytes" — the same path a real
OOM takes. The triage then reports the request, the free and the total memory of the cap.

How much of the cap was in use when the allocation failed cannot be read afterwards: the failing
operation's intermediate tensors are freed while the error unwinds. So, while the cap is on, a
torch dispatch mode reads the address-space size before every tensor operation (one pread of
/proc/self/statm, microseconds) and names the operation; the process's VmPeak adds what the
failing operation itself had allocated before its last request.

Use it inside a training function (a launched rank), not in a notebook kernel: every thread of
the process shares the cap while it is on. Linux only (RLIMIT_AS and /proc).
"""
from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, Iterator

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class _Statm:
    """The process's address-space size, read cheaply (one pread of an open /proc file)."""

    def __init__(self) -> None:
        self.fd = os.open("/proc/self/statm", os.O_RDONLY)

    def vms(self) -> int:
        return int(os.pread(self.fd, 128, 0).split()[0]) * _PAGE

    @staticmethod
    def peak() -> int:
        """VmPeak: the highest address-space size the process ever had."""
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmPeak:"):
                    return int(line.split()[1]) * 1024
        return 0

    def close(self) -> None:
        os.close(self.fd)


def _watch_mode(statm: _Statm, state: dict) -> Any:
    """A TorchDispatchMode that records the address-space size before each operation."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func)
            if not name.startswith("profiler."):  # record_function markers allocate nothing
                state["vms"] = statm.vms()
                state["op"] = name
            return func(*args, **(kwargs or {}))

    return _Watch()


@contextlib.contextmanager
def memory_cap(limit_bytes: int) -> Iterator[dict]:
    """Within the block, allocations beyond `limit_bytes` (of new address space) fail.

    Yields a dict with `limit_bytes` and `base_bytes` (the address space in use at the start).
    On an error inside the block, the triage learns the cap, how much of it was in use just before
    the failing operation, and that operation (see gpu_lab.failures.explain.note), so its report can
    say "x free of <cap>".
    """
    import resource

    from ..failures import explain

    if isinstance(limit_bytes, bool) or not isinstance(limit_bytes, int) or limit_bytes <= 0:
        raise ValueError(f"memory_cap: limit_bytes must be an int > 0; got {limit_bytes!r}")
    statm = _Statm()
    torch = sys.modules.get("torch")
    if torch is not None:
        # start torch's intra-op thread pool now: a thread created under the cap takes its stack
        # from the cap, and one that cannot be created aborts the process instead of raising
        torch.ones(1 << 18).add_(1).sum()
        # the dispatch mode below makes torch import torch._dynamo on its first operation (tens
        # of MB of address space, and a MemoryError under the cap): import it now
        import torch._dynamo  # noqa: F401
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    base = statm.vms()
    new = base + limit_bytes
    if hard != resource.RLIM_INFINITY and new > hard:
        statm.close()
        raise ValueError(f"memory_cap: {limit_bytes} bytes above the {base} in use exceeds the hard "
                         f"limit {hard}; accepted: at most {hard - base}")
    info = {"limit_bytes": limit_bytes, "base_bytes": base}
    state: dict = {"vms": base, "op": None}
    watch = _watch_mode(statm, state) if torch is not None else contextlib.nullcontext()
    try:
        # entering a dispatch mode the first time imports torch._dynamo (tens of MB of address
        # space): enter it before the cap goes on
        with watch:
            base = state["vms"] = statm.vms()
            peak0 = statm.peak()
            info["base_bytes"] = base
            resource.setrlimit(resource.RLIMIT_AS, (base + limit_bytes, hard))
            try:
                yield info
            except BaseException:
                used = state["vms"] - base  # before the failing operation began
                peak1 = statm.peak()
                if peak1 > peak0:
                    # the block set a new high: that includes the operation's own temporaries
                    # (a convolution's reorder buffers) up to the allocation that failed
                    used = max(used, peak1 - base)
                explain.note(memory_cap_bytes=limit_bytes, memory_cap_used_bytes=max(0, used),
                            memory_cap_op=state["op"])
                raise
            finally:
                resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    finally:
        statm.close()


__all__ = ["memory_cap"]
