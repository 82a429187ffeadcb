"""GPU telemetry through NVML (nvidia-ml-py), never through torch.cuda.

Why NVML: `torch.cuda.*` initialises CUDA in the calling process, and a kernel that has initialised
CUDA cannot fork training workers any more ("Cannot re-initialize CUDA in forked subprocess").
NVML talks to the driver without creating a CUDA context, so the kernel and the server extension
can watch the GPUs for as long as they like.

Every NVML call is guarded on its own: a metric a board does not support (a fan on a passively
cooled H100, ECC on a GeForce, encoder utilisation on an A100 MIG slice, NVLink on a PCIe card)
becomes None, never an exception. NVML is initialised lazily, on the first sample.

Device order: CUDA numbers the devices a process sees through CUDA_VISIBLE_DEVICES (indices or
UUIDs, in the order given); NVML numbers all devices by PCI bus id. `resolve_visible` maps one onto
the other so that "GPU 0" in a plot is the device that `cuda:0` means inside the training workers
(assuming CUDA_DEVICE_ORDER=PCI_BUS_ID, which gpu_lab's launcher sets; CUDA's default
FASTEST_FIRST order can differ on hosts that mix GPU models).
"""
from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Callable, Iterable, Sequence

from .probe import close_nvml, open_nvml


MB = 1024 * 1024
FROM_ENV = "$CUDA_VISIBLE_DEVICES"  # NVMLSampler(visible=...) default: read the environment

#: The per-GPU metrics a sample holds: name -> (python type, unit, meaning). Any value may be None
#: where the board or driver does not report it.
GPU_FIELDS: dict[str, tuple[type, str, str]] = {
    "util_gpu": (float, "%", "share of time a kernel ran on the GPU (the 'GPU-Util' of nvidia-smi)"),
    "util_mem": (float, "%", "share of time device memory was read or written"),
    "mem_used_mb": (float, "MiB", "device memory in use"),
    "mem_free_mb": (float, "MiB", "device memory free"),
    "mem_total_mb": (float, "MiB", "device memory installed"),
    "mem_used_pct": (float, "%", "mem_used / mem_total (gpu_lab warns at 95%)"),
    "temperature_c": (float, "°C", "GPU core temperature"),
    "power_w": (float, "W", "board power draw"),
    "power_limit_w": (float, "W", "enforced power limit"),
    "clock_sm_mhz": (float, "MHz", "streaming-multiprocessor clock"),
    "clock_mem_mhz": (float, "MHz", "memory clock"),
    "clock_graphics_mhz": (float, "MHz", "graphics clock"),
    "clock_sm_max_mhz": (float, "MHz", "maximum SM clock"),
    "clock_mem_max_mhz": (float, "MHz", "maximum memory clock"),
    "clock_graphics_max_mhz": (float, "MHz", "maximum graphics clock"),
    "pcie_tx_mbps": (float, "MB/s", "PCIe transmit throughput (GPU → host)"),
    "pcie_rx_mbps": (float, "MB/s", "PCIe receive throughput (host → GPU)"),
    "fan_pct": (float, "%", "fan speed (None on passively cooled boards)"),
    "pstate": (int, "", "performance state, 0 (fastest) to 15 (slowest)"),
    "throttle_reasons": (int, "bitmask", "NVML clocks-event (throttle) reasons"),
    "throttle": (list, "", "names of the active throttle reasons"),
    "ecc_corrected": (int, "errors", "volatile corrected ECC errors since the last driver load"),
    "ecc_uncorrected": (int, "errors", "volatile uncorrected ECC errors since the last driver load"),
    "encoder_util": (float, "%", "video encoder utilisation"),
    "decoder_util": (float, "%", "video decoder utilisation"),
    "nvlink_tx_mbps": (float, "MB/s", "NVLink transmit data throughput, all links (None without NVLink)"),
    "nvlink_rx_mbps": (float, "MB/s", "NVLink receive data throughput, all links (None without NVLink)"),
    "process_mem_mb": (dict, "MiB", "device memory used by each watched PID: {pid: MiB}"),
}

#: Identity keys every GPU entry carries besides the metrics.
GPU_ID_FIELDS = ("index", "nvml_index", "uuid", "name")

