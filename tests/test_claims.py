"""Host-wide device claims and their queue (gpu_lab.supervise.claims): real processes, real flocks,
real files, a real second Unix user. Each claimant is a fresh Python process (WORKER) that claims,
notes what it got in its own events file, holds the claim for its "work" (a fixed time, or until
the test touches its release file) and releases it."""
from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from proc_utils import wait_until

from gpu_lab.supervise import claims
from gpu_lab.supervise.claims import (ClaimCancelled, DevicesBusy, host_queue, queue_stats,
                                      wait_for_devices)
from gpu_lab.supervise.devices import Resources, cpu_slots, parse_request
from gpu_lab.telemetry.doubles import FakeNVML

pytestmark = pytest.mark.slow  # starts processes (ranks, kernels, servers) or runs for seconds

ROOT = Path(__file__).resolve().parents[1]
T = 60.0  # generous deadlines: the host is small and shared

WORKER = r'''
import json, os, sys, time
args = json.loads(sys.argv[1])
os.umask(args.get("umask", 0o022))
from gpu_lab.supervise.claims import wait_for_devices
nvml = None
if args.get("fake_gpus"):
    from gpu_lab.telemetry.doubles import FakeNVML
    nvml = FakeNVML(args["fake_gpus"])
    for i in args.get("foreign", []):
        nvml.gpus[i].processes = {1: 8 << 30}   # pid 1 is no claimant: a foreign process
def note(**kw):
    with open(args["out"], "a") as f:
        f.write(json.dumps(kw) + "\n")
note(event="entering", pid=os.getpid())
claim = wait_for_devices(args["gpus"], args["run"], args.get("prio", 0), nvml=nvml,
                         key=args.get("key"), on_position=lambda n: note(event="position", n=n))
note(event="start", t=time.time(), mono=time.monotonic(), devices=[d.index for d in claim.devices],
     cvd=claim.cuda_visible_devices())
if args.get("fake_gpus"):  # as the supervisor does for its ranks: what a forked rank sees
    os.environ.update(claim.env())
    child = os.fork()
    if child == 0:
        note(event="rank", cvd=os.environ.get("CUDA_VISIBLE_DEVICES"),
             order=os.environ.get("CUDA_DEVICE_ORDER"))
        os._exit(0)
    os.waitpid(child, 0)
if args.get("fork_child") and os.fork() == 0:  # a rank: it inherits the claim's descriptors
    while not os.path.exists(args["fork_child"]):
        time.sleep(0.02)
    os._exit(0)
hold = args["hold"]
if isinstance(hold, (int, float)):
    time.sleep(hold)  # the run's work
else:
    while not os.path.exists(hold):
        time.sleep(0.02)
note(event="end", t=time.time(), mono=time.monotonic())
claim.release()
'''


