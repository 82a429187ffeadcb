"""The tutorials under nbval, in the shapes of the machines users have.

Every notebook runs on a host with one device: GPU_LAB_CPU_SLOTS=1 gives this CPU host the shape
of a one-GPU server (one rank by default, one run at a time). The notebooks whose cells depend on
the device count run a second time on a host with two (`SECOND`): cells counted as "Cell N" the
first time, "two devices::Cell N" the second. Each run of a notebook gets

- a host queue of its own (GPU_LAB_CLAIMS_DIR): its runs wait for each other, as they would on
  that host, and not for the other notebooks of the test session;
- GPU_LAB_STRICT_DEVICE=1: every rank refuses a tensor left on the CPU beside a model on its
  device, as a GPU would (gpu_lab.rank.devicecheck);
- GPU_LAB_VERDICTS: its claim tables' rows, for one more item after the second run, "verdicts
  across shapes": every row that needs several devices names how many it needs and how many the
  host has, says so without measuring on one device, and measures on two. Both runs of a
  notebook share a file scope, so pytest-xdist (--dist loadfile) gives them to one worker, in
  this order.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest
from nbval.plugin import IPyNbFile

# the notebooks whose cells do not depend on the device count, and why: each other one runs in
# both shapes. A notebook that launches `tutorial.ranks()` ranks and branches on nothing else runs
# the same cells on two devices: the two-rank launch itself is tests/'s (test_launch*,
# test_accelerate*), and a second pass would only double the tier's time (#58 allows it)
ONE_SHAPE = {
    "00_overview": "launches nothing: text and the articles' figures",
    "00_first_run": "ranks() ranks; no row or branch follows the device count",
    "00_your_own_code": "ranks() ranks of the user's script; the counts follow run.num_processes",
    "02_data_pipeline": "ranks() ranks; shards and steps follow acc.num_processes",
    "03_mixed_precision": "its timings run on one rank; the bf16 run takes ranks() ranks",
    "10_scale_out": "exports and Slurm jobs of cfg.num_processes ranks; no row needs several",
}
SHAPES = (1, 2)
SECOND = "two devices"


def _folder() -> Path:
    """The session worker's own folder for the shapes' queues and verdicts (TMPDIR is per worker)."""
    p = Path(tempfile.gettempdir()) / "shapes"
    p.mkdir(mode=0o700, exist_ok=True)
    return p


def verdicts_file(notebook: str, slots: int) -> Path:
    return _folder() / f"{notebook}.{slots}.verdicts.jsonl"


class ShapedNotebook(IPyNbFile):
    """A notebook under nbval on a host of `slots` devices (see the module docstring)."""

    def __init__(self, *args, slots: int = 1, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.slots = slots

    def setup(self) -> None:
        stem = self.path.stem
        record = verdicts_file(stem, self.slots)
        record.unlink(missing_ok=True)
        env = {"GPU_LAB_CPU_SLOTS": str(self.slots),
               "GPU_LAB_CLAIMS_DIR": str(_folder() / f"{stem}.{self.slots}.claims"),
               "GPU_LAB_STRICT_DEVICE": "1", "GPU_LAB_VERDICTS": str(record)}
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)  # the kernel nbval starts now inherits them
        try:
            super().setup()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def collect(self):
        yield from super().collect()
        if self.slots > 1 and "needs_devices(" in self.path.read_text():
            yield ShapeVerdicts.from_parent(self, name="verdicts across shapes")


class ShapeVerdicts(pytest.Item):
    """The rows that need several devices: measured on two, "needs more devices" on one."""

    def runtest(self) -> None:
        from gpu_lab.tutorial import NEEDS_DEVICES

        stem = self.path.stem
        rows = {}
        for slots in SHAPES:
            f = verdicts_file(stem, slots)
            if not f.exists():
                pytest.fail(f"{f.name} is missing: the notebook's run on {slots} device(s) "
                            "wrote no claim table (run it before this check)")
            rows[slots] = {r["what"]: r for r in map(json.loads, f.read_text().splitlines())
                           if r["need"] is not None}
        one, two = rows[1], rows[2]
        assert one, f"{stem}: no claim table row needs several devices on one device"
        assert set(one) == set(two), ("the rows that need several devices differ between the "
                                      f"shapes: {sorted(set(one) ^ set(two))}")
        for slots, shaped in rows.items():
            for what, r in shaped.items():
                assert r["have"] == slots, (what, r)
                words = f"needs {r['need']} CPU slot"
                assert words in r["reason"] and f"this host has {slots}" in r["reason"], (
                    f"{what!r} on {slots} device(s): its verdict must name the devices it needs "
                    f"and the host has: {r['reason']!r}")
        for what in one:
            print(f"{what}: one device {one[what]['label']!r}, two {two[what]['label']!r}")
            if one[what]["need"] <= 2:
                assert one[what]["label"] == NEEDS_DEVICES, (what, one[what])
                assert two[what]["label"] != NEEDS_DEVICES, (what, two[what])

    def reportinfo(self):
        return self.path, None, f"{self.path.name}: verdicts across shapes"


@pytest.hookimpl(hookwrapper=True)
def pytest_collect_file(file_path, parent):
    outcome = yield
    if file_path.suffix != ".ipynb":
        return
    found = outcome.get_result()
    if not any(isinstance(r, IPyNbFile) for r in found):  # nbval is off: nothing to shape
        return
    shaped = [ShapedNotebook.from_parent(parent, path=file_path, slots=1)]
    if file_path.stem not in ONE_SHAPE:
        base = shaped[0].nodeid
        shaped.append(ShapedNotebook.from_parent(parent, path=file_path, slots=2,
                                                 name=f"{file_path.name}::{SECOND}",
                                                 nodeid=f"{base}::{SECOND}"))
    outcome.force_result([r for r in found if not isinstance(r, IPyNbFile)] + shaped)
