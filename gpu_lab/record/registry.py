# Long: a run's record in one place: its schema, its writes, its reads, and its table view.
"""The run registry: an embedded SQLite database of runs, their configs and their metrics.

It lives at `$GPU_LAB_HOME/registry.db` (default `~/.gpu_lab/`). WAL mode lets the server extension
and other kernels read while a receiver writes. Contracts:

- Readers never write. A run whose supervisor died unseen (the kernel was killed, the machine
  rebooted) reads as `lost` (worked out from the liveness of its supervisor on every read); the
  next writer of the registry (a new run, a launcher reaping its supervisor) records it
  (`persist_lost`).
- Opening an existing, up-to-date registry takes no lock and writes nothing: only creating or
  upgrading it does (under `registry.db.lock`). So a reader never waits on a writer.
- A registry this user cannot write (a read-only mount, a colleague's file) opens read-only, with
  one `RegistryWarning`; a write then raises `RegistryReadOnlyError` saying what to do.
- A damaged file raises `RegistryCorruptError` naming the file and how to recover, wherever it is
  first touched. `gpu-lab registry check` says what is still readable.
- The writer keeps the WAL bounded: a TRUNCATE checkpoint once it passes CHECKPOINT_BYTES (and
  `journal_size_limit` for the WAL restarts SQLite makes itself).
- Private by default: the home folder 0700, the database and its side files 0600, whatever the
  umask. GPU_LAB_SHARE_GROUP=<group> shares them with that group on purpose (2770 / 0660).
"""
from __future__ import annotations

import errno
import fcntl
import itertools
import json
import os
import re
import socket
import sqlite3
import stat
import threading
import time
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence
from urllib.parse import quote

from ..access import SHARE_GROUP, group_name, share_gid
from .events import ACTIVE_STATUSES as ACTIVE
from .events import CHECKPOINT, CONFIG, KINDS, METRIC, STATUS
from .events import STATUSES
from .events import TEXT as _TEXT
from .events import numbers as _numbers
from . import levels as _levels

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
CREATE INDEX IF NOT EXISTS runs_started ON runs(started);
""" + (_SEARCH := """
CREATE VIRTUAL TABLE IF NOT EXISTS runs_text USING fts5(id UNINDEXED, body, tokenize='trigram');
CREATE TRIGGER IF NOT EXISTS runs_text_insert AFTER INSERT ON runs BEGIN
    INSERT INTO runs_text (rowid, id, body) VALUES (NEW.rowid, NEW.id, {body});
END;
CREATE TRIGGER IF NOT EXISTS runs_text_update AFTER UPDATE OF name, notebook, config ON runs BEGIN
    DELETE FROM runs_text WHERE rowid = OLD.rowid;
    INSERT INTO runs_text (rowid, id, body) VALUES (NEW.rowid, NEW.id, {body});
END;
CREATE TRIGGER IF NOT EXISTS runs_text_delete AFTER DELETE ON runs BEGIN
    DELETE FROM runs_text WHERE rowid = OLD.rowid;
END;
""".format(body=(
    # what a search finds a run by: its name, id, notebook and config values (not their keys)
    "coalesce(NEW.name, '') || ' ' || NEW.id || ' ' || coalesce(NEW.notebook, '') || ' ' || "
    "coalesce((SELECT group_concat(value, ' ') FROM json_each(CASE WHEN json_valid(NEW.config) "
    "THEN NEW.config ELSE '{}' END)), '')")))

# Columns added after the first release: (name, SQL type). Older databases get them on open.
_ADDED = (("reason", "TEXT"), ("detach", "INTEGER DEFAULT 0"), ("events_address", "TEXT"),
          ("entry", "TEXT"), ("resumed_from", "TEXT"), ("last_step", "INTEGER"),
          ("summary", "TEXT"), ("devices", "TEXT"), ("priority", "INTEGER DEFAULT 0"),
          ("queue_position", "INTEGER"), ("part_of", "TEXT"), ("sweep", "TEXT"),
          ("job", "TEXT"), ("note", "TEXT"), ("accelerate", "TEXT"))

_COLUMNS = ("id", "name", "status", "config", "num_processes", "num_nodes", "node_rank", "host",
            "pid", "pgid", "pid_started", "started", "ended", "notebook", "output_dir", "run_dir",
            "error", "kind") + tuple(name for name, _ in _ADDED)
_JSON_COLUMNS = ("config", "resumed_from", "summary", "devices", "part_of", "job", "accelerate")


# Stored in the database's user_version once its schema is in place: an existing file whose
# number matches opens without the lock and without writing. Any change of the schema changes it.
_VERSION = zlib.crc32((_SCHEMA + _levels.SCHEMA + repr(_ADDED)).encode()) & 0x7FFFFFFF
_SIDE_FILES = ("", "-wal", "-shm", ".lock")
_NOTED: set[str] = set()  # registries already noted as read-only in this process

CHECKPOINT_BYTES = 32 * 2**20      # the writer checkpoints (TRUNCATE) a WAL bigger than this
JOURNAL_SIZE_LIMIT = 16 * 2**20    # what SQLite truncates a WAL to when it restarts it itself
_CHECKPOINT_WAIT_MS = 1000         # how long a checkpoint waits for readers to move on


class RegistryWarning(UserWarning):
    """The registry opened read-only (said once per file per process)."""


class RegistryError(sqlite3.DatabaseError):
    """The registry file cannot be used as asked; the message says why and what to do."""

    def __init__(self, message: str, path: Path) -> None:
        super().__init__(message)
        self.path = path


class RegistryReadOnlyError(RegistryError, PermissionError):
    """A write to a registry that this process may only read."""


class RegistryCorruptError(RegistryError):
    """The registry file is damaged or is not a database."""


def home() -> Path:
    """gpu_lab's state directory: $GPU_LAB_HOME, else ~/.gpu_lab; made private (0700), or
    shared with GPU_LAB_SHARE_GROUP's group (2770), when it is ours."""
    p = Path(os.environ.get("GPU_LAB_HOME") or Path.home() / ".gpu_lab")
    dir_mode, _, gid = _modes()
    if not p.is_dir():
        try:
            p.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise PermissionError(f"gpu_lab's home folder {p} cannot be made ({e.strerror}); set "
                                  "GPU_LAB_HOME to a folder you can write") from None
    _fix_mode(p, dir_mode, gid)
    return p


