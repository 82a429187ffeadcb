"""A Grafana dashboard for what gpu_lab's server exports on /gpu-lab/metrics.

GPU panels query DCGM-exporter's series (DCGM_FI_DEV_*), so the same dashboard shows nodes where
a DCGM-exporter runs instead of gpu_lab; run panels query gpu_lab_run_*, named after the run
through gpu_lab_run_info. The data source is a dashboard variable (`${DS_PROMETHEUS}`, of type
datasource), so the JSON imports as is, through Grafana's "Import dashboard" or a provisioning
folder, and the viewer picks the Prometheus data source at the top of the dashboard.

    from gpu_lab.export.grafana import dashboard, dashboard_json
    json_text = dashboard_json()            # what `gpu-lab export grafana` prints
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DATASOURCE = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
FILE = "gpu_lab_grafana.json"
SCHEMA_VERSION = 37  # Grafana 9.x; later versions migrate older schemas on import

# The GPU selectors every GPU panel shares: the Hostname and gpu variables (multi-value, "All").
_GPU = 'Hostname=~"$Hostname", gpu=~"$gpu"'
# Runs are named through gpu_lab_run_info; `on` lists the target labels so that two jobs
# scraping one server (or two servers sharing a registry) never make the join many-to-many.
_RUN_NAME = "* on(job, instance, run_id) group_left(name) gpu_lab_run_info"


@dataclass(frozen=True)
class Panel:
    title: str
    expr: str
    unit: str
    legend: str
    description: str


GPU_PANELS = (
    Panel("GPU utilisation", f"DCGM_FI_DEV_GPU_UTIL{{{_GPU}}}", "percent",
          "{{Hostname}} GPU {{gpu}}",
          "Share of time a kernel ran on the GPU (nvidia-smi's GPU-Util). Keep it "
          "above 70% during training; lower usually means the input pipeline is the limit."),
    Panel("GPU memory used", f"DCGM_FI_DEV_FB_USED{{{_GPU}}}", "mbytes",
          "{{Hostname}} GPU {{gpu}}",
          "Device memory in use (MiB). Near the board's total, the next larger batch runs out "
          "of memory."),
    Panel("GPU power", f"DCGM_FI_DEV_POWER_USAGE{{{_GPU}}}", "watt",
          "{{Hostname}} GPU {{gpu}}",
          "Board power draw (W). A busy GPU pinned at its power limit clocks down."),
    Panel("GPU temperature", f"DCGM_FI_DEV_GPU_TEMP{{{_GPU}}}", "celsius",
          "{{Hostname}} GPU {{gpu}}",
          "Core temperature (°C). Rising towards the slowdown temperature: check the cooling."),
)
RUN_PANELS = (
    Panel("Loss per run", f'gpu_lab_run_last_loss{{run_id=~"$run_id"}} {_RUN_NAME}', "none",
          "{{name}} ({{run_id}})", "Last reported loss of each run, as the server scrapes it."),
    Panel("Samples/s per run", f'gpu_lab_run_samples_per_second{{run_id=~"$run_id"}} {_RUN_NAME}',
          "none", "{{name}} ({{run_id}})",
          "Training throughput over all ranks (samples/s) of each active run."),
    Panel("Data-wait share per run",
          f'gpu_lab_run_data_wait_ratio{{run_id=~"$run_id"}} {_RUN_NAME}', "percentunit",
          "{{name}} ({{run_id}})",
          "Share of each step spent waiting for the next batch. Above 20% the GPUs wait for data: "
          "more loader workers, shards instead of single files, or a faster disk."),
    Panel("Host CPU", "gpu_lab_host_cpu_percent", "percent", "{{instance}}",
          "CPU busy on the Jupyter server's host, all cores (gpu_lab's own series)."),
)


def _query_variable(name: str, label: str, query: str) -> dict:
    return {
        "name": name, "label": label, "type": "query", "datasource": DATASOURCE,
        "query": query, "definition": query, "refresh": 2, "sort": 1,
        "multi": True, "includeAll": True, "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "hide": 0, "options": [], "regex": "", "skipUrlSync": False,
    }


def _panel(p: Panel, panel_id: int, x: int, y: int) -> dict:
    return {
        "id": panel_id, "type": "timeseries", "title": p.title, "description": p.description,
        "datasource": DATASOURCE,
        "gridPos": {"h": 8, "w": 12, "x": x, "y": y},
        "fieldConfig": {
            "defaults": {"unit": p.unit, "color": {"mode": "palette-classic"},
                         "custom": {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10,
                                    "showPoints": "never", "spanNulls": False}},
            "overrides": [],
        },
        "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True,
                               "calcs": []},
                    "tooltip": {"mode": "multi", "sort": "none"}},
        "targets": [{"refId": "A", "datasource": DATASOURCE, "expr": p.expr,
                     "legendFormat": p.legend, "range": True, "instant": False,
                     "editorMode": "code"}],
    }


def _row(title: str, panel_id: int, y: int) -> dict:
    return {"id": panel_id, "type": "row", "title": title, "collapsed": False, "panels": [],
            "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}}


def dashboard(title: str = "gpu_lab: GPUs and training runs", uid: str = "gpu-lab") -> dict:
    """The dashboard as a dict (Grafana's JSON model)."""
    panels: list[dict] = []
    y, pid = 0, 1
    for row_title, group in (("GPUs", GPU_PANELS), ("Training runs", RUN_PANELS)):
        panels.append(_row(row_title, pid, y))
        pid, y = pid + 1, y + 1
        for i, p in enumerate(group):
            panels.append(_panel(p, pid, 12 * (i % 2), y + 8 * (i // 2)))
            pid += 1
        y += 8 * ((len(group) + 1) // 2)
    return {
        "__inputs": [],
        "__requires": [
            {"type": "grafana", "id": "grafana", "name": "Grafana", "version": "9.0.0"},
            {"type": "datasource", "id": "prometheus", "name": "Prometheus", "version": "1.0.0"},
            {"type": "panel", "id": "timeseries", "name": "Time series", "version": ""},
        ],
        "id": None, "uid": uid, "title": title,
        "description": "GPU telemetry (DCGM-exporter names, from gpu_lab's Jupyter server or a "
                       "DCGM-exporter) and gpu_lab training runs. Exported by `gpu-lab export "
                       "grafana`.",
        "tags": ["gpu_lab", "gpu", "dcgm", "training"],
        "editable": True, "graphTooltip": 1, "liveNow": False, "schemaVersion": SCHEMA_VERSION,
        "version": 1, "refresh": "10s", "time": {"from": "now-1h", "to": "now"},
        "timepicker": {}, "timezone": "", "fiscalYearStartMonth": 0, "links": [],
        "annotations": {"list": []},
        "templating": {"list": [
            {"name": "DS_PROMETHEUS", "label": "Prometheus", "type": "datasource",
             "query": "prometheus", "current": {}, "hide": 0, "refresh": 1, "regex": "",
             "options": [], "includeAll": False, "multi": False, "skipUrlSync": False},
            _query_variable("Hostname", "Host", "label_values(DCGM_FI_DEV_GPU_UTIL, Hostname)"),
            _query_variable("gpu", "GPU",
                            'label_values(DCGM_FI_DEV_GPU_UTIL{Hostname=~"$Hostname"}, gpu)'),
            _query_variable("run_id", "Run", "label_values(gpu_lab_run_info, run_id)"),
        ]},
        "panels": panels,
    }


def dashboard_json(**kw: Any) -> str:
    return json.dumps(dashboard(**kw), indent=2) + "\n"


def write_dashboard(directory: str | Path, **kw: Any) -> Path:
    """Write the dashboard JSON to directory/FILE and return its path."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    p = d / FILE
    p.write_text(dashboard_json(**kw))
    return p


__all__ = ["dashboard", "dashboard_json", "write_dashboard", "GPU_PANELS", "RUN_PANELS", "Panel",
           "FILE"]
