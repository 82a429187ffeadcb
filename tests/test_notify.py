"""A run's end notice through apprise (gpu_lab.record.notify), to a webhook this test serves on
127.0.0.1: real runs (launched and headless), a real HTTP server, real sockets."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

import gpu_lab
from gpu_lab.record import notify
from gpu_lab.record.runfolder import RunFolder
from gpu_lab.record.registry import Registry

import launch_fns
from job_utils import job_env
from proc_utils import wait_until

pytestmark = pytest.mark.slow  # starts processes (ranks, kernels, servers) or runs for seconds


class Hook:
    """An HTTP server on a free loopback port that keeps every JSON body POSTed to it."""

    def __init__(self) -> None:
        received = self.received = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                received.append({"path": self.path, **json.loads(body)})
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args) -> None:  # keep the test's output for failures
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"json://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def hook():
    h = Hook()
    yield h
    h.close()


@pytest.fixture
def no_setting(monkeypatch):
    """Neither GPU_LAB_NOTIFY nor a notify.txt in this session's GPU_LAB_HOME."""
    monkeypatch.delenv(notify.ENV, raising=False)
    from gpu_lab.record.registry import home

    assert not (home() / notify.FILE_NAME).exists()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_launched_runs_send_their_end_to_a_webhook(hook, no_setting):
    # a run with no URL anywhere sends nothing: no file, no sender, not a line in its log
    quiet = gpu_lab.launch(launch_fns.train_linear, 3, num_processes=2, name="notify-quiet")
    assert quiet.wait(180) == "succeeded", quiet.logs(None)
    assert not (RunFolder(quiet.run_dir).notify_file).exists()
    assert "gpu_lab notify" not in quiet.logs(None, tail=None)

    dead = f"json://127.0.0.1:{_closed_port()}/nobody"
    ok = gpu_lab.launch(launch_fns.train_linear, 3, num_processes=2, name="notify-ok",
                        notify=[f"{hook.url}/ok", dead])
    broken = gpu_lab.launch(launch_fns.rank1_raises, 3, num_processes=2, name="notify-broken",
                            notify=f"{hook.url}/broken")
    assert ok.wait(180) == "succeeded", ok.logs(None)
    assert broken.wait(180) == "failed", broken.logs(None)
    wait_until(lambda: len(hook.received) >= 2, 60, what="both end notices at the webhook")
    got = {m["path"]: m for m in hook.received}
    assert sorted(got) == ["/broken", "/ok"], hook.received  # and none from notify-quiet

    m = got["/ok"]
    assert (m["title"], m["type"]) == ("gpu_lab: notify-ok succeeded", "success")
    assert f"Run notify-ok ({ok.id}) succeeded after " in m["message"], m["message"]
    m = got["/broken"]
    assert (m["title"], m["type"]) == ("gpu_lab: notify-broken failed", "failure")
    assert "rank 1: ValueError: rank one broke on purpose at step 3 [user code]" in m["message"]
    assert broken.id in m["message"]

    # the outcome is counted in the run's log; the URLs (credentials) do not stay on disk
    wait_until(lambda: "notice sent to" in ok.logs(None, tail=None), 30, what="the log line")
    line = next(x for x in ok.logs(None, tail=None).splitlines() if "gpu_lab notify" in x)
    assert "notice sent to 1 of 2 URL(s); not sent: json://127.0.0.1:" in line, line
    for run in (ok, broken):
        assert not (RunFolder(run.run_dir).notify_file).exists()


def test_a_run_whose_supervisor_died_is_told_as_lost(hook, no_setting):
    """The recorder outlives a SIGKILLed supervisor, records 'lost', and starts the sender."""
    run = gpu_lab.launch(launch_fns.train_forever, num_processes=2, name="notify-lost",
                         notify=f"{hook.url}/lost")
    run.wait_for_step(3, timeout=120)
    os.kill(run.pid, signal.SIGKILL)
    assert run.wait(60) == "lost"
    wait_until(lambda: hook.received, 60, what="the lost run's notice")
    [m] = hook.received
    assert (m["title"], m["type"]) == ("gpu_lab: notify-lost lost", "warning")
    assert "its supervisor process ended without recording a final status" in m["message"]