def _modes() -> tuple[int, int, int | None]:
    """(folder mode, file mode, group id): private, or shared with GPU_LAB_SHARE_GROUP's group
    (setgid on the folder, so files made in it later get the group too)."""
    gid = share_gid()
    return (0o700, 0o600, None) if gid is None else (0o2770, 0o660, gid)


def _fix_mode(p: Path, mode: int, gid: int | None) -> None:
    """Give p this mode (and group) if it is ours; a file system that refuses (read-only) keeps
    what it has: the read-only open that follows says so."""
    try:
        st = p.stat()
    except FileNotFoundError:
        return
    if st.st_uid != os.geteuid():
        return
    try:
        if gid is not None and st.st_gid != gid:
            os.chown(p, -1, gid)
        if stat.S_IMODE(st.st_mode) != mode or gid is not None:
            os.chmod(p, mode)  # after chown: a chown clears the setgid bit
    except PermissionError:
        if gid is not None:
            raise ValueError(f"{SHARE_GROUP}={group_name(gid)}: {p} cannot be given to that group; "
                             "you must be a member of it (see `id`), or unset "
                             f"{SHARE_GROUP}") from None
    except OSError as e:
        if e.errno != errno.EROFS:
            raise


def _why_read_only(path: Path) -> str | None:
    """Why this process cannot write the registry at `path` (None: it can)."""
    folder = path.parent
    try:
        ro_fs = bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
    except OSError:
        ro_fs = False
    if ro_fs:
        return f"it is on a read-only file system ({folder})"
    if path.exists() and not os.access(path, os.W_OK):
        return f"the file is not writable by you ({_owner_mode(path)})"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"its folder {folder} is not writable by you ({_owner_mode(folder)})"
    return None


def _owner_mode(p: Path) -> str:
    import pwd

    st = p.stat()
    try:
        owner = pwd.getpwuid(st.st_uid).pw_name
    except KeyError:
        owner = str(st.st_uid)
    return f"owner {owner}, mode {stat.S_IMODE(st.st_mode):04o}"


def explain(e: sqlite3.Error, path: Path, read_only: str | None = None) -> RegistryError | None:
    """A RegistryError saying what SQLite's error means for the registry file and what to do;
    None for errors that are no fault of the file (a bad query, a constraint)."""
    code = getattr(e, "sqlite_errorcode", 0) & 0xFF
    if code in (11, 26):  # SQLITE_CORRUPT, SQLITE_NOTADB
        return RegistryCorruptError(
            f"the run registry {path} is damaged ({e}). Move it aside (mv {path} "
            f"{path}.damaged, and its -wal and -shm files if any): a new, empty registry is made "
            f"on the next use. `gpu-lab registry check --path {path}` shows what is still readable.",
            path)
    if code == 8:  # SQLITE_READONLY
        why = read_only or f"SQLite says: {e}"
        return RegistryReadOnlyError(
            f"the run registry {path} is read-only here ({why}): its runs can be read, but no run "
            "can be recorded in it. To launch or change runs, set GPU_LAB_HOME to a folder you can "
            "write (e.g. export GPU_LAB_HOME=$HOME/gpu_lab_home).", path)
    return None


class _Conn(sqlite3.Connection):
    """A registry connection: errors that come from the file become advice (explain), and a
    writer's commit keeps the WAL bounded (Registry._after_commit)."""

    registry: "Registry"

    def _run(self, method: Any, sql: str, *args: Any) -> sqlite3.Cursor:
        try:
            cur = method(self, sql, *args)
        except sqlite3.DatabaseError as e:
            better = explain(e, self.registry.path, self.registry.read_only)
            if better is None:
                raise
            raise better from e
        if sql == "COMMIT":
            self.registry._after_commit(self)
        return cur

    def execute(self, sql: str, *args: Any) -> sqlite3.Cursor:  # type: ignore[override]
        return self._run(sqlite3.Connection.execute, sql, *args)

    def executemany(self, sql: str, *args: Any) -> sqlite3.Cursor:  # type: ignore[override]
        return self._run(sqlite3.Connection.executemany, sql, *args)

    def executescript(self, sql: str) -> sqlite3.Cursor:  # type: ignore[override]
        return self._run(sqlite3.Connection.executescript, sql)


