"""Prometheus exposition of GPU, host and run metrics (seed 003 §3.2: "Prometheus + Grafana").

Built on demand for each scrape from the shared sampler's latest sample and the run registry, in the
extension's thread pool. Run metrics are bounded: active runs plus the RECENT_RUNS newest others,
so a registry with thousands of finished runs doesn't explode the series count.
"""
from __future__ import annotations

from typing import Any, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from .wire import sample_to_wire

CONTENT_TYPE = CONTENT_TYPE_LATEST
RECENT_RUNS = 20
MiB = 1024 * 1024

# (sample key, metric name, help, scale to base unit)
GPU_GAUGES = (
    ("util_gpu", "gpu_lab_gpu_utilization_percent", "Share of time a kernel ran on the GPU", 1.0),
    ("util_mem", "gpu_lab_gpu_memory_utilization_percent",
     "Share of time device memory was read or written", 1.0),
    ("mem_used_mb", "gpu_lab_gpu_memory_used_bytes", "Device memory in use", MiB),
    ("mem_total_mb", "gpu_lab_gpu_memory_total_bytes", "Device memory installed", MiB),
    ("temperature_c", "gpu_lab_gpu_temperature_celsius", "GPU core temperature", 1.0),
    ("power_w", "gpu_lab_gpu_power_watts", "Board power draw", 1.0),
    ("power_limit_w", "gpu_lab_gpu_power_limit_watts", "Enforced power limit", 1.0),
    ("clock_sm_mhz", "gpu_lab_gpu_sm_clock_hertz", "Streaming-multiprocessor clock", 1e6),
)
HOST_GAUGES = (
    ("cpu_pct", "gpu_lab_host_cpu_percent", "CPU busy, all cores", 1.0),
    ("ram_used_mb", "gpu_lab_host_memory_used_bytes", "Host memory in use", MiB),
    ("ram_total_mb", "gpu_lab_host_memory_total_bytes", "Host memory installed", MiB),
    ("swap_used_mb", "gpu_lab_host_swap_used_bytes", "Swap in use", MiB),
    ("load_1", "gpu_lab_host_load1", "1-minute load average", 1.0),
)


class GpuLabCollector(Collector):
    def __init__(self, state: Any) -> None:
        self.state = state

    def collect(self) -> Iterator[Any]:
        yield from self._telemetry()
        yield from self._runs()
        clients = GaugeMetricFamily("gpu_lab_telemetry_websocket_clients",
                                    "Browsers streaming telemetry from this server")
        clients.add_metric([], self.state.hub.clients)
        yield clients

    def _telemetry(self) -> Iterator[Any]:
        sampler = self.state.sampler_factory()
        latest = self.state.hub.fresh_latest()
        sample = sample_to_wire(latest) if latest is not None else {"host": {}, "gpus": []}
        gpus = [g for g in sample.get("gpus") or [] if isinstance(g, dict)]
        labels = ["gpu", "name", "uuid"]
        for key, name, doc, scale in GPU_GAUGES:
            fam = GaugeMetricFamily(name, doc, labels=labels)
            for g in gpus:
                v = g.get(key)
                if isinstance(v, (int, float)):
                    fam.add_metric([str(g.get("index", "")), str(g.get("name") or ""),
                                    str(g.get("uuid") or "")], float(v) * scale)
            yield fam
        count = GaugeMetricFamily("gpu_lab_gpus", "GPUs visible to the server")
        count.add_metric([], len(gpus))
        yield count
        host = sample.get("host") or {}
        for key, name, doc, scale in HOST_GAUGES:
            v = host.get(key)
            if isinstance(v, (int, float)):
                fam = GaugeMetricFamily(name, doc)
                fam.add_metric([], float(v) * scale)
                yield fam
        stats = sampler.stats
        calls = CounterMetricFamily("gpu_lab_telemetry_sampler_calls",
                                    "NVML and psutil calls made by the server's shared sampler",
                                    labels=["kind"])
        calls.add_metric(["nvml"], float(stats["nvml_calls"]))
        calls.add_metric(["psutil"], float(stats["psutil_calls"]))
        yield calls
        samples = CounterMetricFamily("gpu_lab_telemetry_samples",
                                      "Samples taken by the server's shared sampler")
        samples.add_metric([], float(stats["samples"]))
        yield samples
        subs = GaugeMetricFamily("gpu_lab_telemetry_sampler_subscribers",
                                 "Subscribers of the server's shared sampler (1 however many "
                                 "browsers stream)")
        subs.add_metric([], float(stats["subscribers"]))
        yield subs

    def _runs(self) -> Iterator[Any]:
        from gpu_lab.registry import ACTIVE, STATUSES

        reg = self.state.registry
        runs = reg.list_runs()
        by_status = GaugeMetricFamily("gpu_lab_runs", "Runs in the registry by status",
                                      labels=["status"])
        for s in STATUSES:
            by_status.add_metric([s], sum(1 for r in runs if r["status"] == s))
        yield by_status
        shown = [r for r in runs if r["status"] in ACTIVE]
        shown += [r for r in runs if r["status"] not in ACTIVE][:RECENT_RUNS]
        info = GaugeMetricFamily("gpu_lab_run_info", "1 for each run shown, labelled with its "
                                 "name and status", labels=["run_id", "name", "status"])
        step = GaugeMetricFamily("gpu_lab_run_last_step", "Last reported step", labels=["run_id"])
        loss = GaugeMetricFamily("gpu_lab_run_last_loss", "Last reported loss", labels=["run_id"])
        procs = GaugeMetricFamily("gpu_lab_run_processes", "Processes (ranks) of the run",
                                  labels=["run_id"])
        for r in shown:
            rid = r["id"]
            info.add_metric([rid, r.get("name") or rid, r["status"]], 1.0)
            last = reg.last_values(rid)
            if last["last_step"] is not None:
                step.add_metric([rid], float(last["last_step"]))
            if last["last_loss"] is not None:
                loss.add_metric([rid], float(last["last_loss"]))
            if r.get("num_processes"):
                procs.add_metric([rid], float(r["num_processes"]))
        yield from (info, step, loss, procs)


def exposition(state: Any) -> bytes:
    """The Prometheus text format for one scrape (blocking: run it off the IOLoop)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(GpuLabCollector(state))
    return generate_latest(registry)
