"""The lab extension in a real browser: JupyterLab on 127.0.0.1 with a token, driven by Playwright
through Debian's Chromium (never a downloaded browser).

1. the GPU Lab side panel shows host stats that update;
2. tutorial 04's launch cell (tagged "launch") starts a 2-rank run whose loss appears in the
   notebook's plot;
3. the run appears in the side panel; its Stop button stops it (status "stopped" in the panel and
   in the registry, the supervisor's process tree gone), and JupyterLab's notification says so;
4. (the run view test) the notifications of a stopped and a failed run, whose View action opens
   the failed run's view;
5. (the sweep test) a real sweep's trials grouped under it in the side panel, with their statuses,
   its progress and best value, and its Compare;
6. (the restart test) a live run view, a live comparison and the side panel while the server is
   stopped and started again: they say so, and go on, with every step.

Screenshots go to test-artifacts/browser-*.png.
"""
from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import subprocess
import time
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

pytestmark = [pytest.mark.browser,  # JupyterLab in headless Chromium
              pytest.mark.timeout(600)]


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


@contextlib.contextmanager
def _page(browser, viewport: dict, prefix: str):
    """A page whose console is kept; on failure, a screenshot and the console go to
    test-artifacts/browser-<prefix>failure.png and browser-<prefix>console.log."""
    page = browser.new_page(viewport=viewport)
    page.set_default_timeout(60_000)
    console: list[str] = []
    page.on("console", lambda m: console.append(f"{m.type}: {m.text}"))
    page.on("pageerror", lambda e: console.append(f"pageerror: {e}"))
    try:
        yield page, console
    except BaseException:
        _shot(page, f"{prefix}failure")
        (ARTIFACTS / f"browser-{prefix}console.log").write_text("\n".join(console))
        raise
    finally:
        page.close()


def page_errors(console: list[str]) -> list[str]:
    """The page's uncaught errors: every one, a failed fetch included (the extension's requests
    catch and retry theirs: test_live_views_survive_a_server_restart)."""
    return [c for c in console if c.startswith("pageerror")]


def _shot(page, name: str) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"browser-{name}.png"))


def test_side_panel_tutorial_launch_and_stop(tmp_path, notebooks, browser):
    launch_idx = _launch_cell_index(notebooks / TUTORIAL)
    # the run must outlive the clicks below: the tutorial honours GPU_LAB_TUTORIAL_STEPS
    env = {"GPU_LAB_TUTORIAL_STEPS": "100000", "GPU_LAB_QUICK": "1"}
    with jupyter_lab(tmp_path, notebooks, env=env, name="browser-lab") as lab:
        with _page(browser, {"width": 1500, "height": 950}, "") as (page, _):
            _run_scenario(page, lab, launch_idx)
        runs = _registry_runs(lab.gpu_lab_home)
        assert [r["status"] for r in runs if r["name"] == "tutorial-04"] == ["stopped"]
        assert "gpu_lab server extension loaded" in lab.log_text()


def _registry_runs(home: Path) -> list[dict]:
    from gpu_lab.record.registry import Registry

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
    # one notification tells the end (the Stop button's own message only tells "stopping")
    page.locator(".Toastify__toast", has_text="Run tutorial-04 stopped after").wait_for()
    assert page.locator(".Toastify__toast", has_text="tutorial-04").count() == 1
    wait_until(lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE
                               for p in tree if _exists(p)), 30, what="the run's processes to end")
    _shot(page, "3-run-stopped")

    # 5. the run's view (the panel's View button), of a stopped run -----------------------------
    row.locator("button.jp-GpuLab-open-dashboard").click()
    view = page.locator(".jp-GpuLab-runview:visible")
    view.locator('.jp-GpuLab-chart[data-metric="loss"] canvas').wait_for()
    points = _series_points(view, "loss")["rank 0"]
    assert points >= 5, points
    assert view.get_attribute("data-status") == "stopped"
    _shot(page, "4-run-view-stopped")

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


def open_run_view(page, run_id: str):
    """Open a run's view from its line in the side panel; the view's locator, once shown."""
    _show_panel(page)
    card = page.locator(f'#gpu-lab-panel .jp-GpuLab-run[data-run-id="{run_id}"]')
    card.wait_for()
    card.locator("button.jp-GpuLab-open-dashboard").click()
    view = page.locator(".jp-GpuLab-runview:visible")
    view.wait_for()
    return view


def _exists(p: psutil.Process) -> bool:
    try:
        return p.is_running()
    except psutil.Error:
        return False


def _series_points(scope, metric: str, attr: str = "data-metric") -> dict[str, int]:
    """{series label: points drawn} of a run view's chart (SeriesChart keeps it on its node)."""
    raw = scope.locator(f'.jp-GpuLab-chart[{attr}="{metric}"]').get_attribute("data-series")
    return json.loads(raw or "{}")


