"""What opening a run costs against its length: the registry's downsampled levels (now) side by
side with the full read (before, bench/lib/full_read.py), on the same records.

For each length (events over 2 ranks, one event per rank per step: loss and lr, or with --fit
fit's six metrics; a single spike of rank 1 at 90% of the run, i.e. at step 450,000 / event
~900,000 of the 1M-event run), a record is written straight into a fresh registry with
Registry.add_events in 20,000-event batches (its file size / events is the registry's bytes per
event), then each measurement runs in a fresh subprocess:

- attach: gpu_lab.attach(id) and the first run.metrics.series("loss", 0) (the dashboard reads
  its default 2,000 points), wall time and the process's resident memory growth (the Run held);
- run view: gpu_lab.server.runview.detail(registry, id) (the first answer of GET
  /gpu-lab/api/runs/<id>, 1,000 points), wall time;
- whether the spike is in what each shows (rank 1's series; the run view's mean too).

Targets: a 1M-event run attaches with its first series in <= 0.5 s and <= 100 MB above a short
run's, its run view answers in <= 0.5 s, both flat from 100k to 1M events.

    .venv/bin/python bench/attach_scale.py [--sizes 1000,10000,100000,1000000] [--no-old] [--fit]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PROBE = r"""
import json, os, sys, time
import numpy  # loaded in any kernel that trains; both paths use it
from gpu_lab.launch.run import attach_run
from gpu_lab.record.registry import Registry
from gpu_lab.server import runview
from bench.lib import full_read
from bench.lib.records import SPIKE
db, run_id, what, path = sys.argv[1:5]
reg = Registry(db)
reg.get_run(run_id)  # the connection and the row: what any reader pays first
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
rss0 = rss()
t0 = time.perf_counter()
if what == "attach":
    run = attach_run(run_id, registry=reg) if path == "new" else full_read.old_attach(run_id, reg)
    steps, values = run.metrics.series("loss", 0)
    dt = time.perf_counter() - t0
    shown = SPIKE in run.metrics.series("loss", 1)[1]
    out = {"points": len(values), "count": run.metrics.count("loss", 0)}
else:
    d = runview.detail(reg, run_id) if path == "new" else full_read.old_detail(reg, run_id)
    dt = time.perf_counter() - t0
    loss = d["series"]["loss"]
    shown = SPIKE in loss["1"]["value"] and max(loss["mean"]["value"]) > SPIKE / 2 - 1
    out = {"points": max(len(s["value"]) for s in loss.values())}
print(json.dumps({**out, "s": dt, "rss_mb": (rss() - rss0) / 2**20, "spike": shown}))
"""


def probe(db: Path, run_id: str, what: str, path: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get(
        "PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", PROBE, str(db), run_id, what, path], env=env,
                         capture_output=True, text=True, timeout=900)
    if out.returncode:
        raise RuntimeError(f"{what} ({path}) failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def record(tmp: Path, events: int, fit: bool) -> tuple[Path, str, float, float]:
    from bench.lib.records import write_record
    from gpu_lab.record.registry import Registry

    db = tmp / f"registry-{events}.db"
    reg = Registry(db)
    run_id = f"20260101-120000-{events:06x}"  # a run id as long as a launch's
    steps = events // 2
    t0 = time.perf_counter()
    write_record(reg, run_id, events, spike=(1, int(steps * 0.9)), fit=fit)
    dt = time.perf_counter() - t0
    reg._conn().execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return db, run_id, dt, _bytes(reg, db, events + 5)


def _bytes(reg, db: Path, events: int) -> dict:
    """File size per event, and the part the levels take (the rest is what the registry held
    before them: the events table, unchanged)."""
    out = {"file": db.stat().st_size / events}
    try:
        pages = dict(reg._conn().execute("SELECT name, SUM(pgsize) FROM dbstat GROUP BY name"))
        out["levels"] = sum(pages.get(t, 0) for t in ("levels", "series", "level_runs",
                                                      "events_notes")) / events
    except Exception:  # noqa: BLE001 - an SQLite built without the dbstat table
        pass
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="1000,10000,100000,1000000")
    ap.add_argument("--no-old", action="store_true", help="skip the full read (before)")
    ap.add_argument("--fit", action="store_true",
                    help="each event also carries fit's other four metrics (six in all)")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    paths = ("new",) if args.no_old else ("new", "old")
    tmp = Path(tempfile.mkdtemp(prefix="gpu_lab_bench_attach_"))
    rows = []
    for n in sizes:
        db, run_id, write_s, per_event = record(tmp, n, args.fit)
        row = {"events": n, "write_s": write_s, "events_per_s": n / write_s,
               "bytes_per_event": per_event}
        for path in paths:
            for what in ("attach", "detail"):
                row[f"{what}_{path}"] = probe(db, run_id, what, path)
        rows.append(row)
        print(_line(row, paths), flush=True)
        db.unlink()
    print()
    _summary(rows, paths)
    print(json.dumps(rows))
    return 0


def _line(r: dict, paths: tuple) -> str:
    cells = [f"{r['events']:>9,} events", f"written {r['events_per_s']:>9,.0f}/s",
             f"{r['bytes_per_event']['file']:5.0f} B/event (levels "
             f"{r['bytes_per_event'].get('levels', float('nan')):4.1f})"]
    for path in paths:
        a, d = r[f"attach_{path}"], r[f"detail_{path}"]
        cells.append(f"{path}: attach {a['s']:6.3f} s {a['rss_mb']:6.1f} MB "
                     f"({a['points']} pts, spike {'yes' if a['spike'] else 'NO'}), run view "
                     f"{d['s']:6.3f} s (spike {'yes' if d['spike'] else 'NO'})")
    return " | ".join(cells)


def _summary(rows: list[dict], paths: tuple) -> None:
    by = {r["events"]: r for r in rows}
    short = rows[0]
    for path in paths:
        for r in rows:
            a, d = r[f"attach_{path}"], r[f"detail_{path}"]
            print(f"{path:>3} {r['events']:>9,} events: attach + first series {a['s']:.3f} s, "
                  f"+{a['rss_mb'] - short[f'attach_{path}']['rss_mb']:.1f} MB over the "
                  f"{short['events']:,}-event run; run view {d['s']:.3f} s")
    if 100_000 in by and 1_000_000 in by:
        a, b = by[100_000], by[1_000_000]
        for path in paths:
            ratio = [b[f"{w}_{path}"]["s"] / a[f"{w}_{path}"]["s"] for w in ("attach", "detail")]
            print(f"{path}: 1M / 100k events: attach {ratio[0]:.2f}x, run view {ratio[1]:.2f}x")
        big = b["attach_new"], b["detail_new"]
        grow = big[0]["rss_mb"] - short["attach_new"]["rss_mb"]
        ok = big[0]["s"] <= 0.5 and big[1]["s"] <= 0.5 and grow <= 100 and all(
            x["spike"] for x in big)
        print(f"targets (1M: attach <= 0.5 s and <= 100 MB over a short run, run view <= 0.5 s, "
              f"spike shown): {'met' if ok else 'MISSED'}")


if __name__ == "__main__":
    sys.exit(main())
