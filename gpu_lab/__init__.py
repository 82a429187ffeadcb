"""gpu_lab: launch, watch, stop and resume accelerate-backed training from JupyterLab.

The public API is curated here and imported lazily: `import gpu_lab` starts no thread, initialises
no NVML and does not import torch.
"""
from __future__ import annotations

from ._lazy import lazy_api

__version__ = "0.1.0"

# name -> module that defines it
_API = {
    "TrainConfig": "gpu_lab.config",
    "launch": "gpu_lab.launch",
    "Run": "gpu_lab.launch",
    "submit": "gpu_lab.launch",
    "ClusterRun": "gpu_lab.launch",
    "attach": "gpu_lab.sweep",  # a run's id or name, or a sweep's id
    "sweep": "gpu_lab.sweep",
    "attach_sweep": "gpu_lab.sweep",
    "attach_run": "gpu_lab.launch",  # gpu_lab.attach, for a run only
    "loguniform": "gpu_lab.sweep",
    "uniform": "gpu_lab.sweep",
    "preflight": "gpu_lab.launch",
    "PreflightError": "gpu_lab.launch",
    "accelerator": "gpu_lab.launch",
    "report": "gpu_lab.record",
    "Tracker": "gpu_lab.rank.tracker",  # accelerate's log_with: accelerator.log into the record
    "TrainerCallback": "gpu_lab.rank.hf_trainer",  # a Hugging Face Trainer into the record
    "LightningLogger": "gpu_lab.rank.lightning_logger",  # Lightning's Trainer and Fabric
    "Reporter": "gpu_lab.record",
    "runs": "gpu_lab.record.registry",
    "queue": "gpu_lab.launch.hostqueue",
    "compare": "gpu_lab.widgets",
    "Registry": "gpu_lab.record.registry",
    "fit": "gpu_lab.train",
    "train_classifier": "gpu_lab.train",
    "doctor": "gpu_lab.diagnostics",
    "Dashboard": "gpu_lab.widgets",
    "LaunchPanel": "gpu_lab.widgets",
    "LivePlot": "gpu_lab.widgets",
    "GPUPanel": "gpu_lab.widgets",
    "SweepView": "gpu_lab.widgets",
}

_SUBMODULES = ("config", "record", "readers", "telemetry", "train", "data", "diagnostics", "cluster",
               "export", "widgets", "models", "tutorial", "exercises", "cases")

__getattr__, __dir__, __all__ = lazy_api(__name__, _API, submodules=_SUBMODULES,
                                          modules=("launch", "sweep"))  # a callable package
__all__ = __all__ + ["__version__"]


def load_ipython_extension(shell) -> None:
    """`%load_ext gpu_lab`: the %%gpu_lab cell magic (gpu_lab.widgets.magic, imported when a
    cell first uses it)."""
    def gpu_lab(line: str, cell: str):
        from .widgets.magic import cell_magic

        return cell_magic(line, cell, shell)

    gpu_lab.__doc__ = "Run the cell on N ranks: %%gpu_lab --ranks 2 --name NAME --as run"
    shell.register_magic_function(gpu_lab, magic_kind="cell", magic_name="gpu_lab")


def _register_magic() -> None:
    """In IPython, `import gpu_lab` is enough for %%gpu_lab (IPython is loaded there already)."""
    import sys

    shell = getattr(sys.modules.get("IPython"), "get_ipython", lambda: None)()
    if shell is not None and "gpu_lab" not in shell.magics_manager.magics.get("cell", {}):
        load_ipython_extension(shell)


_register_magic()


def _jupyter_server_extension_points() -> list[dict]:
    return [{"module": "gpu_lab.server"}]


def _jupyter_labextension_paths() -> list[dict]:
    return [{"src": "labextension", "dest": "gpu_lab"}]
