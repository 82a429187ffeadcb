"""The devices a run may claim on this host, and what a run asks for.

Resources: on a host where NVML shows GPUs, the GPUs this process may see (CUDA_VISIBLE_DEVICES,
resolved as CUDA resolves it), each with its NVML index (the number nvidia-smi shows, and the CUDA
index under CUDA_DEVICE_ORDER=PCI_BUS_ID, which gpu_lab's launcher sets) and its UUID. On a host
without GPUs: CPU slots, one per rank, `len(os.sched_getaffinity(0))` of them unless
GPU_LAB_CPU_SLOTS says otherwise (so that a test suite, or a user who knows better, can allow
more runs side by side). A slot is a ticket, not a pinned core.

Foreign use: a GPU is busy when processes hold more than BUSY_MIB of its memory in all (a CUDA
context alone takes a few hundred MiB; 1 GiB means someone is really using it); NVML reports the
memory per process. GPU_LAB_GPU_BUSY_MIB overrides the threshold. A process whose memory NVML
cannot tell counts as holding the device; where NVML cannot list processes at all, the device's
used memory stands in. The caller's own process never counts (the supervisor stays CUDA-free).
Whether a gpu_lab run holds a device is the claim locks' business (claims.py), not NVML's.

A request is `gpus=N` (any N devices), a list of indices (those devices: NVML indices, or slot
numbers on a CPU host) or "all" (every device of the host, waiting for any that is busy).
Never imports torch: NVML only, through gpu_lab.telemetry.probe.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Sequence

from ..telemetry.nvml import resolve_visible
from ..telemetry.probe import close_nvml, open_nvml

BUSY_MIB = 1024          # default foreign-memory threshold, MiB (see the module docstring)
MIB = 1024 * 1024
KINDS = ("gpu", "cpu")


@dataclasses.dataclass(frozen=True)
class HostDevice:
    """One claimable device. `id` names its lock file: "gpu-<UUID>" or "cpu-<slot>"; `index` is
    the NVML index of a GPU, or the slot number; `uuid` is None for a CPU slot."""

    kind: str
    index: int
    uuid: str | None

    @property
    def id(self) -> str:
        return f"gpu-{self.uuid}" if self.kind == "gpu" else f"cpu-{self.index}"

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "kind": self.kind, "index": self.index, "uuid": self.uuid}


@dataclasses.dataclass(frozen=True)
class Request:
    """What a run asks for: `count` devices of any kind of this host, or exactly `ids`."""

    count: int
    ids: tuple[str, ...] | None = None   # None: any `count` devices

    def as_dict(self) -> dict[str, Any]:
        return {"count": self.count, "ids": list(self.ids) if self.ids is not None else None}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Request":
        ids = d.get("ids")
        return cls(int(d["count"]), tuple(ids) if ids is not None else None)


def env_number(name: str, default: float, what: str, whole: bool = False,
               least: float = 0) -> float:
    """The number setting `name` holds, or `default` where it is unset; a clear error if bad."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        v = int(raw) if whole else float(raw)
    except ValueError:
        v = least - 1
    if v < least:
        kind = "a whole number" if whole else "a number"
        raise ValueError(f"{name}: got {raw!r}; accepted: {kind} ≥ {least:g} ({what}), or unset "
                         f"for the default")
    return v


def cpu_slots() -> int:
    """The number of CPU slots: GPU_LAB_CPU_SLOTS, else the cores this process may run on."""
    return int(env_number("GPU_LAB_CPU_SLOTS", len(os.sched_getaffinity(0)),
                          "the ranks this host may run side by side", whole=True, least=1))


def busy_threshold_mib() -> float:
    """The foreign-memory threshold in MiB: GPU_LAB_GPU_BUSY_MIB, else BUSY_MIB."""
    return env_number("GPU_LAB_GPU_BUSY_MIB", BUSY_MIB,
                      "MiB that foreign processes may hold on a GPU that still counts as free")


