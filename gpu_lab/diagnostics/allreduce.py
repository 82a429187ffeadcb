"""All-reduce benchmark, like nccl-tests' all_reduce_perf (how fast the links between GPUs are
before a multi-GPU run relies on them), run on N ranks through gpu_lab.launch: gloo on CPUs, NCCL
on GPUs.

For each message size S it times an in-place all-reduce (sum) and prints, as nccl-tests does:

    algbw = S / t                      what the application sees
    busbw = algbw × 2 (n − 1) / n      what each link carried: a ring all-reduce sends and receives
                                       2 (n − 1) / n × S per rank, so busbw is comparable with the
                                       hardware's link speed whatever the number of ranks

and #wrong, the number of elements whose sum is not the expected one. Small messages measure
latency, large ones bandwidth: read the plateau of busbw against NVLink (hundreds of GB/s),
PCIe (tens) or the network (InfiniBand HDR 200 Gb/s = 25 GB/s).
"""
from __future__ import annotations

import html
from dataclasses import asdict, dataclass, field
from typing import Any

from ..quickmode import quick
from ..units import MiB, fmt_bytes, parse_size

FULL_RANGE = (8, 256 * MiB)        # nccl-tests -b 8 -e 256M -f 2
QUICK_RANGE = (8, 1 * MiB)         # a CPU laptop / CI: gloo over loopback, seconds not minutes
_DTYPES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


def _parse_one(s: str | int) -> int:
    return parse_size(s, decimal_si=False)  # 64K, 256M, 1G: powers of 1024, as nccl-tests reads them


def parse_sizes(spec: str | list | tuple | None = None, factor: int = 2) -> list[int]:
    """Message sizes in bytes: a list, or "MIN:MAX" stepped by `factor` (nccl-tests -b/-e/-f).
    None: 8 B .. 256 MB, or 8 B .. 1 MB in quick mode (gpu_lab.quickmode)."""
    if spec is None:
        lo, hi = QUICK_RANGE if quick() else FULL_RANGE
    elif isinstance(spec, (list, tuple)):
        out = [_parse_one(s) for s in spec]
        if not out or any(s < 1 for s in out):
            raise ValueError(f"sizes: got {spec!r}; accepted: byte counts >= 1")
        return out
    else:
        parts = str(spec).split(":")
        if len(parts) != 2:
            raise ValueError(f"sizes: got {spec!r}; accepted: 'MIN:MAX' (e.g. '8:256M') or a list")
        lo, hi = _parse_one(parts[0]), _parse_one(parts[1])
    if lo < 1 or hi < lo:
        raise ValueError(f"sizes: got {lo}..{hi}; accepted: 1 <= MIN <= MAX")
    if factor < 2:
        raise ValueError(f"factor: got {factor}; accepted: an int >= 2")
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= factor
    return out


@dataclass
class AllReduceRow:
    size_bytes: int
    count: int
    time_us: float
    algbw_gbps: float
    busbw_gbps: float
    wrong: int
    iters: int


@dataclass
class AllReduceResult:
    rows: list[AllReduceRow]
    world_size: int
    backend: str
    device: str
    dtype: str
    notes: list[str] = field(default_factory=list)

    @property
    def avg_busbw_gbps(self) -> float:
        """nccl-tests' "Avg bus bandwidth": the mean over every size."""
        return sum(r.busbw_gbps for r in self.rows) / len(self.rows) if self.rows else 0.0

    @property
    def peak_busbw_gbps(self) -> float:
        return max((r.busbw_gbps for r in self.rows), default=0.0)

    @property
    def wrong(self) -> int:
        return sum(r.wrong for r in self.rows)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(avg_busbw_gbps=self.avg_busbw_gbps, peak_busbw_gbps=self.peak_busbw_gbps)
        return d

    def table(self) -> str:
        lines = [f"# all_reduce (sum, in place), {self.world_size} ranks, {self.backend} on "
                 f"{self.device}, {self.dtype}",
                 f"# {'size':>12} {'count':>12} {'type':>8} {'time(us)':>11} {'algbw(GB/s)':>12} "
                 f"{'busbw(GB/s)':>12} {'#wrong':>7}"]
        for r in self.rows:
            lines.append(f"  {r.size_bytes:>12} {r.count:>12} {self.dtype:>8} {r.time_us:>11.1f} "
                         f"{r.algbw_gbps:>12.3f} {r.busbw_gbps:>12.3f} {r.wrong:>7}")
        lines.append(f"# Out of bounds values : {self.wrong} {'OK' if not self.wrong else 'WRONG'}")
        lines.append(f"# Avg bus bandwidth    : {self.avg_busbw_gbps:.4f} GB/s")
        lines += [f"# {n}" for n in self.notes]
        return "\n".join(lines)

    def bars(self, width: int = 40) -> str:
        """busbw per size as a text bar chart (the terminal's plot)."""
        peak = self.peak_busbw_gbps or 1.0
        return "\n".join(f"{fmt_bytes(r.size_bytes, 0):>8} {'█' * max(1, round(width * r.busbw_gbps / peak)):<{width}} "
                         f"{r.busbw_gbps:.3f} GB/s" for r in self.rows)

    def __str__(self) -> str:
        return self.table()

    def _repr_html_(self) -> str:
        return f"<pre>{html.escape(self.table())}</pre>"


