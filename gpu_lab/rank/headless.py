"""Run a training function headless: `python -m gpu_lab.rank.headless module:function --config cfg.json`.

This is what every exported command runs, once per rank: under torchrun (and `accelerate launch`,
which starts torchrun's agent), under Slurm's srun (one task per GPU), in a Kubernetes pod, or
alone. No kernel is listening, so each rank records its own metrics:

- every rank runs a Recorder on loopback in its own process and points gpu_lab.report at it
  (`GPU_LAB_EVENTS`, with the recorder's own CURVE key in `GPU_LAB_EVENTS_KEY`, which never leaves
  the rank: another local user cannot push events into it), so `report()` keeps its never-block
  promise; the run's folder is the owner's only (gpu_lab.access); the recorder's thread writes the
  rank's events into the run's record in the registry (SQLite in WAL mode with a busy timeout:
  concurrent writers wait their turn, and the registry numbers events under its write lock). No
  address has to be agreed between ranks or nodes; `gpu_lab.attach(run_id)` follows such a run
  through the registry.
- local rank 0 of each node creates (or, after a restart or a Slurm requeue, revives) the node's
  registry row: kind "torchrun" / "slurm" / "python", the node rank, the number of nodes, the
  launcher's pid (so `gpu_lab.launch.stop_run` and lost-run detection work as for notebook runs).
- the run id is the same on every rank of a node without any exchange: it is derived from the
  launcher process (torchrun's agent) or from the Slurm job id, or given with `--run-id`.
- the outcome lands in the registry: succeeded; failed with the rank's exception; or stopped when
  the training toolkit's PreemptionGuard exits with 143 (Slurm then requeues, see gpu_lab.export),
  or when a stop signal (SIGTERM, SIGUSR1, SIGHUP) arrives outside fit() (also exit 143).

TensorBoard logging is the training toolkit's (TrainConfig.tensorboard, under output_dir).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from ..record.events import ACTIVE_STATUSES

from . import outcome


@dataclass
class Topology:
    """Where this process sits in the job, from the launcher's environment."""

    launcher: str          # "torchrun" | "slurm" | "python"
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    launcher_pid: int      # torchrun's agent; this process under srun or alone

    @property
    def is_node_leader(self) -> bool:
        return self.local_rank == 0


def _int_env(env: dict, key: str, default: int | None = None) -> int:
    raw = env.get(key)
    if raw is None or raw == "":
        if default is None:
            raise ValueError(f"environment variable {key} is not set")
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {key}={raw!r} is not an integer") from None


