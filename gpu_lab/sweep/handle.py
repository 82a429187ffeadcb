"""gpu_lab.sweep(): start a sweep's driver and return a Sweep handle at once; attach_sweep().

A Sweep reads everything from the study (Optuna's storage) and the registry, so a handle made in
another process (attach_sweep) sees what the one that started the sweep sees.
"""
from __future__ import annotations

import base64
import json
import os
import pickle
import secrets
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from ..launch.launcher import IMPORTING
from . import space as sp
from . import study as st


OPENING = 60.0  # s another process waits for a sweep's study to exist (Sweep._open creates it)


@dataclass
class Best:
    """The best finished trial: its full config, its value (mean over seeds) and its runs."""

    config: Any
    value: float
    run: str
    runs: list
    params: dict
    trial: int


def sweep(fn: Callable, base_cfg: Any, space: Mapping[str, Any], *, trials: int = 20,
          parallel: int = 1, gpus_per_trial: int = 1, metric: str = "accuracy",
          direction: str = "maximize", pruner: str | None = "asha", sampler: str = "tpe",
          seeds: int = 1, detach: bool = False, storage: str | None = None,
          name: str | None = None, sampler_seed: int | None = None) -> "Sweep":
    """Search `space` (TrainConfig fields → a list of choices, gpu_lab.uniform or
    gpu_lab.loguniform) around `base_cfg` with Optuna, `trials` trials, `parallel` at a time;
    return a Sweep at once. `fn(config)` is the training function (importable: defined in a module,
    such as gpu_lab.train_classifier); it reports `metric` with gpu_lab.report.

    Each trial is `seeds` gpu_lab.launch runs (seeds base_cfg.seed, +1, …; its value is their mean)
    of `gpus_per_trial` ranks, one per GPU (a CPU slot each on a host without GPUs; it sets the
    run's num_processes), queued on the host like any
    run. pruner: "asha" (successive halving), "median", "hyperband" or None; sampler: "tpe",
    "random" or "grid". detach=True: the sweep outlives this kernel (gpu_lab.attach(sweep_id)
    follows it). storage: an Optuna storage URL (default sqlite:///$GPU_LAB_HOME/sweeps.db).
    Every argument is checked, and every value of the space by TrainConfig, before anything starts.
    The study is created and the driver started on a thread (see Sweep._open).
    """
    from ..config import TrainConfig
    from ..rank.address import parse_entry
    from ..telemetry.probe import gpu_count

    base = TrainConfig.from_dict(base_cfg) if isinstance(base_cfg, Mapping) else base_cfg
    if not isinstance(base, TrainConfig):
        raise TypeError(f"gpu_lab.sweep: base_cfg must be a TrainConfig or a dict; got "
                        f"{type(base_cfg).__name__}")
    entry = _entry(fn)
    parse_entry(entry)
    _check_counts(trials=trials, parallel=parallel, gpus_per_trial=gpus_per_trial, seeds=seeds)
    st.check_choice("direction", direction, st.DIRECTIONS)
    st.check_choice("sampler", sampler, st.SAMPLERS)
    st.check_choice("pruner", pruner, st.PRUNERS)
    checked = sp.check(base, space, seeds=seeds)
    if sampler == "grid":
        sp.grid(checked)
    sweep_id = time.strftime("sweep-%Y%m%d-%H%M%S-") + secrets.token_hex(3)
    storage = storage or st.default_storage()
    spec = {"id": sweep_id, "name": name or sweep_id, "entry": entry, "base": base.to_dict(),
            "space": sp.to_json(checked), "trials": int(trials), "parallel": int(parallel),
            "gpus_per_trial": int(gpus_per_trial), "metric": metric, "direction": direction,
            "pruner": pruner, "sampler": sampler, "sampler_seed": sampler_seed,
            "seeds": int(seeds), "detach": bool(detach), "storage": storage,
            "device": "cuda" if gpu_count() > 0 else "cpu", "kernel": _me()}
    st.spec_path(sweep_id).write_text(json.dumps(spec, indent=1))
    handle = Sweep(spec)
    # The driver first, at once: its interpreter imports torch (seconds) while this kernel, on
    # another core, creates the study and asks for the first trials, which it then hands over.
    handle._proc = _start_driver(sweep_id, first_trials=True)
    # not a daemon: a script that ends at once still creates the study and hands the trials over
    handle._opening = threading.Thread(target=handle._open, name=f"{IMPORTING}sweep-open-{sweep_id}")
    handle._opening.start()
    return handle


