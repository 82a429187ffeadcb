"""gpu_lab.launch(): run a training function on N ranks without blocking the kernel."""
from __future__ import annotations

import atexit
import os
import secrets
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Callable

from ..config import MixedPrecision, TrainConfig
from ..registry import Registry, home
from ..telemetry_probe import gpu_count
from . import checks as pf
from .run import Run, terminate_tree
from .supervisor import EXIT_OK, EXIT_STOPPED, Spec, supervise

_active: "weakref.WeakSet[Run]" = weakref.WeakSet()
_atexit_registered = False
RDZV_BACKENDS = ("static", "c10d")


def launch(fn: Callable, *args: Any, num_processes: int | None = None,
           mixed_precision: str | None = None, config: TrainConfig | dict | None = None,
           name: str | None = None, num_nodes: int = 1, node_rank: int = 0,
           master_addr: str = "127.0.0.1", port: int | None = None,
           rdzv_backend: str = "static", env: dict[str, str] | None = None,
           notebook: str | None = None) -> Run:
    """Launch `fn(*args)` on `num_processes` ranks through accelerate.notebook_launcher, inside a
    supervisor process with its own process group, and return a Run handle at once.

    num_processes=None means every GPU NVML reports, or 2 CPU processes (gloo) without a GPU.
    mixed_precision: "no" | "fp16" | "bf16" (default: config's, else "no").
    Inside `fn`, use gpu_lab.accelerator() and gpu_lab.report(step, loss=...).
    """
    # --- arguments: all checked before anything starts ------------------------------------------
    if not callable(fn):
        raise TypeError(f"launch: fn must be callable (a training function); got {type(fn).__name__}")
    if isinstance(config, dict):
        config = TrainConfig.from_dict(config)
    if config is not None and not isinstance(config, TrainConfig):
        raise TypeError(f"launch: config must be a TrainConfig, a dict or None; got "
                        f"{type(config).__name__}")
    if num_processes is None and config is not None:
        num_processes = config.num_processes
    if num_processes is not None and (isinstance(num_processes, bool)
                                      or not isinstance(num_processes, int)):
        raise TypeError(f"launch: num_processes must be an int >= 1 or None; got {num_processes!r}")
    if num_processes is not None and num_processes < 1:
        raise ValueError(f"launch: num_processes must be >= 1 or None; got {num_processes}")
    if mixed_precision is None:
        mixed_precision = config.mixed_precision if config is not None else "no"
    if mixed_precision not in MixedPrecision.choices():
        raise ValueError(f"launch: mixed_precision: got {mixed_precision!r}; accepted: "
                         f"{', '.join(map(repr, MixedPrecision.choices()))}")
    if name is not None and (not isinstance(name, str) or not name.strip()):
        raise ValueError(f"launch: name must be a non-empty string or None; got {name!r}")
    for label, v in (("num_nodes", num_nodes), ("node_rank", node_rank)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"launch: {label} must be an int; got {v!r}")
    if num_nodes < 1:
        raise ValueError(f"launch: num_nodes must be >= 1; got {num_nodes}")
    if not 0 <= node_rank < num_nodes:
        raise ValueError(f"launch: node_rank must be in [0, num_nodes-1] = [0, {num_nodes - 1}]; "
                         f"got {node_rank}")
    if rdzv_backend not in RDZV_BACKENDS:
        raise ValueError(f"launch: rdzv_backend: got {rdzv_backend!r}; accepted: "
                         f"{', '.join(map(repr, RDZV_BACKENDS))}")
    if not isinstance(master_addr, str) or not master_addr:
        raise ValueError(f"launch: master_addr must be a host name or address; got {master_addr!r}")
    if port is not None and (isinstance(port, bool) or not isinstance(port, int)
                             or not 1 <= port <= 65535):
        raise ValueError(f"launch: port must be an int in 1..65535 or None; got {port!r}")
    if num_nodes > 1 and port is None:
        raise ValueError("launch: port is required when num_nodes > 1 (every node must use the "
                         "master's port); pick one on the master node, e.g. 29400")

    gpus = gpu_count()
    device = "cuda" if gpus > 0 else "cpu"
    if device == "cuda" and num_processes is not None and num_processes > gpus:
        raise ValueError(f"launch: num_processes={num_processes} but this host has {gpus} GPU(s) "
                         "visible; use at most that many (one process per GPU)")
    if device == "cpu" and mixed_precision == "fp16":
        raise ValueError("launch: mixed_precision='fp16' needs a GPU (CPU autocast supports bf16); "
                         "accepted here: 'no', 'bf16'")

    # --- the kernel must be safe to fork -----------------------------------------------------------
    pf.preflight(device)
    if num_processes is None:
        num_processes = gpus if gpus > 0 else 2
        if gpus == 0:
            print("gpu_lab.launch: NVML reports no GPU; launching 2 CPU processes (gloo).",
                  flush=True)
    if port is None:
        port = pf.free_port(master_addr if master_addr in ("127.0.0.1", "localhost") else "0.0.0.0")
    elif node_rank == 0 and pf.port_in_use(port, "0.0.0.0" if num_nodes > 1 else master_addr):
        raise ValueError(f"launch: port {port} is in use; pass port=None to choose a free one")

    from ..stream.receiver import get_receiver

    receiver = get_receiver()  # bound before the fork: workers only need its address
    run_id = time.strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(3)
    name = name or getattr(fn, "__name__", "run")
    run_dir = home() / "runs" / run_id
    (run_dir / "logs").mkdir(parents=True)
    registry = Registry()
    registry.create_run(run_id, name=name, config=config.to_dict() if config else None,
                        num_processes=num_processes, num_nodes=num_nodes, node_rank=node_rank,
                        output_dir=config.output_dir if config else None, run_dir=str(run_dir),
                        notebook=notebook or _notebook_path())
    run = Run(run_id, name, run_dir, num_processes, registry, config=config, port=port,
              device=device)
    receiver.subscribe(run_id, run._on_events)
    spec = Spec(run_id=run_id, run_dir=str(run_dir), fn=fn, args=args,
                num_processes=num_processes, mixed_precision=mixed_precision, port=port,
                device=device, address=receiver.address, registry_path=str(registry.path),
                master_addr=master_addr, num_nodes=num_nodes, node_rank=node_rank,
                rdzv_backend=rdzv_backend, env=dict(env or {}))

    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the supervisor
        supervise(spec)  # never returns
    try:
        os.setpgid(pid, pid)  # also done by the child; whichever runs first wins the race
    except OSError:
        pass
    import psutil

    try:
        started = psutil.Process(pid).create_time()
    except psutil.Error:
        started = None
    run.pid = pid
    registry.update(run_id, pid=pid, pgid=pid, pid_started=started)
    _track(run)
    threading.Thread(target=_wait_supervisor, args=(run, pid, receiver), daemon=True,
                     name=f"gpu_lab-wait-{run_id}").start()
    return run


