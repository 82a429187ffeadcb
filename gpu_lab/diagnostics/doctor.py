# Long: one report made of many small, independent checks (system, GPUs, topology, host, env).
"""gpu_lab.doctor(): what this machine is, and what in its setup will hurt training.

Sections: system (OS, Python, torch and its CUDA / cuDNN / NCCL, the driver), gpus (through NVML:
name, memory, compute capability, PCI bus, NUMA node, and the processes that hold GPU memory but
belong to no live gpu_lab run: gpu_holders), topology (the NVLink / PCIe matrix that
`nvidia-smi topo -m` prints, and P2P), host (CPU, NUMA nodes, RAM, disk and /dev/shm), env (the
variables that matter, with a warning where a value hurts), fork_safety (can this process still
launch workers) and warnings.

It never initialises CUDA in the calling process: GPUs are asked about through NVML, torch's
version is read from its version file without importing torch, cuDNN and NCCL from the pip packages
torch loads them from. A kernel that ran doctor() can still fork training workers.
"""
from __future__ import annotations

import ast
import html
import importlib.metadata as md
import importlib.util
import json
import os
import platform
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..telemetry.probe import nvml_session
from . import gpu_holders
from ..units import GiB, fmt_bytes

SECTIONS = ("system", "gpus", "topology", "host", "env", "fork_safety", "warnings")

#: the environment variables a training run depends on (plus every NCCL_* that is set)
ENV_VARS = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "CUDA_LAUNCH_BLOCKING",
            "NVIDIA_TF32_OVERRIDE", "OMP_NUM_THREADS", "PYTORCH_CUDA_ALLOC_CONF",
            "PYTORCH_NVML_BASED_CUDA_CHECK", "TORCH_DISTRIBUTED_DEBUG", "TORCH_NCCL_BLOCKING_WAIT",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING", "ACCELERATE_CPU_AFFINITY", "NCCL_DEBUG",
            "NCCL_P2P_DISABLE", "NCCL_IB_DISABLE", "NCCL_SHM_DISABLE", "NCCL_SOCKET_IFNAME")

WARNING, INFO = "warning", "info"


@dataclass
class Finding:
    level: str      # warning | info
    topic: str      # the variable or resource it is about
    message: str    # what it does and what to do