# Throttle-reason bits (nvml.h nvmlClocksEventReason*), named as nvidia-smi -q names them.
THROTTLE_BITS = {
    0x1: "gpu_idle",
    0x2: "applications_clocks",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal",
    0x40: "hw_thermal",
    0x80: "hw_power_brake",
    0x100: "display_clocks",
}


def throttle_names(mask: int | None) -> list[str] | None:
    if mask is None:
        return None
    return [name for bit, name in THROTTLE_BITS.items() if mask & bit]


@dataclasses.dataclass(frozen=True)
class Device:
    """One GPU as this process sees it: `index` is the CUDA index (cuda:N in the workers),
    `nvml_index` NVML's PCI-order index."""

    index: int
    nvml_index: int
    uuid: str
    name: str


def resolve_visible(spec: str | None, uuids: Sequence[str]) -> list[int]:
    """NVML indices of the devices CUDA_VISIBLE_DEVICES=`spec` exposes, in CUDA order.

    `uuids` are NVML's device UUIDs in NVML order. Entries may be indices ("0,2") or UUIDs, full or
    a unique prefix ("GPU-8f3a"), as CUDA accepts them. Like CUDA, parsing stops at the first entry
    that names no device, and a device listed twice is listed once. None (unset) means all devices;
    "" or "-1" means none.
    """
    n = len(uuids)
    if spec is None:
        return list(range(n))
    out: list[int] = []
    for raw in spec.split(","):
        entry = raw.strip()
        if not entry:
            break
        idx: int | None = None
        if entry.lstrip("-").isdigit():
            i = int(entry)
            idx = i if 0 <= i < n else None
        else:
            hits = [i for i, u in enumerate(uuids) if u.startswith(entry)
                    or u.startswith("GPU-" + entry)]
            idx = hits[0] if len(hits) == 1 else None
        if idx is None:
            break  # CUDA ignores everything after an invalid entry
        if idx not in out:
            out.append(idx)
    return out


