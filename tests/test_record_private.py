"""A run is private by default: its event channel takes only its key, its files only its owner.

Real runs, real processes, real sockets, real Unix users. A forger that knows the channel's
addresses (as anyone could: ports can be scanned, the publish address is in the registry) but
not the run's key sends random bytes and well-formed forged events (metrics, a log line, a final
"succeeded" status) into a running 2-rank run and subscribes to what it publishes: nothing it
sends appears in the record, it receives nothing, and the run's own reports are all recorded.
"""
from __future__ import annotations

import grp
import json
import os
import secrets
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

import gpu_lab
from gpu_lab.config import TrainConfig
from gpu_lab.record.registry import Registry
from gpu_lab.record.events import FINAL_STATUSES

from proc_utils import wait_until

pytestmark = pytest.mark.slow  # starts processes (ranks, kernels, servers) or runs for seconds

ROOT = Path(__file__).resolve().parents[1]
EXTRA = 20  # reports each rank makes after the forger is done

# The forger: a process of its own, with the addresses but not the key. It tries plain (NULL)
# connections, CURVE with a made-up server key, and CURVE with the run's real server public key
# (a public key may leak) but its own client pair; then raw random bytes to both ports. It
# listens on its subscribers until its stdin closes and prints what it received.
FORGER = r'''
import json, os, socket, sys, time
import zmq

args = json.loads(sys.argv[1])
run = args["run"]
ctx = zmq.Context()
servers = [None, zmq.curve_keypair()[0].decode()] + ([args["server"]] if args.get("server") else [])
subs, pushes = [], []
ends = [(zmq.PUSH, args["push"], pushes)] + ([(zmq.SUB, args["pub"], subs)] if args["pub"] else [])
for server in servers:
    for kind, address, out in ends:
        s = ctx.socket(kind)
        s.setsockopt(zmq.LINGER, 0)
        if kind == zmq.SUB:
            s.setsockopt(zmq.SUBSCRIBE, b"")
        if server:
            public, secret = zmq.curve_keypair()
            s.curve_serverkey, s.curve_publickey, s.curve_secretkey = server.encode(), public, secret
        s.connect(address)
        out.append(s)
t = time.time()
forged = [
    {"run": run, "rank": 0, "kind": "metric", "t": t, "step": 10**6,
     "data": {"loss": 666.0, "forged": 1.0}},
    {"run": run, "rank": 1, "kind": "log", "t": t, "step": None, "data": {"text": "FORGED line"}},
    {"run": run, "rank": 0, "kind": "status", "t": t, "step": None,
     "data": {"status": "succeeded", "reason": "FORGED"}},
    {"run": run, "rank": -1, "kind": "status", "t": t, "step": None,
     "data": {"status": "succeeded", "reason": "FORGED"}},
]
handed = would_block = 0
deadline = time.monotonic() + 2.0  # each socket's handshake gets its chance to go wrong
while time.monotonic() < deadline:
    for p in pushes:
        for msg in (json.dumps(forged).encode(), os.urandom(512)):
            try:
                p.send(msg, zmq.NOBLOCK)
                handed += 1
            except zmq.Again:
                would_block += 1
    time.sleep(0.05)  # the forgery's pace over its 2 s window, not a wait for anything
for address in filter(None, (args["push"], args["pub"])):  # not even ZMTP: raw bytes
    host, port = address.rsplit("/", 1)[1].rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=5) as c:
            c.sendall(os.urandom(4096))
    except OSError:
        pass
print("ready", flush=True)
poller = zmq.Poller()
for s in subs:
    poller.register(s, zmq.POLLIN)
poller.register(sys.stdin.fileno(), zmq.POLLIN)
received = 0
while True:
    ready = dict(poller.poll(1000))
    if sys.stdin.fileno() in ready:
        break
    for s in subs:
        while s in ready:
            try:
                s.recv_multipart(zmq.NOBLOCK)
                received += 1
            except zmq.Again:
                break
print(json.dumps({"received": received, "handed": handed, "would_block": would_block}),
      flush=True)
'''


