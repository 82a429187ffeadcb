"""The follower of a registry's Slurm jobs: `python -m gpu_lab.cluster.follow <registry>`.

It hosts each active job's recorder (gpu_lab.cluster.relay): the job reports to it over the
run's channel and says its own status changes, which become the row's. What happens to a job
before it runs, or without its word, only Slurm knows: a pending job's reason, a job cancelled
while pending, a node that failed, a job killed at its limit or for memory, a requeue. So the
follower also asks Slurm about every active job in one squeue call every GPU_LAB_SLURM_POLL_S
seconds (default 5), or sooner when a job said something, and writes what it learns, through
gpu_lab.cluster.states' table:

- a pending job: `queued`, with Slurm's reason in words;
- a job Slurm requeued after it ran (a later attempt is pending): `queued` again;
- a job Slurm ended that did not record its own end (one more look to let it): the table's end;
- a job Slurm no longer knows (purged, accounting off): `lost`, after three looks.

The job's own word wins: the table decides an end only for a job that has not said one. The
follower is a fresh interpreter in a session of its own (it outlives the kernel that submitted;
SQLite wants fresh processes), holds `slurm-follow.lock` in GPU_LAB_HOME so there is one per
registry, and exits when no job is left to follow. gpu_lab.submit and attach start it (`ensure`).
"""
from __future__ import annotations

import fcntl
import json
import os
import queue
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ..access import open_private
from ..record import events as ev
from ..record.runfolder import RunFolder
from . import slurm, states
from .lost import lost_sentence, record_lost_ranks
from .relay import Relay

POLL_ENV = "GPU_LAB_SLURM_POLL_S"
LOCK = "slurm-follow.lock"
LOG = "slurm-follow.log"
ENDED_LOOKS = 2    # looks at a job Slurm ended, the row still active, before the table decides
UNKNOWN_LOOKS = 3  # looks at a job Slurm does not know before it is lost
SILENT_LOOKS = 12  # looks at a running job that has not written its start, before a hint
UNREACHABLE_S = 600  # seconds without an answer from Slurm before the follower gives up
WOKEN = "woken"  # what SIGUSR1 puts in the follower's news


def poll_seconds() -> float:
    raw = os.environ.get(POLL_ENV, "5")
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0.1 <= value <= 3600:
        raise ValueError(f"{POLL_ENV}={raw!r}; accepted: seconds between 0.1 and 3600")
    return value