class Workers:
    """Claimant processes of one test, and their events files; kills what is left at the end."""

    def __init__(self, folder: Path, env: dict[str, str]) -> None:
        self.folder, self.env, self.procs = folder, env, {}

    def start(self, run: str, gpus, hold="file", user: str | None = None,
              python: str = sys.executable, **kw) -> subprocess.Popen:
        out = self.folder / f"{run}.events"
        hold = str(self.folder / f"{run}.release") if hold == "file" else hold
        args = dict(run=run, gpus=gpus, hold=hold, out=str(out), **kw)
        p = subprocess.Popen([python, "-c", WORKER, json.dumps(args)], env=self.env,
                             user=user, cwd="/")
        self.procs[run] = p
        return p

    def events(self, run: str, event: str | None = None) -> list[dict]:
        path = self.folder / f"{run}.events"
        if not path.exists():
            return []
        rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
        return [r for r in rows if event is None or r["event"] == event]

    def first(self, run: str, event: str) -> dict:
        return wait_until(lambda: (self.events(run, event) or [None])[0], T,
                          what=f"{run}: {event}")

    def release(self, run: str) -> float:
        (self.folder / f"{run}.release").touch()
        return time.time()

    def wait_all(self) -> None:
        for run, p in self.procs.items():
            assert p.wait(T) == 0, f"{run} exited with {p.returncode}"

    def kill_all(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(T)


def queued(run: str, folder=None) -> bool:
    return any(r.run_id == run and r.state == "waiting" for r in host_queue(folder))


@pytest.fixture
def host(tmp_path, monkeypatch):
    """A claims folder of its own and a 2-slot CPU host, for this process and its workers."""
    monkeypatch.setenv("GPU_LAB_CLAIMS_DIR", str(tmp_path / "claims"))
    monkeypatch.setenv("GPU_LAB_CPU_SLOTS", "2")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    w = Workers(tmp_path, env)
    yield w
    w.kill_all()


# ----------------------------------------------------------------------- order and exclusion
def test_priority_then_submission_one_at_a_time(host):
    blocker = wait_for_devices(2, "blocker", kind="cpu")
    for run, prio in (("w1", 0), ("w2", 0), ("w3", 5), ("w4", 0)):
        host.start(run, 2, hold=0.3, prio=prio)
        wait_until(lambda: queued(run), T, what=f"{run} queued")
    rows = [r for r in host_queue() if r.state == "waiting"]
    assert [(r.run_id, r.position) for r in rows] == [("w3", 1), ("w1", 2), ("w2", 3), ("w4", 4)]
    released = time.monotonic()
    blocker.release()
    host.wait_all()
    runs = sorted(("w1", "w2", "w3", "w4"), key=lambda r: host.events(r, "start")[0]["t"])
    assert runs == ["w3", "w1", "w2", "w4"]
    spans = [(host.events(r, "start")[0], host.events(r, "end")[0]) for r in runs]
    for (_, end), (start, _) in zip(spans, spans[1:]):
        assert end["t"] <= start["t"], f"two runs held the 2 slots at once: {spans}"
    for r in runs:  # each was queued until its turn, and says where it stood
        assert host.events(r, "position"), r
        assert host.events(r, "start")[0]["devices"] == [0, 1]
    gaps = [spans[0][0]["mono"] - released] + [b[0]["mono"] - a[1]["mono"]
                                                for a, b in zip(spans, spans[1:])]
    print(f"\nhand-off release -> next claim: {', '.join(f'{g * 1000:.1f} ms' for g in gaps)}")
    assert host_queue() == [] and queue_stats()["dead_tickets"] == 0


def test_sigkill_holder_frees_its_slots(host):
    holder = host.start("holder", 2)
    host.first("holder", "start")
    host.start("next", 2)
    wait_until(lambda: queued("next"), T, what="next queued")
    holder.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    started = host.first("next", "start")
    assert started["mono"] - killed < 5.0
    holder.wait(T)
    print(f"\nSIGKILL of the holder -> next claim: {(started['mono'] - killed) * 1000:.0f} ms")
    host.release("next")
    assert host.procs["next"].wait(T) == 0


def test_forked_children_keep_a_dead_claimants_devices(host, tmp_path):
    child_go = tmp_path / "child.release"
    holder = host.start("holder", 2, fork_child=str(child_go))
    host.first("holder", "start")
    host.start("next", 2)
    wait_until(lambda: queued("next"), T, what="next queued")
    holder.send_signal(signal.SIGKILL)
    holder.wait(T)
    # the claimant is gone, its forked rank is not: the devices stay taken (host_queue probes)
    assert [(r.run_id, r.state) for r in host_queue()] == [("holder", "holding"),
                                                           ("next", "waiting")]
    child_go.touch()
    host.first("next", "start")
    host.release("next")
    assert host.procs["next"].wait(T) == 0


def test_release_is_immediate_and_a_forked_child_cannot_release(host):
    claim = wait_for_devices(2, "parent")
    done_r, done_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        claim.release()  # must do nothing: the parent is the claimant
        os.write(done_w, b"x")
        os.read(go_r, 1)
        os._exit(0)
    try:
        assert os.read(done_r, 1) == b"x"
        with pytest.raises(DevicesBusy):
            wait_for_devices(2, "early", queue=False)
        claim.release()  # the child still holds copies of the descriptors
        with wait_for_devices(2, "next", queue=False) as nxt:
            assert nxt.held
    finally:
        os.write(go_w, b"x")
        os.waitpid(pid, 0)


def test_killed_waiter_leaves_the_queue(host):
    host.start("holder", 2)
    host.first("holder", "start")
    doomed = host.start("doomed", 2)
    wait_until(lambda: queued("doomed"), T, what="doomed queued")
    host.start("after", 2)
    wait_until(lambda: queued("after"), T, what="after queued")
    doomed.send_signal(signal.SIGKILL)
    doomed.wait(T)
    wait_until(lambda: not queued("doomed"), T, what="the dead waiter dropped")
    assert [r.position for r in host_queue() if r.run_id == "after"] == [1]
    host.release("holder")
    host.first("after", "start")
    host.release("after")
    for run in ("holder", "after"):
        assert host.procs[run].wait(T) == 0
    assert host.events("doomed", "start") == []
    assert host_queue() == []
    # the dead waiter's ticket file is gone: the next claimant of its user removed it
    assert not list(claims.claims_folder().glob("ticket-*.json"))
    assert queue_stats() == {"bad_lines": 0, "foreign_files": 0, "dead_tickets": 0}


def test_queue_false_names_the_holder_and_cancel_withdraws(host):
    holder = host.start("holder-run", 2)
    host.first("holder-run", "start")
    with pytest.raises(DevicesBusy) as e:
        wait_for_devices(1, "eager", queue=False)
    msg = str(e.value)
    assert "holder-run" in msg and f"pid {holder.pid}" in msg
    assert pwd.getpwuid(os.geteuid()).pw_name in msg and "queue=True" in msg
    assert e.value.holders == [{"run_id": "holder-run", "user": pwd.getpwuid(os.geteuid()).pw_name,
                                "pid": holder.pid, "devices": [0, 1]}]
    asked = []
    with pytest.raises(ClaimCancelled):
        wait_for_devices(1, "patient", cancelled=lambda: asked.append(1) or len(asked) > 2)
    assert [r.run_id for r in host_queue()] == ["holder-run"]  # both withdrawn
    host.release("holder-run")
    host.wait_all()


def test_shared_key_holds_until_the_last_member(host):
    first = wait_for_devices(2, "node0", key="job-1")
    host.start("node1", 2, key="job-1")
    assert host.first("node1", "start")["devices"] == [0, 1]  # joined: no wait, same devices
    host.start("other", 1)
    wait_until(lambda: queued("other"), T, what="other queued")
    first.release()
    rows = {r.run_id: r for r in host_queue()}
    assert rows["node0"].state == "holding" and rows["other"].state == "waiting"
    ended = host.release("node1")
    assert host.first("other", "start")["t"] >= ended
    host.release("other")
    host.wait_all()


# ----------------------------------------------------------------------- backfill, no starvation
def test_backfill_until_the_large_run_has_been_bypassed_enough(host, monkeypatch):
    monkeypatch.setenv("GPU_LAB_QUEUE_BYPASSES", "2")
    host.env["GPU_LAB_QUEUE_BYPASSES"] = "2"
    host.start("small-holder", 1)
    host.first("small-holder", "start")
    host.start("large", 2, hold=0.3)
    wait_until(lambda: queued("large"), T, what="large queued")
    for run in ("s1", "s2"):  # each starts ahead of the large run, which cannot start yet
        host.start(run, 1)
        host.first(run, "start")
        assert queued("large")
        host.release(run)
        assert host.procs[run].wait(T) == 0
    assert [r.reserved for r in host_queue() if r.run_id == "large"] == [True]
    host.start("s3", 1, hold=0.1)
    wait_until(lambda: queued("s3"), T, what="s3 queued")  # its first look is done: it waits
    released = host.release("small-holder")
    host.wait_all()
    large, s3 = host.events("large", "start")[0], host.events("s3", "start")[0]
    assert released <= large["t"] <= host.events("large", "end")[0]["t"] <= s3["t"]


def test_a_long_wait_reserves(host, monkeypatch):
    monkeypatch.setenv("GPU_LAB_QUEUE_RESERVE_S", "1")
    host.env["GPU_LAB_QUEUE_RESERVE_S"] = "1"
    holder = wait_for_devices(1, "small-holder")
    host.start("large", 2, hold=0.3)
    wait_until(lambda: [r.reserved for r in host_queue() if r.run_id == "large"] == [True], T,
               what="the large run reserves")
    host.start("small", 1, hold=0.1)
    wait_until(lambda: queued("small"), T, what="small queued")
    released = time.time()
    holder.release()
    host.wait_all()
    large, small = host.events("large", "start")[0], host.events("small", "start")[0]
    assert released <= large["t"] <= host.events("large", "end")[0]["t"] <= small["t"]


# ----------------------------------------------------------------------- GPUs, with the NVML double
def test_fake_gpus_disjoint_never_the_foreign_one(host):
    order = (("a", 2), ("b", 2), ("c", 4), ("d", 1))
    for run, n in order:
        host.start(run, n, fake_gpus=8, foreign=[3])
        wait_until(lambda: host.events(run, "start") or queued(run), T, what=f"{run} in")
    got = {run: host.events(run, "start") for run, _ in order}
    assert {r: g[0]["devices"] for r, g in got.items() if g} == {"a": [0, 1], "b": [2, 4],
                                                                  "d": [5]}
    assert queued("c")  # 3 GPUs free besides the foreign one: c waits
    host.release("a")
    assert host.first("c", "start")["cvd"] == "0,1,6,7"
    for run in ("b", "c", "d"):
        host.release(run)
    host.wait_all()
    spans = {run: (host.events(run, "start")[0], host.events(run, "end")[0]) for run, _ in order}
    for x, (xs, xe) in spans.items():
        assert 3 not in xs["devices"] and xs["cvd"] == ",".join(map(str, xs["devices"]))
        assert host.events(x, "rank")[0] == {"event": "rank", "cvd": xs["cvd"],
                                             "order": "PCI_BUS_ID"}
        for y, (ys, ye) in spans.items():
            if x < y and xs["t"] < ye["t"] and ys["t"] < xe["t"]:
                assert not set(xs["devices"]) & set(ys["devices"]), (x, y, spans)


def test_foreign_memory_threshold(monkeypatch):
    fake = FakeNVML(4)
    fake.gpus[1].processes = {1: 2 << 30}
    fake.gpus[2].processes = {1: 512 << 20, os.getpid(): 8 << 30}  # its own pid never counts
    res = Resources.detect(fake)
    try:
        assert res.kind == "gpu" and [d.index for d in res.devices] == [0, 1, 2, 3]
        busy = res.foreign_busy()
        assert list(busy) == [res.devices[1].id]
        assert "2048 MiB held by pid 1" in busy[res.devices[1].id]
        monkeypatch.setenv("GPU_LAB_GPU_BUSY_MIB", "256")
        assert len(res.foreign_busy()) == 2
    finally:
        res.close()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    res = Resources.detect(FakeNVML(4))
    assert [d.index for d in res.devices] == [0, 2]
    res.close()


# ----------------------------------------------------------------------- requests and settings
def test_requests_are_checked_with_clear_messages(monkeypatch):
    monkeypatch.setenv("GPU_LAB_CPU_SLOTS", "3")
    res = Resources.detect(kind="cpu")
    assert parse_request("all", res).count == 3 and parse_request([2, 0], res).ids == ("cpu-2",
                                                                                        "cpu-0")
    for bad, says in ((0, "got 0; this host has 3 CPU slots"), (4, "got 4"), ("two", "'two'"),
                      ([1, 1], "twice"), ([5], "no CPU slots [5]"), (True, "got True"),
                      (1.5, "got 1.5"), ([], "got []")):
        with pytest.raises(ValueError, match="accepted|may use") as e:
            parse_request(bad, res)
        assert says in str(e.value)
    for bad in ("0", "many"):
        monkeypatch.setenv("GPU_LAB_CPU_SLOTS", bad)
        with pytest.raises(ValueError, match=f"GPU_LAB_CPU_SLOTS: got '{bad}'; accepted: a whole"):
            cpu_slots()
    monkeypatch.setenv("GPU_LAB_QUEUE_BYPASSES", "-1")
    with pytest.raises(ValueError, match="GPU_LAB_QUEUE_BYPASSES: got '-1'; accepted"):
        claims.plan([], set(), set(), 0.0)
    monkeypatch.delenv("GPU_LAB_CPU_SLOTS")
    assert cpu_slots() == len(os.sched_getaffinity(0))
    with pytest.raises(ValueError, match="priority: got 'high'"):
        wait_for_devices(1, "x", "high")


# ----------------------------------------------------------------------- who may use the folder
def test_folder_and_locks_are_for_everyone_whatever_the_umask(host, tmp_path):
    old = os.umask(0o077)
    try:
        with wait_for_devices(1, "strict-umask") as claim:
            assert claim.held
            folder = tmp_path / "claims"
            ticket, = folder.glob("ticket-*.json")  # its own, readable by all, writable by it
            assert ticket.name.startswith(f"ticket-{os.geteuid()}-")
            assert oct(ticket.stat().st_mode & 0o777) == oct(0o644)
    finally:
        os.umask(old)
    assert oct(folder.stat().st_mode & 0o7777) == oct(0o1777)
    files = sorted(folder.iterdir())
    assert [f.name for f in files] == ["cpu-0.lock", "cpu-1.lock"]  # the ticket left with it
    assert all(oct(f.stat().st_mode & 0o777) == oct(0o644) for f in files)
    assert (folder / "cpu-0.lock").stat().st_size == 0  # a lock holds no data


def test_hostile_ticket_files_are_counted_and_never_followed(host, tmp_path):
    folder = claims.claims_folder()
    me = os.geteuid()
    good = {"op": "enter", "ticket": "1" * 32, "run": "evil", "key": None, "user": "x", "uid": 1,
            "prio": 0, "kind": "cpu", "indices": None, "want": {"count": 1, "ids": None},
            "pool": ["cpu-0"], "t": 0, "pid": 1, "start": None, "boot": claims._BOOT,
            "bell": "\0gpu_lab-claims-" + "0" * 32}
    hostile = {  # file name -> content; each one this user's own file
        "not-json": "not json\n",
        "escape": json.dumps({**good, "pool": ["../escaped"]}) + "\n",
        "bell": json.dumps({**good, "ticket": "2" * 32, "bell": "/run/some.sock"}) + "\n",
        "hold-first": json.dumps({"op": "hold", "ticket": "3" * 32, "devices": []}) + "\n",
    }
    for i, text in enumerate(hostile.values()):
        (folder / f"ticket-{me}-{i:032x}.json").write_text(text)
    # a file named as another user's ticket (made by this one), and one that is a link
    (folder / f"ticket-{me + 1}-{'a' * 32}.json").write_text(json.dumps(good) + "\n")
    os.symlink("/etc/passwd", folder / f"ticket-{me}-{'b' * 32}.json")
    assert queue_stats() == {"bad_lines": 4, "foreign_files": 2, "dead_tickets": 0}
    with wait_for_devices(2, "fine") as claim:
        assert [d.index for d in claim.devices] == [0, 1]
    assert not (tmp_path / "escaped.lock").exists()
    assert sorted(f.name for f in folder.glob("*.lock")) == ["cpu-0.lock", "cpu-1.lock"]


def test_a_dead_claimant_s_forged_hold_frees_nothing_and_its_file_is_tidied(host):
    """A ticket file that says it holds both slots, for a claimant that is gone: ignored, and
    the next claim of its user removes it."""
    folder = claims.claims_folder()
    me = os.geteuid()
    dead = {"op": "enter", "ticket": "4" * 32, "run": "ghost", "key": None, "prio": 0,
            "kind": "cpu", "indices": None, "want": {"count": 2, "ids": None},
            "pool": ["cpu-0", "cpu-1"], "t": 0, "pid": 2 ** 22 + 7, "start": 1,
            "boot": claims._BOOT, "bell": "\0gpu_lab-claims-" + "5" * 32}
    hold = {"op": "hold", "devices": [{"id": "cpu-0", "kind": "cpu", "index": 0, "uuid": None},
                                      {"id": "cpu-1", "kind": "cpu", "index": 1, "uuid": None}]}
    ghost = folder / f"ticket-{me}-{'4' * 32}.json"
    ghost.write_text(json.dumps(dead) + "\n" + json.dumps(hold) + "\n")
    with wait_for_devices(2, "real") as claim:
        assert claim.held and not ghost.exists()


@pytest.fixture
def two_users():
    """Two throwaway Unix users (root creates them; userdel after)."""
    if os.geteuid() != 0:
        pytest.skip("creating throwaway Unix users needs root (useradd); run as root to check "
                    "claims between two users")
    names = [f"gl{uuid.uuid4().hex[:8]}" for _ in range(2)]
    made = []
    try:
        for n in names:
            r = subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", n],
                               capture_output=True, text=True)
            if r.returncode != 0:
                pytest.skip(f"useradd is not allowed here: {r.stderr.strip()}")
            made.append(n)
        yield names
    finally:
        for n in made:
            subprocess.run(["userdel", n], capture_output=True)


