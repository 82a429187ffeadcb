"""Root conftest: applies to tests/ and notebooks/ alike. Each test session gets its own
GPU_LAB_HOME (registry, run dirs) and quick mode, before any kernel is started."""
import os
import tempfile

os.environ.setdefault("GPU_LAB_HOME", tempfile.mkdtemp(prefix="gpu_lab_test_home_"))
os.environ.setdefault("GPU_LAB_QUICK", "1")
os.environ.setdefault("PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD", "1")
