"""The run folder, GPU_LAB_HOME/runs/<run id>/: the files by which the kernel, the supervisor, the
ranks and the server talk about one run. This module is the only one that names them:

    channel.key               the run's client key, for the owner's readers (gpu_lab.record.channel)
    status.json               the supervisor's last word: {"status", "code", "t", "reason", "note"}
    result.pkl                rank 0's return value, pickled (gpu_lab.rank.outcome)
    target.json               a script's run: the script or module and its argv
                              (gpu_lab.rank.script), never on a command line
    control/checkpoint        a request to save at the next step boundary (the loop consumes it)
    control/stop              a request to stop; it holds the reason, and stays for the supervisor
    errors/rank<r>.json       a failed rank's RankFailure (gpu_lab.failures.triage)
    ranks/rank<r>.pid         each rank's pid, written as it starts (the supervisor watches them)
    ranks/rank<r>.preempted   a rank that checkpointed and exited with the stop exit code
    logs/rank<r>.log          each rank's stdout and stderr; logs/supervisor.log the supervisor's
    elastic/                  torch elastic's temp folder for this run
    job/                      a submitted run's batch job (gpu_lab.submit): job.sbatch, the
                              script sbatch got; job.json, what its supervisor runs;
                              config.json, the ranks' TrainConfig; channel.json, where its
                              recorder (in the registry's follower) listens; server.key, that
                              recorder's keys, so a restarted follower listens as before

Contract: every file written here is written atomically (a temp file in the same folder, fsync,
rename: a reader never sees half a file) and is the owner's only, as is every folder made here
(gpu_lab.access). A read of a file that is missing or cannot be read answers None, "" or an empty
collection, never raises: a reader may be another user, or early, or late.
"""
from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any, Collection

from ..access import open_private, private_dir, private_if_new

RUNS = "runs"
KEY = "channel.key"
STATUS = "status.json"
RESULT = "result.pkl"
TARGET = "target.json"
NOTIFY = "notify.json"  # a launched run's notice URLs, until its end notice is sent
CONTROL, ERRORS, RANKS, LOGS, ELASTIC = "control", "errors", "ranks", "logs", "elastic"
JOB = "job"
JOB_FILES = {"script": "job.sbatch", "spec": "job.json", "config": "config.json",
             "channel": "channel.json", "keys": "server.key"}
CONTROLS = ("checkpoint", "stop")  # what the kernel, the server and the parent watch may ask for
STOP_STATUSES = ("stopped", "pruned")  # the final status a stop may ask for (a sweep prunes)
STOP_STATUS = "stop_status"  # in control/: written before the stop request it qualifies
SUPERVISOR_LOG = "supervisor.log"
LOG_NAME = re.compile(r"^(rank\d{1,5}|supervisor)\.log$")
LOG_NAMES_ACCEPTED = f"rank<N>.log or {SUPERVISOR_LOG}"


def write_atomic(path: str | os.PathLike, data: bytes) -> Path:
    """Write via a temp file in the same directory, fsync, rename: readers never see half a file.
    The file is the owner's only (a run file: gpu_lab.access), whatever the umask."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(open_private(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # a full disk, say: no half-made file is left to be taken for one
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path


def check_log_name(name: Any) -> str:
    """A log file's name as a client sends it: rank<N>.log or supervisor.log, nothing else."""
    if not isinstance(name, str) or not LOG_NAME.match(name):
        raise ValueError(f"log file: got {str(name)[:80]!r}; accepted: {LOG_NAMES_ACCEPTED}")
    return name


