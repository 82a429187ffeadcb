"""Start a real JupyterLab server for the browser and `make lab` tests, and clean up after it.

The server is isolated from the user's Jupyter state (its own config, runtime and workspaces
directories, its own GPU_LAB_HOME) but uses the project venv's installed extensions, which is what
is under test. The announcements ("news") plugin is disabled so no toast covers the UI and nothing
asks the network.
"""
from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "test-artifacts"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def root_flag() -> list[str]:
    # JupyterLab refuses to run as root without it, and CI containers run as root
    return ["--allow-root"] if os.geteuid() == 0 else []


@dataclass
class Lab:
    url: str          # http://127.0.0.1:PORT/
    token: str
    proc: subprocess.Popen
    log: Path
    gpu_lab_home: Path
    root_dir: Path
    cmd: Sequence[str] = ()
    env: dict | None = None

    def stop(self) -> None:
        """Stop the server as SIGTERM does: its websockets close, and its port."""
        terminate(self.proc)

    def start(self) -> None:
        """Start the server again, on the same port with the same token, and wait for it."""
        with open(self.log, "ab") as fh:
            self.proc = subprocess.Popen(self.cmd, cwd=ROOT, env=self.env, stdout=fh,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        wait_ready(self)

    def get(self, path: str, timeout: float = 30.0) -> tuple[int, bytes, dict]:
        req = urllib.request.Request(self.url + path.lstrip("/"),
                                     headers={"Authorization": f"token {self.token}"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, r.read(), dict(r.headers)
        except urllib.error.HTTPError as e:
            return e.code, e.read(), dict(e.headers)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def isolated_env(tmp: Path, gpu_lab_home: Path, extra: dict | None = None) -> dict:
    cfg = tmp / "jupyter_config"
    (cfg / "labconfig").mkdir(parents=True, exist_ok=True)
    (cfg / "labconfig" / "page_config.json").write_text(json.dumps(
        {"disabledExtensions": {"@jupyterlab/apputils-extension:announcements": True}}))
    env = dict(os.environ)
    env.update({
        "JUPYTER_CONFIG_DIR": str(cfg),
        "JUPYTER_RUNTIME_DIR": str(tmp / "jupyter_runtime"),
        "GPU_LAB_HOME": str(gpu_lab_home),
        "PYTHONUNBUFFERED": "1",
    })
    env.update(extra or {})
    return env


def wait_ready(lab: Lab, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if lab.proc.poll() is not None:
            raise AssertionError(f"JupyterLab exited with {lab.proc.returncode}:\n{lab.log_text()[-4000:]}")
        try:
            status, _, _ = lab.get("api/status", timeout=5)
            if status == 200:
                return
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        time.sleep(0.25)
    raise AssertionError(f"JupyterLab not ready after {timeout} s:\n{lab.log_text()[-4000:]}")


def stop_active_runs(gpu_lab_home: Path) -> list[str]:
    """Stop every run still active in this GPU_LAB_HOME (a kernel killed with the server leaves
    its supervisor's process group behind otherwise)."""
    from gpu_lab.launch import stop_run
    from gpu_lab.record.registry import ACTIVE, Registry

    reg = Registry(gpu_lab_home / "registry.db")
    stopped = []
    for r in reg.list_runs(status=ACTIVE):
        stop_run(r["id"], grace=2.0, registry=reg)
        stopped.append(r["id"])
    return stopped


def terminate(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)  # jupyter_server: clean shutdown, kernels included
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@contextlib.contextmanager
def jupyter_lab(tmp: Path, root_dir: Path, *, argv: Sequence[str] | None = None,
                env: dict | None = None, name: str = "lab") -> Iterator[Lab]:
    """Run `jupyter lab` on 127.0.0.1 with a token; `argv` replaces the default command line
    (its {port}/{token}/{root_dir} placeholders are filled in)."""
    port, token = free_port(), secrets.token_hex(16)
    home = tmp / "gpu_lab_home"
    home.mkdir(parents=True, exist_ok=True)
    ARTIFACTS.mkdir(exist_ok=True)
    log = ARTIFACTS / f"{name}.log"
    if argv is None:
        argv = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1",
                "--port={port}", "--ServerApp.port_retries=0", "--IdentityProvider.token={token}",
                "--ServerApp.root_dir={root_dir}", f"--LabApp.workspaces_dir={tmp / 'workspaces'}",
                *root_flag()]
    cmd = [a.format(port=port, token=token, root_dir=root_dir) for a in argv]
    full_env = isolated_env(tmp, home, env)
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=fh,
                                stderr=subprocess.STDOUT, start_new_session=True)
    lab = Lab(f"http://127.0.0.1:{port}/", token, proc, log, home, Path(root_dir), cmd, full_env)
    try:
        wait_ready(lab)
        yield lab
    finally:
        try:
            stop_active_runs(home)
        finally:
            terminate(lab.proc)  # the one running now (Lab.start starts another)