def report_until(go: str, out: str, cfg: TrainConfig | None = None) -> int:
    """A rank: report (and log) until the file `go` exists, then EXTRA more; writes its channel
    address and its number of reports into `out`. Rank 0 saves a checkpoint first."""
    from gpu_lab.record.reporter import get_reporter

    rank = int(os.environ.get("RANK", 0))
    if cfg is not None and rank == 0:
        from gpu_lab.train.checkpoint import checkpoint_dir, save_checkpoint

        save_checkpoint(checkpoint_dir(cfg.output_dir), 1,
                        {"weights.txt": lambda p: p.write_text("the owner's weights")})
    Path(out, f"address{rank}").write_text(os.environ["GPU_LAB_EVENTS"])
    step, extra = 0, EXTRA
    deadline = time.monotonic() + 300
    while extra and time.monotonic() < deadline:
        gpu_lab.report(step, loss=float(step))
        if step % 10 == 0:
            get_reporter().log(f"rank {rank} step {step}")
        step += 1
        if os.path.exists(go):
            extra -= 1
        time.sleep(0.01)  # a training step's pace
    get_reporter().flush(5.0)
    Path(out, f"steps{rank}").write_text(str(step))
    return step


def headless_target() -> int:
    """report_until for `python -m gpu_lab.rank.headless`, which calls its function without
    arguments: the files come from the environment."""
    return report_until(os.environ["TEST_GO"], os.environ["TEST_OUT"])


def _assert_record(reg: Registry, run_id: str, steps: dict[int, int]) -> None:
    """Nothing forged in the record, one final status (the recorder's), every report there."""
    events = reg.events(run_id)
    forged = [e for e in events if "FORGED" in json.dumps(e) or "forged" in e["data"]]
    assert not forged, forged
    finals = [e for e in events if e["kind"] == "status"
              and e["data"].get("status") in FINAL_STATUSES]
    assert [(e["rank"], e["data"]["status"]) for e in finals] == [(-1, "succeeded")]
    assert finals[0] == events[-1]
    assert not [e for e in events if e["kind"] == "dropped"]
    for rank, n in steps.items():
        got = [e["step"] for e in events if e["kind"] == "metric" and e["rank"] == rank]
        assert got == list(range(n)), (rank, n, got[:5], len(got))
        logs = [e["data"]["text"] for e in events if e["kind"] == "log" and e["rank"] == rank]
        assert logs == [f"rank {rank} step {s}" for s in range(0, n, 10)]


