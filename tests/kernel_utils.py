"""A real ipykernel driven as JupyterLab drives one (jupyter_client): for tests that need to act
between two cells (kill the kernel, create a file once a cell's reply has come)."""
from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from jupyter_client.manager import KernelManager

TESTS = Path(__file__).parent


class Kernel:
    """A real ipykernel, as JupyterLab starts one."""

    def __init__(self, setup: str = "import gpu_lab, launch_fns") -> None:
        self.km = KernelManager(kernel_name="python3")
        self.km.start_kernel(cwd=str(TESTS))
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=120)
        self.pid = self.km.provisioner.process.pid
        self.run(f"import sys, json; sys.path.insert(0, {str(TESTS)!r})\n{setup}")

    def run(self, code: str, timeout: float = 180) -> str:
        out: list[str] = []

        def hook(msg: dict) -> None:
            if msg["msg_type"] == "stream":
                out.append(msg["content"]["text"])
            elif msg["msg_type"] == "error":
                out.append("\n".join(msg["content"]["traceback"]))

        reply = self.kc.execute_interactive(code, timeout=timeout, output_hook=hook)
        assert reply["content"]["status"] == "ok", "".join(out)
        return "".join(out)

    def json(self, code: str, timeout: float = 180) -> dict:
        return json.loads(self.run(code, timeout).strip().splitlines()[-1])

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)
        self.km.provisioner.process.wait(30)
        self.close()

    def shutdown(self) -> None:
        """What Kernel → Restart and Shut Down do first: a shutdown request on the control
        channel; the kernel runs its exit handlers and exits."""
        self.km.shutdown_kernel(now=False)
        self.close()

    def close(self) -> None:
        self.kc.stop_channels()
        if self.km.has_kernel:
            self.km.shutdown_kernel(now=True)
        self.km.cleanup_resources()


@pytest.fixture
def kernels():
    made: list[Kernel] = []

    def make(setup: str = "import gpu_lab, launch_fns") -> Kernel:
        k = Kernel(setup)
        made.append(k)
        return k

    yield make
    for k in made:
        try:
            k.close()
        except Exception:  # noqa: BLE001 - already gone
            pass
