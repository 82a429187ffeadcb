"""The shape of this host, and the sizes of work that follow it.

A host has GPUs (NVML's count, narrowed by CUDA_VISIBLE_DEVICES) or, without any, CPU slots (the
cores this process may use, or GPU_LAB_CPU_SLOTS). Every size that depends on the machine reads
that one count here, so `GPU_LAB_CPU_SLOTS=1` gives a CPU host the shape of a one-GPU server and
a test can try each shape:

- `default_ranks()`: the ranks a launch starts when not told: one per GPU; on CPU slots at most
  2 (gloo ranks that share a few cores gain little beyond two), never more than there are slots;
- `loader_workers(ranks)`: loader processes per rank, from the cores each rank has;
- `sweep_parallel(ranks_per_trial)`: trials a sweep runs at once, from the devices free now;
- `precision()`: the mixed precision the device runs natively (bf16, fp16 before Ampere, none on
  a CPU).

Never imports torch or initialises CUDA: NVML only (gpu_lab.telemetry.probe).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

#: CPU ranks a launch starts by default: two show every distributed mechanism (a gloo group, the
#: all-reduce, a shard per rank) and more only divide the same few cores
CPU_DEFAULT_RANKS = 2
#: loader workers per rank at most: past this, decoding rarely keeps up better and RAM suffers
MAX_WORKERS = 8


@dataclass(frozen=True)
class Shape:
    """This host as a launch sees it: `kind` "gpu" or "cpu", `devices` (GPUs or CPU slots),
    `cores` (the CPU cores this process may run on) and the GPUs' names."""

    kind: str
    devices: int
    cores: int
    gpu_names: tuple[str, ...] = ()

    @property
    def unit(self) -> str:
        return "GPU" if self.kind == "gpu" else "CPU slot"

    def count(self, n: int | None = None) -> str:
        """'1 GPU', '8 GPUs', '2 CPU slots': `n` of this host's unit (default: all it has)."""
        n = self.devices if n is None else n
        return f"{n} {self.unit}{'' if n == 1 else 's'}"

    def describe(self) -> str:
        """A sentence a tutorial can print: what this machine is, for the sizes it picks."""
        if self.kind == "gpu":
            names = sorted(set(self.gpu_names))
            return f"{self.count()} ({', '.join(names) or 'unnamed'}), {self.cores} CPU cores"
        cores = f"{self.cores} core{'' if self.cores == 1 else 's'}"
        return f"no GPU; {self.count()} on {cores} (the stand-in for a GPU each)"


def _cores() -> int:
    return len(os.sched_getaffinity(0))


def shape() -> Shape:
    """This host's shape, read now (GPU_LAB_CPU_SLOTS may change between calls)."""
    from .supervise.devices import cpu_slots
    from .telemetry.probe import gpu_count

    gpus = gpu_count()
    if gpus:
        return Shape("gpu", gpus, _cores(), tuple(_gpu_names(gpus)))
    return Shape("cpu", cpu_slots(), _cores())


def _gpu_names(n: int) -> list[str]:
    from .telemetry.probe import nvml_session

    names = []
    with nvml_session() as (nv, _):
        if nv is None:
            return names
        for i in range(n):
            try:
                name = nv.nvmlDeviceGetName(nv.nvmlDeviceGetHandleByIndex(i))
            except Exception:  # noqa: BLE001 - a board NVML cannot name is still a GPU
                continue
            names.append(name.decode() if isinstance(name, bytes) else str(name))
    return names


def default_ranks(gpus: int | None = None) -> int:
    """The ranks a launch starts when not told: one per GPU, else min(2, CPU slots)."""
    if gpus is None:
        from .telemetry.probe import gpu_count

        gpus = gpu_count()
    if gpus > 0:
        return gpus
    from .supervise.devices import cpu_slots

    return min(CPU_DEFAULT_RANKS, cpu_slots())


def loader_workers(ranks: int | None = None, cap: int = MAX_WORKERS) -> int:
    """Loader worker processes per rank: the cores each of `ranks` ranks gets (default: the
    default ranks), less the one the rank itself runs on, at most `cap`. Eight ranks on a
    16-core server get one each; one rank on a 2-core laptop gets one; two get none."""
    ranks = default_ranks() if ranks is None else ranks
    if ranks < 1:
        raise ValueError(f"ranks: got {ranks}; accepted: a whole number ≥ 1")
    return max(0, min(cap, _cores() // ranks - 1))


def free_devices() -> int:
    """Devices of this host that no run holds now (the host queue's view: every user's runs)."""
    from .supervise.claims import host_queue

    here = shape()
    held = sum(len(r.devices) if r.devices else r.count for r in host_queue()
               if r.state == "holding" and r.kind == here.kind)
    return max(0, here.devices - held)


def sweep_parallel(ranks_per_trial: int = 1, cap: int | None = None) -> int:
    """Trials a sweep runs at once: the devices free now, `ranks_per_trial` each, at least 1
    (the rest wait in the host queue), at most `cap`."""
    if ranks_per_trial < 1:
        raise ValueError(f"ranks_per_trial: got {ranks_per_trial}; accepted: a whole number ≥ 1")
    n = max(1, free_devices() // ranks_per_trial)
    return min(n, cap) if cap else n


def precision() -> str:
    """The mixed precision this host's device runs natively: "bf16" on GPUs from Ampere on
    (compute capability 8), "fp16" on older GPUs (Tensor Cores without bf16), "no" on a CPU,
    where 16-bit autocast is emulated on most chips and slower than fp32."""
    from .telemetry.probe import gpu_count, nvml_session

    if gpu_count() == 0:
        return "no"
    with nvml_session() as (nv, _):
        try:
            major, _minor = nv.nvmlDeviceGetCudaComputeCapability(nv.nvmlDeviceGetHandleByIndex(0))
        except Exception:  # noqa: BLE001 - a driver that will not say: fp16 runs on every GPU
            return "fp16"
    return "bf16" if int(major) >= 8 else "fp16"


__all__ = ["Shape", "shape", "default_ranks", "loader_workers", "free_devices", "sweep_parallel",
           "precision", "CPU_DEFAULT_RANKS", "MAX_WORKERS"]