class Registry:
    """A handle on the registry database. Cheap to make; one SQLite connection per thread.
    `read_only` says why this process may only read it (None: it may write)."""

    def __init__(self, path: str | os.PathLike | None = None) -> None:
        self.path = Path(path) if path is not None else home() / "registry.db"
        self._local = threading.local()
        self._checkpoint_at = CHECKPOINT_BYTES
        self.checkpoint_errors = 0  # WAL checkpoints that failed (none is a lost write)
        self._uri: str | None = None
        if not self.path.parent.is_dir():
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
            except OSError:
                pass  # the check below names the folder and why
        self.read_only = _why_read_only(self.path)
        if self.read_only is None:
            try:
                self._open_writable()
            except PermissionError as e:  # the lock file or the database belongs to someone else
                self.read_only = (f"{e.strerror}: {e.filename}" if e.strerror else
                                  "SQLite may not write it")
                self._local = threading.local()
        if self.read_only is not None:
            self._open_read_only()

    def _open_writable(self) -> None:
        _, file_mode, gid = _modes()
        if not self._up_to_date():
            # Switching a new database to WAL takes an exclusive lock, and SQLite answers a second
            # process doing the same at that moment with "database is locked" at once, without its
            # busy timeout (seen: two torchrun ranks opening a fresh registry). So creation and
            # upgrade (WAL, which then persists in the file, and the schema) run under a file lock.
            lock_path = self.path.with_name(self.path.name + ".lock")
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, file_mode)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                # made here with its mode: SQLite gives the -wal and -shm files the database's
                os.close(os.open(self.path, os.O_RDWR | os.O_CREAT, file_mode))
                _fix_mode(self.path, file_mode, gid)
                c = self._conn()
                if c.execute("PRAGMA user_version").fetchone()[0] != _VERSION:
                    c.execute("PRAGMA journal_mode=WAL")
                    c.executescript(_SCHEMA + _levels.SCHEMA)
                    _upgrade(c)
                    _levels.backfill_all(c)  # older runs' levels: so that no reader writes them
                    c.execute(f"PRAGMA user_version={_VERSION}")
            finally:
                os.close(fd)
        for suffix in _SIDE_FILES:
            _fix_mode(self.path.with_name(self.path.name + suffix), file_mode, gid)

    def _up_to_date(self) -> bool:
        """Whether the file exists with this schema in WAL mode: then nothing needs writing."""
        try:
            if self.path.stat().st_size == 0:
                return False
        except FileNotFoundError:
            return False
        c = self._conn()
        return (c.execute("PRAGMA user_version").fetchone()[0] == _VERSION
                and c.execute("PRAGMA journal_mode").fetchone()[0] == "wal")

    def _open_read_only(self) -> None:
        if not self.path.exists():
            raise RegistryReadOnlyError(
                f"there is no run registry at {self.path}, and none can be made there "
                f"({self.read_only}); set GPU_LAB_HOME to a folder you can write", self.path)
        uri = f"file:{quote(os.fspath(self.path.absolute()))}?mode=ro"
        how = ""
        for attempt in (uri, uri + "&immutable=1"):
            self._uri, self._local = attempt, threading.local()
            try:
                self._conn().execute("SELECT count(*) FROM sqlite_master").fetchone()
                break
            except (sqlite3.OperationalError, RegistryReadOnlyError):
                # a WAL database on a read-only folder without its -shm file: SQLite can only
                # read it as immutable (no locks, so changes made meanwhile are not seen)
                how = "; read as immutable: reopen to see later changes"
        else:
            raise RegistryReadOnlyError(
                f"the run registry {self.path} cannot be read ({self.read_only})", self.path)
        if os.fspath(self.path) not in _NOTED:
            _NOTED.add(os.fspath(self.path))
            warnings.warn(f"gpu_lab: the run registry {self.path} opened read-only: "
                          f"{self.read_only}{how}. Runs can be listed and attached to; to record "
                          "runs, set GPU_LAB_HOME to a folder you can write.", RegistryWarning,
                          stacklevel=3)

    def _conn(self) -> sqlite3.Connection:
        c = getattr(self._local, "conn", None)
        if c is None or getattr(self._local, "pid", None) != os.getpid():
            if self._uri is not None:
                c = sqlite3.connect(self._uri, uri=True, timeout=30, isolation_level=None,
                                    factory=_Conn)
            else:
                c = sqlite3.connect(self.path, timeout=30, isolation_level=None, factory=_Conn)
            c.registry = self
            c.row_factory = sqlite3.Row
            c.execute("PRAGMA busy_timeout=30000")
            if self._uri is None:
                c.execute("PRAGMA synchronous=NORMAL")
                c.execute(f"PRAGMA journal_size_limit={JOURNAL_SIZE_LIMIT}")
            self._local.conn, self._local.pid = c, os.getpid()
        return c

    def _after_commit(self, c: sqlite3.Connection) -> None:
        """A writer's commit: past CHECKPOINT_BYTES of WAL, copy it into the database and truncate
        it (readers holding old snapshots are waited for briefly; if they stay, later). TRUNCATE,
        not RESTART: the file's size then says what is in it, so this stat is the whole test."""
        try:
            size = os.stat(f"{self.path}-wal").st_size
        except OSError:
            return
        if size < self._checkpoint_at:
            return
        try:  # the commit is done: whatever happens here must not look like a failed write
            c.execute(f"PRAGMA busy_timeout={_CHECKPOINT_WAIT_MS}")
            try:
                busy = c.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0]
            finally:
                c.execute("PRAGMA busy_timeout=30000")
        except sqlite3.Error:
            self.checkpoint_errors += 1
            busy = 1
        # a reader held on: try again once the WAL has grown by another quarter, not every commit
        self._checkpoint_at = size + CHECKPOINT_BYTES // 4 if busy else CHECKPOINT_BYTES

    # --- runs ------------------------------------------------------------------------------------
    def create_run(self, run_id: str, *, name: str | None = None, config: dict | None = None,
                   num_processes: int | None = None, num_nodes: int = 1, node_rank: int = 0,
                   output_dir: str | None = None, run_dir: str | None = None,
                   notebook: str | None = None, kind: str = "launch",
                   status: str = "pending", **extra: Any) -> None:
        self._check_status(status)
        self.persist_lost()  # a writer records what readers only saw
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
        row = self._conn().execute("SELECT * FROM runs WHERE id=?", (run_id,)).fetchone()
        return self._as_read(_row(row)) if row else None

    def find_run(self, run_id_or_name: str) -> dict:
        """The run with this id, else the newest run with this name; KeyError naming the recent
        runs when there is neither."""
        row = self.get_run(run_id_or_name)
        if row is not None:
            return row
        hit = self._conn().execute("SELECT * FROM runs WHERE name=? ORDER BY started DESC LIMIT 1",
                                   (run_id_or_name,)).fetchone()
        if hit is not None:
            return self._as_read(_row(hit))
        recent = [f"{r['id']} ({r['name']})" for r in self.list_runs(limit=5)]
        raise KeyError(f"no run with id or name {run_id_or_name!r} in {self.path}; recent runs: "
                       f"{', '.join(recent) or '(none)'}")

    def list_runs(self, *, status: str | Sequence[str] | None = None, limit: int | None = None,
                  with_last: bool = False, name: str | None = None,
                  find: "RunQuery | None" = None, offset: int = 0) -> list[dict]:
        """Runs, newest first; `with_last` adds each run's last step and last loss. `name` keeps
        the runs whose name contains it; `find` the runs a search names (RunQuery: text, date
        range, config values), `offset` skips that many of them (a page)."""
        q, where, args = "SELECT * FROM runs", [], []
        if find is not None:
            more, more_args = find.where()
            where += more
            args += more_args
        wanted = None
        if status is not None:
            wanted = [status] if isinstance(status, str) else list(status)
            for s in wanted:
                self._check_status(s)
            # an active row may read as lost: fetch the active ones too and decide after reading
            if "lost" in wanted or set(wanted) & set(ACTIVE):
                sql_sts = list(dict.fromkeys([*wanted, *ACTIVE]))
            else:
                sql_sts, wanted = wanted, None
            where.append(f"status IN ({','.join('?' * len(sql_sts))})")
            args += sql_sts
        if name is not None:
            where.append("instr(name, ?) > 0")
            args.append(name)
        if where:
            q += " WHERE " + " AND ".join(where)
        q += " ORDER BY started DESC, id DESC"
        if limit is not None and wanted is None:
            q += " LIMIT ? OFFSET ?"
            args += [int(limit), int(offset)]
        rows = [self._as_read(_row(r)) for r in self._conn().execute(q, args).fetchall()]
        if wanted is not None:
            rows = [r for r in rows if r["status"] in wanted]
            rows = rows[offset:offset + limit] if limit is not None else rows[offset:]
        if with_last:
            for r in rows:
                r.update(_last(r))
        return rows

    def count_runs(self, find: "RunQuery | None" = None) -> int:
        """How many runs a search names (all of them without one): the total a page is of."""
        q, args = "SELECT count(*) FROM runs", []
        if find is not None:
            where, args = find.where()
            if where:
                q += " WHERE " + " AND ".join(where)
        return int(self._conn().execute(q, args).fetchone()[0])

    def delete_run(self, run_id: str) -> None:
        with self._conn() as c:
            c.execute("DELETE FROM events WHERE run_id=?", (run_id,))
            c.execute("DELETE FROM checkpoints WHERE run_id=?", (run_id,))
            _levels.delete(c, run_id)
            c.execute("DELETE FROM runs WHERE id=?", (run_id,))

    # --- events ----------------------------------------------------------------------------------
    def add_events(self, run_id: str, events: Sequence[dict], *,
                   end: dict | None = None, checked: bool = False) -> list[int]:
        """Append events (dicts of the stream's schema) to a run's record in one transaction and
        return their sequence numbers. Numbers are given here, under the write lock, so several
        writers of one run (the ranks of a headless job) never collide, and a reader that has
        seen seq N has everything up to N. Also keeps the run's last step and last values.
        `end` ({"status", "reason", "error"}) also ends the run in the same transaction.
        `checked`: every event already meets the record's contract (`events.problem`, as the
        recorder checks them), so the strict row conversion is skipped."""
        if not events and end is None:
            return []
        c = self._conn()
        c.execute("BEGIN IMMEDIATE")
        try:
            base = c.execute("SELECT COALESCE(MAX(seq), 0) FROM events WHERE run_id=?",
                             (run_id,)).fetchone()[0]
            rows = _checked_rows(run_id, events, base) if checked else []
            for i, e in enumerate(() if checked else events, base + 1):
                # strict, so that a writer can find the one event it must not write: what SQLite
                # would take loosely (a text step, a NaN time as NULL) is refused here
                try:
                    step, data, t = e.get("step"), e.get("data") or {}, float(e["t"])
                    if step is not None and (type(step) is not int or abs(step) >= 2 ** 63):
                        raise TypeError(f"step {step!r:.40}")
                    if not isinstance(data, dict):
                        raise TypeError(f"data of type {type(data).__name__}")
                    if not -1e308 < t < 1e308:  # NaN and the infinities
                        raise ValueError(f"time {t}")
                    text = e.get(_TEXT)  # the data's JSON as it came, checked by the recorder
                    rows.append((run_id, i, int(e.get("rank", -1)), str(e["kind"]), t, step,
                                 text if type(text) is str else _encode(data)))
                except (TypeError, ValueError, KeyError, AttributeError, RecursionError) as exc:
                    import reprlib

                    raise ValueError(
                        f"Registry.add_events: event {i - base} of {len(events)} cannot be "
                        f"recorded ({exc}): {reprlib.repr(e)}; accepted: an int rank, a finite "
                        "time t, an int step or None, a dict data of JSON values") from None
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
            configs = [e["data"] for e in events if e["kind"] == CONFIG]
            if configs:  # what the run's own code says of its hyperparameters (a tracker's)
                _merge_config(c, run_id, configs)
            used = [(e["rank"], e["data"]["accelerate"]) for e in events if e["kind"] == STATUS
                    and isinstance(e.get("data"), dict)
                    and isinstance(e["data"].get("accelerate"), dict)]
            if used:  # what each rank's Accelerator really trains with
                _merge_used(c, run_id, used)
            saved = [(run_id, e.get("step") or 0, e["data"]["path"], e["t"]) for e in events
                     if e["kind"] == CHECKPOINT and isinstance(e.get("data"), dict)
                     and isinstance(e["data"].get("path"), str)]
            if saved:  # its own table: listing them never scans the run's events
                c.executemany("INSERT INTO checkpoints (run_id, step, path, t) VALUES (?,?,?,?)",
                              saved)
            if end is not None:
                self._check_status(end["status"])
                c.execute("UPDATE runs SET status=?, ended=COALESCE(ended, ?), "
                          "error=COALESCE(?, error), reason=COALESCE(?, reason) WHERE id=? AND "
                          f"status IN ({','.join('?' * len(ACTIVE))})",
                          (end["status"], time.time(), end.get("error"), end.get("reason"),
                           run_id, *ACTIVE))
            c.execute("COMMIT")
        except BaseException:
            try:
                c.execute("ROLLBACK")
            except sqlite3.OperationalError:  # SQLite rolled back itself (a full disk): the
                pass                          # first error is the one to tell
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

    def metric_points(self, run_id: str, name: str, rank: int = 0,
                      after: int = 0) -> tuple[int, list[tuple[int, float]]]:
        """(the newest seq read, [(step, value)]) of metric `name` as `rank` reported it, past
        seq `after`: a poller's read (a sweep's driver) that decodes only the events naming the
        metric and goes on from where it stopped, so a long run costs what is new."""
        upto = self.last_seq(run_id)  # what arrives after this is read by the next call
        points = []
        for step, data in self._conn().execute(
                "SELECT step, data FROM events WHERE run_id=? AND seq>? AND seq<=? "
                "AND kind='metric' AND rank=? AND instr(data, ?) > 0 ORDER BY seq",
                (run_id, int(after), upto, int(rank), json.dumps(name))):
            d = json.loads(data)
            v = d.get(name) if isinstance(d, dict) else None
            if type(step) is int and isinstance(v, (int, float)) and not isinstance(v, bool):
                points.append((step, float(v)))
        return max(upto, int(after)), points

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

    def recent_metrics(self, run_id: str, limit: int, upto: int) -> list[dict]:
        """The newest `limit` metric events with seq <= upto, oldest first (where a live mean
        over ranks starts, record.mean): the run's key read backwards, so its length does not
        count."""
        rows = self._conn().execute(
            "SELECT seq, rank, kind, t, step, data FROM events WHERE run_id=? AND seq<=? "
            "AND kind='metric' ORDER BY seq DESC LIMIT ?", (run_id, int(upto), int(limit)))
        return [{"run": run_id, "seq": r[0], "rank": r[1], "kind": r[2], "t": r[3], "step": r[4],
                 "data": json.loads(r[5])} for r in reversed(rows.fetchall())]

    def count_events(self, run_id: str, kind: str, upto: int | None = None) -> int:
        """How many events of one non-metric kind the run holds (seq <= upto)."""
        if kind not in KINDS or kind == METRIC:
            raise ValueError(f"Registry.count_events: kind {kind!r}; accepted: any of "
                             f"{', '.join(k for k in KINDS if k != METRIC)}")
        return self._conn().execute(
            "SELECT COUNT(*) FROM events INDEXED BY events_notes WHERE run_id=? AND "
            "kind<>'metric' AND kind=? AND seq<=?",
            (run_id, kind, upto if upto is not None else 2**62)).fetchone()[0]

    def events_by_rank(self, run_id: str) -> dict[int, int]:
        """How many events each rank (>= 0) of the run has in the record, `dropped` notes aside:
        what its reporters' `sent` counts compare with."""
        return dict(self._conn().execute(
            "SELECT rank, COUNT(*) FROM events WHERE run_id=? AND rank>=0 AND kind<>'dropped' "
            "GROUP BY rank", (run_id,)).fetchall())

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
            # ev.numbers: what an older record may hold (data not a dict, a text) is left out
            out = [(r[0], r[1], r[2] if type(r[2]) is int else None, r[3], k, v) for r in rows
                   for k, v in _numbers(json.loads(r[4])) if name is None or k == name]
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
            for k, v in _numbers(json.loads(r[3])):
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

    def checkpoints(self, run_id: str) -> list[dict]:
        """The checkpoints a run's code said it saved ("checkpoint" events), oldest first:
        [{"step", "path", "t"}]."""
        rows = self._conn().execute("SELECT step, path, t FROM checkpoints WHERE run_id=? "
                                    "ORDER BY t, step", (run_id,)).fetchall()
        return [{"step": r[0], "path": r[1], "t": r[2]} for r in rows]

    # --- lost runs -------------------------------------------------------------------------------
    def _as_read(self, row: dict) -> dict:
        """The row as a reader sees it: an active run of this host whose supervisor is gone reads
        as lost, with the reason and error persist_lost would record (nothing is written)."""
        # a scheduler's job (a `job` row) has no supervisor here: the scheduler says how it ends
        if row["status"] in ACTIVE and row.get("host") == socket.gethostname() \
                and not row.get("job"):
            verdict = _lost_verdict(row)
            if verdict is not None:
                row.update(verdict, status="lost", ended=row.get("ended") or time.time())
        return row

    def persist_lost(self) -> int:
        """Record as lost the runs of this host whose supervisor is gone but whose status is still
        active (a writer's job: readers only see them so). Returns how many changed."""
        if self.read_only is not None:
            return 0
        rows = self._conn().execute(
            f"SELECT id, pid, pid_started, started FROM runs WHERE host=? AND job IS NULL AND "
            f"status IN ({','.join('?' * len(ACTIVE))})", (socket.gethostname(), *ACTIVE)).fetchall()
        changed = 0
        for r in rows:
            verdict = _lost_verdict(dict(r))
            if verdict is not None:  # the guard in set_status lets a final status just recorded win
                changed += self.set_status(r["id"], "lost", **verdict)
        return changed

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
    indexed = c.execute("SELECT count(*) FROM runs_text").fetchone()[0]
    if indexed < c.execute("SELECT count(*) FROM runs").fetchone()[0]:  # runs from before search
        body = _SEARCH.split("VALUES (NEW.rowid, NEW.id, ", 1)[1].split(");", 1)[0]
        c.execute("INSERT INTO runs_text (rowid, id, body) SELECT rowid, id, "
                  + body.replace("NEW.", "runs.") + " FROM runs WHERE rowid NOT IN "
                  "(SELECT rowid FROM runs_text)")
    if c.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name='metrics'").fetchone():
        c.execute("INSERT OR IGNORE INTO events (run_id, seq, rank, kind, t, step, data) "
                  "SELECT run_id, rowid, rank, 'metric', t, step, json_object(name, value) "
                  "FROM metrics")
        c.execute("DROP TABLE metrics")


