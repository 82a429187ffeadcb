"""Small helpers the tutorial notebooks share: quick vs full mode, claim-vs-measured tables, and
the verdicts in those tables.

Quick mode runs every notebook in about a minute on a CPU laptop; full mode uses the model sizes of
the two articles the tutorials follow (named in notebooks/00_overview) and needs a GPU server.

A verdict is computed, never typed: each verdict function takes the measurement, the claim and the
threshold, and returns a `Verdict` whose text names the threshold and why it is that. A claim that
no measurement here can decide gets a verdict that says so: `arithmetic` (a formula, not a
measurement), `needs_gpu` (full mode measures it), `not_attempted` (with the reason), or, for a
measurement that needs more devices than the host has, the verdict of `needs_devices(n, what)`,
which names how many it needs and how many the host has (and so does the measured verdict).

Sizes follow the machine (gpu_lab.machine): `ranks()`, `loader_workers()`, `sweep_parallel()`,
`precision()`; `full_mode(work)` states how long a notebook's full mode takes on one GPU and on
eight. With GPU_LAB_VERDICTS set to a file, every claim table appends its rows to it (JSON lines):
two machines' verdicts, or two shapes of one, side by side.
"""
from __future__ import annotations

import atexit
import html
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

from .estimate import Work, full_mode  # noqa: F401 - the notebooks' names for them
from .machine import loader_workers, precision, shape, sweep_parallel  # noqa: F401
from .quickmode import env_flag as _env_flag
from .quickmode import describe as mode_line  # noqa: F401
from .quickmode import mode, quick  # noqa: F401


# The two articles the tutorials follow (Chinese; notebooks/00_overview says what each covers), by
# a title a reader can search for and their section headings in English: a notebook cites
# `cite("A", "2.2")`'s text, never a file name or a bare section number.
ARTICLES = {"A": "GPU Servers in the Cloud and Training Image Models",
            "B": "GPU Servers: the Compute Engine of Deep Learning"}
SECTIONS = {
    "A": {"1": "GPU servers in cloud architecture", "1.1": "Where GPU servers sit in a cloud",
          "1.2": "Core architecture components", "2": "Training image models, hands-on",
          "2.1": "Preparing the environment in three steps", "2.2": "Five things that speed up training",
          "2.3": "A typical training flow", "3": "Performance best practice",
          "3.1": "Choosing hardware", "3.2": "Tuning the software stack", "3.3": "Controlling cost",
          "4": "Typical problems and their fixes", "4.1": "Common failures",
          "4.2": "A performance tuning case", "5": "What comes next"},
    "B": {"1": "GPU servers: the compute engine of deep learning", "1.1": "The core of the hardware",
          "1.2": "A vertically integrated software stack", "2": "Optimising deep learning systems",
          "2.1": "Data pipelines", "2.2": "Mixed-precision training",
          "2.3": "Distributed training strategies", "3": "Managing GPU clusters",
          "3.1": "Scheduling resources", "3.2": "Monitoring and tuning",
          "4": "Applications in practice", "4.1": "Computer vision",
          "4.2": "Natural language processing", "4.3": "Recommender systems",
          "5": "What comes next"},
}


def cite(article: str, section: str) -> str:
    """'GPU Servers in the Cloud and Training Image Models, “Five things that speed up training”'."""
    try:
        return f"{ARTICLES[article]}, “{SECTIONS[article][section]}”"
    except KeyError:
        raise ValueError(f"no section {section!r} in article {article!r}: articles "
                         f"{sorted(ARTICLES)}, sections {sorted(SECTIONS.get(article, {}))}") from None


def expected_group(ranks: int) -> dict:
    """What accelerate forms here for `ranks` launched processes, as a notebook's check expects
    it: {"backend", "distributed_type", "world_size"} (nccl and MULTI_GPU on GPUs, gloo and
    MULTI_CPU without; no group and NO for one process)."""
    from .telemetry.probe import gpu_count

    if ranks == 1:
        return {"backend": None, "distributed_type": "NO", "world_size": 1}
    gpu = gpu_count() > 0
    return {"backend": "nccl" if gpu else "gloo",
            "distributed_type": "MULTI_GPU" if gpu else "MULTI_CPU", "world_size": ranks}


def ranks() -> int:
    """How many ranks gpu_lab.launch() starts here when not told: one per GPU, else 2 on CPU
    (1 on a host with one CPU slot, the stand-in for a one-GPU server)."""
    from .machine import default_ranks

    return default_ranks()


def machine_line() -> str:
    """'this machine: 1 GPU (NVIDIA H100 80GB HBM3), 16 CPU cores' or 'this machine: no GPU; 2 CPU
    slots on 2 cores ...': what a notebook's sizes follow."""
    return f"this machine: {shape().describe()}"


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
    verdict: "str | Verdict" = ""


