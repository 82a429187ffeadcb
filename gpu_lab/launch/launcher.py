"""gpu_lab.launch(): run a training function on N ranks without blocking the kernel."""
from __future__ import annotations

import gc
import os
import secrets
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Callable

from ..access import private_dir
from ..config import TrainConfig
from ..record import notify as notices
from ..record.registry import Registry
from ..record.runfolder import RunFolder
from ..record.channel import RunKeys, save_client_key
from ..record.events import ACTIVE_STATUSES
from ..telemetry.probe import gpu_count
from ..rank.script import Script, save_target
from . import accelerate_config
from . import checks as pf
from .run import FINAL, Run
from ..supervise.kill import terminate_tree
from ..supervise.supervisor import Spec, supervise
from ..supervise.turn import BUSY, ERROR

_launched: "weakref.WeakSet[Run]" = weakref.WeakSet()


def launch(fn: Callable | str, *args: Any, num_processes: int | None = None,
           mixed_precision: str | None = None, config: TrainConfig | dict | None = None,
           name: str | None = None, detach: bool = False, resume: Any = None,
           num_nodes: int = 1, node_rank: int = 0, master_addr: str = "127.0.0.1",
           port: int | None = None, rdzv_backend: str = "static",
           env: dict[str, str] | None = None, notebook: str | None = None,
           notify: str | list[str] | None = None, gpus: Any = None, priority: int | None = None,
           queue: bool = True, config_file: Any = None) -> Run:
    """Launch `fn(*args)` on `num_processes` ranks through accelerate.notebook_launcher, inside a
    supervisor process that owns the run's record, and return a Run handle at once.

    fn: the training function; or your own script, as `accelerate launch` would run it:
      `launch("train.py", "--lr", "0.1", num_processes=2)`, `launch("-m", "pkg.train", ...)`;
      or "pkg.module:function". A script runs unchanged on every rank as __main__ with those
      arguments: a bare `Accelerator()` forms the run's group, `accelerator.log(...)` lands in
      the record, sys.exit(0) is a success (gpu_lab.rank.script, gpu_lab.rank.adopt).

    config: the run's TrainConfig; by default the first TrainConfig among `args`, so
      `launch(train_classifier, cfg)` is enough. The run gets a checkpoint folder of its own,
      `<cfg.output_dir>/<run id>`, which the ranks see as cfg.output_dir.
    num_processes=None: the config's, else every GPU NVML reports, or 2 CPU processes (gloo; 1
      on a host with one CPU slot).
    mixed_precision: "no" | "fp16" | "bf16" (default: the config's, else "no").
    detach: False (default) stops the run, with a checkpoint, when the launching kernel or script
      exits; True lets the run outlive it (`gpu_lab.attach(run_id)` from anywhere follows it).
    gpus: which GPUs the ranks see (CUDA_VISIBLE_DEVICES): a count N (any free ones), a list of
      indices, or "all"; None: one per rank. On a host without GPUs each rank takes a CPU slot
      (the usable cores, or GPU_LAB_CPU_SLOTS). Devices other runs hold, of any user of the host,
      are waited for: the run is `queued` until its turn (gpu_lab.queue() shows the host's queue).
      None: the config's `gpus`, if any.
    priority: among your own queued runs, higher starts first (then the order of launch);
      None: the config's, else 0.
    queue: False refuses at once (DevicesBusy, naming who holds them) instead of waiting.
    notify: apprise URL(s) told when the run ends (name, status, triage, duration), e.g.
      "json://host/hook" or "mailto://user:password@example.com"; None: the GPU_LAB_NOTIFY
      setting (gpu_lab.record.notify), "" or []: none. A bad URL is refused here.
    resume: continue from a checkpoint on purpose: a Run, a run id or name (its newest complete
      checkpoint), or a checkpoint or output folder. The checkpoint's model, num_classes,
      image_size, optimizer and zero must match the config; a mismatch is refused here, before
      any process starts.
    config_file: the user's `accelerate config`, as `accelerate launch` reads it: None takes
      accelerate's default file where there is one, a path another, False none. Its settings
      reach every rank; this call's arguments win over it, it wins over a TrainConfig field at
      its default (gpu_lab.launch.accelerate_config). What this host cannot do is refused here.
    Inside `fn`, use gpu_lab.accelerator() and gpu_lab.report(step, loss=...).
    """
    fn, args = _target_of(fn, args)
    if isinstance(fn, Script) and resume is not None:
        raise ValueError("launch: resume= continues a TrainConfig's checkpoint; a script resumes "
                         "by its own flag: launch it again with that flag, e.g. "
                         "launch('train.py', '--resume', '<checkpoint folder>')")
    config = _config_of(config, args)
    visible = gpu_count()
    said = accelerate_config.said(num_processes, mixed_precision, config, num_nodes, node_rank,
                                  master_addr, port)
    accel = accelerate_config.settings(config_file, said, visible)
    spec = _spec(fn, args, config, said, accel, name=name, detach=detach, num_nodes=num_nodes,
                 node_rank=node_rank, master_addr=master_addr, port=port,
                 rdzv_backend=rdzv_backend, env=env, gpus=gpus, priority=priority, queue=queue)
    if accel is not None and config is not None and config.mixed_precision != spec.mixed_precision:
        # the ranks' TrainConfig says what they train with (the file's, over its default)
        config = config.replace(mixed_precision=spec.mixed_precision)
        spec.args = tuple(config if isinstance(a, TrainConfig) else a for a in spec.args)
    notify_urls = notices.resolve(notify)
    spec.device = "cuda" if visible > 0 and not (accel and accel.use_cpu) else "cpu"
    spec.check_device(visible)
    _check_devices(spec)
    registry = Registry()
    source = _resume_source(resume, config, registry) if resume is not None else None
    _prepare_host(spec, visible)
    run = _create_run(spec, config, source, registry, notebook, accel)
    notices.save(run.run_dir, notify_urls)  # for the recorder's sender, at the run's end
    run._fn, run._args = fn, args
    run._launch_kw = {"num_processes": num_processes, "mixed_precision": mixed_precision,
                      "name": name, "detach": detach, "env": env, "num_nodes": num_nodes,
                      "node_rank": node_rank, "master_addr": master_addr,
                      "rdzv_backend": rdzv_backend, "notebook": notebook, "notify": notify,
                      "gpus": gpus, "priority": priority, "queue": queue}
    _start_supervisor(run, spec, registry)
    return run