def _checked_rows(run_id: str, events: Sequence[dict], base: int) -> list[tuple]:
    """The rows of events that meet the record's contract: one pass, no per-event checks."""
    return [(run_id, i, e["rank"], e["kind"], e["t"], e.get("step"),
             text if type(text := e.get(_TEXT)) is str else _encode(e["data"]))
            for i, e in enumerate(events, base + 1)]


def _merge_config(c: sqlite3.Connection, run_id: str, configs: list) -> None:
    """Merge config events' data into the run's config, in the writer's transaction: a name the
    code logs replaces the same name of the launch's TrainConfig, the others stay."""
    row = c.execute("SELECT config FROM runs WHERE id=?", (run_id,)).fetchone()
    if row is None:
        return
    try:
        config = json.loads(row[0]) if row[0] else {}
    except ValueError:
        config = {}
    if not isinstance(config, dict):
        config = {}
    for data in configs:
        if isinstance(data, dict):
            config.update(data)
    c.execute("UPDATE runs SET config=? WHERE id=?", (_encode(config), run_id))


def _merge_used(c: sqlite3.Connection, run_id: str, used: list[tuple[int, dict]]) -> None:
    """The ranks' word on what accelerate uses, into the run's `accelerate` column (beside the
    config file's, if the launch read one): {"ranks": {rank: {mixed_precision, ...}}}."""
    row = c.execute("SELECT accelerate FROM runs WHERE id=?", (run_id,)).fetchone()
    if row is None:
        return
    try:
        acc = json.loads(row[0]) if row[0] else {}
    except ValueError:
        acc = {}
    acc = acc if isinstance(acc, dict) else {}
    ranks = acc.get("ranks") if isinstance(acc.get("ranks"), dict) else {}
    for rank, data in used:
        ranks[str(rank)] = {k: str(v) for k, v in data.items()
                            if k in ("mixed_precision", "distributed_type", "sharding")}
    acc["ranks"] = ranks
    c.execute("UPDATE runs SET accelerate=? WHERE id=?", (_encode(acc), run_id))