def _entry(fn: Callable) -> str:
    mod, qual = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not callable(fn) or not mod or mod == "__main__" or "<" in qual:
        raise ValueError(f"gpu_lab.sweep: fn={fn!r} is not importable by the sweep's driver (a "
                         "fresh interpreter): define it in a .py module on the path, or use "
                         "gpu_lab.train_classifier")
    return f"{mod}:{qual}"


def _check_counts(**counts: int) -> None:
    for what, n in counts.items():
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"gpu_lab.sweep: {what}={n!r}; accepted: a whole number ≥ 1")


def _me() -> dict:
    import psutil

    return {"pid": os.getpid(), "started": psutil.Process().create_time()}


def _start_driver(sweep_id: str, first_trials: bool = False) -> subprocess.Popen:
    """A fresh interpreter in its own session (a Ctrl-C in the kernel is not the sweep's).
    first_trials: its stdin is a pipe on which Sweep._open sends the trials it asked (else the
    driver reads nothing there and asks every trial itself)."""
    root = str(Path(__file__).resolve().parents[2])  # gpu_lab's parent: importable from a clone
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(
        os.pathsep) if p])
    with open(st.log_path(sweep_id), "ab") as log:
        return subprocess.Popen([sys.executable, "-m", "gpu_lab.sweep.driver", sweep_id],
                                stdin=subprocess.PIPE if first_trials else subprocess.DEVNULL,
                                stdout=log, stderr=log, env=env, start_new_session=True)