# --- the run view: live charts, logs, Checkpoint now, Stop, Resume; the comparison ---------------
# A notebook of the test's own: 2-rank runs of fit() on synthetic images, whose ranks print a line
# per step (the log tail) and pause a little (so the long one lasts until Stop); the short one has
# another lr and max_steps, which the comparison's legend must name; the third fails on rank 1.
VIEW_NOTEBOOK_CELLS = [
    '''import os
import time
import gpu_lab
from accelerate.utils import set_seed
from gpu_lab.models import build
from gpu_lab.train import Callback, fit
from gpu_lab.train.classifier import datasets


class Talk(Callback):
    """A line per logged step in the rank's log, and a pause so that the run lasts."""

    def __init__(self, pace):
        self.pace = pace

    def on_log(self, state, metrics):
        print(f"step {state.step} loss {metrics['loss']:.4f}", flush=True)
        time.sleep(self.pace)


class Break(Callback):
    """Rank 1 fails at step 3: what the view's triage box is for."""

    def on_step_end(self, state):
        if state.step == 3 and not state.is_main_process:
            raise ValueError("rank one broke on purpose at step 3")


def train(config, pace=0.0, fail=False):
    set_seed(config.seed)
    model = build(config.model, config.num_classes, config.image_size)
    data, _ = datasets(config)
    return fit(model, data, config, callbacks=[Talk(pace)] + ([Break()] if fail else []))


cfg = gpu_lab.TrainConfig(model="tiny_cnn", image_size=16, batch_size=8, max_steps=100000,
                          lr=3e-3, num_workers=0, num_processes=2, tensorboard=False,
                          output_dir=os.path.abspath("view-runs"))
long_run = gpu_lab.launch(train, cfg, 0.15, name="view-long")
short_run = gpu_lab.launch(train, cfg.replace(lr=1e-3, max_steps=15), name="view-short")
broken_run = gpu_lab.launch(train, cfg.replace(max_steps=50), 0.0, True, name="view-broken")
# a user's own script, written the accelerate way (it never imports gpu_lab)
script_run = gpu_lab.launch(OWN_SCRIPT, "--lr", "0.05", "--steps", "30", "--out",
                            os.path.abspath("own-script"), num_processes=2, name="view-script")
print("launched", long_run.id, short_run.id, broken_run.id, script_run.id)''',
]


def _write_view_notebook(root: Path) -> Path:
    nb = nbformat.v4.new_notebook()
    own = repr(str(Path(__file__).parent / "own_code" / "train_accel.py"))
    nb.cells = [nbformat.v4.new_code_cell(src.replace("OWN_SCRIPT", own))
                for src in VIEW_NOTEBOOK_CELLS]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    path = root / "view_runs.ipynb"
    nbformat.write(nb, path)
    return path


def test_run_view_live_controls_and_comparison(tmp_path, browser):
    root = tmp_path / "lab-root"
    root.mkdir()
    _write_view_notebook(root)
    with jupyter_lab(tmp_path, root, env={"GPU_LAB_QUICK": "1"}, name="browser-runview") as lab:
        with _page(browser, {"width": 1600, "height": 1000}, "runview-") as (page, console):
            facts = _run_view_scenario(page, lab)
        (ARTIFACTS / "browser-runview.json").write_text(json.dumps(facts, indent=1))
        assert not page_errors(console), console