def python_for(user: str, env: dict[str, str]) -> str:
    """An interpreter that `user` may run and that imports the claims module (this session's may
    live in a home only its owner can enter; the claims need nothing outside the stdlib)."""
    tried = []
    for py in dict.fromkeys([sys.executable, shutil.which("python3") or "", "/usr/bin/python3"]):
        if not py:
            continue
        try:
            r = subprocess.run([py, "-c", "import gpu_lab.supervise.claims"], env=env, user=user,
                               capture_output=True, text=True, cwd="/", timeout=T)
        except OSError as e:
            tried.append(f"{py}: {e}")
            continue
        if r.returncode == 0:
            return py
        tried.append(f"{py}: {r.stderr.strip().splitlines()[-1:]}")
    pytest.skip(f"no Python that user {user} may run imports gpu_lab here: {'; '.join(tried)}")


def test_two_users_share_one_queue(two_users, monkeypatch):
    alice, bob = two_users
    base = Path(tempfile.mkdtemp(prefix="gpu_lab-claimtest-", dir="/tmp"))
    os.chmod(base, 0o1777)  # a /tmp of its own: the users' workers write their events here
    folder = base / "claims"
    monkeypatch.setenv("GPU_LAB_CLAIMS_DIR", str(folder))
    env = dict(os.environ, PYTHONPATH=str(ROOT), GPU_LAB_CPU_SLOTS="2")
    w = Workers(base, env)
    try:
        py = python_for(alice, env)
        w.start("alice-run", 2, user=alice, python=py, umask=0o077)
        w.first("alice-run", "start")
        w.start("bob-run", 2, user=bob, python=py, umask=0o077)
        wait_until(lambda: queued("bob-run"), T, what="bob's run queued")
        rows = {r.run_id: r for r in host_queue()}
        assert (rows["alice-run"].user, rows["alice-run"].state) == (alice, "holding")
        assert (rows["bob-run"].user, rows["bob-run"].state, rows["bob-run"].position) == \
            (bob, "waiting", 1)
        ended = w.release("alice-run")
        assert w.first("bob-run", "start")["t"] >= ended
        w.release("bob-run")
        w.wait_all()
        owner = {f.name: pwd.getpwuid(f.stat().st_uid).pw_name for f in folder.iterdir()}
        assert owner == {"cpu-0.lock": alice, "cpu-1.lock": alice}  # the tickets left
        assert pwd.getpwuid(folder.stat().st_uid).pw_name == alice
        assert oct(folder.stat().st_mode & 0o7777) == oct(0o1777)
    finally:
        w.kill_all()
        shutil.rmtree(base, ignore_errors=True)


