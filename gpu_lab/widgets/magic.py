"""`%%gpu_lab`: the cell itself is the training function, run on N ranks.

    %%gpu_lab --ranks 2 --name tiny --as run
    acc = Accelerator()
    ...

The cell returns at once with the Run (shown as the cell's result and bound to `--as`, default
`run`); the kernel stays free while the ranks train. The ranks are forked at launch, so the cell
sees the notebook's variables as they were then. The kernel compiles the cell first (a syntax
error is refused before anything starts) and keeps its text for tracebacks; then `launch()`
applies its checks, so CUDA already initialised in the kernel is refused with the same message.

Registered by `import gpu_lab` in IPython, and by `%load_ext gpu_lab` (gpu_lab.load_ipython_extension,
which imports this module only when a cell uses the magic).
"""
from __future__ import annotations

import argparse
import itertools
import linecache
import shlex
from typing import Any

FLAGS = ("--ranks N", "--gpus N|all|0,1", "--name NAME", "--detach", "--priority N",
         "--mixed-precision no|fp16|bf16", "--no-queue", "--as VARIABLE")
_cells = itertools.count(1)


class MagicError(ValueError):
    """A %%gpu_lab line that cannot be launched: what was wrong, and what is accepted."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse would print and exit the kernel's thread
        raise MagicError(f"%%gpu_lab: {message}. Accepted: {', '.join(FLAGS)}")


def _parser() -> _Parser:
    p = _Parser(prog="%%gpu_lab", add_help=False, allow_abbrev=False)
    p.add_argument("--ranks", "-n", type=int, default=None)
    p.add_argument("--gpus", default=None)
    p.add_argument("--name", default="cell")
    p.add_argument("--detach", action="store_true")
    p.add_argument("--priority", type=int, default=None)
    p.add_argument("--mixed-precision", dest="mixed_precision", default=None,
                   choices=("no", "fp16", "bf16"))
    p.add_argument("--no-queue", dest="queue", action="store_false")
    p.add_argument("--as", dest="bind", default="run")
    return p


def parse(line: str) -> dict[str, Any]:
    """The launch() arguments of a %%gpu_lab line, and `bind`: the name the Run is bound to."""
    try:
        words = shlex.split(line)
    except ValueError as exc:
        raise MagicError(f"%%gpu_lab: cannot read {line!r} ({exc})") from None
    opts = vars(_parser().parse_args(words))
    if opts["ranks"] is not None and opts["ranks"] < 1:
        raise MagicError(f"%%gpu_lab: --ranks {opts['ranks']}: a count of 1 or more")
    if not opts["bind"].isidentifier():
        raise MagicError(f"%%gpu_lab: --as {opts['bind']!r}: a Python name, such as run")
    gpus = opts["gpus"]
    if gpus is not None and gpus != "all":
        try:
            opts["gpus"] = [int(g) for g in gpus.split(",")] if "," in gpus else int(gpus)
        except ValueError:
            raise MagicError(f"%%gpu_lab: --gpus {gpus!r}: a count (2), indices (0,1) or all") \
                from None
    opts["num_processes"] = opts.pop("ranks")
    return opts


class CellFunction:
    """The cell's code as a training function: executed in a copy of the namespace it was
    given (in a rank, the notebook's as it was at launch)."""

    def __init__(self, source: str, namespace: dict, filename: str) -> None:
        self.code = compile(source, filename, "exec")  # a SyntaxError here, in the kernel
        self.namespace, self.filename = namespace, filename
        self.__name__ = self.__qualname__ = "cell"

    def __call__(self) -> None:
        exec(self.code, dict(self.namespace))  # noqa: S102 - the user's own cell


def run_cell(line: str, cell: str, shell: Any) -> Any:
    """What %%gpu_lab does: launch the cell on its ranks, bind and return the Run."""
    from ..launch.launcher import launch

    opts = parse(line)
    bind = opts.pop("bind")
    filename = f"<gpu_lab cell {next(_cells)}>"
    # its lines for tracebacks, in the kernel and (inherited by fork) in the ranks
    linecache.cache[filename] = (len(cell), None, cell.splitlines(True), filename)
    fn = CellFunction(cell, shell.user_ns, filename)
    run = launch(fn, **{k: v for k, v in opts.items() if v is not None})
    shell.user_ns[bind] = run
    return run


def cell_magic(line: str, cell: str, shell: Any) -> Any:
    """%%gpu_lab as IPython calls it: a line that cannot be launched is a UsageError (shown
    without a traceback)."""
    from IPython.core.error import UsageError

    try:
        return run_cell(line, cell, shell)
    except MagicError as exc:
        raise UsageError(str(exc)) from None
