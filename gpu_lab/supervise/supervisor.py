# Long: the supervisor's whole life (devices, recorder, ranks, end) reads best in one place.
"""The forked supervisor: what it does from the fork to its exit.

The supervisor is forked from the kernel (which is still CUDA-free), becomes the leader of its own
process group, lets go of the kernel's sockets and output, and calls accelerate's
notebook_launcher with the ranks' entry (gpu_lab.rank.entry). It owns the run's record: the
recorder process it starts receives every rank's events, writes them to the registry and
publishes them to any subscriber (the launching kernel is one). The run's channel is private: the
supervisor hands the recorder the run's keys over its stdin and the ranks the client key in their
environment (gpu_lab.record.channel); everything it and the ranks write in the run folder is the
owner's only (gpu_lab.record.runfolder). notebook_launcher blocks and discards return values; that
is fine here, because the supervisor is not the kernel: rank 0 writes its return value to a file,
each failed rank writes its exception (gpu_lab.rank.outcome), and the supervisor records the final
status, with its reason, before it exits; `decide_end` is the one place that decides it.

A run ends with its launching kernel unless it was launched with detach=True: the supervisor
watches its parent and, when the kernel is gone, stops the ranks the way Run.stop() does (they
checkpoint at the next step). The ranks die with the supervisor (a parent-death signal), so a
killed supervisor leaves no process behind.
"""
from __future__ import annotations

import os
import signal
import stat
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

from ..record import events as ev
from ..record.channel import ENV_KEY
from ..record.runfolder import RunFolder
from ..failures import triage
from ..rank import outcome
from ..rank.entry import RankEntry, redirect_output
from ..rank.outcome import EXIT_FAILED, EXIT_OK, STOP_EXIT_CODE, STOP_SIGNALS, kill_live_workers
from .claims import ClaimCancelled, DevicesBusy
from .multinode import NodeEnds, join_nodes, record_host
from .turn import try_devices, wait_turn


RDZV_BACKENDS = ("static", "c10d")


class _Stop(BaseException):
    """A stop signal reached the supervisor outside the elastic agent's own handler."""


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
    gpus: Any = None  # the devices to claim: N, [indices] or "all" (devices.py); None: one a rank
    priority: int = 0  # among this user's queued runs, higher first
    queue: bool = True  # False: refuse at once when the devices are taken
    # filled in by the launcher
    run_id: str = ""
    run_dir: str = ""
    device: str = "cpu"
    registry_path: str = ""
    keys: Any = None  # the run's channel keys (gpu_lab.record.channel.RunKeys)
    joined_fd: int | None = None  # where the kernel hears that the run has its place in the queue
    submitted: float | None = None  # time.time() of the launch: the run's place among the user's
    port_chosen: bool = False  # the launcher chose the port (then another may replace it)

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
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise TypeError(f"launch: priority must be a whole number (higher starts first among "
                            f"your queued runs); got {self.priority!r}")
        if not isinstance(self.queue, bool):
            raise TypeError(f"launch: queue must be True (wait for the devices) or False (refuse "
                            f"at once when they are taken); got {self.queue!r}")
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


def _elastic_logs_in(folder: RunFolder) -> str | None:
    """Make torch elastic's log folder a part of the run. Without a log_dir (notebook_launcher
    passes none), elastic makes a fresh tempfile.mkdtemp("torchelastic_") per launch and never
    removes it: one more folder in /tmp for every launch. Here, in the supervisor only, the temp dir
    is the run's `elastic/` folder; returns the one it replaces, which each rank sets back before
    the user's code runs (`RankEntry`)."""
    previous, tempfile.tempdir = tempfile.tempdir, str(folder.make_elastic_dir())
    return previous


@dataclass
class End:
    """How the run ended: what status.json, the registry and the exit code say."""

    status: str
    code: int
    reason: str | None = None
    note: str = ""