def _spec(fn: Any, args: tuple, config: TrainConfig | None, said: dict[str, Any], accel: Any,
          **kw: Any) -> Spec:
    """The run's Spec: this call's arguments, then its TrainConfig's, then the accelerate config
    file's (`accel`), then the defaults. Checks every argument: nothing has started yet."""
    def pick(key: str, default: Any) -> Any:
        if key in said:
            return said[key]
        got = getattr(accel, key, None) if accel is not None else None
        return default if got is None else got

    gpus = kw["gpus"] if kw["gpus"] is not None else (
        config.gpus if config is not None and config.gpus is not None else pick("gpus", None))
    priority = kw["priority"] if kw["priority"] is not None else (
        config.priority if config is not None else 0)
    spec = Spec(fn=fn, args=args, num_processes=pick("num_processes", None),
                mixed_precision=accel.mixed_precision if accel is not None
                else said.get("mixed_precision") or "no",
                name=kw["name"], detach=kw["detach"], num_nodes=pick("num_nodes", 1),
                node_rank=pick("node_rank", 0), master_addr=pick("master_addr", "127.0.0.1"),
                port=pick("port", None), rdzv_backend=kw["rdzv_backend"],
                env={**(accel.env if accel is not None else {}), **(kw["env"] or {})},
                gpus=gpus, priority=priority, queue=kw["queue"], submitted=time.time())
    spec.env.setdefault("ACCELERATE_MIXED_PRECISION", spec.mixed_precision)  # one rank too
    return spec


def _config_of(config: TrainConfig | dict | None, args: tuple) -> TrainConfig | None:
    if isinstance(config, dict):
        config = TrainConfig.from_dict(config)
    if config is None:
        config = next((a for a in args if isinstance(a, TrainConfig)), None)
    if config is not None and not isinstance(config, TrainConfig):
        raise TypeError(f"launch: config must be a TrainConfig, a dict or None; got "
                        f"{type(config).__name__}")
    return config


def default_ranks(gpus: int) -> int:
    """The ranks a launch starts when it is not told: one per GPU, else up to 2 CPU processes
    (gpu_lab.machine: never more than the host's CPU slots)."""
    from ..machine import default_ranks as ranks

    return ranks(gpus)


