"""gpu_lab: launch, watch, stop and resume accelerate-backed training from JupyterLab.

The public API is curated here and imported lazily: `import gpu_lab` starts no thread, initialises
no NVML and does not import torch.
"""
from __future__ import annotations

from importlib import import_module
from typing import Any

__version__ = "0.1.0"

# name -> module that defines it
_API = {
    "TrainConfig": "gpu_lab.config",
    "launch": "gpu_lab.launch",
    "Run": "gpu_lab.launch",
    "attach": "gpu_lab.launch",
    "preflight": "gpu_lab.launch",
    "PreflightError": "gpu_lab.launch",
    "accelerator": "gpu_lab.launch",
    "report": "gpu_lab.stream",
    "Reporter": "gpu_lab.stream",
    "runs": "gpu_lab.registry",
    "compare": "gpu_lab.widgets",
    "Registry": "gpu_lab.registry",
    "fit": "gpu_lab.train",
    "train_classifier": "gpu_lab.train",
    "doctor": "gpu_lab.diagnostics",
    "Dashboard": "gpu_lab.widgets",
    "LaunchPanel": "gpu_lab.widgets",
    "LivePlot": "gpu_lab.widgets",
    "GPUPanel": "gpu_lab.widgets",
}

_SUBMODULES = ("config", "registry", "stream", "telemetry", "train", "data", "diagnostics",
               "export", "widgets", "models", "tutorial", "cases")

__all__ = sorted(_API) + ["__version__"]


def __getattr__(name: str) -> Any:
    mod = _API.get(name)
    if mod is None:
        if name in _SUBMODULES:
            return import_module(f"gpu_lab.{name}")
        raise AttributeError(f"module 'gpu_lab' has no attribute {name!r}")
    module = import_module(mod)
    # gpu_lab.launch is a callable package (see gpu_lab/launch/__init__.py)
    value = module if name == "launch" else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__


def _jupyter_server_extension_points() -> list[dict]:
    return [{"module": "gpu_lab.server"}]


def _jupyter_labextension_paths() -> list[dict]:
    return [{"src": "labextension", "dest": "gpu_lab"}]
