"""gpu_lab.launch from a plain Python script, and no orphans when the script exits early."""
from __future__ import annotations

import pytest

import subprocess
import sys
import textwrap
from pathlib import Path

from proc_utils import alive, processes, wait_until

pytestmark = pytest.mark.slow  # starts processes (ranks, kernels, servers) or runs for seconds

TESTS = Path(__file__).parent


def _script(tmp_path: Path, body: str) -> Path:
    p = tmp_path / "script.py"
    p.write_text(f"import sys\nsys.path.insert(0, {str(TESTS)!r})\n" + textwrap.dedent(body))
    return p


def test_launch_from_a_script(tmp_path):
    p = _script(tmp_path, """
        import gpu_lab, launch_fns
        if __name__ == "__main__":
            run = gpu_lab.launch(launch_fns.train_linear, 3, num_processes=2)
            print("status", run.wait(120), run.result()["distributed_type"])
    """)
    out = subprocess.run([sys.executable, str(p)], capture_output=True, text=True, timeout=180)
    assert "status succeeded MULTI_CPU" in out.stdout, out.stdout + out.stderr


def test_script_that_exits_early_leaves_no_orphans(tmp_path):
    p = _script(tmp_path, """
        import gpu_lab, launch_fns
        from proc_utils import tree
        run = gpu_lab.launch(launch_fns.train_forever, num_processes=2)
        assert run.wait_for_step(2, rank=1, timeout=90), run.status
        print("PIDS", " ".join(str(p.pid) for p in tree(run.pid)), flush=True)
        # the script ends here without waiting: atexit must stop the run
    """)
    out = subprocess.run([sys.executable, str(p)], capture_output=True, text=True, timeout=180)
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("PIDS")]
    assert line, out.stdout + out.stderr
    pids = [int(x) for x in line[0].split()[1:]]
    assert len(pids) >= 3
    procs = processes(pids)
    wait_until(lambda: not alive(procs), 10, what="no orphan processes")


def test_launch_after_multithreaded_torch_work_in_the_parent_does_not_hang(tmp_path):
    # GNU OpenMP's thread pool does not survive a fork; ranks forked after the parent ran a parallel
    # region on 2 threads used to hang at their first one
    p = _script(tmp_path, """
        import torch, gpu_lab
        torch.set_num_threads(2)
        x = torch.randn(600, 768); w = torch.randn(768, 6, requires_grad=True)
        (x @ w).sum().backward()

        def step():
            x = torch.randn(600, 768); w = torch.randn(768, 6, requires_grad=True)
            (x @ w).sum().backward()
            return torch.get_num_threads()

        if __name__ == "__main__":
            for n in (1, 2):
                run = gpu_lab.launch(step, num_processes=n)
                print("ranks", n, run.wait(120), run.result() if run.status == "succeeded" else "")
    """)
    out = subprocess.run([sys.executable, str(p)], capture_output=True, text=True, timeout=240)
    assert "ranks 1 succeeded 1" in out.stdout, out.stdout + out.stderr
    assert "ranks 2 succeeded 1" in out.stdout, out.stdout + out.stderr