def used_by_ranks(row: dict) -> dict | None:
    """What the lowest rank that said so trains with ({mixed_precision, distributed_type,
    sharding}), or None before any rank has said; `mixed` lists what the ranks disagree on."""
    acc = row.get("accelerate")
    ranks = acc.get("ranks") if isinstance(acc, dict) else None
    if not isinstance(ranks, dict) or not ranks:
        return None
    first = dict(ranks[min(ranks, key=lambda r: int(r) if str(r).lstrip("-").isdigit() else 0)])
    first["mixed"] = sorted({k for r in ranks.values() for k, v in r.items() if first.get(k) != v})
    return first


def _fold_last(step: int | None, summary: str | None, metric: list[dict]) -> tuple:
    """The run's (last step, summary JSON) after these metric events. The summary maps each metric
    to [rank, value]: the newest value of the lowest rank that reports it (rank 0's numbers win).
    On the recorder's path for every batch: the passes over all events run in C (map, filter)."""
    top = max(filter(None.__ne__, map(dict.get, metric, itertools.repeat("step"))), default=None)
    if top is not None:
        step = top if step is None else max(step, top)
    values = json.loads(summary) if summary else {}
    ranks = [int(e.get("rank", -1)) for e in metric]
    lowest = min(ranks)
    mine = metric if ranks.count(lowest) == len(ranks) else \
        [e for e, r in zip(metric, ranks) if r == lowest]
    datas = [e.get("data") or {} for e in mine]
    names = set(itertools.chain.from_iterable(datas))
    seen: dict = {}
    for data in reversed(datas):  # newest first: the first value met of each name is the newest
        for k, v in data.items():
            if k not in seen and isinstance(v, (int, float)) and not isinstance(v, bool):
                seen[k] = v
        if len(seen) == len(names):  # every name has its newest value (most batches: 1 event)
            break
    for k, v in seen.items():
        old = values.get(k)
        if old is None or lowest <= old[0]:
            values[k] = [lowest, v]
    return step, json.dumps(values)


