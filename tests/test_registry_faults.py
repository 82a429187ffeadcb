"""The registry when things go wrong: a registry this user cannot write (a read-only mount, a
colleague's file), a damaged file, a writer holding the write lock, a WAL under a long run, and the
modes of its files whatever the umask. Real files, real mounts where root may make them, real
processes, a real Jupyter server."""
from __future__ import annotations

import grp
import json
import os
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest
from pytest_jupyter.jupyter_server import *  # noqa: F401,F403  (fixtures for this module only)
from test_server import jp_server_config, run_loop, sampler  # noqa: F401  (the server's fixtures)

from gpu_lab.record import registry as registry_mod
from gpu_lab.record.registry import Registry, RegistryCorruptError, RegistryReadOnlyError, RegistryWarning

ROOT = Path(__file__).resolve().parents[1]
DEAD_PID = 2**22 - 3  # no such process
IS_ROOT = os.geteuid() == 0


def _env(**extra: str) -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), **extra}


def _py(code: str, *, prefix: tuple = (), env: dict | None = None, timeout: float = 120):
    return subprocess.run([*prefix, sys.executable, "-c", code], capture_output=True, text=True,
                          env=env or _env(), timeout=timeout)


def _registry_with_runs(folder: Path) -> Registry:
    """A registry holding a run whose supervisor is dead but whose row still says running."""
    reg = Registry(folder / "registry.db")
    reg.create_run("done", name="done", status="succeeded")
    reg.create_run("ghost", name="ghost", status="running")  # last: create_run persists lost runs
    reg.update("ghost", pid=DEAD_PID, pid_started=1.0)
    return reg


def _stored_status(path: Path, run_id: str) -> str:
    """The status in the file itself, not as a Registry reads it."""
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as c:
        return c.execute("SELECT status FROM runs WHERE id=?", (run_id,)).fetchone()[0]


READ_ONLY_PROBE = """
import json, warnings
from gpu_lab.record.registry import Registry, RegistryReadOnlyError
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    reg = Registry({path!r})
    Registry({path!r})  # a second handle: no second note
rows = {{r["id"]: r for r in reg.list_runs()}}
try:
    reg.create_run("new")
    refused = None
except RegistryReadOnlyError as e:
    refused = str(e)
print(json.dumps({{"warnings": [str(x.message) for x in w], "read_only": reg.read_only,
                  "ghost": rows["ghost"]["status"], "ghost_error": rows["ghost"]["error"],
                  "one": reg.get_run("ghost")["status"], "done": rows["done"]["status"],
                  "refused": refused}}))
"""


def _probe_read_only(path: Path, prefix: tuple = ()) -> dict:
    out = _py(READ_ONLY_PROBE.format(path=str(path)), prefix=prefix)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _assert_read_only_answers(got: dict, path: Path, src: Path) -> None:
    assert len(got["warnings"]) == 1, got["warnings"]
    assert str(path) in got["warnings"][0] and "read-only" in got["warnings"][0]
    assert got["ghost"] == got["one"] == "lost" and got["done"] == "succeeded"
    assert f"pid {DEAD_PID}" in got["ghost_error"]
    assert got["refused"] and "read-only" in got["refused"] and "GPU_LAB_HOME" in got["refused"]
    assert _stored_status(src, "ghost") == "running"  # readers never write


@pytest.fixture
def read_only_view(tmp_path):
    """(src, view): a folder, and the same folder where neither it nor its files are writable:
    a read-only bind mount when root (root may write anything else), else chmod."""
    src, view = tmp_path / "src", tmp_path / "view"
    src.mkdir()
    mounted = []

    def make() -> Path:
        if IS_ROOT:
            view.mkdir()
            subprocess.run(["mount", "--bind", str(src), str(view)], check=True)
            mounted.append(view)
            subprocess.run(["mount", "-o", "remount,bind,ro", str(view)], check=True)
            return view
        for f in src.iterdir():
            f.chmod(0o444)
        src.chmod(0o555)
        return src

    yield src, make
    for m in mounted:
        subprocess.run(["umount", "-l", str(m)], check=True)
    src.chmod(0o755)


@pytest.mark.parametrize("writer", ["closed", "still open"])
def test_a_read_only_registry_opens_with_one_note_and_refuses_writes(read_only_view, writer):
    src, make = read_only_view
    reg = _registry_with_runs(src)
    if writer == "closed":  # no -wal, -shm: on a read-only folder SQLite needs immutable
        reg._conn().close()
        del reg
    assert (src / "registry.db-wal").exists() == (writer == "still open")
    view = make()
    got = _probe_read_only(view / "registry.db")
    _assert_read_only_answers(got, view / "registry.db", src / "registry.db")


