"""The event schema: the only thing that crosses the process boundary between workers and kernel.

An event is a plain dict, JSON-serialisable, with these keys:

    run   str    the run id
    rank  int    global rank of the sender (-1: the supervisor)
    kind  str    one of KINDS
    t     float  wall time (time.time()) when the event was made
    step  int | None
    data  dict   kind-specific payload: for "metric", {name: float}; for "status", {"status": str,
                 "reason": str, ...}; for "error", {"type", "message", "traceback", "category"};
                 for "log", {"text": str}; for "dropped", {"count": int}
    seq   int    given by the run's recorder when it writes the event to the registry: the
                 event's position in the run's record (absent on the way from a rank)

Events travel in batches (a JSON list) so that one send carries many reports.
"""
from __future__ import annotations

import json
from typing import Any

METRIC = "metric"
STATUS = "status"
ERROR = "error"
LOG = "log"
DROPPED = "dropped"
KINDS = (METRIC, STATUS, ERROR, LOG, DROPPED)

# A run's status, as the registry keeps it and status events carry it.
ACTIVE_STATUSES = ("pending", "running", "stopping")
FINAL_STATUSES = ("succeeded", "failed", "stopped", "lost")
STATUSES = ACTIVE_STATUSES + FINAL_STATUSES

# Environment variables that a launch sets for its workers (and run_entry for headless runs).
ENV_RUN_ID = "GPU_LAB_RUN_ID"
ENV_ADDRESS = "GPU_LAB_EVENTS"       # zmq address the run's recorder listens on
ENV_RUN_DIR = "GPU_LAB_RUN_DIR"      # logs, result, control files of this run
ENV_DEVICE = "GPU_LAB_DEVICE"        # "cuda" or "cpu": what gpu_lab.accelerator() should use


def make(run: str, rank: int, kind: str, data: dict[str, Any], step: int | None = None,
         t: float | None = None) -> dict[str, Any]:
    import time

    if kind not in KINDS:
        raise ValueError(f"event kind: got {kind!r}; accepted: {', '.join(KINDS)}")
    return {"run": run, "rank": int(rank), "kind": kind, "t": time.time() if t is None else t,
            "step": step, "data": data}


def encode(batch: list[dict[str, Any]]) -> bytes:
    return json.dumps(batch, separators=(",", ":"), default=_default).encode()


def decode(raw: bytes) -> list[dict[str, Any]]:
    batch = json.loads(raw)
    if isinstance(batch, dict):
        batch = [batch]
    return [e for e in batch if isinstance(e, dict) and e.get("kind") in KINDS]


def _default(o: Any) -> Any:
    try:
        return float(o)
    except Exception:
        return repr(o)