def _summary_values(raw: str | None) -> dict:
    if not raw:
        return {}
    return {k: v[1] for k, v in json.loads(raw).items()}


@dataclass(frozen=True)
class RunQuery:
    """A search of the registry's runs: `text` in the name, id, notebook or any config value
    (each word, case-insensitive: a trigram index, runs_text, finds words of 3 characters or
    more without reading every run), `status` (a stored status), `since`/`until` (time.time()
    of the start), and `config` values ({field: value}, compared as JSON: {"lr": 0.1})."""

    text: str = ""
    status: str | None = None
    since: float | None = None
    until: float | None = None
    config: tuple[tuple[str, Any], ...] = ()

    def where(self) -> tuple[list[str], list[Any]]:
        where: list[str] = []
        args: list[Any] = []
        words = self.text.lower().split()
        long = [w for w in words if len(w) >= 3]  # the trigram index finds these
        if long:
            where.append("rowid IN (SELECT rowid FROM runs_text WHERE runs_text MATCH ?)")
            args.append(" ".join('"' + w.replace('"', '""') + '"' for w in long))
        for word in (w for w in words if len(w) < 3):
            where.append("rowid IN (SELECT rowid FROM runs_text WHERE body LIKE ? ESCAPE '\\')")
            args.append("%" + word.replace("\\", "\\\\").replace("%", "\\%")
                        .replace("_", "\\_") + "%")
        if self.status is not None:
            where.append("status = ?")
            args.append(self.status)
        if self.since is not None:
            where.append("started >= ?")
            args.append(float(self.since))
        if self.until is not None:
            where.append("started < ?")
            args.append(float(self.until))
        for key, value in self.config:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
                raise ValueError(f"config field {key!r}: accepted: a TrainConfig field's name "
                                 "(letters, digits, _)")
            where.append(f"json_extract(config, '$.{key}') = json_extract(?, '$')")
            args.append(json.dumps(value))
        return where, args