def supervise(spec: Spec) -> None:
    """Body of the forked supervisor. Never returns: exits with 0, 1 or 143."""
    folder = RunFolder(spec.run_dir)
    end = End("failed", EXIT_FAILED)
    claim = None
    nodes = None
    try:
        recorder = None
        try:
            _become_supervisor(folder)
            signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)  # until it holds the recorder
            claim, refused = try_devices(spec)
            recorder, where = _spawn_recorder(spec, folder)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # a stop meanwhile: raised here
            if refused is not None:  # recorded as the run's failure, now that it has a recorder
                raise refused
            claim = wait_turn(spec, recorder, claim)
            target, store = join_nodes(spec, recorder, where)
            if store is not None:  # the nodes' one end (multinode.NodeEnds)
                nodes = NodeEnds(store, spec.num_nodes, spec.node_rank)
                nodes.watch(folder)
            _ranks_environment(spec, target, claim)
            print(f"gpu_lab supervisor pid={os.getpid()} run={spec.run_id} "
                  f"ranks={spec.num_processes} device={spec.device} port={spec.port} "
                  f"devices={[d.index for d in claim.devices]} detach={spec.detach}", flush=True)
            error, in_launch, monitor = _run_ranks(spec, folder)
            store = None  # noqa: F841 - the rendezvous had it open too: theirs closes with them
        except BaseException as exc:  # noqa: BLE001 - the supervisor itself broke
            error, in_launch, monitor = exc, False, None
        _ignore_stop_signals()  # the bookkeeping below must not be cut short
        end = decide_end(folder, error, in_launch)
        if nodes is not None:
            status, reason = nodes.settle(end.status, end.reason,
                                          asked=folder.stop_reason() is not None)
            if (status, reason) != (end.status, end.reason):  # another node's stop ended it
                end = End(status, STOP_EXIT_CODE, reason, f"another node ended {status}; this "
                          f"node's ranks saw it as: {end.note[-2000:]}")
        if end.status == "failed" and monitor is not None:
            monitor.stop()
            _record_child_failures(error, folder, monitor.deaths)
        if error is not None and (end.status == "failed" or not in_launch):
            print("".join(traceback.format_exception(type(error), error, error.__traceback__)),
                  file=sys.stderr)
        # The traceback holds the elastic agent and its rendezvous store: freed now, the store's
        # client closes first. Kept until the exit, the server's side closes first, and the port
        # stays taken (TIME_WAIT) for a minute after the run.
        error = None
        _record_end(folder, recorder, end)
        if claim is not None:  # once its end is recorded: a run's [started, ended] is its own
            claim.release()
        if nodes is not None:
            nodes.hold()
    except BaseException:  # noqa: BLE001 - nothing is left to record it with
        pass
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
            # a one-process run trains in this process: its loader workers, which ignore stop
            # signals, would outlive it for seconds and hold the run's stop until they noticed
            kill_live_workers()
        finally:
            os._exit(end.code)


def decide_end(folder: RunFolder, error: BaseException | None, in_launch: bool) -> End:
    """The run's end, decided here only: from what ended the ranks' launch (`error`: None when it
    returned; in_launch=False: the supervisor itself broke, or was stopped outside the launch) and
    from the run folder (a stop request, ranks that checkpointed and exited 143, errors)."""
    stop = folder.stop_reason()  # None: no stop was requested
    asked = folder.stop_status() if stop is not None else "stopped"  # a sweep's stop: pruned
    if error is None:
        if stop is not None:  # the loop saw the request first, saved, and returned early
            return End(asked, STOP_EXIT_CODE, stop or "stopped by the user")
        return End("succeeded", EXIT_OK)
    trace = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    if not in_launch:
        if isinstance(error, ClaimCancelled):  # its kernel exited while it waited its turn
            return End("stopped", STOP_EXIT_CODE, stop or f"withdrawn from the queue: "
                       f"{ParentWatch.REASON}")
        if isinstance(error, DevicesBusy):  # queue=False, and the devices were taken
            return End("failed", EXIT_FAILED, None, str(error))
        if isinstance(error, _Stop):
            return End("stopped", STOP_EXIT_CODE, stop or "stopped by a signal", trace[-4000:])
        return End("failed", EXIT_FAILED, None, trace[-4000:])
    name = type(error).__name__
    if stop is not None or _is_signal(error):
        return End(asked, STOP_EXIT_CODE, stop or f"stopped by a signal ({name})",
                   f"stopped ({name})")
    preempted = folder.preempted_ranks()
    if preempted and not folder.has_errors():
        # a stop signal from a scheduler (spot reclaim, Slurm): checkpointed, resumable
        why = f"preempted: {', '.join(preempted)} checkpointed and exited {STOP_EXIT_CODE}"
        return End("stopped", STOP_EXIT_CODE, why, why)
    return End("failed", EXIT_FAILED, None, trace)


