"""How many events per second a run's record takes in, side by side with the kernel receiver that
gpu_lab used before runs owned their record.

Two measurements, each alternating the two consumers round by round:

1. capacity: a feeder process pushes ready-made batches of 2,000 events (fit's six metrics per
   event: loss, lr, samples_per_s, step_time, data_wait, epoch) as fast as the consumer takes them
   (its socket pushes back), so the consumer, not the producer, sets the pace;
2. the ranks: two rank processes call report() as fast as they can; the consumer keeps what it can
   and the ranks drop and count the rest. This shows report() never waits for the consumer.

The consumers:

- recorder (CURVE): the run's recorder process (`gpu_lab.record.recorder.spawn`, what a launched
  run uses): events numbered and written to the registry's event log in batches, bounded memory;
  its channel is private (CURVE, the run's key; gpu_lab.record.channel), so the feeder and the
  ranks encrypt and it decrypts every batch;
- recorder (no CURVE): the same Recorder in a fresh process of the same shape, with
  private=False: what the privacy costs;
- kernel receiver (before): a copy of the pre-recorder path (commit a48cc40): a receiver thread
  that added each event to the Run's history and wrote one registry row per scalar.

Events stored per second = stored / time from the first event sent to the last one stored. For the
ranks it also prints the drops (counted, never waited for) and the slowest report() call (on this
2-core VM the ranks, the consumer and the OS share two cores, so a call can wait for a core, never
for the consumer). For the recorder: the most events it held waiting for the database (its bound).
Target: the recorder, with CURVE, stores >= 100,000 events/s with bounded memory.

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

from gpu_lab.record.registry import Registry
from gpu_lab.record import Reporter
from gpu_lab.record import events as ev

METRICS = ("loss", "lr", "samples_per_s", "step_time", "data_wait", "epoch")


def _rank(address: str, key: str | None, run_id: str, rank: int, n: int, start, out) -> None:
    """One rank: n report() calls as fast as possible; the slowest call and the drops."""
    rep = Reporter(address=address, key=key, run_id=run_id, rank=rank, interval=0.05)
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

        from gpu_lab.readers.history import MetricHistory

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


def _feeder(address: str, key: str | None, run_id: str, batches: int, start, out,
            ready=None) -> None:
    """Push ready-made 2,000-event batches; a full socket makes send() wait (the consumer's pace)."""
    import zmq

    now = time.time()
    raw = [ev.encode([{"run": run_id, "rank": b % 2, "kind": "metric", "t": now, "step": b * 2000 + i,
                       "data": {"loss": 0.5, "lr": 1e-3, "samples_per_s": 1000.0,
                                "step_time": 0.01, "data_wait": 0.001, "epoch": 1.0}}
                      for i in range(2000)]) for b in range(batches)]
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, 4)
    if key is not None:
        from gpu_lab.record.channel import ClientKey

        ClientKey.decode(key).apply(sock)
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    sock.connect(address)
    if ready is not None:  # connected and, CURVE's included, handshaken
        from zmq.utils.monitor import recv_monitor_message

        if monitor.poll(30_000):
            recv_monitor_message(monitor)
        sock.disable_monitor()
        ready.set()
    monitor.close()
    start.wait()
    t0 = time.perf_counter()
    for r in raw:
        sock.send(r)
    sock.close(linger=-1)
    ctx.term()
    out.put({"sent": batches * 2000, "t0": t0})


def _feed(address: str, key: str | None, run_id: str, events: int) -> tuple[int, float]:
    ctx = mp.get_context("fork")
    start, out, ready = ctx.Event(), ctx.Queue(), ctx.Event()
    p = ctx.Process(target=_feeder, args=(address, key, run_id, events // 2000, start, out,
                                          ready))
    p.start()
    # the clock starts once the feeder has built its batches and connected (building 400,000
    # events takes it a second or more: a fixed wait counted some of that against the consumer)
    if not ready.wait(120):
        raise RuntimeError("the feeder did not get ready in 120 s")
    t0 = time.perf_counter()
    start.set()
    res = out.get(timeout=600)
    p.join(60)
    return res["sent"], t0


