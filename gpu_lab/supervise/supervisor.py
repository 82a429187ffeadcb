# Long: everything that runs in the forked supervisor and in its ranks, fixed before the fork.
"""Code that runs in the forked supervisor and in each rank.

The supervisor is forked from the kernel (which is still CUDA-free), becomes the leader of its own
process group, lets go of the kernel's sockets and output, and calls accelerate's
notebook_launcher. It owns the run's record: the recorder process it starts receives every rank's
events, writes them to the registry and publishes them to any subscriber (the launching kernel is
one). The run's channel is private: the supervisor hands the recorder the run's keys over its
stdin and the ranks the client key in their environment (gpu_lab.record.channel); everything it
and the ranks write in the run folder is the owner's only (gpu_lab.access).
notebook_launcher blocks and discards return values; that is fine here, because the supervisor is
not the kernel: rank 0 writes its return value to a file, each failed rank writes its exception,
and the supervisor records the final status, with its reason, before it exits.

A run ends with its launching kernel unless it was launched with detach=True: the supervisor
watches its parent and, when the kernel is gone, stops the ranks the way Run.stop() does (they
checkpoint at the next step). The ranks die with the supervisor (a parent-death signal), so a
killed supervisor leaves no process behind.
"""
from __future__ import annotations

import json
import os
import pickle
import signal
import stat
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..access import private_dir
from ..record import events as ev
from ..record.channel import ENV_KEY
from ..failures import triage

EXIT_OK, EXIT_FAILED, EXIT_STOPPED = 0, 1, 143


RDZV_BACKENDS = ("static", "c10d")


class _Stop(BaseException):
    """SIGTERM or SIGHUP reached the supervisor outside the elastic agent's own handler."""


@dataclass
class Spec:
    """What a launch asked for (checked on construction, before anything starts), and what the
    launcher fills in once the run exists: everything the supervisor needs, fixed before the fork."""

    fn: Callable
    args: tuple = ()
    num_processes: int | None = None
    mixed_precision: str = "no"
    name: str | None = None
    detach: bool = False
    num_nodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    port: int | None = None
    rdzv_backend: str = "static"
    env: dict = field(default_factory=dict)
    # filled in by the launcher
    run_id: str = ""
    run_dir: str = ""
    device: str = "cpu"
    registry_path: str = ""
    keys: Any = None  # the run's channel keys (gpu_lab.record.channel.RunKeys)

    def __post_init__(self) -> None:
        from ..config import MixedPrecision

        if not callable(self.fn):
            raise TypeError(f"launch: fn must be callable (a training function); got "
                            f"{type(self.fn).__name__}")
        n = self.num_processes
        if n is not None and (isinstance(n, bool) or not isinstance(n, int)):
            raise TypeError(f"launch: num_processes must be an int >= 1 or None; got {n!r}")
        if n is not None and n < 1:
            raise ValueError(f"launch: num_processes must be >= 1 or None; got {n}")
        if self.mixed_precision not in MixedPrecision.choices():
            raise ValueError(f"launch: mixed_precision: got {self.mixed_precision!r}; accepted: "
                             f"{', '.join(map(repr, MixedPrecision.choices()))}")
        if self.name is not None and (not isinstance(self.name, str) or not self.name.strip()):
            raise ValueError(f"launch: name must be a non-empty string or None; got {self.name!r}")
        if not isinstance(self.detach, bool):
            raise TypeError(f"launch: detach must be True or False; got {self.detach!r}")
        for label, v in (("num_nodes", self.num_nodes), ("node_rank", self.node_rank)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"launch: {label} must be an int; got {v!r}")
        if self.num_nodes < 1:
            raise ValueError(f"launch: num_nodes must be >= 1; got {self.num_nodes}")
        if not 0 <= self.node_rank < self.num_nodes:
            raise ValueError(f"launch: node_rank must be in [0, num_nodes-1] = "
                             f"[0, {self.num_nodes - 1}]; got {self.node_rank}")
        if self.rdzv_backend not in RDZV_BACKENDS:
            raise ValueError(f"launch: rdzv_backend: got {self.rdzv_backend!r}; accepted: "
                             f"{', '.join(map(repr, RDZV_BACKENDS))}")
        if not isinstance(self.master_addr, str) or not self.master_addr:
            raise ValueError(f"launch: master_addr must be a host name or address; got "
                             f"{self.master_addr!r}")
        p = self.port
        if p is not None and (isinstance(p, bool) or not isinstance(p, int) or not 1 <= p <= 65535):
            raise ValueError(f"launch: port must be an int in 1..65535 or None; got {p!r}")
        if self.num_nodes > 1 and p is None:
            raise ValueError("launch: port is required when num_nodes > 1 (every node must use the "
                             "master's port); pick one on the master node, e.g. 29400")

    def check_device(self, gpus: int) -> None:
        """What this host's GPUs (NVML's count) allow."""
        if self.device == "cuda" and self.num_processes is not None and self.num_processes > gpus:
            raise ValueError(f"launch: num_processes={self.num_processes} but this host has {gpus} "
                             "GPU(s) visible; use at most that many (one process per GPU)")
        if self.device == "cpu" and self.mixed_precision == "fp16":
            raise ValueError("launch: mixed_precision='fp16' needs a GPU (CPU autocast supports "
                             "bf16); accepted here: 'no', 'bf16'")


