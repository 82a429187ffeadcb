"""The architecture rules of DESIGN.md, enforced: dependency direction and a cheap import."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "gpu_lab"
HEADLESS = ["train", "data", "diagnostics", "export", "launch", "stream", "models", "cases"]
VIEW_MODULES = ("ipywidgets", "plotly", "anywidget", "jupyter_server", "jupyterlab", "IPython",
                "ipykernel", "tornado", "gpu_lab.widgets", "gpu_lab.server")


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    names = set()
    pkg_parts = path.relative_to(PKG.parent).with_suffix("").parts
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # resolve relative imports
                base = pkg_parts[: len(pkg_parts) - node.level]
                mod = ".".join(base + ((node.module,) if node.module else ()))
            else:
                mod = node.module or ""
            names.add(mod)
            names.update(f"{mod}.{a.name}" for a in node.names)
    return names


@pytest.mark.parametrize("sub", HEADLESS)
def test_headless_packages_never_import_views(sub):
    d = PKG / sub
    files = list(d.rglob("*.py")) if d.is_dir() else [PKG / f"{sub}.py"]
    bad = []
    for f in files:
        for name in _imports(f):
            # Run.dashboard() imports widgets lazily on purpose: the one sanctioned exception
            if f.name == "run.py" and name.startswith("gpu_lab.widgets"):
                continue
            if any(name == v or name.startswith(v + ".") for v in VIEW_MODULES):
                bad.append(f"{f.relative_to(PKG.parent)} imports {name}")
    assert not bad, "\n".join(bad)


def test_import_gpu_lab_is_cheap_and_quiet():
    code = ("import sys, threading; import gpu_lab; "
            "print(sorted(m for m in ('torch','pynvml','zmq','ipywidgets','plotly','accelerate') "
            "if m in sys.modules), threading.active_count())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[] 1"


def test_headless_modules_load_without_view_libraries():
    code = ("import sys, importlib\n"
            f"for m in {['gpu_lab.' + s for s in HEADLESS]!r}:\n"
            "    importlib.import_module(m)\n"
            f"print(sorted(v for v in {list(VIEW_MODULES)!r} if v in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