@dataclass
class DoctorReport:
    """The report. `str()` is the terminal text, `_repr_html_()` the notebook view, `to_json()`
    the machine-readable form (`gpu-lab doctor --json`)."""

    system: dict = field(default_factory=dict)
    gpus: dict = field(default_factory=dict)
    topology: dict = field(default_factory=dict)
    host: dict = field(default_factory=dict)
    env: dict = field(default_factory=dict)
    fork_safety: dict = field(default_factory=dict)
    warnings: list[Finding] = field(default_factory=list)
    elapsed_s: float = 0.0

    def to_dict(self) -> dict:
        d = {name: getattr(self, name) for name in SECTIONS if name != "warnings"}
        d["warnings"] = [vars(w) for w in self.warnings]
        d["elapsed_s"] = round(self.elapsed_s, 3)
        return d

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent, default=str)

    def warnings_about(self, topic: str) -> list[Finding]:
        return [w for w in self.warnings if w.topic == topic]

    # --- rendering -------------------------------------------------------------------------------
    def _rows(self) -> list[tuple[str, list[tuple[str, str]]]]:
        s, h = self.system, self.host
        out = [("System", [
            ("OS", s.get("os", "?")), ("Python", s.get("python", "?")),
            ("torch", f"{s.get('torch') or 'not installed'} (built for CUDA {s.get('torch_cuda') or '—'})"),
            ("CUDA runtime", s.get("cuda_runtime") or "—"), ("cuDNN", s.get("cudnn") or "—"),
            ("NCCL", s.get("nccl") or "—"),
            ("driver", f"{s.get('driver') or '—'} (supports CUDA {s.get('driver_cuda') or '—'})"),
            ("accelerate", s.get("accelerate") or "—")])]
        g = self.gpus
        gl = [(f"GPU {d['index']}", f"{d['name']}, {fmt_bytes(d.get('memory_total_bytes'))}, compute "
               f"capability {d.get('compute_capability') or '?'}, NUMA node "
               f"{d.get('numa_node') if d.get('numa_node') is not None else '?'}, bus {d.get('pci_bus_id') or '?'}")
              for d in g.get("devices", [])]
        out.append(("GPUs", gl or [("NVML", g.get("reason") or "no GPU")]))
        t = self.topology
        if t.get("matrix"):
            names = [f"GPU{i}" for i in range(len(t["matrix"]))]
            tl = [("", "  ".join(f"{n:>6}" for n in names))]
            tl += [(names[i], "  ".join(f"{c:>6}" for c in row)) for i, row in enumerate(t["matrix"])]
            tl.append(("legend", t.get("legend_text", "")))
            out.append(("Topology", tl))
        nodes = h.get("numa_nodes") or []
        out.append(("Host", [
            ("CPU", f"{h.get('cpu_model') or '?'}: {h.get('cpus_logical')} logical / "
                    f"{h.get('cpus_physical')} physical cores"),
            ("NUMA", f"{len(nodes)} node(s): " + "; ".join(f"node {n['node']} cpus {n['cpus']}"
                                                           for n in nodes) if nodes else "—"),
            ("RAM", f"{fmt_bytes(h.get('ram_available_bytes'))} available of {fmt_bytes(h.get('ram_total_bytes'))}"),
        ] + [(f"disk {d['path']}", f"{fmt_bytes(d['free_bytes'])} free of {fmt_bytes(d['total_bytes'])}")
             for d in h.get("disks", [])]
            + [("host queue", (h.get("host_queue") or {}).get("says") or "—")]))
        out.append(("Environment", [(k, "(unset)" if v is None else v) for k, v in self.env.items()]))
        f = self.fork_safety
        out.append(("Fork safety", [("safe", "yes" if f.get("safe") else "NO"),
                                    ("torch imported", str(f.get("torch_imported"))),
                                    ("CUDA initialised", str(f.get("cuda_initialized")))]
                    + ([("problem", f["problem"]), ("remedy", f["remedy"])] if f.get("problem") else [])))
        return out

    def __str__(self) -> str:
        lines = [f"gpu_lab doctor ({self.elapsed_s:.2f} s)"]
        for title, rows in self._rows():
            lines.append(f"\n{title}")
            lines += [f"  {k:<31} {v}" for k, v in rows]
        lines.append("\nWarnings" if self.warnings else "\nWarnings: none")
        for w in self.warnings:
            lines.append(f"  [{w.level}] {w.topic}: {w.message}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        n = len([w for w in self.warnings if w.level == WARNING])
        return (f"DoctorReport(gpus={len(self.gpus.get('devices', []))}, warnings={n}, "
                f"fork_safe={self.fork_safety.get('safe')})")

    def _repr_html_(self) -> str:
        e = html.escape
        parts = ["<div style='font-family:var(--jp-ui-font-family,sans-serif);font-size:13px'>",
                 "<b>gpu_lab doctor</b>"]
        if self.warnings:
            parts.append("<ul style='margin:4px 0'>")
            for w in self.warnings:
                color = "#b35900" if w.level == WARNING else "#555"
                parts.append(f"<li style='color:{color}'><b>{e(w.level)}</b> <code>{e(w.topic)}</code>: "
                             f"{e(w.message)}</li>")
            parts.append("</ul>")
        else:
            parts.append("<div style='color:#1a7f37'>no warnings</div>")
        for title, rows in self._rows():
            mono = title in ("Topology",)
            parts.append(f"<details{' open' if title in ('System', 'GPUs') else ''}><summary><b>"
                         f"{e(title)}</b></summary><table style='border-collapse:collapse'>")
            for k, v in rows:
                style = "font-family:monospace;white-space:pre" if mono else ""
                parts.append(f"<tr><td style='padding:1px 8px;color:#555'>{e(k)}</td>"
                             f"<td style='padding:1px 8px;{style}'>{e(str(v))}</td></tr>")
            parts.append("</table></details>")
        parts.append("</div>")
        return "".join(parts)


# ------------------------------------------------------------------------------------- system

def torch_version_info() -> dict:
    """torch's version and the CUDA it was built for, read from torch/version.py without importing
    torch (an import costs seconds; and nothing here may touch CUDA)."""
    mod = sys.modules.get("torch")
    if mod is not None and hasattr(mod, "version"):
        return {"torch": mod.__version__, "torch_cuda": mod.version.cuda, "torch_hip": mod.version.hip}
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return {"torch": None, "torch_cuda": None, "torch_hip": None}
    vfile = Path(list(spec.submodule_search_locations)[0]) / "version.py"
    values: dict[str, Any] = {}
    try:
        for node in ast.parse(vfile.read_text()).body:
            target = getattr(node, "target", None) or (node.targets[0] if getattr(node, "targets", None) else None)
            if isinstance(target, ast.Name) and getattr(node, "value", None) is not None:
                try:
                    values[target.id] = ast.literal_eval(node.value)
                except ValueError:
                    continue
    except (OSError, SyntaxError):
        pass
    return {"torch": values.get("__version__"), "torch_cuda": values.get("cuda"),
            "torch_hip": values.get("hip")}


def _pkg_version(*names: str) -> str | None:
    for n in names:
        try:
            return md.version(n)
        except md.PackageNotFoundError:
            continue
    return None


def system_info(nvml: Any = None) -> dict:
    info = {"os": platform.platform(), "kernel": platform.release(),
            "python": f"{platform.python_version()} ({sys.executable})"}
    info.update(torch_version_info())
    # the pip packages torch's CUDA wheels load their libraries from
    info["cuda_runtime"] = _pkg_version("nvidia-cuda-runtime", "nvidia-cuda-runtime-cu13",
                                        "nvidia-cuda-runtime-cu12", "nvidia-cuda-runtime-cu11")
    info["cudnn"] = _pkg_version("nvidia-cudnn-cu13", "nvidia-cudnn-cu12", "nvidia-cudnn-cu11")
    info["nccl"] = _pkg_version("nvidia-nccl-cu13", "nvidia-nccl-cu12", "nvidia-nccl-cu11")
    info["accelerate"] = _pkg_version("accelerate")
    info["gpu_lab"] = _pkg_version("gpu_lab") or "source"
    info["driver"] = info["driver_cuda"] = None
    if nvml is not None:
        info["driver"] = _text(_try(nvml.nvmlSystemGetDriverVersion))
        v = _try(nvml.nvmlSystemGetCudaDriverVersion)
        if isinstance(v, int):
            info["driver_cuda"] = f"{v // 1000}.{(v % 1000) // 10}"
    return info


# --------------------------------------------------------------------------------------- GPUs

def _text(v: Any) -> Any:
    return v.decode() if isinstance(v, bytes) else v


def _try(fn: Any, *args: Any) -> Any:
    """One NVML call; None where the board, the driver or the permissions don't allow it."""
    try:
        return fn(*args)
    except Exception:  # noqa: BLE001 - NVMLError_* (NotSupported, NoPermission, ...) and missing functions
        return None


def _numa_of_bus(bus: str | None) -> int | None:
    """The NUMA node a PCI device hangs off (sysfs); None where unknown or a single-node host."""
    if not bus:
        return None
    bus = bus.lower()
    for cand in (bus, bus[4:] if bus.count(":") == 2 and len(bus.split(":")[0]) == 8 else bus):
        p = Path("/sys/bus/pci/devices") / cand / "numa_node"
        try:
            n = int(p.read_text().strip())
            return n if n >= 0 else None
        except (OSError, ValueError):
            continue
    return None


def gpu_info(nvml: Any) -> tuple[dict, list]:
    """(the gpus section, the NVML handles in NVML order)."""
    count = _try(nvml.nvmlDeviceGetCount) or 0
    devices, handles = [], []
    for i in range(count):
        h = _try(nvml.nvmlDeviceGetHandleByIndex, i)
        if h is None:
            continue
        handles.append(h)
        mem = _try(nvml.nvmlDeviceGetMemoryInfo, h)
        cc = _try(nvml.nvmlDeviceGetCudaComputeCapability, h)
        pci = _try(nvml.nvmlDeviceGetPciInfo, h)
        bus = _text(getattr(pci, "busId", None)) if pci is not None else None
        numa = _try(nvml.nvmlDeviceGetNumaNodeId, h) if hasattr(nvml, "nvmlDeviceGetNumaNodeId") else None
        devices.append({
            "index": i, "name": _text(_try(nvml.nvmlDeviceGetName, h)) or "unknown GPU",
            "uuid": _text(_try(nvml.nvmlDeviceGetUUID, h)),
            "memory_total_bytes": int(mem.total) if mem is not None else None,
            "memory_used_bytes": int(mem.used) if mem is not None else None,
            "compute_capability": f"{cc[0]}.{cc[1]}" if cc else None,
            "pci_bus_id": bus,
            "numa_node": numa if isinstance(numa, int) and numa >= 0 else _numa_of_bus(bus),
        })
    return {"count": len(devices), "devices": devices, "reason": None}, handles


_LEVELS = {0: "X?", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}
TOPOLOGY_LEGEND = {
    "X": "self", "NV#": "connected by # NVLinks (directly or through NVSwitch)",
    "PIX": "at most one PCIe bridge", "PXB": "several PCIe bridges, no host bridge",
    "PHB": "through a PCIe host bridge (the CPU)", "NODE": "across host bridges within a NUMA node",
    "SYS": "across NUMA nodes (the CPU interconnect, e.g. UPI): the slowest path"}


def _nvlinks(nvml: Any, h: Any) -> list[str | None]:
    """The PCI bus id at the far end of each active NVLink (NVSwitch ids included)."""
    out = []
    max_links = int(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18))
    for link in range(max_links):
        state = _try(nvml.nvmlDeviceGetNvLinkState, h, link)
        if state is None:
            break  # NotSupported past the last link (or a PCIe-only board)
        if not state:
            continue
        remote = _try(nvml.nvmlDeviceGetNvLinkRemotePciInfo, h, link)
        out.append(_text(getattr(remote, "busId", None)) if remote is not None else None)
    return out