def write_atomic(path: Path, data: bytes) -> None:
    """Write via a temp file in the same directory, fsync, rename: readers never see half a file.
    The file is the owner's only (a run file: gpu_lab.access), whatever the umask."""
    from ..access import open_private

    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(open_private(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _redirect_output(path: Path) -> None:
    """Point fd 1/2 and sys.stdout/sys.stderr at a file (line-buffered). In a process forked from a
    kernel, the inherited sys.stdout writes into the kernel's zmq sockets: never use it."""
    from ..access import open_private

    private_dir(path.parent)
    fd = open_private(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
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
    private_dir(folder)
    previous, tempfile.tempdir = tempfile.tempdir, str(folder)
    return previous


class RankEntry:
    """The function each rank runs: set up output and reporting, check fork safety, call the
    user's function, keep its return value (rank 0) or its exception (any rank)."""

    def __init__(self, fn: Callable, run_dir: str, tempdir: str | None = None) -> None:
        self.fn = fn
        self.run_dir = Path(run_dir)
        self.tempdir = tempdir  # the temp dir the user's code gets (see `_elastic_logs_in`)
        self.supervisor_pid = os.getpid()
        self.__name__ = getattr(fn, "__name__", "train")  # elastic names the job after it
        self.__qualname__ = getattr(fn, "__qualname__", self.__name__)

    def __call__(self, *args: Any) -> None:
        rank = int(os.environ.get("RANK", "0"))
        if os.getpid() != self.supervisor_pid:  # one rank runs in the supervisor itself
            _die_with_parent(self.supervisor_pid)
        tempfile.tempdir = self.tempdir
        _redirect_output(self.run_dir / "logs" / f"rank{rank}.log")
        from ..record import reporter as rep

        rep.reset_reporter()
        reporter = rep.get_reporter()
        ranks = private_dir(self.run_dir / "ranks")
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
        errors = private_dir(self.run_dir / "errors")
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
    reason: str | None = None
    recorder = None
    try:
        os.setpgid(0, 0)
        _release_inherited_sockets()
        _redirect_output(run_dir / "logs" / "supervisor.log")
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        for sig in (signal.SIGTERM, signal.SIGHUP):  # elastic replaces it while the ranks run
            signal.signal(sig, _raise_stop)
        from ..record import recorder as rec

        # The recorder is a process of its own: this one is a fork of the kernel, where SQLite
        # must not be used (see gpu_lab.record.recorder). A stop that arrives while it starts
        # waits until it is up, so that it hears the end.
        stops = {signal.SIGTERM, signal.SIGHUP}
        signal.pthread_sigmask(signal.SIG_BLOCK, stops)
        try:
            recorder, where = rec.spawn(spec.registry_path, spec.run_id,
                                        str(run_dir / "logs" / "supervisor.log"), _keys(spec))
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, stops)
        # the ranks inherit the client key with the address: the environment of a process is
        # readable by its own user only (not by `ps` of another user, unlike a command line)
        os.environ.update({ev.ENV_RUN_ID: spec.run_id, ev.ENV_ADDRESS: where["address"],
                           ENV_KEY: spec.keys.client.encode(),
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
        print(f"gpu_lab supervisor pid={os.getpid()} run={spec.run_id} ranks={spec.num_processes} "
              f"device={spec.device} port={spec.port} detach={spec.detach}", flush=True)
        watch = ParentWatch(os.getppid(), run_dir)
        if not spec.detach:
            watch.start()

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
            stop_file = run_dir / "control" / "stop"
            if stop_file.exists():  # the loop saw the request first, saved, and returned early
                status, code = "stopped", EXIT_STOPPED
                reason = _read_reason(stop_file) or "stopped by the user"
        except BaseException as exc:  # noqa: BLE001 - every outcome is recorded
            _ignore_stop_signals()  # the bookkeeping below must not be cut short
            watch.done.set()
            preempted = sorted(p.stem for p in (run_dir / "ranks").glob("*.preempted"))
            stop_file = run_dir / "control" / "stop"
            if stop_file.exists() or _is_signal(exc):
                status, code = "stopped", EXIT_STOPPED
                reason = _read_reason(stop_file) or f"stopped by a signal ({type(exc).__name__})"
                note = f"stopped ({type(exc).__name__})"
            elif preempted and not any((run_dir / "errors").glob("rank*.json")):
                # SIGTERM/SIGUSR1 from a scheduler (spot reclaim, Slurm): checkpointed, resumable
                status, code = "stopped", EXIT_STOPPED
                reason = note = f"preempted: {', '.join(preempted)} checkpointed and exited 143"
            else:
                status, code = "failed", EXIT_FAILED
                monitor.stop()
                _record_child_failures(exc, run_dir, monitor.deaths)
                note = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
                print(note, file=sys.stderr)
        _ignore_stop_signals()
        watch.done.set()
        _record_end(run_dir, recorder, status, code, note, reason)
    except BaseException:  # noqa: BLE001 - the supervisor itself broke
        try:
            _ignore_stop_signals()
            traceback.print_exc()
            note = traceback.format_exc()[-4000:]
            if isinstance(sys.exc_info()[1], _Stop):
                status, code = "stopped", EXIT_STOPPED
                reason = _read_reason(run_dir / "control" / "stop") or "stopped by a signal"
            else:
                status, code = "failed", EXIT_FAILED
            _record_end(run_dir, recorder, status, code, note, reason)
        except BaseException:  # noqa: BLE001
            pass
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
            # a one-process run trains in this process: its loader workers, which ignore stop
            # signals, would outlive it for seconds and hold the run's stop until they noticed
            from ..data.workers import kill_live_workers

            kill_live_workers()
        finally:
            os._exit(code)


def _keys(spec: Spec) -> Any:
    """The run's channel keys: the launcher's, else (a Spec made elsewhere) fresh ones, whose
    client key is then written where the owner's readers find it."""
    from ..record.channel import RunKeys, save_client_key

    if spec.keys is None:
        spec.keys = RunKeys.new()
        save_client_key(spec.run_dir, spec.keys.client)
    return spec.keys


def _record_end(run_dir: Path, recorder: Any, status: str, code: int, note: str,
                reason: str | None) -> None:
    """The run's last word: status.json, then the recorder writes the final status event and the
    registry row in one transaction, publishes the event, and exits."""
    write_atomic(run_dir / "status.json",
                 json.dumps({"status": status, "code": code, "t": time.time(), "reason": reason,
                             "note": note[-4000:]}).encode())
    if recorder is not None:
        from ..record.recorder import end

        end(recorder, {"status": status, "exitcode": code, "reason": reason,
                       "error": note[-4000:] if status == "failed" else None})


def _raise_stop(signum: int, frame: Any) -> None:
    raise _Stop(signum)


def _ignore_stop_signals() -> None:
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)


def _read_reason(stop_file: Path) -> str | None:
    try:
        text = stop_file.read_text().strip()
    except OSError:
        return None
    try:
        float(text)  # an older stop request holds a time stamp, not a reason
        return "stopped by the user"
    except ValueError:
        return text or None


def _release_inherited_sockets() -> None:
    """Let go of the sockets inherited from the kernel (its zmq ports, its server connections):
    held here, they would keep the kernel's ports bound after it exits, and a restarted kernel,
    which binds the same ports, would fail. Each is replaced by /dev/null rather than closed, so
    the number stays taken and no leftover object can close an unrelated file by it later."""
    fd_dir = "/proc/self/fd"
    if not os.path.isdir(fd_dir):
        return
    null = os.open(os.devnull, os.O_RDWR)
    try:
        for name in os.listdir(fd_dir):
            fd = int(name)
            if fd <= 2 or fd == null:
                continue
            try:
                if stat.S_ISSOCK(os.fstat(fd).st_mode):
                    os.dup2(null, fd)
            except OSError:  # the listing's own descriptor, already closed
                continue
    finally:
        os.close(null)


def _die_with_parent(parent: int) -> None:
    """Ask Linux to SIGTERM this rank when its supervisor dies (killed, say): the rank then
    checkpoints and exits like a preempted one instead of training on, unwatched, forever."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the rank outlives a killed supervisor
        return
    if os.getppid() != parent:  # it died before the request took hold
        os.kill(os.getpid(), signal.SIGTERM)


class ParentWatch(threading.Thread):
    """In a run launched with detach=False: when the launching kernel (or script) exits, however
    it exits, stop the run the way Run.stop() does, with the reason recorded."""

    REASON = "the launching kernel exited"

    def __init__(self, parent: int, run_dir: Path, interval: float = 0.25) -> None:
        super().__init__(name="gpu_lab-parent-watch", daemon=True)
        self.parent, self.run_dir, self.interval = parent, run_dir, interval
        self.done = threading.Event()  # the ranks have ended: nothing left to stop

    def run(self) -> None:
        while os.getppid() == self.parent:
            if self.done.wait(self.interval):
                return
        control = private_dir(self.run_dir / "control")
        write_atomic(control / "stop", self.REASON.encode())
        print(f"gpu_lab supervisor: {self.REASON}; stopping the run", flush=True)
        os.killpg(0, signal.SIGTERM)  # ranks checkpoint at the next step; the agent then returns


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
    errors = private_dir(run_dir / "errors")
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
