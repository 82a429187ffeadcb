"""gpu_lab.queue(): the host's runs holding devices and waiting for them, every user's, as a table."""
from __future__ import annotations

import time
from typing import Any

from ..record.registry import Registry
from ..supervise.claims import host_queue

COLUMNS = ["run", "name", "user", "state", "position", "priority", "devices", "waiting_s"]


def queue(registry: Registry | None = None) -> Any:
    """A pandas DataFrame, one row per run in the host's queue: holders first, then waiters in
    the order they will start. `name` is filled for this user's own runs only (another user's
    registry is private); `devices` are the GPU indices or CPU slots held or asked for."""
    import pandas as pd

    rows = host_queue()
    names = {}
    if rows:
        reg = registry or Registry()
        for r in rows:
            got = reg.get_run(r.run_id)
            names[r.run_id] = got.get("name") if got else None
    now = time.time()
    table = pd.DataFrame([{
        "run": r.run_id, "name": names.get(r.run_id), "user": r.user, "state": r.state,
        "position": r.position, "priority": r.priority,
        "devices": r.devices if r.devices is not None else f"any {r.count}",
        "waiting_s": round(now - r.since, 1) if r.state == "waiting" else None,
    } for r in rows], columns=COLUMNS)
    table["position"] = table["position"].astype("Int64")  # a holder has none: <NA>, not 1.0
    return table
