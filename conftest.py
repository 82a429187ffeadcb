"""Root conftest: applies to tests/ and notebooks/ alike. Each test session gets its own
GPU_LAB_HOME (registry, run dirs) and quick mode, before any kernel is started, and its own
temporary folder (TMPDIR, inherited by every kernel, launcher and rank): GPU_LAB_HOME (with the
run folders), the tutorials' work folders of kernels that do not shut down cleanly, and pytest's
tmp_path all land in it, and it is removed when the session passes (kept, and named, when it
fails)."""
import glob
import os
import pwd
import shutil
import subprocess
import tempfile


def _netns() -> set[str]:
    try:
        out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    except OSError:
        return set()
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _outside() -> tuple[set[str], set[str], set[str]]:
    """What the tests could leave outside their own temporary folders: gpu_lab folders in /tmp
    (another session's own temporary folder aside), Unix users, network namespaces."""
    return ({p for p in glob.glob("/tmp/gpu_lab*") + glob.glob("/tmp/gpulab*")
             if not p.startswith("/tmp/gpu_lab_tests_")},
            {u.pw_name for u in pwd.getpwall()}, _netns())


# Under pytest-xdist (make test) each worker is a session of its own inside the controller's
# folder, with a registry of its own; only the controller, which outlives them, checks leftovers.
WORKER = os.environ.get("PYTEST_XDIST_WORKER")
_BEFORE = _outside()
if WORKER is None:
    SESSION_TMP = tempfile.mkdtemp(prefix="gpu_lab_tests_")
else:  # a short name: Unix socket paths under it (multiprocessing's) must fit in 107 bytes
    SESSION_TMP = os.path.join(tempfile.gettempdir(), WORKER)
    os.makedirs(SESSION_TMP, mode=0o700)
os.environ["TMPDIR"] = SESSION_TMP
tempfile.tempdir = None  # tempfile.gettempdir() reads TMPDIR again
# a home of the tests' own (the controller's, inherited by a worker), not one the user gave
if os.environ.get("GPU_LAB_HOME") in (None, os.environ.get("GPU_LAB_TESTS_HOME")):
    os.environ["GPU_LAB_HOME"] = os.environ["GPU_LAB_TESTS_HOME"] = tempfile.mkdtemp(
        prefix="gpu_lab_test_home_")
os.environ.setdefault("GPU_LAB_QUICK", "1")
# an HF_HOME of the tests' own: a developer's `accelerate config` (its default file lives there)
# must not change what the tests and notebooks launch
os.environ["HF_HOME"] = os.path.join(SESSION_TMP, "hf_home")
# The host queue of the session's own runs, not the machine's; and more CPU slots than cores,
# since the suite runs runs side by side (kernels, tutorials). The queue's tests set their own.
os.environ.setdefault("GPU_LAB_CLAIMS_DIR", os.path.join(SESSION_TMP, "claims"))
os.environ.setdefault("GPU_LAB_CPU_SLOTS", "64")
os.environ.setdefault("PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD", "1")


# Files of the heavier tiers run first (make test passes --no-loadscope-reorder, so xdist keeps
# this order): a long notebook started last would leave the other worker idle at the end.
_FIRST = ("notebooks", "slurm", "browser", "packaging", "slow")
NOTEBOOK_CELL_TIMEOUT = 600  # seconds; pyproject's timeout (300) for every other test


def pytest_collection_modifyitems(config, items):
    import pytest

    for item in items:  # nbval's cells: the notebooks tier
        if str(getattr(item, "fspath", "")).endswith(".ipynb"):
            item.add_marker(pytest.mark.notebooks)
            # a cell that waits for a sweep bounds its own wait (tutorial 07: four times its
            # full-mode estimate); 07's took 231 s of the suite's 300 s under make test's load
            item.add_marker(pytest.mark.timeout(NOTEBOOK_CELL_TIMEOUT))
    weight: dict[str, int] = {}
    for item in items:
        tier = next((i for i, m in enumerate(_FIRST) if item.get_closest_marker(m)), len(_FIRST))
        path = str(item.fspath)
        weight[path] = min(weight.get(path, tier), tier)
    items.sort(key=lambda item: weight[str(item.fspath)])  # stable: a file's order is kept


_LEFT: list[str] = []


def pytest_sessionfinish(session, exitstatus):
    if WORKER is not None:  # the controller checks, and removes the folder this one is in
        return
    after = _outside()
    for what, before, now in zip(("in /tmp", "Unix user", "network namespace"), _BEFORE, after):
        _LEFT.extend(f"{what}: {x}" for x in sorted(now - before))
    if _LEFT:  # a test that cleans up after itself leaves none of these behind
        session.exitstatus = 1
    elif session.exitstatus == 0:
        shutil.rmtree(SESSION_TMP, ignore_errors=True)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    for line in _LEFT:
        terminalreporter.write_line(f"left behind by the tests ({line}): remove it, and fix the "
                                    "test that made it")
    if exitstatus != 0 or _LEFT:
        terminalreporter.write_line(f"temporary files of this session kept in {SESSION_TMP}")
