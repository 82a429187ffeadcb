"""Root conftest: applies to tests/ and notebooks/ alike. Each test session gets its own
GPU_LAB_HOME (registry, run dirs) and quick mode, before any kernel is started, and its own
temporary folder (TMPDIR, inherited by every kernel, launcher and rank): GPU_LAB_HOME (with the
run folders), the tutorials' work folders of kernels that do not shut down cleanly, and pytest's
tmp_path all land in it, and it is removed when the session passes (kept, and named, when it
fails)."""
import os
import shutil
import tempfile

SESSION_TMP = tempfile.mkdtemp(prefix="gpu_lab_tests_")
os.environ["TMPDIR"] = SESSION_TMP
tempfile.tempdir = None  # tempfile.gettempdir() reads TMPDIR again
os.environ.setdefault("GPU_LAB_HOME", tempfile.mkdtemp(prefix="gpu_lab_test_home_"))
os.environ.setdefault("GPU_LAB_QUICK", "1")
# The host queue of the session's own runs, not the machine's; and more CPU slots than cores,
# since the suite runs runs side by side (kernels, tutorials). The queue's tests set their own.
os.environ.setdefault("GPU_LAB_CLAIMS_DIR", os.path.join(SESSION_TMP, "claims"))
os.environ.setdefault("GPU_LAB_CPU_SLOTS", "64")
os.environ.setdefault("PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD", "1")


def pytest_sessionfinish(session, exitstatus):
    if exitstatus == 0:
        shutil.rmtree(SESSION_TMP, ignore_errors=True)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if exitstatus != 0:
        terminalreporter.write_line(f"temporary files of this session kept in {SESSION_TMP}")
