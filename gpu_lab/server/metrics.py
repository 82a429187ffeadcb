"""Prometheus exposition of GPU, host and run metrics, for a Prometheus server that Grafana reads.

Built on demand for each scrape from the shared sampler's latest sample and the run registry, in the
extension's thread pool. Three families, each switched by a GpuLabServer setting (settings.py):

- gpu_lab_* telemetry: GPU and host readings under gpu_lab's names, in base units (bytes, hertz);
- DCGM_FI_DEV_*: the same GPU readings under DCGM-exporter's names, units and labels (dcgm.py);
- gpu_lab_run_*: the registry's runs. Status, last step and last loss for the active runs plus the
  RECENT_RUNS newest others (a registry with thousands of finished runs must not explode the series
  count); throughput, data-wait share and learning rate for the active runs only, since a finished
  run's last throughput is no longer a rate of anything.

The registry is read through its public methods only (list_runs, last_values, summary). Whatever
a record holds, a scrape answers: a last loss of NaN or +-inf goes out as Prometheus' NaN / +Inf /
-Inf (a diverged run must show on a dashboard), a last step that is not an int (an older record)
is left out, and the training series leave out NaN (no rate of anything).
"""
from __future__ import annotations

import socket
from typing import Any, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ..units import MiB
from . import dcgm
from .wire import sample_to_wire

CONTENT_TYPE = CONTENT_TYPE_LATEST
RECENT_RUNS = 20

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
# (training_values key, metric name, help): the training series of an active run
RUN_GAUGES = (
    ("samples_per_s", "gpu_lab_run_samples_per_second",
     "Training throughput over all ranks, samples/s, at the last logged step"),
    ("data_wait_ratio", "gpu_lab_run_data_wait_ratio",
     "Share of the step time spent waiting for the next batch, 0..1, at the last logged step"),
    ("lr", "gpu_lab_run_learning_rate", "Learning rate at the last logged step"),
    ("step_time", "gpu_lab_run_step_seconds", "Wall time of one optimizer step, last logged"),
)


def _step(v: Any) -> float | None:
    return float(v) if type(v) is int else None


