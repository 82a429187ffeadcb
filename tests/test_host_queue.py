"""Many runs on one host: each claims its CPU slots (GPUs on a GPU host), waits its turn in the
host's queue as `queued`, and starts when they free. Real launches from real processes (a script
is the kernel), real locks, two real Unix users; 2 slots, as on the CI machine."""
from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from proc_utils import wait_until
from test_record_private import User, users  # noqa: F401 - the fixture: two throwaway users

from gpu_lab.record import events as ev
from gpu_lab.record.registry import Registry

pytestmark = pytest.mark.slow  # starts processes (ranks, kernels, servers) or runs for seconds

ROOT = Path(__file__).resolve().parents[1]

# a kernel: launches runs, prints their ids, then waits for them (or blocks until killed)
KERNEL = r'''
import json, sys, time
import gpu_lab
from queue_fns import hold_until, quick
plan = json.loads(sys.argv[1])
runs = []
for p in plan:
    fn, args = (hold_until, (p["go"],)) if p.get("go") else (quick, ())
    runs.append(gpu_lab.launch(fn, *args, num_processes=2, name=p["name"],
                               priority=p.get("priority", 0), detach=p.get("detach", False)))
print(json.dumps([r.id for r in runs]), flush=True)
if "--block" in sys.argv:
    time.sleep(3600)  # killed by the test: a kernel that dies
for r in runs:
    r.wait(300)
print(json.dumps([r.status for r in runs]), flush=True)
'''


