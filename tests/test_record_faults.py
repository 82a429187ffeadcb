"""The record survives its own faults: GPU_LAB_HOME on a small real file system (a tmpfs the test
mounts) that a 2-rank run outgrows; a quota refused by the storage layer; the recorder process
SIGKILLed mid-run. The training goes on to its end, the run ends for its own reasons, the user is
told why (runs(), the run view, the notice), and what was not written is counted."""
from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

import gpu_lab
from gpu_lab.launch import RunFailedError
from gpu_lab.record import notify, storage
from gpu_lab.record.recorder import Recorder
from gpu_lab.record.registry import Registry
from gpu_lab.server.runview import detail

from proc_utils import wait_until

pytestmark = pytest.mark.slow  # starts processes (ranks, kernels, servers) or runs for seconds

STEPS = 3000


def train_reporting(steps: int, out: str, pace: float = 0.002) -> int:
    """Five metrics a step; each rank notes (step, time) every 100 steps in `out` (off the small
    disk), and its last step."""
    import gpu_lab as g

    rank = int(os.environ.get("RANK", "0"))
    with open(f"{out}/rank{rank}.txt", "a") as f:
        for s in range(steps):
            g.report(s, loss=1.0 / (s + 1), a=1.0, b=2.0, c=3.0, d=4.0)
            if s % 100 == 0 or s == steps - 1:
                f.write(f"{s} {time.time()}\n")
                f.flush()
            time.sleep(pace)  # a training step's pace
    return steps