def _run_view_scenario(page, lab) -> dict:  # noqa: C901 (one story, in order)
    from gpu_lab.record.registry import Registry

    page.goto(f"{lab.url}lab?token={lab.token}")
    page.wait_for_selector("#jp-main-dock-panel", state="visible", timeout=120_000)

    # 0. the launcher's tile opens a new notebook with a LaunchPanel cell -----------------------
    page.locator(".jp-LauncherCard", has_text="GPU Lab training run").click()
    page.locator(".jp-NotebookPanel:visible .jp-Cell .cm-content",
                 has_text="gpu_lab.LaunchPanel()").wait_for()
    new_nb = page.locator("#jp-main-dock-panel .lm-TabBar-tab.lm-mod-current .lm-TabBar-tabLabel")\
        .inner_text()
    assert new_nb.endswith(".ipynb"), new_nb
    source = json.loads((lab.root_dir / new_nb).read_text())["cells"][0]["source"]
    assert "".join(source) == "import gpu_lab\ngpu_lab.LaunchPanel()"

    # 1. launch two 2-rank runs from a notebook -------------------------------------------------
    if not page.locator("#filebrowser").is_visible():
        page.click('li.lm-TabBar-tab[data-id="filebrowser"]')
    page.dblclick('.jp-DirListing-item[title^="Name: view_runs.ipynb"]')
    nb = page.locator(".jp-NotebookPanel:visible")
    nb.locator(".jp-Cell").first.wait_for()
    page.locator("#jp-main-statusbar", has_text="| Idle").wait_for(timeout=120_000)
    nb.locator(".jp-Cell").first.click()
    page.keyboard.press("Escape")
    page.keyboard.press("Shift+Enter")
    nb.locator(".jp-OutputArea-output", has_text="launched").wait_for(timeout=120_000)
    reg = Registry(lab.gpu_lab_home / "registry.db")
    runs = {r["name"]: r for r in reg.list_runs()}
    long_id, short_id = runs["view-long"]["id"], runs["view-short"]["id"]
    broken_id = runs["view-broken"]["id"]

    # 2. open the long run's view from the side panel ------------------------------------------
    view = open_run_view(page, long_id)

    # 3. axes with tick labels; both ranks' loss, throughput and learning rate, and their mean
    def drawn(metric: str, n: int) -> bool:
        pts = _series_points(view, metric)
        return all(pts.get(k, 0) >= n for k in ("rank 0", "rank 1", "mean"))

    for metric in ("loss", "samples_per_s", "lr"):
        deadline = time.monotonic() + 120
        while not drawn(metric, 5):
            assert time.monotonic() < deadline, (metric, _series_points(view, metric))
            page.wait_for_timeout(250)
        chart = view.locator(f'.jp-GpuLab-chart[data-metric="{metric}"]')
        xticks = chart.get_attribute("data-xticks").split("|")
        yticks = chart.get_attribute("data-yticks").split("|")
        assert len(xticks) >= 2 and all(re.fullmatch(r"-?[\d.]+", t) for t in xticks), xticks
        assert len(yticks) >= 2 and all(t for t in yticks), yticks
        assert chart.locator("canvas").count() == 1
    assert "Learning rate" in view.inner_text() or "learning rate" in view.inner_text()
    # host series on the time axis (no GPU here), with clock-time ticks
    host = view.locator('.jp-GpuLab-chart[data-system="host-cpu"]')
    host.wait_for()
    page.wait_for_function(
        """() => { const c = document.querySelector(
               '.jp-GpuLab-runview:not(.lm-mod-hidden) [data-system="host-cpu"]');
               return c && Object.values(JSON.parse(c.dataset.series || '{}'))[0] >= 3; }""")
    assert re.fullmatch(r"\d\d:\d\d:\d\d", host.get_attribute("data-xticks").split("|")[0])
    assert "No GPU visible to NVML" in view.inner_text()
    # the log tail grows, pushed over the websocket
    log = view.locator('pre.jp-GpuLab-rv-log[data-file="rank0.log"]')
    log.wait_for()
    first = int(log.get_attribute("data-bytes"))
    page.wait_for_function(
        f"""() => Number(document.querySelector('.jp-GpuLab-runview:not(.lm-mod-hidden) '
                 + 'pre[data-file="rank0.log"]').dataset.bytes) > {first}""")
    assert re.search(r"step \d+ loss \d", log.inner_text())
    assert [t.inner_text() for t in view.locator(".jp-GpuLab-rv-logtab").all()] == [
        "rank0.log", "rank1.log", "supervisor.log"]
    assert int(view.get_attribute("data-feed-messages")) > 0
    assert view.locator('[data-field="lr"] .jp-GpuLab-rv-config-value').inner_text() == "0.003"
    _shot(page, "runview-1-live")

    # x on the time axis: the metric charts tick in clock time too
    view.locator("input.jp-GpuLab-rv-x-time").check()
    page.wait_for_function(
        """() => /^\\d\\d:\\d\\d:\\d\\d/.test(document.querySelector(
               '.jp-GpuLab-runview:not(.lm-mod-hidden) [data-metric="loss"]').dataset.xticks
               || '')""")
    view.locator("input.jp-GpuLab-rv-logy").check()
    view.locator("input.jp-GpuLab-rv-x-step").check()
    # drag across the loss chart: every training chart zooms to those steps; a double click
    # shows everything again
    over = view.locator('.jp-GpuLab-chart[data-metric="loss"] .u-over')
    box = over.bounding_box()
    page.mouse.move(box["x"] + box["width"] * 0.2, box["y"] + box["height"] / 2)
    page.mouse.down()
    page.mouse.move(box["x"] + box["width"] * 0.6, box["y"] + box["height"] / 2, steps=5)
    page.mouse.up()
    lr_chart = view.locator('.jp-GpuLab-chart[data-metric="lr"]')
    page.wait_for_function("(el) => el.dataset.zoomed === 'true'", arg=lr_chart.element_handle())
    over.dblclick()
    page.wait_for_function("(el) => !el.dataset.zoomed", arg=lr_chart.element_handle())

    # 4. Checkpoint now: a new step_N folder in the run's checkpoints ---------------------------
    ckpts = Path(reg.get_run(long_id)["output_dir"]) / "checkpoints"
    before = set(p.name for p in ckpts.glob("step_*")) if ckpts.exists() else set()
    view.locator("button.jp-GpuLab-rv-checkpoint").click()
    wait_until(lambda: set(p.name for p in ckpts.glob("step_*")) - before, 60,
               what="a checkpoint after Checkpoint now")
    new_ckpt = sorted(set(p.name for p in ckpts.glob("step_*")) - before)
    view.locator(".jp-GpuLab-rv-message", has_text="checkpoint step").wait_for()
    view.locator(".jp-GpuLab-rv-notes-item", has_text="checkpoint step").first.wait_for()

    # 5. Stop: the status becomes stopped ------------------------------------------------------
    view.locator("button.jp-GpuLab-rv-stop").click()
    page.wait_for_function(
        """() => document.querySelector('.jp-GpuLab-runview:not(.lm-mod-hidden)')
                 ?.dataset.status === 'stopped'""", timeout=60_000)
    assert view.locator(".jp-GpuLab-rv-status").inner_text() == "stopped"
    row = reg.get_run(long_id)
    assert row["status"] == "stopped" and row["reason"] == "stopped from JupyterLab"
    # JupyterLab's own notification tells the end, with the reason
    page.locator(".Toastify__toast", has_text="Run view-long stopped after").filter(
        has_text="stopped from JupyterLab").wait_for(timeout=30_000)
    # a run whose function was defined in a notebook cannot be resumed from here: say why
    view.locator("button.jp-GpuLab-rv-resume").click()
    msg = view.locator('.jp-GpuLab-rv-message[data-kind="error"]')
    msg.wait_for()
    assert "not importable (defined in a notebook?)" in msg.inner_text()
    _shot(page, "runview-2-checkpoint-stop-resume")
    view.locator(".jp-GpuLab-rv-logs").scroll_into_view_if_needed()
    _shot(page, "runview-3-config-notes-logs")
    loss_points = _series_points(view, "loss")

    # 6. compare the two runs: select both in the side panel ------------------------------------
    wait_until(lambda: reg.get_run(short_id)["status"] == "succeeded", 120,
               what="the short run to finish")
    _show_panel(page)
    for rid in (long_id, short_id):
        page.locator(f'#gpu-lab-panel .jp-GpuLab-run[data-run-id="{rid}"] '
                     'input.jp-GpuLab-run-select').check()
    page.locator("#gpu-lab-panel button.jp-GpuLab-compare", has_text="Compare (2)").click()
    cmp = page.locator(".jp-GpuLab-compareview:visible")
    cmp.locator('.jp-GpuLab-chart[data-metric="loss"] canvas').wait_for()
    loss = _series_points(cmp, "loss")
    # named by the fields in which their configs differ, in TrainConfig's field order
    assert sorted(loss) == ["max_steps=100000, lr=0.003", "max_steps=15, lr=0.001"], loss
    assert all(n >= 5 for n in loss.values()), loss
    assert "differ in: max_steps, lr" in cmp.inner_text()
    legend = cmp.locator('.jp-GpuLab-chart[data-metric="loss"] .u-legend').inner_text()
    assert "max_steps=15, lr=0.001" in legend and "max_steps=100000, lr=0.003" in legend
    _shot(page, "runview-4-compare")

    # 7. the failed run's notification (it stays until dismissed) names the triage's first line;
    # its View action opens the run's view, which shows the whole triage ------------------------
    wait_until(lambda: reg.get_run(broken_id)["status"] == "failed", 120,
               what="the broken run to fail")
    notice = page.locator(".Toastify__toast", has_text="Run view-broken failed after")
    notice.wait_for(timeout=60_000)
    assert "rank 1: ValueError: rank one broke on purpose at step 3" in notice.inner_text()
    _shot(page, "runview-5-failed-notification")
    notice.locator("button.jp-toast-button", has_text="View").click()
    failed = page.locator(f'.jp-GpuLab-runview[id="gpu-lab-run-{broken_id}"]:visible')
    failed.wait_for()
    notice.wait_for(state="hidden")  # the action dismissed it
    box = failed.locator(".jp-GpuLab-rv-failure")
    box.locator(".jp-GpuLab-rv-triage", has_text="rank one broke on purpose").wait_for()
    triage = box.inner_text()
    assert "rank 1: ValueError: rank one broke on purpose at step 3" in triage, triage
    assert "What to try (user code)" in triage and "traceback" in triage
    assert failed.get_attribute("data-status") == "failed"
    _shot(page, "runview-6-failed")

    # 8. the user's own script: what it logged through accelerator.log is drawn, step by step,
    # and the config it gave init_trackers is the run's config ----------------------------------
    script_id = runs["view-script"]["id"]
    wait_until(lambda: reg.get_run(script_id)["status"] == "succeeded", 120,
               what="the script's run to finish")
    _show_panel(page)
    card = page.locator(f'#gpu-lab-panel .jp-GpuLab-run[data-run-id="{script_id}"]')
    card.locator("button.jp-GpuLab-open-dashboard").click()
    sview = page.locator(f'.jp-GpuLab-runview[id="gpu-lab-run-{script_id}"]:visible')
    sview.wait_for()
    deadline = time.monotonic() + 60
    while _series_points(sview, "loss").get("rank 0", 0) < 30:
        assert time.monotonic() < deadline, _series_points(sview, "loss")
        page.wait_for_timeout(250)
    script_loss = _series_points(sview, "loss")
    assert script_loss["rank 0"] == 30 and "rank 1" not in script_loss, script_loss
    for field, value in (("lr", "0.05"), ("steps", "30")):
        assert sview.locator(f'[data-field="{field}"] .jp-GpuLab-rv-config-value').inner_text() \
            == value, field
    _shot(page, "runview-7-own-script")
    # what the record says of itself (here: as a full disk would have it) reaches the open view
    # and the side panel's card, pushed by the server
    said = "the record was paused for 3 s: the disk holding /x was full; 12 events were not written"
    reg.update(script_id, note=said)
    sview.locator(".jp-GpuLab-rv-record-note", has_text=said).wait_for(timeout=30_000)
    _show_panel(page)
    page.locator(f'#gpu-lab-panel .jp-GpuLab-run[data-run-id="{script_id}"] .jp-GpuLab-run-note',
                 has_text="the record was paused").wait_for(timeout=30_000)

    # 9. reloaded, the lab does not announce the runs that had ended before it opened: none after
    # its first polls of the runs list (the baseline, then two more)
    polls: list[str] = []
    page.on("request", lambda r: polls.append(r.url)
            if r.url.split("?")[0].endswith("/gpu-lab/api/runs") else None)
    page.reload()
    page.wait_for_selector("#jp-main-dock-panel", state="visible", timeout=120_000)
    deadline = time.monotonic() + 60
    while len(polls) < 3:
        assert time.monotonic() < deadline, polls
        page.wait_for_timeout(100)
    assert page.locator(".Toastify__toast", has_text="Run view-").count() == 0
    return {"long_run": long_id, "short_run": short_id, "broken_run": broken_id,
            "checkpoints_made": new_ckpt, "loss_points": loss_points,
            "compare_loss_points": loss, "triage": triage, "script_loss_points": script_loss}


