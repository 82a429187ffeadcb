"""A submitted run's job supervisor: `python -m gpu_lab.cluster.job <run folder>`, the last command
of the batch script (gpu_lab.cluster.script), on the job's first node.

The run's record stays on the host it was submitted from: its recorder runs there, in the
registry's follower (gpu_lab.cluster.relay), and listens where the run folder's job/channel.json
says, with the run's keys. This process tells it the job's status changes (rank -1 status events
"from": "job": running with the attempt and nodes, then the end), and srun starts one
`gpu_lab.rank.headless --in-job` task per rank, each reporting to the same recorder and logging to
logs/rank<r>.log. Nothing here opens the registry: the job's nodes need the run folder (a shared
file system) and a route to the recorder, not the database. Then it decides the end:

| what happened | status | Slurm state after |
|---|---|---|
| srun exits 0 | succeeded | COMPLETED |
| the Run's stop (control/stop), the ranks checkpointed | stopped | CANCELLED (it cancels itself) |
| the checkpoint signal before the time limit, requeue on | queued (requeued) | PENDING |
| the same, requeue off | stopped | COMPLETED |
| Slurm signalled this process (scancel, preemption) | stopping, until the follower sees Slurm's end | CANCELLED / PENDING / PREEMPTED |
| a rank failed | failed, with each rank's triaged error | FAILED |
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ..access import touch_private
from ..rank.outcome import STOP_EXIT_CODE, STOP_SIGNALS
from ..record import events as ev
from ..record.channel import ENV_KEY
from ..record.runfolder import RunFolder
from . import slurm
from .relay import FROM_JOB


READY_S = 120.0  # seconds the job waits for its recorder before it starts the ranks anyway


class Job:
    def __init__(self, folder: RunFolder) -> None:
        from ..record.channel import load_client_key
        from ..record.reporter import Reporter

        self.folder = folder
        self.spec = json.loads(folder.job_file("spec").read_text())
        self.run_id = self.spec["run_id"]
        where = json.loads(folder.job_file("channel").read_text())
        self.address = f"tcp://{where['host']}:{where['port']}"
        self.key = load_client_key(folder.path)
        if self.key is None:
            raise RuntimeError(f"no channel key in {folder.path}: the run folder must be the one "
                               "gpu_lab.submit made, on a file system this node shares")
        self.job_id = os.environ.get("SLURM_JOB_ID", "")
        self.attempt = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
        self.signalled: str | None = None  # a signal Slurm sent this process (cancel, preempt)
        self.say = Reporter(self.address, self.run_id, rank=-1, key=self.key)

    def status(self, status: str, **extra: Any) -> None:
        self.say.status(status, **extra, **{"from": FROM_JOB})

    def run(self) -> int:
        for sig in STOP_SIGNALS:  # Slurm signals the ranks itself; this process notes and waits
            signal.signal(sig, self._note_signal)
        nodes = os.environ.get("SLURM_JOB_NODELIST")
        if self.attempt:  # a requeue: what the attempt before left is not this attempt's end
            self.folder.set_aside_attempt(self.attempt - 1)
        self.status("running", attempt=self.attempt, nodes=nodes, batch_host=socket.gethostname())
        self.say.log(f"Slurm job {self.job_id} attempt {self.attempt} started on {nodes}")
        # the ranks start once the recorder listens: a short job's reports would otherwise go to
        # a port the follower has not bound yet, and be lost when the ranks exit
        if not self.say.wait_connected(READY_S):
            print(f"gpu_lab job {self.job_id}: the run's recorder at {self.address} did not "
                  f"answer in {READY_S:.0f} s; the ranks start anyway and what they report "
                  "before it answers is counted as lost. It runs on the host the job was "
                  "submitted from (GPU_LAB_RECORDER_HOST): this node must reach it", flush=True)
        code = self._ranks()
        end, after = self._decide(code)
        self.status(**end)
        self.say.close(10.0)  # the end reaches the recorder before Slurm is told anything
        print(f"gpu_lab job {self.job_id}: srun exited {code}; the run is {end['status']}"
              + (f" ({end['reason']})" if end.get("reason") else ""), flush=True)
        if after is not None:
            after(self.job_id)  # requeue, or cancel: this process ends with the job
        return 0 if end["status"] in ("succeeded", "stopped", "queued", "stopping") else 1

    def _note_signal(self, signum: int, frame: Any) -> None:
        self.signalled = signal.Signals(signum).name

    def _ranks(self) -> int:
        for rank in range(int(self.spec["nodes"]) * int(self.spec["ranks_per_node"])):
            touch_private(self.folder.log_file(rank))  # srun would use the job's umask
        env = dict(os.environ, **{ev.ENV_RUN_ID: self.run_id, ev.ENV_RUN_DIR: str(self.folder.path),
                                  ev.ENV_ADDRESS: self.address, ENV_KEY: self.key.encode()})
        argv = ["srun", "--kill-on-bad-exit=1", f"--output={self.folder.slurm_log_pattern()}",
                "--open-mode=append", self.spec["python"], "-m", "gpu_lab.rank.headless",
                self.spec["entry"], "--config", str(self.folder.job_file("config")),
                "--run-id", self.run_id, "--in-job"]
        proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL)
        while True:
            try:
                return proc.wait()
            except InterruptedError:  # a signal handler ran: keep waiting for the ranks
                continue

    def _decide(self, code: int) -> tuple[dict, Any]:
        """The end of this attempt and what to tell Slurm after it is recorded."""
        stopped = code in (STOP_EXIT_CODE, 128 + signal.SIGUSR1)
        stop = self.folder.stop_reason()
        # the Run asked (fit may have seen control/stop before the signal, and returned): Slurm
        # agrees once the job cancels itself
        if stop is not None and (code == 0 or stopped):
            return {"status": self.folder.stop_status(), "reason": stop or "stopped by the user",
                    "exitcode": code}, slurm.cancel
        if code == 0:
            return {"status": "succeeded", "exitcode": 0}, None
        if stopped:
            if self.signalled:
                return {"status": "stopping", "reason": f"Slurm sent {self.signalled} (scancel or "
                        "preemption); the ranks checkpointed"}, None
            if self.spec.get("requeue", True):
                return {"status": "queued", "reason": "checkpointed before the time limit and "
                        "requeued: it resumes from the checkpoint when Slurm starts it again"}, \
                    slurm.requeue
            return {"status": "stopped", "exitcode": code, "reason": (
                "checkpointed before the time limit (requeue=False): resume the run to go on")}, None
        from ..failures.triage import RunError, failures_of
        from .lost import lost_sentence, record_lost_ranks

        # a node that went down took its ranks with it, silently: named before what their
        # peers saw of it (a connection reset). A job that may be requeued goes back in the
        # queue, as Slurm does with it after a node failure, and resumes from its checkpoint.
        requeue = bool(self.spec.get("requeue", True))
        lost = record_lost_ranks(self.folder, os.environ.get("SLURM_JOB_NODELIST"),
                                 int(self.spec["ranks_per_node"]), write=not requeue)
        if lost and requeue:
            return {"status": "queued", "reason": lost_sentence(lost, requeued=True)}, \
                _requeue_after_node_failure
        report = RunError(failures_of(self.folder.read_errors()))  # root cause first
        text = report.headline or f"srun exited with code {code}; see the ranks' logs"
        end = {"status": "failed", "exitcode": code, "error": text}
        if lost:
            end["reason"] = lost_sentence(lost)
        return end, None


def _requeue_after_node_failure(job_id: str) -> None:
    """Back in the queue; Slurm may have done it already (NODE_FAIL requeues a requeue-able job),
    and then refuses a second time."""
    try:
        slurm.requeue(job_id)
    except slurm.SlurmError as exc:
        print(f"gpu_lab job {job_id}: {exc} (Slurm requeues a job after a node failure itself)",
              flush=True)


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        print("usage: python -m gpu_lab.cluster.job <run folder> (the batch script of "
              "gpu_lab.submit runs it)", file=sys.stderr)
        return 2
    t0 = time.time()
    job = Job(RunFolder(argv[0]))
    try:
        return job.run()
    except BaseException as exc:  # noqa: BLE001 - the record says why the job could not run its ranks
        import traceback

        traceback.print_exc()
        job.status("failed", error=f"the job's supervisor failed after {time.time() - t0:.0f} "
                   f"s: {type(exc).__name__}: {exc}")
        job.say.close(10.0)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
