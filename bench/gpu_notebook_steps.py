"""The GPU smoke lane: the tutorials on a real GPU, one step a notebook and a shape, run by
bench/gpu_check.py (`--lane notebooks`, `make gpu-notebooks`).

Each notebook runs in quick mode (GPU_LAB_QUICK=1: small models and few steps) on the GPU, so its
cells take full mode's code paths at a smoke size: CUDA, bf16 (tutorial.precision()), NCCL where
it has several ranks, pinned memory, loader workers. Shapes: "one" sees the first GPU only (the
one-GPU server); "all" sees every GPU, and exists on a machine with two or more (on one GPU its
steps are left out: NCCL refuses two ranks on one device). A step executes the notebook with nbclient and records
how far it got, the first failing cell with its error, and every claim-table row (the verdicts
the tutorials reach on this GPU). The order puts what only a GPU can show first, so that a budget
cut (the lane has about 240 s) leaves the least GPU-specific ones.

In the dry run (a CPU, `make test`): every notebook's packages are importable here, and each one
either lies in the GPU image or travels in bench/gpu_wheels.txt; 01_environment_setup runs for
real through the same path, on the CPU (the notebooks tier runs them all on one device, and on
two those whose cells follow the device count).
"""
from __future__ import annotations

import json
import os
import time

from gpu_check_steps import REPO, Ctx, Step

NOTEBOOKS = REPO / "notebooks"
# in order: what only a GPU can show first (Tensor Cores, NCCL, memory, OOM, NVML, loaders)
ORDER = ("03_mixed_precision", "04_distributed_training", "01_environment_setup",
         "05_memory_optimization", "08_troubleshooting", "06_monitoring_profiling",
         "02_data_pipeline", "00_first_run", "12_case_studies", "09_cost_control", "10_scale_out",
         "00_your_own_code", "11_diffusion_finetune", "07_tuning", "00_overview")
# what a notebook imports (itself, or through the gpu_lab feature it uses) beyond gpu_lab's own
# wheels: the GPU image has some (IMAGE), the others travel in bench/gpu_wheels.txt
NEEDS = {
    "00_your_own_code": ("transformers", "lightning"),
    "07_tuning": ("optuna",),                       # gpu_lab.sweep
    "09_cost_control": ("apprise",),                # notify=
    "11_diffusion_finetune": ("diffusers",),        # gpu_lab.cases.diffusion
    "12_case_studies": ("onnxruntime", "tritonclient"),
}
# packages of the GPU image (the device's package list, read 2026-11-17) that notebooks need
IMAGE = {"torch", "torchvision", "accelerate", "transformers", "lightning", "onnxruntime", "onnx",
         "pandas", "tensorboard", "pytest", "requests", "huggingface-hub", "safetensors"}
# import name -> distribution name, where they differ
DIST = {"huggingface_hub": "huggingface-hub", "tritonclient": "tritonclient"}
# the shapes whose cells depend on the device count run in both; these in "one" only
ONE_SHAPE = ("00_overview",)
# the dry run executes this one for real (seconds on a CPU)
DRY_RUN = "01_environment_setup"


def _gpus() -> int:
    from gpu_lab.telemetry.probe import gpu_count

    return gpu_count()


def _wheels() -> set[str]:
    from gpu_check import wanted_wheels

    return set(wanted_wheels())


def run_notebook(ctx: Ctx, name: str, shape: str, timeout: int) -> None:
    """Execute notebooks/<name>.ipynb in a fresh kernel in quick mode on this shape."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    verdicts = ctx.work / "verdicts.jsonl"
    env = {"GPU_LAB_QUICK": "1", "GPU_LAB_VERDICTS": str(verdicts),
           "GPU_LAB_CLAIMS_DIR": str(ctx.work / "claims")}
    if shape == "one":
        env["CUDA_VISIBLE_DEVICES"] = "0"
    os.environ.update(env)  # the kernel inherits them
    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    code = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOKS)}})
    t0 = time.perf_counter()
    error = None
    try:
        client.execute()
    except CellExecutionError as e:
        error = str(e).strip().splitlines()[-1][:1500]
    ran = [i for i in code if nb.cells[i].get("execution_count") is not None]
    failed = next((i for i in code if any(o.get("output_type") == "error"
                                          for o in nb.cells[i].get("outputs", []))), None)
    rows = ([json.loads(line) for line in verdicts.read_text().splitlines()]
            if verdicts.exists() else [])
    ctx.record(notebook=name, shape=shape, code_cells=len(code), cells_run=len(ran),
               failed_cell=failed, error=error, seconds=round(time.perf_counter() - t0, 1),
               verdicts=[{k: r[k] for k in ("what", "label", "reason")} for r in rows])
    ctx.check("every cell ran without an error", error is None and len(ran) == len(code),
              error or f"{len(ran)} of {len(code)} cells")
    held = sum(r["label"] in ("holds", "exceeds the claim") for r in rows)
    ctx.summary(f"{len(ran)}/{len(code)} cells"
                + (f", first error in cell {failed}: {error[:200]}" if error else "")
                + (f"; {held} of {len(rows)} claims hold" if rows else ""))


def check_packages(ctx: Ctx) -> None:
    """The dry run's check of the whole lane: every tutorial is in it, each one's packages import
    here, and each lies in the GPU image or travels as a wheel."""
    import importlib.util

    import nbformat

    names = sorted(p.stem for p in NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
    ctx.check("every tutorial is in the lane's order", sorted(ORDER) == names,
              sorted(set(names) ^ set(ORDER)) or len(names))
    travel = IMAGE | _wheels()
    for name in ORDER:
        nbformat.validate(nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4))
        needs = NEEDS.get(name, ())
        here = [m for m in needs if importlib.util.find_spec(m) is None]
        missing = [m for m in needs if DIST.get(m, m).replace("_", "-") not in travel]
        ctx.check(f"{name}: its packages import here, and each is in the GPU image or travels",
                  not here and not missing, here + missing or list(needs) or "gpu_lab's own")
    ctx.summary(f"{len(ORDER)} notebooks: their packages are in the GPU image or the wheels")


def _step(name: str, shape: str) -> Step:
    def run(ctx: Ctx) -> None:
        run_notebook(ctx, name, shape, timeout=300 if ctx.dry else 90)

    where = "the first GPU" if shape == "one" else "every GPU"
    return Step(f"{name}.{shape}", f"{name} in quick mode on {where}", 90, run,
                "the notebook itself, on the CPU")


def steps(gpus: int | None = None, dry: bool = False) -> list[Step]:
    """Every notebook on one GPU, then those whose cells depend on the device count on all of
    them where there are two or more. The dry run checks the lane's packages and runs one
    notebook through the same path on the CPU."""
    if dry:
        return [Step("packages", "every tutorial's packages: in the GPU image or the wheels", 60,
                     check_packages, "the same check"), _step(DRY_RUN, "one")]
    gpus = _gpus() if gpus is None else gpus
    out = [_step(n, "one") for n in ORDER]
    if gpus >= 2:
        out += [_step(n, "all") for n in ORDER if n not in ONE_SHAPE]
    return out


STEPS = steps(dry=os.environ.get("GPU_LAB_LANE_DRY") == "1")