def _forger(args: dict, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", FORGER, json.dumps(args)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, **popen)


def _finish_forger(p: subprocess.Popen) -> dict:
    out, _ = p.communicate("", timeout=60)
    return json.loads(out.splitlines()[-1])


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_a_forger_without_the_key_neither_writes_nor_reads_a_run(tmp_path):
    """Same user, no key: the channel, not the file modes, keeps the forger out. Launched under
    umask 000, to show the run's files are private whatever the umask."""
    out, go = tmp_path / "signals", tmp_path / "go"
    out.mkdir()
    cfg = TrainConfig(output_dir=str(tmp_path / "out"))
    old_umask = os.umask(0)
    try:
        run = gpu_lab.launch(report_until, str(go), str(out), cfg, num_processes=2)
    finally:
        os.umask(old_umask)
    live = []
    run.subscribe(live.extend)
    try:
        wait_until(lambda: (out / "address1").exists() and (out / "address0").exists(), 120,
                   what="both ranks to start")
        reg = Registry()
        row = wait_until(lambda: (r := reg.get_run(run.id)) and r.get("events_address") and r,
                         30, what="the publish address in the registry")
        server = json.loads((Path(row["run_dir"]) / "channel.key").read_text())["server"]
        forger = _forger({"run": run.id, "push": (out / "address0").read_text(),
                          "pub": row["events_address"], "server": server})
        assert forger.stdout.readline().strip() == "ready"
        seen = len(live)  # the run publishes while the forger listens
        wait_until(lambda: len(live) >= seen + 40, 60, what="live events during the forgery")
        got = _finish_forger(forger)
        assert got["received"] == 0, got
        assert reg.get_run(run.id)["status"] == "running"  # the forged "succeeded" did nothing
        go.write_text("")
        assert run.wait(120) == "succeeded"
    finally:
        go.write_text("")
        run.wait(60)
    steps = {r: int((out / f"steps{r}").read_text()) for r in (0, 1)}
    _assert_record(reg, run.id, steps)
    from gpu_lab.readers.receiver import get_receiver

    assert get_receiver().unkeyed == 0  # the owner followed live, with the run's key
    log = (Path(row["run_dir"]) / "logs" / "supervisor.log").read_text()
    assert "connection(s) with another key refused" in log  # counted, never read
    _assert_private_files(Path(row["run_dir"]), Path(row["output_dir"]))
    print(f"forger: {got}; reports per rank: {steps}")


def test_a_headless_rank_records_through_a_key_of_its_own(tmp_path):
    """gpu_lab.rank.headless: the rank's recorder (in the rank's own process) makes its own key,
    which no other process gets; a forger with the address writes nothing into the record."""
    out, go = tmp_path / "signals", tmp_path / "go"
    out.mkdir()
    env = {**os.environ, "TEST_GO": str(go), "TEST_OUT": str(out),
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    for k in ("GPU_LAB_EVENTS", "GPU_LAB_EVENTS_KEY", "RANK", "LOCAL_RANK", "WORLD_SIZE"):
        env.pop(k, None)
    rank = subprocess.Popen([sys.executable, "-m", "gpu_lab.rank.headless",
                             "test_record_private:headless_target", "--run-id", "headless-1"],
                            env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        wait_until(lambda: (out / "address0").exists() or rank.poll() is not None, 120,
                   what="the headless rank to start")
        forger = _forger({"run": "headless-1", "push": (out / "address0").read_text(),
                          "pub": None})
        assert forger.stdout.readline().strip() == "ready"
        assert _finish_forger(forger)["received"] == 0
    finally:
        go.write_text("")
        output, _ = rank.communicate(timeout=120)
    assert rank.returncode == 0, output
    reg = Registry()
    events = reg.events("headless-1")
    assert not [e for e in events if "FORGED" in json.dumps(e) or "forged" in e["data"]]
    n = int((out / "steps0").read_text())
    assert [e["step"] for e in events if e["kind"] == "metric"] == list(range(n))
    assert reg.get_run("headless-1")["status"] == "succeeded"
    assert _mode(Path(reg.get_run("headless-1")["run_dir"])) == 0o700


def _assert_private_files(run_dir: Path, output_dir: Path) -> None:
    assert _mode(run_dir) == 0o700 and _mode(output_dir) == 0o700
    for d in (run_dir / "logs", run_dir / "ranks", run_dir / "elastic", output_dir / "checkpoints"):
        assert _mode(d) == 0o700, d
    files = [run_dir / "channel.key", run_dir / "result.pkl", run_dir / "status.json",
             *run_dir.glob("logs/*.log"), *run_dir.glob("ranks/*.pid")]
    assert len(files) >= 8, files
    assert {str(f): oct(_mode(f)) for f in files if _mode(f) != 0o600} == {}


def test_private_folders_and_files_ignore_the_umask_and_share_through_a_group(tmp_path,
                                                                               monkeypatch):
    from gpu_lab.access import SHARE_GROUP, open_private, private_dir

    old = os.umask(0o077)  # the tightest umask must not cut a shared mode either
    try:
        os.umask(0)
        assert _mode(private_dir(tmp_path / "a" / "b")) == 0o700
        os.close(open_private(tmp_path / "a" / "b" / "f", os.O_WRONLY | os.O_CREAT))
        assert _mode(tmp_path / "a" / "b" / "f") == 0o600
        group = grp.getgrgid(os.getgid()).gr_name
        monkeypatch.setenv(SHARE_GROUP, group)
        os.umask(0o077)
        shared = private_dir(tmp_path / "shared")
        assert _mode(shared) == 0o2770 and shared.stat().st_gid == os.getgid()
        os.close(open_private(shared / "f", os.O_WRONLY | os.O_CREAT))
        assert _mode(shared / "f") == 0o660
        monkeypatch.setenv(SHARE_GROUP, "no-such-group-here")
        with pytest.raises(ValueError, match="GPU_LAB_SHARE_GROUP='no-such-group-here': no such "
                                             "group on this host; accepted: the name or id of a "
                                             "group you are in"):
            private_dir(tmp_path / "x")
    finally:
        os.umask(old)


# --- another Unix user ------------------------------------------------------------------------------
class User:
    def __init__(self, name: str, claims: Path) -> None:
        import pwd

        pw = pwd.getpwnam(name)
        self.name, self.uid, self.gid, self.home = name, pw.pw_uid, pw.pw_gid, Path(pw.pw_dir)
        self.claims = claims  # the host queue of the test's users, not the machine's

    def env(self, gpu_lab_home: Path) -> dict:
        (self.home / "tmp").mkdir(exist_ok=True)
        os.chown(self.home / "tmp", self.uid, self.gid)
        return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(self.home),
                "USER": self.name, "LOGNAME": self.name, "GPU_LAB_HOME": str(gpu_lab_home),
                "GPU_LAB_QUICK": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}",
                "TMPDIR": str(self.home / "tmp"), "OMP_NUM_THREADS": "1",
                "GPU_LAB_CLAIMS_DIR": str(self.claims)}

    def popen(self, args: list, env: dict, **kw) -> subprocess.Popen:
        return subprocess.Popen(args, user=self.uid, group=self.gid, extra_groups=[], env=env,
                                cwd=self.home, **kw)

    def run(self, args: list, env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
        p = self.popen(args, env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = p.communicate(timeout=timeout)
        return subprocess.CompletedProcess(args, p.returncode, out, err)


def _let_others_run_python() -> dict[Path, int]:
    """The interpreter lives under /root (mode 0700): give every folder on the way to it, to its
    standard library and to the venv the search (x) bit for others, nothing more (no listing,
    no reading); returns the modes to restore."""
    targets = [Path(os.path.realpath(sys.executable)), Path(sys.base_prefix) / "lib",
               Path(sys.prefix) / "lib", ROOT]
    changed: dict[Path, int] = {}
    for t in targets:
        for d in [t, *t.parents] if t.is_dir() else list(t.parents):
            m = d.stat().st_mode
            if not m & stat.S_IXOTH and d not in changed:
                changed[d] = stat.S_IMODE(m)
                os.chmod(d, stat.S_IMODE(m) | stat.S_IXOTH)
    return changed


@pytest.fixture(scope="module")
def users():
    """Two fresh non-root users (owner, other), removed afterwards whatever happens. The owner's
    home is made 0755, so that what keeps the other user out is gpu_lab's own modes."""
    if os.geteuid() != 0:
        pytest.skip("creating Unix users needs root; run as root to check that another user "
                    "cannot read a run")
    if shutil.which("useradd") is None or shutil.which("userdel") is None:
        pytest.skip("useradd/userdel are not installed on this machine")
    names = [f"gplab{secrets.token_hex(3)}{i}" for i in (1, 2)]
    created: list[str] = []
    restore: dict[Path, int] = {}
    # reachable by both users (the session's temp folder is root's alone); removed after
    claims = Path(tempfile.mkdtemp(prefix="gpu_lab-claims-users-", dir="/tmp"))
    os.chmod(claims, 0o1777)
    try:
        for n in names:
            r = subprocess.run(["useradd", "-m", "-s", "/bin/sh", n], capture_output=True,
                               text=True)
            if r.returncode:
                pytest.skip(f"this machine does not allow creating users: {r.stderr.strip()}")
            created.append(n)
        restore = _let_others_run_python()
        owner, other = User(names[0], claims), User(names[1], claims)
        os.chmod(owner.home, 0o755)
        yield owner, other
    finally:
        for d, m in restore.items():
            os.chmod(d, m)
        for n in created:
            _end_processes_of(n)
            subprocess.run(["userdel", "-r", n], capture_output=True)
        shutil.rmtree(claims, ignore_errors=True)


def _end_processes_of(name: str) -> None:
    """Processes this test started as that user, which must be gone before userdel."""
    import psutil

    for p in psutil.process_iter(["username"]):
        if p.info["username"] == name:
            try:
                p.kill()
            except psutil.Error:
                pass


LAUNCH = r'''
import json, sys
from pathlib import Path
import gpu_lab
from gpu_lab.config import TrainConfig
from test_record_private import report_until

go, out, info = sys.argv[1:4]
cfg = TrainConfig(output_dir=str(Path.home() / "out"))
run = gpu_lab.launch(report_until, go, out, cfg, num_processes=2)
Path(info).write_text(json.dumps({"id": run.id, "run_dir": str(run.run_dir),
                                  "output_dir": run.output_dir}))
print(run.wait(300), flush=True)
'''

ATTACH = r'''
import json, sys, time
import gpu_lab
from gpu_lab.readers.receiver import get_receiver

run = gpu_lab.attach(sys.argv[1])
r = get_receiver()
deadline = time.monotonic() + 60
while r.received - r.read_back < 20 and time.monotonic() < deadline:
    time.sleep(0.05)  # polls a condition, with a deadline
print(json.dumps({"live": r.received - r.read_back, "unkeyed": r.unkeyed, "status": run.status}))
'''

PROBE = r'''
import json, os, sys
out = {}
for p in sys.argv[1:]:
    try:
        if os.path.isdir(p):
            os.listdir(p)
        else:
            open(p, "rb").read(1)
        out[p] = "read"
    except OSError as e:
        out[p] = type(e).__name__
print(json.dumps(out))
'''


def test_another_user_can_neither_use_the_channel_nor_read_the_run(users):
    """The owner (user 1) launches a 2-rank run from a script, with GPU_LAB_HOME in its home;
    user 2, with the addresses, forges and subscribes (nothing), and cannot read the run's
    folder, logs, key, result or checkpoints; the owner's attach follows the run live.

    Both users run the test's own interpreter, which lives under /root (mode 0700): the `users`
    fixture gives the folders on its way the search bit for others (no listing, no reading) for
    the test's duration and restores their modes after, whatever happens; the owner's home is
    made 0755 so that what keeps user 2 out is gpu_lab's modes, not the home's."""
    owner, other = users
    home = owner.home / "gpu_lab_home"
    env = owner.env(home)
    signals, go, info = owner.home / "signals", owner.home / "go", owner.home / "info.json"
    signals.mkdir()
    os.chown(signals, owner.uid, owner.gid)
    launcher = owner.popen([sys.executable, "-c", LAUNCH, str(go), str(signals), str(info)], env,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: info.exists() and (signals / "address0").exists()
                   and (signals / "address1").exists() or launcher.poll() is not None, 180,
                   what="the owner's run to start")
        assert launcher.poll() is None, launcher.communicate()
        run = json.loads(info.read_text())
        reg = Registry(home / "registry.db")
        row = wait_until(lambda: (r := reg.get_run(run["id"])) and r.get("events_address") and r,
                         30, what="the publish address in the registry")
        forger = _forger({"run": run["id"], "push": (signals / "address0").read_text(),
                          "pub": row["events_address"]}, user=other.uid, group=other.gid,
                         extra_groups=[], env=other.env(home), cwd=other.home)
        assert forger.stdout.readline().strip() == "ready"
        attach = owner.run([sys.executable, "-c", ATTACH, run["id"]], env)  # while it listens
        got = _finish_forger(forger)
        assert got["received"] == 0, got
        assert attach.returncode == 0, attach.stderr
        seen = json.loads(attach.stdout.splitlines()[-1])
        assert seen["live"] >= 20 and seen["unkeyed"] == 0 and seen["status"] == "running", seen
        go.write_text("")
        out, err = launcher.communicate(timeout=180)
        assert out.strip().splitlines()[-1] == "succeeded", (out, err)
    finally:
        go.write_text("")
        if launcher.poll() is None:
            launcher.communicate(timeout=120)
    steps = {r: int((signals / f"steps{r}").read_text()) for r in (0, 1)}
    _assert_record(reg, run["id"], steps)
    run_dir, output_dir = Path(run["run_dir"]), Path(run["output_dir"])
    private = [run_dir, run_dir / "logs" / "rank0.log", run_dir / "result.pkl",
               run_dir / "channel.key", output_dir, output_dir / "checkpoints"]
    assert all(p.exists() for p in private)
    probe = other.run([sys.executable, "-c", PROBE, *map(str, private)], other.env(home))
    assert json.loads(probe.stdout) == {str(p): "PermissionError" for p in private}, probe.stderr
    mine = owner.run([sys.executable, "-c", PROBE, *map(str, private)], env)
    assert set(json.loads(mine.stdout).values()) == {"read"}, mine.stderr
    print(f"forger as {other.name}: {got}; owner's attach: {seen}; reports per rank: {steps}")


def test_another_user_cannot_read_the_registry(users):
    """The registry file's modes are the registry's own (gpu_lab.record.registry)."""
    owner, other = users
    home = owner.home / "registry_only"
    made = owner.run([sys.executable, "-c", "from gpu_lab.record.registry import Registry; "
                      "Registry().create_run('r1', status='running')"], owner.env(home))
    assert made.returncode == 0, made.stderr
    probe = other.run([sys.executable, "-c", PROBE, str(home / "registry.db")], other.env(home))
    assert json.loads(probe.stdout) == {str(home / "registry.db"): "PermissionError"}
