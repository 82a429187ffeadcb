"""Launching: preflight (fork safety, ports), the supervisor, the Run handle, failure triage.

`gpu_lab.launch` is both this package and the launch function: the module object is callable, so
`gpu_lab.launch(train, num_processes=2)` and `gpu_lab.launch.stop_run(run_id)` both work, whatever
was imported first.
"""
from .._lazy import callable_module
from .launcher import launch, stop_all_runs, stop_run
from .checks import PreflightError, free_port, preflight
from .run import Run, RunFailedError, attach_run
from .submit import ClusterRun, submit
from ..failures.triage import RankFailure, RunError
from ..rank.accelerator import accelerator, control_requested

__all__ = ["launch", "submit", "ClusterRun", "stop_run", "stop_all_runs", "attach_run", "Run", "RunFailedError", "RunError", "RankFailure", "preflight",
           "PreflightError", "free_port", "accelerator", "control_requested"]

callable_module(__name__, launch)
