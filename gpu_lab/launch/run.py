# Long: a run's handle answers every question a user asks of a run, from any process.
"""Run: a handle on one training run, from the kernel that launched it or from any other process.

The run's record belongs to the run: its supervisor records every event in the registry and
publishes it live. A Run handle is one subscriber among others. `gpu_lab.launch` returns one;
`gpu_lab.attach(id_or_name)` makes one for any run on this host (a bounded history from the
registry's downsampled levels, then the live events), and both work the same: status, wait,
wait_for_step, stop, request_checkpoint, logs, error, result, resume. A view is built from a
handle (gpu_lab.Dashboard(run)): the handle never imports its views.
"""
from __future__ import annotations

import os
import threading
from collections import deque
from pathlib import Path
from typing import Any, Callable

from ..record.registry import Registry
from ..record import events as ev
from ..record.runfolder import RunFolder
from ..rank import outcome
from ..readers.runmetrics import ATTACH_POINTS, RunMetrics
from ..failures import triage
from ..supervise.kill import terminate_tree

FINAL = ev.FINAL_STATUSES
NOTES_KEPT = 500  # newest events of each non-metric kind read at attach (their totals are counted)
NOTE_KINDS = (ev.STATUS, ev.DROPPED, ev.ERROR, ev.LOG)


class RunFailedError(RuntimeError):
    """Raised by Run.result() when the run did not succeed."""