def test_a_colleagues_registry_opens_read_only(tmp_path):
    """Their file and folder, mode 0644/0755 (an older gpu_lab's, or shared by hand): we may read,
    not write."""
    src = tmp_path / "theirs"
    src.mkdir()
    _registry_with_runs(src)._conn().close()
    for p in src.iterdir():
        p.chmod(0o644)
    prefix: tuple = ()
    if IS_ROOT:  # make it another user's, and read it without root's override of file modes
        for p in (src, *src.iterdir()):
            os.chown(p, 65534, 65534)
        prefix = ("setpriv", "--bounding-set", "-dac_override,-dac_read_search,-fowner,-chown",
                  "--inh-caps", "-all")
    else:
        for p in src.iterdir():
            p.chmod(0o444)
        src.chmod(0o555)
    got = _probe_read_only(src / "registry.db", prefix)
    _assert_read_only_answers(got, src / "registry.db", src / "registry.db")
    assert "not writable by you" in got["read_only"]
    src.chmod(0o755)


def _damage(path: Path) -> None:
    path.write_bytes(os.urandom(8192))


def test_a_damaged_registry_names_the_file_and_the_way_out(tmp_path):
    path = tmp_path / "registry.db"
    _damage(path)
    with pytest.raises(RegistryCorruptError) as e:
        Registry(path)
    msg = str(e.value)
    assert str(path) in msg and "Move it aside" in msg and "registry check" in msg
    assert isinstance(e.value, sqlite3.DatabaseError)  # what callers caught before still catches
    path.rename(path.with_name("registry.db.damaged"))
    Registry(path).create_run("fresh")  # moved aside: a new registry is made
    assert Registry(path).get_run("fresh")["status"] == "pending"


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpu_lab.cli", *args], capture_output=True,
                          text=True, env=_env(), timeout=120)


def test_registry_check_on_a_healthy_and_a_damaged_file(tmp_path):
    reg = _registry_with_runs(tmp_path)
    reg.add_metrics([("done", 0, s, float(s), "loss", 1.0) for s in range(7)])
    ok = _cli("registry", "check", "--path", str(tmp_path / "registry.db"))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "integrity_check: ok" in ok.stdout and "runs: 2 readable" in ok.stdout
    assert "done  done  succeeded  7 events" in ok.stdout
    bad = tmp_path / "bad.db"
    _damage(bad)
    out = _cli("registry", "check", "--path", str(bad))
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert "not a database" in out.stdout and "move" in out.stdout
    missing = _cli("registry", "check", "--path", str(tmp_path / "none.db"))
    assert missing.returncode == 1 and "no such file" in missing.stdout


# --- the server ------------------------------------------------------------------------------------
def test_the_server_answers_a_damaged_registry_with_advice_and_recovers(
        jp_fetch, run_loop, sampler, gpu_lab_home):  # noqa: F811 - fixtures
    import tornado.httpclient

    gpu_lab_home.mkdir(parents=True, exist_ok=True)
    db = gpu_lab_home / "registry.db"
    _damage(db)
    for parts in (("gpu-lab", "api", "runs"), ("gpu-lab", "api", "runs", "ghost"),
                  ("gpu-lab", "metrics")):
        with pytest.raises(tornado.httpclient.HTTPClientError) as e:
            run_loop(jp_fetch(*parts))
        assert e.value.code == 503, parts
        body = json.loads(e.value.response.body)
        assert str(db) in body["message"] and "Move it aside" in body["message"], body
        assert "Traceback" not in json.dumps(body)
    db.rename(db.with_name("registry.db.damaged"))
    runs = json.loads(run_loop(jp_fetch("gpu-lab", "api", "runs")).body)["runs"]
    assert runs == []



def test_the_server_reads_a_read_only_registry_and_refuses_its_writes(
        jp_fetch, run_loop, sampler, read_only_view, monkeypatch):  # noqa: F811
    from test_server import _http_error

    src, make = read_only_view
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        reg = Registry(src / "registry.db")
        reg.create_run("live", name="live", status="running")
        reg.update("live", pid=live.pid, pid_started=psutil.Process(live.pid).create_time())
        _registry_with_runs(src)._conn().close()
        reg._conn().close()
        monkeypatch.setenv("GPU_LAB_HOME", str(make()))
        runs = json.loads(run_loop(jp_fetch("gpu-lab", "api", "runs")).body)["runs"]
        assert {r["id"]: r["status"] for r in runs} == {
            "ghost": "lost", "live": "running", "done": "succeeded"}
        code, message = _http_error(run_loop, jp_fetch, "runs", "live", "stop", method="POST")
        assert code == 409 and "read-only" in message and "GPU_LAB_HOME" in message, message
        assert live.poll() is None  # refused before anything was signalled
    finally:
        live.kill()
        live.wait(10)