def topology_info(nvml: Any, handles: list, devices: list[dict]) -> dict:
    """The matrix `nvidia-smi topo -m` prints, and whether each pair can do P2P reads."""
    n = len(handles)
    if n == 0:
        return {"matrix": [], "p2p": [], "legend": TOPOLOGY_LEGEND, "legend_text": ""}
    buses = [(d.get("pci_bus_id") or "").lower() for d in devices]
    links = [_nvlinks(nvml, h) for h in handles]
    read_idx = getattr(nvml, "NVML_P2P_CAPS_INDEX_READ", 0)
    read_idx = read_idx[0] if isinstance(read_idx, tuple) else read_idx  # some pynvml define (0,)
    ok = getattr(nvml, "NVML_P2P_STATUS_OK", 0)
    matrix, p2p = [], []
    for i in range(n):
        row, prow = [], []
        for j in range(n):
            if i == j:
                row.append("X")
                prow.append(None)
                continue
            direct = sum(1 for b in links[i] if b and b.lower() == buses[j])
            switch_i = [b for b in links[i] if b and b.lower() not in buses]
            switch_j = [b for b in links[j] if b and b.lower() not in buses]
            if direct:
                row.append(f"NV{direct}")
            elif switch_i and switch_j:  # both on the NVSwitch fabric (HGX/DGX boards)
                row.append(f"NV{min(len(switch_i), len(switch_j))}")
            else:
                lvl = _try(nvml.nvmlDeviceGetTopologyCommonAncestor, handles[i], handles[j])
                row.append(_LEVELS.get(int(lvl), str(lvl)) if lvl is not None else "?")
            st = _try(nvml.nvmlDeviceGetP2PStatus, handles[i], handles[j], read_idx)
            prow.append(None if st is None else st == ok)
        matrix.append(row)
        p2p.append(prow)
    used = sorted({c if not c.startswith("NV") or c == "X" else "NV#" for r in matrix for c in r})
    text = "; ".join(f"{k} = {TOPOLOGY_LEGEND[k]}" for k in used if k in TOPOLOGY_LEGEND)
    return {"matrix": matrix, "p2p": p2p, "legend": TOPOLOGY_LEGEND, "legend_text": text}