class NVMLSampler:
    """Samples every visible GPU through NVML. Lazy: nothing happens until `available` or
    `sample()` is first used. Not thread-safe: one Sampler thread owns it.

    `nvml` is the module to call (default: pynvml, imported on first use); tests pass
    `gpu_lab.telemetry.doubles.FakeNVML()`. `visible` overrides $CUDA_VISIBLE_DEVICES.
    """

    def __init__(self, nvml: Any = None, visible: Any = FROM_ENV,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._nvml = nvml
        self._visible = visible
        self._clock = clock
        self._state: str = "new"  # new | ready | unavailable | closed
        self.reason: str | None = None  # why NVML is unavailable
        self.devices: list[Device] = []
        self._handles: list[Any] = []
        self._static: list[dict[str, Any]] = []
        self._nvlinks: list[list[int]] = []  # active NVLink ids per device
        self._prev_nvlink: list[tuple[float, int, int] | None] = []
        self.calls = 0  # NVML calls made, for the server's "constant call rate" check
        self._errors: tuple[type[BaseException], ...] = (AttributeError, NotImplementedError)

    # --- lifecycle -------------------------------------------------------------------------------
    @property
    def available(self) -> bool:
        if self._state == "new":
            self._init()
        return self._state == "ready"

    def _call(self, fn: Callable, *args: Any) -> Any:
        self.calls += 1
        return fn(*args)

    def _guard(self, fn: Callable, *args: Any) -> Any:
        """One NVML call; None where the board, driver or permissions don't allow it."""
        try:
            return self._call(fn, *args)
        except self._errors:
            return None

    def _init(self) -> None:
        self.calls += 1
        nv, why = open_nvml(self._nvml)
        if nv is None:
            self._unavailable(why)
            return
        self._nvml = nv
        self._errors = (nv.NVMLError, AttributeError, NotImplementedError)
        try:
            count = self._call(nv.nvmlDeviceGetCount)
            all_handles = [self._call(nv.nvmlDeviceGetHandleByIndex, i) for i in range(count)]
            uuids = [_text(self._guard(nv.nvmlDeviceGetUUID, h)) or f"nvml-{i}"
                     for i, h in enumerate(all_handles)]
        except nv.NVMLError as e:
            self._unavailable(f"NVML could not list devices: {e}")
            return
        spec = os.environ.get("CUDA_VISIBLE_DEVICES") if self._visible is FROM_ENV else self._visible
        order = resolve_visible(spec, uuids)
        for cuda_idx, nv_idx in enumerate(order):
            h = all_handles[nv_idx]
            name = _text(self._guard(nv.nvmlDeviceGetName, h)) or "unknown GPU"
            self.devices.append(Device(cuda_idx, nv_idx, uuids[nv_idx], name))
            self._handles.append(h)
            # Maxima and totals don't change while the driver is loaded: read them once.
            self._static.append({
                "clock_sm_max_mhz": _num(self._guard(nv.nvmlDeviceGetMaxClockInfo, h, nv.NVML_CLOCK_SM)),
                "clock_mem_max_mhz": _num(self._guard(nv.nvmlDeviceGetMaxClockInfo, h, nv.NVML_CLOCK_MEM)),
                "clock_graphics_max_mhz": _num(self._guard(nv.nvmlDeviceGetMaxClockInfo, h,
                                                           nv.NVML_CLOCK_GRAPHICS)),
            })
            self._nvlinks.append(self._active_links(h))
            self._prev_nvlink.append(None)
        if not self.devices:
            self._unavailable("no GPU visible" + (f" (CUDA_VISIBLE_DEVICES={spec!r})"
                                                  if spec is not None else ""))
            return
        self._state = "ready"

    def _active_links(self, h: Any) -> list[int]:
        nv = self._nvml
        links = []
        for link in range(int(getattr(nv, "NVML_NVLINK_MAX_LINKS", 18))):
            state = self._guard(nv.nvmlDeviceGetNvLinkState, h, link)
            if state is None:  # NotSupported / InvalidArgument: no (more) links on this board
                break
            if state:
                links.append(link)
        return links

    def _unavailable(self, reason: str) -> None:
        self._state = "unavailable"
        self.reason = reason
        self.devices, self._handles, self._static = [], [], []

    def close(self) -> None:
        if self._state == "ready":
            self.calls += 1
            close_nvml(self._nvml)
        self._state = "closed"
        self.devices, self._handles = [], []

    # --- sampling --------------------------------------------------------------------------------
    def sample(self, pids: Iterable[int] = ()) -> list[dict[str, Any]]:
        """One entry per visible GPU, in CUDA order: identity keys plus every GPU_FIELDS metric.

        `pids`: processes whose device memory to report in `process_mem_mb` (the run's workers).
        """
        if not self.available:
            return []
        pids = set(pids)
        return [self._sample_one(i, pids) for i in range(len(self._handles))]

    def _sample_one(self, i: int, pids: set[int]) -> dict[str, Any]:
        nv, h, g = self._nvml, self._handles[i], self._guard
        dev = self.devices[i]
        out: dict[str, Any] = {"index": dev.index, "nvml_index": dev.nvml_index, "uuid": dev.uuid,
                               "name": dev.name}
        util = g(nv.nvmlDeviceGetUtilizationRates, h)
        out["util_gpu"] = _num(getattr(util, "gpu", None))
        out["util_mem"] = _num(getattr(util, "memory", None))
        mem = g(nv.nvmlDeviceGetMemoryInfo, h)
        used, free, total = (getattr(mem, k, None) for k in ("used", "free", "total"))
        out["mem_used_mb"] = _num(used, MB)
        out["mem_free_mb"] = _num(free, MB)
        out["mem_total_mb"] = _num(total, MB)
        out["mem_used_pct"] = 100.0 * used / total if used is not None and total else None
        out["temperature_c"] = _num(g(nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU))
        out["power_w"] = _num(g(nv.nvmlDeviceGetPowerUsage, h), 1000)  # NVML reports mW
        out["power_limit_w"] = _num(g(nv.nvmlDeviceGetEnforcedPowerLimit, h), 1000)
        out["clock_sm_mhz"] = _num(g(nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_SM))
        out["clock_mem_mhz"] = _num(g(nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_MEM))
        out["clock_graphics_mhz"] = _num(g(nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_GRAPHICS))
        out.update(self._static[i])
        # PCIe throughput: NVML measures over a 20 ms window inside the call (it blocks that long),
        # in KB/s. That is why the sampler runs on its own thread and never faster than 4 Hz.
        out["pcie_tx_mbps"] = _num(g(nv.nvmlDeviceGetPcieThroughput, h, nv.NVML_PCIE_UTIL_TX_BYTES), 1000)
        out["pcie_rx_mbps"] = _num(g(nv.nvmlDeviceGetPcieThroughput, h, nv.NVML_PCIE_UTIL_RX_BYTES), 1000)
        out["fan_pct"] = _num(g(nv.nvmlDeviceGetFanSpeed, h))
        pstate = g(nv.nvmlDeviceGetPerformanceState, h)
        out["pstate"] = int(pstate) if pstate is not None and int(pstate) <= 15 else None
        reasons_fn = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
            nv.nvmlDeviceGetCurrentClocksThrottleReasons
        mask = g(reasons_fn, h)
        out["throttle_reasons"] = int(mask) if mask is not None else None
        out["throttle"] = throttle_names(out["throttle_reasons"])
        for key, kind in (("ecc_corrected", nv.NVML_MEMORY_ERROR_TYPE_CORRECTED),
                          ("ecc_uncorrected", nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED)):
            v = g(nv.nvmlDeviceGetTotalEccErrors, h, kind, nv.NVML_VOLATILE_ECC)
            out[key] = int(v) if v is not None else None
        enc = g(nv.nvmlDeviceGetEncoderUtilization, h)
        dec = g(nv.nvmlDeviceGetDecoderUtilization, h)
        out["encoder_util"] = _num(enc[0]) if enc else None
        out["decoder_util"] = _num(dec[0]) if dec else None
        out["nvlink_tx_mbps"], out["nvlink_rx_mbps"] = self._nvlink_rates(i, h)
        out["process_mem_mb"] = self._process_memory(h, pids)
        return out

    def _nvlink_rates(self, i: int, h: Any) -> tuple[float | None, float | None]:
        """MB/s over all active links, from NVML's cumulative KiB counters (None without NVLink)."""
        if not self._nvlinks[i]:
            return None, None
        nv = self._nvml
        vals = self._guard(nv.nvmlDeviceGetFieldValues, h,
                           [nv.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX,
                            nv.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX])
        if vals is None or any(getattr(v, "nvmlReturn", 0) != 0 for v in vals):
            return None, None
        now = self._clock()
        tx, rx = (int(v.value.ullVal) for v in vals)
        prev, self._prev_nvlink[i] = self._prev_nvlink[i], (now, tx, rx)
        if prev is None or now <= prev[0]:
            return 0.0, 0.0
        dt = now - prev[0]
        kib = 1024 / 1e6  # counters are KiB; report MB/s like PCIe
        return max(0, tx - prev[1]) * kib / dt, max(0, rx - prev[2]) * kib / dt

    def _process_memory(self, h: Any, pids: set[int]) -> dict[int, float] | None:
        """{pid: MiB} for the watched PIDs that hold memory on this GPU. NVML reports host PIDs:
        inside a container without --pid=host they do not match the container's, and the dict
        stays empty."""
        if not pids:
            return {}
        procs = self._guard(self._nvml.nvmlDeviceGetComputeRunningProcesses, h)
        if procs is None:
            return None
        out: dict[int, float] = {}
        for p in procs:
            pid = int(getattr(p, "pid", -1))
            used = getattr(p, "usedGpuMemory", None)
            if pid in pids and used is not None:
                out[pid] = out.get(pid, 0.0) + used / MB
        return out

    def __repr__(self) -> str:
        return f"NVMLSampler(state={self._state!r}, devices={len(self.devices)}, calls={self.calls})"


def _num(v: Any, div: float = 1.0) -> float | None:
    if v is None:
        return None
    try:
        return float(v) / div
    except (TypeError, ValueError):
        return None


def _text(v: Any) -> str | None:
    if v is None:
        return None
    return v.decode() if isinstance(v, bytes) else str(v)
