"""The tutorials' helpers: fact checks that can fail, work folders that do not pile up."""
import os
from pathlib import Path

import pytest
from IPython.utils.capture import capture_output

from gpu_lab.tutorial import check_output


def test_check_output_passes_on_the_expected_text_and_fails_otherwise():
    with capture_output() as cap:
        print("world size 2")
    check_output(cap, "world size 2\n")
    with pytest.raises(AssertionError, match="expects"):
        check_output(cap, "world size 1\n")


@pytest.mark.parametrize("keep", [False, True])
def test_workdir_goes_with_the_kernel_unless_kept(keep, tmp_path):
    """A notebook's work folder is removed when its (real) kernel shuts down, after the runs that
    kernel launched are stopped; GPU_LAB_KEEP_WORK=1 keeps it."""
    from jupyter_client.manager import start_new_kernel

    env = dict(os.environ, GPU_LAB_KEEP_WORK="1" if keep else "")
    km, kc = start_new_kernel(kernel_name="python3", env=env)
    try:
        reply = kc.execute_interactive(
            "from gpu_lab import tutorial\n"
            "w = tutorial.workdir('test')\n"
            "(w / 'shards').mkdir(); (w / 'shards' / 'a.tar').write_bytes(b'x' * 4096)\n"
            f"open({str(tmp_path / 'where')!r}, 'w').write(str(w))\n", timeout=60)
        assert reply["content"]["status"] == "ok", reply["content"]
        work = Path((tmp_path / "where").read_text())
        assert work.is_dir() and work.name.startswith("gpu_lab_test_")
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=False)  # a graceful shutdown, as JupyterLab's "Shut Down Kernel"
    assert work.exists() == keep
