"""GPU classes: memory and dense peak throughput, from NVIDIA's data sheets.

The usual picks go by model size (VGG16 → one P100 16 GB, ResNet-50 → four V100 32 GB,
ViT → eight A100 80 GB); the classes add A40 and the H200 with 141 GB. The advisor checks those
picks against a measured memory estimate, and the GPU benchmark divides by the peak to get MFU.

Peaks are dense (no 2:4 sparsity), in TFLOPS, for the SXM board where one exists. None means the
GPU has no such math mode (no TF32 or bf16 before Ampere: those run as fp32 / fp16).
"""
from __future__ import annotations

from dataclasses import dataclass

from .units import GiB


@dataclass(frozen=True)
class GPUClass:
    name: str            # as people say it: "A100 80GB"
    memory_gb: float     # as sold (GB on the box; the driver reports slightly less in GiB)
    fp32_tflops: float
    tf32_tflops: float | None
    bf16_tflops: float | None   # bf16 tensor-core dense (fp16 where bf16 is missing, see fp16)
    fp16_tflops: float | None
    arch: str
    match: tuple[str, ...]      # lower-case substrings that identify it in an NVML name

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gb * 1e9)

    def peak_tflops(self, precision: str) -> float | None:
        """Dense peak for a precision: fp32 | tf32 | bf16 | fp16."""
        return {"fp32": self.fp32_tflops, "tf32": self.tf32_tflops or self.fp32_tflops,
                "bf16": self.bf16_tflops, "fp16": self.fp16_tflops or self.bf16_tflops}.get(precision)


#: from small to large memory: the usual picks (P100 16GB, V100 32GB, A100 80GB), A40, H200 and more
GPU_CLASSES: tuple[GPUClass, ...] = (
    GPUClass("T4 16GB", 16, 8.1, None, None, 65.0, "Turing", ("t4",)),
    GPUClass("P100 16GB", 16, 10.6, None, None, 21.2, "Pascal", ("p100",)),
    GPUClass("V100 32GB", 32, 15.7, None, None, 125.0, "Volta", ("v100",)),
    GPUClass("A10 24GB", 24, 31.2, 62.5, 125.0, 125.0, "Ampere", ("a10",)),
    GPUClass("L4 24GB", 24, 30.3, 60.0, 121.0, 121.0, "Ada", ("l4",)),
    GPUClass("A100 40GB", 40, 19.5, 156.0, 312.0, 312.0, "Ampere", ("a100-sxm4-40gb", "a100-pcie-40gb", "a100 40gb")),
    GPUClass("A40 48GB", 48, 37.4, 74.8, 149.7, 149.7, "Ampere", ("a40",)),
    GPUClass("L40S 48GB", 48, 91.6, 183.0, 362.0, 362.0, "Ada", ("l40s",)),
    GPUClass("A100 80GB", 80, 19.5, 156.0, 312.0, 312.0, "Ampere", ("a100",)),
    GPUClass("H100 80GB", 80, 67.0, 494.7, 989.4, 989.4, "Hopper", ("h100",)),
    GPUClass("H200 141GB", 141, 67.0, 494.7, 989.4, 989.4, "Hopper", ("h200",)),
)

#: the usual pick by model: model → (GPUs, class); the advisor shows whether memory agrees
ARTICLE_PICKS: dict[str, tuple[int, str]] = {
    "vgg16": (1, "P100 16GB"),
    "resnet50": (4, "V100 32GB"),
    "vit_b_16": (8, "A100 80GB"),
}

#: what a CUDA process cannot give to tensors: the context and library workspaces (~0.5–1 GiB),
#: plus ~10% of allocator fragmentation and cached blocks
CONTEXT_RESERVE_BYTES = 1 * GiB
FRAGMENTATION = 0.10


def usable_bytes(gpu: GPUClass) -> int:
    """Memory a training step can plan on: minus the CUDA context and fragmentation headroom."""
    return int(gpu.memory_bytes * (1 - FRAGMENTATION) - CONTEXT_RESERVE_BYTES)


def by_name(name: str) -> GPUClass:
    """A GPU class from a name people or NVML write: "A100 80GB", "NVIDIA A100-SXM4-80GB", "h200"."""
    key = name.lower().replace("nvidia", "").strip()
    for g in GPU_CLASSES:
        if g.name.lower() == key:
            return g
    # NVML names: the longest matching substring wins ("a100-pcie-40gb" over "a100" over "a10")
    score = {g: max((len(m) for m in g.match if m in key), default=0) for g in GPU_CLASSES}
    best = max(GPU_CLASSES, key=lambda g: score[g])
    if score[best]:
        return best
    raise ValueError(f"unknown GPU {name!r}; accepted: {', '.join(g.name for g in GPU_CLASSES)} "
                     "(or an NVML name containing one of them)")


def classes_with_memory(need_bytes: float) -> list[str]:
    """Names of the GPU classes whose usable memory holds `need_bytes`, smallest first."""
    return [g.name for g in sorted(GPU_CLASSES, key=lambda g: g.memory_gb)
            if usable_bytes(g) >= need_bytes]


__all__ = ["GPUClass", "GPU_CLASSES", "ARTICLE_PICKS", "by_name", "classes_with_memory",
           "usable_bytes", "CONTEXT_RESERVE_BYTES", "FRAGMENTATION"]