class ClaimTable:
    """Renders claims and measurements side by side (HTML in a notebook, text elsewhere); with
    GPU_LAB_VERDICTS set, appends each row to that file as a JSON line."""

    def __init__(self, rows: Iterable[Claim | tuple | dict]) -> None:
        self.rows = [r if isinstance(r, Claim) else Claim(**r) if isinstance(r, dict) else Claim(*r)
                     for r in rows]
        path = os.environ.get(VERDICTS_VARIABLE, "").strip()
        if path:
            self.record(path)

    def record(self, path: str) -> None:
        """Append the rows to `path`, a JSON line each: what, the verdict's label and reason, and
        for a multi-device row the devices it needs and the host has."""
        with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "a") as f:
            for r in self.rows:
                v = r.verdict if isinstance(r.verdict, Verdict) else Verdict(str(r.verdict))
                f.write(json.dumps({"what": r.what, "claimed": r.claimed, "label": v.label,
                                    "reason": v.reason, "need": v.need, "have": v.have}) + "\n")

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
    """'holds' / 'does not hold here' / 'exceeds' for a measured ratio against a claimed one: the
    label of `ratio_verdict` (which also gives the reason)."""
    if claimed == 0:
        return "n/a"
    return ratio_verdict(measured, claimed, tolerance, higher_is_better).label


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


# ------------------------------------------------------------------------------------- verdicts

HOLDS, FAILS, EXCEEDS = "holds", "does not hold here", "exceeds the claim"
ARITHMETIC, NEEDS_GPU, NOT_ATTEMPTED = "arithmetic, not measured", "needs a GPU", "not attempted"
NEEDS_DEVICES = "needs more devices"
VERDICTS_VARIABLE = "GPU_LAB_VERDICTS"


@dataclass(frozen=True)
class Verdict:
    """The outcome of one claim: `label` (HOLDS, FAILS, ...) and `reason`, which names the
    threshold and why it is that, or why nothing was measured. A row that needs several devices
    carries `need` (how many) and `have` (how many this host has)."""

    label: str
    reason: str = ""
    need: int | None = None
    have: int | None = None

    @property
    def holds(self) -> bool:
        return self.label in (HOLDS, EXCEEDS)

    @property
    def measured(self) -> bool:
        return self.label not in (ARITHMETIC, NEEDS_GPU, NOT_ATTEMPTED, NEEDS_DEVICES)

    def __str__(self) -> str:
        return f"{self.label} ({self.reason})" if self.reason else self.label


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise ValueError(f"{name}={value!r}: expected a measured number (int or float, not NaN)")
    return float(value)


def _fmt(x: float) -> str:
    """3 significant digits, without an exponent for the sizes a table shows (3,046 not 3.05e+03)."""
    return f"{x:,.0f}" if 1e3 <= abs(x) < 1e9 else f"{x:.3g}"


def _samples(name: str, values: Sequence[float]) -> list[float]:
    vals = [_number(name, v) for v in values]
    if len(vals) < 2:
        raise ValueError(f"{name}={values!r}: expected at least 2 runs (seeds) to estimate a spread")
    return vals


def ratio_verdict(measured: float, claimed: float, tolerance: float = 0.25,
                  higher_is_better: bool = True, why: str = "") -> Verdict:
    """A measured ratio (a speed-up, a saving) against the article's: HOLDS within ±tolerance of
    the claim, EXCEEDS beyond it on the good side, FAILS on the other."""
    measured, claimed = _number("measured", measured), _number("claimed", claimed)
    if claimed == 0:
        raise ValueError("claimed=0: a ratio claim needs a non-zero figure")
    rel = measured / claimed
    reason = f"{rel:.2f}× the claim; holds within ±{tolerance:.0%}" + (f": {why}" if why else "")
    if abs(rel - 1) <= tolerance:
        return Verdict(HOLDS, reason)
    better = rel > 1 if higher_is_better else rel < 1
    return Verdict(EXCEEDS if better else FAILS, reason)


def at_least(measured: float, threshold: float, why: str, unit: str = "") -> Verdict:
    """A claim that names no figure, only a direction ("batching is faster"): HOLDS when the
    measurement reaches `threshold`, chosen (and explained in `why`) above the noise."""
    measured, threshold = _number("measured", measured), _number("threshold", threshold)
    label = HOLDS if measured >= threshold else FAILS
    return Verdict(label, f"{_fmt(measured)}{unit} against a threshold of {_fmt(threshold)}{unit}: {why}")


def at_most(measured: float, threshold: float, why: str, unit: str = "") -> Verdict:
    """The mirror of `at_least`: HOLDS when the measurement stays at or below `threshold`."""
    measured, threshold = _number("measured", measured), _number("threshold", threshold)
    label = HOLDS if measured <= threshold else FAILS
    return Verdict(label, f"{_fmt(measured)}{unit} against a limit of {_fmt(threshold)}{unit}: {why}")


def spread(values: Sequence[float]) -> tuple[float, float]:
    """(mean, sample standard deviation) of per-seed results."""
    import statistics

    vals = _samples("values", values)
    return statistics.fmean(vals), statistics.stdev(vals)