class Sweep:
    """A sweep: `state`, `trials` (rows), `best`, `study` (Optuna's), `wait()`, `stop()`."""

    def __init__(self, spec: dict) -> None:
        self.spec = spec
        self.id = spec["id"]
        self.metric = spec["metric"]
        self.direction = spec["direction"]
        self._proc: subprocess.Popen | None = None
        self._study = None
        self._opening: threading.Thread | None = None  # sweep()'s _open, until it is joined
        self.error: str | None = None  # why the study could not be created, if it could not

    def __repr__(self) -> str:
        if self._opening is not None and self._opening.is_alive():  # never waits for it
            return f"<Sweep {self.id} starting: 0/{self.spec['trials']} trials>"
        return f"<Sweep {self.id} {self.state}: {len(self.study.trials)}/{self.spec['trials']} trials>"

    def _open(self) -> None:
        """Create the study, ask for the first `parallel` trials and hand them, with the sampler
        that drew them, to the driver sweep() started. sweep() runs this on a thread and returns:
        a process's first Optuna storage takes a second or more to open (SQLAlchemy, Alembic, the
        schema), and the kernel stays free meanwhile; the driver imports torch meanwhile and
        launches these trials the moment it can, before it opens the storage itself. A failure is
        the sweep's state, `failed`, and ends the driver."""
        import optuna

        proc = self._proc
        try:
            spec = self.spec
            space = sp.from_json(spec["space"])
            sampler = st.sampler(spec["sampler"], sp.grid(space) if spec["sampler"] == "grid"
                                 else None, spec["sampler_seed"])
            self._study = optuna.create_study(
                study_name=self.id, storage=st.storage_of(spec["storage"]),
                direction=spec["direction"], pruner=st.pruner(spec["pruner"]), sampler=sampler)
            self._study.set_user_attr("driver_pid", proc.pid)
            first = []
            for _ in range(min(spec["parallel"], spec["trials"])):
                trial = self._study.ask()
                first.append({"number": trial.number, "id": trial._trial_id,
                              "params": sp.suggest(trial, space)})
        except Exception as e:  # noqa: BLE001 - said by state and error, not lost in a thread
            self.error = f"the study could not be created in {self.spec['storage']}: {e}"
            proc.kill()
            proc.wait()
            proc.stdin.close()
            self._proc = None
            return
        self._hand_over(proc, {"trials": first,
                               "sampler": base64.b64encode(pickle.dumps(sampler)).decode()})

    @staticmethod
    def _hand_over(proc: subprocess.Popen, what: dict) -> None:
        """The trials asked and the sampler, on the driver's stdin (it reads to the end)."""
        try:
            with proc.stdin:
                proc.stdin.write(json.dumps(what).encode())
        except OSError:  # the driver is gone already: the sweep is lost; resume() starts one
            pass

    def _opened(self) -> bool:
        """Wait for _open, if it runs; False when it failed."""
        if self._opening is not None:
            self._opening.join()
            self._opening = None
        return self.error is None

    @property
    def study(self) -> Any:
        """The Optuna study itself (optuna.load_study from the sweep's storage)."""
        import optuna

        if not self._opened():
            raise RuntimeError(f"sweep {self.id}: {self.error}")
        deadline = time.monotonic() + OPENING
        while self._study is None:
            try:
                self._study = optuna.load_study(study_name=self.id,
                                                storage=st.storage_of(self.spec["storage"]))
            except KeyError:  # attached a moment after sweep() returned: its kernel creates it
                if time.monotonic() > deadline:
                    raise KeyError(f"sweep {self.id}: no study in {self.spec['storage']} "
                                   f"{OPENING:.0f} s after its spec was written") from None
                time.sleep(0.1)
        return self._study

    @property
    def state(self) -> str:
        """running | finished | failed | stopped, or lost when the driver died without saying."""
        if not self._opened():
            return "failed"
        attrs = self.study.user_attrs
        state = attrs.get("state", "running")
        if state in st.FINAL_STATES:
            return state
        if self._proc is not None:
            return "running" if self._proc.poll() is None else "lost"
        from .driver import _alive

        pid = attrs.get("driver_pid")  # set by whoever started the driver, before it runs
        if pid is None:  # the study is made, its driver not yet started: by the sweep's kernel
            kernel = self.spec.get("kernel") or {}
            return "running" if kernel.get("pid") and _alive(int(kernel["pid"]),
                                                             kernel.get("started")) else "lost"
        return "running" if _alive(int(pid), None) else "lost"

    @property
    def done(self) -> bool:
        return self.state != "running"

    def wait(self, timeout: float | None = None, poll: float = 0.5) -> str:
        """Until the sweep ends (or `timeout` seconds); returns its state. The process that
        started the driver is woken by the driver's exit, any other reads the study every `poll`."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.done:
            left = poll if deadline is None else min(poll, deadline - time.monotonic())
            if left <= 0:
                break
            if self._proc is None:
                time.sleep(left)
                continue
            try:
                self._proc.wait(left)
            except subprocess.TimeoutExpired:
                pass
        return self.state

    def stop(self, timeout: float = 120.0) -> str:
        """Stop the sweep: its running trials are stopped with a checkpoint, it asks for no more."""
        st.stop_path(self.id).touch()
        return self.wait(timeout)

    def resume(self) -> "Sweep":
        """Continue a sweep whose driver died (state lost) or that was stopped: a new driver
        follows the trials left running and asks for the rest."""
        state = self.state
        if state in ("running", "finished"):
            raise ValueError(f"sweep {self.id} is {state}: only a lost or stopped sweep resumes")
        st.stop_path(self.id).unlink(missing_ok=True)
        self.study.set_user_attr("state", "running")
        self._proc = _start_driver(self.id)
        self.study.set_user_attr("driver_pid", self._proc.pid)
        return self

    @property
    def trials(self) -> list[dict]:
        """One row per trial: number, status, params, value, best and last value, runs."""
        from ..record.registry import Registry

        reg = Registry()
        rows = []
        for t in self.study.trials:
            runs = t.user_attrs.get("runs", [])
            status = t.state.name.lower()
            if status == "running" and runs:
                live = [(reg.get_run(r) or {}).get("status") for r in runs]
                status = "queued" if all(s in ("pending", "queued") for s in live) else status
            rows.append({"trial": t.number, "status": status, "params": dict(t.params),
                         "value": t.value, "best": t.user_attrs.get("best"),
                         "last": t.user_attrs.get("last"), "step": t.user_attrs.get("step"),
                         "runs": runs, "error": t.user_attrs.get("error")})
        return rows

    @property
    def best(self) -> Best | None:
        """The best finished trial (None before one has finished)."""
        import optuna

        done = [t for t in self.study.trials if t.state == optuna.trial.TrialState.COMPLETE]
        if not done:
            return None
        t = self.study.best_trial
        from ..config import TrainConfig

        config = TrainConfig.from_dict(self.spec["base"]).replace(**t.params)
        runs = t.user_attrs.get("runs", [])
        return Best(config=config, value=t.value, run=runs[0] if runs else None, runs=runs,
                    params=dict(t.params), trial=t.number)

def attach_sweep(sweep_id: str) -> Sweep:
    """A handle on a sweep of this host, from any process (KeyError naming recent sweeps)."""
    return Sweep(st.read_spec(sweep_id))


def attach(id_or_name: str, registry: Any = None) -> Any:
    """gpu_lab.attach: a Sweep for a sweep id, else a Run (gpu_lab.launch.attach_run)."""
    if isinstance(id_or_name, str) and st.spec_path_exists(id_or_name):
        return attach_sweep(id_or_name)
    from ..launch import attach_run

    return attach_run(id_or_name, registry)


__all__ = ["sweep", "Sweep", "Best", "attach_sweep", "attach"]
