"""A team's GPU server behind JupyterHub: a real hub (JupyterHub with PAM logins and its local
spawner, npm's configurable-http-proxy) serving two Unix users made for the test, each user's
server running this project's venv (`jupyterhub-singleuser`, the `hub` extra). In headless
Chromium each user logs in and sees the GPU Lab panel under /user/<name>/ with their own runs
only; their runs queue against each other for the host's slots, and the queued run's line names
the user who holds them; each end notice reaches its own user; one user's token gets 403 from the
other's server. The hub, the proxy, both servers and both users are gone afterwards."""
from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from test_browser import _show_panel, browser  # noqa: F401 - the fixture: headless Chromium
from test_host_queue import KERNEL
from test_record_private import User, users  # noqa: F401 - the fixture: two throwaway users

from gpu_lab.record.registry import Registry
from lab_utils import ROOT, free_port
from proc_utils import wait_until

pytestmark = pytest.mark.browser  # a hub, its proxy, two users' labs, in headless Chromium

VENV_BIN = Path(sys.executable).parent
CHP = ROOT / ".hub" / "node_modules" / ".bin" / "configurable-http-proxy"

CONFIG = '''
c = get_config()  # noqa: F821
c.JupyterHub.bind_url = "http://127.0.0.1:{port}"
c.JupyterHub.hub_bind_url = "http://127.0.0.1:{hub_port}"
c.ConfigurableHTTPProxy.api_url = "http://127.0.0.1:{api_port}"
c.ConfigurableHTTPProxy.command = [{chp!r}]
c.ConfigurableHTTPProxy.pid_file = {folder!r} + "/proxy.pid"
c.JupyterHub.db_url = "sqlite:///" + {folder!r} + "/hub.sqlite"
c.JupyterHub.cookie_secret_file = {folder!r} + "/cookie_secret"
c.JupyterHub.pid_file = {folder!r} + "/hub.pid"
c.JupyterHub.cleanup_servers = True
c.JupyterHub.authenticator_class = "pam"
c.PAMAuthenticator.open_sessions = False  # no login session manager in a container
c.Authenticator.allowed_users = {names!r}
# the project's venv, as docs/jupyterhub.md says: an interpreter every user can run
c.Spawner.cmd = [{singleuser!r}]
c.Spawner.default_url = "/lab"
c.Spawner.start_timeout = 240
c.Spawner.http_timeout = 240
c.Spawner.environment = dict({environment!r},
                             TMPDIR=lambda spawner: "/home/" + spawner.user.name + "/tmp")
c.JupyterHub.services = [{{"name": "gpu-lab-test", "api_token": {token!r}}}]
c.JupyterHub.load_roles = [{{"name": "gpu-lab-test", "services": ["gpu-lab-test"],
                            "scopes": ["admin:users", "admin:servers", "tokens",
                                       "access:servers"]}}]
'''


