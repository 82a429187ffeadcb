"""Bottleneck finder: split a run's step time into data wait, compute and communication, name the
bound, say what to do, and project what a set of fixes (each a share of one part's time removed)
would give on the user's own run (`Breakdown.waterfall`).

The finder measures the split from what the workers report (seconds per optimizer step):

    step_time       wall time of one optimizer step        (gpu_lab.train.fit, StepTimer)
    data_wait       time spent waiting for the next batch  (gpu_lab.train.fit, StepTimer)
    fwd_bwd_time    forward + backward                     (StepTimer, optional)
    optimizer_time  the optimizer step                     (StepTimer, optional)
    comm_time       explicit collectives                   (StepTimer, optional)
    samples_per_s   throughput                             (gpu_lab.train.fit, StepTimer)

or from a torch.profiler trace (gpu_lab.train.ProfilerWindow writes one): `breakdown_from_trace`.
"""
from __future__ import annotations

import html
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

STEP, DATA, FWD_BWD, OPTIM, COMM, SAMPLES = ("step_time", "data_wait", "fwd_bwd_time",
                                             "optimizer_time", "comm_time", "samples_per_s")
BOUNDS = ("data", "compute", "communication")

#: a fed pipeline has the next batch ready (prefetch), so its wait is ~0; at 20% the accelerator
#: idles a fifth of every step, past the 70-80% utilisation a well-fed GPU job keeps (a
#: loader-starved job can wait 45% of its steps).
DATA_BOUND = 0.20
#: DDP overlaps gradient all-reduce with backward; what still shows after the overlap above 30%
#: of the step means the links, not the GPUs, set the pace.
COMM_BOUND = 0.30


@dataclass(frozen=True)
class Fix:
    label: str
    part: str         # data | compute | communication
    reduction: float  # fraction of that part's time removed


@dataclass
class WaterfallStep:
    label: str
    step_time: float        # seconds per step after this fix
    samples_per_s: float
    delta_samples_per_s: float


RECOMMENDATIONS = {
    "data": [
        "more DataLoader workers (num_workers), with persistent_workers=True and prefetch_factor≥2, "
        "so the next batches are decoded while the model computes",
        "WebDataset shards instead of one file per image (`gpu-lab shards`): large sequential "
        "reads instead of a small random read per image",
        "check the disk: `gpu-lab bench io DIR` (and `iostat -x 1` while training): a disk at "
        "100% util or a network file system sets the pace; copy hot data to local NVMe",
        "pin_memory=True and non_blocking copies, so the host-to-GPU copy overlaps compute",
        "decode less: store images at the training size, or decode on the GPU "
        "(TrainConfig.decode='gpu', or DALI)",
    ],
    "compute": [
        "mixed_precision='bf16': tensor cores at twice fp32's rate, half the activation bytes",
        "channels_last=True for convolutional nets on tensor cores",
        "compile=True (torch.compile: fused kernels, fewer launches)",
        "a bigger batch per GPU while utilisation is below 70%, with the learning rate scaled to "
        "the batch",
        "leave TF32 on (do not set NVIDIA_TF32_OVERRIDE=0) and never CUDA_LAUNCH_BLOCKING=1",
    ],
    "communication": [
        "grad_accum_steps=N: one all-reduce per N micro-batches instead of one per batch",
        "a bigger batch per GPU: the same gradient bytes per step, more compute to hide them under",
        "powersgd=True: low-rank gradient compression, a fraction of the gradient traffic",
        "measure the links: `gpu-lab bench allreduce`, and compare busbw with the hardware "
        "(NVLink ≫ PCIe ≫ TCP); check the topology in `gpu-lab doctor`",
        "NCCL_DEBUG=INFO shows which transport NCCL chose",
    ],
}


