# Long: a run's record in one place: its schema, its writes, its reads, and its table view.
"""The run registry: an embedded SQLite database of runs, their configs and their metrics.

It lives at `$GPU_LAB_HOME/registry.db` (default `~/.gpu_lab/`). WAL mode lets the server extension
and other kernels read while a receiver writes. A run whose supervisor died unseen (the kernel was
killed, the machine rebooted) is marked `lost` the next time anyone lists runs.
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

from .stream.events import ACTIVE_STATUSES as ACTIVE
from .stream.events import KINDS, METRIC
from .stream.events import STATUSES
from .stream import levels as _levels

_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    id TEXT PRIMARY KEY,
    name TEXT,
    status TEXT NOT NULL,
    config TEXT,
    num_processes INTEGER,
    num_nodes INTEGER DEFAULT 1,
    node_rank INTEGER DEFAULT 0,
    host TEXT,
    pid INTEGER,
    pgid INTEGER,
    pid_started REAL,
    started REAL,
    ended REAL,
    notebook TEXT,
    output_dir TEXT,
    run_dir TEXT,
    error TEXT,
    kind TEXT DEFAULT 'launch'
);
CREATE TABLE IF NOT EXISTS events (
    run_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    rank INTEGER NOT NULL,
    kind TEXT NOT NULL,
    t REAL NOT NULL,
    step INTEGER,
    data TEXT NOT NULL,
    PRIMARY KEY (run_id, seq)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS checkpoints (
    run_id TEXT NOT NULL,
    step INTEGER NOT NULL,
    path TEXT NOT NULL,
    t REAL NOT NULL
);
"""

# Columns added after the first release: (name, SQL type). Older databases get them on open.
_ADDED = (("reason", "TEXT"), ("detach", "INTEGER DEFAULT 0"), ("events_address", "TEXT"),
          ("entry", "TEXT"), ("resumed_from", "TEXT"), ("last_step", "INTEGER"),
          ("summary", "TEXT"))

_COLUMNS = ("id", "name", "status", "config", "num_processes", "num_nodes", "node_rank", "host",
            "pid", "pgid", "pid_started", "started", "ended", "notebook", "output_dir", "run_dir",
            "error", "kind") + tuple(name for name, _ in _ADDED)
_JSON_COLUMNS = ("config", "resumed_from", "summary")


def home() -> Path:
    """gpu_lab's state directory: $GPU_LAB_HOME, else ~/.gpu_lab."""
    p = Path(os.environ.get("GPU_LAB_HOME") or Path.home() / ".gpu_lab")
    p.mkdir(parents=True, exist_ok=True)
    return p


