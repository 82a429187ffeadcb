"""How big the registry's WAL grows while a run records 1M events and a reader keeps reading,
with the writer's periodic checkpoint (what gpu_lab does) side by side with SQLite's automatic
passive checkpoint alone (what it did before).

The writer adds batches of 1,000 metric events (the recorder's batches, six metrics per event)
through Registry.add_events. A reader process does what the server and an attached kernel do, in a
loop: list the runs, read the events after the last one seen in a read transaction that it holds
for HOLD seconds (a slow page fold). The WAL file's size is sampled after every batch; the figure
is its largest size, and the write rate in events/s. Target: the WAL stays under 64 MB.

    .venv/bin/python bench/registry_wal.py [--events 1000000] [--hold 0.2]
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_lab.record import registry as registry_mod
from gpu_lab.record.registry import Registry

METRICS = ("loss", "lr", "samples_per_s", "step_time", "data_wait", "epoch")


def _reader(path: str, run_id: str, hold: float, stop) -> None:
    reg = Registry(path)
    after = 0
    while not stop.is_set():
        reg.list_runs(with_last=True)
        c = reg._conn()
        c.execute("BEGIN")  # a read transaction held open: what pins the WAL
        page = reg.events(run_id, after=after, limit=5000)
        time.sleep(hold)  # the bench's model of a slow reader, not synchronisation
        c.execute("COMMIT")
        after = page[-1]["seq"] if page else after


def measure(n_events: int, hold: float, checkpoint: bool) -> dict:
    registry_mod.CHECKPOINT_BYTES = 32 * 2**20 if checkpoint else 2**62
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "registry.db")
        reg = Registry(path)
        reg.create_run("bench", status="running")
        ctx = mp.get_context("spawn")
        stop = ctx.Event()
        reader = ctx.Process(target=_reader, args=(path, "bench", hold, stop))
        reader.start()
        batch = [{"rank": 0, "kind": "metric", "t": 0.0, "step": 0,
                  "data": {m: 0.5 for m in METRICS}} for _ in range(1000)]
        biggest, t0 = 0, time.perf_counter()
        for i in range(n_events // len(batch)):
            for j, e in enumerate(batch):
                e["step"] = e["t"] = i * len(batch) + j
            reg.add_events("bench", batch)
            try:
                biggest = max(biggest, os.stat(path + "-wal").st_size)
            except FileNotFoundError:
                pass
        rate = n_events / (time.perf_counter() - t0)
        stop.set()
        reader.join(30)
        return {"max_wal_mb": biggest / 2**20, "events_per_s": rate}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--hold", type=float, default=0.2, help="s the reader holds each read")
    args = ap.parse_args()
    with_cp = measure(args.events, args.hold, checkpoint=True)
    without = measure(args.events, args.hold, checkpoint=False)
    for name, r in (("periodic TRUNCATE checkpoint", with_cp), ("passive autocheckpoint only", without)):
        print(f"{name:30s} largest WAL {r['max_wal_mb']:8.1f} MB   {r['events_per_s']:9.0f} events/s")
    print(f"WAL ratio (passive only / periodic): {without['max_wal_mb'] / max(with_cp['max_wal_mb'], 1e-9):.1f}x"
          f"; target < 64 MB: {'met' if with_cp['max_wal_mb'] < 64 else 'NOT met'}")


if __name__ == "__main__":
    main()