def _wait_supervisor(run: Run, pid: int, receiver: Any) -> None:
    try:
        _, status = os.waitpid(pid, 0)
        code: int | None = os.waitstatus_to_exitcode(status)
    except ChildProcessError:  # reaped elsewhere (a SIGCHLD handler of the host program)
        code = None
    st = None
    sp = run.run_dir / "status.json"
    if sp.exists():
        import json

        try:
            st = json.loads(sp.read_text()).get("status")
        except ValueError:
            st = None
    if st is None:
        if (run.run_dir / "control" / "stop").exists():
            st = "stopped"
        elif code == EXIT_OK:
            st = "succeeded"
        elif code == EXIT_STOPPED:
            st = "stopped"
        else:
            st = "failed"
    # let the last batches that workers sent before exiting reach the run
    deadline = time.monotonic() + 0.5
    seen = receiver.received
    while time.monotonic() < deadline:
        time.sleep(0.05)
        if receiver.received == seen:
            break
        seen = receiver.received
    run._finish(st, code)
    receiver.unsubscribe(run.id, run._on_events)


def _notebook_path() -> str | None:
    for key in ("JPY_SESSION_NAME", "__vsc_ipynb_file__"):
        if os.environ.get(key):
            return os.environ[key]
    return None


def _track(run: Run) -> None:
    global _atexit_registered
    _active.add(run)
    if not _atexit_registered:
        atexit.register(stop_all_runs)
        _atexit_registered = True


def stop_all_runs() -> None:
    """Stop every run this process launched that is still going. Registered at exit: when the
    kernel (or script) exits, it leaves no orphan training processes behind."""
    for run in list(_active):
        if not run.done:
            run.stop(grace=3.0, timeout=5.0)


def stop_run(run_id: str, grace: float = 5.0, registry: Registry | None = None) -> str:
    """Stop a run by id from any process on its host (the server extension uses this)."""
    reg = registry or Registry()
    row = reg.get_run(run_id)
    if row is None:
        raise KeyError(f"no run with id {run_id!r} in {reg.path}")
    for run in list(_active):  # launched from this process: use the handle (it reaps)
        if run.id == run_id:
            return run.stop(grace=grace)
    if row["status"] not in ("pending", "running", "stopping"):
        return row["status"]
    reg.set_status(run_id, "stopping")
    if row.get("pid"):
        terminate_tree(int(row["pid"]), Path(row["run_dir"]) if row.get("run_dir") else None,
                       grace=grace, pid_started=row.get("pid_started"))
    reg.set_status(run_id, "stopped")
    return "stopped"