@dataclass
class Breakdown:
    """Seconds per optimizer step, by part; `bound` is what limits the run."""

    step_time: float
    data: float
    compute: float            # forward + backward + optimizer + anything not measured apart
    communication: float
    fwd_bwd: float | None = None
    optimizer: float | None = None
    samples_per_s: float | None = None
    steps: int = 0            # reports averaged
    source: str = "reported metrics"
    bound: str = "compute"
    recommendations: list[str] = field(default_factory=list)

    @property
    def samples_per_step(self) -> float | None:
        return self.samples_per_s * self.step_time if self.samples_per_s else None

    def fractions(self) -> dict[str, float]:
        t = self.step_time or 1.0
        return {"data": self.data / t, "compute": self.compute / t,
                "communication": self.communication / t}

    def to_dict(self) -> dict:
        d = asdict(self)
        d["fractions"] = self.fractions()
        return d

    def ceiling(self) -> float | None:
        """samples/s if the bound's part took no time at all (the most its fix can give)."""
        part = {"data": self.data, "compute": self.compute, "communication": self.communication}
        rest = self.step_time - part[self.bound]
        if not self.samples_per_step or rest <= 0:
            return None
        return self.samples_per_step / rest

    def waterfall(self, fixes: Iterable[Fix]) -> list[WaterfallStep]:
        """Apply `fixes`, in order, to this run's own split: the start, then one bar per fix, with
        the samples/s it would reach."""
        parts = {"data": self.data, "compute": self.compute, "communication": self.communication}
        n = self.samples_per_step or 1.0
        t = sum(parts.values())
        out = [WaterfallStep("your run", t, n / t, 0.0)]
        for fx in fixes:
            if fx.part not in parts:
                raise ValueError(f"Fix.part: got {fx.part!r}; accepted: {', '.join(map(repr, BOUNDS))}")
            parts[fx.part] *= 1 - fx.reduction
            t_new = sum(parts.values())
            out.append(WaterfallStep(fx.label, t_new, n / t_new, n / t_new - out[-1].samples_per_s))
        return out

    def __str__(self) -> str:
        f = self.fractions()
        lines = [f"step {self.step_time * 1e3:.1f} ms"
                 + (f", {self.samples_per_s:.1f} samples/s" if self.samples_per_s else "")
                 + f" ({self.source}, {self.steps} reports)",
                 f"  data wait      {self.data * 1e3:8.1f} ms  {f['data']:6.1%}",
                 f"  compute        {self.compute * 1e3:8.1f} ms  {f['compute']:6.1%}"
                 + (f"  (forward+backward {self.fwd_bwd * 1e3:.1f} ms, optimizer "
                    f"{self.optimizer * 1e3:.1f} ms)" if self.fwd_bwd is not None
                    and self.optimizer is not None else ""),
                 f"  communication  {self.communication * 1e3:8.1f} ms  {f['communication']:6.1%}",
                 f"bound: {self.bound}"]
        c = self.ceiling()
        if c:
            lines.append(f"  removing the {self.bound} time entirely would give at most {c:.1f} "
                         f"samples/s (×{c / self.samples_per_s:.2f})")
        lines.append("what to do, cheapest first:")
        lines += [f"  {i}. {r}" for i, r in enumerate(self.recommendations, 1)]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        return f"<pre>{html.escape(str(self))}</pre>"


def classify(data: float, compute: float, communication: float) -> str:
    t = data + compute + communication
    if t <= 0:
        return "compute"
    cands = [(data / t, "data")] if data / t >= DATA_BOUND else []
    if communication / t >= COMM_BOUND:
        cands.append((communication / t, "communication"))
    return max(cands)[1] if cands else "compute"


def make_breakdown(step_time: float, data: float, *, fwd_bwd: float | None = None,
                   optimizer: float | None = None, comm: float | None = None,
                   samples_per_s: float | None = None, steps: int = 1,
                   source: str = "reported metrics") -> Breakdown:
    if step_time is None or step_time <= 0:
        raise ValueError(f"step_time: got {step_time!r}; accepted: seconds per step > 0")
    data = min(max(data or 0.0, 0.0), step_time)
    comm = min(max(comm or 0.0, 0.0), step_time - data)
    compute = max(step_time - data - comm, 0.0)
    bound = classify(data, compute, comm)
    return Breakdown(step_time, data, compute, comm, fwd_bwd, optimizer, samples_per_s, steps,
                     source, bound, list(RECOMMENDATIONS[bound]))


def _series_from(source: Any, rank: int | None) -> dict[str, list[float]]:
    """{metric: values} of one rank (or all ranks concatenated) from a Run, a MetricHistory, a
    registry run id, or a dict of lists."""
    names = (STEP, DATA, FWD_BWD, OPTIM, COMM, SAMPLES)
    if isinstance(source, dict):
        return {k: [float(v) for v in source.get(k, [])] for k in names}
    hist = getattr(source, "metrics", source)
    if isinstance(source, str):  # a run id: read the registry
        from ..record.registry import Registry

        rows = Registry().metrics(source)
        out: dict[str, list[float]] = {k: [] for k in names}
        for r in rows:
            if r["name"] in out and (rank is None or r["rank"] == rank):
                out[r["name"]].append(float(r["value"]))
        return out
    if not hasattr(hist, "series"):
        raise TypeError(f"find_bottleneck: got {type(source).__name__}; accepted: a Run, a "
                        "MetricHistory, a run id, or a dict of metric lists")
    ranks = [rank] if rank is not None else hist.ranks()
    out = {k: [] for k in names}
    for r in ranks:
        for k in names:
            out[k] += hist.series(k, r)[1]
    return out


