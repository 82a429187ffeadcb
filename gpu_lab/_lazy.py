"""Lazy public APIs: a package names what it offers, and each name is imported on first use, so that
`import gpu_lab` (or `gpu_lab.train`, `gpu_lab.data`, ...) starts no thread and imports no torch."""
from __future__ import annotations

import sys
import types
from importlib import import_module
from typing import Any, Callable, Iterable


def lazy_api(package: str, api: dict[str, str], *, submodules: Iterable[str] = (),
             modules: Iterable[str] = (), eager: Iterable[str] = ()
             ) -> tuple[Callable[[str], Any], Callable[[], list], list]:
    """(__getattr__, __dir__, __all__) for `package`. `api` maps each public name to the module
    that defines it (absolute, or relative to the package: ".loop"); names in `modules` resolve to
    that module itself (a callable package such as gpu_lab.launch); `submodules` may be reached as
    attributes without being listed in __all__; `eager` names the package imported itself."""
    names = sorted([*api, *eager])
    subs, whole = frozenset(submodules), frozenset(modules)

    def __getattr__(name: str) -> Any:
        where = api.get(name)
        if where is None:
            if name in subs:
                return import_module(f"{package}.{name}")
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = import_module(where, package)
        value = module if name in whole else getattr(module, name)
        setattr(sys.modules[package], name, value)  # the next lookup is a plain attribute
        return value

    def __dir__() -> list[str]:
        return list(names)

    return __getattr__, __dir__, names


class CallableModule(types.ModuleType):
    """A package that is also its main function: `gpu_lab.launch(...)`, `gpu_lab.sweep(...)`."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.__dict__["_call"](*args, **kwargs)


def callable_module(name: str, fn: Callable) -> None:
    """Make the module `name` callable as `fn`, whatever was imported first (the package or the
    function through gpu_lab's lazy API); its help() is the function's."""
    module = sys.modules[name]
    module._call = fn
    module.__class__ = CallableModule
    module.__doc__ = fn.__doc__
