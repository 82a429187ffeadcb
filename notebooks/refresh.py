"""Re-execute tutorial notebooks in quick mode and store them the way git wants them.

Every output is stripped: deterministic facts are checked by the notebooks themselves (a cell run
under `%%capture captured`, then `gpu_lab.tutorial.check_output(captured, expected)`), so a wrong
fact fails the cell under nbval. Widget state and other volatile metadata are dropped.

    .venv/bin/python notebooks/refresh.py notebooks/01_environment_setup.ipynb [...]
    .venv/bin/python notebooks/refresh.py --strip-only notebooks/*.ipynb
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import nbformat

KEEP_NB_META = ("kernelspec", "language_info")


def strip(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    nb.metadata = {k: v for k, v in nb.metadata.items() if k in KEEP_NB_META}
    for cell in nb.cells:
        # "jupyter": source_hidden collapses the fact-check cells for the reader (JupyterLab honours it);
        # "gpu_lab": what a check declares about itself (tests/test_tutorial_checks.py)
        cell.metadata = {k: v for k, v in cell.metadata.items() if k in ("tags", "jupyter", "gpu_lab")}
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
    return nb


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="+", type=Path)
    ap.add_argument("--strip-only", action="store_true")
    ap.add_argument("--timeout", type=int, default=600)
    a = ap.parse_args(argv)
    os.environ.setdefault("GPU_LAB_QUICK", "1")
    if "GPU_LAB_HOME" not in os.environ:
        import tempfile

        os.environ["GPU_LAB_HOME"] = tempfile.mkdtemp(prefix="gpu_lab_nb_")
    for p in a.paths:
        nb = nbformat.read(p, as_version=4)
        if not a.strip_only:
            from nbclient import NotebookClient

            NotebookClient(nb, timeout=a.timeout, kernel_name="python3",
                           resources={"metadata": {"path": str(p.parent)}}).execute()
        nbformat.write(strip(nb), p)
        print(f"stored {p}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