@pytest.fixture
def host(tmp_path):
    """A host with 2 CPU slots and its own claims folder; (env, registry)."""
    home = tmp_path / "home"
    env = {**os.environ, "GPU_LAB_HOME": str(home), "GPU_LAB_CPU_SLOTS": "2",
           "GPU_LAB_CLAIMS_DIR": str(tmp_path / "claims"),
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    return env, lambda: Registry(home / "registry.db")


def _kernel(env: dict, plan: list[dict], *extra: str) -> tuple[subprocess.Popen, list[str]]:
    p = subprocess.Popen([sys.executable, "-c", KERNEL, json.dumps(plan), *extra], env=env,
                         stdout=subprocess.PIPE, text=True)
    return p, json.loads(p.stdout.readline())


def _statuses(reg: Registry, run_id: str) -> list[str]:
    return [e["data"].get("status") for e in reg.events(run_id, kinds=[ev.STATUS])]


def _row(reg: Registry, run_id: str) -> dict:
    return reg.get_run(run_id) or {}


def test_four_runs_on_two_slots_run_one_at_a_time_by_priority_then_launch(host):
    env, registry = host
    plan = [{"name": f"q{i}", "priority": p} for i, p in enumerate([0, 0, 5, 0])]
    p, ids = _kernel(env, plan)
    assert json.loads(p.stdout.readline()) == ["succeeded"] * 4
    assert p.wait(30) == 0
    reg = registry()
    rows = sorted((_row(reg, i) for i in ids), key=lambda r: r["started"])
    # the first finds the host free; then priority 5, then the order of launch
    assert [r["name"] for r in rows] == ["q0", "q2", "q1", "q3"]
    for a, b in zip(rows, rows[1:]):
        assert a["ended"] <= b["started"], f"{a['name']} and {b['name']} overlap"
    for r in rows[1:]:
        st = _statuses(reg, r["id"])
        assert st.index("queued") < st.index("running"), st
        assert r["queue_position"] is None
    assert "queued" not in _statuses(reg, rows[0]["id"])
    assert [r["priority"] for r in rows] == [0, 5, 0, 0]
    for r in rows:
        assert [d["index"] for d in r["devices"]["devices"]] == [0, 1]
        assert r["devices"]["kind"] == "cpu"


def test_killed_supervisor_frees_its_slots_and_the_next_run_starts(host, tmp_path):
    env, registry = host
    go = str(tmp_path / "never")
    p, (holder, waiter) = _kernel(env, [{"name": "holder", "go": go, "detach": True},
                                        {"name": "next"}])
    reg = registry()
    wait_until(lambda: _row(reg, waiter).get("status") == "queued", 60, what="next queued")
    # the holder has its slots before its row says running (its recorder starts meanwhile)
    wait_until(lambda: _row(reg, holder).get("status") == "running", 60, what="holder running")
    killed = time.monotonic()
    os.kill(_row(reg, holder)["pid"], signal.SIGKILL)
    wait_until(lambda: "running" in _statuses(reg, waiter), 5, what="next started")
    assert time.monotonic() - killed < 5
    assert json.loads(p.stdout.readline())[1] == "succeeded"
    p.wait(30)


def test_a_queued_run_is_withdrawn_with_its_kernel_unless_detached(host, tmp_path):
    env, registry = host
    go = tmp_path / "go"
    h, (holder,) = _kernel(env, [{"name": "holder", "go": str(go), "detach": True}])
    reg = registry()
    wait_until(lambda: _row(reg, holder).get("status") == "running", 60, what="holder running")
    k1, (attached,) = _kernel(env, [{"name": "attached"}], "--block")
    k2, (detached,) = _kernel(env, [{"name": "detached", "detach": True}], "--block")
    wait_until(lambda: _row(reg, attached).get("status") == "queued"
               and _row(reg, detached).get("status") == "queued", 60, what="both queued")
    k1.kill()
    k2.kill()
    k1.wait(10), k2.wait(10)
    wait_until(lambda: _row(reg, attached).get("status") == "stopped", 30, what="withdrawn")
    assert "withdrawn from the queue" in _row(reg, attached)["reason"]
    go.write_text("")
    wait_until(lambda: _row(reg, detached).get("status") == "succeeded", 120,
               what="the detached run's turn")
    assert "running" not in _statuses(reg, attached)
    assert _row(reg, attached)["devices"] is None
    h.kill()


def test_queue_table_cancel_and_queue_false(host, tmp_path):
    env, registry = host
    go = tmp_path / "go"
    h, (holder,) = _kernel(env, [{"name": "holder", "go": str(go), "detach": True}])
    reg = registry()
    wait_until(lambda: _row(reg, holder).get("status") == "running", 60, what="holder running")
    code = r'''
import json, sys
import gpu_lab
from gpu_lab.supervise.claims import DevicesBusy
from queue_fns import quick
try:
    gpu_lab.launch(quick, num_processes=2, name="impatient", queue=False)
    print(json.dumps({"refused": None}))
except DevicesBusy as e:
    print(json.dumps({"refused": str(e)}))
run = gpu_lab.launch(quick, num_processes=2, name="patient")
table = gpu_lab.queue()  # launch() has returned: the run has its place in the queue
while run.status != "queued":
    run.wait(0.05)
rows = table[["name", "state", "position", "waiting_s"]].values.tolist()
print(json.dumps({"table": rows, "shown": table.to_string(),
                  "position": run.queue_position, "cancel": run.cancel(), "id": run.id}))
'''
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    refused, got = (json.loads(line) for line in out.stdout.strip().splitlines())
    assert holder in refused["refused"]  # it names the run that holds the slots
    (holding, waiting) = got["table"]
    assert holding == ["holder", "holding", "", ""] and waiting[:3] == ["patient", "waiting", 1]
    assert isinstance(waiting[3], float) and waiting[3] >= 0
    assert not re.search(r"\bNone\b|\bNaN\b|<NA>", got["shown"]), got["shown"]  # blanks
    assert got["position"] == 1 and got["cancel"] == "stopped"
    assert "withdrawn from the queue" in _row(reg, got["id"])["reason"]
    assert "running" not in _statuses(reg, got["id"])
    go.write_text("")
    wait_until(lambda: _row(reg, holder).get("status") == "succeeded", 60, what="holder ends")
    h.kill()


# what the lab's side panel lists (gpu_lab.server.state), read as the user whose lab it is
PANEL = r'''
import json, sys
from gpu_lab.server.state import ServerState
state = ServerState(root_dir=sys.argv[1])
try:
    runs = state.runs_and_sweeps()["runs"]
finally:
    state.executor.shutdown(wait=False)
print(json.dumps([[r["name"], r["status"], r["queue_position"], r.get("held_by")] for r in runs]))
'''


def test_another_users_run_holds_the_slots_and_this_users_waits(users, tmp_path):  # noqa: F811
    owner, other = users
    claims = Path(f"/tmp/gpu_lab-claims-test-{secrets.token_hex(3)}")  # reachable by both
    try:
        envs = {}
        for u in (owner, other):
            envs[u.name] = {**u.env(u.home / "gpu_lab"), "GPU_LAB_CPU_SLOTS": "2",
                            "GPU_LAB_CLAIMS_DIR": str(claims)}
        go = other.home / "go"
        first = other.popen([sys.executable, "-c", KERNEL, json.dumps(
            [{"name": "theirs", "go": str(go)}])], envs[other.name], stdout=subprocess.PIPE,
            text=True)
        (theirs,) = json.loads(first.stdout.readline())
        their_reg = Registry(other.home / "gpu_lab" / "registry.db")
        wait_until(lambda: _row(their_reg, theirs).get("status") == "running", 60,
                   what="their run running")
        second = owner.popen([sys.executable, "-c", KERNEL, json.dumps([{"name": "mine"}])],
                             envs[owner.name], stdout=subprocess.PIPE, text=True)
        (mine,) = json.loads(second.stdout.readline())
        my_reg = Registry(owner.home / "gpu_lab" / "registry.db")
        wait_until(lambda: _row(my_reg, mine).get("status") == "queued", 60, what="mine queued")
        probe = "import sys\ntry:\n open(sys.argv[1],'rb').read(1); print('read')\n" \
                "except OSError as e: print(type(e).__name__)"
        for u, path in ((owner, their_reg.path), (other, my_reg.path)):
            r = u.run([sys.executable, "-c", probe, str(path)], envs[u.name])
            assert r.stdout.strip() == "PermissionError", (u.name, r.stdout, r.stderr)
        assert _row(my_reg, mine)["status"] == "queued"
        # the side panel's list says who holds the slots mine waits for: a user, not their run
        r = owner.run([sys.executable, "-c", PANEL, str(owner.home)], envs[owner.name])
        assert json.loads(r.stdout) == [["mine", "queued", 1, [other.name]]], r.stderr
        go.write_text("")
        os.chown(go, other.uid, other.gid)
        assert json.loads(second.stdout.readline()) == ["succeeded"]
        assert json.loads(first.stdout.readline()) == ["succeeded"]
        a, b = _row(their_reg, theirs), _row(my_reg, mine)
        assert a["ended"] <= b["started"]
        first.wait(30), second.wait(30)
    finally:
        shutil.rmtree(claims, ignore_errors=True)


# what another user tries against the queue, from their own account (tests/test_host_queue.py):
# every file of the owner's in the claims folder, then their own forgeries
ATTACK = r'''
import json, os, sys
folder, owner = sys.argv[1], int(sys.argv[2])
me = os.getuid()
said = {}
def attempt(what, fn):
    try:
        fn()
        said[what] = "done"
    except OSError as e:
        said[what] = type(e).__name__
for name in sorted(os.listdir(folder)):  # the owner's tickets, and every lock file
    path = os.path.join(folder, name)
    kind = "ticket" if name.startswith("ticket-") else "lock" if name.endswith(".lock") else name
    if kind != "lock" and os.lstat(path).st_uid != owner:
        continue
    attempt(f"truncate {kind}", lambda: open(path, "r+").truncate(0))
    attempt(f"forge {kind}", lambda: open(path, "a").write('{"op":"hold","devices":[]}\n'))
    attempt(f"rename {kind}", lambda: os.rename(path, path + ".moved"))
    if said[f"rename {kind}"] == "done":
        os.rename(path + ".moved", path)
    attempt(f"delete {kind}", lambda: os.unlink(path))
    if said[f"delete {kind}"] == "done" and kind == "lock":  # then make one of one's own
        open(path, "w").close()
# one's own files: garbage, a forged hold of every slot, a ticket named after the owner
open(os.path.join(folder, f"ticket-{me}-{'e' * 32}.json"), "w").write("garbage\n")
enter = {"op": "enter", "ticket": "f" * 32, "run": "forged", "key": None, "prio": 99,
         "kind": "cpu", "indices": None, "want": {"count": 2, "ids": None},
         "pool": ["cpu-0", "cpu-1"], "t": 0, "pid": os.getpid(), "start": None,
         "boot": open("/proc/sys/kernel/random/boot_id").read().strip(),
         "bell": "\0gpu_lab-claims-" + "f" * 32}
hold = {"op": "hold", "devices": [{"id": f"cpu-{i}", "kind": "cpu", "index": i, "uuid": None}
                                  for i in (0, 1)], "bypassed": []}
open(os.path.join(folder, f"ticket-{me}-{'d' * 32}.json"), "w").write(
    json.dumps(enter) + "\n" + json.dumps(hold) + "\n")
open(os.path.join(folder, f"ticket-{owner}-{'c' * 32}.json"), "w").write(json.dumps(enter) + "\n")
attempt("truncate queue", lambda: open(os.path.join(folder, "queue"), "w").close())
print(json.dumps(said))
'''


@pytest.mark.parametrize("setup", ["made by the owner's runs", "made by an administrator",
                                   "made by the other user"])
def test_another_user_cannot_break_the_queue(users, setup):  # noqa: F811
    """A second Unix user attacks the claims folder while the owner has a run holding both slots
    and one waiting: what the design forbids the system refuses; what it allows (the folder's
    owner may remove files in it) is repaired. Both runs succeed, in order, never overlapping;
    a lock file removed while held (as a cleaner would) lets no third run in."""
    from gpu_lab.supervise import claims

    owner, other = users
    folder = Path(f"/tmp/gpu_lab-claims-test-{secrets.token_hex(3)}")
    try:
        if setup == "made by an administrator":
            claims.init_host(folder)
        elif setup == "made by the other user":  # it made the folder and the lock files first
            r = other.run([sys.executable, "-c", "import os, sys; os.mkdir(sys.argv[1]); "
                           "os.chmod(sys.argv[1], 0o1777); [open(f'{sys.argv[1]}/cpu-{i}.lock',"
                           " 'w').close() for i in (0, 1)]; [os.chmod(f'{sys.argv[1]}/cpu-{i}.lock'"
                           ", 0o666) for i in (0, 1)]", str(folder)], other.env(other.home))
            assert r.returncode == 0, r.stderr
        env = {**owner.env(owner.home / "gpu_lab"), "GPU_LAB_CPU_SLOTS": "2",
               "GPU_LAB_CLAIMS_DIR": str(folder)}
        go = owner.home / "go"
        kernel = owner.popen([sys.executable, "-c", KERNEL, json.dumps(
            [{"name": "first", "go": str(go)}, {"name": "second"}])], env,
            stdout=subprocess.PIPE, text=True)
        first, second = json.loads(kernel.stdout.readline())
        reg = Registry(owner.home / "gpu_lab" / "registry.db")
        wait_until(lambda: _row(reg, first).get("status") == "running", 60, what="first running")
        wait_until(lambda: _row(reg, second).get("status") == "queued", 60, what="second queued")

        r = other.run([sys.executable, "-c", ATTACK, str(folder), str(owner.uid)],
                      other.env(other.home))
        assert r.returncode == 0, r.stderr
        said = json.loads(r.stdout)
        if setup == "made by the other user":  # the folder's owner may remove files in it
            assert said["delete lock"] == "done" and said["delete ticket"] == "done", said
            # the owner's claimants write their tickets and relock within a second
            wait_until(lambda: len(list(folder.glob(f"ticket-{owner.uid}-*.json"))) >= 2, 10,
                       what="the owner's tickets written again")
        else:
            assert set(said) >= {f"{verb} {kind}" for verb in ("truncate", "forge", "rename",
                                                               "delete")
                                 for kind in ("ticket", "lock")}, said
            refused = {k: v for k, v in said.items() if k != "truncate queue"}
            assert set(refused.values()) == {"PermissionError"}, said
        assert _row(reg, second).get("status") == "queued"

        # a cleaner (root) removes the held lock files: a third run still waits its turn
        for lock in folder.glob("cpu-*.lock"):
            lock.unlink()
        third = owner.popen([sys.executable, "-c", KERNEL, json.dumps([{"name": "third"}])],
                            env, stdout=subprocess.PIPE, text=True)
        (third_id,) = json.loads(third.stdout.readline())
        wait_until(lambda: _row(reg, third_id).get("status") == "queued", 60,
                   what="the third run queued")
        wait_until(lambda: len(list(folder.glob("cpu-*.lock"))) == 2, 10,
                   what="the holder's lock files made again")
        assert _row(reg, first).get("status") == "running"

        go.write_text("")
        os.chown(go, owner.uid, owner.gid)
        assert json.loads(kernel.stdout.readline()) == ["succeeded", "succeeded"]
        assert json.loads(third.stdout.readline()) == ["succeeded"]
        kernel.wait(30), third.wait(30)
        rows = sorted((_row(reg, i) for i in (first, second, third_id)),
                      key=lambda x: x["started"])
        assert [x["name"] for x in rows][0] == "first"
        for a, b in zip(rows, rows[1:]):
            assert a["ended"] <= b["started"], f"{a['name']} and {b['name']} overlap"
        said = claims.protection(folder)
        assert said["protected"] is (setup == "made by an administrator"), said
    finally:
        shutil.rmtree(folder, ignore_errors=True)