class Resources:
    """The devices of this host that this process may claim. `Resources.detect()` asks NVML
    (`nvml`: pynvml by default, or gpu_lab.telemetry.doubles.FakeNVML); `kind` forces "gpu" or
    "cpu" (default: GPUs where NVML shows any). Holds an NVML session until close()."""

    def __init__(self, kind: str, devices: Sequence[HostDevice], nvml: Any = None,
                 handles: Sequence[Any] = ()) -> None:
        self.kind = kind
        self.devices = list(devices)
        self._nvml = nvml
        self._handles = list(handles)   # NVML handles, parallel to devices (GPUs only)

    @classmethod
    def detect(cls, nvml: Any = None, kind: str | None = None) -> "Resources":
        if kind not in (None, *KINDS):
            raise ValueError(f"kind: got {kind!r}; accepted: None (detect), 'gpu', 'cpu'")
        if kind != "cpu":
            gpus = cls._gpus(nvml)
            if gpus is not None:
                return gpus
            if kind == "gpu":
                raise RuntimeError("kind='gpu': NVML shows no GPU this process may use; on a host "
                                   "without GPUs leave kind unset to claim CPU slots")
        return cls("cpu", [HostDevice("cpu", i, None) for i in range(cpu_slots())])

    @classmethod
    def _gpus(cls, nvml: Any) -> "Resources | None":
        nv, _why = open_nvml(nvml)
        if nv is None:
            return None
        try:
            handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(nv.nvmlDeviceGetCount())]
            uuids = [_text(nv.nvmlDeviceGetUUID(h)) for h in handles]
        except Exception:  # noqa: BLE001 - a driver that lists nothing: no GPU to claim
            close_nvml(nv)
            return None
        order = sorted(resolve_visible(os.environ.get("CUDA_VISIBLE_DEVICES"), uuids))
        if not order:
            close_nvml(nv)
            return None
        return cls("gpu", [HostDevice("gpu", i, uuids[i]) for i in order], nv,
                   [handles[i] for i in order])

    def close(self) -> None:
        if self._nvml is not None:
            close_nvml(self._nvml)
            self._nvml = None

    def by_id(self) -> dict[str, HostDevice]:
        return {d.id: d for d in self.devices}

    def foreign_busy(self, exclude_pids: Sequence[int] = ()) -> dict[str, str]:
        """{device id: why it counts as busy} for the GPUs that other processes use (see the
        module docstring); always empty for CPU slots."""
        if self.kind != "gpu" or self._nvml is None:
            return {}
        limit = busy_threshold_mib()
        skip = {os.getpid(), *exclude_pids}
        out = {}
        for dev, h in zip(self.devices, self._handles):
            mib, pids = self._memory_in_use(h, skip)
            if mib > limit:
                who = f"pid {', '.join(map(str, pids))}" if pids else "processes NVML cannot list"
                out[dev.id] = (f"GPU {dev.index}: {mib:.0f} MiB held by {who} "
                               f"(more than {limit:.0f} MiB)")
        return out

    def _memory_in_use(self, h: Any, skip: set[int]) -> tuple[float, list[int]]:
        nv = self._nvml
        try:
            procs = nv.nvmlDeviceGetComputeRunningProcesses(h)
        except Exception:  # noqa: BLE001 - NotSupported: the device's used memory stands in
            try:
                return nv.nvmlDeviceGetMemoryInfo(h).used / MIB, []
            except Exception:  # noqa: BLE001 - nothing to go on: count the device as free
                return 0.0, []
        mib, pids = 0.0, []
        for p in procs:
            pid = int(getattr(p, "pid", -1))
            if pid in skip:
                continue
            used = getattr(p, "usedGpuMemory", None)
            mib += float("inf") if used is None else used / MIB
            pids.append(pid)
        return mib, pids

    def parse(self, gpus: Any) -> Request:
        """The Request for `gpus=N | [indices] | "all"`, checked against this host."""
        return parse_request(gpus, self)

    def __repr__(self) -> str:
        return f"Resources({self.kind!r}, {[d.index for d in self.devices]})"


def parse_request(gpus: Any, res: Resources) -> Request:
    """`gpus=N | [indices] | "all"` as a Request on `res`; a clear ValueError otherwise."""
    unit = "GPUs" if res.kind == "gpu" else "CPU slots"
    accepted = ("accepted: a count ≥ 1, a list of device indices, or 'all'")
    have = [d.index for d in res.devices]
    if gpus == "all":
        return Request(len(res.devices), tuple(d.id for d in res.devices))
    if isinstance(gpus, bool) or isinstance(gpus, str):
        raise ValueError(f"gpus: got {gpus!r}; {accepted}")
    if isinstance(gpus, int):
        if gpus < 1 or gpus > len(res.devices):
            raise ValueError(f"gpus: got {gpus}; this host has {len(res.devices)} {unit} "
                             f"({have}); {accepted}")
        return Request(gpus)
    try:
        wanted = list(gpus)
    except TypeError:
        raise ValueError(f"gpus: got {gpus!r}; {accepted}") from None
    if not wanted or not all(isinstance(i, int) and not isinstance(i, bool) for i in wanted):
        raise ValueError(f"gpus: got {gpus!r}; {accepted} (a list of whole numbers)")
    if len(set(wanted)) != len(wanted):
        raise ValueError(f"gpus: got {gpus!r}, which names a device twice; {accepted}")
    by_index = {d.index: d for d in res.devices}
    missing = [i for i in wanted if i not in by_index]
    if missing:
        raise ValueError(f"gpus: got {gpus!r}; no {unit} {missing} here: this process may use "
                         f"{have}")
    return Request(len(wanted), tuple(by_index[i].id for i in wanted))


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)