def _bench_rank(sizes: list[int], iters: int, warmup: int, dtype_name: str,
                budget_s: float) -> dict:
    """One rank of the benchmark (runs inside gpu_lab.launch)."""
    import time

    import torch
    import torch.distributed as dist

    from ..rank.accelerator import accelerator

    acc = accelerator()
    if not dist.is_initialized():
        raise RuntimeError("all-reduce benchmark: no process group (launch it on >= 2 ranks)")
    dev = acc.device
    world, rank = dist.get_world_size(), dist.get_rank()
    dtype = getattr(torch, dtype_name)
    item = torch.empty((), dtype=dtype).element_size()
    cuda = dev.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(dev)

    rows = []
    for size in sizes:
        count = max(1, size // item)
        nbytes = count * item
        buf = torch.ones(count, dtype=dtype, device=dev)
        for _ in range(warmup):
            dist.all_reduce(buf)
        sync()
        dist.barrier()
        # how many timed iterations fit the budget: rank 0 decides, everyone follows (every rank
        # must call the same collectives)
        t0 = time.perf_counter()
        dist.all_reduce(buf)
        sync()
        one = time.perf_counter() - t0
        n = torch.tensor([max(1, min(iters, int(budget_s / max(one, 1e-6))))], device=dev)
        dist.broadcast(n, 0)
        n_iters = int(n.item())
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(n_iters):
            dist.all_reduce(buf)
        sync()
        dt = torch.tensor([(time.perf_counter() - t0) / n_iters], dtype=torch.float64, device=dev)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # the slowest rank is the collective's time
        # correctness: each rank contributes rank+1; the sum is n(n+1)/2 everywhere
        buf.fill_(rank + 1)
        dist.all_reduce(buf)
        sync()
        expect = world * (world + 1) / 2
        wrong = torch.tensor([int((buf.float() != expect).sum().item())], device=dev)
        dist.all_reduce(wrong)
        t = float(dt.item())
        algbw = nbytes / t / 1e9
        rows.append(asdict(AllReduceRow(nbytes, count, t * 1e6, algbw, algbw * 2 * (world - 1) / world,
                                        int(wrong.item()), n_iters)))
        del buf
    return {"rows": rows, "world_size": world, "backend": dist.get_backend(),
            "device": str(dev.type), "dtype": dtype_name}


def allreduce_bench(sizes: Any = None, num_processes: int | None = None, *, iters: int = 20,
                    warmup: int = 5, dtype: str = "float32", budget_s: float | None = None,
                    timeout: float = 900) -> AllReduceResult:
    """Run the all-reduce benchmark on `num_processes` ranks (default: every GPU, or 2 CPU ranks)
    through gpu_lab.launch and return its table; a ValueError names the devices it needs where
    the default is one rank (a host with one device). `sizes`: see parse_sizes. `budget_s`: the
    most time spent timing one size (iterations are cut to fit; default 0.5 s, 0.05 s in quick
    mode)."""
    from ..launch import launch

    sz = parse_sizes(sizes)
    if dtype not in _DTYPES:
        raise ValueError(f"dtype: got {dtype!r}; accepted: {', '.join(map(repr, _DTYPES))}")
    if iters < 1 or warmup < 0:
        raise ValueError(f"iters >= 1 and warmup >= 0; got iters={iters}, warmup={warmup}")
    if num_processes is not None and num_processes < 2:
        raise ValueError(f"num_processes: got {num_processes}; accepted: >= 2 (an all-reduce needs "
                         "peers) or None")
    if num_processes is None:  # the launch's default, resolved here: one rank has no peers
        from ..machine import default_ranks, shape

        num_processes = default_ranks()
        if num_processes < 2:
            here = shape()
            raise ValueError(
                f"allreduce_bench: an all-reduce needs 2 ranks, one per device: 2 {here.unit}s; "
                f"this host has {here.count()}, so num_processes=None gives {num_processes} rank. "
                f"Run it on a host with 2 {here.unit}s or more")
    if budget_s is None:
        budget_s = 0.05 if quick() else 0.5
    run = launch(_bench_rank, sz, iters, warmup, dtype, budget_s, num_processes=num_processes,
                 name="allreduce-bench")
    out = run.result(timeout=timeout)
    res = AllReduceResult([AllReduceRow(**r) for r in out["rows"]], out["world_size"],
                          out["backend"], out["device"], out["dtype"])
    if res.backend == "gloo":
        res.notes.append("gloo over TCP on one host: a floor for what NCCL over NVLink/PCIe gives")
    return res


__all__ = ["allreduce_bench", "AllReduceResult", "AllReduceRow", "parse_sizes", "FULL_RANGE",
           "QUICK_RANGE"]
