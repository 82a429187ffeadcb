"""Test doubles for telemetry on machines without a GPU.

`FakeNVML` stands in for the `pynvml` module: it answers the calls NVMLSampler makes with plausible,
deterministic values for a configurable set of fake GPUs, raises pynvml's own NVMLError_NotSupported
for what a fake board "lacks", and counts every call. It is a double, not a simulator: the real NVML
path runs whenever a GPU is present (tests/test_telemetry.py::test_real_nvml_when_present).
"""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pynvml as _pynvml  # only its constants and error classes: nvidia-ml-py loads no library at import


@dataclasses.dataclass
class FakeGPU:
    """One fake board. Names in `unsupported` are NVML function names that raise NotSupported."""

    name: str = "Fake H100 80GB HBM3"
    uuid: str = "GPU-00000000-0000-0000-0000-000000000000"
    mem_total: int = 80 * 1024**3
    mem_used: int = 20 * 1024**3
    util_gpu: int = 85
    util_mem: int = 40
    temperature: int = 61
    power_mw: int = 350_000
    power_limit_mw: int = 700_000
    clocks: dict = dataclasses.field(default_factory=lambda: {"sm": 1755, "mem": 2619, "graphics": 1755})
    max_clocks: dict = dataclasses.field(default_factory=lambda: {"sm": 1980, "mem": 2619,
                                                                   "graphics": 1980})
    pcie_kbps: tuple = (120_000, 480_000)   # (tx, rx) KB/s
    fan: int = 35
    pstate: int = 0
    throttle: int = 0x4                      # sw_power_cap
    ecc: tuple = (3, 0)                      # (corrected, uncorrected)
    encoder: int = 0
    decoder: int = 5
    nvlinks: int = 0                         # active NVLink links; 0 = a PCIe-only board
    nvlink_kib: list = dataclasses.field(default_factory=lambda: [0, 0])  # cumulative (tx, rx) KiB
    processes: dict = dataclasses.field(default_factory=dict)  # {pid: bytes}
    compute_capability: tuple = (9, 0)       # Hopper
    unsupported: set = dataclasses.field(default_factory=set)


