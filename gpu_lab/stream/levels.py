"""Downsampled levels of every metric series, kept in the registry beside the events they sum up.

Contract:
- Written in the transaction that writes the events (Registry.add_events calls `record`), so the
  levels never disagree with the events, whoever writes them (a recorder, a headless rank).
- A series is one metric of one rank of one run (table `series`, which also holds its point count
  and its name once). Level k >= 1 has buckets of F**k consecutive points of the series; each
  bucket row holds the count, the first, the minimum, the maximum and the last point (step, time,
  value) and the sum. The newest bucket of each level is open and is rewritten as points arrive.
  Level 0 holds the raw points while the series has at most RAW_KEEP of them (then level 1 already
  gives RAW_KEEP / 8 points, and level 0 is dropped).
- `read` answers with at most `points` points per series from the coarsest level that still gives
  >= `points` (each bucket gives its min and max), in time and memory bounded by `points`, not by
  the series' length. Each bucket's minimum and maximum are exact, so a spike never disappears.
- A run recorded before levels existed has no `level_runs` row: its first `read` builds its
  levels from its events (one full read, once, in one write transaction).
"""
from __future__ import annotations

import json
import math
import sqlite3
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

F = 16              # points per bucket grow by this factor from one level to the next
LEVELS = 5          # buckets of 16 .. 1,048,576 points
RAW_KEEP = 16_384   # raw points kept per series (level 0) while the series is no longer than this
BACKFILL_PAGE = 20_000

SCHEMA = """
CREATE TABLE IF NOT EXISTS series (
    id INTEGER PRIMARY KEY,
    run_id TEXT NOT NULL,
    rank INTEGER NOT NULL,
    name TEXT NOT NULL,
    count INTEGER NOT NULL DEFAULT 0,
    UNIQUE (run_id, rank, name)
);
CREATE TABLE IF NOT EXISTS levels (
    sid INTEGER NOT NULL, level INTEGER NOT NULL, bucket INTEGER NOT NULL,
    n, s0, smin, smax, s1, t0, v0, tmin, vmin, tmax, vmax, t1, v1, vsum,
    PRIMARY KEY (sid, level, bucket)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS level_runs (run_id TEXT PRIMARY KEY) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS events_notes ON events (run_id, kind, seq) WHERE kind <> 'metric';
"""

# columns of a bucket row, in the table's order after (sid, level, bucket)
N, S0, SMIN, SMAX, S1, T0, V0, TMIN, VMIN, TMAX, VMAX, T1, V1, VSUM = range(14)
FIRST, LOW, HIGH, LAST = (S0, T0, V0), (SMIN, TMIN, VMIN), (SMAX, TMAX, VMAX), (S1, T1, V1)
STEPS = (N, S0, SMIN, SMAX, S1)
COLS = ("n, s0, smin, smax, s1, t0, v0, tmin, vmin, tmax, vmax, t1, v1, vsum")


@dataclass
class Points:
    """One series as read: at most the requested points, plus how many the series holds."""
    rank: int
    name: str
    count: int
    level: int
    steps: list = field(default_factory=list)
    times: list = field(default_factory=list)
    values: list = field(default_factory=list)
    # the level's whole envelope, before decimation to `points` (what the mean over ranks uses)
    env: tuple = ((), (), ())


@dataclass
class Snapshot:
    """Every series of a run up to event `seq`, read in one transaction."""
    seq: int
    series: dict  # (rank, name) -> Points


# --- writing ---------------------------------------------------------------------------------------
def record(c: sqlite3.Connection, run_id: str, events: Sequence[dict], base: int) -> None:
    """Fold these events (numbered from base + 1) into the run's levels; inside add_events'
    transaction. A run whose first events were written without levels is left to `read`."""
    if c.execute("SELECT 1 FROM level_runs WHERE run_id=?", (run_id,)).fetchone() is None:
        if base:
            return  # recorded before levels existed: `read` builds them from the events
        c.execute("INSERT INTO level_runs (run_id) VALUES (?)", (run_id,))
    _fold(c, run_id, events)