# --------------------------------------------------------------------------------------- host

def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def numa_nodes() -> list[dict]:
    out = []
    base = Path("/sys/devices/system/node")
    for d in sorted(base.glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
        try:
            cpus = (d / "cpulist").read_text().strip()
        except OSError:
            continue
        mem = None
        try:
            for line in (d / "meminfo").read_text().splitlines():
                if "MemTotal" in line:
                    mem = int(line.split()[-2]) * 1024
        except (OSError, ValueError, IndexError):
            pass
        out.append({"node": int(d.name[4:]), "cpus": cpus, "memory_bytes": mem})
    return out


def _disk(path: str | os.PathLike) -> dict | None:
    try:
        u = shutil.disk_usage(path)
    except OSError:
        return None
    return {"path": str(path), "total_bytes": u.total, "free_bytes": u.free}


def host_info(paths: list[str | os.PathLike] | None = None) -> dict:
    import psutil

    vm = psutil.virtual_memory()
    disks = []
    from ..record.registry import home

    for p in [Path.cwd(), home(), *(paths or []), "/dev/shm"]:
        p = Path(p)
        while not p.exists() and p != p.parent:
            p = p.parent  # GPU_LAB_HOME may not exist yet: its file system does
        d = _disk(p)
        if d and d["path"] not in [x["path"] for x in disks]:
            disks.append(d)
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = None
    return {"cpu_model": _cpu_model(), "cpus_logical": psutil.cpu_count(logical=True),
            "cpus_physical": psutil.cpu_count(logical=False), "cpus_usable": affinity,
            "numa_nodes": numa_nodes(), "ram_total_bytes": vm.total,
            "ram_available_bytes": vm.available, "load_average": load, "disks": disks}


# ---------------------------------------------------------------------------------------- env

def env_info(environ: dict[str, str]) -> dict:
    keys = list(ENV_VARS) + sorted(k for k in environ if k.startswith("NCCL_") and k not in ENV_VARS)
    return {k: environ.get(k) for k in keys}


def env_findings(env: dict, host: dict, gpus: dict) -> list[Finding]:
    """Where a variable's value hurts, say what it does and what to do."""
    out: list[Finding] = []
    v = env.get("CUDA_LAUNCH_BLOCKING")
    if v not in (None, "", "0"):
        out.append(Finding(WARNING, "CUDA_LAUNCH_BLOCKING",
                           f"={v} makes every CUDA kernel launch wait until the kernel finishes: the "
                           "CPU can no longer queue work ahead of the GPU, so training slows down, "
                           "often by tens of percent. It is a debugging switch (an error then points "
                           "at the kernel that caused it), not a speed-up: some guides recommend "
                           "it for speed, which is wrong. Unset it for training."))
    v = env.get("NVIDIA_TF32_OVERRIDE")
    if v == "0":
        out.append(Finding(WARNING, "NVIDIA_TF32_OVERRIDE",
                           "=0 forbids TF32 tensor-core math on Ampere and newer GPUs: fp32 matrix "
                           "multiplies and convolutions fall back to plain fp32 (A100: 19.5 instead "
                           "of 156 TFLOPS). Unset "
                           "it unless you need bit-exact fp32, or train in bf16."))
    v = env.get("CUDA_VISIBLE_DEVICES")
    if v is not None and v.strip() in ("", "-1", "none", "NoDevFiles"):
        out.append(Finding(WARNING, "CUDA_VISIBLE_DEVICES",
                           f"={v!r} hides every GPU from CUDA: training will run on the CPU."))
    v = env.get("NCCL_DEBUG")
    if v and v.upper() in ("INFO", "TRACE"):
        out.append(Finding(INFO, "NCCL_DEBUG",
                           f"={v}: NCCL logs its topology and every communicator — right for a "
                           "diagnosis, noisy for production runs."))
    for k, what in (("NCCL_P2P_DISABLE", "GPU-to-GPU copies go through host memory instead of "
                                         "NVLink/PCIe peer-to-peer"),
                    ("NCCL_SHM_DISABLE", "processes on one host stop using shared memory"),
                    ("NCCL_IB_DISABLE", "nodes talk over TCP sockets instead of InfiniBand/RoCE")):
        if env.get(k) not in (None, "", "0"):
            out.append(Finding(WARNING, k, f"={env[k]}: {what}; all-reduce gets slower. Keep it only "
                                          "as a workaround you have measured (gpu-lab bench allreduce)."))
    for k in ("TORCH_NCCL_BLOCKING_WAIT", "NCCL_BLOCKING_WAIT"):
        if env.get(k) not in (None, "", "0"):
            out.append(Finding(INFO, k, f"={env[k]}: the CPU waits for each collective; useful to "
                                        "find a hang, slower for training."))
    omp = env.get("OMP_NUM_THREADS")
    cpus = host.get("cpus_usable") or host.get("cpus_logical") or 0
    if omp:
        try:
            n = int(omp)
        except ValueError:
            out.append(Finding(WARNING, "OMP_NUM_THREADS", f"={omp!r} is not a number; torch ignores it"))
        else:
            if cpus and n > cpus:
                out.append(Finding(WARNING, "OMP_NUM_THREADS",
                                   f"={n} is more than the {cpus} CPUs this process may use: "
                                   "threads oversubscribe the cores and slow each other down."))
    shm = next((d for d in host.get("disks", []) if d["path"] == "/dev/shm"), None)
    if shm and shm["total_bytes"] < 1 * GiB:
        out.append(Finding(WARNING, "/dev/shm",
                           f"only {fmt_bytes(shm['total_bytes'])}: DataLoader workers hand batches over in "
                           "shared memory and die with 'bus error' when it is full (Docker's default "
                           "is 64 MB). Run the container with --shm-size=8g or --ipc=host."))
    for d in host.get("disks", []):
        if d["path"] != "/dev/shm" and d["total_bytes"] and (
                d["free_bytes"] < 5 * GiB or d["free_bytes"] / d["total_bytes"] < 0.05):
            out.append(Finding(WARNING, f"disk {d['path']}",
                               f"{fmt_bytes(d['free_bytes'])} free: checkpoints and shards need room; "
                               "a full disk fails a checkpoint write halfway."))
    nodes = host.get("numa_nodes") or []
    gpu_nodes = {d.get("numa_node") for d in gpus.get("devices", []) if d.get("numa_node") is not None}
    if len(nodes) > 1 and gpus.get("count"):
        out.append(Finding(INFO, "NUMA",
                           f"{len(nodes)} NUMA nodes, GPUs on node(s) {sorted(gpu_nodes) or '?'}: bind "
                           "each rank to its GPU's node: ACCELERATE_CPU_AFFINITY=1 "
                           "does it for accelerate launches, `numactl --cpunodebind=N --membind=N` "
                           "otherwise." + (" (set)" if env.get("ACCELERATE_CPU_AFFINITY") == "1" else "")))
    return out


# ------------------------------------------------------------------------------- fork safety

def fork_safety_info() -> dict:
    from ..launch import checks

    st = checks.cuda_probe()
    d = {"safe": True, "torch_imported": st.imported, "cuda_initialized": st.initialized,
         "bad_fork": st.bad_fork, "fork_poisoned": st.fork_poisoned, "problem": None,
         "remedy": None}
    try:
        checks.preflight()
    except checks.PreflightError as e:
        d.update(safe=False, problem=e.problem, remedy=e.remedy)
    return d


# ------------------------------------------------------------------------------------ doctor

def doctor(env: dict[str, str] | None = None, *, nvml: Any = None,
           paths: list[str | os.PathLike] | None = None) -> DoctorReport:
    """Report on this machine and environment; never initialises CUDA.

    env: extra or overriding environment variables to judge (e.g. {"CUDA_LAUNCH_BLOCKING": "1"}
    to see what a setting would do) — the process environment is not changed.
    nvml: the NVML module (default pynvml); tests pass a double. paths: more directories whose
    disk space matters (a data directory).
    """
    t0 = time.perf_counter()
    environ = dict(os.environ)
    environ.update(env or {})
    owners_unknown = None
    with nvml_session(nvml) as (nv, reason):
        system = system_info(nv)
        if nv is not None:
            gpus, handles = gpu_info(nv)
            topology = topology_info(nv, handles, gpus["devices"])
            owners, owners_unknown = gpu_holders.run_owners()
            gpus["unowned_processes"] = gpu_holders.unowned_processes(nv, handles,
                                                                      gpus["devices"], owners)
        else:
            gpus, handles = {"count": 0, "devices": [], "reason": reason}, []
            topology = topology_info(None, [], [])
    host = host_info(paths)
    from ..supervise.claims import protection

    host["host_queue"] = protection()
    envd = env_info(environ)
    findings = env_findings(envd, host, gpus)
    findings.append(Finding(INFO, "host queue", host["host_queue"]["says"]))
    fork = fork_safety_info()
    if not fork["safe"]:
        findings.insert(0, Finding(WARNING, "fork safety", f"{fork['problem']} {fork['remedy']}"))
    if gpus.get("unowned_processes"):
        findings.append(Finding(WARNING, "GPU memory", gpu_holders.advice(
            gpus["unowned_processes"], owners_unknown)))
    if gpus["count"] == 0:
        findings.append(Finding(INFO, "GPU", f"no GPU visible ({gpus.get('reason') or 'NVML lists none'}); "
                                             "gpu_lab.launch runs CPU ranks over gloo."))
    rep = DoctorReport(system=system, gpus=gpus, topology=topology, host=host, env=envd,
                       fork_safety=fork, warnings=findings)
    rep.elapsed_s = time.perf_counter() - t0
    return rep


__all__ = ["doctor", "DoctorReport", "Finding", "SECTIONS", "ENV_VARS", "torch_version_info"]
