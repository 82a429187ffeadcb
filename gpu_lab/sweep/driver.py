"""The sweep's driver: `python -m gpu_lab.sweep.driver <sweep id>`, a fresh interpreter started by
gpu_lab.sweep() (never a fork of the kernel: a forked kernel cannot safely write SQLite).

It imports torch first, then reads on stdin the first trials the kernel asked for meanwhile (and
the sampler that drew them) and launches them, before it opens Optuna's storage itself. It asks
Optuna for the next trials, `parallel` at a time; each trial is `seeds` gpu_lab.launch runs (one per
seed, each with its own record, checkpoints and place in the host queue), tagged with the sweep in
the registry (column `sweep`). It reads the trials' metric from their records as it arrives,
reports the mean over seeds to Optuna at every step all seeds have reached, and prunes when the
pruner says so: the runs are stopped (they checkpoint) and get the final status `pruned`; the
trial is PRUNED in the study. A trial's value is the mean over its seeds of each run's last value
of the metric; a failed run fails its trial. The driver ends with the study's last trial, on a stop
request (the sweep folder's stop_requested file) or, unless detached, when the launching kernel is gone.
"""
from __future__ import annotations

import base64
import json
import os
import pickle
import sys
import threading
import traceback
from typing import Any

from . import space as sp
from . import study as st

POLL = 0.5  # seconds between reads of the trials' records (a run's end wakes the loop at once)


class TrialRuns:
    """One Optuna trial and its runs (one per seed)."""

    def __init__(self, trial: Any, runs: list, params: dict) -> None:
        self.trial, self.runs, self.params = trial, runs, params
        self.reported = -1  # the newest step reported to Optuna
        self.best: float | None = None
        self.last: float | None = None


