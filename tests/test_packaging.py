"""Packaging: `python -m build` from a clean copy of the sources (no node_modules, no prebuilt
labextension) runs the hatch-jupyter-builder hook, and the wheel it makes installs into an isolated
venv where `jupyter labextension list` and `jupyter server extension list` both report gpu_lab OK.

The isolated venv gets the wheel with --no-deps and sees the project venv's third-party packages
through a .pth line (nothing is downloaded); the project venv's own gpu_lab (an editable install)
and its share/ and etc/ directories stay invisible to it.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.packaging,  # builds the wheel, or the lab from a clone
              pytest.mark.timeout(900)]


def _clean_copy(dst: Path) -> Path:
    """What a fresh clone holds: tracked files plus untracked-but-not-ignored ones."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         cwd=ROOT, check=True, capture_output=True).stdout.decode()
    for rel in filter(None, out.split("\0")):
        src = ROOT / rel
        if src.is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / rel)
    assert not (dst / "extension" / "node_modules").exists()
    assert not (dst / "gpu_lab" / "labextension").exists()
    return dst


def _run(cmd, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    assert r.returncode == 0, f"{cmd} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("pkg")
    src = _clean_copy(tmp / "src")
    env = dict(os.environ, npm_config_prefer_offline="true", npm_config_fund="false",
               npm_config_audit="false")
    # --no-isolation: build with the project venv's hatchling + hatch-jupyter-builder (offline);
    # the npm install + TypeScript + rspack build of extension/ still happens from scratch.
    r = _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(tmp / "dist"),
              str(src)], env=env, timeout=840)
    wheels = list((tmp / "dist").glob("gpu_lab-*.whl"))
    sdists = list((tmp / "dist").glob("gpu_lab-*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1, r.stdout[-2000:]
    return {"tmp": tmp, "wheel": wheels[0], "sdist": sdists[0], "log": r.stdout + r.stderr}


def test_wheel_contains_prebuilt_labextension_and_server_config(built):
    names = zipfile.ZipFile(built["wheel"]).namelist()
    data = "gpu_lab-0.1.0.data/data/"
    ext = data + "share/jupyter/labextensions/gpu_lab/"
    assert ext + "package.json" in names
    assert ext + "install.json" in names
    assert any(re.fullmatch(re.escape(ext) + r"static/remoteEntry\.[0-9a-f]+\.js", n) for n in names)
    assert data + "etc/jupyter/jupyter_server_config.d/gpu_lab.json" in names
    assert "gpu_lab/server/handlers.py" in names
    config = json.loads(zipfile.ZipFile(built["wheel"]).read(
        data + "etc/jupyter/jupyter_server_config.d/gpu_lab.json"))
    assert config == {"ServerApp": {"jpserver_extensions": {"gpu_lab": True}}}
    # no node_modules or TypeScript build leftovers in the sdist, but the prebuilt extension
    import tarfile

    members = tarfile.open(built["sdist"]).getnames()
    assert not [m for m in members if "node_modules" in m]
    assert any(m.endswith("gpu_lab/labextension/package.json") for m in members)


def test_extension_and_python_versions_agree():
    py = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    js = json.loads((ROOT / "extension" / "package.json").read_text())["version"]
    import gpu_lab

    assert py == js == gpu_lab.__version__


def test_wheel_installs_into_isolated_venv_with_both_extensions_ok(built):
    venv = built["tmp"] / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    vpy = venv / "bin" / "python"
    site = Path(_run([str(vpy), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
                .stdout.strip())
    # third-party packages from the project venv, appended after the venv's own site-packages
    (site / "zz_project_venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run([sys.executable, "-m", "pip", "--python", str(vpy), "install", "--no-deps", "--no-index",
          "--quiet", str(built["wheel"])])
    home = built["tmp"] / "home"
    env = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": str(home),
           "JUPYTER_CONFIG_DIR": str(home / "cfg"), "JUPYTER_DATA_DIR": str(home / "data"),
           "JUPYTER_PLATFORM_DIRS": "1"}
    cwd = built["tmp"]  # not the repository: its gpu_lab/ must not shadow the installed one
    where = _run([str(vpy), "-c", "import gpu_lab, sys; print(gpu_lab.__file__, sys.prefix)"],
                 env=env, cwd=cwd).stdout
    assert str(venv) in where.split()[0], where

    labx = _run([str(vpy), "-m", "jupyterlab.labextensions", "list"], env=env, cwd=cwd)
    out = _strip_ansi(labx.stdout + labx.stderr)
    assert re.search(r"gpu_lab v0\.1\.0 enabled OK \(python, gpu_lab\)", out), out
    assert f"{venv}/share/jupyter/labextensions" in out, out

    srvx = _run([str(vpy), "-m", "jupyter_server.extension.serverextension", "list"], env=env,
                cwd=cwd)
    out = _strip_ansi(srvx.stdout + srvx.stderr)
    assert re.search(r"gpu_lab enabled", out), out
    assert re.search(r"gpu_lab 0\.1\.0 OK", out), out
    assert f"{venv}/etc/jupyter" in out, out


def _strip_ansi(s: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", s)