def detect_topology(env: dict | None = None) -> Topology:
    """Read the rank layout that torchrun or srun set. Under srun (no torchrun), set the
    variables torch.distributed and accelerate read (RANK, LOCAL_RANK, WORLD_SIZE, ...) from
    Slurm's, in `env` (os.environ by default)."""
    env = os.environ if env is None else env
    if "LOCAL_RANK" in env and "RANK" in env and "WORLD_SIZE" in env:
        world = _int_env(env, "WORLD_SIZE")
        local_world = _int_env(env, "LOCAL_WORLD_SIZE", world)
        rank = _int_env(env, "RANK")
        nodes = _int_env(env, "GROUP_WORLD_SIZE", max(1, world // max(1, local_world)))
        node = _int_env(env, "GROUP_RANK", _int_env(env, "NODE_RANK", rank // max(1, local_world)))
        return Topology("torchrun", rank, _int_env(env, "LOCAL_RANK"), world, local_world, node,
                        nodes, os.getppid())
    # Only inside an srun step (SLURM_STEP_NUM_TASKS): the batch script itself also sees
    # SLURM_PROCID=0 and the allocation's SLURM_NTASKS, and must not wait for ranks that no one
    # started.
    if "SLURM_PROCID" in env and _int_env(env, "SLURM_STEP_NUM_TASKS", 1) > 1:
        world = _int_env(env, "SLURM_STEP_NUM_TASKS")
        nodes = _int_env(env, "SLURM_STEP_NUM_NODES", _int_env(env, "SLURM_NNODES", 1))
        if world % nodes:
            raise ValueError(f"SLURM_STEP_NUM_TASKS={world} is not a multiple of the step's "
                             f"{nodes} node(s): use --ntasks-per-node (one task per GPU) so "
                             "every node runs as many ranks")
        if nodes > 1 and not env.get("MASTER_ADDR"):
            raise ValueError("running under srun on several nodes, but MASTER_ADDR is not set: "
                             "export MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" "
                             "| head -n 1) in the batch script (the exported one does)")
        rank, local = _int_env(env, "SLURM_PROCID"), _int_env(env, "SLURM_LOCALID")
        node = _int_env(env, "SLURM_NODEID", 0)
        env.update({"RANK": str(rank), "LOCAL_RANK": str(local), "WORLD_SIZE": str(world),
                    "LOCAL_WORLD_SIZE": str(world // nodes), "GROUP_RANK": str(node),
                    "NODE_RANK": str(node)})
        env.setdefault("MASTER_ADDR", "127.0.0.1")
        env.setdefault("MASTER_PORT", str(29500 + _int_env(env, "SLURM_JOB_ID", 0) % 1000))
        return Topology("slurm", rank, local, world, world // nodes, node, nodes, os.getpid())
    return Topology("python", 0, 0, 1, 1, 0, 1, os.getpid())


def derive_run_id(topo: Topology, explicit: str | None = None, env: dict | None = None) -> str:
    """The registry id of this node's run, the same on every local rank without any exchange:
    `--run-id`, else `slurm-<job id>` (a requeued job continues its row), else a timestamp and a
    hash of the launcher process (host, pid, start time). Nodes after the first get `-node<k>`."""
    env = os.environ if env is None else env
    if explicit:
        base = explicit
    elif topo.launcher == "slurm" and env.get("SLURM_JOB_ID"):
        base = f"slurm-{env['SLURM_JOB_ID']}"
    else:
        import psutil

        try:
            started = psutil.Process(topo.launcher_pid).create_time()
        except psutil.Error:
            started = 0.0
        digest = hashlib.sha1(f"{socket.gethostname()}:{topo.launcher_pid}:{started:.3f}"
                              .encode()).hexdigest()[:6]
        base = time.strftime("%Y%m%d-%H%M%S-", time.localtime(started or time.time())) + digest
    return base if topo.num_nodes == 1 or topo.node_rank == 0 else f"{base}-node{topo.node_rank}"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m gpu_lab.rank.headless",
        description="Run a training function on this rank (under torchrun, accelerate launch, "
                    "srun, or alone) and record its metrics in the gpu_lab run registry.")
    p.add_argument("entry", metavar="MODULE:FUNCTION",
                   help="the training function, e.g. gpu_lab.train:train_classifier; it is called "
                        "as fn(config) with --config, else fn()")
    p.add_argument("--config", metavar="CONFIG.json", help="a TrainConfig as JSON (TrainConfig.to_json)")
    p.add_argument("--run-id", help="registry id of the run (default: derived from the launcher; "
                                    "slurm-<job id> under Slurm)")
    p.add_argument("--name", help="run name shown in the registry (default: the function's name)")
    p.add_argument("--in-job", action="store_true",
                   help="a rank of a submitted run (gpu_lab.submit): report to the job's recorder "
                        "(GPU_LAB_EVENTS, GPU_LAB_EVENTS_KEY), which owns the run's record")
    return p.parse_args(argv)


def load_config(path: str):
    from ..config import TrainConfig

    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--config: {path!r} is not a file (cwd: {os.getcwd()})")
    try:
        return TrainConfig.from_json(p.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"--config {path!r}: not valid JSON ({exc})") from None


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # --- everything is checked before anything starts --------------------------------------------
    from ..record import notify
    from .address import EntryError, resolve_entry

    try:
        config = load_config(args.config) if args.config else None
        fn = resolve_entry(args.entry)
        topo = detect_topology()
        run_id = derive_run_id(topo, args.run_id)
        notify_urls = notify.configured()  # a bad GPU_LAB_NOTIFY is refused before the run
    except (EntryError, ValueError, TypeError) as exc:
        print(f"gpu_lab.rank.headless: {exc}", file=sys.stderr, flush=True)
        return outcome.EXIT_USAGE

    from ..access import private_if_new
    from ..record.registry import Registry
    from ..record.runfolder import RunFolder

    if args.in_job:
        return _in_job(fn, config, topo)
    registry = Registry()
    # the same folder on every local rank, and after a requeue
    folder = RunFolder.of(run_id).create(fresh=False)
    if config is not None:  # a folder the user made stays as they made it
        private_if_new(Path(config.output_dir).expanduser())

    def make_row() -> None:
        open_row(registry, run_id, topo, config, folder.path,
                 args.name or getattr(fn, "__name__", "run"))

    if topo.is_node_leader:
        make_row()
    recorder, reporter = start_recording(registry, run_id, folder)
    try:
        status, code, error = _call(fn, config, topo, folder, reporter)
    finally:
        reporter.close(2.5)  # the last reports go to the recorder, which writes them and closes
        recorder.close()

    if status == "failed" and registry.get_run(run_id) is None:
        # this rank failed before the node leader got as far as creating the row (it may have
        # been ended by torchrun meanwhile): create it, so the failure is not lost
        try:
            make_row()
        except Exception:  # noqa: BLE001 - the leader created it in the meantime
            pass
    close_row(registry, run_id, topo, status, error)
    if notify_urls and topo.rank == 0:  # one notice per run, with the row as it stands now
        notify.send_end(registry.get_run(run_id) or {"id": run_id, "status": status}, notify_urls)
    lost = recorder.received - recorder.written
    if lost or recorder.write_errors:
        print(f"gpu_lab.rank.headless: rank {topo.rank}: {lost} event(s) could not be written to "
              f"{registry.path} ({recorder.write_errors} failed write(s))", file=sys.stderr,
              flush=True)
    return code


def _in_job(fn: Any, config: Any, topo: Topology) -> int:
    """A rank of a submitted run: its job's supervisor owns the record (row, recorder, end) and
    handed this rank the channel in its environment; the rank leaves its result or its error in
    the run folder and exits with its code, which srun passes on."""
    from ..record import events as ev
    from ..record import reporter as rep
    from ..record.runfolder import RunFolder

    folder = RunFolder.from_env()
    if folder is None or not os.environ.get(ev.ENV_ADDRESS):
        print(f"gpu_lab.rank.headless: --in-job needs {ev.ENV_ADDRESS} and {ev.ENV_RUN_DIR}, "
              "which the job's supervisor (gpu_lab.cluster.job) sets", file=sys.stderr, flush=True)
        return outcome.EXIT_USAGE
    rep.reset_reporter()
    reporter = rep.get_reporter()
    try:
        _, code, _ = _call(fn, config, topo, folder, reporter)
    finally:
        reporter.close(2.5)
        # what reached the recorder is in the record; what did not is counted against this
        # (gpu_lab.cluster.relay): a recorder restarted mid-job loses what was on the way
        folder.write_sent(topo.rank, reporter.sent)
    return code


def start_recording(registry: Any, run_id: str, folder: Any) -> tuple[Any, Any]:
    """This rank's own recorder, and gpu_lab.report pointed at it. The recorder makes its own
    channel key: it never leaves this process and its children (DataLoader workers report too),
    and no other process needs it (nothing publishes)."""
    from ..record import events as ev
    from ..record import reporter as rep
    from ..record.channel import ENV_KEY
    from ..record.recorder import Recorder

    recorder = Recorder(registry, run_id, publish=False)
    os.environ.update({ev.ENV_RUN_ID: run_id, ev.ENV_ADDRESS: recorder.address,
                       ENV_KEY: recorder.client_key.encode(), ev.ENV_RUN_DIR: str(folder.path)})
    rep.reset_reporter()
    return recorder, rep.get_reporter()


def _call(fn: Any, config: Any, topo: Topology, folder: Any,
          reporter: Any) -> tuple[str, int, str | None]:
    """Run the training function; (status, exit code, error) of this rank, its result or its
    failure recorded in the run folder (gpu_lab.rank.outcome). A stop signal outside fit() ends
    it as 'stopped' with exit code 143 (outcome.raise_stopped)."""
    from . import adopt

    on_main = threading.current_thread() is threading.main_thread()
    if on_main:
        outcome.set_stop_handlers(outcome.raise_stopped)
    try:
        adopt.prepare()  # accelerate's group and tracker, as in a launched rank
        result = fn(config) if config is not None else fn()
        if topo.rank == 0:
            outcome.write_result(folder, result, reporter)
        return "succeeded", outcome.EXIT_OK, None
    except SystemExit as exc:
        code = outcome.exit_code(exc)
        if code == outcome.STOP_EXIT_CODE:
            return "stopped", code, f"rank {topo.rank}: {exc}"
        if code != 0:
            failure = outcome.write_exit(folder, topo.rank, exc)
            return "failed", code, f"rank {topo.rank}: {failure.type}: {failure.message}"
        return "succeeded", code, None
    except KeyboardInterrupt:
        return ("stopped", outcome.EXIT_INTERRUPTED,
                f"rank {topo.rank}: interrupted (SIGINT)")
    except BaseException as exc:  # noqa: BLE001 - recorded, then the process fails
        outcome.write_error(folder, topo.rank, exc)
        traceback.print_exc()
        return "failed", outcome.EXIT_FAILED, f"rank {topo.rank}: {type(exc).__name__}: {exc}"
    finally:
        if on_main:  # a second signal must not cut the bookkeeping short
            outcome.set_stop_handlers(signal.SIG_IGN)


def open_row(registry: Any, run_id: str, topo: Topology, config: Any, run_dir: Path,
              name: str) -> None:
    """Create this node's row, or revive it (a torchrun restart, a Slurm requeue)."""
    import psutil

    try:
        started = psutil.Process(topo.launcher_pid).create_time()
    except psutil.Error:
        started = None
    if registry.get_run(run_id) is None:
        registry.create_run(run_id, name=name, config=config.to_dict() if config else None,
                            num_processes=topo.local_world_size, num_nodes=topo.num_nodes,
                            node_rank=topo.node_rank, run_dir=str(run_dir),
                            output_dir=config.output_dir if config else None, kind=topo.launcher,
                            status="running")
    registry.update(run_id, status="running", ended=None, error=None, host=socket.gethostname(),
                    pid=topo.launcher_pid, pgid=None, pid_started=started)


def close_row(registry: Any, run_id: str, topo: Topology, status: str, error: str | None) -> None:
    """Record this rank's outcome in the node's row. A failure on any rank wins (the first one
    keeps its message: a dead rank makes the others fail with "connection closed"); a stop (a
    preemption, or torchrun ending the other ranks after one failed) never hides a failure; a
    success is local rank 0's word and only ends a row that is still active."""
    if status == "failed":
        row = registry.get_run(run_id)
        if row is None or row["status"] != "failed":  # the first failure is the root cause;
            # the others follow from it; it also replaces a 'stopped' that torchrun's ending of
            # the surviving ranks wrote first
            registry.set_status(run_id, "failed", error=error, overwrite=True)
        return
    if status == "succeeded" and not topo.is_node_leader:
        return
    row = registry.get_run(run_id)
    if row is not None and row["status"] in ACTIVE_STATUSES:
        registry.set_status(run_id, status, error=error)


if __name__ == "__main__":
    sys.exit(main())
