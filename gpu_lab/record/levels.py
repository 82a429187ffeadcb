# Long: one home for the levels' format: how they are written, folded, packed and read back.
"""Downsampled levels of every metric series, kept in the registry beside the events they sum up.

Contract:
- Written in the transaction that writes the events (Registry.add_events calls `record`), so the
  levels never disagree with the events, whoever writes them (a recorder, a headless rank).
- A series is one metric of one rank of one run (table `series`: its name, once, and its point
  count). Level k >= 1 has buckets of SIZES[k-1] consecutive points of the series; each holds the
  count, the first, the minimum, the maximum and the last point (step, time, value) and the sum.
  The newest bucket of each level is open and is rewritten as points arrive. Level 0 holds the raw
  points while the series has at most RAW_KEEP of them (then level 1 already gives >= 2 * RAW_KEEP
  / F points, and level 0 is dropped). Buckets are stored CHUNK to a row (a blob of float64
  records), so a transaction rewrites a few rows per series, whatever the batch; a chunk that
  can no longer change is compressed (`pack`) once.
- `read` answers with at most `points` points per series from the coarsest level that still gives
  >= `points` (each bucket gives its min and max), in time and memory bounded by `points`, not by
  the series' length. Each bucket's minimum and maximum are exact, so a spike never disappears.
- A run recorded before levels existed gets them when the registry is upgraded (`backfill_all`,
  once, under the upgrade's lock): readers never write. `level_runs.upto` is
  the newest event folded: events that an older gpu_lab adds to a run later are folded by the
  next add_events or read, so the levels never fall behind the event log unseen.
"""
from __future__ import annotations

import itertools
import json
import math
import sqlite3
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from . import mean
from .decimate import minmax_indices

