"""The user's path: a real Jupyter kernel (nbclient) launches 2 gloo ranks and stays free."""
from __future__ import annotations

import pytest

import json
from pathlib import Path

import nbformat
from nbclient import NotebookClient

pytestmark = pytest.mark.slow  # starts processes (ranks, kernels, servers) or runs for seconds

TESTS = Path(__file__).parent

CELLS = [
    f"""
import sys, time, json
sys.path.insert(0, {str(TESTS)!r})
import gpu_lab, launch_fns
from proc_utils import tree, alive, wait_until
from gpu_lab.launch.checks import port_in_use
from gpu_lab.record.registry import Registry
""",
    # the launch returns at once: the run is still going when the cell ends
    """
t0 = time.monotonic()
run = gpu_lab.launch(launch_fns.train_linear, 40, 0.05, num_processes=2, name="from-kernel")
launch_seconds = time.monotonic() - t0
assert not run.done, run.status
print("launched", run.status in ("pending", "running"))
""",
    # the kernel executes other cells while the ranks train
    """
busy = not run.done
print("kernel free while training:", busy, 6 * 7)
""",
    """
assert run.wait(180) == "succeeded", run.logs(None, 50)
res = run.result()
p0, p1 = res["params"]
out = dict(
    distributed_type=res["distributed_type"],
    num_processes=res["num_processes"],
    same_params=max(abs(a - b) for a, b in zip(p0, p1)) < 1e-7,
    metric_ranks=run.metrics.ranks(),
    steps_rank1=run.metrics.count("loss", 1),
    bad_fork=[v for r in (0, 1) for v in run.metrics.series("bad_fork", r)[1]],
    registry=Registry().get_run(run.id)["status"],
    launch_seconds=launch_seconds,
)
print(json.dumps(out))
""",
    """
run2 = gpu_lab.launch(launch_fns.train_forever, num_processes=2, name="to-stop")
assert run2.wait_for_step(2, rank=1, timeout=90), run2.status
procs = tree(run2.pid)
n_procs = len(procs)
status = run2.stop()
wait_until(lambda: not alive(procs), 10, what="the run's processes to end")
print(json.dumps(dict(status=status, n_procs=n_procs, port_free=not port_in_use(run2.port),
                      registry=Registry().get_run(run2.id)["status"])))
""",
    "print('still executing', 1 + 1)",
]


def _run_notebook(cells, timeout=300):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c) for c in cells]
    NotebookClient(nb, timeout=timeout, kernel_name="python3",
                   resources={"metadata": {"path": str(TESTS)}}).execute()
    return nb


def _stdout(cell) -> str:
    return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")


def test_launch_from_a_real_kernel_trains_two_ranks_and_stays_free():
    nb = _run_notebook(CELLS)
    assert "launched True" in _stdout(nb.cells[1])
    assert "kernel free while training: True 42" in _stdout(nb.cells[2])
    res = json.loads(_stdout(nb.cells[3]).strip().splitlines()[-1])
    assert res["distributed_type"] == "MULTI_CPU"
    assert res["num_processes"] == 2
    assert res["same_params"] is True
    assert res["metric_ranks"] == [0, 1]
    assert res["steps_rank1"] == 40
    assert res["bad_fork"] == [0.0] * 80  # every worker of a clean kernel: not in bad-fork state
    assert res["registry"] == "succeeded"
    print(f"gpu_lab.launch returned in {res['launch_seconds'] * 1000:.0f} ms")
    stop = json.loads(_stdout(nb.cells[4]).strip().splitlines()[-1])
    assert stop == {"status": "stopped", "n_procs": stop["n_procs"], "port_free": True,
                    "registry": "stopped"}
    assert stop["n_procs"] >= 3
    assert "still executing 2" in _stdout(nb.cells[5])
