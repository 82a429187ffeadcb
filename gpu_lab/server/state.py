"""Per-server state shared by every handler: the thread pool, the registry, the telemetry hub and
the live run feeds."""
from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from . import runview, sweeps
from .feeds import RunFeeds
from .hub import TelemetryHub
from .settings import GpuLabServer
from .wire import run_to_wire

# Where the tutorials index may sit relative to the server's root directory: `make lab` serves
# notebooks/ itself, a plain `jupyter lab` in a clone serves the repository root.
TUTORIALS_INDEX = ("00_overview.ipynb", "notebooks/00_overview.ipynb")
STOP_REASON = "stopped from JupyterLab"


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
        self.feeds = RunFeeds(lambda: self.registry, self.executor, self.log,
                              sampler=sampler_factory,
                              receiver=self._receiver if self.settings.live_push else None)
        self._registry: Any = None
        self._sweep_specs: dict[str, dict] = {}  # a sweep's settings never change: read once

    def _receiver(self) -> Any:
        """The server's own follower of the runs' recorders (the feeds' doorbell)."""
        from ..readers.receiver import Receiver

        return Receiver(self.registry)

    # --- registry -------------------------------------------------------------------------------
    @property
    def registry(self) -> Any:
        from gpu_lab.record.registry import Registry

        if self._registry is None:
            self._registry = Registry()
        return self._registry

    def registry_path(self) -> Path:
        """Where the registry is, without opening it (for messages about a registry that fails)."""
        if self._registry is not None:
            return self._registry.path
        from gpu_lab.record.registry import home

        return home() / "registry.db"

    def runs_and_sweeps(self, limit: int = 100, offset: int = 0, find: Any = None) -> dict:
        """The newest `limit` runs after `offset` of those `find` names (a RunQuery; all without
        one), those of a sweep tagged with their trial, a summary of each sweep among them
        (sweeps.py), and how many runs the search names in all (`total`)."""
        rows = self.registry.list_runs(limit=limit, offset=offset, find=find, with_last=True)
        wire = [run_to_wire(r) for r in rows]
        queued = {w["id"] for w in wire if w["status"] == "queued"}
        if queued:  # who holds what they wait for: read from the host's queue only then
            from gpu_lab.launch.hostqueue import held_by

            holders = held_by(queued)
            for w in wire:
                if w["id"] in holders:
                    w["held_by"] = holders[w["id"]]
        sweeps.tag_runs(wire, rows, self._sweep_specs)
        whole = len(rows) < limit and offset == 0 and find is None
        total = len(rows) + offset if len(rows) < limit else self.registry.count_runs(find)
        return {"runs": wire, "total": total, "offset": offset,
                "sweeps": sweeps.summaries(self.registry, rows, whole, self._sweep_specs)}

    def get_run(self, run_id: str, points: int = runview.DEFAULT_POINTS) -> dict | None:
        """What the run view opens with (runview.detail): row, config, bounded series of every
        rank and their mean, notes, failure triage, log tails, and where to follow from."""
        return runview.detail(self.registry, run_id, points)

    def events(self, run_id: str, after: int, limit: int) -> dict | None:
        return runview.events_since(self.registry, run_id, after, limit)

    def read_log(self, run_id: str, name: str, offset: int) -> dict | None:
        row = self.registry.get_run(run_id)
        if row is None:
            return None
        return runview.read_log(row.get("run_dir"), name, offset)

    def stop_run(self, run_id: str) -> dict:
        """Stop a run through the launcher (graceful, then forceful) and return its new row."""
        from gpu_lab.launch import stop_run

        stop_run(run_id, registry=self.registry, reason=STOP_REASON)
        return runview.row_to_wire(self.registry, self.registry.get_run(run_id))

    def request_checkpoint(self, run_id: str) -> dict:
        return runview.request_checkpoint(self.registry, run_id)

    def resume(self, run_id: str) -> dict:
        return runview.resume(self.registry, run_id)

    def compare(self, run_ids: list[str], points: int) -> dict:
        return runview.compare(self.registry, run_ids, points)

    # --- info -----------------------------------------------------------------------------------
    def info(self) -> dict:
        from gpu_lab import __version__
        from gpu_lab.telemetry.probe import gpu_count

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
        self.feeds.close()
        self.hub.close()
        self.executor.shutdown(wait=False, cancel_futures=True)