class Registry:
    """A handle on the registry database. Cheap to make; one SQLite connection per thread."""

    def __init__(self, path: str | os.PathLike | None = None) -> None:
        self.path = Path(path) if path is not None else home() / "registry.db"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._local = threading.local()
        # Switching a new database to WAL takes an exclusive lock, and SQLite answers a second
        # process doing the same at that moment with "database is locked" at once, without its
        # busy timeout (seen: two torchrun ranks opening a fresh registry). So the first-open setup
        # (WAL, which then persists in the file, and the schema) runs under a file lock.
        with open(self.path.with_name(self.path.name + ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            with self._conn() as c:
                c.execute("PRAGMA journal_mode=WAL")
                c.executescript(_SCHEMA + _levels.SCHEMA)
                _upgrade(c)

    def _conn(self) -> sqlite3.Connection:
        c = getattr(self._local, "conn", None)
        if c is None or getattr(self._local, "pid", None) != os.getpid():
            c = sqlite3.connect(self.path, timeout=30, isolation_level=None)
            c.row_factory = sqlite3.Row
            c.execute("PRAGMA busy_timeout=30000")
            c.execute("PRAGMA synchronous=NORMAL")
            self._local.conn, self._local.pid = c, os.getpid()
        return c

    # --- runs ------------------------------------------------------------------------------------
    def create_run(self, run_id: str, *, name: str | None = None, config: dict | None = None,
                   num_processes: int | None = None, num_nodes: int = 1, node_rank: int = 0,
                   output_dir: str | None = None, run_dir: str | None = None,
                   notebook: str | None = None, kind: str = "launch",
                   status: str = "pending", **extra: Any) -> None:
        self._check_status(status)
        fields = {"id": run_id, "name": name or run_id, "status": status,
                  "config": config or {}, "num_processes": num_processes,
                  "num_nodes": num_nodes, "node_rank": node_rank, "host": socket.gethostname(),
                  "started": time.time(), "notebook": notebook, "output_dir": output_dir,
                  "run_dir": run_dir, "kind": kind, **extra}
        bad = set(fields) - set(_COLUMNS)
        if bad:
            raise ValueError(f"Registry.create_run: unknown column(s) {sorted(bad)}; accepted: "
                             f"{_COLUMNS}")
        names = ", ".join(fields)
        with self._conn() as c:
            c.execute(f"INSERT INTO runs ({names}) VALUES ({','.join('?' * len(fields))})",
                      [_to_sql(k, v) for k, v in fields.items()])

    def update(self, run_id: str, **fields: Any) -> None:
        bad = set(fields) - set(_COLUMNS)
        if bad:
            raise ValueError(f"Registry.update: unknown column(s) {sorted(bad)}; accepted: {_COLUMNS}")
        if "status" in fields:
            self._check_status(fields["status"])
        sets = ", ".join(f"{k}=?" for k in fields)
        with self._conn() as c:
            c.execute(f"UPDATE runs SET {sets} WHERE id=?",
                      (*(_to_sql(k, v) for k, v in fields.items()), run_id))

    def set_status(self, run_id: str, status: str, *, error: str | None = None,
                   reason: str | None = None, final: bool | None = None,
                   overwrite: bool = False) -> bool:
        """Set a run's status; a final status also stamps `ended`. Only an active run changes
        (a late 'running' event cannot revive a finished run, and a supervisor's 'stopped' is not
        turned into 'lost' by a reader) unless `overwrite`. Returns whether the row changed."""
        self._check_status(status)
        is_final = status not in ACTIVE if final is None else final
        guard = "" if overwrite else f" AND status IN ({','.join('?' * len(ACTIVE))})"
        with self._conn() as c:
            cur = c.execute(
                "UPDATE runs SET status=?, ended=CASE WHEN ? THEN COALESCE(ended, ?) END, "
                f"error=COALESCE(?, error), reason=COALESCE(?, reason) WHERE id=?{guard}",
                (status, is_final, time.time(), error, reason, run_id,
                 *(() if overwrite else ACTIVE)))
        return cur.rowcount > 0

    def get_run(self, run_id: str) -> dict | None:
        self._mark_lost()
        row = self._conn().execute("SELECT * FROM runs WHERE id=?", (run_id,)).fetchone()
        return _row(row) if row else None

    def find_run(self, run_id_or_name: str) -> dict:
        """The run with this id, else the newest run with this name; KeyError naming the recent
        runs when there is neither."""
        row = self.get_run(run_id_or_name)
        if row is not None:
            return row
        hit = self._conn().execute("SELECT * FROM runs WHERE name=? ORDER BY started DESC LIMIT 1",
                                   (run_id_or_name,)).fetchone()
        if hit is not None:
            return _row(hit)
        recent = [f"{r['id']} ({r['name']})" for r in self.list_runs(limit=5)]
        raise KeyError(f"no run with id or name {run_id_or_name!r} in {self.path}; recent runs: "
                       f"{', '.join(recent) or '(none)'}")

    def list_runs(self, *, status: str | Sequence[str] | None = None, limit: int | None = None,
                  with_last: bool = False, name: str | None = None) -> list[dict]:
        """Runs, newest first; `with_last` adds each run's last step and last loss. `name` keeps
        the runs whose name contains it."""
        self._mark_lost()
        q, where, args = "SELECT * FROM runs", [], []
        if status is not None:
            sts = [status] if isinstance(status, str) else list(status)
            for s in sts:
                self._check_status(s)
            where.append(f"status IN ({','.join('?' * len(sts))})")
            args += sts
        if name is not None:
            where.append("instr(name, ?) > 0")
            args.append(name)
        if where:
            q += " WHERE " + " AND ".join(where)
        q += " ORDER BY started DESC"
        if limit is not None:
            q += " LIMIT ?"
            args.append(int(limit))
        rows = [_row(r) for r in self._conn().execute(q, args).fetchall()]
        if with_last:
            for r in rows:
                r.update(_last(r))
        return rows

    def delete_run(self, run_id: str) -> None:
        with self._conn() as c:
            c.execute("DELETE FROM events WHERE run_id=?", (run_id,))
            c.execute("DELETE FROM checkpoints WHERE run_id=?", (run_id,))
            _levels.delete(c, run_id)
            c.execute("DELETE FROM runs WHERE id=?", (run_id,))

    # --- events ----------------------------------------------------------------------------------
    def add_events(self, run_id: str, events: Sequence[dict], *,
                   end: dict | None = None) -> list[int]:
        """Append events (dicts of the stream's schema) to a run's record in one transaction and
        return their sequence numbers. Numbers are given here, under the write lock, so several
        writers of one run (the ranks of a headless job) never collide, and a reader that has
        seen seq N has everything up to N. Also keeps the run's last step and last values.
        `end` ({"status", "reason", "error"}) also ends the run in the same transaction."""
        if not events and end is None:
            return []
        c = self._conn()
        c.execute("BEGIN IMMEDIATE")
        try:
            base = c.execute("SELECT COALESCE(MAX(seq), 0) FROM events WHERE run_id=?",
                             (run_id,)).fetchone()[0]
            rows = [(run_id, i, int(e.get("rank", -1)), e["kind"], float(e["t"]), e.get("step"),
                     _encode(e.get("data") or {})) for i, e in enumerate(events, base + 1)]
            c.executemany("INSERT INTO events (run_id, seq, rank, kind, t, step, data) "
                          "VALUES (?,?,?,?,?,?,?)", rows)
            _levels.record(c, run_id, events, base)  # the levels of its series, in step
            metric = [e for e in events if e["kind"] == "metric"]
            if metric:
                row = c.execute("SELECT last_step, summary FROM runs WHERE id=?",
                                (run_id,)).fetchone()
                if row is not None:
                    step, summary = _fold_last(row[0], row[1], metric)
                    c.execute("UPDATE runs SET last_step=?, summary=? WHERE id=?",
                              (step, summary, run_id))
            if end is not None:
                self._check_status(end["status"])
                c.execute("UPDATE runs SET status=?, ended=COALESCE(ended, ?), "
                          "error=COALESCE(?, error), reason=COALESCE(?, reason) WHERE id=? AND "
                          f"status IN ({','.join('?' * len(ACTIVE))})",
                          (end["status"], time.time(), end.get("error"), end.get("reason"),
                           run_id, *ACTIVE))
            c.execute("COMMIT")
        except BaseException:
            c.execute("ROLLBACK")
            raise
        return list(range(base + 1, base + 1 + len(events)))

    def events(self, run_id: str, after: int = 0, upto: int | None = None,
               kinds: Sequence[str] | None = None, limit: int | None = None) -> list[dict]:
        """A run's events with seq > after (and <= upto), oldest first, each with its `seq`."""
        q = "SELECT seq, rank, kind, t, step, data FROM events WHERE run_id=? AND seq>?"
        args: list[Any] = [run_id, int(after)]
        if upto is not None:
            q += " AND seq<=?"
            args.append(int(upto))
        if kinds:
            q += f" AND kind IN ({','.join('?' * len(kinds))})"
            args += list(kinds)
        q += " ORDER BY seq"
        if limit is not None:
            q += " LIMIT ?"
            args.append(int(limit))
        return [{"run": run_id, "seq": r[0], "rank": r[1], "kind": r[2], "t": r[3], "step": r[4],
                 "data": json.loads(r[5])} for r in self._conn().execute(q, args)]

    def last_seq(self, run_id: str) -> int:
        """The newest recorded event's sequence number (0: none yet)."""
        return self._conn().execute("SELECT COALESCE(MAX(seq), 0) FROM events WHERE run_id=?",
                                    (run_id,)).fetchone()[0]

    def last_events(self, run_id: str, kinds: Sequence[str], limit: int,
                    upto: int | None = None) -> list[dict]:
        """The newest `limit` events of these non-metric kinds (seq <= upto), oldest first: read
        through the index of non-metric events, so a run's length does not count."""
        bad = [k for k in kinds if k not in KINDS or k == METRIC]
        if bad or not kinds:
            raise ValueError(f"Registry.last_events: kinds {list(kinds)!r}; accepted: any of "
                             f"{', '.join(k for k in KINDS if k != METRIC)}")
        rows: list = []
        for kind in dict.fromkeys(kinds):  # one index range per kind, newest first
            rows += self._conn().execute(
                "SELECT seq, rank, kind, t, step, data FROM events INDEXED BY events_notes "
                "WHERE run_id=? AND kind<>'metric' AND kind=? AND seq<=? ORDER BY seq DESC "
                "LIMIT ?", (run_id, kind, upto if upto is not None else 2**62,
                            int(limit))).fetchall()
        rows = sorted(rows, key=lambda r: r[0])[-int(limit):] if limit else []
        return [{"run": run_id, "seq": r[0], "rank": r[1], "kind": r[2], "t": r[3], "step": r[4],
                 "data": json.loads(r[5])} for r in rows]

    def count_events(self, run_id: str, kind: str, upto: int | None = None) -> int:
        """How many events of one non-metric kind the run holds (seq <= upto)."""
        if kind not in KINDS or kind == METRIC:
            raise ValueError(f"Registry.count_events: kind {kind!r}; accepted: any of "
                             f"{', '.join(k for k in KINDS if k != METRIC)}")
        return self._conn().execute(
            "SELECT COUNT(*) FROM events INDEXED BY events_notes WHERE run_id=? AND "
            "kind<>'metric' AND kind=? AND seq<=?",
            (run_id, kind, upto if upto is not None else 2**62)).fetchone()[0]

    def series(self, run_id: str, points: int, names: Sequence[str] | None = None,
               ranks: Sequence[int] | None = None) -> "_levels.Snapshot":
        """Every metric series of the run (or those named / of those ranks), each at most
        `points` points with its min/max envelope exact, and the newest event number they
        include: read from the downsampled levels, in time bounded by `points`."""
        return _levels.read(self._conn(), run_id, int(points), names=names, ranks=ranks)

    def metric_pages(self, run_id: str, page: int = 50_000, name: str | None = None,
                     rank: int | None = None) -> Iterable[list[tuple]]:
        """Every metric point of the run at full resolution as pages of (seq, rank, step, t,
        name, value) tuples, oldest first: memory bounded by `page` events."""
        after = 0
        while True:
            q = ("SELECT seq, rank, step, t, data FROM events WHERE run_id=? AND seq>? AND "
                 "kind='metric'" + (" AND rank=?" if rank is not None else "") +
                 " ORDER BY seq LIMIT ?")
            args = (run_id, after, *(() if rank is None else (int(rank),)), int(page))
            rows = self._conn().execute(q, args).fetchall()
            if not rows:
                return
            out = [(r[0], r[1], r[2], r[3], k, v) for r in rows
                   for k, v in json.loads(r[4]).items()
                   if (name is None or k == name) and isinstance(v, (int, float))
                   and not isinstance(v, bool)]
            after = rows[-1][0]
            yield out

    def add_metrics(self, rows: Iterable[tuple]) -> int:
        """Record (run_id, rank, step, t, name, value) rows, one metric event per row: a shorthand
        for tools and tests that write a run's record without a stream."""
        by_run: dict[str, list[dict]] = {}
        n = 0
        for run_id, rank, step, t, name, value in rows:
            by_run.setdefault(run_id, []).append(
                {"rank": rank, "kind": "metric", "t": t, "step": step, "data": {name: value}})
            n += 1
        for run_id, events in by_run.items():
            self.add_events(run_id, events)
        return n

    def metrics(self, run_id: str, name: str | None = None, rank: int | None = None) -> list[dict]:
        """A run's metric points as rows {rank, step, t, name, value}, in the order reported."""
        q = "SELECT rank, step, t, data FROM events WHERE run_id=? AND kind='metric'"
        args: list[Any] = [run_id]
        if rank is not None:
            q += " AND rank=?"
            args.append(rank)
        if name is not None:  # a cheap pre-filter; the JSON decides
            q += " AND instr(data, ?) > 0"
            args.append(json.dumps(name))
        q += " ORDER BY seq"
        out = []
        for r in self._conn().execute(q, args):
            for k, v in json.loads(r[3]).items():
                if name is None or k == name:
                    out.append({"rank": r[0], "step": r[1], "t": r[2], "name": k, "value": v})
        return out

    def last_values(self, run_id: str) -> dict:
        """{'last_step': int|None, 'last_loss': float|None} over all ranks."""
        row = self._conn().execute("SELECT last_step, summary FROM runs WHERE id=?",
                                   (run_id,)).fetchone()
        return _last(dict(row)) if row else {"last_step": None, "last_loss": None}

    def summary(self, run_id: str) -> dict:
        """Last value of every metric (rank 0 where present): the comparison table's row."""
        row = self._conn().execute("SELECT summary FROM runs WHERE id=?", (run_id,)).fetchone()
        return _summary_values(row[0] if row else None)

    def add_checkpoint(self, run_id: str, step: int, path: str) -> None:
        with self._conn() as c:
            c.execute("INSERT INTO checkpoints (run_id, step, path, t) VALUES (?,?,?,?)",
                      (run_id, step, path, time.time()))

    # --- lost runs -------------------------------------------------------------------------------
    def _mark_lost(self) -> None:
        """Mark runs of this host whose supervisor is gone but whose status is still active."""
        host = socket.gethostname()
        rows = self._conn().execute(
            f"SELECT id, pid, pid_started, started FROM runs WHERE host=? AND status IN "
            f"({','.join('?' * len(ACTIVE))})", (host, *ACTIVE)).fetchall()
        for r in rows:
            if r["pid"] is None:
                # never got a supervisor: lost if it has been pending for a minute
                if time.time() - (r["started"] or 0) > 60:
                    self.set_status(r["id"], "lost", error="the run never started a supervisor")
                continue
            if not _alive(r["pid"], r["pid_started"]):
                self.set_status(r["id"], "lost",
                                reason="its supervisor process ended without recording a final "
                                       "status",
                                error=f"the supervisor (pid {r['pid']}) ended without recording "
                                      "a final status (killed, or the machine went down)")

    @staticmethod
    def _check_status(status: str) -> None:
        if status not in STATUSES:
            raise ValueError(f"run status: got {status!r}; accepted: {', '.join(STATUSES)}")


def _upgrade(c: sqlite3.Connection) -> None:
    """Bring an older database to this schema: new run columns, and per-scalar metric rows (the
    first schema) moved into the event log, one event per row, so no history is lost."""
    have = {r[1] for r in c.execute("PRAGMA table_info(runs)")}
    for name, typ in _ADDED:
        if name not in have:
            c.execute(f"ALTER TABLE runs ADD COLUMN {name} {typ}")
    if c.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name='metrics'").fetchone():
        c.execute("INSERT OR IGNORE INTO events (run_id, seq, rank, kind, t, step, data) "
                  "SELECT run_id, rowid, rank, 'metric', t, step, json_object(name, value) "
                  "FROM metrics")
        c.execute("DROP TABLE metrics")


def _fold_last(step: int | None, summary: str | None, metric: list[dict]) -> tuple:
    """The run's (last step, summary JSON) after these metric events. The summary maps each metric
    to [rank, value]: the newest value of the lowest rank that reports it (rank 0's numbers win)."""
    steps = [e["step"] for e in metric if e.get("step") is not None]
    if steps:
        step = max(steps) if step is None else max(step, max(steps))
    values = json.loads(summary) if summary else {}
    lowest = min(int(e.get("rank", 0)) for e in metric)
    seen: dict = {}
    for e in reversed(metric):  # newest first: the first value met of each name is the newest
        if int(e.get("rank", 0)) == lowest:
            for k, v in e["data"].items():
                if k not in seen and isinstance(v, (int, float)) and not isinstance(v, bool):
                    seen[k] = v
    for k, v in seen.items():
        old = values.get(k)
        if old is None or lowest <= old[0]:
            values[k] = [lowest, v]
    return step, json.dumps(values)


def _summary_values(raw: str | None) -> dict:
    if not raw:
        return {}
    return {k: v[1] for k, v in json.loads(raw).items()}


def _last(row: dict) -> dict:
    values = row["summary"] if isinstance(row.get("summary"), dict) else \
        _summary_values(row.get("summary"))
    return {"last_step": row.get("last_step"), "last_loss": values.get("loss")}


def _plain(o: Any) -> Any:
    try:
        return float(o)
    except Exception:
        return repr(o)


_encode = json.JSONEncoder(separators=(",", ":"), default=_plain).encode  # made once: per event


def _to_sql(column: str, value: Any) -> Any:
    if column in _JSON_COLUMNS and value is not None and not isinstance(value, str):
        return json.dumps(value, default=str)
    return value


def _alive(pid: int, started: float | None) -> bool:
    import psutil

    try:
        p = psutil.Process(pid)
        if p.status() == psutil.STATUS_ZOMBIE:
            return False
        return started is None or abs(p.create_time() - started) < 1.0
    except psutil.Error:
        return False


def _row(r: sqlite3.Row) -> dict:
    d = dict(r)
    for k in _JSON_COLUMNS:
        if k == "summary":
            d[k] = _summary_values(d.get(k))
            continue
        try:
            d[k] = json.loads(d[k]) if d.get(k) else ({} if k == "config" else None)
        except ValueError:
            pass
    return d


class RunTable(list):
    """Runs as a table: HTML in a notebook, aligned text in a terminal, still a list of row dicts
    (iterate it, index it, read any column of a row)."""

    COLS = (("id", "id"), ("name", "name"), ("status", "status"), ("num_processes", "ranks"),
            ("last_step", "step"), ("last_loss", "loss"), ("started", "started"),
            ("duration", "duration"), ("note", "note"))

    def _cells(self, r: dict) -> list[str]:
        out = []
        for key, _ in self.COLS:
            if key == "duration":
                start, end = r.get("started"), r.get("ended") or time.time()
                v = _duration(end - start) if start else ""
            elif key == "note":
                v = r.get("reason") or ""
                src = r.get("resumed_from")
                if isinstance(src, dict) and src.get("step") is not None:
                    v = f"resumed from step {src['step']}" + (f"; {v}" if v else "")
            else:
                v = r.get(key)
                if key == "started" and v:
                    v = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(v))
                elif isinstance(v, float):
                    v = f"{v:.4g}"
            out.append("" if v is None else str(v))
        return out

    def _repr_html_(self) -> str:
        import html

        head = "".join(f"<th style='text-align:left'>{t}</th>" for _, t in self.COLS)
        body = "".join("<tr>" + "".join(f"<td style='text-align:left'>{html.escape(c)}</td>"
                                        for c in self._cells(r)) + "</tr>" for r in self)
        return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"

    def __str__(self) -> str:
        rows = [[t for _, t in self.COLS]] + [self._cells(r) for r in self]
        widths = [max(len(row[i]) for row in rows) for i in range(len(self.COLS))]
        return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()
                         for row in rows)

    def __repr__(self) -> str:
        return str(self) if self else "RunTable([])  (no runs)"


def _duration(seconds: float) -> str:
    s = int(max(0, seconds))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def runs(status: str | Sequence[str] | None = None, name: str | None = None,
         limit: int | None = None) -> RunTable:
    """The runs in the registry, newest first, as a table: `status` keeps those in that status
    (or any of several), `name` those whose name contains it."""
    return RunTable(Registry().list_runs(status=status, name=name, limit=limit, with_last=True))