def _last(row: dict) -> dict:
    values = row["summary"] if isinstance(row.get("summary"), dict) else \
        _summary_values(row.get("summary"))
    return {"last_step": row.get("last_step"), "last_loss": values.get("loss")}


def _plain(o: Any) -> Any:
    try:
        return float(o)
    except Exception:  # noqa: BLE001 - what json cannot take is kept as its repr
        return repr(o)


# made once: JSONEncoder.encode builds its C encoder anew at every call, a third of its cost per
# event; this is that C encoder (no circular check: event data are trees), called as _encode(o)
_c_encode = json.encoder.c_make_encoder(None, _plain, json.encoder.encode_basestring_ascii, None,
                                        ":", ",", False, False, True) \
    if json.encoder.c_make_encoder is not None else None


def _encode(o: Any) -> str:
    if _c_encode is None:  # a Python without the C accelerator
        return json.dumps(o, separators=(",", ":"), default=_plain)
    return "".join(_c_encode(o, 0))


def _to_sql(column: str, value: Any) -> Any:
    if column in _JSON_COLUMNS and value is not None and not isinstance(value, str):
        return json.dumps(value, default=str)
    return value


def _lost_verdict(r: dict) -> dict | None:
    """{reason, error} when this active run's supervisor is gone (or never came), else None."""
    if r.get("pid") is None:
        # never got a supervisor: lost if it has been pending for a minute
        if time.time() - (r.get("started") or 0) > 60:
            return {"error": "the run never started a supervisor"}
        return None
    if _alive(r["pid"], r.get("pid_started")):
        return None
    return {"reason": "its supervisor process ended without recording a final status",
            "error": f"the supervisor (pid {r['pid']}) ended without recording a final status "
                     "(killed, or the machine went down)"}


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
            ("precision", "precision"), ("last_step", "step"), ("last_loss", "loss"),
            ("started", "started"), ("duration", "duration"), ("note", "note"))

    def _cells(self, r: dict) -> list[str]:
        out = []
        for key, _ in self.COLS:
            if key == "duration":
                start, end = r.get("started"), r.get("ended") or time.time()
                v = _duration(end - start) if start else ""
            elif key == "precision":
                v = precision_words(r)
            elif key == "note":
                v = "; ".join(x for x in (r.get("reason"), r.get("note")) if x)
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


