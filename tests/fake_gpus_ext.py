"""A test-only Jupyter server extension: on a host without a GPU, the server's process-wide
telemetry sampler reads two FakeNVML boards (gpu_lab.telemetry.doubles, a named double), so a real
server, scraped by a real Prometheus, exports GPU series. On a host with a GPU it does nothing and
the real NVML path is what gets scraped. Enabled by the Prometheus test's server config only."""
from __future__ import annotations

import os
from typing import Any


def _jupyter_server_extension_points() -> list[dict]:
    return [{"module": "fake_gpus_ext"}]


def _load_jupyter_server_extension(serverapp: Any) -> None:
    from gpu_lab.telemetry import NVMLSampler, Sampler
    from gpu_lab.telemetry import sampler as sampler_mod
    from gpu_lab.telemetry.doubles import FakeNVML
    from gpu_lab.telemetry.probe import gpu_count

    if gpu_count() > 0:
        serverapp.log.info("fake_gpus_ext: real GPUs present, FakeNVML not used")
        return
    sampler_mod._sampler = Sampler(gpu=NVMLSampler(nvml=FakeNVML(2), visible=None))
    sampler_mod._sampler_pid = os.getpid()
    serverapp.log.info("fake_gpus_ext: the server's sampler reads 2 FakeNVML boards")
