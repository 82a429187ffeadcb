"""gpu_lab.submit(): a run as a Slurm job, followed from the notebook like a launched run.

The kernel makes the run (its id, folder, checkpoint folder and registry row, kind "slurm", with a
`job` column: the scheduler, the job id, Slurm's state), writes the batch script and the ranks'
config into the run folder, and calls sbatch. The job reports over the run's channel to its
recorder, which the registry's follower (gpu_lab.cluster.follow, gpu_lab.cluster.relay) runs on
this host: the registry never leaves it, and only the run folder must be on a file system the
nodes share. The follower also writes what only Slurm knows (a pending job's reason, an end the
job could not record). The ClusterRun handle is a
Run: status, wait, metrics, logs, result, error, stop and resume work as for a launched run; stop
is Slurm's (the checkpoint signal to the ranks), resume a new submission.
"""
from __future__ import annotations

import json
import os
import secrets
import sys
import time
from pathlib import Path
from typing import Any, Callable

from ..access import touch_private
from ..cluster import follow, slurm, states
from ..cluster.relay import recorder_host
from ..cluster.script import job_script
from ..config import TrainConfig
from ..record import events as ev
from ..record.channel import RunKeys, save_client_key
from ..record.registry import Registry
from ..record.runfolder import RunFolder
from .checks import free_port
from .run import Run

SCRIPT_ENTRY = "gpu_lab.rank.script:run_in_job"  # a submitted script's ranks: run its target
STOP_SIGNAL = "USR1"  # what the ranks' preemption guard answers with a checkpoint and exit 143


def submit(fn: Callable | str, *args: Any, config: TrainConfig | dict | None = None,
           nodes: int = 1,
           ranks_per_node: int | None = None, device: str | None = None, name: str | None = None,
           partition: str | None = None, account: str | None = None, qos: str | None = None,
           time_limit: str = "24:00:00", cpus_per_task: int | None = None,
           requeue: bool = True, resume: Any = None, env: dict | None = None) -> "ClusterRun":
    """Submit `fn(config)` to Slurm with sbatch and return a ClusterRun at once: `queued` while
    Slurm holds it (with Slurm's reason), then running, then its end.

    fn: a module-level function (or "module:function"), importable where the job runs, called
      as fn(config) (the config: `config=` or the first of `args`); or your own script, run
      unchanged on every rank: submit("train.py", "--lr", "0.1", nodes=1, ranks_per_node=2),
      submit("-m pkg.train", ...) (a string ending in .py, or naming a file, is a script). Its
      arguments travel in the owner-only run folder, never on a command line Slurm shows.
    ranks_per_node: one task per GPU (default: config.num_processes, else 1); device: "cuda"
      asks for that many GPUs per node (--gres), "cpu" for CPU ranks (gloo); None: "cuda" when
      this host has GPUs. cpus_per_task: default config.num_workers + 1 (a script's: 1, as
      sbatch's; pass more for its DataLoader workers).
    partition, account, qos, time_limit: Slurm's. Before the time limit the ranks get SIGUSR1,
      checkpoint and exit; with requeue=True the job goes back in the queue and resumes.
    resume: continue from a checkpoint, as launch(..., resume=) takes it.
    nodes: more than one puts ranks_per_node ranks on each node, one process group.
    The run folder (under GPU_LAB_HOME) must be on a file system the nodes share; the registry
    and the record stay on this host (every rank reports to a recorder here, over the run's
    channel), so the nodes never open the registry.
    """
    from ..rank.address import entry_of, resolve_entry
    from .launcher import _resume_source

    script = _script_of(fn, args)
    if config is None and script is None and args:
        config, args = args[0], args[1:]
    if args and script is None:
        raise TypeError(f"gpu_lab.submit: a function is called as fn(config); got more "
                        f"arguments: {args!r}")
    cfg = TrainConfig.from_dict(config) if isinstance(config, dict) else (config or TrainConfig())
    if not isinstance(cfg, TrainConfig):
        raise TypeError(f"gpu_lab.submit: config must be a TrainConfig, a dict or None; got "
                        f"{type(config).__name__}")
    if script is not None and resume is not None:
        raise ValueError("gpu_lab.submit: a script resumes by its own flag; submit it again "
                         "with that flag")
    entry = SCRIPT_ENTRY if script is not None else (fn if isinstance(fn, str) else entry_of(fn))
    resolve_entry(entry)  # the job imports it: a typo fails here, not on the cluster
    label = name or (script.name if script is not None else entry.rpartition(":")[2])
    if script is not None and cpus_per_task is None:
        cpus_per_task = 1  # Slurm's own default: a script's loader workers are its own affair
    options = dict(nodes=nodes, ranks_per_node=ranks_per_node, device=device,
                   partition=partition, account=account, qos=qos, time_limit=time_limit,
                   cpus_per_task=cpus_per_task)  # completed by _job_spec; resume() reuses them
    spec = _job_spec(entry, cfg, label, options, env)
    why = slurm.missing()  # after the checks: they hold on any machine
    if why:
        raise slurm.SlurmError(f"gpu_lab.submit: {why}")
    registry = Registry()
    source = _resume_source(resume, cfg, registry) if resume is not None else None
    run_id, folder = _make_run(registry, spec, label, source, {
        "scheduler": "slurm", "id": None, "state": None, "requeue": bool(requeue),
        "options": options}, script)
    touch_private(folder.log_file(None))  # Slurm would make it with the job's umask
    try:
        job_id = slurm.sbatch(str(folder.job_file("script")), cwd=os.getcwd(), extra=[
            f"--output={folder.log_file(None)}", "--open-mode=append"])
    except slurm.SlurmError as exc:
        registry.set_status(run_id, "failed", error=str(exc), reason="sbatch refused the job")
        raise
    registry.update(run_id, job=dict(registry.get_run(run_id)["job"], id=job_id, state="PENDING"))
    _say(registry, run_id, "queued", states.waiting(None))
    follow.ensure(registry.path)
    run = ClusterRun._from_row(registry.get_run(run_id), registry)
    run._follow()
    return run


