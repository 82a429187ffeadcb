"""GPU telemetry under NVIDIA DCGM-exporter's metric names, units and labels.

Ops teams that already run DCGM-exporter, Prometheus and Grafana get gpu_lab's NVML readings in
the series their dashboards and alerts query: `DCGM_FI_DEV_GPU_UTIL{gpu="0", UUID="GPU-...",
device="nvidia0", modelName="NVIDIA H100 80GB HBM3", Hostname="node7"}`. Names and types follow
dcgm-exporter's default counters file (etc/default-counters.csv) and DCGM's field list; units are
DCGM's (MiB, W, MHz, %, °C), not gpu_lab's base units.

Labels: `gpu` is the NVML index of the board (DCGM numbers every GPU of the node, whatever
CUDA_VISIBLE_DEVICES says), `device` is `nvidia<NVML index>`, which is the /dev/nvidiaN minor
number on the usual hosts where both follow the PCI bus order. dcgm-exporter's `pci_bus_id` label
is not given: gpu_lab's sampler does not read it.

The text is written here rather than through prometheus_client because DCGM counters keep their
own names (`DCGM_FI_DEV_ECC_SBE_VOL_TOTAL`), where prometheus_client would append `_total`.
"""
from __future__ import annotations

import math
from typing import Iterable

from prometheus_client.utils import floatToGoString

#: (DCGM field name, Prometheus type, help, key in a gpu_lab telemetry sample). Units: DCGM's.
FIELDS: tuple[tuple[str, str, str, str], ...] = (
    ("DCGM_FI_DEV_SM_CLOCK", "gauge", "SM clock (MHz).", "clock_sm_mhz"),
    ("DCGM_FI_DEV_MEM_CLOCK", "gauge", "Memory clock (MHz).", "clock_mem_mhz"),
    ("DCGM_FI_DEV_MAX_SM_CLOCK", "gauge", "Maximum SM clock (MHz).", "clock_sm_max_mhz"),
    ("DCGM_FI_DEV_MAX_MEM_CLOCK", "gauge", "Maximum memory clock (MHz).", "clock_mem_max_mhz"),
    ("DCGM_FI_DEV_GPU_TEMP", "gauge", "GPU temperature (C).", "temperature_c"),
    ("DCGM_FI_DEV_POWER_USAGE", "gauge", "Power draw (W).", "power_w"),
    ("DCGM_FI_DEV_ENFORCED_POWER_LIMIT", "gauge", "Power limit the driver enforces (W).",
     "power_limit_w"),
    ("DCGM_FI_DEV_GPU_UTIL", "gauge", "GPU utilization (%).", "util_gpu"),
    ("DCGM_FI_DEV_MEM_COPY_UTIL", "gauge", "Memory utilization (%).", "util_mem"),
    ("DCGM_FI_DEV_ENC_UTIL", "gauge", "Encoder utilization (%).", "encoder_util"),
    ("DCGM_FI_DEV_DEC_UTIL", "gauge", "Decoder utilization (%).", "decoder_util"),
    ("DCGM_FI_DEV_FB_FREE", "gauge", "Framebuffer memory free (MiB).", "mem_free_mb"),
    ("DCGM_FI_DEV_FB_USED", "gauge", "Framebuffer memory used (MiB).", "mem_used_mb"),
    ("DCGM_FI_DEV_FB_TOTAL", "gauge", "Framebuffer memory total (MiB).", "mem_total_mb"),
    ("DCGM_FI_DEV_FAN_SPEED", "gauge", "Fan speed (%).", "fan_pct"),
    ("DCGM_FI_DEV_PSTATE", "gauge", "Performance state, 0 (fastest) to 15.", "pstate"),
    ("DCGM_FI_DEV_CLOCKS_EVENT_REASONS", "gauge",
     "Reasons the clocks are held down (NVML clocks-event bitmask).", "throttle_reasons"),
    ("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "counter",
     "Single-bit (corrected) volatile ECC errors since the driver loaded.", "ecc_corrected"),
    ("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "counter",
     "Double-bit (uncorrected) volatile ECC errors since the driver loaded.", "ecc_uncorrected"),
)
NAMES = tuple(f[0] for f in FIELDS)
LABELS = ("gpu", "UUID", "device", "modelName", "Hostname")


def gpu_labels(gpu: dict, hostname: str) -> dict[str, str]:
    """DCGM-exporter's identity labels for one GPU of a telemetry sample."""
    nvml_index = gpu.get("nvml_index", gpu.get("index", ""))
    return {"gpu": str(nvml_index), "UUID": str(gpu.get("uuid") or ""),
            "device": f"nvidia{nvml_index}", "modelName": str(gpu.get("name") or ""),
            "Hostname": hostname}


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def exposition(gpus: Iterable[dict], hostname: str) -> str:
    """The DCGM families in Prometheus text format (version 0.0.4) for one sample's GPUs.

    Every family keeps its HELP and TYPE lines even without a GPU, so a scrape declares the
    names it serves; a value the board does not report (None) is left out, never sent as 0.
    """
    gpus = [g for g in gpus if isinstance(g, dict)]
    labels = [gpu_labels(g, hostname) for g in gpus]
    lines: list[str] = []
    for name, kind, doc, key in FIELDS:
        lines.append(f"# HELP {name} {_escape_help(doc)}")
        lines.append(f"# TYPE {name} {kind}")
        for g, lab in zip(gpus, labels):
            v = g.get(key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v):
                continue
            text = ",".join(f'{k}="{_escape_label(val)}"' for k, val in lab.items())
            lines.append(f"{name}{{{text}}} {floatToGoString(v)}")
    return "\n".join(lines) + "\n"


__all__ = ["FIELDS", "NAMES", "LABELS", "gpu_labels", "exposition"]
