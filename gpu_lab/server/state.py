"""Per-server state shared by every handler: the thread pool, the registry, the telemetry hub."""
from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from .hub import TelemetryHub
from .settings import GpuLabServer
from .wire import run_to_wire

# Where the tutorials index may sit relative to the server's root directory: `make lab` serves
# notebooks/ itself, a plain `jupyter lab` in a clone serves the repository root.
TUTORIALS_INDEX = ("00_overview.ipynb", "notebooks/00_overview.ipynb")


def _default_sampler() -> Any:
    from gpu_lab.telemetry import get_sampler

    return get_sampler()


class ServerState:
    """Everything the handlers share. One per Jupyter server."""

    def __init__(self, *, root_dir: str | None = None, log: logging.Logger | None = None,
                 sampler_factory: Callable[[], Any] = _default_sampler,
                 settings: GpuLabServer | None = None) -> None:
        self.root_dir = Path(root_dir) if root_dir else Path.cwd()
        self.log = log or logging.getLogger("gpu_lab.server")
        self.settings = settings if settings is not None else GpuLabServer()
        # SQLite queries, NVML calls and process signalling block: they run here, never on the
        # IOLoop. Four threads: a slow stop (graceful SIGTERM wait) must not starve the lists.
        self.executor = ThreadPoolExecutor(max_workers=4, thread_name_prefix="gpu-lab-server")
        self.sampler_factory = sampler_factory
        self.hub = TelemetryHub(sampler_factory, self.executor, self.log)
        self._registry: Any = None

    # --- registry -------------------------------------------------------------------------------
    @property
    def registry(self) -> Any:
        from gpu_lab.registry import Registry

        if self._registry is None:
            self._registry = Registry()
        return self._registry

    def list_runs(self, limit: int = 100) -> list[dict]:
        return [run_to_wire(r) for r in self.registry.list_runs(limit=limit, with_last=True)]

    def get_run(self, run_id: str, max_points: int = 500) -> dict | None:
        """A run with its rank-0 metric series, each decimated to at most max_points points."""
        from gpu_lab.stream.history import decimate_minmax

        row = self.registry.get_run(run_id)
        if row is None:
            return None
        out = run_to_wire({**row, **self.registry.last_values(run_id)})
        out["config"] = row.get("config") or {}
        series: dict[str, tuple[list, list]] = {}
        for m in self.registry.metrics(run_id, rank=0):
            if m["value"] is None:
                continue
            xs, ys = series.setdefault(m["name"], ([], []))
            xs.append(m["step"] if m["step"] is not None else len(xs))
            ys.append(m["value"])
        out["metrics"] = {}
        for name, (xs, ys) in sorted(series.items()):
            dx, dy = decimate_minmax(xs, ys, max_points)
            out["metrics"][name] = {"step": dx, "value": dy}
        return out

    def stop_run(self, run_id: str) -> dict:
        """Stop a run through the launcher (graceful, then forceful) and return its new row."""
        from gpu_lab.launch import stop_run

        stop_run(run_id, registry=self.registry)
        row = self.registry.get_run(run_id)
        return run_to_wire({**row, **self.registry.last_values(run_id)})

    # --- info -----------------------------------------------------------------------------------
    def info(self) -> dict:
        from gpu_lab import __version__
        from gpu_lab.telemetry_probe import gpu_count

        index = next((p for p in TUTORIALS_INDEX if (self.root_dir / p).is_file()), None)
        return {
            "version": __version__,
            "gpu_count": gpu_count(),
            "tutorials_index": index,
            "registry": os.fspath(self.registry.path),
        }

    # --- telemetry ------------------------------------------------------------------------------
    def telemetry(self, n: int) -> dict:
        return self.hub.snapshot(n)

    def close(self) -> None:
        self.hub.close()
        self.executor.shutdown(wait=False, cancel_futures=True)