class Hub:
    def __init__(self, url: str, token: str, proc: subprocess.Popen, log: Path) -> None:
        self.url, self.token, self.proc, self.log = url, token, proc, log

    def api(self, method: str, path: str, body: dict | None = None, token: str | None = None,
            base: str = "hub/api/") -> tuple[int, object]:
        req = urllib.request.Request(self.url + base + path.lstrip("/"), method=method,
                                     data=None if body is None else json.dumps(body).encode(),
                                     headers={"Authorization": f"token {token or self.token}"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                data = r.read()
                return r.status, json.loads(data) if data else None
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode(errors="replace")
        except (urllib.error.URLError, ConnectionError) as e:  # not listening (yet)
            return 0, str(e)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


@pytest.fixture(scope="module")
def hub(users):  # noqa: F811
    try:
        import jupyterhub  # noqa: F401
    except ImportError:
        pytest.fail("jupyterhub is missing: `make test` installs it (the hub extra)")
    if not CHP.exists() or not (VENV_BIN / "jupyterhub-singleuser").exists():
        pytest.fail(f"{CHP} or jupyterhub-singleuser is missing: `make test` installs both")
    owner, other = users
    passwords = {u.name: secrets.token_urlsafe(12) for u in users}
    subprocess.run(["chpasswd"], input="".join(f"{n}:{p}\n" for n, p in passwords.items()),
                   text=True, check=True)
    folder = Path(tempfile.mkdtemp(prefix="hub-"))  # the session's own temp folder: root's
    # the labs' page config (no news toast), readable by both users
    shared = Path(tempfile.mkdtemp(prefix="gpu_lab-hub-", dir="/tmp"))
    (shared / "labconfig").mkdir()
    (shared / "labconfig" / "page_config.json").write_text(json.dumps(
        {"disabledExtensions": {"@jupyterlab/apputils-extension:announcements": True}}))
    for p in (shared, shared / "labconfig", shared / "labconfig" / "page_config.json"):
        os.chmod(p, 0o755 if p.is_dir() else 0o644)
    for u in users:
        (u.home / "tmp").mkdir(exist_ok=True)
        os.chown(u.home / "tmp", u.uid, u.gid)
    port, token = free_port(), secrets.token_hex(16)
    environment = {"GPU_LAB_CLAIMS_DIR": str(owner.claims), "GPU_LAB_CPU_SLOTS": "2",
                   "GPU_LAB_QUICK": "1", "OMP_NUM_THREADS": "1", "JUPYTER_CONFIG_DIR": str(shared),
                   "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"}
    (folder / "jupyterhub_config.py").write_text(CONFIG.format(
        port=port, hub_port=free_port(), api_port=free_port(), chp=str(CHP), folder=str(folder),
        names={u.name for u in users}, singleuser=str(VENV_BIN / "jupyterhub-singleuser"),
        environment=environment, token=token))
    log = folder / "hub.log"
    env = {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}"}
    with open(log, "w") as out:
        proc = subprocess.Popen([str(VENV_BIN / "jupyterhub"), "-f", "jupyterhub_config.py"],
                                cwd=folder, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    h = Hub(f"http://127.0.0.1:{port}/", token, proc, log)
    h.passwords = passwords
    try:
        wait_until(lambda: proc.poll() is not None or h.api("GET", "")[0] == 200, 120,
                   what="the hub to answer")
        assert proc.poll() is None, h.log_text()[-3000:]
        for u in users:  # each user's server, started as the hub's admin would
            code, body = h.api("POST", f"users/{u.name}/server")
            assert code in (201, 202), (code, body, h.log_text()[-3000:])
        for u in users:
            wait_until(lambda u=u: _ready(h, u.name), 240, what=f"{u.name}'s server",
                       hint=lambda: h.log_text()[-3000:])
        yield h
    finally:
        _stop(proc)
        for u in users:
            subprocess.run(["passwd", "-d", u.name], capture_output=True)
        shutil.rmtree(shared, ignore_errors=True)
        shutil.rmtree(folder, ignore_errors=True)


def _ready(h: Hub, name: str) -> bool:
    code, user = h.api("GET", f"users/{name}")
    return code == 200 and bool(user.get("servers", {}).get("", {}).get("ready"))


def _stop(proc: subprocess.Popen) -> None:
    """The hub stops the users' servers and its proxy on SIGTERM; whatever is left of its
    process group goes too."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)


def _login(browser, hub: Hub, user: User):  # noqa: F811
    """A page of `user`'s lab, logged in through the hub's form, the GPU Lab panel shown."""
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    page.set_default_timeout(90_000)
    page.goto(hub.url + "hub/login")
    page.fill("#username_input", user.name)
    page.fill("#password_input", hub.passwords[user.name])
    page.click("#login_submit")
    page.wait_for_url(f"**/user/{user.name}/lab**", timeout=120_000)
    page.locator("#jp-main-dock-panel").wait_for()
    _show_panel(page)
    return page


def _runs(hub: Hub, owner: str, token: str) -> tuple[int, object]:
    """The GPU Lab runs endpoint of `owner`'s server, asked with `token`."""
    return hub.api("GET", f"user/{owner}/gpu-lab/api/runs", token=token, base="")


def _cards(page) -> dict[str, str]:
    return page.evaluate("""() => Object.fromEntries([...document.querySelectorAll(
        '#gpu-lab-panel .jp-GpuLab-run')].map(c => [c.querySelector('.jp-GpuLab-run-name')
        .innerText, c.querySelector('.jp-GpuLab-run-status').innerText]))""")


def test_two_users_behind_a_hub_see_their_own_runs_queue_and_notices(hub, users, browser):  # noqa: F811
    owner, other = users
    tokens = {}
    for u in users:
        code, body = hub.api("POST", f"users/{u.name}/tokens", {
            "note": "gpu_lab test", "scopes": [f"access:servers!user={u.name}"]})
        assert code in (200, 201), (code, body)
        tokens[u.name] = body["token"]
    pages = {u.name: _login(browser, hub, u) for u in users}
    kernels = []
    try:
        # the other user's run holds both slots until `go` exists; the owner's waits for them
        go = other.home / "go"
        theirs = other.popen([sys.executable, "-c", KERNEL, json.dumps(
            [{"name": "theirs", "go": str(go)}])], other.env(other.home / ".gpu_lab"),
            stdout=subprocess.PIPE, text=True)
        kernels.append(theirs)
        (their_id,) = json.loads(theirs.stdout.readline())
        their_reg = Registry(other.home / ".gpu_lab" / "registry.db")
        wait_until(lambda: (their_reg.get_run(their_id) or {}).get("status") == "running", 90,
                   what="their run running")
        mine = owner.popen([sys.executable, "-c", KERNEL, json.dumps([{"name": "mine"}])],
                           owner.env(owner.home / ".gpu_lab"), stdout=subprocess.PIPE, text=True)
        kernels.append(mine)
        (my_id,) = json.loads(mine.stdout.readline())
        my_reg = Registry(owner.home / ".gpu_lab" / "registry.db")
        wait_until(lambda: (my_reg.get_run(my_id) or {}).get("status") == "queued", 90,
                   what="my run queued")

        # the REST API under each user's base URL: their own runs only; the other's token: 403
        code, body = _runs(hub, owner.name, tokens[owner.name])
        assert code == 200, body
        assert [(r["name"], r["status"], r.get("held_by")) for r in body["runs"]] == [
            ("mine", "queued", [other.name])]
        code, body = _runs(hub, other.name, tokens[other.name])
        assert code == 200 and [r["name"] for r in body["runs"]] == ["theirs"], body
        code, body = _runs(hub, owner.name, tokens[other.name])
        assert code == 403, (code, body)

        # each lab's panel, reached under /user/<name>/: its user's run, and who holds the slots
        wait_until(lambda: _cards(pages[owner.name]) == {
            "mine": f"queued · 1st · held by {other.name}"}, 60,
            what="the owner's panel", hint=lambda: _cards(pages[owner.name]))
        wait_until(lambda: _cards(pages[other.name]) == {"theirs": "running"}, 60,
                   what="the other's panel", hint=lambda: _cards(pages[other.name]))

        # their run ends, then mine runs: each end notice in its own user's lab only
        go.write_text("")
        os.chown(go, other.uid, other.gid)
        pages[other.name].locator(".Toastify__toast", has_text="Run theirs succeeded").wait_for()
        pages[owner.name].locator(".Toastify__toast", has_text="Run mine succeeded").wait_for()
        assert pages[owner.name].locator(".Toastify__toast", has_text="theirs").count() == 0
        assert pages[other.name].locator(".Toastify__toast", has_text="Run mine").count() == 0
        assert json.loads(mine.stdout.readline()) == ["succeeded"]
        assert json.loads(theirs.stdout.readline()) == ["succeeded"]
        a, b = their_reg.get_run(their_id), my_reg.get_run(my_id)
        assert a["ended"] <= b["started"]  # one after the other, never side by side
    finally:
        for k in kernels:
            if k.poll() is None:
                k.kill()
            k.wait(30)
        for p in pages.values():
            p.close()