class Driver:
    """handed: what the sweep's kernel sent on stdin, the trials it asked (numbers, ids, params)
    and its sampler, pickled, to go on drawing from; their runs are launched before the storage is
    opened here (SQLAlchemy, Alembic: about a second)."""

    def __init__(self, spec: dict, handed: dict | None = None) -> None:
        from ..config import TrainConfig
        from ..rank.address import resolve_entry
        from ..record.registry import Registry

        self.spec = spec
        self.id = spec["id"]
        self.fn = resolve_entry(spec["entry"])
        self.base = TrainConfig.from_dict(spec["base"])
        self.space = sp.from_json(spec["space"])
        self.registry = Registry()
        self._read: dict[str, tuple[int, list]] = {}  # run id -> (last seq read, its points)
        self.maximize = spec["direction"] == "maximize"
        self.active: dict[int, TrialRuns] = {}
        self._wake = threading.Event()  # set when a trial's run ends
        first = [(t, self._launch_runs(t["number"], t["params"]))
                 for t in (handed or {}).get("trials", [])]

        import optuna

        storage = st.storage_of(spec["storage"])
        if handed:
            st._ask_tell_grid()  # the class a grid sampler's pickle names
            sampler = pickle.loads(base64.b64decode(handed["sampler"]))
        else:  # a seeded sampler made again would draw the trials already drawn: seed it past them
            seed = spec.get("sampler_seed")
            if seed is not None:
                seed += len(optuna.load_study(study_name=self.id, storage=storage).trials)
            sampler = st.sampler(spec["sampler"], sp.grid(self.space) if spec["sampler"] == "grid"
                                 else None, seed)
        self.study = optuna.load_study(  # the sampler and pruner are not in the storage
            study_name=self.id, storage=storage, sampler=sampler, pruner=st.pruner(spec["pruner"]))
        for t, runs in first:
            trial = optuna.trial.Trial(self.study, t["id"])
            trial.set_user_attr("runs", [r.id for r in runs])
            self.active[t["number"]] = TrialRuns(trial, runs, t["params"])
        self.asked = len(self.study.trials)
        self._adopt()

    def _adopt(self) -> None:
        """The trials left running by a dead driver (a resumed sweep) are followed again: their
        runs, detached, went on. A trial asked that never got its runs (its driver, or the kernel
        that asked it, died first) gets them now, with the params it was given."""
        import optuna

        from ..launch import attach_run

        for t in self.study.get_trials(deepcopy=False,
                                       states=(optuna.trial.TrialState.RUNNING,)):
            if t.number in self.active:  # handed over by the kernel and launched here
                continue
            trial = optuna.trial.Trial(self.study, t._trial_id)
            ids = t.user_attrs.get("runs")
            if not ids:
                params = sp.suggest(trial, self.space)  # what it was given (a field it lacks: drawn)
                runs = self._launch_runs(t.number, params)
                trial.set_user_attr("runs", [r.id for r in runs])
                self.active[t.number] = TrialRuns(trial, runs, params)
                continue
            tr = TrialRuns(trial, [attach_run(i) for i in ids], dict(t.params))
            for run in tr.runs:
                self._watch(run)
            tr.reported = max(t.intermediate_values, default=-1)
            self.active[t.number] = tr
            print(f"trial {t.number}: adopted {ids}", flush=True)

    def _watch(self, run: Any) -> None:
        """Wake the loop when `run` ends, so that the next trial starts then, not at the next
        poll (this process launched the run and reaps it: Run.wait returns at its end)."""
        threading.Thread(target=lambda: (run.wait(), self._wake.set()), daemon=True,
                         name=f"gpu_lab-sweep-watch-{run.id}").start()

    # --- the loop ----------------------------------------------------------------------------------
    def run(self) -> str:
        self.study.set_user_attr("driver_pid", os.getpid())
        self.study.set_user_attr("state", "running")
        while self.asked < self.spec["trials"] or self.active:
            self._wake.clear()  # before the look: a run that ends after it sets it again
            why = self._why_stop()
            if why:
                self._stop_all(why)
                return "stopped"
            # the trials that ended leave first: their slots go to the next trials in this same
            # pass, not after the next wait (the end that woke this pass is cleared already)
            for number, tr in list(self.active.items()):
                if self._follow(tr):
                    del self.active[number]
            while len(self.active) < self.spec["parallel"] and self.asked < self.spec["trials"]:
                self._start_trial()
            if self.active or self.asked < self.spec["trials"]:
                self._wake.wait(POLL)
        return "finished"

    def _why_stop(self) -> str | None:
        if st.stop_path(self.id).exists():
            return "the sweep was stopped by the user"
        kernel = self.spec.get("kernel")
        if kernel and not self.spec["detach"] and not _alive(kernel["pid"], kernel["started"]):
            return "the launching kernel exited (detach=False)"
        return None

    def _start_trial(self) -> None:
        trial = self.study.ask()
        self.asked += 1
        params = sp.suggest(trial, self.space)
        runs = self._launch_runs(trial.number, params)
        trial.set_user_attr("runs", [r.id for r in runs])
        self.active[trial.number] = TrialRuns(trial, runs, params)

    def _launch_runs(self, number: int, params: dict) -> list:
        """A trial's runs, one per seed, launched into the host queue and tagged with the sweep."""
        from .. import launch

        runs = []
        for i in range(self.spec["seeds"]):
            cfg = self.base.replace(**params, **({"seed": self.base.seed + i}
                                                 if self.spec["seeds"] > 1 else {}))
            name = st.run_name(self.id, number, i if self.spec["seeds"] > 1 else None)
            gpus = self.spec["gpus_per_trial"]
            on_gpu = self.spec["device"] == "cuda"
            run = launch(self.fn, cfg, name=name, detach=self.spec["detach"],  # a rank per device
                         gpus=gpus if on_gpu else None, num_processes=gpus)
            self.registry.update(run.id, sweep=self.id)
            self._watch(run)
            runs.append(run)
        print(f"trial {number}: {params} -> {[r.id for r in runs]}", flush=True)
        return runs

    def _follow(self, tr: TrialRuns) -> bool:
        """Report what arrived; prune or finish the trial. True when it is over."""
        import optuna

        for step, value in self._new_points(tr):
            tr.trial.report(value, step)
            tr.reported = step
            if tr.trial.should_prune():
                self._prune(tr, step)
                return True
        if not all(r.done for r in tr.runs):
            return False
        statuses = [r.status for r in tr.runs]
        lasts = [self._values(r.id) for r in tr.runs]
        if all(s == "succeeded" for s in statuses) and all(lasts):
            value = sum(v[-1][1] for v in lasts) / len(lasts)
            self.study.tell(tr.trial, value)
            print(f"trial {tr.trial.number}: {value}", flush=True)
        else:
            tr.trial.set_user_attr("error", f"runs ended {statuses}" if not all(
                s == "succeeded" for s in statuses) else f"no {self.spec['metric']!r} reported")
            self.study.tell(tr.trial, state=optuna.trial.TrialState.FAIL)
        return True

    def _values(self, run_id: str) -> list[tuple[int, float]]:
        """(step, value) of the sweep's metric, rank 0, as the run's record holds them. Each look
        reads only the events past the last one read, and decodes only those naming the metric:
        a long trial costs what is new."""
        seq, points = self._read.setdefault(run_id, (0, []))
        seq, new = self.registry.metric_points(run_id, self.spec["metric"], rank=0, after=seq)
        points.extend(new)
        self._read[run_id] = (seq, points)
        return points

    def _new_points(self, tr: TrialRuns) -> list[tuple[int, float]]:
        """The steps past the last reported that every seed has reached, with their mean; the
        trial's best and last values kept in its user attributes for the trials table."""
        per_run = [dict(self._values(r.id)) for r in tr.runs]
        common = sorted(set.intersection(*(set(d) for d in per_run)))
        points = [(s, sum(d[s] for d in per_run) / len(per_run)) for s in common]
        new = [(s, v) for s, v in points if s > tr.reported]
        if new:
            values = [v for _, v in points]
            tr.last = values[-1]
            tr.best = max(values) if self.maximize else min(values)
            tr.trial.set_user_attr("best", tr.best)
            tr.trial.set_user_attr("last", tr.last)
            tr.trial.set_user_attr("step", new[-1][0])
        return new

    def _prune(self, tr: TrialRuns, step: int) -> None:
        import optuna

        reason = f"pruned by sweep {self.id} at step {step} ({self.spec['pruner']})"
        for run in tr.runs:
            # the loop checkpoints on SIGTERM; its end is recorded as pruned
            run.stop(grace=30.0, timeout=60.0, reason=reason, status="pruned")
            if run.status in ("stopped", "succeeded"):  # it ended before the request was seen
                self.registry.set_status(run.id, "pruned", reason=reason, overwrite=True)
        self.study.tell(tr.trial, state=optuna.trial.TrialState.PRUNED)
        print(f"trial {tr.trial.number}: pruned at step {step}", flush=True)

    def _stop_all(self, why: str) -> None:
        import optuna

        for tr in self.active.values():
            for run in tr.runs:
                run.stop(grace=30.0, timeout=60.0, reason=why)
            tr.trial.set_user_attr("error", why)
            self.study.tell(tr.trial, state=optuna.trial.TrialState.FAIL)
        self.active.clear()
        print(f"sweep stopped: {why}", flush=True)


