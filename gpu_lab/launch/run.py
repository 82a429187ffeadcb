"""Run: the kernel's handle on one launched training run."""
from __future__ import annotations

import json
import os
import pickle
import signal
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable

from ..registry import Registry
from ..stream import events as ev
from ..stream.history import MetricHistory
from . import triage

FINAL = ("succeeded", "failed", "stopped", "lost")


class RunFailedError(RuntimeError):
    """Raised by Run.result() when the run did not succeed."""


class Run:
    """A launched run. Returned at once by gpu_lab.launch(); the kernel stays free.

    status: pending → running → succeeded | failed | stopped.
    """

    def __init__(self, run_id: str, name: str, run_dir: Path, num_processes: int,
                 registry: Registry, config: Any = None, port: int | None = None,
                 device: str = "cpu") -> None:
        self.id = run_id
        self.name = name
        self.run_dir = Path(run_dir)
        self.num_processes = num_processes
        self.config = config
        self.port = port
        self.device = device
        self.pid: int | None = None
        self.metrics = MetricHistory()
        self.exitcode: int | None = None
        self._registry = registry
        self._status = "pending"
        self._done = threading.Event()
        self._progress = threading.Condition()  # notified on every metric batch and at the end
        self._last_step: dict[tuple[str, int], float] = {}  # (metric, rank) -> newest step
        self._subs: list[Callable[[list], None]] = []
        self._lock = threading.Lock()
        self._log_events: deque = deque(maxlen=500)
        self.dropped = 0
        self._error: triage.RunError | None = None

    # --- state -----------------------------------------------------------------------------------
    @property
    def status(self) -> str:
        return self._status

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> str:
        """Block until the run ends or `timeout` seconds pass; return the status."""
        self._done.wait(timeout)
        return self._status

    def wait_for_step(self, step: float, rank: int = 0, metric: str = "loss",
                      timeout: float | None = None) -> bool:
        """Block until `rank` has reported `metric` at `step` or later (True), or the run ended
        before that (False). Raises TimeoutError after `timeout` seconds. Woken by the events
        themselves: no polling."""
        def reached() -> bool:
            return self._last_step.get((metric, rank), float("-inf")) >= step

        with self._progress:
            if not self._progress.wait_for(lambda: reached() or self.done, timeout):
                raise TimeoutError(f"run {self.id}: rank {rank} did not report {metric!r} at step "
                                   f"{step} within {timeout} s (status {self._status})")
        return reached()

    def result(self, timeout: float | None = None) -> Any:
        """Rank 0's return value. Waits for the end; raises RunFailedError if it did not succeed."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"run {self.id} still {self._status} after {timeout} s")
        if self._status != "succeeded":
            detail = f"\n{self.error}" if self.error else ""
            raise RunFailedError(f"run {self.id} {self._status}; no result{detail}")
        p = self.run_dir / "result.pkl"
        if not p.exists():
            return None
        with open(p, "rb") as f:
            value = pickle.load(f)  # written by this run's own rank 0
        reason = getattr(value, "reason", None)
        if type(value).__name__ == "_Unpicklable":
            raise RunFailedError(f"rank 0's return value could not be pickled: {reason}")
        return value

    @property
    def error(self) -> triage.RunError | None:
        """Each failed rank with its exception type, message, traceback and triage category."""
        if self._error is None and self._status == "failed":
            self._error = self._load_errors()
        return self._error

    def _load_errors(self) -> triage.RunError | None:
        failures = []
        d = self.run_dir / "errors"
        if d.is_dir():
            for p in sorted(d.glob("rank*.json")):
                try:
                    failures.append(triage.RankFailure.from_dict(json.loads(p.read_text())))
                except (OSError, ValueError):
                    continue
        note = None
        sp = self.run_dir / "status.json"
        if sp.exists():
            try:
                note = json.loads(sp.read_text()).get("note") or None
            except ValueError:
                pass
        if not failures and note is None and self.exitcode is not None:
            note = f"supervisor exited with code {self.exitcode} without a status file"
        if not failures and note:
            note = note.strip().splitlines()[-1] if note.strip() else note
        return triage.RunError(failures, supervisor=note if not failures else None)

    def logs(self, rank: int | None = 0, tail: int | None = 50) -> str:
        """The last `tail` lines of a rank's stdout+stderr (rank=None: the supervisor's)."""
        name = "supervisor.log" if rank is None else f"rank{rank}.log"
        p = self.run_dir / "logs" / name
        if not p.exists():
            return ""
        with open(p, "rb") as f:
            if tail is None:
                return f.read().decode(errors="replace")
            f.seek(0, os.SEEK_END)
            size, block, data = f.tell(), 8192, b""
            while size > 0 and data.count(b"\n") <= tail:
                step = min(block, size)
                size -= step
                f.seek(size)
                data = f.read(step) + data
            return b"\n".join(data.splitlines()[-tail:]).decode(errors="replace")

    # --- events ----------------------------------------------------------------------------------
    def subscribe(self, fn: Callable[[list], None]) -> None:
        """Call fn(events) on the receiver thread for every batch of this run's events."""
        with self._lock:
            self._subs.append(fn)

    def unsubscribe(self, fn: Callable[[list], None]) -> None:
        with self._lock:
            if fn in self._subs:
                self._subs.remove(fn)

    def _on_events(self, events: list) -> None:
        rows = []
        progressed = False
        for e in events:
            kind = e["kind"]
            if kind == ev.METRIC:
                self.metrics.add(e["rank"], e.get("step"), e["t"], e["data"])
                progressed = True
                if e.get("step") is not None:
                    for k in e["data"]:
                        key = (k, e["rank"])
                        self._last_step[key] = max(self._last_step.get(key, e["step"]), e["step"])
                rows += [(self.id, e["rank"], e.get("step"), e["t"], k, v)
                         for k, v in e["data"].items() if isinstance(v, (int, float))]
            elif kind == ev.STATUS and e["data"].get("status") == "running" and self._status == "pending":
                self._status = "running"
            elif kind == ev.DROPPED:
                self.dropped = max(self.dropped, int(e["data"].get("count", 0)))
            elif kind == ev.LOG:
                self._log_events.append(e)
        if progressed:
            with self._progress:
                self._progress.notify_all()
        if rows:
            try:
                self._registry.add_metrics(rows)
            except Exception:  # noqa: BLE001 - a locked DB must not stop the stream
                pass
        with self._lock:
            subs = list(self._subs)
        for fn in subs:
            fn(events)

    def _finish(self, status: str, exitcode: int | None) -> None:
        self.exitcode = exitcode
        self._status = status
        if status == "failed":
            self._error = self._load_errors()
        self._registry.set_status(self.id, status,
                                  error=str(self._error) if self._error else None)
        self._done.set()
        with self._progress:
            self._progress.notify_all()
        e = ev.make(self.id, -1, ev.STATUS, {"status": status, "exitcode": exitcode})
        with self._lock:
            subs = list(self._subs)
        for fn in subs:
            try:
                fn([e])
            except Exception:  # noqa: BLE001
                pass

    # --- control ---------------------------------------------------------------------------------
    def request_checkpoint(self) -> None:
        """Ask the training loop to save a checkpoint at its next step boundary."""
        _touch(self.run_dir / "control" / "checkpoint")

    def stop(self, grace: float = 5.0, timeout: float = 15.0) -> str:
        """Stop the run: SIGTERM to its process group (the training loop checkpoints and exits),
        then SIGKILL to whatever is left after `grace` seconds. Returns the final status."""
        if self.done:
            return self._status
        if self.pid is not None:
            terminate_tree(self.pid, self.run_dir, grace=grace)
        self._done.wait(timeout)
        return self._status

    def dashboard(self, **kw: Any):
        """A live Dashboard widget for this run."""
        from ..widgets import Dashboard

        return Dashboard(self, **kw)

    def __repr__(self) -> str:
        return (f"Run(id={self.id!r}, name={self.name!r}, status={self._status!r}, "
                f"num_processes={self.num_processes})")

    def _repr_html_(self) -> str:
        import html

        color = {"running": "#1a7f37", "failed": "#b00", "stopped": "#9a6700",
                 "succeeded": "#0969da"}.get(self._status, "#555")
        step = self.metrics.last("loss")
        loss = f", last loss {step:.4g}" if step is not None else ""
        return (f"<b>{html.escape(self.name)}</b> <code>{html.escape(self.id)}</code> "
                f"<span style='color:{color}'>{self._status}</span> · {self.num_processes} "
                f"{'GPU' if self.device == 'cuda' else 'CPU'} rank(s){loss}")


