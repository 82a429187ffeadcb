"""How many events per second a run's record takes in, side by side with the kernel receiver that
gpu_lab used before runs owned their record.

Two rank processes report as fast as they can (fit's six metrics per event: loss, lr,
samples_per_s, step_time, data_wait, epoch) for a fixed number of events each. The same load goes,
in alternating rounds, to:

- recorder: the run's recorder process (`gpu_lab.stream.recorder.spawn`, what a launched run uses):
  events numbered and written to the registry's event log in batches, bounded memory;
- kernel receiver (before): a copy of the pre-recorder path (commit a48cc40): a receiver thread
  that added each event to the Run's history and wrote one registry row per scalar.

For each round it prints events stored per second (stored / time from the first report to the
last stored event), events dropped at the ranks (counted, never waited for), the slowest
`report()` call in the ranks, and, for the recorder, the most events it held waiting for the
database. Target: the recorder stores >= 100,000 events/s with bounded memory, and no report()
call waits on it.

    .venv/bin/python bench/recorder_throughput.py [--events 200000] [--rounds 3]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from gpu_lab.registry import Registry
from gpu_lab.stream import Reporter
from gpu_lab.stream import events as ev

METRICS = ("loss", "lr", "samples_per_s", "step_time", "data_wait", "epoch")


def _rank(address: str, run_id: str, rank: int, n: int, start, out) -> None:
    """One rank: n report() calls as fast as possible; the slowest call and the drops."""
    rep = Reporter(address=address, run_id=run_id, rank=rank, interval=0.05)
    start.wait()
    worst, t0 = 0.0, time.perf_counter()
    for step in range(n):
        t = time.perf_counter()
        rep.report(step, loss=0.5, lr=1e-3, samples_per_s=1000.0, step_time=0.01,
                   data_wait=0.001, epoch=1.0)
        worst = max(worst, time.perf_counter() - t)
    elapsed = time.perf_counter() - t0
    rep.close(10.0)
    out.put({"rank": rank, "worst_us": worst * 1e6, "dropped": rep.dropped, "sent": rep.sent,
             "report_s": elapsed, "t0": t0})


class OldKernelReceiver:
    """The kernel side as it was before this change: a PULL socket and a thread that hands each
    batch to the Run (bounded history) and inserts one row per scalar into the registry."""

    def __init__(self, db: Path) -> None:
        import zmq

        from gpu_lab.stream.history import MetricHistory

        self.c = sqlite3.connect(db, isolation_level=None, check_same_thread=False)
        self.c.execute("PRAGMA journal_mode=WAL")
        self.c.execute("PRAGMA synchronous=NORMAL")
        self.c.execute("CREATE TABLE IF NOT EXISTS metrics (run_id TEXT NOT NULL, rank INTEGER "
                       "NOT NULL, step INTEGER, t REAL NOT NULL, name TEXT NOT NULL, value REAL)")
        self.c.execute("CREATE INDEX IF NOT EXISTS metrics_run ON metrics(run_id, name, rank, step)")
        self.history = MetricHistory()
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.RCVHWM, 1000)
        self.address = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.stored = 0
        self.last = 0.0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while not self.stop.is_set():
            if not dict(poller.poll(100)):
                continue
            batch = []
            for _ in range(1000):
                try:
                    batch.extend(ev.decode(self.sock.recv(zmq.NOBLOCK)))
                except zmq.Again:
                    break
            rows = []
            for e in batch:
                if e["kind"] == ev.METRIC:
                    self.history.add(e["rank"], e.get("step"), e["t"], e["data"])
                    rows += [("bench", e["rank"], e.get("step"), e["t"], k, v)
                             for k, v in e["data"].items()]
            self.c.execute("BEGIN")
            self.c.executemany("INSERT INTO metrics VALUES (?,?,?,?,?,?)", rows)
            self.c.execute("COMMIT")
            self.stored += sum(1 for e in batch if e["kind"] == ev.METRIC)
            self.last = time.perf_counter()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close(0)
        self.ctx.term()


def _load(address: str, run_id: str, n: int) -> tuple[list[dict], float]:
    ctx = mp.get_context("fork")
    start, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(address, run_id, r, n, start, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    time.sleep(0.5)  # both ranks connected and waiting
    t0 = time.perf_counter()
    start.set()
    ranks = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(60)
    return ranks, t0


def _stored_metrics(db: Path, run_id: str) -> tuple[int, float | None]:
    c = sqlite3.connect(db)
    n = c.execute("SELECT COUNT(*) FROM events WHERE run_id=? AND kind='metric'", (run_id,)).fetchone()[0]
    c.close()
    return n


def round_recorder(tmp: Path, n: int) -> dict:
    from gpu_lab.stream import recorder

    db = tmp / "recorder.db"
    run_id = f"bench-{time.time_ns()}"
    Registry(db).create_run(run_id, status="pending")
    log = tmp / "recorder.log"
    proc, where = recorder.spawn(str(db), run_id, str(log))
    ranks, t0 = _load(where["address"], run_id, n)
    sent = sum(r["sent"] for r in ranks)
    deadline = time.monotonic() + 120
    stored = 0
    while time.monotonic() < deadline:  # polling a reader: the recorder itself is not slowed
        stored = _stored_metrics(db, run_id)
        if stored >= sent:
            break
        time.sleep(0.01)
    t_end = time.perf_counter()
    recorder.end(proc, {"status": "succeeded"})
    peak = None
    for line in log.read_text().splitlines():
        if "waiting for the database" in line:
            peak = int(line.split("at most ")[1].split()[0])
    return {"path": "recorder", "stored": stored, "per_s": stored / (t_end - t0),
            "dropped": sum(r["dropped"] for r in ranks),
            "worst_report_us": max(r["worst_us"] for r in ranks), "peak_pending": peak}


def round_old(tmp: Path, n: int) -> dict:
    recv = OldKernelReceiver(tmp / f"old-{time.time_ns()}.db")
    ranks, t0 = _load(recv.address, "bench", n)
    sent = sum(r["sent"] for r in ranks)
    deadline = time.monotonic() + 120
    while recv.stored < sent and time.monotonic() < deadline:
        time.sleep(0.01)
    per_s = recv.stored / (recv.last - t0)
    recv.close()
    return {"path": "kernel receiver (before)", "stored": recv.stored, "per_s": per_s,
            "dropped": sum(r["dropped"] for r in ranks),
            "worst_report_us": max(r["worst_us"] for r in ranks), "peak_pending": None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--events", type=int, default=200_000, help="report() calls per rank")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="gpu_lab_bench_recorder_"))
    results = []
    for i in range(args.rounds):
        for fn in (round_recorder, round_old) if i % 2 == 0 else (round_old, round_recorder):
            r = fn(tmp, args.events)
            results.append(r)
            print(f"round {i + 1}: {r['path']:<25} {r['per_s']:>10,.0f} events/s stored "
                  f"({r['stored']:,} stored, {r['dropped']:,} dropped and counted at the ranks), "
                  f"slowest report() {r['worst_report_us']:,.0f} µs"
                  + (f", at most {r['peak_pending']:,} events waiting for the database"
                     if r["peak_pending"] is not None else ""), flush=True)
    new = [r["per_s"] for r in results if r["path"] == "recorder"]
    old = [r["per_s"] for r in results if r["path"] != "recorder"]
    ratio = statistics.median(new) / statistics.median(old)
    verdict = "met" if statistics.median(new) >= 100_000 else "MISSED"
    print(f"\nrecorder: median {statistics.median(new):,.0f} events/s (target >= 100,000: {verdict}); "
          f"kernel receiver before: median {statistics.median(old):,.0f} events/s; "
          f"recorder / before = {ratio:.2f}x")
    print(json.dumps({"recorder_per_s": new, "before_per_s": old, "ratio": ratio}))


if __name__ == "__main__":
    sys.exit(main())