def _alive(pid: int, started: float | None) -> bool:
    import psutil

    try:
        p = psutil.Process(pid)
        return p.status() != psutil.STATUS_ZOMBIE and (
            started is None or abs(p.create_time() - started) < 1.0)
    except psutil.Error:
        return False


def _warm() -> None:
    """Import what a training kernel has imported: every trial's ranks are forked from here
    (through its supervisor) and inherit it, instead of importing torch anew each time."""
    import accelerate  # noqa: F401
    import torch  # noqa: F401


def _handed_over() -> dict | None:
    """What the sweep's kernel sends on stdin once it has asked for the first trials; None when
    it sends nothing (a resumed sweep's stdin is empty; a kernel gone before it sent: the trials
    it asked have no runs, and _adopt gives them theirs)."""
    try:
        data = sys.stdin.buffer.read() if sys.stdin is not None else b""
        return json.loads(data) if data else None
    except (OSError, ValueError):
        return None


def main(argv: list[str]) -> int:
    spec = json.loads(st.spec_path(argv[0]).read_text())
    _warm()
    driver = None
    try:
        driver = Driver(spec, _handed_over())
        state = driver.run()
    except BaseException as e:  # noqa: BLE001 - the sweep's state says it failed, and why
        traceback.print_exc()
        if driver is not None:
            driver.study.set_user_attr("error", f"{type(e).__name__}: {e}")
            driver.study.set_user_attr("state", "failed")
        return 1
    driver.study.set_user_attr("state", state)
    return 0


def _exit(code: int) -> None:
    """Leave without the interpreter's teardown: with torch loaded it takes over a second, and the
    kernel's Sweep.wait() returns at this exit. Nothing needs it: the sweep's state is in the
    study, each run's record is its recorder's, and a run not detached watches this process, not
    its teardown. Only the log is flushed."""
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _exit(main(sys.argv[1:]))