def _job_spec(entry: str, cfg: TrainConfig, label: str, options: dict, env: dict | None) -> Any:
    """The job, checked field by field (gpu_lab.export's JobSpec) before anything is made."""
    from ..export.job import JobSpec, k8s_name
    from ..record.registry import home
    from ..telemetry.probe import gpu_count

    if options["device"] is None:
        options["device"] = "cuda" if gpu_count() > 0 else "cpu"
    spec = JobSpec(entry, cfg, num_nodes=options["nodes"], nproc_per_node=options["ranks_per_node"],
                   name=k8s_name(label), device=options["device"], partition=options["partition"],
                   account=options["account"], qos=options["qos"],
                   time_limit=options["time_limit"], python=sys.executable, check_import=False,
                   cpus_per_task=options["cpus_per_task"] or cfg.num_workers + 1,
                   env={"GPU_LAB_HOME": str(home()), **(env or {})})
    options.update(ranks_per_node=spec.nproc_per_node, cpus_per_task=spec.cpus_per_task)
    return spec


def _script_of(fn: Any, args: tuple) -> Any:
    """The Script that `fn` names (a path ending in .py or to a file, "-m module"), or None for a
    function or a "module:function"."""
    from ..rank.script import Script

    if isinstance(fn, Script):
        return fn.with_args(*args).checked("gpu_lab.submit")
    if isinstance(fn, os.PathLike):
        fn = os.fspath(fn)
    if not isinstance(fn, str):
        return None
    if fn.startswith("-m") or fn.endswith(".py") or Path(fn).expanduser().is_file():
        return Script.parse(fn, args, where="gpu_lab.submit")
    return None


def _make_run(registry: Registry, spec: Any, label: str, source: dict | None,
              job: dict, script: Any = None) -> tuple[str, RunFolder]:
    """The run's id, folder (with the job's script, spec and the ranks' config; a user's script
    and its argv), checkpoint folder and registry row (queued, kind "slurm", its `job`)."""
    from ..rank.script import save_target

    from .launcher import _private_output_dir

    cfg = spec.config
    run_id = time.strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(3)
    folder = RunFolder.of(run_id).create(fresh=True)
    if script is not None:
        save_target(str(folder.path), script)
    output_dir = str(Path(cfg.output_dir).expanduser().resolve() / run_id)
    _private_output_dir(output_dir)
    ranks_cfg = cfg.replace(output_dir=output_dir, resume_from=source["path"] if source else None)
    folder.write_job_file("config", ranks_cfg.to_json(indent=1) + "\n")
    folder.write_job_file("spec", _spec_json(run_id, registry, spec, job["requeue"]))
    # the run's recorder runs on this host (in the registry's follower), where the registry is:
    # the job reports to it over the channel, so the registry never leaves this machine
    keys = RunKeys.new()
    save_client_key(folder.path, keys.client)
    folder.write_job_file("keys", keys.encode())
    host = recorder_host()
    folder.write_job_file("channel", json.dumps({"host": host, "port": free_port(host)}))
    folder.write_job_file("script", job_script(spec, run_id, str(folder.path), job["requeue"]))
    registry.create_run(run_id, name=label, config=None if script else cfg.to_dict(),
                        num_processes=spec.world_size,
                        num_nodes=spec.num_nodes, output_dir=output_dir, run_dir=str(folder.path),
                        kind="slurm", status="queued", entry=spec.entry, resumed_from=source,
                        detach=1, job=job)
    return run_id, folder


