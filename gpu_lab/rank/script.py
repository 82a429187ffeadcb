"""A user's own script or module as the training of every rank: `launch("train.py", "--lr", "0.1")`
or `launch("-m", "pkg.train", ...)`, the way `accelerate launch train.py --lr 0.1` runs it.

The kernel only finds and compiles the file (a missing path or a syntax error is refused before
anything starts); it never imports or runs it, so it stays CUDA-free. Each rank runs it as
`__main__` with its own `sys.argv`, as `python train.py` would:
- `sys.path[0]` is the script's folder (`-m`: the working directory), and a module the kernel
  imported under a name that this folder holds a file for is forgotten first: a fork inherits
  `sys.modules`, and the kernel's `model.py` must not stand in for the script's own;
- non-daemon threads the script started are joined and its `atexit` handlers run when it ends
  (a forked rank leaves with `os._exit`, which runs neither); the kernel's inherited handlers
  are dropped first, they are the kernel's business;
- `sys.exit(0)` and `sys.exit(None)` are a success (gpu_lab.rank.entry).
The argv travels with the fork, and in the owner-only run folder (`target.json`) for resume and
for a Slurm job (gpu_lab.launch.submit): never on a command line that `ps` shows other users.
"""
from __future__ import annotations

import atexit
import importlib.machinery
import os
import runpy
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..record.runfolder import RunFolder

_LOADED_IN = os.getpid()  # the kernel, for a launched run: a rank with another pid is a fork
# never forgotten, whatever the script's folder holds: the rank itself runs on them
_KEEP = frozenset(("gpu_lab", "torch", "accelerate", "numpy", "zmq", "psutil"))


class ScriptError(ValueError):
    """A script or module that cannot be run: missing, not Python, or not valid Python."""


@dataclass(frozen=True)
class Script:
    """What each rank runs as `__main__`: a file (`path`) or a module (`module`), with `argv`."""

    path: str | None = None
    module: str | None = None
    argv: tuple[str, ...] = ()
    origin: str = field(default="", compare=False)  # the file a module runs (found, not imported)

    @classmethod
    def parse(cls, target: str, args: tuple = (), where: str = "launch") -> "Script":
        """`("train.py", "--lr", "0.1")`, `("-m", "pkg.train", ...)` or `("-m pkg.train", ...)`:
        found and compiled here, never imported. Raises ScriptError naming what is wrong."""
        argv = tuple(_arg(a, where) for a in args)
        if target == "-m" or target.startswith("-m "):
            rest = target[2:].strip()
            if not rest:
                if not argv:
                    raise ScriptError(f"{where}: '-m' needs a module name after it, e.g. "
                                      f"{where}('-m', 'pkg.train', '--lr', '0.1')")
                rest, argv = argv[0], argv[1:]
            return cls(module=rest, argv=argv, origin=_find_module(rest, where)).checked(where)
        path = Path(target).expanduser()
        if not path.is_file():
            raise ScriptError(f"{where}: script {target!r} not found (working directory "
                              f"{os.getcwd()}); give a path to a .py file, '-m pkg.module' for a "
                              "module, or 'pkg.module:function' for a function")
        return cls(path=str(path.resolve()), argv=argv).checked(where)

    @classmethod
    def from_dict(cls, d: dict) -> "Script":
        return cls(path=d.get("path"), module=d.get("module"), argv=tuple(d.get("argv") or ()),
                   origin=d.get("origin") or "")

    def to_dict(self) -> dict:
        return {"path": self.path, "module": self.module, "argv": list(self.argv),
                "origin": self.origin}

    @property
    def file(self) -> str:
        return self.path or self.origin

    @property
    def name(self) -> str:
        """The run's default name: the script's file name, or the module's."""
        return Path(self.path).name if self.path else str(self.module)

    @property
    def command(self) -> str:
        """How a terminal would run it (for messages and the registry)."""
        import shlex

        head = ["python", self.path] if self.path else ["python", "-m", str(self.module)]
        return shlex.join(head + list(self.argv))

    def checked(self, where: str = "launch") -> "Script":
        """Compile the file (here, never run): a syntax error is refused before anything starts."""
        try:
            source = Path(self.file).read_bytes()
        except OSError as exc:
            raise ScriptError(f"{where}: cannot read {self.file}: {exc.strerror}") from None
        try:
            compile(source, self.file, "exec", dont_inherit=True)
        except SyntaxError as exc:
            raise ScriptError(f"{where}: {self.file}, line {exc.lineno}: {exc.msg} (a syntax "
                              "error; nothing was started)") from None
        except ValueError as exc:  # null bytes: not a Python source file
            raise ScriptError(f"{where}: {self.file} is not a Python source file ({exc})") from None
        return self

    def with_args(self, *extra: Any) -> "Script":
        """The same script with more arguments (a resume flag, say)."""
        return Script(self.path, self.module, self.argv + tuple(_arg(a, "resume") for a in extra),
                      self.origin)

    # --- in a rank -------------------------------------------------------------------------------
    def __call__(self) -> None:
        """Run the script as this process's `__main__` (in a rank; never in the kernel)."""
        folder = self.path and os.path.dirname(self.path)
        home = folder or os.getcwd()
        sys.path[0:1] = [home]  # what `python train.py` (`python -m`: the cwd) puts first
        forget_shadowed(home)
        before = set(threading.enumerate())
        forked = os.getpid() != _LOADED_IN  # a fork of the kernel ends with os._exit
        if forked:
            atexit._clear()  # the kernel's handlers, inherited by the fork: not this rank's
        try:
            if self.path:
                sys.argv = [self.path, *self.argv]
                runpy.run_path(self.path, run_name="__main__")
            else:
                sys.argv = [self.origin, *self.argv]
                runpy.run_module(str(self.module), run_name="__main__", alter_sys=True)
        finally:
            if forked:  # a fresh interpreter (a headless rank) does this itself at its exit
                _end_like_python(before)

    def __repr__(self) -> str:
        return f"Script({self.command!r})"