WRITER = """
import select, sys
from gpu_lab.record.registry import Registry
reg = Registry(sys.argv[1])
c = reg._conn()
c.execute("BEGIN IMMEDIATE")
c.execute("INSERT INTO events (run_id, seq, rank, kind, t, step, data) "
          "VALUES ('live', 999999, 0, 'note', 0, 0, '{}')")
print("holding", flush=True)
ready = select.select([sys.stdin], [], [], 10)[0]  # hold until told, 10 s at most
c.execute("ROLLBACK")
print("released on request" if ready else "released after 10 s", flush=True)
"""


def test_server_gets_never_wait_on_a_writer(jp_fetch, run_loop, sampler,  # noqa: F811
                                            gpu_lab_home):
    """A writer holds the write lock (up to 10 s) while a fresh server opens the registry and
    answers its list, detail and metrics: each answered before the writer let go."""
    gpu_lab_home.mkdir(parents=True, exist_ok=True)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    reg = Registry(gpu_lab_home / "registry.db")
    reg.create_run("live", name="live", status="running", num_processes=1)
    reg.update("live", pid=live.pid, pgid=live.pid,
               pid_started=psutil.Process(live.pid).create_time())
    reg.add_metrics([("live", 0, s, float(s), "loss", 1.0 / (s + 1)) for s in range(20)])
    _registry_with_runs(gpu_lab_home)
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(gpu_lab_home / "registry.db")],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_env())
    try:
        assert writer.stdout.readline().strip() == "holding"
        runs = json.loads(run_loop(jp_fetch("gpu-lab", "api", "runs")).body)["runs"]
        detail = json.loads(run_loop(jp_fetch("gpu-lab", "api", "runs", "live")).body)
        metrics = run_loop(jp_fetch("gpu-lab", "metrics")).body.decode()
        assert writer.poll() is None, "the writer let go before the server answered"
        writer.stdin.write("go\n")
        writer.stdin.flush()
        assert writer.stdout.readline().strip() == "released on request"
    finally:
        writer.kill()
        writer.wait(10)
        live.kill()
        live.wait(10)
    status = {r["id"]: r["status"] for r in runs}
    assert status == {"ghost": "lost", "live": "running", "done": "succeeded"}
    assert detail["status"] == "running" and detail["last_step"] == 19
    assert 'gpu_lab_run_info{name="ghost",run_id="ghost",status="lost"} 1.0' in metrics
    assert _stored_status(gpu_lab_home / "registry.db", "ghost") == "running"
    Registry().create_run("next")  # the next writer records what the readers saw
    assert _stored_status(gpu_lab_home / "registry.db", "ghost") == "lost"


# --- the WAL ---------------------------------------------------------------------------------------
@pytest.mark.slow  # over half a second
def test_the_writer_keeps_the_wal_bounded_under_a_holding_reader(tmp_path, monkeypatch):
    """Small thresholds here so that a few MB of events show it; bench/registry_wal.py measures a
    1M-event run at the real ones."""
    monkeypatch.setattr(registry_mod, "CHECKPOINT_BYTES", 2**20)
    monkeypatch.setattr(registry_mod, "JOURNAL_SIZE_LIMIT", 2**19)
    path = tmp_path / "registry.db"
    reg = Registry(path)
    reg.create_run("r", status="running")
    reader, stop = Registry(path), threading.Event()
    reads = []

    def read() -> None:
        # holds a read transaction across several of the writer's batches, half the time, as a
        # busy server's polls would; one never let go starves any checkpoint (SQLite's limit)
        c = reader._conn()
        while not stop.is_set():
            c.execute("BEGIN")
            reads.append(len(reader.events("r", after=max(0, reader.last_seq("r") - 100))))
            stop.wait(0.05)
            c.execute("COMMIT")
            stop.wait(0.05)

    t = threading.Thread(target=read)
    t.start()
    biggest = 0
    try:
        batch = [{"rank": 0, "kind": "metric", "t": 0.0, "step": 0,
                  "data": {"loss": 0.5, "lr": 0.1, "samples_per_s": 1e3}} for _ in range(1000)]
        for _ in range(100):
            reg.add_events("r", batch)
            biggest = max(biggest, os.stat(f"{path}-wal").st_size)
    finally:
        stop.set()
        t.join(30)
    assert reads, "the reader never read"
    written = path.stat().st_size
    assert written > 6 * 2**20  # enough went through the WAL to overflow it several times
    assert biggest < 3 * 2**20, f"the WAL reached {biggest / 2**20:.1f} MB"


