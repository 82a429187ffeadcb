"""gpu_lab.diagnostics: what is wrong with my setup and my run, and what should I do.

    doctor()                                   environment report (NVML only: never initialises CUDA)
    estimate_memory(model, image_size, batch_size, precision, optimizer)   fake-tensor dry run
    advise(model, ...)                         which GPU classes fit, how many, what to switch on
    allreduce_bench(sizes, num_processes)      nccl-tests-style algbw / busbw through gpu_lab.launch
    io_bench(path) / DiskMonitor               sequential + random read MB/s and IOPS; live iostat
    loader_bench(data_dir, ...)                gpu_lab's shard loader vs the per-file PIL pipeline
    find_bottleneck(run)                       data / compute / communication, and the fix
    StepTimer                                  the per-phase timing a training loop reports
    memory_cap(bytes)                          an allocation cap (RLIMIT_AS) to provoke an OOM on CPU
    oom_report / comm_report / data_report     the triage texts with the exact numbers
    gpu_benchmark(...)                         ResNet-50 img/s in fp32 / TF32 / bf16, MFU

Never imports widgets, plotly or jupyter; names are imported on first use (torch is not loaded by
`import gpu_lab.diagnostics`).
"""
from __future__ import annotations

from gpu_lab._lazy import lazy_api


_API = {
    "doctor": "gpu_lab.diagnostics.doctor",
    "DoctorReport": "gpu_lab.diagnostics.doctor",
    "Finding": "gpu_lab.diagnostics.doctor",
    "estimate_memory": "gpu_lab.diagnostics.advisor",
    "measure_memory": "gpu_lab.diagnostics.advisor",
    "advise": "gpu_lab.diagnostics.advisor",
    "MemoryEstimate": "gpu_lab.diagnostics.advisor",
    "Advice": "gpu_lab.diagnostics.advisor",
    "GPU_CLASSES": "gpu_lab.hardware",
    "GPUClass": "gpu_lab.hardware",
    "allreduce_bench": "gpu_lab.diagnostics.allreduce",
    "AllReduceResult": "gpu_lab.diagnostics.allreduce",
    "parse_sizes": "gpu_lab.diagnostics.allreduce",
    "io_bench": "gpu_lab.diagnostics.iobench",
    "IOResult": "gpu_lab.diagnostics.iobench",
    "DiskMonitor": "gpu_lab.diagnostics.iobench",
    "loader_bench": "gpu_lab.diagnostics.loaderbench",
    "find_bottleneck": "gpu_lab.diagnostics.bottleneck",
    "Breakdown": "gpu_lab.diagnostics.bottleneck",
    "breakdown_from_trace": "gpu_lab.diagnostics.bottleneck",
    "StepTimer": "gpu_lab.diagnostics.timing",
    "memory_cap": "gpu_lab.diagnostics.memcap",
    "gpu_benchmark": "gpu_lab.diagnostics.gpubench",
    "oom_report": "gpu_lab.failures.oom",
    "comm_report": "gpu_lab.failures.explain",
    "data_report": "gpu_lab.failures.explain",
    "note": "gpu_lab.failures.explain",
}

__getattr__, __dir__, __all__ = lazy_api(__name__, _API)