class Run:
    """A training run. Returned at once by gpu_lab.launch(), or by gpu_lab.attach().

    status: pending → running → succeeded | failed | stopped (| lost: its supervisor died).
    `reason` says why a run stopped; `resumed_from` is {"run", "step", "path"} for a run that
    continues another's checkpoint.
    """

    # the launch function, for resume(): set by gpu_lab.launch.launcher, which makes Run handles
    # (the handle never imports its launcher)
    _launch: Callable[..., "Run"] | None = None
    # the handle of a run that is a scheduler's job (a row with `job`): set by gpu_lab.launch.submit
    _job_handle: type["Run"] | None = None

    def __init__(self, run_id: str, name: str, run_dir: Path, num_processes: int,
                 registry: Registry, config: Any = None, port: int | None = None,
                 device: str = "cpu", *, detach: bool = False, output_dir: str | None = None,
                 resumed_from: dict | None = None, owner: bool = True) -> None:
        self.id = run_id
        self.name = name
        self.run_dir = Path(run_dir)
        self.folder = RunFolder(self.run_dir)
        self.num_processes = num_processes
        self.config = config
        self.port = port
        self.device = device
        self.detach = detach
        self.output_dir = output_dir
        self.resumed_from = resumed_from
        self.owner = owner  # launched by this process (it is the supervisor's parent)
        self.pid: int | None = None
        self.pid_started: float | None = None
        self.metrics = RunMetrics(registry, run_id)
        self.history_counts: dict[str, int] = {}  # attach: events of each non-metric kind recorded
        self.exitcode: int | None = None
        self.reason: str | None = None
        self._fn: Callable | None = None  # the training function and its args, for resume()
        self._args: tuple = ()
        self._launch_kw: dict = {}
        self._registry = registry
        self._status = "pending"
        self.queue_position: int | None = None  # 1 = next to start, while queued
        self._seq = 0
        self._done = threading.Event()
        # the launching process learns of the end once it has reaped the supervisor: when wait()
        # returns there, no process of the run is left
        self._reaped = threading.Event()
        self._final: dict | None = None
        self._progress = threading.Condition()  # notified on every metric batch and at the end
        self._last_step: dict[tuple[str, int], float] = {}  # (metric, rank) -> newest step
        self._subs: list[Callable[[list], None]] = []
        self._lock = threading.Lock()
        self._log_events: deque = deque(maxlen=500)
        self.dropped = 0
        self._dropped_by_rank: dict[int, int] = {}
        self._error: triage.RunError | None = None

    @classmethod
    def _from_row(cls, row: dict, registry: Registry) -> "Run":
        if cls is Run and row.get("job") and Run._job_handle is not None:
            cls = Run._job_handle
        cfg = row.get("config") or None
        if cfg:
            from ..config import TrainConfig

            try:
                cfg = TrainConfig.from_dict(cfg)
            except (TypeError, ValueError):
                pass  # a config of another version: keep the dict
        run = cls(row["id"], row.get("name") or row["id"],
                  Path(row["run_dir"]) if row.get("run_dir") else Path(),
                  int(row.get("num_processes") or 0), registry, config=cfg,
                  detach=bool(row.get("detach")), output_dir=row.get("output_dir"),
                  resumed_from=row.get("resumed_from"), owner=False)
        run.pid, run.pid_started = row.get("pid"), row.get("pid_started")
        run._entry = row.get("entry")
        run._row_error = row.get("error")
        run._apply_row(row)
        return run

    def _apply_row(self, row: dict) -> None:
        if row["status"] in ev.ACTIVE_STATUSES and self._status in ("pending", "queued"):
            self._status = row["status"]
            self.queue_position = row.get("queue_position")
        if row["status"] in FINAL:
            self._finish(row["status"], reason=row.get("reason"), announce=False)

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
            detail = f"\n{self.error}" if self.error else (f" ({self.reason})" if self.reason else "")
            raise RunFailedError(f"run {self.id} {self._status}; no result{detail}")
        if not self.folder.result_file.exists() and self.run_dir.name and self._holds_rank0():
            raise RunFailedError(f"run {self.id} succeeded, but rank 0's return value is not in "
                                 f"{self.folder.result_file} (it could not be written there, "
                                 "or the folder was removed)"
                                 + (f" ({self.note})" if self.note else ""))
        value = outcome.read_result(self.folder)
        if isinstance(value, outcome.Unpicklable):
            raise RunFailedError(f"rank 0's return value could not be pickled: {value.reason}")
        return value

    def _holds_rank0(self) -> bool:
        """Whether global rank 0 ran in this run (node 0 of a multi-node launch holds it)."""
        try:
            row = self._registry.get_run(self.id) or {}
        except Exception:  # noqa: BLE001 - a registry that cannot be read: assume it did
            return True
        return not row.get("node_rank")

    @property
    def note(self) -> str | None:
        """What the run's record says of itself, when there is something to say: for example
        that its disk was full and the record paused (read from the registry's row)."""
        try:
            row = self._registry.get_run(self.id)
        except Exception:  # noqa: BLE001 - a reader never raises for a note
            return None
        return (row or {}).get("note") or None

    @property
    def checkpoints(self) -> list[dict]:
        """The checkpoints the run's code saved, oldest first, as its framework told the record
        (a Trainer's checkpoint-N folders, Lightning's .ckpt files): [{"step", "path", "t",
        "exists"}]. fit()'s own are in its output folder (train.resume.find_checkpoint)."""
        return [dict(c, exists=os.path.exists(c["path"]))
                for c in self._registry.checkpoints(self.id)]

    @property
    def error(self) -> triage.RunError | None:
        """Each failed rank with its exception type, message, traceback and triage category."""
        if self._error is None and self._status == "failed":
            self._error = self._load_errors()
        return self._error

    def _load_errors(self) -> triage.RunError | None:
        failures = []
        for d in self.folder.read_errors():
            try:
                failures.append(triage.RankFailure.from_dict(d))
            except (TypeError, ValueError):
                continue
        note = (self.folder.read_status() or {}).get("note") or None
        if not failures and note is None:
            note = getattr(self, "_row_error", None)  # what the registry holds (a headless job's)
        if not failures and note is None and self.exitcode is not None:
            note = f"supervisor exited with code {self.exitcode} without a status file"
        if not failures and note:
            note = note.strip().splitlines()[-1] if note.strip() else note
        return triage.RunError(failures, supervisor=note if not failures else None)

    def logs(self, rank: int | None = 0, tail: int | None = 50) -> str:
        """The last `tail` lines of a rank's stdout+stderr (rank=None: the supervisor's)."""
        p = self.folder.log_file(rank)
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

    def _follow(self) -> None:
        """Receive this run's events from now on (those after the ones already applied)."""
        from ..readers.receiver import get_receiver

        row_address = None
        if not self.owner:
            row = self._registry.get_run(self.id)
            row_address = row.get("events_address") if row else None
        get_receiver().follow(self.id, self._on_events, after=self._seq, address=row_address,
                              registry=self._registry)

    def _load_history(self, points: int = ATTACH_POINTS) -> None:
        """Apply the run's record (an attach), on the calling thread, in time and memory bounded
        by `points` per series: the metrics from the registry's downsampled levels, the newest
        NOTES_KEPT events of each other kind (history_counts has their totals). Live events then
        follow from the snapshot's seq: no gap, no duplicate."""
        snap = self._registry.series(self.id, points)
        self.metrics.seed(snap)
        for (rank, name), p in snap.series.items():
            if p.steps:
                self._last_step[(name, rank)] = max(p.steps)
        notes = []
        for kind in NOTE_KINDS:
            notes += self._registry.last_events(self.id, [kind], NOTES_KEPT, upto=snap.seq)
            self.history_counts[kind] = self._registry.count_events(self.id, kind, upto=snap.seq)
        self.history_counts["metric_points"] = sum(p.count for p in snap.series.values())
        if notes:
            self._on_events(sorted(notes, key=lambda e: e["seq"]))
        self._seq = max(self._seq, snap.seq)

    def _on_events(self, events: list) -> None:
        progressed = False
        final = None
        for e in events:
            if not isinstance(e, dict):
                continue
            seq = e.get("seq")
            if seq:
                if seq <= self._seq:
                    continue
                self._seq = seq
            progressed |= self._apply_event(e)
            if ev.ends_run(e):
                final = e["data"]
        if progressed:
            with self._progress:
                self._progress.notify_all()
        with self._lock:
            subs = list(self._subs)
        for fn in subs:
            fn(events)
        if final is not None:
            self._final = final
            if not self.owner or self._reaped.is_set():
                self._finish(final["status"], final.get("exitcode"), final.get("reason"))

    def _apply_event(self, e: dict) -> bool:
        """Fold one event into the handle; True for a metric. Whatever an (older) record holds,
        a value of the wrong type is skipped, never raised on."""
        kind, rank, data = e.get("kind"), e.get("rank"), e.get("data")
        if not isinstance(data, dict) or type(rank) is not int:
            return False
        if kind == ev.METRIC:
            self.metrics.add(rank, e.get("step"), e.get("t"), data)
            step = ev.step_of(e)
            if step is not None:
                for k, _ in ev.numbers(data):
                    key = (k, rank)
                    self._last_step[key] = max(self._last_step.get(key, step), step)
            return True
        if kind == ev.STATUS:
            st = data.get("status")
            if st in ("queued", "running", "stopping") and \
                    self._status in ("pending", "queued", "running"):
                self._status = st
                pos = data.get("position")
                self.queue_position = pos if st == "queued" and type(pos) is int else None
            if data.get("reason") and isinstance(data["reason"], str):
                self.reason = data["reason"]
            elif st == "running":  # why it waited is over
                self.reason = None
        elif kind == ev.DROPPED:
            count = data.get("count", 0)
            if type(count) is int:
                self._dropped_by_rank[rank] = max(self._dropped_by_rank.get(rank, 0), count)
                self.dropped = sum(self._dropped_by_rank.values())
        elif kind == ev.LOG:
            self._log_events.append(e)
        elif kind == ev.CONFIG and not hasattr(self.config, "replace"):  # not a TrainConfig:
            self.config = {**(self.config or {}), **data}  # what the run's code logged
        return False

    def _finish(self, status: str, exitcode: int | None = None, reason: str | None = None,
                announce: bool = True) -> None:
        with self._lock:
            if self._done.is_set():
                return
            self._finish_locked(status, exitcode, reason)
        from ..readers.receiver import get_receiver

        if announce:
            get_receiver().unfollow(self.id, self._on_events)

    def _finish_locked(self, status: str, exitcode: int | None, reason: str | None) -> None:
        if exitcode is not None:
            self.exitcode = exitcode
        if reason:
            self.reason = reason
        self._status = status
        if status == "failed":
            self._error = self._load_errors()
        self._done.set()
        with self._progress:
            self._progress.notify_all()

    # --- control ---------------------------------------------------------------------------------
    def request_checkpoint(self) -> None:
        """Ask the training loop to save a checkpoint at its next step boundary."""
        self.folder.request("checkpoint")

    def cancel(self, timeout: float = 15.0) -> str:
        """Withdraw a run that waits in the host's queue (status 'queued'): it never starts and
        ends 'stopped'. A run that has started is stopped with stop() instead."""
        if self._status not in ("pending", "queued"):
            raise ValueError(f"run {self.id} is {self._status}, not queued: use run.stop() to "
                             "stop a run that has started")
        return self.stop(grace=1.0, timeout=timeout, reason="withdrawn from the queue by the user")

    def stop(self, grace: float = 5.0, timeout: float = 15.0,
             reason: str = "stopped by the user", status: str = "stopped") -> str:
        """Stop the run: SIGTERM to its process group (the training loop checkpoints and exits),
        then SIGKILL to whatever is left after `grace` seconds. Returns the final status
        (`status`: "stopped", or "pruned" when a sweep stops it)."""
        if self.done:
            return self._status
        if self.pid is not None:
            terminate_tree(self.pid, self.run_dir, grace=grace, pid_started=self.pid_started,
                           reason=reason, status=status)
        self._done.wait(timeout)
        return self._status

    def resume(self, fn: Callable | None = None, *args: Any, **changes: Any) -> "Run":
        """Launch a new run that continues this one from its newest complete checkpoint, with the
        same training function and config (`changes` replace config fields that may change, such
        as max_steps). An attached run knows its function only when it is importable (not defined
        in a notebook); pass `fn` (and its `args`) otherwise.

        A script's run (launch("train.py", ...)) resumes by its own flag: run.resume("--resume",
        path) launches the same script with its arguments and these after them. With no flag,
        a Trainer or Lightning script continues from the newest checkpoint the run recorded
        that still exists (its trainer.train() / trainer.fit() get it when they name none)."""
        from ..rank.address import resolve_entry
        from ..rank.script import Script, load_target

        script = self._fn if isinstance(self._fn, Script) else (
            load_target(str(self.run_dir)) if self._fn is None and self.run_dir.name else None)
        if script is not None:
            if changes:
                raise ValueError(f"run {self.id} ran a script: it has no TrainConfig to change "
                                 f"{sorted(changes)} in; pass its own flags instead")
            extra = ((fn,) if fn is not None else ()) + args
            kw = {k: v for k, v in self._launch_kw.items() if k not in ("config", "name",
                                                                        "detach")}
            kw["num_processes"] = kw.get("num_processes") or self.num_processes or None
            newest = [c for c in self.checkpoints if c["exists"]][-1:]
            if not extra and newest:  # gpu_lab.rank.frameworks hands it to the framework
                kw["env"] = {**(kw.get("env") or {}), ev.ENV_RESUME: newest[0]["path"]}
            return type(self)._launch(script.with_args(*extra), name=self.name,
                                      detach=self.detach, **kw)
        if fn is None:
            if self._fn is not None:
                fn, args = self._fn, args or self._args
            elif getattr(self, "_entry", None):
                fn = resolve_entry(self._entry)
            else:
                raise ValueError(f"run {self.id}: its training function is not importable (defined "
                                 "in a notebook?); call run.resume(fn) with the function")
        config = self.config
        if changes:
            if config is None or isinstance(config, dict):
                raise ValueError(f"run {self.id} has no TrainConfig to change {sorted(changes)} in")
            config = config.replace(**changes)
        if not args and config is not None:
            args = (config,)
        else:
            args = tuple(config if a is self.config else a for a in args)
        kw = {k: v for k, v in self._launch_kw.items() if k != "config"}
        return type(self)._launch(fn, *args, config=config, resume=self,
                                  name=kw.pop("name", self.name),
                                  detach=kw.pop("detach", self.detach), **kw)

    def __repr__(self) -> str:
        return (f"Run(id={self.id!r}, name={self.name!r}, status={self._status!r}, "
                f"num_processes={self.num_processes})")

    def _repr_html_(self) -> str:
        import html

        color = {"running": "#1a7f37", "failed": "#b00", "stopped": "#9a6700",
                 "succeeded": "#0969da"}.get(self._status, "#555")
        step = self.metrics.last("loss")
        loss = f", last loss {step:.4g}" if step is not None else ""
        extra = ""
        if self.resumed_from:
            extra += (f" · resumed from step {self.resumed_from.get('step')} "
                      f"({html.escape(str(self.resumed_from.get('path')))})")
        if self.reason and self._status in FINAL:
            extra += f" · {html.escape(self.reason)}"
        note = self.note
        if note:
            extra += f" · <span style='color:#9a6700'>{html.escape(note)}</span>"
        return (f"<b>{html.escape(self.name)}</b> <code>{html.escape(self.id)}</code> "
                f"<span style='color:{color}'>{self._status}</span> · {self.num_processes} "
                f"{'GPU' if self.device == 'cuda' else 'CPU'} rank(s){loss}{extra}")


def attach_run(run_id_or_name: str, registry: Registry | None = None) -> Run:
    """gpu_lab.attach for a run (a sweep id is not looked for). A Run handle on a run of this host, by id or name (the newest run of that name): its
    recorded history, bounded (each metric series at most ATTACH_POINTS points with each bucket's
    min and max exact, the newest NOTES_KEPT events of each other kind), then its live events.
    Every point is one call away: run.metrics.frame() / to_csv(). Works from any kernel or script,
    whoever launched it, and for finished runs too."""
    reg = registry or Registry()
    row = reg.find_run(run_id_or_name)
    run = Run._from_row(row, reg)
    run._load_history()
    if not run.done:
        run._follow()
    return run


