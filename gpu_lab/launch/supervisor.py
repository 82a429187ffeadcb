"""Code that runs in the forked supervisor and in each rank.

The supervisor is forked from the kernel (which is still CUDA-free), becomes the leader of its own
process group, detaches its output from the kernel's sockets, and calls accelerate's
notebook_launcher. notebook_launcher blocks and discards return values; that is fine here, because
the supervisor is not the kernel: rank 0 writes its return value to a file, each failed rank writes
its exception, and the supervisor writes the final status before it exits.
"""
from __future__ import annotations

import json
import os
import pickle
import signal
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..stream import events as ev
from . import triage

EXIT_OK, EXIT_FAILED, EXIT_STOPPED = 0, 1, 143


@dataclass
class Spec:
    """Everything the supervisor needs, fixed before the fork."""

    run_id: str
    run_dir: str
    fn: Callable
    args: tuple
    num_processes: int
    mixed_precision: str
    port: int
    device: str
    address: str
    registry_path: str
    master_addr: str = "127.0.0.1"
    num_nodes: int = 1
    node_rank: int = 0
    rdzv_backend: str = "static"
    env: dict = field(default_factory=dict)


def write_atomic(path: Path, data: bytes) -> None:
    """Write via a temp file in the same directory, fsync, rename: readers never see half a file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _redirect_output(path: Path) -> None:
    """Point fd 1/2 and sys.stdout/sys.stderr at a file (line-buffered). In a process forked from a
    kernel, the inherited sys.stdout writes into the kernel's zmq sockets: never use it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    sys.stdin = open(0, "r", closefd=False)


def _elastic_logs_in(folder: Path) -> str | None:
    """Make torch elastic's log folder a part of the run. Without a log_dir (notebook_launcher
    passes none), elastic makes a fresh tempfile.mkdtemp("torchelastic_") per launch and never
    removes it: one more folder in /tmp for every launch. Here, in the supervisor only, the temp dir
    is the run's `elastic/` folder; returns the one it replaces, which each rank sets back before
    the user's code runs (`RankEntry`)."""
    folder.mkdir(parents=True, exist_ok=True)
    previous, tempfile.tempdir = tempfile.tempdir, str(folder)
    return previous


class RankEntry:
    """The function each rank runs: set up output and reporting, check fork safety, call the
    user's function, keep its return value (rank 0) or its exception (any rank)."""

    def __init__(self, fn: Callable, run_dir: str, tempdir: str | None = None) -> None:
        self.fn = fn
        self.run_dir = Path(run_dir)
        self.tempdir = tempdir  # the temp dir the user's code gets (see `_elastic_logs_in`)
        self.__name__ = getattr(fn, "__name__", "train")  # elastic names the job after it
        self.__qualname__ = getattr(fn, "__qualname__", self.__name__)

    def __call__(self, *args: Any) -> None:
        rank = int(os.environ.get("RANK", "0"))
        tempfile.tempdir = self.tempdir
        _redirect_output(self.run_dir / "logs" / f"rank{rank}.log")
        from ..stream import reporter as rep

        rep.reset_reporter()
        reporter = rep.get_reporter()
        ranks = self.run_dir / "ranks"
        ranks.mkdir(exist_ok=True)
        write_atomic(ranks / f"rank{rank}.pid", str(os.getpid()).encode())
        try:
            import torch

            if torch._C._cuda_isInBadFork() and os.environ.get(ev.ENV_DEVICE) == "cuda":
                raise RuntimeError(
                    "CUDA was initialised in the process this worker was forked from (bad-fork "
                    "state). Restart the kernel and keep CUDA calls inside the training function.")
            reporter.status("running", pid=os.getpid())
            result = self.fn(*args)
        except SystemExit as exc:
            if exc.code == EXIT_STOPPED:  # preempted: the loop checkpointed and exits 143
                write_atomic(ranks / f"rank{rank}.preempted", str(time.time()).encode())
                reporter.status("preempted")
                reporter.close(1.0)
                raise
            self._record_failure(rank, exc, reporter)
            raise
        except BaseException as exc:  # noqa: BLE001 - recorded, then re-raised for the launcher
            self._record_failure(rank, exc, reporter)
            raise
        if rank == 0:
            try:
                payload = pickle.dumps(result)
            except Exception as exc:  # noqa: BLE001
                payload = pickle.dumps(_Unpicklable(f"{type(result).__name__}: {exc}"))
            write_atomic(self.run_dir / "result.pkl", payload)
        reporter.close(2.0)
        sys.stdout.flush()
        sys.stderr.flush()
        return None  # elastic would pickle a return value through a queue: keep it on disk

    def _record_failure(self, rank: int, exc: BaseException, reporter: Any) -> None:
        failure = triage.from_exception(rank, exc)
        failure.pid = os.getpid()
        errors = self.run_dir / "errors"
        errors.mkdir(exist_ok=True)
        write_atomic(errors / f"rank{rank}.json", json.dumps(failure.to_dict()).encode())
        traceback.print_exc()
        reporter.error(failure.to_dict())
        reporter.close(1.0)


