"""Jupyter server extension: authenticated REST and WebSocket endpoints over gpu_lab's shared
telemetry sampler and run registry, plus a Prometheus exposition.

Thin handlers (handlers.py) over one per-server state object (state.py): a telemetry hub that holds
the single subscription to the shared sampler however many browsers connect (hub.py), live run
feeds that read each followed run once per tick for every browser that follows it (feeds.py), what
the run view reads from a run's record and folder (runview.py), the run registry, and a small
thread pool so that SQLite, NVML, files and process signalling never run on the IOLoop. Prometheus
metrics are built in metrics.py (DCGM-exporter names in dcgm.py), and the extension's settings
(`c.GpuLabServer.*`) are in settings.py.

Endpoints (under the server's base_url):

    GET  gpu-lab/api/info                  version, GPU count, tutorials index path
    GET  gpu-lab/api/telemetry?n=60        latest sample + the last n samples
    WS   gpu-lab/api/telemetry/ws          streams samples; client sends {"interval": s}, s >= 0.25;
                                           {"follow": id, "after": seq, "logs": {file: offset}}
                                           pushes that run's new events, log lines and status
    GET  gpu-lab/api/runs                  runs from the registry, with last step and loss
    GET  gpu-lab/api/runs/<id>?points=1000 the run view's start: row, config, bounded series per
                                           rank and their mean, notes, triage, log tails, seq
    GET  gpu-lab/api/runs/<id>/events?after=N&limit=M   the run's events after seq N
    GET  gpu-lab/api/runs/<id>/logs/<file>?offset=B     whole lines of rank<N>.log or
                                           supervisor.log from byte B (-1: the tail)
    POST gpu-lab/api/runs/<id>/stop        gpu_lab.launch.stop_run(id)
    POST gpu-lab/api/runs/<id>/checkpoint  a checkpoint at the next step boundary
    POST gpu-lab/api/runs/<id>/resume      gpu_lab.attach(id).resume(): a run that continues it
    GET  gpu-lab/api/compare?runs=a,b      each run's mean curves and the config fields that differ
    GET  gpu-lab/metrics                   Prometheus text format: gpu_lab_* and DCGM-exporter
                                           names (c.GpuLabServer.gpu_lab_metrics, dcgm_metrics,
                                           run_metrics switch each family; see settings.py)
"""
from __future__ import annotations

from typing import Any


def _jupyter_server_extension_points() -> list[dict]:
    return [{"module": "gpu_lab.server"}]


def _load_jupyter_server_extension(serverapp: Any) -> None:
    from .handlers import handlers
    from .settings import GpuLabServer
    from .state import ServerState

    web_app = serverapp.web_app
    settings = GpuLabServer(parent=serverapp)  # c.GpuLabServer.* from the server's config
    state = ServerState(root_dir=getattr(serverapp, "root_dir", None), log=serverapp.log,
                        settings=settings)
    web_app.settings["gpu_lab"] = state
    web_app.add_handlers(".*$", handlers(web_app.settings["base_url"]))
    _close_with_server(serverapp, state)
    serverapp.log.info("gpu_lab server extension loaded: %s", ", ".join(
        f"{web_app.settings['base_url']}{p}" for p in ("gpu-lab/api", "gpu-lab/metrics")))


def _close_with_server(serverapp: Any, state: Any) -> None:
    """Release the sampler subscription and the thread pool when the server shuts down.

    Function-style server extensions get no stop hook (only ExtensionApp subclasses do), so wrap
    the server's own async cleanup, which runs while the IOLoop is still alive.
    """
    original = serverapp._cleanup

    async def _cleanup() -> None:
        state.close()
        await original()

    serverapp._cleanup = _cleanup