def test_bad_urls_are_refused_before_anything_starts(monkeypatch, no_setting):
    before = len(Registry().list_runs())
    with pytest.raises(ValueError, match=r"launch: notify: 'slack://nope' is not a notification "
                                         r"URL apprise can use \(.*Slack.*json://host"):
        gpu_lab.launch(launch_fns.train_linear, notify="slack://nope")
    with pytest.raises(TypeError, match="launch: notify must be an apprise URL, a list of them"):
        gpu_lab.launch(launch_fns.train_linear, notify=3)
    monkeypatch.setenv(notify.ENV, "json://127.0.0.1:9/fine, foo://user:secret@bar")
    with pytest.raises(ValueError, match=r"GPU_LAB_NOTIFY: 'foo://user:\*\*\*@bar' is not"):
        gpu_lab.launch(launch_fns.train_linear)
    assert len(Registry().list_runs()) == before  # nothing was recorded, nothing started


def test_settings_env_then_file_and_launch_overrides(gpu_lab_home, monkeypatch):
    monkeypatch.delenv(notify.ENV, raising=False)
    assert notify.resolve(None) == []
    (gpu_lab_home / notify.FILE_NAME).write_text(
        "# where my runs report\njson://127.0.0.1:9/a   # the lab's hook\n\nntfy://my-topic\n")
    assert notify.resolve(None) == ["json://127.0.0.1:9/a", "ntfy://my-topic"]
    monkeypatch.setenv(notify.ENV, "json://127.0.0.1:9/b,json://127.0.0.1:9/c")
    assert notify.resolve(None) == ["json://127.0.0.1:9/b", "json://127.0.0.1:9/c"]
    assert notify.resolve("") == [] and notify.resolve([]) == []  # this run: none
    (gpu_lab_home / notify.FILE_NAME).write_text("json://127.0.0.1:9/a\nnot-a-url\n")
    monkeypatch.delenv(notify.ENV)
    with pytest.raises(ValueError, match=r"notify.txt: 'not-a-url' is not a notification URL"):
        notify.resolve(None)


def test_a_notice_never_says_running(tmp_path):
    """Where the registry missed the end (its write failed), the supervisor's status.json tells."""
    (tmp_path / "status.json").write_text(json.dumps(
        {"status": "stopped", "reason": "stopped by the user", "t": 130.0}))
    row = {"id": "r1", "name": "n", "status": "running", "started": 100.0, "ended": None,
           "run_dir": str(tmp_path), "host": "h"}
    title, body, kind = notify.compose(notify._ended(row))
    assert (title, kind) == ("gpu_lab: n stopped", "info")
    assert body == "Run n (r1) stopped after 0m30s on h.\nstopped by the user"
    (tmp_path / "status.json").unlink()
    assert notify.compose(notify._ended(row))[0] == "gpu_lab: n lost"


def test_a_silent_server_costs_the_timeout_and_is_counted():
    """A webhook that accepts the connection and never answers: deliver() gives up in time."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        url = f"json://127.0.0.1:{s.getsockname()[1]}/never"
        sent, failures = notify.deliver([url], "t", "b", "info", timeout=1.0)
    assert sent == 0 and failures == [f"{url}: no answer within 1 s"]


def test_headless_rank_sends_its_end_and_refuses_a_bad_setting(tmp_path, hook):
    env = job_env(tmp_path / "home")
    env[notify.ENV] = f"{hook.url}/headless"
    cmd = [sys.executable, "-m", "gpu_lab.rank.headless", "export_fns:raises", "--run-id",
           "notify-headless", "--name", "solo"]
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=180)
    assert out.returncode == 1, out.stderr[-3000:]
    assert "notice sent to 1 of 1 URL(s)" in out.stderr, out.stderr[-3000:]
    [m] = hook.received  # rank 0 sent before it exited
    assert (m["path"], m["title"], m["type"]) == ("/headless", "gpu_lab: solo failed", "failure")
    assert "rank 0: ValueError: broke on purpose" in m["message"], m["message"]

    env[notify.ENV] = "mailto://"
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "GPU_LAB_NOTIFY: 'mailto://' is not a notification URL apprise can use" in out.stderr
    assert Path(tmp_path / "home" / "registry.db").exists()
    assert Registry(tmp_path / "home" / "registry.db").get_run("notify-headless")["status"] == \
        "failed"  # the first run's row, untouched by the refused one