# points per bucket of levels 1, 2, ...: 32, then 8 times more each level, so that a read (the
# coarsest level with >= points / 2 buckets) takes at most 4 * points buckets above level 1
SIZES = (32, 256, 2048, 16_384, 131_072, 1_048_576)
LEVELS = len(SIZES)
F = SIZES[0]
RAW_KEEP = 32_768   # raw points kept per series (level 0) while it holds no more than this
CHUNK = (512, 64)   # records per row: raw points (level 0), buckets (levels >= 1)
BACKFILL_PAGE = 20_000
_SPAN = 1 << 44     # series j's bucket b is j * _SPAN + b while all series are merged at once

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
    sid INTEGER NOT NULL,
    level INTEGER NOT NULL,
    chunk INTEGER NOT NULL,
    packed INTEGER NOT NULL,
    data BLOB NOT NULL,
    PRIMARY KEY (sid, level, chunk)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS level_runs (
    run_id TEXT PRIMARY KEY,
    upto INTEGER NOT NULL      -- the newest event folded into the run's levels
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS events_notes ON events (run_id, kind, seq) WHERE kind <> 'metric';
"""

# fields of a bucket record (float64 each); a raw point is (step, time, value)
N, S0, T0, V0, SMIN, TMIN, VMIN, SMAX, TMAX, VMAX, S1, T1, V1, VSUM = range(14)
FIRST, LOW, HIGH, LAST = (S0, T0, V0), (SMIN, TMIN, VMIN), (SMAX, TMAX, VMAX), (S1, T1, V1)
WIDTH = (3, 14)


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
    # the level's whole envelope (numpy arrays), before decimation: what the mean over ranks uses
    env: tuple = ((), (), ())
    stepped: Any = None  # level 0: which points came with a step (the others sit at their index)


@dataclass
class Snapshot:
    """Every series of a run up to event `seq`, read in one transaction."""
    seq: int
    series: dict  # (rank, name) -> Points


# --- writing ------------------------------------------------------------------------------------
def record(c: sqlite3.Connection, run_id: str, events: Sequence[dict], base: int) -> None:
    """Fold these events (numbered from base + 1) into the run's levels; inside add_events'
    transaction. Events that a gpu_lab without levels added before or in between are folded
    first, so the order holds."""
    row = c.execute("SELECT upto FROM level_runs WHERE run_id=?", (run_id,)).fetchone()
    if row is None:
        c.execute("INSERT INTO level_runs (run_id, upto) VALUES (?, 0)", (run_id,))
        if base:  # begun by a gpu_lab without levels: its events first, once (this is a writer)
            delete(c, run_id)
            _catch_up(c, run_id, 0, base)
    elif row[0] < base:
        _catch_up(c, run_id, row[0], base)
    _fold(c, run_id, events)
    c.execute("UPDATE level_runs SET upto=? WHERE run_id=?", (base + len(events), run_id))


def _catch_up(c: sqlite3.Connection, run_id: str, after: int, upto: int,
              into: sqlite3.Connection | None = None) -> None:
    """Fold the run's metric events after..upto (read from the event log, a page at a time)
    into its levels (`into`: those of another database)."""
    while after < upto:
        page = c.execute("SELECT seq, rank, kind, t, step, data FROM events WHERE run_id=? AND "
                         "seq>? AND seq<=? AND kind='metric' ORDER BY seq LIMIT ?",
                         (run_id, after, upto, BACKFILL_PAGE)).fetchall()
        if not page:
            return
        _fold(into or c, run_id, ({"rank": r[1], "kind": r[2], "t": r[3], "step": r[4],
                                   "data": json.loads(r[5])} for r in page))
        after = page[-1][0]


def _fold(c: sqlite3.Connection, run_id: str, events: Iterable[dict]) -> None:
    import numpy as np

    points = _columns(events)
    if not points:
        return
    known = {(r[0], r[1]): (r[2], r[3]) for r in c.execute(
        "SELECT rank, name, id, count FROM series WHERE run_id=?", (run_id,))}
    items = []
    for key, (steps, times, values) in points.items():
        sid, count = known.get(key) or (None, 0)
        if sid is None:
            sid = c.execute("INSERT INTO series (run_id, rank, name, count) VALUES (?,?,?,0)",
                            (run_id, *key)).lastrowid
        pts = np.column_stack((steps, times, values))
        items.append((sid, count, pts))
    out: list[tuple] = []
    _raw(c, items, out)  # level 0 keeps a missing step as NaN: the mean over ranks skips it
    for sid, count, pts in items:
        gaps = np.isnan(pts[:, 0])
        if gaps.any():  # a point without a step sits at its index, as in MetricHistory
            pts[gaps, 0] = count + np.flatnonzero(gaps)
    _levels(c, items, out)
    c.executemany("INSERT OR REPLACE INTO levels (sid, level, chunk, packed, data) "
                  "VALUES (?,?,?,?,?)", out)
    c.executemany("UPDATE series SET count=? WHERE id=?",
                  [(count + len(pts), sid) for sid, count, pts in items])


def _columns(events: Iterable[dict]) -> dict:
    """{(rank, name): (steps, times, values)} float arrays of the metric events' numbers, in order.
    A rank's events that all carry the same metric names (nearly always) become columns in a few
    passes in C; others go event by event."""
    # an older record may hold anything: a metric is an event with an int rank and a dict
    metric = [e for e in events if e.get("kind") == "metric" and type(e.get("rank", -1)) is int
              and isinstance(e.get("data") or {}, dict)]
    ranks = [e.get("rank", -1) for e in metric]
    out: dict = {}
    for rank in set(ranks):
        evs = metric if len(set(ranks)) == 1 else [e for e, r in zip(metric, ranks) if r == rank]
        datas = [e.get("data") or {} for e in evs]
        steps, times = _floats(evs, "step"), _floats(evs, "t")
        names = list(datas[0])
        flat = list(itertools.chain.from_iterable(datas))  # every event's names, in order
        if flat == names * len(datas):
            for name, col in _numeric(tuple(names), datas):
                out[(int(rank), name)] = (steps, times, col)
        else:
            out.update(_mixed(int(rank), datas, steps, times))
    return out


def _mixed(rank: int, datas: list, steps: Any, times: Any) -> dict:
    """Columns of events that carry different metrics: each metric's points where it appears."""
    import numpy as np

    out = {}
    for name in dict.fromkeys(itertools.chain.from_iterable(datas)):
        at = [i for i, d in enumerate(datas) if _is_number(d.get(name))]
        if at:
            out[(rank, name)] = (steps[at], times[at],
                                 np.array([datas[i][name] for i in at], dtype=float))
    return out


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _floats(evs: list, key: str) -> Any:
    """Each event's `key` as a float array; a missing step is NaN (placed by `_fold`)."""
    import operator

    import numpy as np

    try:
        out = np.fromiter(map(operator.itemgetter(key), evs), dtype=float, count=len(evs))
        if key != "step" or all(type(e[key]) is int for e in evs[:1]):
            return out
    except (KeyError, TypeError, ValueError):
        pass
    # an older record's step that is not an int counts as none (as events.step_of has it)
    ok = (lambda v: type(v) is int) if key == "step" else _is_number
    return np.array([float(e[key]) if ok(e.get(key)) else np.nan for e in evs])


def _numeric(names: tuple, datas: list) -> Iterable[tuple]:
    """(name, values) of each metric that holds numbers (booleans and text are not metrics), for
    events that all carry these names in this order."""
    import numpy as np

    if all(type(v) in (int, float) for v in datas[0].values()):
        try:  # one pass in C over every value (a later bool would count as 0 / 1)
            flat = np.fromiter(itertools.chain.from_iterable(map(dict.values, datas)),
                               dtype=float, count=len(datas) * len(names))
            arr = flat.reshape(len(datas), len(names))
            for j, name in enumerate(names):
                yield name, arr[:, j]
            return
        except (TypeError, ValueError):
            pass
    for name in names:  # mixed types: value by value, as MetricHistory.add does
        col = [d[name] for d in datas]
        if all(_is_number(v) for v in col):
            yield name, np.asarray(col, dtype=float)


def _raw(c: sqlite3.Connection, items: list, out: list) -> None:
    """Level 0: each short series' raw points; a series outgrowing RAW_KEEP loses them."""
    for sid, count, pts in items:
        if count + len(pts) > RAW_KEEP:
            if count <= RAW_KEEP:  # long enough for level 1 from now on
                c.execute("DELETE FROM levels WHERE sid=? AND level=0", (sid,))
            continue
        _splice(c, sid, 0, [count], pts, out)


def _levels(c: sqlite3.Connection, items: list, out: list) -> None:
    """Levels 1..LEVELS of all these series: the new points are merged into partial buckets level
    by level (all series at once), then spliced into each series' newest chunk."""
    import numpy as np

    pts = np.concatenate([it[2] for it in items])
    ids = np.concatenate([j * _SPAN + np.arange(count, count + len(p))
                          for j, (_, count, p) in enumerate(items)])
    ids, part = _from_points(pts, (ids // _SPAN) * _SPAN + (ids % _SPAN) // F)
    for k in range(1, LEVELS + 1):
        if k > 1:
            step = SIZES[k - 1] // SIZES[k - 2]
            ids, part = merge(part, (ids // _SPAN) * _SPAN + (ids % _SPAN) // step)
        owner = ids // _SPAN
        cut = np.flatnonzero(np.r_[True, owner[1:] != owner[:-1], True])
        for a, b in zip(cut[:-1], cut[1:]):
            sid, count, _ = items[int(owner[a])]
            _splice(c, sid, k, (ids[a:b] % _SPAN).tolist(), part[a:b], out)


def _splice(c: sqlite3.Connection, sid: int, level: int, ids: list, recs: Any,
            out: list) -> None:
    """Write records `recs` of buckets `ids` (ascending, consecutive; at level 0 the first raw
    point's index) into the level's chunks: an open bucket's record merges with the first new
    one."""
    import numpy as np

    size, width = CHUNK[level > 0], WIDTH[level > 0]
    chunk = ids[0] // size
    old = c.execute("SELECT data, packed FROM levels WHERE sid=? AND level=? AND chunk=?",
                    (sid, level, chunk)).fetchone()
    have = unpack(old[0], old[1], width) if old is not None else np.empty((0, width))
    if level and len(have) and chunk * size + len(have) - 1 == ids[0]:
        recs = np.vstack((combine(have[-1], recs[0]), recs[1:]))
        have = have[:-1]
    block = np.vstack((have, recs))
    for i in range(0, len(block), size):
        part = block[i:i + size]
        if i + size < len(block):  # a chunk with a bucket after it is final: packed, once
            out.append((sid, level, chunk + i // size, 1, pack(part)))
        else:  # the open chunk, rewritten by each batch: kept plain (cheaper to rewrite)
            out.append((sid, level, chunk + i // size, 0, part.tobytes()))


def pack(recs: Any) -> bytes:
    """A chunk compressed: byte-shuffled by field (steps, times and counts that change little
    become long runs) and zstd, about 0.4 of its size."""
    import numpy as np
    import zstandard

    m, w = recs.shape
    planes = np.ascontiguousarray(recs.T).view(np.uint8).reshape(w, m, 8).transpose(0, 2, 1)
    return zstandard.compress(np.ascontiguousarray(planes).tobytes(), 1)


def unpack(blob: bytes, packed: int, width: int) -> Any:
    """The records of a chunk as stored (`pack`ed or plain float64)."""
    import numpy as np

    if not packed:
        return np.frombuffer(blob).reshape(-1, width)
    import zstandard

    raw = np.frombuffer(zstandard.decompress(blob), dtype=np.uint8)
    m = len(raw) // (8 * width)
    planes = raw.reshape(width, 8, m).transpose(0, 2, 1)
    return np.ascontiguousarray(planes).view(np.float64).reshape(width, m).T


def _from_points(pts: Any, ids: Any) -> tuple[Any, Any]:
    """Bucket records of raw (step, time, value) points, whose bucket ids ascend."""
    import numpy as np

    starts = np.flatnonzero(np.r_[True, ids[1:] != ids[:-1]])
    ends = np.r_[starts[1:], len(ids)] - 1
    group = np.repeat(np.arange(len(starts)), np.diff(np.r_[starts, len(ids)]))
    v = pts[:, 2]
    out = np.empty((len(starts), 14))
    out[:, N] = ends - starts + 1
    out[:, VSUM] = np.add.reduceat(v, starts)
    out[:, S0:V0 + 1] = pts[starts]
    out[:, S1:V1 + 1] = pts[ends]
    out[:, SMIN:VMIN + 1] = pts[_first_extreme(v, starts, group, np.fmin)]
    out[:, SMAX:VMAX + 1] = pts[_first_extreme(v, starts, group, np.fmax)]
    return ids[starts], out


def _first_extreme(v: Any, starts: Any, group: Any, reduce: Any) -> Any:
    """Index of the first minimum (np.fmin) or maximum (np.fmax) of each group, NaN ignored; a
    group of NaNs: its first point."""
    import numpy as np

    hit = np.flatnonzero(v == reduce.reduceat(v, starts)[group])
    g = group[hit]
    first = np.r_[True, g[1:] != g[:-1]]
    out = starts.copy()
    out[g[first]] = hit[first]
    return out


def combine(a: Any, b: Any) -> Any:
    """One bucket record from two consecutive ones (a before b)."""
    r = a.copy()
    r[N], r[VSUM] = a[N] + b[N], a[VSUM] + b[VSUM]
    r[S1:V1 + 1] = b[S1:V1 + 1]
    if b[VMIN] < a[VMIN] or (a[VMIN] != a[VMIN] and b[VMIN] == b[VMIN]):  # NaN loses
        r[SMIN:VMIN + 1] = b[SMIN:VMIN + 1]
    if b[VMAX] > a[VMAX] or (a[VMAX] != a[VMAX] and b[VMAX] == b[VMAX]):
        r[SMAX:VMAX + 1] = b[SMAX:VMAX + 1]
    return r


def merge(rows: Any, ids: Any) -> tuple[Any, Any]:
    """Records of consecutive buckets (ids ascending) merged into one record per bucket id: counts
    and sums added, the first record's first point, the last record's last, the lowest minimum and
    the highest maximum (the first one met on a tie)."""
    import numpy as np

    starts = np.flatnonzero(np.r_[True, ids[1:] != ids[:-1]])
    ends = np.r_[starts[1:], len(ids)] - 1
    group = np.repeat(np.arange(len(starts)), np.diff(np.r_[starts, len(ids)]))
    out = np.empty((len(starts), 14))
    out[:, N] = np.add.reduceat(rows[:, N], starts)
    out[:, VSUM] = np.add.reduceat(rows[:, VSUM], starts)
    out[:, S0:V0 + 1] = rows[starts, S0:V0 + 1]
    out[:, S1:V1 + 1] = rows[ends, S1:V1 + 1]
    # lexsort is stable: within a group, equal values keep their order (the first one wins);
    # NaN sorts last, so a NaN is the minimum or maximum only of a bucket of NaNs
    low = np.lexsort((rows[:, VMIN], group))[starts]
    high = np.lexsort((-rows[:, VMAX], group))[starts]
    out[:, SMIN:VMIN + 1] = rows[low, SMIN:VMIN + 1]
    out[:, SMAX:VMAX + 1] = rows[high, SMAX:VMAX + 1]
    return ids[starts], out


def delete(c: sqlite3.Connection, run_id: str) -> None:
    c.execute("DELETE FROM levels WHERE sid IN (SELECT id FROM series WHERE run_id=?)", (run_id,))
    c.execute("DELETE FROM series WHERE run_id=?", (run_id,))
    c.execute("DELETE FROM level_runs WHERE run_id=?", (run_id,))


# --- reading ------------------------------------------------------------------------------------
def choose_level(count: int, points: int) -> int:
    """The coarsest level whose buckets (two points each) still give >= `points` points."""
    if count <= RAW_KEEP:
        return 0
    k = 1
    while k < LEVELS and math.ceil(count / SIZES[k]) * 2 >= points:
        k += 1
    return k


def read(c: sqlite3.Connection, run_id: str, points: int, *, names: Sequence[str] | None = None,
         ranks: Sequence[int] | None = None) -> Snapshot:
    """Each series of the run (or those named / of those ranks) at most `points` points, with the
    newest event number they include, in one read transaction."""
    if points < 4:
        raise ValueError(f"series points: got {points!r}; expected an int >= 4")
    c.execute("BEGIN")
    try:
        seq = c.execute("SELECT COALESCE(MAX(seq), 0) FROM events WHERE run_id=?",
                        (run_id,)).fetchone()[0]
        row = c.execute("SELECT upto FROM level_runs WHERE run_id=?", (run_id,)).fetchone()
        if (row is not None and row[0] >= seq) or not seq:
            return Snapshot(seq, _read_series(c, run_id, points, names, ranks))
    finally:
        c.execute("COMMIT")
    # levels behind the events: a gpu_lab without levels wrote some since (the registry's
    # upgrade built every older run's, and the next add_events catches up). A read never writes.
    return _in_memory(c, run_id, points, names, ranks)


def _read_series(c: sqlite3.Connection, run_id: str, points: int, names, ranks) -> dict:
    import numpy as np

    out = {}
    for sid, rank, name, count in c.execute(
            "SELECT id, rank, name, count FROM series WHERE run_id=? ORDER BY rank, name",
            (run_id,)).fetchall():
        if (names is not None and name not in names) or (ranks is not None and rank not in ranks):
            continue
        level = choose_level(count, points)
        width = WIDTH[level > 0]
        recs = [unpack(r[0], r[1], width) for r in c.execute(
            "SELECT data, packed FROM levels WHERE sid=? AND level=? ORDER BY chunk", (sid, level))]
        recs = np.concatenate(recs) if recs else np.empty((0, width))
        stepped = ~np.isnan(recs[:, 0]) if level == 0 else None
        env = envelope(recs, level)
        keep = minmax_indices(env[2], points) if len(env[2]) > points else slice(None)
        steps, times, values = (a[keep] for a in env)
        out[(rank, name)] = Points(rank, name, count, level, _steps(steps), times.tolist(),
                                   values.tolist(), env, stepped)
    return out


def _steps(steps: Any) -> list:
    """Steps as the ranks reported them: integers unless some are not whole."""
    import numpy as np

    whole = bool(np.all(np.isfinite(steps) & (steps == np.floor(steps))))
    return steps.astype(np.int64).tolist() if whole else steps.tolist()


def envelope(recs: Any, level: int) -> tuple[Any, Any, Any]:
    """(steps, times, values) arrays of a level's records: the raw points at level 0; else the
    series' first point, each bucket's minimum and maximum in step order, and its last point."""
    import numpy as np

    if level == 0 or not len(recs):
        r = recs if level == 0 else np.empty((0, 3))
        steps = r[:, 0].copy()
        gaps = np.isnan(steps)
        steps[gaps] = np.flatnonzero(gaps)  # a point without a step sits at its index
        return steps, r[:, 1].copy(), r[:, 2].copy()
    lo, hi = recs[:, SMIN:VMIN + 1], recs[:, SMAX:VMAX + 1]
    lo_first = (lo[:, 0] < hi[:, 0]) | ((lo[:, 0] == hi[:, 0]) & (lo[:, 1] <= hi[:, 1]))
    a = np.where(lo_first[:, None], lo, hi)
    b = np.where(lo_first[:, None], hi, lo)
    pts = np.empty((2 * len(recs), 3))
    pts[0::2], pts[1::2] = a, b
    nan = recs[np.isnan(recs[:, VSUM]), S1:V1 + 1].copy()  # a bucket that holds a NaN shows
    nan[:, 2] = np.nan                                      # one, at its last point's step
    if len(nan):
        pts = np.vstack((pts, nan))
        pts = pts[np.argsort(pts[:, 0], kind="stable")]
    pts = np.vstack((recs[:1, S0:V0 + 1], pts, recs[-1:, S1:V1 + 1]))
    # a bucket whose min and max are one point, and the ends, which may repeat a neighbour
    same = np.r_[False, np.all((pts[1:] == pts[:-1]) | (np.isnan(pts[1:]) & np.isnan(pts[:-1])),
                               axis=1)]
    pts = pts[~same]
    return pts[:, 0], pts[:, 1], pts[:, 2]


def _in_memory(c: sqlite3.Connection, run_id: str, points: int, names, ranks) -> Snapshot:
    """The levels of a run without (up-to-date) levels in a registry this process may only read:
    built in memory from its events, at each read (a full read: the one case that costs the
    run's length)."""
    m = sqlite3.connect(":memory:")
    m.executescript(SCHEMA[:SCHEMA.index("CREATE INDEX")])
    c.execute("BEGIN")
    try:
        seq = c.execute("SELECT COALESCE(MAX(seq), 0) FROM events WHERE run_id=?",
                        (run_id,)).fetchone()[0]
        _catch_up(c, run_id, 0, seq, into=m)
    finally:
        c.execute("COMMIT")
    return Snapshot(seq, _read_series(m, run_id, points, names, ranks))


def backfill_all(c: sqlite3.Connection) -> None:
    """Levels for every run recorded before levels existed: part of the registry's upgrade (under
    its lock, once), so that readers never have to write them."""
    for (run_id,) in c.execute("SELECT id FROM runs WHERE id NOT IN "
                               "(SELECT run_id FROM level_runs)").fetchall():
        backfill(c, run_id)


def backfill(c: sqlite3.Connection, run_id: str) -> None:
    """Bring the run's levels up to its newest event, in one write transaction (writers of the
    run wait): all of them for a run recorded before levels existed (one full read, once), else
    what a gpu_lab without levels added since. Afterwards add_events keeps them."""
    c.execute("BEGIN IMMEDIATE")
    try:
        row = c.execute("SELECT upto FROM level_runs WHERE run_id=?", (run_id,)).fetchone()
        if row is None:
            delete(c, run_id)
            c.execute("INSERT INTO level_runs (run_id, upto) VALUES (?, 0)", (run_id,))
        seq = c.execute("SELECT COALESCE(MAX(seq), 0) FROM events WHERE run_id=?",
                        (run_id,)).fetchone()[0]
        _catch_up(c, run_id, row[0] if row else 0, seq)
        c.execute("UPDATE level_runs SET upto=? WHERE run_id=?", (seq, run_id))
        c.execute("COMMIT")
    except BaseException:
        c.execute("ROLLBACK")
        raise


# --- the mean over ranks ---------------------------------------------------------------------------
def mean_of_ranks(series: list[Points], points: int) -> tuple[list, list, list]:
    """The mean over ranks of one metric (record.mean's rule), at most `points` points: exact per
    step when every rank's series was read raw (level 0), else from each rank's envelope."""
    series = [p for p in series if len(p.env[0])]
    if not series:
        return [], [], []
    exact = all(p.level == 0 for p in series)
    # a raw point without a step sits at its index: it has no step to be averaged at
    grid, times, values = mean.over_ranks(
        [tuple(a[p.stepped] for a in p.env) if exact else p.env for p in series], exact)
    keep = minmax_indices(values, points) if len(values) > points else slice(None)
    return _steps(grid[keep]), times[keep].tolist(), values[keep].tolist()


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
