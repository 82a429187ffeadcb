"""The tutorials' helpers: fact checks that can fail, work folders that do not pile up."""
import json
import os
from pathlib import Path

import pytest
from IPython.utils.capture import capture_output

from gpu_lab.record.registry import Registry
from gpu_lab.tutorial import check_output

from proc_utils import alive, processes, wait_until

pytestmark = pytest.mark.slow  # starts processes (ranks, kernels, servers) or runs for seconds

TESTS = Path(__file__).parent


def test_check_output_passes_on_the_expected_text_and_fails_otherwise():
    with capture_output() as cap:
        print("world size 2")
    check_output(cap, "world size 2\n")
    with pytest.raises(AssertionError, match="expects"):
        check_output(cap, "world size 1\n")


@pytest.mark.parametrize("keep", [False, True])
def test_workdir_goes_with_the_kernel_unless_kept(keep, tmp_path):
    """A notebook's work folder is removed when its (real) kernel shuts down, after the run that
    kernel launched (still training) is stopped; GPU_LAB_KEEP_WORK=1 keeps the folder."""
    from jupyter_client.manager import start_new_kernel

    env = dict(os.environ, GPU_LAB_KEEP_WORK="1" if keep else "")
    km, kc = start_new_kernel(kernel_name="python3", env=env)
    try:
        reply = kc.execute_interactive(
            f"import json, sys; sys.path.insert(0, {str(TESTS)!r})\n"
            "import gpu_lab, launch_fns\n"
            "from gpu_lab import tutorial\n"
            "from proc_utils import tree\n"
            "w = tutorial.workdir('test')\n"
            "(w / 'shards').mkdir(); (w / 'shards' / 'a.tar').write_bytes(b'x' * 4096)\n"
            "run = gpu_lab.launch(launch_fns.train_forever, num_processes=2)\n"
            "assert run.wait_for_step(1, rank=1, timeout=90), run.status\n"
            f"open({str(tmp_path / 'state')!r}, 'w').write(json.dumps(\n"
            "    dict(work=str(w), pids=[p.pid for p in tree(run.pid)], run=run.id)))\n", timeout=120)
        assert reply["content"]["status"] == "ok", reply["content"]
        state = json.loads((tmp_path / "state").read_text())
        work = Path(state["work"])
        assert work.is_dir() and work.name.startswith("gpu_lab_test_") and len(state["pids"]) >= 3
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=False)  # a graceful shutdown, as JupyterLab's "Shut Down Kernel"
    assert work.exists() == keep
    procs = processes(state["pids"])
    wait_until(lambda: not alive(procs), 10, what="the run's processes to end with the kernel")
    assert Registry().get_run(state["run"])["status"] == "stopped"