def _load(address: str, key: str | None, run_id: str, n: int) -> tuple[list[dict], float]:
    ctx = mp.get_context("fork")
    start, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(address, key, run_id, r, n, start, out))
             for r in (0, 1)]
    for p in procs:
        p.start()
    time.sleep(0.5)  # both ranks connected and waiting
    t0 = time.perf_counter()
    start.set()
    ranks = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(60)
    return ranks, t0


def _stored_metrics(db: Path, run_id: str) -> int:
    """Metric events stored: the newest sequence number less the recorder's own 'running' event
    (an index lookup, so the polling costs the recorder nothing measurable)."""
    c = sqlite3.connect(db)
    n = c.execute("SELECT COALESCE(MAX(seq), 0) FROM events WHERE run_id=?", (run_id,)).fetchone()[0]
    c.close()
    return max(0, n - 1)


# The recorder process of `gpu_lab.record.recorder.serve`, with the channel open (private=False):
# the same Recorder, binding, reply and end protocol, without CURVE.
OPEN_RECORDER = r"""
import json, sys
from gpu_lab.record.registry import Registry
from gpu_lab.record import events as ev
from gpu_lab.record.recorder import Recorder
reg = Registry(sys.argv[1])
rec = Recorder(reg, sys.argv[2], private=False)
reg.update(sys.argv[2], status="running", events_address=rec.publish_address)
rec.record([ev.make(sys.argv[2], -1, ev.STATUS, {"status": "running"})])
print(json.dumps({"address": rec.address, "publish": rec.publish_address}), flush=True)
final = None
for line in sys.stdin:
    final = json.loads(line).get("end")
    if final:
        break
rec.close(end=final)
print(f"recorder: {rec.written} events recorded, at most {rec.peak_pending} waiting for the "
      "database", file=sys.stderr, flush=True)
"""


def _start_recorder(db: Path, run_id: str, log: Path, private: bool) -> tuple:
    """(process, addresses, client key or None): a run's recorder, private or open."""
    import subprocess

    from gpu_lab.record import recorder
    from gpu_lab.record.channel import RunKeys

    if private:
        keys = RunKeys.new()
        proc, where = recorder.spawn(str(db), run_id, str(log), keys)
        return proc, where, keys.client.encode()
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    with open(log, "ab") as log_file:
        proc = subprocess.Popen([sys.executable, "-c", OPEN_RECORDER, str(db), run_id],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log_file,
                                env=env)
    return proc, json.loads(proc.stdout.readline()), None


def round_recorder(tmp: Path, n: int, feed: bool, private: bool = True) -> dict:
    from gpu_lab.record import recorder

    db = tmp / "recorder.db"
    run_id = f"bench-{time.time_ns()}"
    Registry(db).create_run(run_id, status="pending")
    log = tmp / "recorder.log"
    proc, where, key = _start_recorder(db, run_id, log, private)
    cpu0 = _cpu_s(proc.pid)
    if feed:
        sent, t0 = _feed(where["address"], key, run_id, n)
        ranks = [{"dropped": 0, "worst_us": 0.0}]
    else:
        ranks, t0 = _load(where["address"], key, run_id, n)
        sent = sum(r["sent"] for r in ranks)
    deadline = time.monotonic() + 120
    stored = 0
    while time.monotonic() < deadline:  # polling a reader: the recorder itself is not slowed
        stored = _stored_metrics(db, run_id)
        if stored >= sent:
            break
        time.sleep(0.02)
    t_end = time.perf_counter()
    cpu = _cpu_s(proc.pid) - cpu0
    recorder.end(proc, {"status": "succeeded"})
    peak = None
    for line in log.read_text().splitlines():
        if "waiting for the database" in line:
            peak = int(line.split("at most ")[1].split()[0])
    log.unlink()
    return {"path": "recorder (CURVE)" if private else "recorder (no CURVE)", "stored": stored, "per_s": stored / (t_end - t0),
            "dropped": sum(r["dropped"] for r in ranks),
            "worst_report_us": max(r["worst_us"] for r in ranks), "peak_pending": peak,
            "per_cpu_s": stored / cpu if cpu > 0 else None}