# --- a sweep: its trials grouped in the side panel, and compared -------------------------------
def test_side_panel_groups_a_sweeps_trials_and_compares_them(tmp_path, gpu_lab_home, browser):
    """A real sweep (its driver, Optuna, 12 trials of tiny_cnn, 2 at a time, ASHA at the settings
    of tests/test_sweep.py, which prune) started beside the lab: the panel shows one group for it
    whose trials carry the registry's statuses, pruned included, whose line counts them and names
    the study's best value, and whose Compare shows its best trials (a comparison holds 8)."""
    import gpu_lab
    from gpu_lab.record.registry import Registry

    root = tmp_path / "lab-root"
    root.mkdir()
    cfg = gpu_lab.TrainConfig(model="tiny_cnn", image_size=16, batch_size=16, max_steps=20,
                              eval_every=5, num_workers=0, tensorboard=False, num_processes=1,
                              output_dir=str(tmp_path / "out"))
    space = {"lr": gpu_lab.loguniform(1e-4, 1e-1), "optimizer": ["adamw", "sgd"]}
    with jupyter_lab(tmp_path, root, env={"GPU_LAB_QUICK": "1"}, name="browser-sweep") as lab:
        sw = gpu_lab.sweep(gpu_lab.train_classifier, cfg, space, trials=12, parallel=2,
                           name="lr and optimizer", sampler_seed=0)
        try:
            with _page(browser, {"width": 1500, "height": 1000}, "sweep-") as (page, console):
                facts = _sweep_scenario(page, lab, sw, Registry(lab.gpu_lab_home / "registry.db"))
        finally:
            if not sw.done:
                sw.stop()
        (ARTIFACTS / "browser-sweep.json").write_text(json.dumps(facts, indent=1))
        assert not page_errors(console), console


