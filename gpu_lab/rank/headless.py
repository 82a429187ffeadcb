"""Run a training function headless: `python -m gpu_lab.rank.headless module:function --config cfg.json`.

This is what every exported command runs, once per rank: under torchrun (and `accelerate launch`,
which starts torchrun's agent), under Slurm's srun (one task per GPU), in a Kubernetes pod, or
alone. No kernel is listening, so each rank records its own metrics:

- every rank runs a Recorder on loopback in its own process and points gpu_lab.report at it
  (`GPU_LAB_EVENTS`, with the recorder's own CURVE key in `GPU_LAB_EVENTS_KEY`, which never leaves
  the rank: another local user cannot push events into it), so `report()` keeps its never-block
  promise; the run's folder is the owner's only (gpu_lab.access); the recorder's thread writes the
  rank's events into the run's record in the registry (SQLite in WAL mode with a busy timeout:
  concurrent writers wait their turn, and the registry numbers events under its write lock). No
  address has to be agreed between ranks or nodes; `gpu_lab.attach(run_id)` follows such a run
  through the registry.
- local rank 0 of each node creates (or, after a restart or a Slurm requeue, revives) the node's
  registry row: kind "torchrun" / "slurm" / "python", the node rank, the number of nodes, the
  launcher's pid (so `gpu_lab.launch.stop_run` and lost-run detection work as for notebook runs).
- the run id is the same on every rank of a node without any exchange: it is derived from the
  launcher process (torchrun's agent) or from the Slurm job id, or given with `--run-id`.
- the outcome lands in the registry: succeeded; failed with the rank's exception; or stopped when
  the training toolkit's PreemptionGuard exits with 143 (Slurm then requeues, see gpu_lab.export),
  or when a stop signal (SIGTERM, SIGUSR1, SIGHUP) arrives outside fit() (also exit 143).

TensorBoard logging is the training toolkit's (TrainConfig.tensorboard, under output_dir).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import traceback
from pathlib import Path
from typing import Any, Sequence

from . import outcome
from .rows import Topology, close_row, derive_run_id, detect_topology, open_row, start_recording

__all__ = ["main", "parse_args", "load_config", "Topology", "detect_topology", "derive_run_id",
           "open_row", "close_row", "start_recording"]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m gpu_lab.rank.headless",
        description="Run a training function on this rank (under torchrun, accelerate launch, "
                    "srun, or alone) and record its metrics in the gpu_lab run registry.")
    p.add_argument("entry", metavar="MODULE:FUNCTION",
                   help="the training function, e.g. gpu_lab.train:train_classifier; it is called "
                        "as fn(config) with --config, else fn()")
    p.add_argument("--config", metavar="CONFIG.json", help="a TrainConfig as JSON (TrainConfig.to_json)")
    p.add_argument("--run-id", help="registry id of the run (default: derived from the launcher; "
                                    "slurm-<job id> under Slurm)")
    p.add_argument("--name", help="run name shown in the registry (default: the function's name)")
    p.add_argument("--in-job", action="store_true",
                   help="a rank of a submitted run (gpu_lab.submit): report to the job's recorder "
                        "(GPU_LAB_EVENTS, GPU_LAB_EVENTS_KEY), which owns the run's record")
    return p.parse_args(argv)


def load_config(path: str):
    from ..config import TrainConfig

    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--config: {path!r} is not a file (cwd: {os.getcwd()})")
    try:
        return TrainConfig.from_json(p.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"--config {path!r}: not valid JSON ({exc})") from None


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # --- everything is checked before anything starts --------------------------------------------
    from ..record import notify
    from .address import EntryError, resolve_entry

    try:
        config = load_config(args.config) if args.config else None
        fn = resolve_entry(args.entry)
        topo = detect_topology()
        run_id = derive_run_id(topo, args.run_id)
        notify_urls = notify.configured()  # a bad GPU_LAB_NOTIFY is refused before the run
    except (EntryError, ValueError, TypeError) as exc:
        print(f"gpu_lab.rank.headless: {exc}", file=sys.stderr, flush=True)
        return outcome.EXIT_USAGE

    from ..access import private_if_new
    from ..record.registry import Registry
    from ..record.runfolder import RunFolder

    if args.in_job:
        return _in_job(fn, config, topo)
    registry = Registry()
    # the same folder on every local rank, and after a requeue
    folder = RunFolder.of(run_id).create(fresh=False)
    if config is not None:  # a folder the user made stays as they made it
        private_if_new(Path(config.output_dir).expanduser())

    def make_row() -> None:
        open_row(registry, run_id, topo, config, folder.path,
                 args.name or getattr(fn, "__name__", "run"))

    if topo.is_node_leader:
        make_row()
    recorder, reporter = start_recording(registry, run_id, folder)
    try:
        status, code, error = _call(fn, config, topo, folder, reporter)
    finally:
        reporter.close(2.5)  # the last reports go to the recorder, which writes them and closes
        recorder.close()

    if status == "failed" and registry.get_run(run_id) is None:
        # this rank failed before the node leader got as far as creating the row (it may have
        # been ended by torchrun meanwhile): create it, so the failure is not lost
        try:
            make_row()
        except Exception:  # noqa: BLE001 - the leader created it in the meantime
            pass
    close_row(registry, run_id, topo, status, error)
    if notify_urls and topo.rank == 0:  # one notice per run, with the row as it stands now
        notify.send_end(registry.get_run(run_id) or {"id": run_id, "status": status}, notify_urls)
    lost = recorder.received - recorder.written
    if lost or recorder.write_errors:
        print(f"gpu_lab.rank.headless: rank {topo.rank}: {lost} event(s) could not be written to "
              f"{registry.path} ({recorder.write_errors} failed write(s))", file=sys.stderr,
              flush=True)
    return code


def _in_job(fn: Any, config: Any, topo: Topology) -> int:
    """A rank of a submitted run: its job's supervisor owns the record (row, recorder, end) and
    handed this rank the channel in its environment; the rank leaves its result or its error in
    the run folder and exits with its code, which srun passes on."""
    from ..record import events as ev
    from ..record import reporter as rep
    from ..record.runfolder import RunFolder

    folder = RunFolder.from_env()
    if folder is None or not os.environ.get(ev.ENV_ADDRESS):
        print(f"gpu_lab.rank.headless: --in-job needs {ev.ENV_ADDRESS} and {ev.ENV_RUN_DIR}, "
              "which the job's supervisor (gpu_lab.cluster.job) sets", file=sys.stderr, flush=True)
        return outcome.EXIT_USAGE
    rep.reset_reporter()
    reporter = rep.get_reporter()
    try:
        _, code, _ = _call(fn, config, topo, folder, reporter)
    finally:
        reporter.close(2.5)
        # what reached the recorder is in the record; what did not is counted against this
        # (gpu_lab.cluster.relay): a recorder restarted mid-job loses what was on the way
        folder.write_sent(topo.rank, reporter.sent)
    return code


def _call(fn: Any, config: Any, topo: Topology, folder: Any,
          reporter: Any) -> tuple[str, int, str | None]:
    """Run the training function; (status, exit code, error) of this rank, its result or its
    failure recorded in the run folder (gpu_lab.rank.outcome). A stop signal outside fit() ends
    it as 'stopped' with exit code 143 (outcome.raise_stopped)."""
    from . import adopt

    on_main = threading.current_thread() is threading.main_thread()
    if on_main:
        outcome.set_stop_handlers(outcome.raise_stopped)
    try:
        adopt.prepare()  # accelerate's group and tracker, as in a launched rank
        reporter.running()
        result = fn(config) if config is not None else fn()
        if topo.rank == 0:
            outcome.write_result(folder, result, reporter)
        return "succeeded", outcome.EXIT_OK, None
    except SystemExit as exc:
        code = outcome.exit_code(exc)
        if code == outcome.STOP_EXIT_CODE:
            return "stopped", code, f"rank {topo.rank}: {exc}"
        if code != 0:
            failure = outcome.write_exit(folder, topo.rank, exc)
            return "failed", code, f"rank {topo.rank}: {failure.type}: {failure.message}"
        return "succeeded", code, None
    except KeyboardInterrupt:
        return ("stopped", outcome.EXIT_INTERRUPTED,
                f"rank {topo.rank}: interrupted (SIGINT)")
    except BaseException as exc:  # noqa: BLE001 - recorded, then the process fails
        outcome.write_error(folder, topo.rank, exc)
        traceback.print_exc()
        return "failed", outcome.EXIT_FAILED, f"rank {topo.rank}: {type(exc).__name__}: {exc}"
    finally:
        if on_main:  # a second signal must not cut the bookkeeping short
            outcome.set_stop_handlers(signal.SIG_IGN)


if __name__ == "__main__":
    sys.exit(main())