def _touch(p: Path) -> None:
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(str(time.time()))


def terminate_tree(pid: int, run_dir: Path | None, grace: float = 5.0,
                   pid_started: float | None = None) -> None:
    """End a supervisor's whole process tree: graceful (SIGTERM), then forceful (SIGKILL).

    The tree is snapshotted first, because once the supervisor dies its workers are re-parented
    and can no longer be found through it; the process group catches anything started later.
    """
    import psutil

    if run_dir is not None:
        _touch(Path(run_dir) / "control" / "stop")
    try:
        sup = psutil.Process(pid)
        if pid_started is not None and abs(sup.create_time() - pid_started) > 1.0:
            return  # the pid was reused by an unrelated process
        procs = [sup] + sup.children(recursive=True)
    except psutil.Error:
        return
    try:
        pgid = os.getpgid(pid)
    except OSError:
        pgid = None
    if pgid is not None and pgid == os.getpgid(0):
        pgid = None  # never signal our own group (the supervisor failed to set its own)
    _signal_all(procs, pgid, signal.SIGTERM)
    # Poll rather than psutil.wait_procs: that would waitpid() the supervisor, which is our child,
    # and steal its exit status from the thread that waits for it.
    _wait_gone(procs, grace)
    leftover = [p for p in procs if _alive(p)]
    if leftover:
        _signal_all(leftover, pgid, signal.SIGKILL)
        _wait_gone(leftover, 5.0)


def _wait_gone(procs: list, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(_alive(p) for p in procs):
        time.sleep(0.05)


def _alive(p: Any) -> bool:
    import psutil

    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _signal_all(procs: list, pgid: int | None, sig: int) -> None:
    import psutil

    if pgid is not None:
        try:
            os.killpg(pgid, sig)
        except OSError:
            pass
    for p in procs:
        try:
            p.send_signal(sig)
        except psutil.Error:
            pass