def _prepare_host(spec: Spec, gpus: int) -> None:
    """The kernel must be safe to fork; then the number of ranks and the port, if not given."""
    pf.preflight(spec.device)
    if spec.num_processes is None:
        spec.num_processes = default_ranks(gpus)
        if gpus == 0:
            n = spec.num_processes
            print(f"gpu_lab.launch: NVML reports no GPU; launching {n} CPU process"
                  f"{'es (gloo)' if n > 1 else ''}.", flush=True)
    master_addr = spec.master_addr
    if spec.port is None:
        spec.port_chosen = True
        spec.port = pf.free_port(master_addr if master_addr in ("127.0.0.1", "localhost")
                                 else "0.0.0.0")
    elif spec.node_rank == 0 and pf.port_in_use(spec.port, "0.0.0.0" if spec.num_nodes > 1
                                                else master_addr):
        raise ValueError(f"launch: port {spec.port} is in use; pass port=None to choose a free one")


def _create_run(spec: Spec, config: TrainConfig | None, source: dict | None, registry: Registry,
                notebook: str | None, accel: Any = None) -> Run:
    """The run's id, folder, channel keys, checkpoint folder and registry row; its handle."""
    spec.run_id = time.strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(3)
    script = spec.fn if isinstance(spec.fn, Script) else None
    spec.name = spec.name or (script.name if script else getattr(spec.fn, "__name__", "run"))
    # owner-only (gpu_lab.access): what is made below it later (ranks/, errors/, control/,
    # elastic/) is out of other users' reach whatever its own mode
    folder = RunFolder.of(spec.run_id).create(fresh=True)
    # the run's channel keys: the client key for its ranks and the owner's readers, the server
    # pair for its recorder (handed over by the supervisor, never on disk)
    spec.keys = RunKeys.new()
    save_client_key(folder.path, spec.keys.client)
    if script is not None:  # its argv: owner-only, for resume(); never on a command line
        save_target(str(folder.path), script)
    spec.run_dir, spec.registry_path = str(folder.path), str(registry.path)
    output_dir = None
    if config is not None:  # the run's own folder; the ranks get it as cfg.output_dir
        # absolute: the registry row is read from other working directories (the server, attach)
        output_dir = str(Path(config.output_dir).expanduser().resolve() / spec.run_id)
        _private_output_dir(output_dir)
        ranks_config = config.replace(output_dir=output_dir,
                                      resume_from=source["path"] if source else None)
        spec.args = tuple(ranks_config if a is config else a for a in spec.args)
    registry.create_run(spec.run_id, name=spec.name,
                        config=config.to_dict() if config is not None else None,
                        num_processes=spec.num_processes, num_nodes=spec.num_nodes,
                        node_rank=spec.node_rank, output_dir=output_dir, run_dir=spec.run_dir,
                        notebook=notebook or _notebook_path(), detach=int(spec.detach),
                        entry=_entry_of(spec.fn), resumed_from=source, priority=spec.priority,
                        accelerate=accel.record() if accel is not None else None)
    return Run(spec.run_id, spec.name, folder.path, spec.num_processes, registry, config=config,
               port=spec.port, device=spec.device, detach=spec.detach, output_dir=output_dir,
               resumed_from=source)


def _start_supervisor(run: Run, spec: Spec, registry: Registry) -> None:
    """Fork the supervisor, record its pid, follow the run's events and reap it when it ends."""
    sys.stdout.flush()
    sys.stderr.flush()
    heard, spec.joined_fd = os.pipe()
    pid = _fork()
    if pid == 0:  # the supervisor
        os.close(heard)
        supervise(spec)  # never returns
    os.close(spec.joined_fd)
    try:
        os.setpgid(pid, pid)  # also done by the child; whichever runs first wins the race
    except OSError:
        pass
    import psutil

    try:
        started = psutil.Process(pid).create_time()
    except psutil.Error:
        started = None
    run.pid, run.pid_started = pid, started
    registry.update(spec.run_id, pid=pid, pgid=pid, pid_started=started)
    _launched.add(run)
    run._follow()
    threading.Thread(target=_wait_supervisor, args=(run, pid), daemon=True,
                     name=f"gpu_lab-wait-{spec.run_id}").start()
    _wait_joined(heard, run)