class RunFolder:
    """One run's folder: its paths, and atomic, owner-only reads and writes of what is in it."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)

    @classmethod
    def of(cls, run_id: str) -> "RunFolder":
        """The folder of run `run_id` on this host (GPU_LAB_HOME/runs/<run_id>)."""
        return cls(cls.runs_dir() / run_id)

    @staticmethod
    def runs_dir() -> Path:
        from .registry import home

        return home() / RUNS

    @classmethod
    def from_env(cls) -> "RunFolder | None":
        """The folder of the run this process is a rank of (GPU_LAB_RUN_DIR), if any."""
        from .events import ENV_RUN_DIR

        d = os.environ.get(ENV_RUN_DIR)
        return cls(d) if d else None

    def __fspath__(self) -> str:
        return os.fspath(self.path)

    def __repr__(self) -> str:
        return f"RunFolder({os.fspath(self.path)!r})"

    def create(self, fresh: bool = True) -> "RunFolder":
        """Make the folder and its logs/, owner-only (what is made below it later is then out of
        other users' reach whatever its own mode). fresh=True: it must not exist (a fresh id: an
        existing folder would be another run's); False: the same folder on every local rank, and
        after a requeue."""
        private_if_new(self.path.parent)  # runs/
        if fresh:
            self.path.mkdir()
        private_dir(self.path)
        private_dir(self.logs_dir)
        return self

    # --- paths -----------------------------------------------------------------------------------
    @property
    def key_file(self) -> Path:
        return self.path / KEY

    @property
    def status_file(self) -> Path:
        return self.path / STATUS

    @property
    def result_file(self) -> Path:
        return self.path / RESULT

    @property
    def target_file(self) -> Path:
        return self.path / TARGET

    @property
    def notify_file(self) -> Path:
        return self.path / NOTIFY

    @property
    def logs_dir(self) -> Path:
        return self.path / LOGS

    @property
    def elastic_dir(self) -> Path:
        return self.path / ELASTIC

    @property
    def control_dir(self) -> Path:
        return self.path / CONTROL

    def job_file(self, what: str) -> Path:
        """A submitted run's batch job file: "script", "spec" or "config" (JOB_FILES)."""
        if what not in JOB_FILES:
            raise ValueError(f"job file: got {what!r}; accepted: {', '.join(map(repr, JOB_FILES))}")
        return self.path / JOB / JOB_FILES[what]

    def write_job_file(self, what: str, text: str) -> Path:
        return self._write(self.job_file(what), text.encode())

    def write_sent(self, rank: int, sent: int) -> Path:
        """A job's rank, at its end: how many events its reporter handed to the channel (one file
        per process, so that a requeued attempt adds to the first)."""
        return self._write(self.path / JOB / f"sent-{int(rank)}-{os.getpid()}.json",
                           json.dumps({"rank": int(rank), "sent": int(sent)}).encode())

    def sent(self) -> dict[int, int]:
        """Events each rank of a job said it sent, over every process that wrote write_sent."""
        total: dict[int, int] = {}
        for p in (self.path / JOB).glob("sent-*.json"):
            try:
                d = json.loads(p.read_text())
                total[int(d["rank"])] = total.get(int(d["rank"]), 0) + int(d["sent"])
            except (OSError, ValueError, KeyError, TypeError):
                continue  # half a file of a rank killed while writing: nothing to add
        return total

    def log_file(self, rank: int | None) -> Path:
        """A rank's log (stdout and stderr); rank=None: the supervisor's."""
        return self.logs_dir / (SUPERVISOR_LOG if rank is None else f"rank{int(rank)}.log")

    def slurm_log_pattern(self) -> Path:
        """srun's --output for the ranks' logs: "%t" is the task id, which is the rank."""
        return self.logs_dir / "rank%t.log"

    def log_path(self, name: str) -> Path:
        """The log file a client names (checked: rank<N>.log or supervisor.log)."""
        return self.logs_dir / check_log_name(name)

    def control_file(self, name: str) -> Path:
        if name not in CONTROLS:
            raise ValueError(f"run control: got {name!r}; accepted: "
                             f"{', '.join(map(repr, CONTROLS))}")
        return self.control_dir / name

    def error_file(self, rank: int) -> Path:
        return self.path / ERRORS / f"rank{int(rank)}.json"

    def pid_file(self, rank: int) -> Path:
        return self.path / RANKS / f"rank{int(rank)}.pid"

    def _preempted_file(self, rank: int) -> Path:
        return self.path / RANKS / f"rank{int(rank)}.preempted"

    # --- writes ----------------------------------------------------------------------------------
    def _write(self, path: Path, data: bytes) -> Path:
        private_dir(path.parent)
        return write_atomic(path, data)

    def write_key(self, text: str) -> Path:
        return self._write(self.key_file, text.encode())

    def request(self, name: str, text: str = "") -> Path:
        """Ask the run's training loop for `name` ("checkpoint", "stop"); a stop's text is its
        reason. The one way every caller asks (Run, stop_run, the server, the parent watch).
        On a full disk the request is an empty file (no reason): it still asks."""
        path = self.control_file(name)
        try:
            return self._write(path, (text or str(time.time())).encode())
        except OSError:
            private_dir(path.parent)
            os.close(open_private(path, os.O_WRONLY | os.O_CREAT))  # needs an inode, no block
            return path

    def request_stop(self, reason: str, status: str = "stopped") -> Path:
        """Ask for a stop whose end is recorded as `status` (one of STOP_STATUSES): the status is
        written first, so whoever sees the stop request also sees what it ends as."""
        if status not in STOP_STATUSES:
            raise ValueError(f"stop: status={status!r}; accepted: "
                             f"{', '.join(map(repr, STOP_STATUSES))}")
        if status != "stopped":
            self._write(self.control_dir / STOP_STATUS, status.encode())
        return self.request("stop", reason)

    def write_pid(self, rank: int, pid: int) -> Path:
        return self._write(self.pid_file(rank), str(pid).encode())

    def mark_preempted(self, rank: int) -> Path:
        return self._write(self._preempted_file(rank), str(time.time()).encode())

    def write_error(self, rank: int, failure: dict) -> Path:
        return self._write(self.error_file(rank), json.dumps(failure).encode())

    def write_result(self, payload: bytes) -> Path:
        return self._write(self.result_file, payload)

    def write_status(self, status: dict) -> Path:
        return self._write(self.status_file, json.dumps(status).encode())

    def make_elastic_dir(self) -> Path:
        return private_dir(self.elastic_dir)

    def set_aside_attempt(self, attempt: int) -> Path:
        """A requeued job's new attempt: the ranks' failures and preemption marks of the attempt
        before go to errors/attempt<N>/, kept, so that this attempt's end reads its own."""
        keep = private_dir(self.path / ERRORS / f"attempt{int(attempt)}")
        for p in [*(self.path / ERRORS).glob("rank*.json"), *(self.path / RANKS).glob("*.preempted")]:
            p.replace(keep / p.name)
        return keep

    # --- reads -----------------------------------------------------------------------------------
    def read_key(self) -> str | None:
        try:
            return self.key_file.read_text()
        except OSError:
            return None

    def control_requested(self, name: str, consume: bool = False) -> bool:
        """True when `name` was requested; consume=True removes the request (a checkpoint)."""
        p = self.control_file(name)
        if not p.exists():
            return False
        if consume:
            try:
                p.unlink()
            except FileNotFoundError:
                pass
        return True

    def stop_status(self) -> str:
        """The final status the stop request asked for: "stopped" unless it said otherwise."""
        try:
            text = (self.control_dir / STOP_STATUS).read_text().strip()
        except OSError:
            return "stopped"
        return text if text in STOP_STATUSES else "stopped"

    def stop_reason(self) -> str | None:
        """None when no stop was requested; else its reason ("" when it gives none)."""
        p = self.control_file("stop")
        if not p.exists():
            return None
        try:
            text = p.read_text().strip()
        except OSError:
            return ""
        try:
            float(text)  # an older stop request holds a time stamp, not a reason
            return "stopped by the user"
        except ValueError:
            return text

    def stop_requested_at(self) -> float | None:
        """When the stop was requested (the request's time), or None."""
        try:
            return self.control_file("stop").stat().st_mtime
        except OSError:
            return None

    def read_status(self) -> dict | None:
        try:
            d = json.loads(self.status_file.read_text())
        except (OSError, ValueError):
            return None
        return d if isinstance(d, dict) else None

    def write_target(self, text: str) -> Path:
        return self._write(self.target_file, text.encode())

    def read_target(self) -> str:
        try:
            return self.target_file.read_text()
        except (OSError, UnicodeDecodeError):
            return ""

    def read_result(self) -> bytes | None:
        try:
            return self.result_file.read_bytes()
        except FileNotFoundError:
            return None

    def has_error(self, rank: int) -> bool:
        return self.error_file(rank).exists()

    def has_errors(self) -> bool:
        d = self.path / ERRORS
        return d.is_dir() and any(d.glob("rank*.json"))

    def read_errors(self) -> list[dict]:
        """Each failed rank's recorded failure (as written), by rank file name; unreadable ones
        are left out."""
        d = self.path / ERRORS
        out = []
        for p in sorted(d.glob("rank*.json")) if d.is_dir() else ():
            try:
                got = json.loads(p.read_text())
            except (OSError, ValueError):
                continue
            if isinstance(got, dict):
                out.append(got)
        return out

    def preempted_ranks(self) -> list[str]:
        """'rank<r>' for each rank that checkpointed and exited with the stop exit code."""
        d = self.path / RANKS
        return sorted(p.stem for p in d.glob("*.preempted")) if d.is_dir() else []

    def rank_pids(self, skip: Collection[int] = ()) -> dict[int, int]:
        """{rank: pid} of the ranks that have started (those in `skip` are not read again)."""
        d = self.path / RANKS
        out: dict[int, int] = {}
        for p in d.glob("rank*.pid") if d.is_dir() else ():
            try:
                r = int(p.stem[len("rank"):])
                if r not in skip:
                    out[r] = int(p.read_text())
            except (OSError, ValueError):
                continue
        return out

    def log_names(self) -> list[str]:
        """The run's log files: rank0.log, rank1.log, ... (by rank), then supervisor.log."""
        d = self.logs_dir
        if not d.is_dir():
            return []
        names = [p.name for p in d.iterdir() if LOG_NAME.match(p.name)]
        return sorted(names, key=lambda n: (n == SUPERVISOR_LOG, len(n), n))
