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
    registry is private); `devices` are the GPU indices or CPU slots held or asked for. A cell
    that does not apply is blank (""): a holder's `position` and `waiting_s`, another user's
    `name`."""
    import pandas as pd

    rows = host_queue()
    names = {}
    if rows:
        reg = registry or Registry()
        for r in rows:
            got = reg.get_run(r.run_id)
            names[r.run_id] = got.get("name") if got else None
    now = time.time()
    # blanks, not None/NaN/<NA>: the table is read by people (a column of numbers and blanks is
    # an object column; `table[table.state == "waiting"].waiting_s.astype(float)` for sums)
    return pd.DataFrame([{
        "run": r.run_id, "name": names.get(r.run_id) or "", "user": r.user, "state": r.state,
        "position": r.position if r.position is not None else "", "priority": r.priority,
        "devices": r.devices if r.devices is not None else f"any {r.count}",
        "waiting_s": round(now - r.since, 1) if r.state == "waiting" else "",
    } for r in rows], columns=COLUMNS)


def held_by(run_ids: set[str]) -> dict[str, list[str]]:
    """For each of these runs that waits in the host's queue, the users who hold what it waits
    for (the devices it asked for by index, else any of its kind), sorted: what a queued run's
    line says, rather than the other users' runs, which are theirs to name."""
    rows = host_queue()
    holders = [r for r in rows if r.state == "holding"]
    out = {}
    for r in rows:
        if r.state != "waiting" or r.run_id not in run_ids:
            continue
        want = set(r.devices) if r.devices is not None else None
        out[r.run_id] = sorted({h.user for h in holders if h.kind == r.kind and (
            want is None or want & set(h.devices or ()))})
    return out