def _spec_json(run_id: str, registry: Registry, spec: Any, requeue: bool) -> str:
    return json.dumps({"run_id": run_id, "entry": spec.entry,
                       "python": spec.python, "nodes": spec.num_nodes,
                       "ranks_per_node": spec.nproc_per_node, "requeue": bool(requeue)},
                      indent=1) + "\n"


def _say(registry: Registry, run_id: str, status: str, reason: str) -> None:
    """A status change this process makes (a final one only if the run is still active)."""
    if registry.set_status(run_id, status, reason=reason):
        registry.add_events(run_id, [ev.make(run_id, -1, ev.STATUS,
                                             {"status": status, "reason": reason})])


class ClusterRun(Run):
    """A run that is a Slurm job (gpu_lab.submit). `job_id`, `slurm_state()` (Slurm's own view),
    and a Run's status, wait, metrics, logs, result and error. stop() sends the ranks the
    checkpoint signal through scancel; resume() submits a new job that continues this one."""

    @property
    def job(self) -> dict:
        row = self._registry.get_run(self.id) or {}
        return row.get("job") or {}

    @property
    def job_id(self) -> str | None:
        return self.job.get("id")

    def slurm_state(self) -> slurm.JobState | None:
        """The job as Slurm sees it now (None once Slurm has forgotten it)."""
        return slurm.states([self.job_id]).get(str(self.job_id)) if self.job_id else None

    def stop(self, grace: float = 60.0, timeout: float = 120.0,
             reason: str = "stopped by the user", status: str = "stopped") -> str:
        """Withdraw the job if it is pending; else the ranks get SIGUSR1: they checkpoint at the
        next step and exit, and the job cancels itself, so Slurm says CANCELLED. A job still
        running `grace` seconds after the request is cancelled by the registry's follower.
        Waits up to `timeout` seconds; returns the status."""
        if not self.done:
            self.request_stop(reason, status, grace)
            self._done.wait(timeout)
        return self._status

    def request_stop(self, reason: str = "stopped by the user", status: str = "stopped",
                     grace: float = 60.0) -> None:
        """stop() without the wait (the server's Stop button)."""
        self.folder.request_stop(reason, status)  # the job reads why it ended, and how
        self._registry.update(self.id, job=dict(self.job, stop_grace=float(grace)))
        job = self.slurm_state()
        if job is None or job.state in states.FINAL:
            return  # it ended already: the job or the follower records how
        if job.state in states.QUEUED:
            slurm.cancel(job.job_id)
            _say(self._registry, self.id, status, f"{reason} (withdrawn from Slurm's queue)")
        else:
            slurm.signal(job.job_id, STOP_SIGNAL)
            _say(self._registry, self.id, "stopping", reason)

    def cancel(self, timeout: float = 30.0) -> str:
        if self._status not in ("pending", "queued"):
            raise ValueError(f"run {self.id} is {self._status}, not queued: use run.stop()")
        return self.stop(grace=0.0, timeout=timeout, reason="withdrawn from the queue by the user")

    def resume(self, fn: Callable | None = None, *args: Any, **changes: Any) -> "ClusterRun":
        """Submit a new job that continues this run from its newest complete checkpoint, with the
        same function, Slurm options and config (`changes` replace config fields)."""
        options = dict(self.job.get("options") or {})
        if self._entry == SCRIPT_ENTRY:  # a script resumes by its own flag: run.resume("--resume", p)
            from ..rank.script import load_target

            script = load_target(str(self.run_dir))
            if script is None:
                raise ValueError(f"run {self.id}: its run folder no longer names its script")
            extra = ((fn,) if fn is not None else ()) + args
            return submit(script.with_args(*extra), name=self.name,
                          requeue=self.job.get("requeue", True), **options)
        config = self.config if not changes else self.config.replace(**changes)
        return submit(fn or self._entry, config=config, resume=self, name=self.name,
                      requeue=self.job.get("requeue", True), **options)

    def _follow(self) -> None:
        follow.ensure(self._registry.path)  # whoever follows a job keeps its follower alive
        super()._follow()

    def __repr__(self) -> str:
        return (f"ClusterRun(id={self.id!r}, job={self.job_id!r}, status={self._status!r}, "
                f"num_processes={self.num_processes})")


Run._job_handle = ClusterRun  # attach() makes one for a job's row: the Run never imports this