def _become_supervisor(folder: RunFolder) -> None:
    """A process group of its own, the kernel's sockets and output let go, stop signals caught."""
    os.setpgid(0, 0)
    _release_inherited_sockets()
    redirect_output(folder.log_file(None))
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    outcome.set_stop_handlers(_raise_stop)  # elastic replaces them while the ranks run


def _spawn_recorder(spec: Spec, folder: RunFolder) -> tuple[Any, dict]:
    """Start the run's recorder, with the stop signals blocked; the caller unblocks them once it
    holds the recorder. The recorder is a process of its own: this one is a fork of the kernel,
    where SQLite must not be used (see gpu_lab.record.recorder). A stop that arrives while it
    starts waits until it is up, so that it hears the end."""
    from ..record import recorder as rec

    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        host = "127.0.0.1"
        if spec.num_nodes > 1 and spec.node_rank == 0:  # the other nodes' ranks report here
            host = record_host(spec.master_addr)
        recorder, where = rec.spawn(spec.registry_path, spec.run_id, str(folder.log_file(None)),
                                    _keys(spec), host=host)
        recorder.keep()  # a recorder that dies (the OOM killer) is replaced; the ranks go on
        return recorder, where
    except BaseException:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
        raise


def _ranks_environment(spec: Spec, target: dict, claim: Any) -> None:
    """What the ranks inherit: the run they report to, its recorder's address and a client key,
    the device, the devices it claimed, the user's variables, and a thread count that is safe
    after a fork."""
    # the ranks inherit the client key with the address: the environment of a process is
    # readable by its own user only (not by `ps` of another user, unlike a command line)
    os.environ.update({ev.ENV_RUN_ID: target["run"], ev.ENV_ADDRESS: target["address"],
                       ENV_KEY: target["key"].encode(),
                       ev.ENV_RUN_DIR: spec.run_dir, ev.ENV_DEVICE: spec.device})
    if claim.kind == "gpu":  # the ranks see their GPUs only; this process stays CUDA-free
        os.environ.update(claim.env())
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


def _run_ranks(spec: Spec, folder: RunFolder) -> tuple[BaseException | None, bool, "RankMonitor"]:
    """Start the ranks and block until they end: (what ended the launch or None, True, the
    monitor of the ranks' deaths). A stop (Run.stop()'s SIGTERM) becomes a SignalException inside
    the elastic agent, which then terminates the workers."""
    watch = ParentWatch(os.getppid(), folder)
    if not spec.detach:
        watch.start()
    from accelerate import notebook_launcher

    entry = RankEntry(spec.fn, spec.run_dir, tempdir=_elastic_logs_in(folder))
    monitor = RankMonitor(folder)
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
            for attempt in range(3):
                try:
                    notebook_launcher(entry, args=spec.args,
                                      num_processes=spec.num_processes,
                                      mixed_precision=spec.mixed_precision,
                                      use_port=str(spec.port), master_addr=spec.master_addr,
                                      node_rank=spec.node_rank, num_nodes=spec.num_nodes,
                                      rdzv_backend=spec.rdzv_backend)
                    break
                except Exception as exc:  # noqa: BLE001 - only a taken port is tried again
                    if not (spec.port_chosen and attempt < 2 and _port_taken(exc)):
                        raise
                    # the free port the launcher found was taken before the store bound it
                    # (no rank has started yet): another one
                    from .ports import free_port

                    old, spec.port = spec.port, free_port(spec.master_addr)
                    print(f"gpu_lab supervisor: port {old} was taken before the ranks' store "
                          f"could listen on it; trying port {spec.port}", file=sys.stderr)
    except BaseException as exc:  # noqa: BLE001 - every outcome is recorded
        _ignore_stop_signals()  # the bookkeeping that follows must not be cut short
        watch.done.set()
        return exc, True, monitor  # (not kept in a local: that would be a reference cycle)
    watch.done.set()
    return None, True, monitor


def _port_taken(exc: BaseException) -> bool:
    text = f"{type(exc).__name__}: {exc}"
    return "EADDRINUSE" in text or "address already in use" in text.lower()