def _cpu_s(pid: int) -> float:
    """CPU seconds the recorder process has used: what it costs, whatever else shares the cores."""
    import psutil

    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def round_old(tmp: Path, n: int, feed: bool) -> dict:
    recv = OldKernelReceiver(tmp / f"old-{time.time_ns()}.db")
    if feed:
        sent, t0 = _feed(recv.address, None, "bench", n)
        ranks = [{"dropped": 0, "worst_us": 0.0}]
    else:
        ranks, t0 = _load(recv.address, None, "bench", n)
        sent = sum(r["sent"] for r in ranks)
    deadline = time.monotonic() + 120
    while recv.stored < sent and time.monotonic() < deadline:
        time.sleep(0.01)
    per_s = recv.stored / (recv.last - t0)
    recv.close()
    return {"path": "kernel receiver (before)", "stored": recv.stored, "per_s": per_s,
            "dropped": sum(r["dropped"] for r in ranks),
            "worst_report_us": max(r["worst_us"] for r in ranks), "peak_pending": None,
            "per_cpu_s": None}


def _median(results: list[dict], path: str) -> float:
    return statistics.median(r["per_s"] for r in results if r["path"] == path)


def _summary(label: str, results: list[dict]) -> dict:
    curve, open_, old = (_median(results, p) for p in
                         ("recorder (CURVE)", "recorder (no CURVE)", "kernel receiver (before)"))
    cpu = {p: statistics.median(r["per_cpu_s"] for r in results if r["path"] == p)
           for p in ("recorder (CURVE)", "recorder (no CURVE)")}
    print(f"{label}: recorder with CURVE median {curve:,.0f} events/s, without {open_:,.0f} "
          f"events/s (CURVE / without = {curve / open_:.2f}x); per recorder CPU second "
          f"{cpu['recorder (CURVE)']:,.0f} with CURVE, {cpu['recorder (no CURVE)']:,.0f} without "
          f"({cpu['recorder (CURVE)'] / cpu['recorder (no CURVE)']:.2f}x); kernel receiver before "
          f"{old:,.0f} events/s (recorder with CURVE / before = {curve / old:.2f}x)\n")
    return {"curve_over_open": curve / open_, "curve_over_before": curve / old,
            "cpu_curve_over_open": cpu["recorder (CURVE)"] / cpu["recorder (no CURVE)"]}


def _open_recorder(tmp: Path, n: int, feed: bool) -> dict:
    return round_recorder(tmp, n, feed, private=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--events", type=int, default=200_000, help="events per round (per rank)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="gpu_lab_bench_recorder_"))
    report = {}
    for label, feed in (("capacity (feeder)", True), ("ranks calling report()", False)):
        results = []
        for i in range(args.rounds):
            order = [round_recorder, _open_recorder, round_old]
            for fn in order[i % 3:] + order[:i % 3]:  # each consumer goes first in turn
                r = fn(tmp, args.events * (2 if feed else 1), feed)
                results.append(r)
                line = (f"{label}, round {i + 1}: {r['path']:<25} {r['per_s']:>10,.0f} events/s "
                        f"stored ({r['stored']:,} stored")
                if not feed:
                    line += (f", {r['dropped']:,} dropped and counted at the ranks; slowest "
                             f"report() {r['worst_report_us']:,.0f} µs")
                if r["peak_pending"] is not None:
                    line += f"; at most {r['peak_pending']:,} events waiting for the database"
                if r["per_cpu_s"]:
                    line += f"; {r['per_cpu_s']:,.0f} events per recorder CPU second"
                print(line + ")", flush=True)
        report[label] = {"ratio": _summary(label, results), "results": results}
    results = report["capacity (feeder)"]["results"]
    cap = _median(results, "recorder (CURVE)")
    per_cpu = statistics.median(r["per_cpu_s"] for r in results if r["path"] == "recorder (CURVE)")
    print(f"recorder capacity with CURVE {cap:,.0f} events/s ({per_cpu:,.0f} per second of its "
          f"own CPU: the rate it keeps with a core to itself): target >= 100,000 "
          f"{'met' if cap >= 100_000 else 'MISSED'}")
    print(json.dumps({k: {"ratio": v["ratio"], "per_s": [(r["path"], round(r["per_s"]))
                                                        for r in v["results"]]}
                      for k, v in report.items()}))


if __name__ == "__main__":
    sys.exit(main())
