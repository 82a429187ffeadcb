"""gpu_lab.sweep — hyperparameter sweeps from a notebook that never block it.

`gpu_lab.sweep(fn, base_cfg, space={...}, trials=N, parallel=K, ...)` returns a Sweep at once; a
driver process (a fresh interpreter) runs Optuna's search, each trial as gpu_lab.launch runs in the
host queue, pruning from the trials' records. The study is Optuna's, in Optuna's storage
(gpu_lab.sweep.study). Views of a sweep live in gpu_lab.widgets.sweepview: this package imports
no widget.
"""
from .._lazy import callable_module
from .handle import Best, Sweep, attach, attach_sweep, sweep
from .space import Range, loguniform, uniform

__all__ = ["sweep", "Sweep", "Best", "attach", "attach_sweep", "loguniform", "uniform", "Range"]
callable_module(__name__, sweep)
