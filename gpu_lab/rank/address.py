"""`module:function` addresses of training functions, checked before anything starts.

A headless run cannot receive a function object the way gpu_lab.launch does: torchrun, srun and a
Kubernetes pod start fresh interpreters, so the function travels as its import address, the
convention of console-script entry points (`package.module:function`).
"""
from __future__ import annotations

import importlib
import re
import sys
from typing import Any, Callable

_MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_ATTR = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


class EntryError(ValueError):
    """A `module:function` address that is malformed or does not resolve to a callable."""


def parse_entry(entry: str) -> tuple[str, str]:
    """Split and check the syntax of 'package.module:function' (no import)."""
    if not isinstance(entry, str):
        raise EntryError(f"entry: got {entry!r} ({type(entry).__name__}); expected a string "
                         "'package.module:function'")
    module, sep, attr = entry.strip().partition(":")
    if not sep or not _MODULE.match(module) or not _ATTR.match(attr):
        raise EntryError(f"entry: got {entry!r}; expected 'package.module:function', e.g. "
                         "'gpu_lab.train:train_classifier' (a module-level function, importable "
                         "on every node)")
    return module, attr


def resolve_entry(entry: str) -> Callable[..., Any]:
    """Import 'package.module:function' and return the function; errors name what is missing."""
    module_name, attr = parse_entry(entry)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise EntryError(
            f"entry {entry!r}: module {module_name!r} cannot be imported ({type(exc).__name__}: "
            f"{exc}). It must be importable where the job runs: install the package, or put its "
            f"directory on PYTHONPATH (sys.path[0] is {sys.path[0] or '.'!r}).") from exc
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            names = sorted(n for n in dir(module) if not n.startswith("_")
                           and callable(getattr(module, n, None)))
            raise EntryError(f"entry {entry!r}: module {module_name!r} has no attribute "
                             f"{attr!r}; its callables: {', '.join(names[:20]) or 'none'}") from None
    if not callable(obj):
        raise EntryError(f"entry {entry!r}: {attr!r} is a {type(obj).__name__}, not a function")
    return obj


def entry_of(fn: Callable[..., Any]) -> str:
    """The 'module:function' address of a module-level function (what an exporter needs)."""
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", "")
    if not module or not qualname or "<" in qualname:
        raise EntryError(f"entry: {fn!r} is not a module-level function (a lambda or a nested "
                         "function cannot be imported by a new process); define it in a module")
    if module == "__main__":
        raise EntryError(f"entry: {qualname} is defined in __main__ (a notebook cell or a script); "
                         "a torchrun or cluster job imports it, so move it into a .py module and "
                         "import it from there")
    return f"{module}:{qualname}"