def _sweep_scenario(page, lab, sw, reg) -> dict:
    page.goto(f"{lab.url}lab?token={lab.token}")
    page.wait_for_selector("#jp-main-dock-panel", state="visible", timeout=120_000)
    _show_panel(page)
    group = page.locator(f'#gpu-lab-panel .jp-GpuLab-sweep[data-sweep-id="{sw.id}"]')
    group.wait_for(timeout=120_000)
    # 1. while it runs: its trials appear in it, none outside it ---------------------------------
    group.locator(".jp-GpuLab-run").first.wait_for(timeout=120_000)
    assert group.locator(".jp-GpuLab-sweep-title").inner_text() == "lr and optimizer"
    _shot(page, "sweep-1-running")
    assert sw.wait(timeout=400) == "finished", sw.trials
    tagged = [r for r in reg.list_runs() if r.get("sweep") == sw.id]
    assert len(tagged) == 12
    page.wait_for_function(
        f"""() => document.querySelector('.jp-GpuLab-sweep[data-sweep-id="{sw.id}"]')
                 ?.dataset.done === '12'""", timeout=60_000)
    cards = {c.get_attribute("data-run-id"): c for c in group.locator(".jp-GpuLab-run").all()}
    assert set(cards) == {r["id"] for r in tagged}
    assert page.locator("#gpu-lab-panel .jp-GpuLab-runs-list > .jp-GpuLab-run").count() == 0
    # 2. each trial named by its number, with its status as the registry has it (pruned too) ----
    wait_until(lambda: all(cards[r["id"]].get_attribute("data-status") == r["status"]
                           for r in tagged), 30, what="the panel to show the final statuses")
    shown = {}
    for r in tagged:
        card = cards[r["id"]]
        shown[r["id"]] = card.locator(".jp-GpuLab-run-status").inner_text()
        assert shown[r["id"]] == r["status"], (r["id"], shown[r["id"]], r["status"])
        assert re.fullmatch(r"trial \d+", card.locator(".jp-GpuLab-run-name").inner_text())
        assert "accuracy" in card.locator(".jp-GpuLab-run-stats").inner_text()
    # 3. its line: trials done of the total, pruned ones counted, the study's best --------------
    pruned = sum(r["status"] == "pruned" for r in tagged)
    assert pruned and list(shown.values()).count("pruned") == pruned, shown
    line = group.locator(".jp-GpuLab-sweep-line").inner_text()
    assert line.startswith(f"12/12 trials done · {pruned} pruned · best accuracy "), line
    best = sw.best
    assert float(group.get_attribute("data-best")) == pytest.approx(best.value), line
    assert f"best accuracy {float(f'{best.value:.4g}'):g}" in line, (line, best.value)
    _shot(page, "sweep-2-done")
    # 4. the group collapses and opens again ----------------------------------------------------
    group.locator("button.jp-GpuLab-sweep-toggle").click()
    group.locator(".jp-GpuLab-sweep-trials").wait_for(state="hidden")
    group.locator("button.jp-GpuLab-sweep-toggle").click()
    group.locator(".jp-GpuLab-sweep-trials").wait_for(state="visible")
    # 5. its Compare: the comparison of all its trials, named by the parameters searched -------
    compare = group.locator("button.jp-GpuLab-sweep-compare")
    assert "Compare the curves of these runs" in compare.get_attribute("title")
    compare.click()
    cmp = page.locator(".jp-GpuLab-compareview:visible")
    cmp.locator('.jp-GpuLab-chart[data-metric="loss"] canvas').wait_for()
    rows = {tr.get_attribute("data-run-id"): tr.inner_text()
            for tr in cmp.locator("tr[data-run-id]").all()}
    value = {r["id"]: r["summary"].get("accuracy", float("-inf")) for r in tagged}
    assert set(rows) == set(value), rows  # the whole sweep (up to MAX_COMPARE runs)
    assert all(r["status"] in rows[r["id"]] for r in tagged), rows
    differ = cmp.locator(".jp-GpuLab-cmp-differ").inner_text()
    assert "lr" in differ, differ
    assert page.locator(".lm-TabBar-tab.lm-mod-current", has_text="Compare lr and optimizer")\
        .count() == 1
    assert len(_series_points(cmp, "loss")) == 12
    _shot(page, "sweep-3-compare")
    return {"sweep": sw.id, "statuses": shown, "pruned": pruned, "line": line,
            "best": best.value, "compare_differ": differ}