class Follower:
    def __init__(self, registry: Any) -> None:
        self.registry = registry
        # run id -> consecutive looks at: an end the job has not recorded / a job Slurm does not
        # know / a running job that has not written its start
        self.ended: dict[str, int] = {}
        self.unknown: dict[str, int] = {}
        self.silent: dict[str, int] = {}
        self.cancelled: set[str] = set()  # runs whose stop the follower enforced
        self.relay = Relay(registry)

    def active(self) -> list[dict]:
        return [r for r in self.registry.list_runs(status=list(ev.ACTIVE_STATUSES))
                if isinstance(r.get("job"), dict) and r["job"].get("scheduler") == "slurm"]

    def look(self) -> int:
        """One look at every active job: its recorder, its own word, then Slurm's; returns how
        many are still active."""
        rows = []
        for row in self.active():
            self.relay.serve(row)
            row = self.relay.apply(row)
            # a job whose own end waits for its last reports: not Slurm's to decide
            if row["status"] in ev.ACTIVE_STATUSES and row["job"].get("id") and \
                    row["id"] not in self.relay.ending:
                rows.append(row)
        known = slurm.states(r["job"]["id"] for r in rows) if rows else {}
        for row in rows:
            self.reconcile(row, known.get(str(row["job"]["id"])))
        active = {r["id"] for r in self.active()}
        self.relay.retire(active)
        return len(active) + len(self.relay.recorders)

    def reconcile(self, row: dict, job: slurm.JobState | None) -> None:
        rid = row["id"]
        if job is None:
            if _count(self.unknown, rid) >= UNKNOWN_LOOKS:
                self._end(row, "lost", f"Slurm no longer knows job {row['job']['id']} (it ended "
                          "more than MinJobAge ago and accounting is off, or it was removed)")
            return
        self.unknown.pop(rid, None)
        self._note_job(row, job)
        status, reason = states.status_of(job.state, job.reason,
                                          stop_reason=_stop_reason(row))
        if status == "queued":
            attempt = row["job"].get("attempt")
            # a pending job that has run before is a requeue, unless the job has since started
            requeued = attempt is not None and job.restarts > attempt
            if row["status"] == "queued" and reason != row.get("reason") or \
                    row["status"] in ("running", "stopping") and requeued:
                self._say(row, "queued", reason)
        elif status == "running" and row["status"] == "stopping":
            self._enforce_stop(row)
        elif status == "running" and row["status"] == "queued":
            if _count(self.silent, rid) == SILENT_LOOKS:  # once
                log = RunFolder(row["run_dir"]).log_file(None)
                rec = self.relay.recorders.get(rid)
                self._say(row, "queued", f"Slurm runs job {job.job_id} on {job.nodes}, but the "
                          "job has not reported: the run folder must be on a file system the "
                          "nodes share, and the job's first node must reach "
                          f"{rec.address if rec else 'this host'} (GPU_LAB_RECORDER_HOST); see "
                          f"{log}")
        elif status in ev.FINAL_STATUSES:
            if _count(self.ended, rid) >= ENDED_LOOKS:  # the job writes its end before it exits
                if job.state.startswith("NODE_FAIL") and row.get("run_dir"):
                    # the node the job's supervisor ran on was lost with it: name it here
                    lost = record_lost_ranks(RunFolder(row["run_dir"]), job.nodes, int(
                        (row["job"].get("options") or {}).get("ranks_per_node") or 1))
                    reason = f"Slurm: NODE_FAIL: {lost_sentence(lost)}" if lost else reason
                self._end(row, status, reason)

    def _enforce_stop(self, row: dict) -> None:
        """A stop the ranks did not answer within its grace (a function that ignores SIGUSR1):
        Slurm cancels the job (SIGTERM, then SIGKILL)."""
        asked = RunFolder(row["run_dir"]).stop_requested_at() if row.get("run_dir") else None
        grace = float(row["job"].get("stop_grace") or 60.0)
        if asked is not None and time.time() - asked > grace and row["id"] not in self.cancelled:
            self.cancelled.add(row["id"])
            slurm.cancel(row["job"]["id"])
            print(f"{time.strftime('%H:%M:%S')} run {row['id']}: no checkpoint {grace:.0f} s "
                  f"after the stop; cancelled job {row['job']['id']}", flush=True)

    def _note_job(self, row: dict, job: slurm.JobState) -> None:
        """Slurm's view of the job, kept in the row (the side panel and Prometheus show it)."""
        now = dict(row["job"], **job.as_record())
        if now != row["job"]:
            self.registry.update(row["id"], job=now)

    def _say(self, row: dict, status: str, reason: str | None) -> None:
        self.registry.update(row["id"], status=status, reason=reason)
        self._event(row["id"], {"status": status, "reason": reason, "from": "slurm"})

    def _event(self, run_id: str, data: dict) -> None:
        """A status event, published live by the run's recorder where it has one."""
        e = ev.make(run_id, -1, ev.STATUS, data)
        if not self.relay.record(run_id, [e]):
            self.registry.add_events(run_id, [e])

    def _end(self, row: dict, status: str, reason: str | None) -> None:
        for looks in (self.ended, self.unknown, self.silent):
            looks.pop(row["id"], None)
        if self.registry.set_status(row["id"], status, reason=reason,
                                    error=reason if status in ("failed", "lost") else None):
            self._event(row["id"], {"status": status, "reason": reason, "from": "slurm"})
            print(f"{time.strftime('%H:%M:%S')} run {row['id']} (job {row['job'].get('id')}): "
                  f"{status}" + (f" ({reason})" if reason else ""), flush=True)