def _fold(c: sqlite3.Connection, run_id: str, events: Iterable[dict]) -> None:
    points: dict[tuple[int, str], tuple[list, list, list]] = {}
    for e in events:
        if e["kind"] != "metric":
            continue
        rank, step, t = int(e.get("rank", -1)), e.get("step"), float(e["t"])
        for k, v in (e.get("data") or {}).items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                p = points.get((rank, k))
                if p is None:
                    p = points[(rank, k)] = ([], [], [])
                p[0].append(step)
                p[1].append(t)
                p[2].append(float(v))
    if not points:
        return
    known = {(r[0], r[1]): (r[2], r[3]) for r in c.execute(
        "SELECT rank, name, id, count FROM series WHERE run_id=?", (run_id,))}
    for key, (steps, times, values) in points.items():
        sid, count = known.get(key) or (None, 0)
        if sid is None:
            sid = c.execute("INSERT INTO series (run_id, rank, name, count) VALUES (?,?,?,0)",
                            (run_id, *key)).lastrowid
        _append(c, sid, count, steps, times, values)
        c.execute("UPDATE series SET count=? WHERE id=?", (count + len(values), sid))


def _append(c: sqlite3.Connection, sid: int, count: int, steps: list, times: list,
            values: list) -> None:
    import numpy as np

    m = len(values)
    # a point without a step is placed at its index in the series, as MetricHistory does
    s = np.array([count + i if st is None else st for i, st in enumerate(steps)], dtype=float)
    t, v = np.asarray(times, dtype=float), np.asarray(values, dtype=float)
    rows = np.empty((m, 14))
    rows[:, N] = 1
    for cols in (FIRST, LOW, HIGH, LAST):
        rows[:, cols[0]], rows[:, cols[1]], rows[:, cols[2]] = s, t, v
    rows[:, VSUM] = v
    idx = np.arange(count, count + m)
    out: list[tuple] = []
    if count + m <= RAW_KEEP:  # raw points: step, time, value only
        raw = [(sid, i, r[S0], r[T0], r[V0]) for i, r in zip(idx.tolist(), _sql_rows(rows))]
        c.executemany("INSERT OR REPLACE INTO levels (sid, level, bucket, s0, t0, v0) "
                      "VALUES (?,0,?,?,?,?)", raw)
    elif count < RAW_KEEP:
        c.execute("DELETE FROM levels WHERE sid=? AND level=0", (sid,))
    for k in range(1, LEVELS + 1):
        size = F ** k
        ids, block = idx // size, rows
        if count % size:  # the open bucket goes first, merged with the new points
            old = c.execute(f"SELECT {COLS} FROM levels WHERE sid=? AND level=? AND bucket=?",
                            (sid, k, count // size)).fetchone()
            if old is not None:
                block = np.vstack((np.array([old], dtype=float), rows))
                ids = np.concatenate(([count // size], ids))
        buckets, merged = merge(block, ids)
        out += [(sid, k, b, *r) for b, r in zip(buckets.tolist(), _sql_rows(merged))]
    c.executemany(f"INSERT OR REPLACE INTO levels (sid, level, bucket, {COLS}) "
                  f"VALUES ({','.join('?' * 17)})", out)


def merge(rows: Any, ids: Any) -> tuple[Any, Any]:
    """Rows of consecutive buckets (ids ascending) merged into one row per bucket id: counts and
    sums added, the first row's first point, the last row's last, the lowest minimum and the
    highest maximum (the first one met on a tie)."""
    import numpy as np

    starts = np.flatnonzero(np.r_[True, ids[1:] != ids[:-1]])
    ends = np.r_[starts[1:], len(ids)] - 1
    group = np.repeat(np.arange(len(starts)), np.diff(np.r_[starts, len(ids)]))
    out = np.empty((len(starts), 14))
    out[:, N] = np.add.reduceat(rows[:, N], starts)
    out[:, VSUM] = np.add.reduceat(rows[:, VSUM], starts)
    out[:, FIRST] = rows[starts][:, FIRST]
    out[:, LAST] = rows[ends][:, LAST]
    # lexsort is stable: within a group, equal values keep their order (the first one wins);
    # NaN sorts last, so a NaN is the minimum or maximum only of a bucket of NaNs
    low = np.lexsort((rows[:, VMIN], group))[starts]
    high = np.lexsort((-rows[:, VMAX], group))[starts]
    out[:, LOW] = rows[low][:, LOW]
    out[:, HIGH] = rows[high][:, HIGH]
    return ids[starts], out


def _sql_rows(rows: Any) -> list[list]:
    """Rows as SQL values: counts and whole-number steps as integers (smaller on disk)."""
    import numpy as np

    ints = rows[:, STEPS]
    whole = bool(np.all(np.isfinite(ints) & (ints == np.floor(ints))))
    head = ints.astype(np.int64).tolist() if whole else ints.tolist()
    return [h + r for h, r in zip(head, rows[:, T0:].tolist())]


def delete(c: sqlite3.Connection, run_id: str) -> None:
    c.execute("DELETE FROM levels WHERE sid IN (SELECT id FROM series WHERE run_id=?)", (run_id,))
    c.execute("DELETE FROM series WHERE run_id=?", (run_id,))
    c.execute("DELETE FROM level_runs WHERE run_id=?", (run_id,))


# --- reading ---------------------------------------------------------------------------------------
def choose_level(count: int, points: int) -> int:
    """The coarsest level whose buckets (two points each) still give >= `points` points."""
    if count <= RAW_KEEP:
        return 0
    k = 1
    while k < LEVELS and math.ceil(count / F ** (k + 1)) * 2 >= points:
        k += 1
    return k


def read(c: sqlite3.Connection, run_id: str, points: int, *, names: Sequence[str] | None = None,
         ranks: Sequence[int] | None = None) -> Snapshot:
    """Each series of the run (or those named / of those ranks) at most `points` points, with the
    newest event number they include, in one read transaction."""
    if points < 4:
        raise ValueError(f"series points: got {points!r}; expected an int >= 4")
    for attempt in (0, 1):
        c.execute("BEGIN")
        try:
            seq = c.execute("SELECT COALESCE(MAX(seq), 0) FROM events WHERE run_id=?",
                            (run_id,)).fetchone()[0]
            tracked = c.execute("SELECT 1 FROM level_runs WHERE run_id=?",
                                (run_id,)).fetchone() is not None
            if tracked or not seq:
                return Snapshot(seq, _read_series(c, run_id, points, names, ranks))
        finally:
            c.execute("COMMIT")
        if attempt == 0:
            backfill(c, run_id)
    raise RuntimeError(f"run {run_id}: its metric levels could not be built")  # pragma: no cover


def _read_series(c: sqlite3.Connection, run_id: str, points: int, names, ranks) -> dict:
    from .history import minmax_indices

    out = {}
    for sid, rank, name, count in c.execute(
            "SELECT id, rank, name, count FROM series WHERE run_id=? ORDER BY rank, name",
            (run_id,)).fetchall():
        if (names is not None and name not in names) or (ranks is not None and rank not in ranks):
            continue
        level = choose_level(count, points)
        rows = c.execute(f"SELECT {COLS} FROM levels WHERE sid=? AND level=? ORDER BY bucket",
                         (sid, level)).fetchall()
        env = steps, times, values = envelope(rows, level)
        if len(values) > points:
            keep = minmax_indices(values, points).tolist()
            steps, times, values = ([a[i] for i in keep] for a in (steps, times, values))
        out[(rank, name)] = Points(rank, name, count, level, steps, times, values, env)
    return out


def envelope(rows: list, level: int) -> tuple[list, list, list]:
    """(steps, times, values) of bucket rows: raw points at level 0; else the series' first
    point, each bucket's minimum and maximum in step order, and the series' last point."""
    if level == 0:
        return [r[S0] for r in rows], [r[T0] for r in rows], [r[V0] for r in rows]
    pts = [(rows[0][S0], rows[0][T0], rows[0][V0])] if rows else []
    for r in rows:
        lo, hi = (r[SMIN], r[TMIN], r[VMIN]), (r[SMAX], r[TMAX], r[VMAX])
        a, b = (lo, hi) if (lo[0], lo[1]) <= (hi[0], hi[1]) else (hi, lo)
        pts.append(a)
        if b != a:
            pts.append(b)
    if rows:
        pts.append((rows[-1][S1], rows[-1][T1], rows[-1][V1]))
    # the first and last points may be a bucket's minimum or maximum as well: keep one of each
    pts = [p for i, p in enumerate(pts) if i == 0 or p != pts[i - 1]]
    return [p[0] for p in pts], [p[1] for p in pts], [p[2] for p in pts]


def backfill(c: sqlite3.Connection, run_id: str) -> None:
    """Build the levels of a run recorded before they existed, from its events, in one write
    transaction (writers of the run wait; afterwards add_events keeps the levels)."""
    c.execute("BEGIN IMMEDIATE")
    try:
        if c.execute("SELECT 1 FROM level_runs WHERE run_id=?", (run_id,)).fetchone() is None:
            delete(c, run_id)
            c.execute("INSERT INTO level_runs (run_id) VALUES (?)", (run_id,))
            after = 0
            while True:
                page = c.execute("SELECT seq, rank, kind, t, step, data FROM events WHERE "
                                 "run_id=? AND seq>? AND kind='metric' ORDER BY seq LIMIT ?",
                                 (run_id, after, BACKFILL_PAGE)).fetchall()
                if not page:
                    break
                _fold(c, run_id, ({"rank": r[1], "kind": r[2], "t": r[3], "step": r[4],
                                   "data": json.loads(r[5])} for r in page))
                after = page[-1][0]
        c.execute("COMMIT")
    except BaseException:
        c.execute("ROLLBACK")
        raise


# --- the mean over ranks -------------------------------------------------------------------------
def mean_of_ranks(series: list[Points], points: int) -> tuple[list, list, list]:
    """The mean over ranks of one metric, at most `points` points. Exact per step when every
    rank's series was read raw (level 0); else each rank's envelope is interpolated at the union
    of their steps (within that rank's range), so a spike of one rank shows at its step."""
    import numpy as np

    from .history import minmax_indices

    series = [p for p in series if p.values]
    if not series:
        return [], [], []
    if all(p.level == 0 for p in series):
        acc: dict = {}
        for p in series:
            for s, t, v in zip(*p.env):
                a = acc.setdefault(s, [0.0, 0, t])
                a[0], a[1], a[2] = a[0] + v, a[1] + 1, max(a[2], t)
        steps = sorted(acc)
        times, values = [acc[s][2] for s in steps], [acc[s][0] / acc[s][1] for s in steps]
    else:
        grid = np.unique(np.concatenate([np.asarray(p.env[0], dtype=float) for p in series]))
        total, n, when = np.zeros(len(grid)), np.zeros(len(grid)), np.zeros(len(grid))
        for p in series:
            xs, ts, vs = (np.asarray(a, dtype=float) for a in p.env)
            inside = (grid >= xs[0]) & (grid <= xs[-1])
            total[inside] += np.interp(grid[inside], xs, vs)
            when[inside] = np.maximum(when[inside], np.interp(grid[inside], xs, ts))
            n[inside] += 1
        ok = n > 0
        steps, times, values = grid[ok].tolist(), when[ok].tolist(), (total[ok] / n[ok]).tolist()
        steps = [int(s) if float(s).is_integer() else s for s in steps]
    if len(values) > points:
        keep = minmax_indices(values, points).tolist()
        steps, times, values = ([a[i] for i in keep] for a in (steps, times, values))
    return steps, times, values


def by_metric(snap: Snapshot, points: int, with_ranks: bool = True) -> dict:
    """{metric: {"0": (steps, times, values), ..., "mean": (...)}}: what the run view draws."""
    names: dict[str, list[Points]] = {}
    for (_, name), p in sorted(snap.series.items()):
        names.setdefault(name, []).append(p)
    out: dict = {}
    for name, ps in names.items():
        mean = mean_of_ranks(ps, points)
        if mean[0]:
            out.setdefault(name, {})["mean"] = mean
        if with_ranks:
            for p in ps:
                if p.values:
                    out.setdefault(name, {})[str(p.rank)] = (p.steps, p.times, p.values)
    return out
