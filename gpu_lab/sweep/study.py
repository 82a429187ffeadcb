"""Where a sweep lives and what Optuna objects it is made of.

The study is Optuna's own, in Optuna's storage: by default `sqlite:///$GPU_LAB_HOME/sweeps.db`,
beside the registry, so `optuna.load_study(study_name=sweep_id, storage=...)` and
optuna-dashboard open it as they are; `storage=` takes any Optuna storage URL. The study's name is
the sweep id. Its user attributes hold what gpu_lab adds: the sweep's settings ("gpu_lab"), the
driver's pid and start time, and its state (running → finished | failed | stopped). A sweep also
has a private folder, $GPU_LAB_HOME/sweeps/<id>/: the driver's spec, its log and a stop request (stop_requested).
"""
from __future__ import annotations

import json
import os
import re
import threading
from pathlib import Path
from typing import Any

PRUNERS = ("asha", "median", "hyperband", None)
SAMPLERS = ("tpe", "random", "grid")
DIRECTIONS = ("maximize", "minimize")
STATES = ("running", "finished", "failed", "stopped")  # the sweep's, in the study's user attrs
FINAL_STATES = STATES[1:]


def default_storage() -> str:
    from ..record.registry import home

    return f"sqlite:///{home() / 'sweeps.db'}"


_storages: dict[tuple[str, int], Any] = {}
_storages_lock = threading.Lock()


def storage_of(url: str) -> Any:
    """Optuna's storage for `url`, made once per process: its engine and schema check cost about
    a second the first time, and a kernel's sweep() and Sweep handles share them (never a forked
    child: the pid is part of the key). SQLite waits for a writer instead of failing at once (the
    driver writes while kernels read)."""
    import optuna
    from sqlalchemy.exc import IntegrityError, OperationalError

    key = (url, os.getpid())
    with _storages_lock:
        if key not in _storages:
            optuna.logging.set_verbosity(optuna.logging.WARNING)
            kw = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {}
            try:
                _storages[key] = optuna.storages.RDBStorage(url, engine_kwargs=kw)
            except (IntegrityError, OperationalError):
                # another process made the new database's schema meanwhile (a table, Alembic's
                # version): this time it is there. Any other error is raised again here.
                _storages[key] = optuna.storages.RDBStorage(url, engine_kwargs=kw)
        return _storages[key]


def folder(sweep_id: str) -> Path:
    """The sweep's own folder (owner-only, like a run's)."""
    from ..access import private_dir
    from ..record.registry import home

    p = home() / "sweeps" / sweep_id
    private_dir(p)
    return p


def spec_path(sweep_id: str) -> Path:
    return folder(sweep_id) / "spec.json"


def log_path(sweep_id: str) -> Path:
    return folder(sweep_id) / "driver.log"


def stop_path(sweep_id: str) -> Path:
    return folder(sweep_id) / "stop_requested"


def spec_path_exists(sweep_id: str) -> bool:
    from ..record.registry import home

    return "/" not in sweep_id and (home() / "sweeps" / sweep_id / "spec.json").is_file()


def read_spec(sweep_id: str) -> dict:
    p = spec_path(sweep_id)
    if not p.is_file():
        raise KeyError(f"no sweep with id {sweep_id!r} on this host ({p} is missing); "
                       f"recent sweeps: {', '.join(recent()) or '(none)'}")
    return json.loads(p.read_text())


def recent(n: int = 5) -> list[str]:
    from ..record.registry import home

    d = home() / "sweeps"
    names = sorted((p.name for p in d.iterdir() if p.is_dir()), reverse=True) if d.is_dir() else []
    return names[:n]


def run_name(sweep_id: str, trial: int, seed: int | None = None) -> str:
    """The name of a trial's run (`seed`: its index among the trial's seeds, when it has several);
    the lab's side panel reads the trial back from it (trial_of)."""
    return f"{sweep_id}-t{trial}" + ("" if seed is None else f"-s{seed}")


def trial_of(sweep_id: str, name: str | None) -> tuple[int, int | None] | None:
    """(trial, seed index or None) of a run named by run_name, else None."""
    m = re.fullmatch(rf"{re.escape(sweep_id)}-t(\d+)(?:-s(\d+))?", name or "")
    return (int(m[1]), None if m[2] is None else int(m[2])) if m else None


def check_choice(what: str, value: Any, accepted: tuple) -> None:
    if value not in accepted:
        raise ValueError(f"gpu_lab.sweep: {what}={value!r}; accepted: "
                         f"{', '.join(repr(a) for a in accepted)}")


def pruner(name: str | None) -> Any:
    """Optuna's pruner at its own defaults (what its tutorials use): asha = successive halving."""
    import optuna

    check_choice("pruner", name, PRUNERS)
    return {"asha": optuna.pruners.SuccessiveHalvingPruner, "median": optuna.pruners.MedianPruner,
            "hyperband": optuna.pruners.HyperbandPruner,
            None: optuna.pruners.NopPruner}[name]()


def sampler(name: str, grid_space: dict | None, seed: int | None) -> Any:
    import optuna

    check_choice("sampler", name, SAMPLERS)
    if name == "grid":
        return _ask_tell_grid()(grid_space, seed=seed)
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    return optuna.samplers.TPESampler(seed=seed)


def _ask_tell_grid() -> type:
    """Optuna's grid sampler for ask-and-tell: once the grid is covered, its after_trial calls
    study.stop(), which raises outside study.optimize(). The driver asks `trials` trials. Made
    once, as this module's AskTellGrid, so that a grid sampler pickles (the kernel hands its
    sampler, mid-sequence, to the driver, which calls this before it unpickles one)."""
    global AskTellGrid
    if "AskTellGrid" not in globals():
        import optuna

        class AskTellGrid(optuna.samplers.GridSampler):
            def after_trial(self, study: Any, trial: Any, state: Any, values: Any) -> None:
                pass

    return AskTellGrid