@pytest.fixture
def small_disk(tmp_path):
    """A real, small file system for GPU_LAB_HOME (unmounted after)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m,mode=0700", "tmpfs", str(disk)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small file system here ({r.stderr.strip()}); mounting needs "
                    "root (or CAP_SYS_ADMIN)")
    try:
        yield disk
    finally:
        if subprocess.run(["umount", str(disk)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def _fill(disk: Path) -> Path | None:
    """Fill the disk with a file of the test's own; None when it is full already (then what
    fills it is named, for the test that needs the filler to free space). Unbuffered: a buffered
    file would hold back what did not fit and raise again when closed."""
    filler = disk / "filler"
    try:
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    except OSError:
        return None
    chunk = b"\0" * (1 << 16)
    try:
        while True:
            os.write(fd, chunk)
    except OSError:  # ENOSPC: full
        pass
    finally:
        os.close(fd)
    return filler


def _contents(disk: Path) -> list[tuple[int, str]]:
    return sorted(((p.stat().st_size, str(p)) for p in disk.rglob("*") if p.is_file()),
                  reverse=True)[:10]


def _progress(out: Path, rank: int) -> list[tuple[int, float]]:
    p = out / f"rank{rank}.txt"
    if not p.exists():
        return []
    return [(int(a), float(b)) for a, b in (ln.split() for ln in p.read_text().splitlines())]


def _tmp_files(root: Path) -> list[str]:
    return [str(p) for p in root.rglob("*") if p.name.endswith(".tmp")]


@pytest.mark.parametrize("freed", [True, False], ids=["space freed mid-run", "full to the end"])
def test_a_full_disk_pauses_the_record_and_the_training_goes_on(small_disk, tmp_path, monkeypatch,
                                                                freed):
    home, out = small_disk / "home", tmp_path / "out"
    out.mkdir()
    monkeypatch.setenv("GPU_LAB_HOME", str(home))
    monkeypatch.setenv("GPU_LAB_RECORD_BUFFER", "1000")  # a small buffer: drops, counted
    run = gpu_lab.launch(train_reporting, STEPS, str(out), num_processes=2, name="outgrows")
    assert run.wait_for_step(20, timeout=120), run.status
    filler = _fill(small_disk)
    wait_until(lambda: (run.note or "").startswith("the record is paused"), 30,
               what="the run's note that its record paused")
    paused_note = run.note
    assert f"the disk holding {home} is full" in paused_note and "free)" in paused_note
    assert run.status == "running"
    t_free = None
    if freed:
        assert filler is not None, ("the disk was full before the test filled it", _contents(
            small_disk))
        wait_until(lambda: (_progress(out, 0) or [(0, 0)])[-1][0] >= STEPS // 2, 120,
                   what="the ranks half way")
        filler.unlink()
        t_free = time.time()
    assert run.wait(300) == "succeeded", (run.status, run.error)
    for rank in (0, 1):  # the training ran to its last step
        assert _progress(out, rank)[-1][0] == STEPS - 1

    reg = Registry()
    row = reg.get_run(run.id)
    note = row["note"]
    assert note.startswith("the record was paused for ") and f"the disk holding {home}" in note
    lost = int(note.split("; ")[1].split(" events were not written")[0])
    have = {r: [m["step"] for m in reg.metrics(run.id, "loss", rank=r)] for r in (0, 1)}
    missing = sum(STEPS - len(v) for v in have.values())  # metric points (a report each)
    (dropped,) = reg.events(run.id, kinds=["dropped"])
    data = dropped["data"]
    assert data["kinds"]["metric"] == missing > 0, (data, missing)
    assert data["count"] == lost == sum(data["kinds"].values()) == sum(data["ranks"].values())
    assert data["why"] == {"record paused": lost}
    if freed:  # writing resumed: everything reported from a second after the space came back
        for rank in (0, 1):
            after = [s for s, t in _progress(out, rank) if t > t_free + storage_retry() + 1.0]
            assert after and set(range(after[0], STEPS)) <= set(have[rank]), rank
        assert gpu_lab.attach(run.id).result() == STEPS
    else:  # the end and its note were written in the space the reserve gave back
        with pytest.raises(RunFailedError, match="could not be written there"):
            run.result()
    # where the user looks: runs(), the run view, the end notice; never SQLite's words alone
    assert note in str(gpu_lab.runs(name="outgrows"))
    assert detail(reg, run.id)["note"] == note
    assert note in notify.compose(row)[1]
    assert "database or disk is full" not in note
    assert not _tmp_files(home), _tmp_files(home)
    assert not list(home.glob("reserve/*"))  # the reserve went with its recorder


def storage_retry() -> float:
    from gpu_lab.record.recorder import RETRY_S

    return RETRY_S


class QuotaRegistry(Registry):
    """The storage layer answers as an exhausted quota does, until `quota` is lifted."""

    quota = True

    def add_events(self, run_id, events, **kw):
        if self.quota:
            raise OSError(errno.EDQUOT, "Disk quota exceeded")
        return super().add_events(run_id, events, **kw)


def test_a_quota_pauses_the_record_the_same_way(tmp_path):
    reg = QuotaRegistry(tmp_path / "registry.db")
    reg.create_run("q1", name="quota", status="running")
    rec = Recorder(reg, "q1", publish=False, private=False, max_pending=1000, reserve=True)
    try:
        rec.record([{"run": "q1", "rank": 0, "kind": "metric", "t": time.time(), "step": s,
                     "data": {"loss": 1.0}} for s in range(10)])
        wait_until(lambda: (Registry(reg.path).get_run("q1")["note"] or "").startswith(
            "the record is paused"), 10, what="the quota's note")
        said = Registry(reg.path).get_run("q1")["note"]
        assert f"the disk quota for {tmp_path} is used up" in said and "Disk quota" not in said
        assert not (tmp_path / "reserve" / "q1").exists()  # given back for the note and the end
        reg.quota = False
        wait_until(lambda: rec.storage is None and rec.written == 10, 10, what="writing again")
        assert [m["step"] for m in reg.metrics("q1", "loss", rank=0)] == list(range(10))
        assert Registry(reg.path).get_run("q1")["note"].startswith("the record was paused for ")
        assert (tmp_path / "reserve" / "q1").stat().st_size == storage.RESERVE_BYTES
    finally:
        rec.close()
    assert not (tmp_path / "reserve" / "q1").exists()


def test_a_killed_recorder_is_replaced_and_what_it_lost_is_counted_by_rank(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    steps = 1500
    run = gpu_lab.launch(train_reporting, steps, str(out), 0.005, num_processes=2)
    assert run.wait_for_step(100, timeout=120), run.status
    (recorder,) = [c for c in psutil.Process(run.pid).children()
                   if "gpu_lab.record.recorder" in " ".join(c.cmdline())]
    recorder.send_signal(signal.SIGKILL)  # as the OOM killer would
    assert run.wait(300) == "succeeded", (run.status, run.error)
    reg = Registry()
    replaced = [e for e in reg.events(run.id, kinds=["log"]) if "was replaced in" in
                e["data"]["text"]]
    assert len(replaced) == 1, reg.events(run.id, kinds=["log"])
    have = {r: {m["step"] for m in reg.metrics(run.id, "loss", rank=r)} for r in (0, 1)}
    missing = {r: set(range(steps)) - have[r] for r in (0, 1)}
    for rank in (0, 1):  # every report made after the new recorder listened is in the record
        after = [s for s, t in _progress(out, rank) if t > replaced[0]["t"] + 0.5]
        assert after and not {s for s in missing[rank] if s >= after[0]}, rank
    counted = {int(r): n for e in reg.events(run.id, kinds=["dropped"])
               for r, n in e["data"].get("ranks", {}).items()}
    assert counted == {r: len(m) for r, m in missing.items() if m}, (counted, missing)
    note = reg.get_run(run.id)["note"]
    assert "its recorder was replaced 1 time(s)" in note or "never reached the record" in note
    assert json.loads(json.dumps(note))  # a plain text, shown as it is


def test_a_run_on_a_full_disk_can_still_be_stopped(small_disk, tmp_path, monkeypatch):
    """The run folder (logs, control, result) is on the full disk too: a stop still works, and
    what the ranks printed that the disk refused is counted in the record."""
    home, out = small_disk / "home", tmp_path / "out"
    out.mkdir()
    monkeypatch.setenv("GPU_LAB_HOME", str(home))
    run = gpu_lab.launch(train_reporting, 10 ** 6, str(out), 0.01, num_processes=2)
    assert run.wait_for_step(5, timeout=120), run.status
    _fill(small_disk)
    wait_until(lambda: (run.note or "").startswith("the record is paused"), 30,
               what="the record paused")
    assert run.stop() == "stopped", (run.status, run.error)
    assert run.reason == "stopped by the user"
    assert Registry().get_run(run.id)["status"] == "stopped"
    assert not _tmp_files(home), _tmp_files(home)


def test_a_print_on_a_full_disk_is_counted_not_raised(small_disk):
    """What a rank's stdout becomes (storage.LogStream): the disk refuses, the print goes on."""
    log = small_disk / "rank0.log"
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        _fill(small_disk)
        storage.LogStream.reset()
        stream = storage.LogStream(fd)
        print("step 1 loss 0.5" * 1000, file=stream)  # would raise OSError(ENOSPC) on a file
        stream.buffer.write(b"x" * 5000)
        assert storage.lost_bytes() >= 15 * 1000 + 5000
    finally:
        os.close(fd)
