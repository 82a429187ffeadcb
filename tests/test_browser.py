"""The lab extension in a real browser: JupyterLab on 127.0.0.1 with a token, driven by Playwright
through Debian's Chromium (never a downloaded browser).

1. the GPU Lab side panel shows host stats that update;
2. tutorial 04's launch cell (tagged "launch") starts a 2-rank run whose loss appears in the
   notebook's plot;
3. the run appears in the side panel; its Stop button stops it (status "stopped" in the panel and
   in the registry, the supervisor's process tree gone).

Screenshots go to test-artifacts/browser-*.png.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import nbformat
import psutil
import pytest

from lab_utils import ARTIFACTS, ROOT, jupyter_lab
from playwright.sync_api import TimeoutError as PlaywrightTimeout
from proc_utils import wait_until

CHROMIUM = "/usr/bin/chromium"
TUTORIAL = "04_distributed_training.ipynb"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]

pytestmark = pytest.mark.timeout(600)


def _launch_cell_index(path: Path) -> int:
    nb = nbformat.read(path, as_version=4)
    tagged = [i for i, c in enumerate(nb.cells) if "launch" in c.metadata.get("tags", [])]
    assert len(tagged) == 1, f"{path.name}: expected exactly one cell tagged 'launch', got {tagged}"
    return tagged[0]


@pytest.fixture
def notebooks(tmp_path):
    """A scratch copy of notebooks/: the test must not write outputs into the tutorials."""
    dst = tmp_path / "notebooks"
    shutil.copytree(ROOT / "notebooks", dst, ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    return dst


@pytest.fixture
def browser():
    if not os.path.exists(CHROMIUM):
        pytest.fail(f"{CHROMIUM} is missing: `make test` installs it (apt-get install chromium)")
    os.environ.setdefault("PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD", "1")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            yield b
        finally:
            b.close()


def _shot(page, name: str) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"browser-{name}.png"))


def test_side_panel_tutorial_launch_and_stop(tmp_path, notebooks, browser):
    launch_idx = _launch_cell_index(notebooks / TUTORIAL)
    # the run must outlive the clicks below: the tutorial honours GPU_LAB_TUTORIAL_STEPS
    env = {"GPU_LAB_TUTORIAL_STEPS": "100000", "GPU_LAB_QUICK": "1"}
    with jupyter_lab(tmp_path, notebooks, env=env, name="browser-lab") as lab:
        page = browser.new_page(viewport={"width": 1500, "height": 950})
        page.set_default_timeout(60_000)
        console: list[str] = []
        page.on("console", lambda m: console.append(f"{m.type}: {m.text}"))
        page.on("pageerror", lambda e: console.append(f"pageerror: {e}"))
        try:
            _run_scenario(page, lab, launch_idx)
        except BaseException:
            _shot(page, "failure")
            (ARTIFACTS / "browser-console.log").write_text("\n".join(console))
            raise
        finally:
            page.close()
        runs = _registry_runs(lab.gpu_lab_home)
        assert [r["status"] for r in runs if r["name"] == "tutorial-04"] == ["stopped"]
        assert "gpu_lab server extension loaded" in lab.log_text()


def _registry_runs(home: Path) -> list[dict]:
    from gpu_lab.registry import Registry

    return Registry(home / "registry.db").list_runs()


def _run_scenario(page, lab, launch_idx: int) -> None:  # noqa: C901 (one story, in order)
    page.goto(f"{lab.url}lab?token={lab.token}")
    page.wait_for_selector("#jp-main-dock-panel", state="visible", timeout=120_000)

    # 1. the side panel, with host stats that update ------------------------------------------
    _show_panel(page)
    panel = page.locator("#gpu-lab-panel")
    panel.wait_for(state="visible")
    page.wait_for_function(
        "() => Number(document.querySelector('#gpu-lab-panel .jp-GpuLab-sample-time')"
        "?.dataset.samples || 0) >= 3", timeout=60_000)
    cpu = panel.locator('[data-stat="host-cpu"] .jp-GpuLab-stat-value').inner_text()
    assert re.match(r"^\d+% of \d+ cores$", cpu), cpu
    assert re.search(r"GiB|MiB", panel.locator('[data-stat="host-ram"] .jp-GpuLab-stat-value')
                     .inner_text())
    assert "No GPU visible" in panel.locator('[data-section="gpus"]').inner_text()
    status_item = page.locator(".jp-GpuLab-status")
    assert status_item.inner_text().startswith("CPU "), status_item.inner_text()
    first = panel.locator(".jp-GpuLab-sample-time").get_attribute("data-samples")
    page.wait_for_function(
        f"() => Number(document.querySelector('#gpu-lab-panel .jp-GpuLab-sample-time')"
        f".dataset.samples) > {int(first)}")
    _shot(page, "1-side-panel-host-stats")

    # 2. open tutorial 04 from the file browser and run up to its launch cell -----------------
    page.click('li.lm-TabBar-tab[data-id="filebrowser"]')
    page.dblclick(f'.jp-DirListing-item[title^="Name: {TUTORIAL}"]')
    nb = page.locator(".jp-NotebookPanel:visible")
    nb.wait_for()
    # the kernel is connected once the status bar reads "<kernel> | Idle"
    page.locator("#jp-main-statusbar", has_text="| Idle").wait_for(timeout=120_000)
    cells = nb.locator(".jp-Notebook .jp-Cell")
    launch_cell = cells.nth(launch_idx)
    prompt = launch_cell.locator(".jp-InputArea-prompt")
    # the tutorial is stored with outputs (plots included): clear them, so that what the test
    # sees below is what this run draws
    page.click(".lm-MenuBar-itemLabel:text-is('Edit')")
    page.click(".lm-Menu-itemLabel:text-is('Clear Outputs of All Cells')")
    page.wait_for_function("(el) => !/\\d/.test(el.innerText)", arg=prompt.element_handle())
    for attempt in range(2):
        cells.nth(0).click()
        page.keyboard.press("Escape")  # command mode
        for _ in range(launch_idx + 1):
            page.keyboard.press("Shift+Enter")
        try:  # "[*]:" queued/running, "[3]:" done
            page.wait_for_function(
                "(el) => /\\[(\\*|\\d+)\\]/.test(el.innerText)", arg=prompt.element_handle(),
                timeout=30_000)
            break
        except PlaywrightTimeout:
            if attempt:
                raise
    # the loss trace: LivePlot's traces carry meta.metric; plotly keeps a figure's data on its
    # graph div. Wait for a loss trace with points, drawn (its legend entry "rank 0" rendered).
    page.wait_for_function(
        """(idx) => {
            const cell = document.querySelectorAll(
                '.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Cell')[idx];
            if (!cell) return false;
            for (const gd of cell.querySelectorAll('.js-plotly-plot')) {
                const loss = (gd.data || []).filter(t => t.meta && t.meta.metric === 'loss');
                const drawn = [...gd.querySelectorAll('.legendtext')]
                    .some(t => t.textContent === 'rank 0');
                if (drawn && loss.some(t => (t.y || []).length >= 5)) return true;
            }
            return false;
        }""", arg=launch_idx, timeout=240_000)
    loss_points = launch_cell.evaluate(
        """(cell) => Math.max(...[...cell.querySelectorAll('.js-plotly-plot')].flatMap(
               gd => (gd.data || []).filter(t => t.meta && t.meta.metric === 'loss')
                                    .map(t => (t.y || []).length)))""")
    assert loss_points >= 5, loss_points
    launch_cell.scroll_into_view_if_needed()

    # 3. the run in the side panel, running ------------------------------------------------------
    _show_panel(page)
    row = page.locator("#gpu-lab-panel .jp-GpuLab-run", has_text="tutorial-04")
    row.wait_for()
    page.wait_for_function(
        """() => [...document.querySelectorAll('#gpu-lab-panel .jp-GpuLab-run')]
                 .some(r => r.innerText.includes('tutorial-04') && r.dataset.status === 'running'
                            && r.querySelector('.jp-GpuLab-run-step').innerText !== '–')""",
        timeout=60_000)
    run_id = row.get_attribute("data-run-id")
    run = next(r for r in _registry_runs(lab.gpu_lab_home) if r["id"] == run_id)
    assert run["status"] == "running" and run["pid"]
    supervisor = psutil.Process(run["pid"])
    tree = [supervisor] + supervisor.children(recursive=True)
    assert len(tree) >= 3, f"expected a supervisor and 2 ranks, got {[p.name() for p in tree]}"
    _shot(page, "2-notebook-loss-plot-and-run-running")

    # 4. Stop it from the panel ------------------------------------------------------------------
    row.locator("button.jp-GpuLab-stop").click()
    page.wait_for_function(
        f"""() => document.querySelector('#gpu-lab-panel .jp-GpuLab-run[data-run-id="{run_id}"]')
                 ?.dataset.status === 'stopped'""", timeout=60_000)
    assert row.locator(".jp-GpuLab-run-status").inner_text() == "stopped"
    assert not row.locator("button.jp-GpuLab-stop").is_visible()  # only active runs can stop
    wait_until(lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE
                               for p in tree if _exists(p)), 30, what="the run's processes to end")
    _shot(page, "3-run-stopped")

    # 5. the run's dashboard command (the panel's Dashboard button) -----------------------------
    row.locator("button.jp-GpuLab-open-dashboard").click()
    dash = page.locator(".jp-GpuLab-dashboard:visible")
    dash.locator('.jp-GpuLab-lineChart[data-metric="loss"]').wait_for()
    points = int(dash.locator('.jp-GpuLab-lineChart[data-metric="loss"]').get_attribute("data-points"))
    assert points >= 5, points
    assert dash.locator(".jp-GpuLab-dashboard-meta").get_attribute("data-status") == "stopped"
    _shot(page, "4-run-dashboard")

    # 6. the tutorials-index command (the panel's Tutorials button) ------------------------------
    _show_panel(page)
    page.locator("#gpu-lab-panel button.jp-GpuLab-link", has_text="Tutorials").click()
    if (Path(lab.root_dir) / "00_overview.ipynb").exists():
        page.locator(".lm-TabBar-tab", has_text="00_overview.ipynb").wait_for()
    else:  # before the tutorials exist: the command says what is missing instead of failing
        page.locator(".jp-toast-container", has_text="no tutorials index").wait_for()
    (ARTIFACTS / "browser-run.json").write_text(json.dumps(
        {"run_id": run_id, "status": "stopped", "processes": len(tree),
         "notebook_loss_points": loss_points, "dashboard_loss_points": points}))


def _show_panel(page) -> None:
    """Show the GPU Lab side panel (clicking the tab of an open side panel would collapse it)."""
    if not page.locator("#gpu-lab-panel").is_visible():
        page.click('li.lm-TabBar-tab[data-id="gpu-lab-panel"]')
    page.locator("#gpu-lab-panel").wait_for(state="visible")


def _exists(p: psutil.Process) -> bool:
    try:
        return p.is_running()
    except psutil.Error:
        return False