@dataclass
class _Unpicklable:
    reason: str


def supervise(spec: Spec) -> None:
    """Body of the forked supervisor. Never returns: exits with 0, 1 or 143."""
    code = EXIT_FAILED
    status = "failed"
    run_dir = Path(spec.run_dir)
    note = ""
    try:
        os.setpgid(0, 0)
        _redirect_output(run_dir / "logs" / "supervisor.log")
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        os.environ.update({ev.ENV_RUN_ID: spec.run_id, ev.ENV_ADDRESS: spec.address,
                           ev.ENV_RUN_DIR: spec.run_dir, ev.ENV_DEVICE: spec.device})
        user_threads = spec.env.get("OMP_NUM_THREADS") or os.environ.get("OMP_NUM_THREADS")
        os.environ.update(spec.env)
        if "torch" in sys.modules:
            # The kernel has torch loaded, and maybe GNU OpenMP's thread pool from an earlier cell.
            # That pool does not survive a fork: a rank's first parallel region on several threads
            # then hangs forever (DataLoader workers set 1 thread for the same reason). So ranks
            # forked from here run one intra-op thread unless the user asked for more.
            n = int(user_threads) if user_threads and user_threads.isdigit() else 1
            os.environ["OMP_NUM_THREADS"] = str(n)
            sys.modules["torch"].set_num_threads(n)
        elif spec.device == "cpu" and spec.num_processes > 1 and not user_threads:
            # N ranks × all cores each would oversubscribe the CPU (torchrun does the same)
            os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // spec.num_processes))
        from ..registry import Registry

        reg = Registry(spec.registry_path)
        reg.update(spec.run_id, status="running")
        print(f"gpu_lab supervisor pid={os.getpid()} run={spec.run_id} ranks={spec.num_processes} "
              f"device={spec.device} port={spec.port}", flush=True)

        # SIGTERM from Run.stop(): become a SignalException inside the elastic agent, which then
        # terminates the workers; we record "stopped".
        from accelerate import notebook_launcher

        entry = RankEntry(spec.fn, spec.run_dir, tempdir=_elastic_logs_in(run_dir / "elastic"))
        monitor = RankMonitor(run_dir)
        monitor.start()
        try:
            if spec.num_nodes > 1:  # notebook_launcher does not rendezvous there: multinode.py
                from .multinode import launch_nodes

                launch_nodes(entry, spec.args,
                             num_processes=spec.num_processes, num_nodes=spec.num_nodes,
                             node_rank=spec.node_rank, master_addr=spec.master_addr,
                             port=spec.port, rdzv_backend=spec.rdzv_backend,
                             mixed_precision=spec.mixed_precision)
            else:
                notebook_launcher(entry, args=spec.args,
                                  num_processes=spec.num_processes,
                                  mixed_precision=spec.mixed_precision, use_port=str(spec.port),
                                  master_addr=spec.master_addr, node_rank=spec.node_rank,
                                  num_nodes=spec.num_nodes, rdzv_backend=spec.rdzv_backend)
            status, code = "succeeded", EXIT_OK
        except BaseException as exc:  # noqa: BLE001 - every outcome is recorded
            preempted = sorted(p.stem for p in (run_dir / "ranks").glob("*.preempted"))
            if (run_dir / "control" / "stop").exists() or _is_signal(exc):
                status, code = "stopped", EXIT_STOPPED
                note = f"stopped ({type(exc).__name__})"
            elif preempted and not any((run_dir / "errors").glob("rank*.json")):
                # SIGTERM/SIGUSR1 from a scheduler (spot reclaim, Slurm): checkpointed, resumable
                status, code = "stopped", EXIT_STOPPED
                note = f"preempted: {', '.join(preempted)} checkpointed and exited 143"
            else:
                status, code = "failed", EXIT_FAILED
                monitor.stop()
                _record_child_failures(exc, run_dir, monitor.deaths)
                note = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
                print(note, file=sys.stderr)
        write_atomic(run_dir / "status.json",
                     json.dumps({"status": status, "code": code, "t": time.time(),
                                 "note": note[-4000:]}).encode())
        reg.set_status(spec.run_id, status, error=note[-4000:] if status == "failed" else None)
    except BaseException:  # noqa: BLE001 - the supervisor itself broke
        try:
            traceback.print_exc()
            write_atomic(run_dir / "status.json", json.dumps(
                {"status": "failed", "code": EXIT_FAILED, "t": time.time(),
                 "note": traceback.format_exc()[-4000:]}).encode())
        except BaseException:  # noqa: BLE001
            pass
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _is_signal(exc: BaseException) -> bool:
    name = type(exc).__name__
    return name in ("SignalException", "KeyboardInterrupt") or isinstance(exc, KeyboardInterrupt)