IMPORTING = "gpu_lab-importing-"  # the name of a kernel thread that imports (a sweep's opening)


def _fork() -> int:
    """os.fork(), the child never collecting the kernel's objects: the kernel's garbage may hold
    SQLite connections, and finalizing one takes SQLite's allocator lock, which another kernel
    thread may have held at the fork (the child then hangs for good). Its own objects it collects.
    A thread still importing would leave its modules' import locks held in the child, which hangs
    importing one of them: gpu_lab's such threads finish first (a second or two)."""
    for t in threading.enumerate():
        if t.name.startswith(IMPORTING) and t is not threading.current_thread():
            t.join(60)
    collecting = gc.isenabled()
    gc.disable()  # no collection between the fork and the child's freeze
    try:
        pid = os.fork()
        if pid == 0:
            gc.freeze()
    finally:
        if collecting:
            gc.enable()
    return pid


def _check_devices(spec: Spec) -> None:
    """The devices the run will claim exist on this host (gpu_lab.supervise.devices), and how
    many ranks they give when num_processes was not said."""
    from ..supervise.devices import Resources

    res = Resources.detect(kind="gpu" if spec.device == "cuda" else "cpu")
    try:
        if spec.device == "cpu":
            if spec.gpus is not None:
                raise ValueError(f"launch: gpus={spec.gpus!r} but NVML shows no GPU on this host; "
                                 "leave gpus unset (a CPU run takes one CPU slot per rank)")
            n = spec.num_processes or default_ranks(0)
            if n > len(res.devices):
                raise ValueError(f"launch: num_processes={n} needs {n} CPU slots; this host has "
                                 f"{len(res.devices)} (the cores this process may use). Use at "
                                 "most that many, or set GPU_LAB_CPU_SLOTS to allow more")
            return
        if spec.gpus is not None:
            want = res.parse(spec.gpus)
            if spec.num_processes is None:
                spec.num_processes = want.count
            elif spec.num_processes != want.count and spec.num_processes != 1:
                raise ValueError(f"launch: num_processes={spec.num_processes} but gpus="
                                 f"{spec.gpus!r} gives {want.count} GPU(s); one rank per GPU, "
                                 "or num_processes=1 for one process that drives them all "
                                 "(torch.nn.DataParallel, a model split across GPUs)")
    finally:
        res.close()


def _wait_joined(heard: int, run: Run) -> None:
    """Until the supervisor has tried the devices: it holds them, or has its place in the host's
    queue (so runs launched one after another queue in that order), or may not wait."""
    import select

    from ..supervise.claims import DevicesBusy

    try:
        ready, _, _ = select.select([heard], [], [], 60.0)
        word = os.read(heard, 4096) if ready else b""
    finally:
        os.close(heard)
    if word[:1] == BUSY:
        run.wait(timeout=30)  # its failure is recorded before launch() raises
        raise DevicesBusy(f"launch: {word[1:].decode(errors='replace')} (queue=False)", [])
    if word[:1] == ERROR:
        run.wait(timeout=30)
        raise RuntimeError(f"launch: the run could not claim its devices: "
                           f"{word[1:].decode(errors='replace')}")


def _private_output_dir(output_dir: str) -> None:
    """The run's checkpoint folder, owner-only from the start: its checkpoints, TensorBoard logs
    and profiles are written below it by the ranks, whatever modes they use."""
    try:
        private_dir(output_dir)
    except OSError:  # not writable here: the ranks' first checkpoint reports it, with advice
        pass


def _resume_source(resume: Any, config: TrainConfig | None, registry: Registry) -> dict:
    """{"run", "step", "path"} of the checkpoint a resume names, checked against `config`."""
    from ..train.resume import check_compatible, find_checkpoint

    row = None
    if isinstance(resume, Run):
        row = registry.get_run(resume.id)
    elif isinstance(resume, (str, os.PathLike)):
        if not Path(resume).expanduser().exists():
            try:
                row = registry.find_run(str(resume))
            except KeyError as e:
                raise ValueError(f"launch: resume={str(resume)!r} is neither a folder nor a run "
                                 f"in the registry. {e.args[0]}") from None
    else:
        raise TypeError(f"launch: resume must be a Run, a run id or name, or a checkpoint or "
                        f"output folder; got {type(resume).__name__}")
    if row is not None:
        if not row.get("output_dir"):
            raise ValueError(f"launch: run {row['id']} has no checkpoint folder (it was launched "
                             "without a TrainConfig); pass resume=<checkpoint folder>")
        where = row["output_dir"]
    else:
        where = resume
    info = find_checkpoint(where)
    if config is not None:
        check_compatible(info, config)
    return {"run": row["id"] if row else None, "step": info.step, "path": str(info.path)}