def _arg(a: Any, where: str) -> str:
    if isinstance(a, (str, os.PathLike)):
        return os.fspath(a)
    if isinstance(a, (int, float)) and not isinstance(a, bool):
        return str(a)
    raise ScriptError(f"{where}: a script's arguments are strings (a path or a number is "
                      f"turned into one); got {a!r} ({type(a).__name__})")


def _find_module(name: str, where: str) -> str:
    """The file `python -m name` would run, found without importing anything (a package's
    `__init__` would run here, in the kernel): its `__main__.py` for a package."""
    parts = name.split(".")
    if not all(p.isidentifier() for p in parts):
        raise ScriptError(f"{where}: -m {name!r} is not a module name (e.g. 'pkg.train')")
    search: list[str] | None = [os.getcwd()] + [p for p in sys.path if p]
    spec = None
    for i, part in enumerate(parts):
        spec = importlib.machinery.PathFinder.find_spec(part, search)
        if spec is None:
            missing = ".".join(parts[:i + 1])
            raise ScriptError(f"{where}: module {missing!r} not found (looked in the working "
                              f"directory {os.getcwd()} and sys.path); install its package or "
                              "run from the folder that holds it")
        search = list(spec.submodule_search_locations or []) or None
        if search is None and i < len(parts) - 1:
            raise ScriptError(f"{where}: {'.'.join(parts[:i + 1])!r} is a module, not a package: "
                              f"it has no {parts[i + 1]!r}")
    if spec.submodule_search_locations:  # a package runs its __main__
        main = importlib.machinery.PathFinder.find_spec("__main__", list(
            spec.submodule_search_locations))
        if main is None or not main.origin:
            raise ScriptError(f"{where}: {name!r} is a package without a __main__.py; name the "
                              "module to run, e.g. -m pkg.train")
        return main.origin
    if not spec.origin or not spec.origin.endswith(".py"):
        raise ScriptError(f"{where}: -m {name!r} is not a Python source module ({spec.origin})")
    return spec.origin


def forget_shadowed(folder: str) -> list[str]:
    """Forget the modules this process (a fork of the kernel) imported under a name that `folder`
    holds a module or package of, from another file: the script must import its own. Returns
    their names."""
    try:
        entries = os.listdir(folder)
    except OSError:
        return []
    names = set()
    for e in entries:
        if e.endswith(".py"):
            names.add(e[:-3])
        elif os.path.isfile(os.path.join(folder, e, "__init__.py")):
            names.add(e)
    gone = []
    for name in sorted(names - _KEEP):
        mod = sys.modules.get(name)
        if mod is None:
            continue
        spec = importlib.machinery.PathFinder.find_spec(name, [folder])
        mine = getattr(mod, "__file__", None)
        if spec is None or (mine and spec.origin and os.path.realpath(mine)
                            == os.path.realpath(spec.origin)):
            continue
        for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
            del sys.modules[key]
            gone.append(key)
    return gone


def _end_like_python(before: set) -> None:
    """What the interpreter does after `__main__`: wait for the script's non-daemon threads,
    then run the atexit handlers it registered (TensorBoard writers, trackers' finish)."""
    for t in threading.enumerate():
        if t not in before and not t.daemon and t is not threading.current_thread():
            t.join()
    atexit._run_exitfuncs()


def save_target(run_dir: str, script: Script) -> None:
    """The script and its argv in the owner-only run folder: what resume and a job read."""
    import json

    RunFolder(run_dir).write_target(json.dumps(script.to_dict(), indent=1) + "\n")


def load_target(run_dir: str) -> Script | None:
    import json

    text = RunFolder(run_dir).read_target()
    if not text:
        return None
    try:
        return Script.from_dict(json.loads(text))
    except (ValueError, TypeError, AttributeError):
        return None


def run_in_job(config: Any = None) -> None:
    """The entry of a submitted script's ranks (`gpu_lab.rank.headless
    gpu_lab.rank.script:run_in_job`): the script named in the run folder, with its argv."""
    folder = RunFolder.from_env()
    script = load_target(str(folder.path)) if folder is not None else None
    if script is None:
        raise ScriptError("this rank's run folder names no script (target.json); it was "
                          "submitted by an older gpu_lab, or the folder was changed")
    script()