class RankMonitor(threading.Thread):
    """Watches the ranks (children of this supervisor) die, without reaping them.

    The elastic agent reports only the failures it observes first: when rank 1 is SIGKILLed, rank
    0's gloo "connection reset" often wins, and the kill goes unreported. waitid(WNOWAIT) lets this
    thread see each rank's exit status and time while the agent still reaps it as usual.
    """

    def __init__(self, run_dir: Path) -> None:
        super().__init__(name="gpu_lab-rank-monitor", daemon=True)
        self.ranks_dir = run_dir / "ranks"
        self.deaths: dict[int, tuple[int, int, float]] = {}  # rank -> (pid, exitcode, time)
        self._stop_evt = threading.Event()

    def run(self) -> None:
        known: dict[int, int] = {}
        while not self._stop_evt.wait(0.02):
            if self.ranks_dir.is_dir():
                for p in self.ranks_dir.glob("rank*.pid"):
                    r = int(p.stem[4:])
                    if r not in known:
                        try:
                            known[r] = int(p.read_text())
                        except (OSError, ValueError):
                            continue
            for r, pid in known.items():
                if r in self.deaths:
                    continue
                try:
                    res = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
                except ChildProcessError:
                    continue  # already reaped, or not our child
                if res is None:
                    continue
                code = -res.si_status if res.si_code in (os.CLD_KILLED, os.CLD_DUMPED) \
                    else res.si_status
                self.deaths[r] = (pid, code, time.time())

    def stop(self) -> None:
        self._stop_evt.set()
        self.join(1)


def _record_child_failures(exc: BaseException, run_dir: Path,
                           deaths: dict[int, tuple[int, int, float]]) -> None:
    """Write an errors/rank{r}.json for every failed rank that did not write its own (killed)."""
    errors = run_dir / "errors"
    errors.mkdir(exist_ok=True)
    seen: dict[int, tuple[int | None, int | None, float | None]] = {
        r: (pid, code, t) for r, (pid, code, t) in deaths.items() if code != 0}
    for rank, pf in (getattr(exc, "failures", None) or {}).items():
        seen.setdefault(int(rank), (getattr(pf, "pid", None), getattr(pf, "exitcode", None), None))
    for rank, (pid, code, t) in seen.items():
        p = errors / f"rank{rank}.json"
        if p.exists():
            continue
        f = triage.from_exitcode(int(rank), code, pid, t)
        write_atomic(p, json.dumps(f.to_dict()).encode())