# --- a server that goes away: the live views go on ---------------------------------------------
def test_live_views_survive_a_server_restart(tmp_path, gpu_lab_home, browser):
    """Issue 60: a live run view, a live comparison and the side panel are open while the server
    is stopped (its websockets and port closed) and started again on its port a few seconds later,
    and a run keeps reporting all along. Meanwhile each says it is reconnecting; after, each goes
    on (new steps in the view, a newer step in the comparison, the run's new status in the panel),
    the page raised no uncaught error, and the view holds every step of the run's record. The
    view's axes tell their ticks apart (a nearly flat metric, a metric of one point)."""
    import gpu_lab
    import live_fns
    from gpu_lab.record.registry import Registry

    root = tmp_path / "lab-root"
    root.mkdir()
    with jupyter_lab(tmp_path, root, env={"GPU_LAB_QUICK": "1"}, name="browser-restart") as lab:
        short = gpu_lab.launch(live_fns.report_steadily, 10, 0.05, num_processes=1,
                               name="restart-short")
        long = gpu_lab.launch(live_fns.report_steadily, 100_000, 0.1, num_processes=1,
                              name="restart-long")
        try:
            with _page(browser, {"width": 1600, "height": 1000}, "restart-") as (page, console):
                facts = _restart_scenario(page, lab, long, short,
                                          Registry(lab.gpu_lab_home / "registry.db"))
        finally:
            for run in (long, short):
                if run.status in ("pending", "queued", "running"):
                    run.stop()
        (ARTIFACTS / "browser-restart.json").write_text(json.dumps(facts, indent=1))
        assert not page_errors(console), console


def _restart_scenario(page, lab, long, short, reg) -> dict:  # noqa: C901 (one story, in order)
    page.goto(f"{lab.url}lab?token={lab.token}")
    page.wait_for_selector("#jp-main-dock-panel", state="visible", timeout=120_000)
    assert long.wait_for_step(3, timeout=120)
    wait_until(lambda: short.status == "succeeded", 120, what="the short run to finish")

    # 1. a live comparison of the two, then the long run's view in front --------------------
    _show_panel(page)
    for rid in (long.id, short.id):
        page.locator(f'#gpu-lab-panel .jp-GpuLab-run[data-run-id="{rid}"] '
                     'input.jp-GpuLab-run-select').check()
    page.locator("#gpu-lab-panel button.jp-GpuLab-compare", has_text="Compare (2)").click()
    cmp = page.locator(".jp-GpuLab-compareview")
    cmp.locator('.jp-GpuLab-chart[data-metric="loss"] canvas').wait_for()
    page.wait_for_function("(el) => el.dataset.state === 'live'", arg=cmp.element_handle())
    view = open_run_view(page, long.id)
    feed = view.element_handle()
    page.wait_for_function("(el) => el.dataset.feed === 'live'", arg=feed)
    page.wait_for_function(
        """(el) => (JSON.parse(el.querySelector('[data-metric="loss"]')?.dataset.series || '{}')
                   ['rank 0'] || 0) >= 5""", arg=feed)
    conn = page.locator("#gpu-lab-panel .jp-GpuLab-conn")
    assert conn.get_attribute("data-state") == "live"
    card = page.locator(f'#gpu-lab-panel .jp-GpuLab-run[data-run-id="{long.id}"]')

    def cmp_step() -> int:
        cells = cmp.locator(f'tr[data-run-id="{long.id}"] td').all_inner_texts()
        return int(cells[-2])  # ..., step, loss

    before = {"view": _series_points(view, "loss")["rank 0"], "compare": cmp_step(),
              "record": reg.last_seq(long.id)}
    _shot(page, "restart-1-live")

    # 2. the server goes away for a few seconds; the run keeps reporting ----------------------
    lab.stop()
    stopped = time.monotonic()
    page.wait_for_function("(el) => el.dataset.state === 'reconnecting'",
                           arg=conn.element_handle(), timeout=30_000)
    page.wait_for_function("(el) => el.dataset.feed === 'reconnecting'", arg=feed,
                           timeout=30_000)
    page.wait_for_function("(el) => el.dataset.state === 'reconnecting'",
                           arg=cmp.element_handle(), timeout=30_000)
    assert "reconnecting" in view.locator(".jp-GpuLab-rv-live").inner_text()
    _shot(page, "restart-2-reconnecting")
    time.sleep(max(0.0, 5 - (time.monotonic() - stopped)))
    during = reg.last_seq(long.id) - before["record"]
    lab.start()
    away = time.monotonic() - stopped
    assert long.status == "running" and during > 0, (long.status, during)

    # 3. back: all three go on -----------------------------------------------------------------
    # (JupyterLab's own "Server Connection Error" dialog, if it showed one, stays until closed)
    for button in page.locator(".jp-Dialog button", has_text="Dismiss").all():
        button.click()
    page.wait_for_function("(el) => el.dataset.state === 'live'", arg=conn.element_handle(),
                           timeout=60_000)
    page.wait_for_function("(el) => el.dataset.feed === 'live'", arg=feed, timeout=60_000)
    after_outage = _series_points(view, "loss")["rank 0"]
    page.wait_for_function(
        f"""(el) => (JSON.parse(el.querySelector('[data-metric="loss"]').dataset.series)
                    ['rank 0'] || 0) > {after_outage}""", arg=feed, timeout=30_000)
    wait_until(lambda: cmp_step() > before["compare"] + 10 and
               cmp.get_attribute("data-state") == "live", 60,
               what="the comparison to show new steps")
    _shot(page, "restart-3-back")
    # the run's new status, everywhere
    long.stop(reason="stopped by the test")
    page.wait_for_function("(el) => el.dataset.status === 'stopped'", arg=card.element_handle(),
                           timeout=60_000)
    page.wait_for_function("(el) => el.dataset.status === 'stopped'", arg=feed, timeout=60_000)
    wait_until(lambda: cmp.get_attribute("data-state") == "ended", 60,
               what="the comparison to see the run end")
    assert "stopped" in cmp.locator(f'tr[data-run-id="{long.id}"]').inner_text()

    # 4. the view holds every step of the record, once ----------------------------------------
    steps = sorted(step for step, _ in reg.metric_points(long.id, "loss", 0)[1])
    assert steps == list(range(len(steps))), "the record itself has a gap"
    want = f"0-{steps[-1]}"

    def held() -> str:
        return json.loads(view.locator('.jp-GpuLab-chart[data-metric="loss"]')
                          .get_attribute("data-steps"))["rank 0"]

    wait_until(lambda: held() == want, 30, what=f"the view to hold steps {want}")
    assert _series_points(view, "loss")["rank 0"] == len(steps)

    # 5. readable axes: each chart's ticks are told apart ---------------------------------------
    page.wait_for_function(
        """(el) => ['loss', 'ram', 'eval_loss'].every(
               m => el.querySelector(`[data-metric="${m}"]`)?.dataset.yticks)""", arg=feed)
    ticks = {}
    for chart in view.locator(".jp-GpuLab-chart").all():
        name = chart.get_attribute("data-metric") or chart.get_attribute("data-system")
        ticks[name] = {axis: (chart.get_attribute(f"data-{axis}") or "").split("|")
                       for axis in ("xticks", "yticks")}
    repeated = {name: t for name, t in ticks.items()
                if any(len(set(v)) < len(v) for v in t.values())}
    assert not repeated, repeated
    assert len(ticks["ram"]["yticks"]) >= 2, ticks["ram"]  # 1.339 GiB, give or take 20 KiB
    _shot(page, "restart-4-stopped")
    return {"run": long.id, "away_s": round(away, 1), "reported_while_away": during,
            "before": before, "steps": want, "ticks": ticks}