def _value(v: Any) -> float | None:
    """A number as Prometheus takes it, NaN and infinities included; None for anything else."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    try:
        return float(v)
    except OverflowError:
        return None


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
        return None
    return float(v)


def training_values(registry: Any, run_id: str) -> dict[str, float]:
    """The last training figures of a run: what `fit` logs (samples_per_s, step_time, data_wait,
    lr), plus the data-wait share data_wait / step_time. Missing figures are left out."""
    last = registry.summary(run_id)
    out = {}
    for key in ("samples_per_s", "lr", "step_time"):
        v = _number(last.get(key))
        if v is not None:
            out[key] = v
    wait, step = _number(last.get("data_wait")), _number(last.get("step_time"))
    if wait is not None and step:
        out["data_wait_ratio"] = min(1.0, max(0.0, wait / step))
    return out


class GpuLabCollector(Collector):
    """The gpu_lab_* families of one scrape; `sample` is the telemetry sample in wire format (None
    when the telemetry family is off)."""

    def __init__(self, state: Any, settings: Any, sample: dict | None) -> None:
        self.state = state
        self.settings = settings
        self.sample = sample

    def collect(self) -> Iterator[Any]:
        if self.settings.gpu_lab_metrics and self.sample is not None:
            yield from self._telemetry(self.sample)
        if self.settings.run_metrics:
            yield from self._runs()

    def _telemetry(self, sample: dict) -> Iterator[Any]:
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
        stats = self.state.sampler_factory().stats
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
        clients = GaugeMetricFamily("gpu_lab_telemetry_websocket_clients",
                                    "Browsers streaming telemetry from this server")
        clients.add_metric([], self.state.hub.clients)
        yield clients
        feeds = self.state.feeds
        reads = CounterMetricFamily("gpu_lab_server_run_feed_reads",
                                    "Reads of followed runs' records and logs by the live run "
                                    "feeds: shared (one per run per tick, whoever follows) or "
                                    "catchup (one follower getting level)", labels=["kind"])
        for kind, n in sorted(feeds.reads.items()):
            reads.add_metric([kind], float(n))
        yield reads
        followers = GaugeMetricFamily("gpu_lab_server_run_feed_followers",
                                      "Run views following a run live, over all followed runs")
        followers.add_metric([], float(feeds.followers))
        yield followers

    def _runs(self) -> Iterator[Any]:
        from gpu_lab.record.registry import ACTIVE, STATUSES

        reg = self.state.registry
        runs = reg.list_runs()
        by_status = GaugeMetricFamily("gpu_lab_runs", "Runs in the registry by status",
                                      labels=["status"])
        for s in STATUSES:
            by_status.add_metric([s], sum(1 for r in runs if r["status"] == s))
        yield by_status
        active = [r for r in runs if r["status"] in ACTIVE]
        shown = active + [r for r in runs if r["status"] not in ACTIVE][:RECENT_RUNS]
        info = GaugeMetricFamily("gpu_lab_run_info", "1 for each run shown, labelled with its "
                                 "name and status", labels=["run_id", "name", "status"])
        step = GaugeMetricFamily("gpu_lab_run_last_step", "Last reported step", labels=["run_id"])
        loss = GaugeMetricFamily("gpu_lab_run_last_loss", "Last reported loss", labels=["run_id"])
        procs = GaugeMetricFamily("gpu_lab_run_processes", "Processes (ranks) of the run",
                                  labels=["run_id"])
        place = GaugeMetricFamily("gpu_lab_run_queue_position", "A queued run's place in the "
                                  "host's queue (1 = next to start)", labels=["run_id"])
        devices = GaugeMetricFamily("gpu_lab_run_device", "1 for each device (GPU, or CPU slot) "
                                    "an active run holds", labels=["run_id", "kind", "index", "uuid"])
        note = GaugeMetricFamily("gpu_lab_run_record_note", "1 for each run whose record says "
                                 "something of itself (its disk was full and it paused, its "
                                 "recorder was replaced), with what it says",
                                 labels=["run_id", "note"])
        for r in shown:
            rid = r["id"]
            info.add_metric([rid, r.get("name") or rid, r["status"]], 1.0)
            last = reg.last_values(rid)
            if _step(last["last_step"]) is not None:
                step.add_metric([rid], _step(last["last_step"]))
            if _value(last["last_loss"]) is not None:
                loss.add_metric([rid], _value(last["last_loss"]))
            if r.get("num_processes"):
                procs.add_metric([rid], float(r["num_processes"]))
            if r["status"] == "queued" and type(r.get("queue_position")) is int:
                place.add_metric([rid], float(r["queue_position"]))
            if r.get("note"):
                note.add_metric([rid, str(r["note"])[:300]], 1.0)
            held = r.get("devices") if r["status"] in ACTIVE else None
            for d in (held.get("devices") or []) if isinstance(held, dict) else []:
                if isinstance(d, dict):
                    devices.add_metric([rid, str(held.get("kind")), str(d.get("index")),
                                        str(d.get("uuid") or "")], 1.0)
        yield from (info, step, loss, procs, place, devices, note)
        training = {r["id"]: training_values(reg, r["id"]) for r in active}
        for key, name, doc in RUN_GAUGES:
            fam = GaugeMetricFamily(name, doc, labels=["run_id"])
            for rid, values in training.items():
                if key in values:
                    fam.add_metric([rid], values[key])
            yield fam


def exposition(state: Any) -> bytes:
    """The Prometheus text format for one scrape (blocking: run it off the IOLoop)."""
    settings = state.settings
    sample = None
    if settings.gpu_lab_metrics or settings.dcgm_metrics:  # no NVML call when neither is on
        latest = state.hub.fresh_latest()
        sample = sample_to_wire(latest) if latest is not None else {"host": {}, "gpus": []}
    registry = CollectorRegistry(auto_describe=False)
    registry.register(GpuLabCollector(state, settings, sample))
    body = generate_latest(registry)
    if settings.dcgm_metrics and sample is not None:
        body += dcgm.exposition(sample.get("gpus") or [], socket.gethostname()).encode()
    return body