def _target_of(fn: Any, args: tuple) -> tuple[Callable, tuple]:
    """What launch() runs: a function with its args, or a Script (its args are its argv)."""
    if isinstance(fn, Script):
        return fn.with_args(*args).checked(), ()
    if isinstance(fn, os.PathLike):
        fn = os.fspath(fn)
    if not isinstance(fn, str):
        return fn, args
    if ":" in fn and not fn.endswith(".py") and not Path(fn).expanduser().exists():
        from ..rank.address import EntryError, resolve_entry

        try:
            return resolve_entry(fn), args
        except EntryError as exc:
            raise ValueError(f"launch: {exc}") from None
    return Script.parse(fn, args), ()


def _entry_of(fn: Callable) -> str | None:
    """'module:qualname' when another process can import fn (not for notebook functions)."""
    if isinstance(fn, Script):  # its target.json says what it runs
        return None
    mod, qual = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not mod or mod == "__main__" or "<" in qual:
        return None
    return f"{mod}:{qual}"


def _wait_supervisor(run: Run, pid: int) -> None:
    """Reap the supervisor (this process is its parent). Its last act is to record the end; the
    run is final here once both have happened. If it died without recording it, the run is lost."""
    try:
        _, status = os.waitpid(pid, 0)
        code: int | None = os.waitstatus_to_exitcode(status)
    except ChildProcessError:  # reaped elsewhere (a SIGCHLD handler of the host program)
        code = None
    run._reaped.set()
    if run._final is not None:
        final = run._final
        run._finish(final["status"], final.get("exitcode", code), final.get("reason"))
        return
    run.exitcode = code
    from ..readers.receiver import get_receiver

    get_receiver().poke(run.id)  # the end may be in the registry without having reached us
    if run._done.wait(5.0):
        return
    run._registry.persist_lost()  # this process writes: record what readers see as lost
    row = run._registry.get_run(run.id)
    if row is not None:
        run._finish(row["status"] if row["status"] in FINAL else "lost", code, row.get("reason"))


Run._launch = staticmethod(launch)  # what Run.resume() calls: the handle never imports this module


def _notebook_path() -> str | None:
    for key in ("JPY_SESSION_NAME", "__vsc_ipynb_file__"):
        if os.environ.get(key):
            return os.environ[key]
    return None


def stop_all_runs(reason: str = "the launching kernel exited") -> None:
    """Stop every run this process launched that is still going and not detached, and wait for
    each to end (a tutorial calls it before removing the folder its runs write into)."""
    for run in list(_launched):
        if not run.done and not run.detach:
            run.stop(grace=3.0, timeout=10.0, reason=reason)


def stop_run(run_id: str, grace: float = 5.0, registry: Registry | None = None,
             reason: str = "stopped by the user") -> str:
    """Stop a run by id from any process on its host (the server extension uses this)."""
    reg = registry or Registry()
    row = reg.get_run(run_id)
    if row is None:
        raise KeyError(f"no run with id {run_id!r} in {reg.path}")
    for run in list(_launched):  # launched from this process: use the handle (it reaps)
        if run.id == run_id:
            return run.stop(grace=grace, reason=reason)
    if row["status"] not in ACTIVE_STATUSES:
        return row["status"]
    if row.get("job"):  # a Slurm job: the checkpoint signal through scancel, not a kill here
        Run._from_row(row, reg).request_stop(reason)  # a ClusterRun (gpu_lab.launch.submit)
        return reg.get_run(run_id)["status"]
    reg.set_status(run_id, "stopping")
    if row.get("pid"):
        terminate_tree(int(row["pid"]), Path(row["run_dir"]) if row.get("run_dir") else None,
                       grace=grace, pid_started=row.get("pid_started"), reason=reason)
    reg.set_status(run_id, "stopped", reason=reason)  # a supervisor that recorded its end wins
    return reg.get_run(run_id)["status"]
