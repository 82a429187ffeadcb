"""Re-execute tutorial notebooks in quick mode and store them the way git wants them.

Outputs are stripped everywhere except in cells marked `# NBVAL_CHECK_OUTPUT`: those keep their
(deterministic) output and an execution count, because nbval compares only cells that were run.
Widget state and other volatile metadata are dropped.

    .venv/bin/python notebooks/refresh.py notebooks/01_environment_setup.ipynb [...]
    .venv/bin/python notebooks/refresh.py --strip-only notebooks/*.ipynb
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import nbformat

CHECK = "NBVAL_CHECK_OUTPUT"
KEEP_NB_META = ("kernelspec", "language_info")


def strip(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    nb.metadata = {k: v for k, v in nb.metadata.items() if k in KEEP_NB_META}
    n = 0
    for cell in nb.cells:
        cell.metadata = {k: v for k, v in cell.metadata.items() if k in ("tags",)}
        if cell.cell_type != "code":
            continue
        if CHECK in cell.source and cell.get("outputs"):
            n += 1
            cell.execution_count = n
            for o in cell.outputs:
                o.pop("metadata", None) if o.get("output_type") == "stream" else None
                if o.get("output_type") == "execute_result":
                    o["execution_count"] = n
        else:
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