def precision_words(row: dict) -> str:
    """'bf16', 'bf16, fsdp2': what the ranks said they train with; before they say, what the
    launch asked for (its config file's, else its TrainConfig's)."""
    used = used_by_ranks(row)
    if used is None:
        acc = row.get("accelerate") if isinstance(row.get("accelerate"), dict) else {}
        config = row.get("config") if isinstance(row.get("config"), dict) else {}
        used = {"mixed_precision": acc.get("mixed_precision") or config.get("mixed_precision"),
                "sharding": acc.get("sharding")}
    words = [w for w in (used.get("mixed_precision"), used.get("sharding")) if w and w != "none"]
    return ", ".join(words) + (" (ranks differ)" if used.get("mixed") else "")


def _duration(seconds: float) -> str:
    s = int(max(0, seconds))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def runs(status: str | Sequence[str] | None = None, name: str | None = None,
         limit: int | None = None) -> RunTable:
    """The runs in the registry, newest first, as a table: `status` keeps those in that status
    (or any of several), `name` those whose name contains it."""
    return RunTable(Registry().list_runs(status=status, name=name, limit=limit, with_last=True))


def check(path: str | os.PathLike | None = None) -> tuple[bool, list[str]]:
    """What of the registry file is readable, without changing it: (healthy, report lines).
    Runs SQLite's integrity_check, then reads every run and counts its events."""
    if path is None:
        path = Path(os.environ.get("GPU_LAB_HOME") or Path.home() / ".gpu_lab") / "registry.db"
    path = Path(path)
    lines = [f"registry: {path}"]
    if not path.is_file():
        return False, lines + ["no such file (a registry is made on the first launch)"]
    wal = Path(f"{path}-wal")
    lines.append(f"size: {path.stat().st_size} bytes"
                 + (f", WAL {wal.stat().st_size} bytes" if wal.exists() else ""))
    uri = f"file:{quote(os.fspath(path.absolute()))}?mode=ro"
    c = sqlite3.connect(uri, uri=True, timeout=5)
    try:
        c.execute("SELECT count(*) FROM sqlite_master").fetchone()
    except sqlite3.OperationalError:  # a WAL file on a read-only folder: see Registry
        c = sqlite3.connect(uri + "&immutable=1", uri=True)
    except sqlite3.DatabaseError:
        pass  # damaged: the checks below say how far it reads
    ok = _check_integrity(c, lines)
    ok = _check_runs(c, lines) and ok
    c.close()
    if not ok:
        lines.append(f"not healthy: move {path} aside (and its -wal and -shm files); a new, empty "
                     "registry is made on the next use.")
    return ok, lines


def _check_integrity(c: sqlite3.Connection, lines: list[str]) -> bool:
    try:
        res = [r[0] for r in c.execute("PRAGMA integrity_check(20)")]
    except sqlite3.DatabaseError as e:
        lines.append(f"integrity_check: cannot run ({e})")
        return False
    lines.append("integrity_check: ok" if res == ["ok"] else
                 "integrity_check: " + "; ".join(res))
    return res == ["ok"]


def _check_runs(c: sqlite3.Connection, lines: list[str]) -> bool:
    try:
        runs = c.execute("SELECT id, name, status FROM runs ORDER BY started").fetchall()
    except sqlite3.DatabaseError as e:
        lines.append(f"runs: unreadable ({e})")
        return False
    lines.append(f"runs: {len(runs)} readable")
    ok = True
    for run_id, name, status in runs:
        try:
            n = c.execute("SELECT count(*) FROM events WHERE run_id=?", (run_id,)).fetchone()[0]
            what = f"{n} events"
        except sqlite3.DatabaseError as e:
            what, ok = f"events unreadable ({e})", False
        lines.append(f"  {run_id}  {name}  {status}  {what}")
    return ok
