"""Small helpers the tutorial notebooks share: quick vs full mode, claim-vs-measured tables.

Quick mode runs every notebook in about a minute on a CPU laptop; full mode uses the model sizes of
the two articles the tutorials follow (Article A and Article B, named in notebooks/00_overview) and
needs a GPU server.
"""
from __future__ import annotations

import atexit
import html
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable


def _env_flag(name: str) -> bool | None:
    """An on/off environment variable: None when unset or empty, False for 0/false/no, else True."""
    flag = os.environ.get(name, "").strip()
    return None if not flag else flag not in ("0", "false", "no")


def quick() -> bool:
    """True without a GPU (NVML's count) or with GPU_LAB_QUICK=1; GPU_LAB_QUICK=0 forces full."""
    flag = _env_flag("GPU_LAB_QUICK")
    if flag is not None:
        return flag
    from .telemetry_probe import gpu_count

    return gpu_count() == 0


def mode() -> str:
    return "quick" if quick() else "full"


def workdir(tag: str) -> Path:
    """A fresh folder for one notebook's files (synthetic images, shards, checkpoints) in the
    system temp dir, removed when the kernel shuts down: in full mode a notebook writes hundreds of
    MB there, and a temp folder per run of every notebook would pile up. The runs this kernel
    launched are stopped first (they may be writing checkpoints into it). GPU_LAB_KEEP_WORK=1
    keeps the folder."""
    path = Path(tempfile.mkdtemp(prefix=f"gpu_lab_{tag}_"))
    atexit.register(_remove_workdir, path)
    return path


def _remove_workdir(path: Path) -> None:
    if _env_flag("GPU_LAB_KEEP_WORK"):
        return
    launcher = sys.modules.get("gpu_lab.launch.launcher")  # not imported: nothing was launched
    if launcher is not None:
        launcher.stop_all_runs()
    shutil.rmtree(path, ignore_errors=True)


@dataclass
class Claim:
    """One number an article claims, next to what this machine measured."""

    what: str
    claimed: str
    measured: str
    source: str = ""
    verdict: str = ""


class ClaimTable:
    """Renders claims and measurements side by side (HTML in a notebook, text elsewhere)."""

    def __init__(self, rows: Iterable[Claim | tuple | dict]) -> None:
        self.rows = [r if isinstance(r, Claim) else Claim(**r) if isinstance(r, dict) else Claim(*r)
                     for r in rows]

    def __str__(self) -> str:
        cols = ("what", "claimed", "measured", "verdict", "source")
        data = [[getattr(r, c) for c in cols] for r in self.rows]
        width = [max(len(c), *(len(str(d[i])) for d in data)) if data else len(c)
                 for i, c in enumerate(cols)]
        line = lambda vals: "  ".join(str(v).ljust(w) for v, w in zip(vals, width))  # noqa: E731
        return "\n".join([line(cols)] + [line(d) for d in data])

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{c}</th>" for c in ("What", "Article claims", "Measured here",
                                                  "Verdict", "Source"))
        body = "".join(
            "<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in
                             (r.what, r.claimed, r.measured, r.verdict, r.source)) + "</tr>"
            for r in self.rows)
        return f"<table><tr>{head}</tr>{body}</table>"

    def __repr__(self) -> str:
        return f"ClaimTable({len(self.rows)} rows)"


def verdict(measured: float, claimed: float, tolerance: float = 0.25,
            higher_is_better: bool = True) -> str:
    """'holds' / 'does not hold here' / 'exceeds' for a measured ratio against a claimed one."""
    if claimed == 0:
        return "n/a"
    rel = measured / claimed
    if abs(rel - 1) <= tolerance:
        return "holds"
    better = rel > 1 if higher_is_better else rel < 1
    return "exceeds the claim" if better else "does not hold here"


def show(obj: Any) -> Any:
    """Display in a notebook if IPython is there, else print."""
    try:
        from IPython.display import display

        display(obj)
    except ImportError:
        print(obj)
    return None


def check_output(captured: Any, expected: str) -> None:
    """Assert that a cell run under `%%capture captured` printed exactly `expected`, then show it.

    The tutorials check their deterministic facts this way (shapes, counts, preflight messages)
    instead of storing reference outputs in the notebook: a wrong fact fails the cell under nbval.
    """
    parts = [captured.stdout]
    for out in getattr(captured, "outputs", []):
        text = getattr(out, "data", {}).get("text/plain")
        if text is not None:
            parts.append(text + "\n")
    got = "".join(parts)
    captured.show()
    if got != expected:
        raise AssertionError(f"the cell printed\n{got!r}\nbut the tutorial expects\n{expected!r}")
