"""Launching: preflight (fork safety, ports), the supervisor, the Run handle, failure triage.

`gpu_lab.launch` is both this package and the launch function: the module object is callable, so
`gpu_lab.launch(train, num_processes=2)` and `gpu_lab.launch.stop_run(run_id)` both work, whatever
was imported first.
"""
import sys as _sys
import types as _types

from .launcher import launch, stop_all_runs, stop_run
from .checks import PreflightError, free_port, preflight
from .run import Run, RunFailedError, attach
from .submit import ClusterRun, submit
from ..failures.triage import RankFailure, RunError
from ..rank.accelerator import accelerator, control_requested

__all__ = ["launch", "submit", "ClusterRun", "stop_run", "stop_all_runs", "attach", "Run", "RunFailedError", "RunError", "RankFailure", "preflight",
           "PreflightError", "free_port", "accelerator", "control_requested"]


class _CallableModule(_types.ModuleType):
    def __call__(self, fn, *args, **kwargs):
        return launch(fn, *args, **kwargs)


_sys.modules[__name__].__class__ = _CallableModule
__doc__ = launch.__doc__