def test_a_folder_another_user_locked_down_is_refused(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to make a folder that belongs to another user")
    folder = tmp_path / "claims"
    folder.mkdir(mode=0o755)
    os.chown(folder, 65534, 65534)  # nobody
    with pytest.raises(RuntimeError, match="chmod 1777"):
        claims.claims_folder(folder)


def test_admin_init_host_makes_a_folder_no_user_can_take_over(tmp_path, monkeypatch):
    if os.geteuid() != 0:
        pytest.skip("gpu-lab admin init-host needs root")
    folder = tmp_path / "var" / "claims"
    r = subprocess.run([sys.executable, "-m", "gpu_lab.cli", "admin", "init-host", "--path",
                        str(folder)], capture_output=True, text=True, env=dict(
                            os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode == 0, r.stderr
    assert "no user can change, move or remove another user's tickets or locks" in r.stdout
    st = folder.stat()
    assert (st.st_uid, oct(st.st_mode & 0o7777)) == (0, oct(0o1777))
    assert claims.protection(folder)["protected"] is True
    # a folder a user made: doctor says what that user could do
    theirs = tmp_path / "theirs"
    claims.claims_folder(theirs)
    os.chown(theirs, 65534, 65534)
    said = claims.protection(theirs)
    assert said["protected"] is False and "can remove other users' tickets" in said["says"]
    assert "sudo gpu-lab admin init-host" in said["says"]
    monkeypatch.setenv("GPU_LAB_CLAIMS_DIR", str(theirs))
    from gpu_lab.diagnostics.doctor import doctor

    report = doctor()
    assert report.host["host_queue"]["folder"] == str(theirs)
    assert [w.message for w in report.warnings_about("host queue")] == [said["says"]]
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(PermissionError, match="must run as root"):
        claims.init_host(tmp_path / "nope")