def _keys(spec: Spec) -> Any:
    """The run's channel keys: the launcher's, else (a Spec made elsewhere) fresh ones, whose
    client key is then written where the owner's readers find it."""
    from ..record.channel import RunKeys, save_client_key

    if spec.keys is None:
        spec.keys = RunKeys.new()
        save_client_key(spec.run_dir, spec.keys.client)
    return spec.keys


def _record_end(folder: RunFolder, recorder: Any, end: End) -> None:
    """The run's last word: status.json, then the recorder writes the final status event and the
    registry row in one transaction, publishes the event, and exits."""
    try:
        folder.write_status({"status": end.status, "code": end.code, "t": time.time(),
                             "reason": end.reason, "note": end.note[-4000:]})
    except OSError as exc:  # a full disk: the recorder writes the end with its reserve
        print(f"gpu_lab supervisor: the run's status file could not be written "
              f"({exc.strerror})", file=sys.stderr)
    if recorder is not None:
        from ..record.recorder import end as record_end

        record_end(recorder, {"status": end.status, "exitcode": end.code, "reason": end.reason,
                              "error": end.note[-4000:] if end.status == "failed" else None})


def _raise_stop(signum: int, frame: Any) -> None:
    raise _Stop(signum)


def _ignore_stop_signals() -> None:
    outcome.set_stop_handlers(signal.SIG_IGN)
    signal.signal(outcome.INTERRUPT_SIGNAL, signal.SIG_IGN)


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


class ParentWatch(threading.Thread):
    """In a run launched with detach=False: when the launching kernel (or script) exits, however
    it exits, stop the run the way Run.stop() does, with the reason recorded."""

    REASON = "the launching kernel exited"

    def __init__(self, parent: int, folder: RunFolder, interval: float = 0.25) -> None:
        super().__init__(name="gpu_lab-parent-watch", daemon=True)
        self.parent, self.folder, self.interval = parent, folder, interval
        self.done = threading.Event()  # the ranks have ended: nothing left to stop

    def run(self) -> None:
        while os.getppid() == self.parent:
            if self.done.wait(self.interval):
                return
        self.folder.request("stop", self.REASON)
        print(f"gpu_lab supervisor: {self.REASON}; stopping the run", flush=True)
        os.killpg(0, signal.SIGTERM)  # ranks checkpoint at the next step; the agent then returns


def _is_signal(exc: BaseException) -> bool:
    name = type(exc).__name__
    return name in ("SignalException", "KeyboardInterrupt") or isinstance(exc, (KeyboardInterrupt,
                                                                              _Stop))


class RankMonitor(threading.Thread):
    """Watches the ranks (children of this supervisor) die, without reaping them.

    The elastic agent reports only the failures it observes first: when rank 1 is SIGKILLed, rank
    0's gloo "connection reset" often wins, and the kill goes unreported. waitid(WNOWAIT) lets this
    thread see each rank's exit status and time while the agent still reaps it as usual.
    """

    def __init__(self, folder: RunFolder) -> None:
        super().__init__(name="gpu_lab-rank-monitor", daemon=True)
        self.folder = folder
        self.deaths: dict[int, tuple[int, int, float]] = {}  # rank -> (pid, exitcode, time)
        self._stop_evt = threading.Event()

    def run(self) -> None:
        known: dict[int, int] = {}
        while not self._stop_evt.wait(0.02):
            known.update(self.folder.rank_pids(skip=known))
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


def _record_child_failures(exc: BaseException, folder: RunFolder,
                           deaths: dict[int, tuple[int, int, float]]) -> None:
    """Record the failure of every failed rank that did not record its own (killed)."""
    seen: dict[int, tuple[int | None, int | None, float | None]] = {
        r: (pid, code, t) for r, (pid, code, t) in deaths.items() if code != 0}
    for rank, pf in (getattr(exc, "failures", None) or {}).items():
        seen.setdefault(int(rank), (getattr(pf, "pid", None), getattr(pf, "exitcode", None), None))
    for rank, (pid, code, t) in seen.items():
        if not folder.has_error(int(rank)):
            folder.write_error(int(rank), triage.from_exitcode(int(rank), code, pid, t).to_dict())