# --- every run within reach: search, pages, a sweep of 50 compared ----------------------------
def test_the_panel_finds_an_old_run_among_hundreds_and_compares_fifty(tmp_path, gpu_lab_home,
                                                                       browser):
    """Issue 60: with 300 runs in the registry the panel lists the newest 100, pages back
    through the rest, finds the oldest by a word of its name and by a config value, filters by
    status, and a comparison overlays the 50 runs of a sweep, each decimated."""
    from gpu_lab.record.registry import Registry

    root = tmp_path / "lab-root"
    root.mkdir()
    with jupyter_lab(tmp_path, root, env={"GPU_LAB_QUICK": "1"}, name="browser-many") as lab:
        reg = Registry(lab.gpu_lab_home / "registry.db")
        t0 = time.time() - 300 * 60
        for i in range(300):
            rid = f"old-{i:03d}"
            sweep = i >= 250  # the newest 50: one sweep's trials
            reg.create_run(rid, name="the-oldest-run" if i == 0 else
                           (f"lr-sweep trial {i}" if sweep else f"run {i}"),
                           config={"lr": 1e-4 * (1 + i % 50), "batch_size": 7 if i == 0 else 32},
                           num_processes=1, status="failed" if i % 40 == 1 else "succeeded")
            reg.update(rid, started=t0 + i * 60, ended=t0 + i * 60 + 30)
            reg.add_events(rid, [{"rank": 0, "kind": "metric", "t": t0 + i * 60 + s, "step": s,
                                  "data": {"loss": 2.0 / (1 + s) + i * 1e-3}}
                                 for s in range(400)], checked=True)
        with _page(browser, {"width": 1600, "height": 1000}, "many-") as (page, console):
            facts = _many_runs_scenario(page, lab)
        (ARTIFACTS / "browser-many.json").write_text(json.dumps(facts, indent=1))
        assert not page_errors(console), console


