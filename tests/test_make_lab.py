"""`make lab` starts JupyterLab with both extensions active: the test runs the real target (on a
free port), reads the token from its log as a user would, fetches /lab, and checks that the page
lists gpu_lab's prebuilt extension, that its assets are served, and that the server extension
answers (with the token) and refuses (without)."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from html.parser import HTMLParser

import pytest

from lab_utils import ARTIFACTS, ROOT, Lab, free_port, isolated_env, wait_ready

pytestmark = [pytest.mark.packaging,  # builds the wheel, or the lab from a clone
              pytest.mark.timeout(600)]


class _ConfigData(HTMLParser):
    """Pulls JupyterLab's page config out of <script id="jupyter-config-data">."""

    def __init__(self) -> None:
        super().__init__()
        self._inside = False
        self.text = ""

    def handle_starttag(self, tag, attrs):
        self._inside = tag == "script" and ("id", "jupyter-config-data") in attrs

    def handle_endtag(self, tag):
        self._inside = False

    def handle_data(self, data):
        if self._inside:
            self.text += data


def _get(url: str, token: str | None) -> tuple[int, bytes]:
    headers = {"Authorization": f"token {token}"} if token else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_make_lab_serves_both_extensions(tmp_path):
    port = free_port()
    home = tmp_path / "gpu_lab_home"
    env = isolated_env(tmp_path, home, {"BROWSER": "true"})  # `true`: don't open a browser
    log_path = ARTIFACTS / "make-lab.log"
    ARTIFACTS.mkdir(exist_ok=True)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(["make", "lab", f"LAB_PORT={port}"], cwd=ROOT, env=env,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        token = _wait_for_token(proc, log_path, port)
        base = f"http://127.0.0.1:{port}/"
        # jupyter_server prints its URL before the io loop binds the socket: wait until it answers
        wait_ready(Lab(base, token, proc, log_path, home, ROOT / "notebooks"))

        status, body = _get(f"{base}lab?token={token}", None)
        assert status == 200
        parser = _ConfigData()
        parser.feed(body.decode())
        config = json.loads(parser.text)
        ours = [e for e in config["federated_extensions"] if e["name"] == "gpu_lab"]
        assert ours, [e["name"] for e in config["federated_extensions"]]
        entry = ours[0]["load"]
        assert re.fullmatch(r"static/remoteEntry\.[0-9a-f]+\.js", entry), entry
        assert "gpu_lab" not in config.get("disabledExtensions", [])

        status, js = _get(f"{base}lab/extensions/gpu_lab/{entry}", token)
        assert status == 200 and b"gpu_lab" in js
        status, style = _get(f"{base}lab/extensions/gpu_lab/static/style.js", token)
        assert status == 200

        # the server extension is active too, and authenticated
        status, info = _get(f"{base}gpu-lab/api/info", token)
        assert status == 200 and json.loads(info)["version"]
        assert _get(f"{base}gpu-lab/api/info", None)[0] == 403
        # `make lab` serves notebooks/: the tutorial the browser test runs is at the root
        status, _ = _get(f"{base}api/contents/04_distributed_training.ipynb?content=0", token)
        assert status == 200
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # make and the jupyter lab it started
        proc.wait(60)


def _wait_for_token(proc: subprocess.Popen, log_path, port: int, timeout: float = 480.0) -> str:
    """`make lab` may first (re)install (a fresh clone): wait for JupyterLab's URL line."""
    deadline = time.monotonic() + timeout
    pattern = re.compile(rf"http://127\.0\.0\.1:{port}/\S*\?token=([0-9a-f]+)")
    while time.monotonic() < deadline:
        text = log_path.read_text(errors="replace")
        m = pattern.search(text)
        if m:
            return m.group(1)
        if proc.poll() is not None:
            raise AssertionError(f"make lab exited with {proc.returncode}:\n{text[-4000:]}")
        time.sleep(0.25)
    raise AssertionError(f"no JupyterLab URL after {timeout} s:\n{log_path.read_text()[-4000:]}")