class FakeNVML:
    """A stand-in for the pynvml module (see module docstring). `FakeNVML(gpus=2)` or
    `FakeNVML(gpus=[FakeGPU(...), ...])`; `FakeNVML(init_error=...)` mimics a host without a driver.
    """

    NVMLError = _pynvml.NVMLError

    def __init__(self, gpus: int | list[FakeGPU] = 1, init_error: str | None = None) -> None:
        if isinstance(gpus, int):
            gpus = [FakeGPU(uuid=f"GPU-{i:08d}-fake-0000-0000-{i:012d}") for i in range(gpus)]
        self.gpus = list(gpus)
        self.init_error = init_error
        self.initialised = False
        self.calls: dict[str, int] = {}
        # constants NVMLSampler reads from the module
        for name in dir(_pynvml):
            if name.startswith(("NVML_", "nvmlClocks")) and not callable(getattr(_pynvml, name)):
                setattr(self, name, getattr(_pynvml, name))

    # --- helpers ---------------------------------------------------------------------------------
    def _count(self, fn: str, handle: Any = None) -> FakeGPU | None:
        self.calls[fn] = self.calls.get(fn, 0) + 1
        if fn != "nvmlInit" and not self.initialised:
            raise _pynvml.NVMLError(_pynvml.NVML_ERROR_UNINITIALIZED)
        if handle is None:
            return None
        if fn in handle.unsupported:
            raise _pynvml.NVMLError(_pynvml.NVML_ERROR_NOT_SUPPORTED)
        return handle

    @property
    def total_calls(self) -> int:
        return sum(self.calls.values())

    # --- the pynvml functions NVMLSampler calls ---------------------------------------------------
    def nvmlInit(self) -> None:
        self._count("nvmlInit")
        if self.init_error == "library":
            raise _pynvml.NVMLError(_pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
        if self.init_error == "driver":
            raise _pynvml.NVMLError(_pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
        self.initialised = True

    def nvmlShutdown(self) -> None:
        self._count("nvmlShutdown")
        self.initialised = False

    def nvmlDeviceGetCount(self) -> int:
        self._count("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> FakeGPU:
        self._count("nvmlDeviceGetHandleByIndex")
        if not 0 <= i < len(self.gpus):
            raise _pynvml.NVMLError(_pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self.gpus[i]

    def nvmlDeviceGetUUID(self, h: FakeGPU) -> str:
        return self._count("nvmlDeviceGetUUID", h).uuid

    def nvmlDeviceGetName(self, h: FakeGPU) -> str:
        return self._count("nvmlDeviceGetName", h).name

    def nvmlDeviceGetCudaComputeCapability(self, h: FakeGPU) -> tuple[int, int]:
        return self._count("nvmlDeviceGetCudaComputeCapability", h).compute_capability

    def nvmlDeviceGetUtilizationRates(self, h: FakeGPU) -> Any:
        g = self._count("nvmlDeviceGetUtilizationRates", h)
        return SimpleNamespace(gpu=g.util_gpu, memory=g.util_mem)

    def nvmlDeviceGetMemoryInfo(self, h: FakeGPU) -> Any:
        g = self._count("nvmlDeviceGetMemoryInfo", h)
        return SimpleNamespace(total=g.mem_total, used=g.mem_used, free=g.mem_total - g.mem_used)

    def nvmlDeviceGetTemperature(self, h: FakeGPU, sensor: int) -> int:
        return self._count("nvmlDeviceGetTemperature", h).temperature

    def nvmlDeviceGetPowerUsage(self, h: FakeGPU) -> int:
        return self._count("nvmlDeviceGetPowerUsage", h).power_mw

    def nvmlDeviceGetEnforcedPowerLimit(self, h: FakeGPU) -> int:
        return self._count("nvmlDeviceGetEnforcedPowerLimit", h).power_limit_mw

    _CLOCK = {0: "graphics", 1: "sm", 2: "mem"}  # NVML_CLOCK_GRAPHICS, _SM, _MEM

    def nvmlDeviceGetClockInfo(self, h: FakeGPU, clock: int) -> int:
        return self._count("nvmlDeviceGetClockInfo", h).clocks[self._CLOCK[clock]]

    def nvmlDeviceGetMaxClockInfo(self, h: FakeGPU, clock: int) -> int:
        return self._count("nvmlDeviceGetMaxClockInfo", h).max_clocks[self._CLOCK[clock]]

    def nvmlDeviceGetPcieThroughput(self, h: FakeGPU, counter: int) -> int:
        g = self._count("nvmlDeviceGetPcieThroughput", h)
        return g.pcie_kbps[0 if counter == _pynvml.NVML_PCIE_UTIL_TX_BYTES else 1]

    def nvmlDeviceGetFanSpeed(self, h: FakeGPU) -> int:
        return self._count("nvmlDeviceGetFanSpeed", h).fan

    def nvmlDeviceGetPerformanceState(self, h: FakeGPU) -> int:
        return self._count("nvmlDeviceGetPerformanceState", h).pstate

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: FakeGPU) -> int:
        return self._count("nvmlDeviceGetCurrentClocksEventReasons", h).throttle

    def nvmlDeviceGetTotalEccErrors(self, h: FakeGPU, kind: int, counter: int) -> int:
        g = self._count("nvmlDeviceGetTotalEccErrors", h)
        return g.ecc[0 if kind == _pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED else 1]

    def nvmlDeviceGetEncoderUtilization(self, h: FakeGPU) -> list[int]:
        return [self._count("nvmlDeviceGetEncoderUtilization", h).encoder, 167000]

    def nvmlDeviceGetDecoderUtilization(self, h: FakeGPU) -> list[int]:
        return [self._count("nvmlDeviceGetDecoderUtilization", h).decoder, 167000]

    def nvmlDeviceGetNvLinkState(self, h: FakeGPU, link: int) -> int:
        g = self._count("nvmlDeviceGetNvLinkState", h)
        if link >= g.nvlinks:  # a real board answers NotSupported past its last link
            raise _pynvml.NVMLError(_pynvml.NVML_ERROR_NOT_SUPPORTED)
        return 1

    def nvmlDeviceGetFieldValues(self, h: FakeGPU, field_ids: list[int]) -> list[Any]:
        g = self._count("nvmlDeviceGetFieldValues", h)
        out = []
        for fid in field_ids:
            v = {_pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX: g.nvlink_kib[0],
                 _pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX: g.nvlink_kib[1]}.get(fid)
            out.append(SimpleNamespace(fieldId=fid, nvmlReturn=0 if v is not None else
                                       _pynvml.NVML_ERROR_NOT_SUPPORTED,
                                       value=SimpleNamespace(ullVal=v or 0)))
        return out

    def nvmlDeviceGetComputeRunningProcesses(self, h: FakeGPU) -> list[Any]:
        g = self._count("nvmlDeviceGetComputeRunningProcesses", h)
        return [SimpleNamespace(pid=pid, usedGpuMemory=b) for pid, b in g.processes.items()]

    def __repr__(self) -> str:
        return f"FakeNVML(gpus={len(self.gpus)}, calls={self.total_calls})"