# --- modes -----------------------------------------------------------------------------------------
MODES = """
import json, os, stat
os.umask(0)
from gpu_lab.record.registry import Registry, home
reg = Registry()
reg.create_run("r")
reg.add_metrics([("r", 0, 1, 1.0, "loss", 1.0)])
h = home()
print(json.dumps({name: [stat.S_IMODE(os.stat(h / name).st_mode), os.stat(h / name).st_gid]
                  for name in ("", "registry.db", "registry.db-wal", "registry.db-shm",
                               "registry.db.lock")}))
"""


def _modes(home: Path, **env: str) -> dict:
    out = _py(MODES, env=_env(GPU_LAB_HOME=str(home), **env))
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_private_modes_whatever_the_umask(tmp_path):
    got = _modes(tmp_path / "fresh")
    assert {k: v[0] for k, v in got.items()} == {
        "": 0o700, "registry.db": 0o600, "registry.db-wal": 0o600, "registry.db-shm": 0o600,
        "registry.db.lock": 0o600}
    old = tmp_path / "old"  # made by an earlier gpu_lab: world-readable; fixed on open
    old.mkdir(mode=0o755)
    Registry(old / "registry.db")._conn().close()
    for p in (old, *old.iterdir()):
        p.chmod(0o755 if p.is_dir() else 0o644)
    got = _modes(old)
    assert {v[0] for k, v in got.items() if k} == {0o600} and got[""][0] == 0o700


def _a_group_of_mine() -> grp.struct_group:
    """A group this user may give files to, other than its own where there is one."""
    mine = os.getegid()
    if IS_ROOT:
        return next(g for g in grp.getgrall() if g.gr_gid != mine)
    others = [g for g in os.getgroups() if g != mine]
    return grp.getgrgid(others[0] if others else mine)


def test_a_share_group_makes_a_group_registry_and_a_bad_one_is_named(tmp_path):
    group = _a_group_of_mine()
    got = _modes(tmp_path / "team", GPU_LAB_SHARE_GROUP=group.gr_name)
    assert got[""] == [0o2770, group.gr_gid]
    for name in ("registry.db", "registry.db-wal", "registry.db-shm", "registry.db.lock"):
        assert got[name] == [0o660, group.gr_gid], name
    bad = _py("from gpu_lab.record.registry import Registry; Registry()",
              env=_env(GPU_LAB_HOME=str(tmp_path / "x"), GPU_LAB_SHARE_GROUP="no-such-group-q"))
    assert bad.returncode == 1
    last = bad.stderr.strip().splitlines()[-1]
    assert "GPU_LAB_SHARE_GROUP" in last and "'no-such-group-q'" in last and "accepted" in last


def test_one_note_per_file_not_per_handle(read_only_view):
    """In this process too: the note is a RegistryWarning, given once per file."""
    src, make = read_only_view
    _registry_with_runs(src)._conn().close()
    view = make()
    registry_mod._NOTED.discard(str(view / "registry.db"))
    with pytest.warns(RegistryWarning) as w:
        first = Registry(view / "registry.db")
        Registry(view / "registry.db")
    assert len(w) == 1 and first.read_only
    with pytest.raises(RegistryReadOnlyError):
        first.update("ghost", name="renamed")
    assert first.list_runs(status="lost")[0]["id"] == "ghost"
    assert [r["id"] for r in first.list_runs(status="running")] == []
    first._conn().close()


def test_opening_an_up_to_date_registry_takes_no_lock(tmp_path):
    """Only creation and upgrade take registry.db.lock: a reader opening an existing registry while
    another process holds that lock (a first open, say) does not wait for it."""
    import fcntl

    _registry_with_runs(tmp_path)._conn().close()
    with open(tmp_path / "registry.db.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        out = _py(f"from gpu_lab.record.registry import Registry; "
                  f"print(Registry({str(tmp_path / 'registry.db')!r}).get_run('ghost')['status'])",
                  timeout=60)
        assert out.returncode == 0 and out.stdout.strip() == "lost", out.stderr
