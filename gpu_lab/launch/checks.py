"""Checks that run in the kernel before any fork, and free ports.

A fork copies the kernel. If CUDA was initialised there, every worker dies with "Cannot re-initialize
CUDA in forked subprocess"; if an Accelerator exists there, accelerate refuses or, worse, the workers
inherit a half-made state. Preflight finds these first and says what to do instead.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable

from ..supervise.ports import free_port, port_in_use  # noqa: F401 - launch's API


class PreflightError(RuntimeError):
    """The kernel is not in a state from which workers can be forked safely."""

    def __init__(self, problem: str, remedy: str) -> None:
        self.problem, self.remedy = problem, remedy
        super().__init__(f"{problem}\nWhat to do: {remedy}")

    def __reduce__(self):  # it crosses process boundaries (gpu_lab.diagnostics.isolate)
        return type(self), (self.problem, self.remedy)


@dataclass
class CudaState:
    imported: bool      # torch is imported in this process
    initialized: bool   # torch.cuda is initialised (a CUDA context may exist)
    bad_fork: bool      # this process is itself a fork of a CUDA process
    fork_poisoned: bool = False  # a child forked now would be in the bad-fork state


def _child_would_be_bad_fork() -> bool:
    """Fork a child that only reports torch's bad-fork flag, then exits.

    torch marks future children as "bad fork" as soon as anything asks the CUDA runtime for a device
    count — torch.cuda.is_available(), but also AdamW.step(), torch.utils.checkpoint and
    FakeTensorMode call it — while torch.cuda.is_initialized() stays False. Only a child can tell.
    The child runs nothing but a flag read, an os.write and os._exit: safe in a threaded kernel.
    """
    import os

    torch = sys.modules["torch"]
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.write(w, b"1" if torch._C._cuda_isInBadFork() else b"0")
        finally:
            os._exit(0)
    os.close(w)
    try:
        flag = os.read(r, 1)
    finally:
        os.close(r)
        os.waitpid(pid, 0)
    return flag == b"1"


def real_cuda_probe() -> CudaState:
    """Read torch's CUDA state without initialising anything (torch is not imported here)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return CudaState(False, False, False, False)
    return CudaState(True, bool(torch.cuda.is_initialized()), bool(torch._C._cuda_isInBadFork()),
                     _child_would_be_bad_fork())


#: What preflight calls to read the CUDA state. Tests swap in gpu_lab.launch.testing.FakeCudaProbe,
#: since no GPU exists on the CI machine.
cuda_probe: Callable[[], CudaState] = real_cuda_probe


def check_cuda(device: str = "cuda") -> None:
    """Refuse when forked workers could not use CUDA. With device="cpu", a poisoned fork is harmless
    (the workers never touch CUDA) and is allowed; an initialised context is refused everywhere."""
    st = cuda_probe()
    if st.bad_fork:
        raise PreflightError(
            "This process is a fork of a process that had initialised CUDA (torch reports a bad-fork "
            "state), so no CUDA work can happen here or in its children.",
            "run the launch from a fresh kernel (Kernel → Restart) and keep every CUDA call inside "
            "the training function.")
    if st.initialized:
        raise PreflightError(
            "CUDA is already initialised in this kernel (an earlier cell called something like "
            "torch.cuda.is_available(), .cuda(), .to('cuda') or torch.cuda.device_count()). Forked "
            "workers would fail with 'Cannot re-initialize CUDA in forked subprocess'.",
            "restart the kernel and move every CUDA call into the training function. To ask about "
            "GPUs in the kernel, use gpu_lab.doctor() or gpu_lab.telemetry (NVML, fork-safe), or "
            "set PYTORCH_NVML_BASED_CUDA_CHECK=1 before importing torch.")
    if st.fork_poisoned and device == "cuda":
        raise PreflightError(
            "torch has asked the CUDA runtime for its devices in this kernel (torch.cuda."
            "is_available(), torch.cuda.device_count(), or an optimizer step / torch.utils."
            "checkpoint / FakeTensorMode run here), so every forked worker starts in CUDA's "
            "bad-fork state and cannot use a GPU.",
            "restart the kernel and run model code only inside the training function; ask NVML "
            "(gpu_lab.doctor()) about GPUs, or set PYTORCH_NVML_BASED_CUDA_CHECK=1 before "
            "importing torch.")


def check_accelerate_state() -> None:
    state_mod = sys.modules.get("accelerate.state")
    if state_mod is None:
        return
    shared = {}
    for cls_name in ("AcceleratorState", "PartialState"):
        cls = getattr(state_mod, cls_name, None)
        if cls is not None and getattr(cls, "_shared_state", None):
            shared[cls_name] = cls._shared_state
    if shared:
        raise PreflightError(
            f"An accelerate {' / '.join(shared)} already exists in this kernel (an Accelerator() was "
            "created in a cell). Forked workers would inherit it instead of forming their own "
            "process group.",
            "create the Accelerator inside the training function (gpu_lab.accelerator()). To clear it "
            "without a restart, if no device was touched: `from accelerate.state import "
            "AcceleratorState; AcceleratorState._reset_state(reset_partial_state=True)`; otherwise "
            "restart the kernel.")


def check_imports() -> None:
    bad = [m for m in ("bitsandbytes",) if m in sys.modules]
    if bad:
        raise PreflightError(
            f"{', '.join(bad)} is imported in this kernel; it initialises CUDA on import, which "
            "poisons forked workers.",
            "restart the kernel and import it inside the training function.")


def preflight(device: str | None = None) -> None:
    """Raise PreflightError if forking workers from this process is unsafe; otherwise return.

    device: "cuda" or "cpu", what the workers will use (default: "cuda" when NVML sees a GPU)."""
    if device is None:
        from ..telemetry.probe import gpu_count

        device = "cuda" if gpu_count() > 0 else "cpu"
    check_cuda(device)
    check_accelerate_state()
    check_imports()


