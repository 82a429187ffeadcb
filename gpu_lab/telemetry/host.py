"""Host telemetry through psutil: CPU (overall and per core), RAM, swap, disk and network rates,
load average.

CPU % is computed from our own cpu_times() deltas rather than psutil.cpu_percent(): cpu_percent
keeps its "since last call" state in module globals, so any other caller in the process (the
server extension, jupyter-resource-usage) would silently shorten our measuring window.
Rates (MB/s) are deltas of the cumulative counters between two samples; the first sample reports
0.0 for them.
"""
from __future__ import annotations

import os
import time
from typing import Any, Callable

MB = 1024 * 1024

#: The host metrics a sample holds: name -> (python type, unit, meaning).
HOST_FIELDS: dict[str, tuple[type, str, str]] = {
    "cpu_pct": (float, "%", "CPU busy, all cores (100 = every core busy)"),
    "cpu_per_core": (list, "%", "CPU busy per logical core"),
    "cpu_count": (int, "", "logical cores"),
    "ram_used_mb": (float, "MiB", "memory in use (total − available)"),
    "ram_total_mb": (float, "MiB", "installed memory"),
    "ram_pct": (float, "%", "memory in use"),
    "swap_used_mb": (float, "MiB", "swap in use"),
    "swap_pct": (float, "%", "swap in use"),
    "disk_read_mbps": (float, "MB/s", "disk reads, all disks"),
    "disk_write_mbps": (float, "MB/s", "disk writes, all disks"),
    "net_recv_mbps": (float, "MB/s", "network receive, all interfaces"),
    "net_sent_mbps": (float, "MB/s", "network send, all interfaces"),
    "load_1": (float, "", "1-minute load average"),
    "load_5": (float, "", "5-minute load average"),
    "load_15": (float, "", "15-minute load average"),
}


class HostSampler:
    """Samples the host. `psutil` may be replaced (tests); `clock` times the rate windows."""

    def __init__(self, psutil: Any = None, clock: Callable[[], float] = time.monotonic) -> None:
        if psutil is None:
            import psutil
        self._ps = psutil
        self._clock = clock
        self.calls = 0  # psutil calls made
        self._prev_cpu: list | None = None
        self._prev_io: tuple[float, Any, Any] | None = None

    def _call(self, fn: Callable, *args: Any, **kw: Any) -> Any:
        self.calls += 1
        try:
            return fn(*args, **kw)
        except (OSError, RuntimeError, AttributeError, NotImplementedError):
            # containers without /proc/diskstats, hosts without a network interface, ...
            return None

    def sample(self) -> dict[str, Any]:
        ps = self._ps
        out: dict[str, Any] = {}
        cpu = self._call(ps.cpu_times, percpu=True)
        per_core = self._cpu_pct(cpu)
        out["cpu_per_core"] = per_core
        out["cpu_count"] = len(cpu) if cpu else (os.cpu_count() or 1)
        out["cpu_pct"] = sum(per_core) / len(per_core) if per_core else None
        vm = self._call(ps.virtual_memory)
        if vm is not None:
            out["ram_total_mb"] = vm.total / MB
            out["ram_used_mb"] = (vm.total - vm.available) / MB
            out["ram_pct"] = float(vm.percent)
        else:
            out["ram_total_mb"] = out["ram_used_mb"] = out["ram_pct"] = None
        sw = self._call(ps.swap_memory)
        out["swap_used_mb"] = sw.used / MB if sw is not None else None
        out["swap_pct"] = float(sw.percent) if sw is not None else None
        now = self._clock()
        disk = self._call(ps.disk_io_counters)
        net = self._call(ps.net_io_counters)
        prev, self._prev_io = self._prev_io, (now, disk, net)
        dt = now - prev[0] if prev is not None else 0.0
        out["disk_read_mbps"] = _rate(disk, prev[1] if prev else None, "read_bytes", dt)
        out["disk_write_mbps"] = _rate(disk, prev[1] if prev else None, "write_bytes", dt)
        out["net_recv_mbps"] = _rate(net, prev[2] if prev else None, "bytes_recv", dt)
        out["net_sent_mbps"] = _rate(net, prev[2] if prev else None, "bytes_sent", dt)
        load = self._call(ps.getloadavg) if hasattr(ps, "getloadavg") else None
        out["load_1"], out["load_5"], out["load_15"] = (
            (float(load[0]), float(load[1]), float(load[2])) if load else (None, None, None))
        return out

    def _cpu_pct(self, cpu: list | None) -> list[float] | None:
        if not cpu:
            return None
        prev, self._prev_cpu = self._prev_cpu, cpu
        if prev is None or len(prev) != len(cpu):
            # first sample: the load since boot is no use; report since-boot busy share anyway so
            # the panel has a value, it is replaced one interval later
            prev = [None] * len(cpu)
        out = []
        for now_t, then_t in zip(cpu, prev):
            busy_now, total_now = _busy_total(now_t)
            if then_t is None:
                out.append(100.0 * busy_now / total_now if total_now else 0.0)
                continue
            busy_then, total_then = _busy_total(then_t)
            d_total = total_now - total_then
            out.append(min(100.0, max(0.0, 100.0 * (busy_now - busy_then) / d_total))
                       if d_total > 0 else 0.0)
        return out

    def __repr__(self) -> str:
        return f"HostSampler(calls={self.calls})"


def _busy_total(t: Any) -> tuple[float, float]:
    fields = t._asdict() if hasattr(t, "_asdict") else dict(vars(t))
    # Linux counts guest time inside user time already; don't count it twice.
    total = sum(v for k, v in fields.items() if k not in ("guest", "guest_nice"))
    idle = fields.get("idle", 0.0) + fields.get("iowait", 0.0)
    return total - idle, total


def _rate(now: Any, prev: Any, attr: str, dt: float) -> float | None:
    if now is None:
        return None
    if prev is None or dt <= 0:
        return 0.0
    return max(0, getattr(now, attr) - getattr(prev, attr)) / 1e6 / dt