def _count(looks: dict[str, int], run_id: str) -> int:
    looks[run_id] = looks.get(run_id, 0) + 1
    return looks[run_id]


def _stop_reason(row: dict) -> str | None:
    return RunFolder(row["run_dir"]).stop_reason() if row.get("run_dir") else None


def follow(registry_path: str) -> int:
    """Follow until no job is left, if no other follower holds the registry's lock."""
    from ..record.registry import Registry

    registry = Registry(registry_path)
    follower = Follower(registry)
    # a submit wakes the follower (ensure): its new job's recorder listens before the job starts
    signal.signal(signal.SIGUSR1, lambda *_: follower.relay.news.put(WOKEN))
    lock = _lock(Path(registry.path).parent, holder=True)
    if lock is None:
        return 0  # another follower has it
    try:
        return _loop(follower, lock, Path(registry.path).parent)
    finally:
        follower.relay.close()


def _loop(follower: Follower, lock: int, home: Path) -> int:
    pause, answered = poll_seconds(), time.monotonic()
    while True:
        try:
            left = follower.look()
            answered = time.monotonic()
        except slurm.SlurmError as exc:  # the controller is down or slow: look again later
            print(f"{time.strftime('%H:%M:%S')} {exc}", flush=True)
            if time.monotonic() - answered > UNREACHABLE_S:  # attach or submit starts another
                print(f"no answer from Slurm for {UNREACHABLE_S} s: the follower ends", flush=True)
                return 1
            left = 1
        if not left:
            os.close(lock)  # then one more look: a job submitted meanwhile found the lock held
            if not follower.active() or (lock := _lock(home, holder=True)) is None:
                return 0
        try:  # the next look: when a job says something, or after the pause
            follower.relay.news.get(timeout=pause)
        except queue.Empty:
            pass


def _lock(home: Path, holder: bool = False) -> int | None:
    """The registry's follower lock, or None when held; a `holder` (the follower) writes its pid
    in it, a probe (ensure, following) does not."""
    fd = os.open(home / LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    if holder:
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid()}).encode())
    return fd


def _wake(home: Path) -> None:
    """SIGUSR1 to the follower that holds the lock (its pid is in the lock file)."""
    try:
        pid = int(json.loads((home / LOCK).read_text())["pid"])
        # the pid of the follower before it, while the new one writes its own: never signal
        # a process that is not a follower (SIGUSR1 ends most)
        if b"gpu_lab.cluster.follow" in Path(f"/proc/{pid}/cmdline").read_bytes():
            os.kill(pid, signal.SIGUSR1)
    except (OSError, ValueError, KeyError, TypeError):
        pass  # it is writing its pid, or just ended: its next look, or the next follower, serves


def following(home: str | os.PathLike) -> bool:
    """Whether a follower holds this GPU_LAB_HOME's registry."""
    fd = _lock(Path(home))
    if fd is None:
        return True
    os.close(fd)
    return False


def ensure(registry_path: str | os.PathLike) -> bool:
    """Start the registry's follower unless one runs, else wake it for a look now (a new job's
    recorder); True when this call started it."""
    home = Path(registry_path).parent
    fd = _lock(home)
    if fd is None:
        _wake(home)
        return False
    os.close(fd)
    root = str(Path(__file__).resolve().parents[2])  # gpu_lab's parent: importable from a clone
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    with open(open_private(home / LOG, os.O_WRONLY | os.O_CREAT | os.O_APPEND), "ab") as log:
        subprocess.Popen([sys.executable, "-m", "gpu_lab.cluster.follow", str(registry_path)],
                         stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env,
                         start_new_session=True)
    return True


if __name__ == "__main__":
    sys.exit(follow(sys.argv[1]))
