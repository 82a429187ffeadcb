"""Training functions the diagnostics tests launch on real gloo ranks, and an NVML test double for
the GPU topology (no GPU on the CI machine)."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pynvml

import gpu_lab
from gpu_lab.telemetry.doubles import FakeGPU, FakeNVML


# ------------------------------------------------------------------------ launched functions

class SlowDataset:
    """A map-style dataset whose every read waits `delay` seconds: storage with per-file latency
    (an object store, a network file system), the deliberately slow loader of the tests."""

    def __init__(self, n: int, delay: float, image_size: int = 32) -> None:
        self.n, self.delay, self.image_size = n, delay, image_size

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        import torch

        if self.delay:
            time.sleep(self.delay)  # the modelled read latency, not synchronisation
        g = torch.Generator().manual_seed(i)
        return torch.randn(3, self.image_size, self.image_size, generator=g), i % 4


def train_timed(steps: int, delay: float, batch_size: int = 8, num_workers: int = 0):
    """A small DDP training loop timed by StepTimer; the loader reads SlowDataset(delay)."""
    import torch
    from torch.utils.data import DataLoader

    from gpu_lab.diagnostics import StepTimer
    from gpu_lab.models import build

    acc = gpu_lab.accelerator()
    torch.manual_seed(0)
    model = build("tiny_cnn", num_classes=4, image_size=32)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(SlowDataset(steps * batch_size * 2, delay), batch_size=batch_size,
                        num_workers=num_workers)
    model, opt, loader = acc.prepare(model, opt, loader)
    timer = StepTimer()
    it = iter(loader)
    for step in range(steps):
        with timer.phase("data"):
            x, y = next(it)
        with timer.phase("forward_backward"):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            acc.backward(loss)
        with timer.phase("optimizer"):
            opt.step()
            opt.zero_grad()
        timer.step(step, samples=len(y) * acc.num_processes, loss=loss.detach())
    return timer.last


def train_capped(batch_size: int, cap_bytes: int, image_size: int = 64):
    """One training step of tiny_resnet under an allocation cap: out of memory if the batch's
    activations do not fit in `cap_bytes`."""
    import torch

    from gpu_lab.diagnostics import memory_cap, note
    from gpu_lab.models import build

    acc = gpu_lab.accelerator()
    torch.manual_seed(0)
    model = build("tiny_resnet", num_classes=4, image_size=image_size)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt = acc.prepare(model, opt)
    note(batch_size=batch_size, num_processes=acc.num_processes)
    with memory_cap(cap_bytes):
        x = torch.randn(batch_size, 3, image_size, image_size)
        y = torch.randint(0, 4, (batch_size,))
        loss = torch.nn.functional.cross_entropy(model(x), y)
        acc.backward(loss)
        opt.step()
    return float(loss)


def collective_timeout(timeout_s: float = 2.0):
    """Rank 0 enters an all_reduce that rank 1 never joins: a communication timeout."""
    import datetime

    import torch
    import torch.distributed as dist

    acc = gpu_lab.accelerator()
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
    if acc.process_index == 0:
        dist.all_reduce(torch.ones(1000), group=group)
    else:
        time.sleep(60)  # a rank stuck elsewhere; the launcher ends it when rank 0 fails
    return None


def profile_slow_loop(path: str) -> str:
    """A few training steps over SlowDataset under torch.profiler; writes a Chrome trace."""
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule
    from torch.utils.data import DataLoader

    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, 64),
                                torch.nn.ReLU(), torch.nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(SlowDataset(64, 0.003), batch_size=8)
    with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=0, warmup=1, active=4),
                 on_trace_ready=lambda p: p.export_chrome_trace(path)) as prof:
        for x, y in loader:
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            prof.step()
    return path


# ----------------------------------------------------------------------------- NVML double

class FakeTopologyNVML(FakeNVML):
    """Test double: FakeNVML plus the static calls doctor makes (driver, compute capability, PCI
    bus, NUMA node, NVLink peers, topology level, P2P). `nvlink_pairs` maps (i, j) to a number of
    links; other pairs meet at `level` (NVML_TOPOLOGY_*)."""

    def __init__(self, gpus: int = 4, nvlink_pairs: dict | None = None,
                 level: int = pynvml.NVML_TOPOLOGY_SYSTEM, numa: list | None = None,
                 driver: str = "575.51.03", cuda_driver: int = 12090) -> None:
        boards = [FakeGPU(name="NVIDIA H100 80GB HBM3", uuid=f"GPU-{i:08d}-fake",
                          nvlinks=0) for i in range(gpus)]
        super().__init__(boards)
        self.buses = [f"00000000:{0x18 + 0x10 * i:02X}:00.0" for i in range(gpus)]
        self.pairs = {}
        for (i, j), n in (nvlink_pairs or {}).items():
            self.pairs[(i, j)] = self.pairs[(j, i)] = n
        self.links = [[j for (a, j), n in sorted(self.pairs.items()) if a == i for _ in range(n)]
                      for i in range(gpus)]
        for i, g in enumerate(boards):
            g.nvlinks = len(self.links[i])
        self.level = level
        self.numa = numa or [0] * gpus
        self.driver, self.cuda_driver = driver, cuda_driver

    def _i(self, h) -> int:
        return self.gpus.index(h)

    def nvmlSystemGetDriverVersion(self) -> str:
        self._count("nvmlSystemGetDriverVersion")
        return self.driver

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        self._count("nvmlSystemGetCudaDriverVersion")
        return self.cuda_driver

    def nvmlDeviceGetCudaComputeCapability(self, h):
        self._count("nvmlDeviceGetCudaComputeCapability", h)
        return (9, 0)

    def nvmlDeviceGetPciInfo(self, h):
        self._count("nvmlDeviceGetPciInfo", h)
        return SimpleNamespace(busId=self.buses[self._i(h)])

    def nvmlDeviceGetNumaNodeId(self, h) -> int:
        self._count("nvmlDeviceGetNumaNodeId", h)
        return self.numa[self._i(h)]

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h, link: int):
        self._count("nvmlDeviceGetNvLinkRemotePciInfo", h)
        return SimpleNamespace(busId=self.buses[self.links[self._i(h)][link]])

    def nvmlDeviceGetTopologyCommonAncestor(self, h1, h2) -> int:
        self._count("nvmlDeviceGetTopologyCommonAncestor", h1)
        return self.level

    def nvmlDeviceGetP2PStatus(self, h1, h2, index) -> int:
        self._count("nvmlDeviceGetP2PStatus", h1)
        linked = (self._i(h1), self._i(h2)) in self.pairs
        return pynvml.NVML_P2P_STATUS_OK if linked else pynvml.NVML_P2P_STATUS_NOT_SUPPORTED