def gain(baseline: Sequence[float], treated: Sequence[float], min_gain: float, why: str,
         z: float = 2.0) -> Verdict:
    """Claim: `treated` beats `baseline` (per-seed results, higher is better). HOLDS when the mean
    gain is at least `min_gain` and `z` standard errors of the difference; FAILS otherwise, and the
    reason says whether the difference is inside the noise or of the other sign."""
    import math

    (ma, sa), (mb, sb) = spread(baseline), spread(treated)
    diff = mb - ma
    se = math.sqrt(sa * sa / len(baseline) + sb * sb / len(treated))
    noise = z * se
    reason = (f"mean gain {diff:+.3g} ± {se:.2g} (standard error, {len(baseline)} and "
              f"{len(treated)} seeds); holds from {max(min_gain, noise):.3g}: {why}")
    if diff >= min_gain and diff > noise:
        return Verdict(HOLDS, reason)
    if diff < -noise:
        return Verdict(FAILS, "the opposite holds here: " + reason)
    return Verdict(FAILS, "within the noise: " + reason)


def follows(driver: Sequence[float], response: Sequence[float], min_ratio: float, why: str) -> Verdict:
    """Claim: `response` grows with `driver` (the batch with the request rate). HOLDS when the
    response never falls as the driver rises and grows by at least `min_ratio` from the lowest
    driver to the highest."""
    pairs = sorted(zip(_samples("driver", driver), _samples("response", response)))
    if len(pairs) != len(driver) or len(driver) != len(response):
        raise ValueError(f"follows: {len(driver)} drivers but {len(response)} responses")
    ys = [y for _, y in pairs]
    # 5% slack: a mean batch measured over a second wobbles by a few percent
    monotone = all(b >= a * 0.95 for a, b in zip(ys, ys[1:]))
    ratio = ys[-1] / ys[0] if ys[0] > 0 else float("inf")
    reason = (f"{ys[0]:.3g} → {ys[-1]:.3g} ({ratio:.1f}×) over {pairs[0][0]:g} → {pairs[-1][0]:g}, "
              f"{'never falling' if monotone else 'falling somewhere'}; holds from {min_ratio:g}×, rising: {why}")
    return Verdict(HOLDS if monotone and ratio >= min_ratio else FAILS, reason)


def equivalent(measured: float, reference: float, rtol: float, why: str) -> Verdict:
    """Claim: two computations give the same number (accumulated vs one large batch). HOLDS when
    they agree within `rtol` of the reference."""
    measured, reference = _number("measured", measured), _number("reference", reference)
    rel = abs(measured - reference) / max(abs(reference), 1e-12)
    return Verdict(HOLDS if rel <= rtol else FAILS,
                   f"relative difference {rel:.1e}, holds up to {rtol:.0e}: {why}")


def arithmetic(why: str) -> Verdict:
    """A claim that is a formula or a definition: shown, never passed off as measured."""
    return Verdict(ARITHMETIC, why)


def needs_gpu(why: str, where: str = "full mode measures it") -> Verdict:
    """A claim only a GPU can decide, with `where` it is measured (by default this notebook's full
    mode, which then calls a measuring verdict instead)."""
    return Verdict(NEEDS_GPU, f"{why}; {where}")


def not_attempted(why: str) -> Verdict:
    """A claim this machine cannot measure (missing weights, no server), with the reason."""
    return Verdict(NOT_ATTEMPTED, why)


@dataclass(frozen=True)
class Devices:
    """A measurement that needs `need` devices (GPUs, or CPU slots on a host without one), and
    whether this host has them: true when it does. `needs_devices(2, "scaling efficiency")`."""

    need: int
    have: int
    unit: str
    what: str

    def __bool__(self) -> bool:
        return self.have >= self.need

    def _count(self, n: int) -> str:
        return f"{n} {self.unit}{'' if n == 1 else 's'}"

    @property
    def words(self) -> str:
        """'needs 2 GPUs; this host has 1'."""
        return f"needs {self._count(self.need)}; this host has {self.have}"

    def __str__(self) -> str:
        """The line a notebook prints where it skips the measurement, or runs it."""
        if self:
            return f"{self.what}: measured on this host's {self._count(self.have)} (it {self.words})"
        return (f"{self.what}: not measured here; it {self.words}. On a host with "
                f"{self.need} or more, this cell measures it")

    def verdict(self, measured: Verdict | None = None) -> Verdict:
        """The row's verdict: `measured` (required where the host has the devices), its reason
        naming the devices; else NEEDS_DEVICES, saying how many it needs and the host has."""
        if not self:
            return Verdict(NEEDS_DEVICES, f"{self.words}: {self.what}", self.need, self.have)
        if measured is None:
            raise ValueError(f"{self.what}: this host has the {self._count(self.need)} it needs; "
                             "pass the measured verdict")
        return Verdict(measured.label, f"{measured.reason} (on {self._count(self.have)}; it "
                       f"{self.words})", self.need, self.have)


def needs_devices(need: int, what: str) -> Devices:
    """Whether this host has the `need` devices a measurement takes (true if so), and the words
    and verdict for either case (see Devices)."""
    if need < 1:
        raise ValueError(f"need: got {need}; accepted: a whole number ≥ 1")
    here = shape()
    return Devices(need, here.devices, here.unit, what)
