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

STATUSES = ("pending", "running", "stopping", "succeeded", "failed", "stopped", "lost")
ACTIVE = ("pending", "running", "stopping")

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
CREATE TABLE IF NOT EXISTS metrics (
    run_id TEXT NOT NULL,
    rank INTEGER NOT NULL,
    step INTEGER,
    t REAL NOT NULL,
    name TEXT NOT NULL,
    value REAL
);
CREATE INDEX IF NOT EXISTS metrics_run ON metrics(run_id, name, rank, step);
CREATE TABLE IF NOT EXISTS checkpoints (
    run_id TEXT NOT NULL,
    step INTEGER NOT NULL,
    path TEXT NOT NULL,
    t REAL NOT NULL
);
"""

_COLUMNS = ("id", "name", "status", "config", "num_processes", "num_nodes", "node_rank", "host",
            "pid", "pgid", "pid_started", "started", "ended", "notebook", "output_dir", "run_dir",
            "error", "kind")


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
                c.executescript(_SCHEMA)

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
                   status: str = "pending") -> None:
        self._check_status(status)
        with self._conn() as c:
            c.execute(
                "INSERT INTO runs (id, name, status, config, num_processes, num_nodes, node_rank, "
                "host, started, notebook, output_dir, run_dir, kind) "
                "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (run_id, name or run_id, status, json.dumps(config or {}), num_processes,
                 num_nodes, node_rank, socket.gethostname(), time.time(), notebook,
                 output_dir, run_dir, kind))

    def update(self, run_id: str, **fields: Any) -> None:
        bad = set(fields) - set(_COLUMNS)
        if bad:
            raise ValueError(f"Registry.update: unknown column(s) {sorted(bad)}; accepted: {_COLUMNS}")
        if "status" in fields:
            self._check_status(fields["status"])
        if "config" in fields and not isinstance(fields["config"], str):
            fields["config"] = json.dumps(fields["config"])
        sets = ", ".join(f"{k}=?" for k in fields)
        with self._conn() as c:
            c.execute(f"UPDATE runs SET {sets} WHERE id=?", (*fields.values(), run_id))

    def set_status(self, run_id: str, status: str, *, error: str | None = None,
                   final: bool | None = None) -> None:
        """Set a run's status; a final status also stamps `ended`. A final status is never
        overwritten by an active one (a late 'running' event cannot revive a finished run)."""
        self._check_status(status)
        is_final = status not in ACTIVE if final is None else final
        with self._conn() as c:
            if is_final:
                c.execute("UPDATE runs SET status=?, ended=COALESCE(ended, ?), "
                          "error=COALESCE(?, error) WHERE id=?", (status, time.time(), error, run_id))
            else:
                c.execute("UPDATE runs SET status=? WHERE id=? AND status IN "
                          f"({','.join('?' * len(ACTIVE))})", (status, run_id, *ACTIVE))

    def get_run(self, run_id: str) -> dict | None:
        self._mark_lost()
        row = self._conn().execute("SELECT * FROM runs WHERE id=?", (run_id,)).fetchone()
        return _row(row) if row else None

    def list_runs(self, *, status: str | Sequence[str] | None = None, limit: int | None = None,
                  with_last: bool = False) -> list[dict]:
        """Runs, newest first; `with_last` adds each run's last step and last loss."""
        self._mark_lost()
        q, args = "SELECT * FROM runs", []
        if status is not None:
            sts = [status] if isinstance(status, str) else list(status)
            q += f" WHERE status IN ({','.join('?' * len(sts))})"
            args += sts
        q += " ORDER BY started DESC"
        if limit is not None:
            q += " LIMIT ?"
            args.append(int(limit))
        rows = [_row(r) for r in self._conn().execute(q, args).fetchall()]
        if with_last:
            for r in rows:
                r.update(self.last_values(r["id"]))
        return rows

    def delete_run(self, run_id: str) -> None:
        with self._conn() as c:
            c.execute("DELETE FROM metrics WHERE run_id=?", (run_id,))
            c.execute("DELETE FROM checkpoints WHERE run_id=?", (run_id,))
            c.execute("DELETE FROM runs WHERE id=?", (run_id,))

    # --- metrics ---------------------------------------------------------------------------------
    def add_metrics(self, rows: Iterable[tuple]) -> int:
        """Insert (run_id, rank, step, t, name, value) rows in one transaction."""
        rows = list(rows)
        if rows:
            c = self._conn()
            c.execute("BEGIN")
            try:
                c.executemany("INSERT INTO metrics (run_id, rank, step, t, name, value) "
                              "VALUES (?,?,?,?,?,?)", rows)
                c.execute("COMMIT")
            except BaseException:
                c.execute("ROLLBACK")
                raise
        return len(rows)

    def metrics(self, run_id: str, name: str | None = None, rank: int | None = None) -> list[dict]:
        q, args = "SELECT rank, step, t, name, value FROM metrics WHERE run_id=?", [run_id]
        if name is not None:
            q += " AND name=?"
            args.append(name)
        if rank is not None:
            q += " AND rank=?"
            args.append(rank)
        q += " ORDER BY t, rowid"
        return [dict(r) for r in self._conn().execute(q, args).fetchall()]

    def last_values(self, run_id: str) -> dict:
        """{'last_step': int|None, 'last_loss': float|None} over all ranks."""
        c = self._conn()
        step = c.execute("SELECT MAX(step) FROM metrics WHERE run_id=?", (run_id,)).fetchone()[0]
        loss = c.execute("SELECT value FROM metrics WHERE run_id=? AND name='loss' "
                         "ORDER BY t DESC, rowid DESC LIMIT 1", (run_id,)).fetchone()
        return {"last_step": step, "last_loss": loss[0] if loss else None}

    def summary(self, run_id: str) -> dict:
        """Last value of every metric (rank 0 where present): the comparison table's row."""
        rows = self._conn().execute(
            "SELECT name, value FROM metrics WHERE run_id=? ORDER BY rank DESC, t, rowid",
            (run_id,)).fetchall()
        return {r["name"]: r["value"] for r in rows}

    def add_checkpoint(self, run_id: str, step: int, path: str) -> None:
        with self._conn() as c:
            c.execute("INSERT INTO checkpoints (run_id, step, path, t) VALUES (?,?,?,?)",
                      (run_id, step, path, time.time()))

    # --- lost runs -------------------------------------------------------------------------------
    def _mark_lost(self) -> None:
        """Mark runs of this host whose supervisor is gone but whose status is still active."""
        import psutil

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
                                error=f"the supervisor (pid {r['pid']}) ended without recording a "
                                      "final status (kernel or machine died?)")

    @staticmethod
    def _check_status(status: str) -> None:
        if status not in STATUSES:
            raise ValueError(f"run status: got {status!r}; accepted: {', '.join(STATUSES)}")


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
    try:
        d["config"] = json.loads(d["config"]) if d.get("config") else {}
    except ValueError:
        pass
    return d


class RunList(list):
    """A list of run dicts that renders as a table in a notebook."""

    COLS = ("id", "name", "status", "num_processes", "last_step", "last_loss", "started", "ended")

    def _repr_html_(self) -> str:
        import html

        head = "".join(f"<th>{c}</th>" for c in self.COLS)
        body = []
        for r in self:
            cells = []
            for c in self.COLS:
                v = r.get(c)
                if c in ("started", "ended") and v:
                    v = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(v))
                elif isinstance(v, float):
                    v = f"{v:.4g}"
                cells.append(f"<td>{html.escape('' if v is None else str(v))}</td>")
            body.append("<tr>" + "".join(cells) + "</tr>")
        return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def runs(status: str | Sequence[str] | None = None, limit: int | None = None) -> RunList:
    """The runs in the registry, newest first, with their last step and loss."""
    return RunList(Registry().list_runs(status=status, limit=limit, with_last=True))
