"""Many runs on one host: each claims its CPU slots (GPUs on a GPU host), waits its turn in the
host's queue as `queued`, and starts when they free. Real launches from real processes (a script
is the kernel), real locks, two real Unix users; 2 slots, as on the CI machine."""
from __future__ import annotations

import json
import os
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
import pandas as pd
rows = [[n, s, None if pd.isna(p) else int(p)]
        for n, s, p in table[["name", "state", "position"]].values.tolist()]
print(json.dumps({"table": rows,
                  "position": run.queue_position, "cancel": run.cancel(), "id": run.id}))
'''
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    refused, got = (json.loads(line) for line in out.stdout.strip().splitlines())
    assert holder in refused["refused"]  # it names the run that holds the slots
    assert got["table"] == [["holder", "holding", None], ["patient", "waiting", 1]]
    assert got["position"] == 1 and got["cancel"] == "stopped"
    assert "withdrawn from the queue" in _row(reg, got["id"])["reason"]
    assert "running" not in _statuses(reg, got["id"])
    go.write_text("")
    wait_until(lambda: _row(reg, holder).get("status") == "succeeded", 60, what="holder ends")
    h.kill()


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
        go.write_text("")
        os.chown(go, other.uid, other.gid)
        assert json.loads(second.stdout.readline()) == ["succeeded"]
        assert json.loads(first.stdout.readline()) == ["succeeded"]
        a, b = _row(their_reg, theirs), _row(my_reg, mine)
        assert a["ended"] <= b["started"]
        first.wait(30), second.wait(30)
    finally:
        shutil.rmtree(claims, ignore_errors=True)
