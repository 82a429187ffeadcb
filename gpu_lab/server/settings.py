"""The server extension's settings, read from Jupyter's own configuration system.

Set them like any Jupyter server option, in `jupyter_server_config.py`:

    c.GpuLabServer.dcgm_metrics = False      # a DCGM-exporter already runs on this node

or on the command line: `jupyter lab --GpuLabServer.gpu_lab_metrics=False`.
"""
from __future__ import annotations

from traitlets import Bool
from traitlets.config import Configurable


class GpuLabServer(Configurable):
    """Settings of gpu_lab's Jupyter server extension (`c.GpuLabServer.<name>`)."""

    dcgm_metrics = Bool(True, help=(
        "Expose the GPUs on /gpu-lab/metrics under DCGM-exporter's names, units and labels "
        "(DCGM_FI_DEV_GPU_UTIL, DCGM_FI_DEV_FB_USED in MiB, ... with gpu, UUID, device, "
        "modelName, Hostname), so NVIDIA's Grafana dashboards show them. Turn off where a "
        "DCGM-exporter already exports the same GPUs.")).tag(config=True)

    gpu_lab_metrics = Bool(True, help=(
        "Expose GPU, host and sampler telemetry under gpu_lab's own names (gpu_lab_gpu_*, "
        "gpu_lab_host_*, gpu_lab_telemetry_*), in base units (bytes, hertz).")).tag(config=True)

    live_push = Bool(True, help=(
        "Read a followed run as soon as its recorder publishes new events (the run view follows "
        "within a few hundredths of a second); off: read it once a second, as before.")
                     ).tag(config=True)

    run_metrics = Bool(True, help=(
        "Expose the training runs of the registry (gpu_lab_run_*: status, step, loss, "
        "samples/s, data-wait share, learning rate).")).tag(config=True)