def _many_runs_scenario(page, lab) -> dict:
    page.goto(f"{lab.url}lab?token={lab.token}")
    page.wait_for_selector("#jp-main-dock-panel", state="visible", timeout=120_000)
    _show_panel(page)
    panel = page.locator("#gpu-lab-panel")
    pages = panel.locator(".jp-GpuLab-page")

    def ids() -> list[str]:  # read at once: the list may be redrawn between two reads
        return page.evaluate("() => [...document.querySelectorAll('#gpu-lab-panel .jp-GpuLab-run')]"
                             ".map(e => e.dataset.runId)")

    # 1. the newest 100 of 300, then the next page, and back ----------------------------------
    wait_until(lambda: pages.inner_text() == "1–100 of 300", 60, what="the first page")
    assert ids()[0] == "old-299" and len(ids()) == 100
    panel.locator("button.jp-GpuLab-older").click()
    wait_until(lambda: pages.inner_text() == "101–200 of 300", 30, what="the second page")
    assert ids()[0] == "old-199"
    panel.locator("button.jp-GpuLab-newer").click()
    wait_until(lambda: pages.inner_text() == "1–100 of 300", 30, what="the first page again")
    # runs that ended hours ago, shown by an older page: no end notice for them
    assert page.locator(".Toastify__toast", has_text="Run run ").count() == 0
    _shot(page, "many-1-page")
    # 2. the oldest run, by a word of its name, then by a config value --------------------------
    search = panel.locator("input.jp-GpuLab-search-text")
    search.fill("oldest")
    wait_until(lambda: ids() == ["old-000"], 30, what="the search to find the oldest run")
    search.fill("batch_size:7")
    wait_until(lambda: ids() == ["old-000"], 30, what="the config search to find it")
    _shot(page, "many-2-found")
    # 3. a status filter: the failed ones, on one page ------------------------------------------
    search.fill("")
    panel.locator("select.jp-GpuLab-search-status").select_option("failed")
    failed = [f"old-{i:03d}" for i in range(299, -1, -1) if i % 40 == 1]
    wait_until(lambda: ids() == failed, 30, what="the failed runs")
    panel.locator("select.jp-GpuLab-search-status").select_option("")
    # 4. a sweep's 50 runs, found and compared --------------------------------------------------
    search.fill("lr-sweep")
    wait_until(lambda: len(ids()) == 50, 30, what="the sweep's 50 runs")
    for rid in ids():
        panel.locator(f'.jp-GpuLab-run[data-run-id="{rid}"] input.jp-GpuLab-run-select').check()
    panel.locator("button.jp-GpuLab-compare", has_text="Compare (50)").click()
    cmp = page.locator(".jp-GpuLab-compareview:visible")
    cmp.locator('.jp-GpuLab-chart[data-metric="loss"] canvas').wait_for(timeout=60_000)
    rows = cmp.locator("tr[data-run-id]").count()
    series = _series_points(cmp, "loss")
    assert rows == 50 and len(series) == 50, (rows, len(series))
    assert "lr" in cmp.locator(".jp-GpuLab-cmp-differ").inner_text()
    drawn = sum(series.values())
    assert drawn <= 8000 and min(series.values()) >= 16, series  # each run decimated
    _shot(page, "many-3-compare")
    return {"pages": "1–100 of 300", "failed": len(failed), "compared": rows, "points": drawn}


# --- the browser's decimation is Python's ------------------------------------------------------
DECIMATE_DRIVER = """
const { decimateMinMax, BoundedSeries } = require('./decimate.js');
const input = JSON.parse(require('fs').readFileSync(0, 'utf8'));
const cases = input.cases.map(c => decimateMinMax(c.x, c.y, c.n));
const s = new BoundedSeries(input.series.capacity);
for (const [step, t, v] of input.series.points) s.append(step, t, v);
process.stdout.write(JSON.stringify({cases, series: [s.steps, s.times, s.values, s.count]}));
"""


def test_decimation_in_the_browser_keeps_the_points_python_keeps(tmp_path):
    """extension/src/decimate.ts (the run view's bounded series) against
    gpu_lab.readers.history: the same inputs keep the same points, spikes included."""
    from gpu_lab.readers.history import Series
    from gpu_lab.record.decimate import decimate_minmax

    node = shutil.which("node")
    tsc = ROOT / "extension" / "node_modules" / "typescript" / "bin" / "tsc"
    if node is None or not tsc.exists():
        pytest.fail("node and extension/node_modules are needed: `make install` builds the "
                    "extension with them (Node.js >= 20.19)")
    subprocess.run([node, str(tsc), "--module", "commonjs", "--target", "ES2020", "--outDir",
                    str(tmp_path), str(ROOT / "extension" / "src" / "decimate.ts")], check=True)
    (tmp_path / "driver.js").write_text(DECIMATE_DRIVER)
    rng = random.Random(7)
    cases = []
    for m, n in ((10, 4), (1000, 100), (997, 37), (5000, 1000), (50, 50), (3, 8)):
        y = [rng.gauss(0, 1) for _ in range(m)]
        if m > 100:
            y[m // 3] = 40.0  # a spike that must survive
            y[m // 2] = -40.0
        cases.append({"x": list(range(m)), "y": y, "n": n})
    cases.append({"x": list(range(300)), "y": [1.5] * 300, "n": 20})  # ties: first index wins
    points = [[i, 1000.0 + i / 4, rng.random() * (100 if i == 777 else 1)] for i in range(3000)]
    payload = {"cases": cases, "series": {"capacity": 64, "points": points}}
    out = subprocess.run([node, str(tmp_path / "driver.js")], input=json.dumps(payload),
                         capture_output=True, text=True, check=True)
    got = json.loads(out.stdout)
    for case, (gx, gy) in zip(cases, got["cases"]):
        assert [gx, gy] == [list(v) for v in decimate_minmax(case["x"], case["y"], case["n"])]
        assert len(gx) <= case["n"] if len(case["x"]) > case["n"] else gx == case["x"]
    assert 40.0 in got["cases"][2][1] and -40.0 in got["cases"][2][1]
    py = Series(capacity=64)
    for step, t, v in points:
        py.append(step, t, v)
    assert got["series"] == [py.steps, py.times, py.values, py.count]
    assert max(got["series"][2]) == points[777][2]  # the spike outlived 3000 appends
