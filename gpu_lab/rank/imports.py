"""Patching a library in a launched rank when it is imported, not before: a script imports
transformers or Lightning after gpu_lab has set the rank up, and importing them here for every
rank would cost seconds for code that never uses them.

`when_imported("transformers.trainer", "gpu_lab.rank.hf_trainer:adopt")` runs the hook on the
module right away if it is loaded already (a rank forked from a kernel that imported it), else
right after its import, once. `wrap(cls, "method", wrapper)` replaces a method once (prepare() may
run twice in a process).
"""
from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.machinery
import sys
from typing import Any, Callable

DONE = "_gpu_lab_adopted"  # marks what was wrapped here

_hooks: dict[str, list[str]] = {}


def when_imported(module: str, hook: str) -> None:
    """Call `hook` ("package.module:function") with `module` once it is imported."""
    if module in sys.modules:
        _call(hook, sys.modules[module])
        return
    hooks = _hooks.setdefault(module, [])
    if hook not in hooks:
        hooks.append(hook)
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


def wrap(cls: Any, name: str, wrapper: Callable[[Callable], Callable]) -> None:
    """cls.name = wrapper(cls.name), unless it was wrapped here already."""
    old = getattr(cls, name)
    if getattr(old, DONE, False):
        return
    new = functools.wraps(old)(wrapper(old))
    setattr(new, DONE, True)
    setattr(cls, name, new)


def _call(hook: str, module: Any) -> None:
    where, _, fn = hook.partition(":")
    getattr(importlib.import_module(where), fn)(module)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a hooked module it asks the finders after it and wraps the
    loader so that the hooks run once the module's code has."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in _hooks:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _Loader(spec.loader, _hooks.pop(fullname))
        return spec


class _Loader(importlib.abc.Loader):
    def __init__(self, loader: Any, hooks: list[str]) -> None:
        self.loader, self.hooks = loader, hooks

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.loader.exec_module(module)
        for hook in self.hooks:
            _call(hook, module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_code, ... for tracebacks
        return getattr(self.loader, name)
