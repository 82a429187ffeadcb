"""A submitted run's job supervisor: `python -m gpu_lab.cluster.job <run folder>`, the last command
of the batch script (gpu_lab.cluster.script), on the job's first node.

It owns the run's record for this attempt, as a launched run's supervisor does: a Recorder in this
fresh process (the only kind that may write SQLite) with keys made here (the client key goes to
the run folder for the owner's readers and to the ranks in their environment; no secret travels
through Slurm's submission), bound on loopback for one node, else on the first node's address so
every node's ranks report to it. srun starts one `gpu_lab.rank.headless --in-job` task per rank,
each logging to logs/rank<r>.log. Then it decides the end:

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
from ..record.channel import ENV_KEY, RunKeys, save_client_key
from ..record.runfolder import RunFolder
from . import slurm


class Job:
    def __init__(self, folder: RunFolder) -> None:
        from ..record.registry import Registry

        self.folder = folder
        self.spec = json.loads(folder.job_file("spec").read_text())
        self.run_id = self.spec["run_id"]
        self.registry = Registry(self.spec["registry"])
        self.job_id = os.environ.get("SLURM_JOB_ID", "")
        self.attempt = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
        self.signalled: str | None = None  # a signal Slurm sent this process (cancel, preempt)

    def run(self) -> int:
        from ..record.recorder import Recorder

        for sig in STOP_SIGNALS:  # Slurm signals the ranks itself; this process notes and waits
            signal.signal(sig, self._note_signal)
        keys = RunKeys.new()
        save_client_key(self.folder.path, keys.client)
        host = self._address()
        rec = Recorder(self.registry, self.run_id, keys=keys, host=host)
        self._started(rec)
        code = self._ranks(rec, keys)
        end, after = self._decide(code)
        if end["status"] in ev.FINAL_STATUSES:
            rec.close(end=end)
        else:  # requeued or stopping: the run goes on, in Slurm's hands
            self.registry.update(self.run_id, status=end["status"], reason=end.get("reason"))
            rec.record([ev.make(self.run_id, -1, ev.STATUS, end)])
            rec.close()
        print(f"gpu_lab job {self.job_id}: srun exited {code}; the run is {end['status']}"
              + (f" ({end['reason']})" if end.get("reason") else ""), flush=True)
        if after is not None:
            after(self.job_id)  # requeue, or cancel: this process ends with the job
        return 0 if end["status"] in ("succeeded", "stopped", "queued", "stopping") else 1

    def _note_signal(self, signum: int, frame: Any) -> None:
        self.signalled = signal.Signals(signum).name

    def _address(self) -> str:
        """Where the recorder listens: loopback for one node, else the first node's address
        (MASTER_ADDR, the batch script's), which every node reaches."""
        if int(self.spec["nodes"]) == 1:
            return "127.0.0.1"
        name = os.environ.get("MASTER_ADDR") or socket.gethostname()
        addr = socket.gethostbyname(name)
        if addr.startswith("127."):
            raise RuntimeError(f"the job's first node {name!r} resolves to {addr}, which other "
                               "nodes cannot reach: fix the node's /etc/hosts, or set "
                               "MASTER_ADDR to its address in the submit's env")
        return addr

    def _started(self, rec: Any) -> None:
        job = dict(self.registry.get_run(self.run_id).get("job") or {})
        job.update(id=self.job_id, attempt=self.attempt, batch_host=socket.gethostname(),
                   nodes=os.environ.get("SLURM_JOB_NODELIST"), state="RUNNING", reason=None)
        self.registry.update(self.run_id, status="running", ended=None, reason=None, job=job,
                             events_address=rec.publish_address)
        rec.record([ev.make(self.run_id, -1, ev.STATUS, {"status": "running"}),
                    ev.make(self.run_id, -1, ev.LOG, {"text": (
                        f"Slurm job {self.job_id} attempt {self.attempt} started on "
                        f"{job['nodes']}")})])

    def _ranks(self, rec: Any, keys: RunKeys) -> int:
        for rank in range(int(self.spec["nodes"]) * int(self.spec["ranks_per_node"])):
            touch_private(self.folder.log_file(rank))  # srun would use the job's umask
        env = dict(os.environ, **{ev.ENV_RUN_ID: self.run_id, ev.ENV_RUN_DIR: str(self.folder.path),
                                  ev.ENV_ADDRESS: rec.address, ENV_KEY: keys.client.encode()})
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
        if code == 0:
            return {"status": "succeeded", "exitcode": 0}, None
        if code == STOP_EXIT_CODE or code == 128 + signal.SIGUSR1:
            stop = self.folder.stop_reason()
            if stop is not None:  # the Run asked: Slurm agrees once the job cancels itself
                return {"status": self.folder.stop_status(), "reason": stop or "stopped by the user",
                        "exitcode": code}, slurm.cancel
            if self.signalled:
                return {"status": "stopping", "reason": f"Slurm sent {self.signalled} (scancel or "
                        "preemption); the ranks checkpointed"}, None
            if self.spec.get("requeue", True):
                return {"status": "queued", "reason": "checkpointed before the time limit and "
                        "requeued: it resumes from the checkpoint when Slurm starts it again"}, \
                    slurm.requeue
            return {"status": "stopped", "exitcode": code, "reason": (
                "checkpointed before the time limit (requeue=False): resume the run to go on")}, None
        from ..failures.triage import RankFailure

        errors = sorted(self.folder.read_errors(), key=lambda d: d.get("t") or 0)
        text = (RankFailure.from_dict(errors[0]).summary() if errors  # the earliest: the cause
                else f"srun exited with code {code}; see the ranks' logs")
        return {"status": "failed", "exitcode": code, "error": text}, None


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        print("usage: python -m gpu_lab.cluster.job <run folder> (the batch script of "
              "gpu_lab.submit runs it)", file=sys.stderr)
        return 2
    t0 = time.time()
    job = Job(RunFolder(argv[0]))
    try:
        return job.run()
    except BaseException as exc:  # the record says why the job could not run its ranks
        import traceback

        traceback.print_exc()
        job.registry.set_status(job.run_id, "failed", error=f"the job's supervisor failed after "
                                f"{time.time() - t0:.0f} s: {type(exc).__name__}: {exc}")
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