def find_bottleneck(source: Any, *, rank: int | None = 0, skip: int = 1,
                    trace: str | Path | None = None) -> Breakdown:
    """The breakdown of a run: `source` is a Run, its MetricHistory, a run id, or a dict of
    metric lists. `skip` drops each rank's first reports (warm-up: allocator, cuDNN autotune,
    compile, loader start). `rank=None` averages every rank. With `trace` (a torch.profiler Chrome
    trace), the profiler's timeline is used instead."""
    if trace is not None:
        return breakdown_from_trace(trace)
    s = _series_from(source, rank)
    steps = s[STEP]
    if not steps:
        raise ValueError("find_bottleneck: the run reported no 'step_time' (seconds per step); report "
                         "it with gpu_lab.diagnostics.StepTimer or train with gpu_lab.train.fit")
    k = skip if len(steps) > skip else 0

    def mean(name: str) -> float | None:
        v = s[name][k:] if len(s[name]) > k else s[name]
        return sum(v) / len(v) if v else None

    step = mean(STEP)
    sps = mean(SAMPLES)
    if s[SAMPLES] and len(s[SAMPLES]) == len(steps):
        # samples per step from each report, over the mean step time: a mean of the per-report
        # rates would over-weight short reports
        per_step = [a * b for a, b in zip(s[SAMPLES][k:], steps[k:])]
        sps = sum(per_step) / len(per_step) / step if per_step and step else sps
    return make_breakdown(step, mean(DATA) or 0.0, fwd_bwd=mean(FWD_BWD),
                          optimizer=mean(OPTIM), comm=mean(COMM), samples_per_s=sps,
                          steps=len(steps) - k)


def compare(before: Breakdown, after: Breakdown, label: str = "after") -> list[WaterfallStep]:
    """A measured waterfall from one run to another: the change of each part, then the result."""
    n_before = before.samples_per_step or 1.0
    n_after = after.samples_per_step or n_before
    out = [WaterfallStep("before", before.step_time, n_before / before.step_time, 0.0)]
    t = before.step_time
    for part in ("data", "compute", "communication"):
        t += getattr(after, part) - getattr(before, part)
        t = max(t, 1e-12)
        sps = n_before / t
        out.append(WaterfallStep(f"{part} {getattr(after, part) - getattr(before, part):+.1e} s",
                                 t, sps, sps - out[-1].samples_per_s))
    final = n_after / after.step_time
    out.append(WaterfallStep(label, after.step_time, final, final - out[-1].samples_per_s))
    return out


# -------------------------------------------------------------------------- profiler trace

_COMM_WORDS = ("allreduce", "all_reduce", "allgather", "all_gather", "broadcast", "reduce_scatter",
               "nccl", "gloo", "c10d::")


def _category(name: str) -> str | None:
    n = name.lower()
    if n.startswith("enumerate(dataloader)") or "dataloader" in n and "__next__" in n:
        return "data"
    if n.startswith("optimizer.step") or n.startswith("optimizer.zero_grad"):
        return "optimizer"
    if any(w in n for w in _COMM_WORDS):
        return "communication"
    return None


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def breakdown_from_trace(path: str | Path) -> Breakdown:
    """The split from a torch.profiler Chrome trace: ProfilerStep#N spans are the steps; loader
    `__next__`, `Optimizer.step` and collective ops inside them are data, optimizer and
    communication (on the CPU timeline); the rest of each step is compute."""
    events = json.loads(Path(path).read_text()).get("traceEvents", [])
    spans = [e for e in events if e.get("ph") == "X" and str(e.get("name", "")).startswith("ProfilerStep#")]
    if not spans:
        raise ValueError(f"{path}: no ProfilerStep# spans; record with a torch.profiler schedule "
                         "(gpu_lab.train.ProfilerWindow does)")
    cats: dict[str, list[tuple[float, float]]] = {"data": [], "optimizer": [], "communication": []}
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        c = _category(str(e.get("name", "")))
        if c:
            cats[c].append((float(e["ts"]), float(e["ts"]) + float(e["dur"])))
    total = {"step": 0.0, "data": 0.0, "optimizer": 0.0, "communication": 0.0}
    for s in spans:
        a, b = float(s["ts"]), float(s["ts"]) + float(s["dur"])
        total["step"] += b - a
        for c, ivs in cats.items():
            total[c] += _union([(max(x, a), min(y, b)) for x, y in ivs if y > a and x < b])
    n = len(spans)
    us = 1e-6 / n
    step = total["step"] * us
    opt = total["optimizer"] * us
    data = total["data"] * us
    comm = total["communication"] * us
    return make_breakdown(step, data, fwd_bwd=max(step - data - opt - comm, 0.0), optimizer=opt,
                          comm=comm, steps=n, source=f"profiler trace {Path(path).name}")


__all__ = ["find_bottleneck", "Breakdown", "make_breakdown", "classify", "compare", "Fix",
           "WaterfallStep", "breakdown_from_trace",
           "RECOMMENDATIONS", "DATA_BOUND", "COMM_BOUND"]
