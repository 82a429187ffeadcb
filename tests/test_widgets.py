"""Widgets: decimation, throttling, bounded memory, the LivePlot / GPUPanel / LaunchPanel /
Dashboard views (in this process; the real-kernel path is tests/test_dashboard_notebook.py)."""
from __future__ import annotations

import random
import threading
import time

import pytest

from gpu_lab.config import TrainConfig
from gpu_lab.record.registry import Registry
from gpu_lab.readers.history import MetricHistory
from gpu_lab.record.decimate import decimate_minmax
from gpu_lab.telemetry import NVMLSampler, Sampler
from gpu_lab.telemetry.doubles import FakeGPU, FakeNVML
from gpu_lab.widgets import Dashboard, GPUPanel, LaunchPanel, LivePlot, Throttle
from gpu_lab.widgets.liveplot import MEAN, ema


class Clock:
    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def wait_for(pred, timeout=10.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def metric(rank, step, t=None, run="r", **data):
    return {"run": run, "rank": rank, "kind": "metric", "t": 1e9 + step if t is None else t,
            "step": step, "data": data}


class RunDouble:
    """A stand-in for gpu_lab.launch.Run with the same view-facing surface: it fills its
    MetricHistory, then calls subscribers, as Run._on_events does."""

    def __init__(self, run_id="run-double", num_processes=2, status="running"):
        self.id, self.name, self.status = run_id, "double", status
        self.num_processes, self.device, self.pid, self.dropped = num_processes, "cpu", None, 0
        self.metrics = MetricHistory()
        self.error = None
        self.checkpoints = 0
        self.stopped = threading.Event()
        self._subs = []

    def subscribe(self, fn):
        self._subs.append(fn)

    def unsubscribe(self, fn):
        self._subs.remove(fn)

    def emit(self, events):
        for e in events:
            if e["kind"] == "metric":
                self.metrics.add(e["rank"], e["step"], e["t"], e["data"])
        for fn in list(self._subs):
            fn(events)

    def finish(self, status="succeeded"):
        self.status = status
        self.emit([{"run": self.id, "rank": -1, "kind": "status", "t": time.time(), "step": None,
                    "data": {"status": status}}])

    def logs(self, rank=0, tail=50):
        return f"log of rank {rank}"

    def request_checkpoint(self):
        self.checkpoints += 1

    def stop(self):
        self.stopped.set()
        self.finish("stopped")
        return "stopped"


# --- decimation --------------------------------------------------------------------------------
@pytest.mark.slow  # over half a second
def test_decimation_is_bounded_and_keeps_spikes():
    rnd = random.Random(0)
    n = 1_000_000
    x = list(range(n))
    y = [rnd.gauss(0, 1) for _ in range(n)]
    spikes_up, spikes_down = rnd.sample(range(1, n - 1), 5), rnd.sample(range(1, n - 1), 3)
    for i in spikes_up:
        y[i] = 1000.0
    for i in spikes_down:
        y[i] = -1000.0
    dx, dy = decimate_minmax(x, y, 2000)
    assert len(dx) == len(dy) <= 2000
    assert dx == sorted(dx) and dx[0] == 0 and dx[-1] == n - 1
    assert set(spikes_up) | set(spikes_down) <= set(dx)  # every spike survives
    assert dy.count(1000.0) == 5 and dy.count(-1000.0) == 3


def _reference_decimation(x, y, n):
    """The rule, in plain Python: first and last point, and each bucket's min and max in order."""
    m = len(x)
    if m <= n:
        return list(x), list(y)
    buckets, inner = (n - 2) // 2, m - 2
    ox, oy = [x[0]], [y[0]]
    for b in range(buckets):
        lo, hi = 1 + (b * inner) // buckets, 1 + ((b + 1) * inner) // buckets
        if hi <= lo:
            continue
        seg = range(lo, hi)
        for i in sorted({min(seg, key=y.__getitem__), max(seg, key=y.__getitem__)}):
            ox.append(x[i])
            oy.append(y[i])
    return ox + [x[-1]], oy + [y[-1]]


def test_numpy_decimation_matches_the_reference():
    from gpu_lab.widgets.liveplot import decimate

    rnd = random.Random(1)
    for m, n in [(10, 4), (4001, 2000), (5000, 2000), (1234, 100), (7, 5), (3000, 7), (2001, 2000)]:
        for trial in range(4):  # Gaussian noise, and small integers (many ties)
            x = list(range(m))
            y = [float(rnd.randint(0, 5)) if trial % 2 else rnd.gauss(0, 1) for _ in range(m)]
            ref = _reference_decimation(x, y, n)
            for got in (decimate(x, y, n), decimate_minmax(x, y, n)):
                assert list(got[0]) == ref[0] and list(got[1]) == ref[1], (m, n, trial)


@pytest.mark.slow  # over half a second
def test_liveplot_memory_and_traces_bounded_over_a_million_steps():
    clock = Clock()
    p = LivePlot(clock=clock, max_points=2000)
    spike_step = 777_777
    batch = 50_000
    for start in range(0, 1_000_000, batch):
        p.on_events([metric(0, s, loss=50.0 if s == spike_step else 1.0 / (1 + s * 1e-4))
                     for s in range(start, start + batch)])
        clock.t += 1.0
        p.tick()
    y = p.fig.data[0].y
    x = p.fig.data[0].x
    assert p.history.count("loss") == 1_000_000
    assert len(p.history.series("loss", 0)[0]) <= p.history.capacity  # bounded history
    assert len(y) <= 2000 and len(x) == len(y)                         # bounded trace
    assert max(y) == 50.0 and spike_step in set(x)                     # the spike is visible
    assert x[-1] == 999_999


# --- throttling --------------------------------------------------------------------------------
def test_throttle_unit():
    c = Clock()
    t = Throttle(4, clock=c)
    assert t.due() and not t.due()
    c.t = 0.2
    assert not t.due()
    c.t = 0.25
    assert t.due()
    with pytest.raises(ValueError, match="max_hz: got 0"):
        Throttle(0)


def test_slow_redraws_wait_longer():
    """max_share: a redraw that took d seconds makes the next wait d / max_share."""
    from gpu_lab.widgets import Flusher

    c = Clock()

    def slow_redraw():
        c.t += 0.05  # this redraw "takes" 50 ms

    f = Flusher(slow_redraw, max_hz=4, clock=c, max_share=0.02)
    f.mark()
    assert f.maybe_flush()
    f.mark()
    c.t += 2.0
    assert not f.maybe_flush()  # 0.05 / 0.02 = 2.5 s after the end of the last redraw
    c.t += 0.6
    assert f.maybe_flush() and f.flushes == 2 and f.busy == pytest.approx(0.1)

    def very_slow_redraw():
        c.t += 1.0

    g = Flusher(very_slow_redraw, max_hz=4, clock=c, max_share=0.02)
    g.mark()
    g.maybe_flush()
    g.mark()
    c.t += Flusher.MAX_WAIT
    assert g.maybe_flush()  # 1.0 / 0.02 = 50 s, but never more than MAX_WAIT


def test_at_most_4_flushes_per_second_under_10k_events_per_second():
    clock = Clock()
    p = LivePlot(clock=clock)
    batch_updates = 0
    real = p.fig.batch_update

    def counting():
        nonlocal batch_updates
        batch_updates += 1
        return real()

    p.fig.batch_update = counting
    start_flushes = p.flushes  # the constructor draws once
    seconds, per_ms = 10, 10  # 10 events every simulated millisecond = 10,000 events/s
    step = 0
    for _ in range(seconds * 1000):
        p.on_events([metric(r, step, lr=0.1, loss=1.0) for r in (0, 1)] * (per_ms // 2))
        step += 1
        clock.t += 0.001
        p.tick()  # ticking every ms: far more often than the receiver's 4 Hz
    flushes = p.flushes - start_flushes
    assert p.events == seconds * 10_000
    assert 4 * seconds - 1 <= flushes <= 4 * seconds + 1
    assert batch_updates == flushes  # exactly one batch_update per flush


# --- LivePlot ----------------------------------------------------------------------------------
def test_ema():
    assert ema([1.0, 1.0, 1.0], 0.9) == pytest.approx([1.0, 1.0, 1.0])  # debiased
    assert ema([0.0, 10.0], 0.0) == [0.0, 10.0]
    sm = ema([0.0] * 5 + [10.0] * 5, 0.5)
    assert sm[5] < 10.0 and sm[-1] > 9.0


def test_liveplots_mean_is_the_records_over_the_ranks_that_reported_each_step():
    p = LivePlot(max_points=8)
    # rank 1 skips step 1: step 1's mean is rank 0's alone, as the server's (record.mean)
    p.on_events([metric(0, s, loss=1.0) for s in range(3)] + [metric(1, 0, loss=3.0),
                                                               metric(1, 2, loss=5.0)])
    p.flush()
    mean = next(t for t in p.fig.data if t.meta["rank"] == MEAN)
    assert list(mean.x) == [0, 1, 2] and list(mean.y) == [2.0, 1.0, 3.0]


def test_liveplot_traces_toggles_and_panels():
    p = LivePlot()
    titles = [a.text for a in p.fig.layout.annotations]
    assert titles[1:] == ["samples/s (not reported)", "learning rate (not reported)",
                          "data-wait fraction (not reported)"]
    p.on_events([metric(r, s, t=1000.0 + s, loss=1.0 + 2 * r, samples_per_s=100.0 * (r + 1), lr=0.01)
                 for s in range(10) for r in (0, 1)])
    p.flush()
    metas = [(t.meta["metric"], t.meta["rank"]) for t in p.fig.data]
    assert metas == [("loss", 0), ("loss", 1), ("loss", MEAN), ("throughput", 0),
                     ("throughput", 1), ("lr", 0)]  # lr: one trace, ranks agree
    assert list(p.fig.data[2].y) == [2.0] * 10 and p.fig.data[2].name == "mean"
    assert [a.text for a in p.fig.layout.annotations][1:] == [
        "samples/s", "learning rate", "data-wait fraction (not reported)"]
    # the fit loop reports seconds waited and seconds per step: the panel shows their ratio
    p.on_events([metric(0, s, t=1000.0 + s, data_wait=0.01 * s, step_time=0.1) for s in range(10)])
    p.flush()
    wait = next(t for t in p.fig.data if t.meta == {"metric": "data_wait", "rank": 0})
    assert list(wait.y) == pytest.approx([0.1 * s for s in range(10)])
    assert p.fig.layout.annotations[3].text == "data-wait fraction"
    p.log_box.value = True
    assert p.fig.layout.yaxis.type == "log"
    p.x_toggle.value = "time"
    assert p.fig.layout.xaxis.type == "date" and p.fig.layout.xaxis3.type == "date"
    import numpy as np

    assert list(p.fig.data[0].x[:2]) == list(np.array([1_000_000, 1_001_000], "datetime64[ms]"))
    p.on_events([metric(0, 10, t=1010.0, loss=100.0), metric(1, 10, t=1010.0, loss=100.0)])
    p.ema_box.value = True  # the toggle redraws at once
    assert p.fig.data[0].y[-1] < 100.0 and not p.smoothing.disabled
    assert "0x" not in repr(p) and repr(p) == "LivePlot(run=None, ranks=[0, 1], points=22, x='time')"


@pytest.mark.slow  # over half a second
def test_liveplot_follows_a_run_then_detaches():
    from gpu_lab.readers.receiver import get_receiver

    run = RunDouble()
    p = LivePlot(run)
    recv = get_receiver()
    assert p.tick in recv._ticks and p.on_events in run._subs
    run.emit([metric(r, s, loss=1.0) for s in range(30) for r in (0, 1)])
    # the receiver thread's own tick redraws: no manual flush here
    wait_for(lambda: p.trace_points("loss", 0) == 30 and p.trace_points("loss", 1) == 30,
             what="the receiver's tick to draw both ranks")
    run.emit([metric(0, 30, loss=0.5), metric(1, 30, loss=0.5)])
    run.finish()
    wait_for(lambda: p.tick not in recv._ticks, what="the plot to stop following the ended run")
    assert p.trace_points("loss", 0) == 31 and p.on_events not in run._subs
    p.close()


# --- GPUPanel ----------------------------------------------------------------------------------
def test_gpupanel_plots_gpus_and_highlights_thresholds():
    fake = FakeNVML([FakeGPU(uuid="GPU-a", util_gpu=50), FakeGPU(uuid="GPU-b", mem_used=79 * 2**30)])
    s = Sampler(interval=0.25, gpu=NVMLSampler(nvml=fake, visible=None))
    p = GPUPanel(sampler=s)
    wait_for(lambda: p.flushes >= 2, what="two telemetry redraws")
    p.stop("test over")
    assert not s.running or s.stats["subscribers"] == 0
    gpu_metas = {(t.meta["metric"], t.meta["gpu"]) for t in p.gpu_fig.data if t.meta}
    assert gpu_metas == {(m, g) for m in ("util_gpu", "mem_used_pct", "temperature_c", "power_w")
                         for g in (0, 1)}
    assert all(len(t.y) >= 2 for t in p.gpu_fig.data if t.meta)
    table = p.table.value
    rows = table.split("<tr>")[1:]
    assert "background:#fff3cd'>50%" in rows[0]          # GPU 0: utilisation < 70%
    assert "background:#f8d7da'>80896/81920 MiB (99%)" in rows[1]  # GPU 1: memory >= 95%
    assert "background" not in rows[0].split("MiB")[0].split("50%")[1]
    assert "<b>host</b>" in table and p.gpu_box.layout.display is None
    assert "telemetry stopped: test over" in p.notice.value
    s.close()


def test_gpupanel_gpus_appearing_later_get_a_figure_with_their_points():
    host_only = Sampler(interval=0.25, gpu=NVMLSampler(nvml=FakeNVML(init_error="library")))
    with_gpus = Sampler(interval=0.25, gpu=NVMLSampler(nvml=FakeNVML([FakeGPU(uuid="GPU-a")]),
                                                        visible=None))
    p = GPUPanel(sampler=host_only, start=False)
    assert p.gpu_fig is None
    for _ in range(3):
        p.on_sample(with_gpus.sample_once())
    assert p.gpu_box.layout.display is None and p.gpu_box.children == (p.gpu_fig,)
    assert hasattr(p.gpu_fig, "comm")  # a widget, built with the points already in it
    util = next(t for t in p.gpu_fig.data if t.meta and t.meta["metric"] == "util_gpu")
    assert len(util.y) >= 1
    p.close()
    host_only.close()
    with_gpus.close()


def test_gpupanel_host_only():
    s = Sampler(interval=0.25, gpu=NVMLSampler(nvml=FakeNVML(init_error="library")))
    p = GPUPanel(sampler=s)
    wait_for(lambda: p.flushes >= 2, what="two host-only redraws")
    p.stop()
    assert p.gpu_box.layout.display == "none" and p.gpu_fig is None  # no GPU figure at all
    assert "host metrics only" in p.notice.value
    assert "<b>host</b> · CPU" in p.table.value and " GiB" in p.table.value
    cpu = next(t for t in p.host_fig.data if t.meta["metric"] == "cpu_pct")
    ram = next(t for t in p.host_fig.data if t.meta["metric"] == "ram_pct")
    assert len(cpu.y) >= 2 and all(0 <= v <= 100 for v in cpu.y) and all(v > 0 for v in ram.y)
    assert repr(p) == f"GPUPanel(gpus=0, samples={len(p.samples)}, listening=False)"
    # layout and a first sample are in the widget's initial state (a view may render late)
    assert p.host_fig._widget_layout["xaxis"]["type"] == "date"
    assert len(p.host_fig._widget_data[0]["y"]) >= 1
    s.close()


# --- LaunchPanel -------------------------------------------------------------------------------
class LauncherDouble:
    """Records what Launch asked gpu_lab.launch to do; returns a RunDouble."""

    def __init__(self, fail: Exception | None = None):
        self.calls, self.fail, self.run = [], fail, None

    def __call__(self, fn, *args, **kw):
        self.calls.append((fn, args, kw))
        if self.fail:
            raise self.fail
        self.run = RunDouble(num_processes=kw.get("num_processes") or args[0].num_processes)
        return self.run


def train_fn_double(config):
    return {}


def test_launchpanel_form_help_and_inline_validation():
    p = LaunchPanel(train_fn=train_fn_double)
    help_ = TrainConfig.field_help()
    assert set(p.fields) == {n for n, i in help_.items() if i.get("form", True) is not False}
    for name in ("num_processes", "mixed_precision", "model", "lr"):
        assert help_[name]["help"][:30] in p.fields[name].help.value.replace("&#x27;", "'")
    assert p.fields["mixed_precision"].input.options == ("no", "fp16", "bf16")
    assert not p.errors and not p.launch_button.disabled
    p.fields["batch_size"].input.value = "0"
    p.fields["lr"].input.value = "fast"
    assert "TrainConfig.batch_size: got 0" in p.fields["batch_size"].error.value
    assert "TrainConfig.lr: got &#x27;fast&#x27;" in p.fields["lr"].error.value
    assert p.fields["batch_size"].error.layout.display is None
    assert p.fields["model"].error.layout.display == "none"
    assert p.launch_button.disabled
    p.fields["epochs"].input.value = ""  # with max_steps empty too: a cross-field problem
    cross = p.fields["max_steps"].error.value + p.fields["epochs"].error.value
    assert "epochs" in cross and "max_steps" in cross  # shown inline where TrainConfig points
    assert "TrainConfig.batch_size: got 0" in p.fields["batch_size"].error.value  # still there
    p.fields["batch_size"].input.value = "16"
    p.fields["lr"].input.value = "3e-4"
    p.fields["max_steps"].input.value = "12"
    assert not p.errors and not p.launch_button.disabled
    cfg = p.config
    assert (cfg.batch_size, cfg.lr, cfg.max_steps, cfg.epochs) == (16, 3e-4, 12, None)
    p.set_config(TrainConfig(num_processes=2, mixed_precision="bf16", max_steps=5))
    assert p.config.num_processes == 2 and p.config.mixed_precision == "bf16"
    assert repr(p) == "LaunchPanel(what='function', fields=%d, run=None, errors=[])" % len(p.fields)


def test_launchpanel_launch_stop_checkpoint():
    launcher = LauncherDouble()
    cfg = TrainConfig(max_steps=7, num_processes=2, mixed_precision="bf16")
    p = LaunchPanel(train_fn=train_fn_double, config=cfg, launcher=launcher,
                    dashboard_kw={"telemetry": False})
    p.launch_button.click()
    (fn, args, kw), = launcher.calls
    assert fn is train_fn_double and args == (cfg,) and kw == {"detach": False}
    assert p.run is launcher.run and p.dashboard is not None
    assert p.run_box.children == (p.dashboard,)
    assert p.launch_button.disabled and not p.stop_button.disabled  # clickable while it trains
    p.checkpoint_button.click()
    assert p.run.checkpoints == 1 and "checkpoint requested" in p.status.value
    p.launch_button.click()
    assert len(launcher.calls) == 1  # one active run at a time
    p.stop_button.click()
    assert p.run.stopped.wait(5)
    wait_for(lambda: not p.launch_button.disabled, what="Launch to come back after the run ended")
    assert p.stop_button.disabled and "stopped" in p.status.value
    p.close()


def test_launchpanel_launches_a_script_with_its_command_line(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import sys\nprint(sys.argv)\n")
    launcher = LauncherDouble()
    p = LaunchPanel(script=str(script), script_args="--lr 0.1 --name 'a b'", launcher=launcher,
                    config=TrainConfig(num_processes=2, priority=3),
                    dashboard_kw={"telemetry": False})
    assert p.what.value == "script" and p.resume_row.layout.display == "none"
    assert not p.errors and not p.launch_button.disabled
    p.launch_button.click()
    (fn, args, kw), = launcher.calls
    assert (fn.path, fn.argv, args) == (str(script), ("--lr", "0.1", "--name", "a b"), ())
    assert kw == {"num_processes": 2, "gpus": None, "priority": 3, "mixed_precision": "no",
                  "detach": False}
    p.close()
    # what is wrong is named inline, and Launch stays off until it is fixed
    q = LaunchPanel(script=str(tmp_path / "nope.py"), launcher=launcher)
    assert "script 'nope.py' not found" in q.script_error.value.replace("&#x27;", "'") or \
        "not found" in q.script_error.value
    assert q.launch_button.disabled and "script" in q.errors
    q.script_path.value = str(script)
    q.script_args.value = "--name 'unclosed"
    assert "quotation" in q.script_error.value and q.launch_button.disabled
    script.write_text("def train(:\n")
    q.script_args.value = ""
    assert "line 1" in q.script_error.value and "syntax error" in q.script_error.value
    q.what.value = "function"  # the script no longer matters
    assert not q.errors and q.script_box.layout.display == "none"
    q.close()


def test_launchpanel_gpus_and_priority_reach_the_launch():
    launcher = LauncherDouble()
    p = LaunchPanel(train_fn=train_fn_double, launcher=launcher, dashboard_kw={"telemetry": False})
    assert p.fields["gpus"].input.placeholder == "empty: one per process"
    p.fields["gpus"].input.value = "zero,one"
    assert "TrainConfig.gpus: got &#x27;zero,one&#x27;" in p.fields["gpus"].error.value
    assert p.launch_button.disabled
    p.fields["gpus"].input.value = "0,1"
    p.fields["priority"].input.value = "5"
    assert not p.errors
    p.launch_button.click()
    (fn, args, kw), = launcher.calls
    assert (args[0].gpus, args[0].priority) == ([0, 1], 5)
    p.set_config(TrainConfig(gpus="all"))
    assert p.fields["gpus"].input.value == "all" and p.config.gpus == "all"
    p.set_config(TrainConfig(gpus=[2, 3]))
    assert p.config.gpus == [2, 3]  # the list, shown as text, reads back the same
    p.close()


def test_launchpanel_resumes_a_stopped_run_with_the_form_config(gpu_lab_home):
    reg = Registry()
    old = TrainConfig(max_steps=20, lr=0.01, num_processes=2)
    reg.create_run("r-stopped", name="old", config=old.to_dict(), output_dir="/somewhere",
                   status="running")
    reg.set_status("r-stopped", "stopped", reason="the launching kernel exited")
    reg.create_run("r-ok", name="done", config=old.to_dict(), output_dir="/x", status="succeeded")
    launcher = LauncherDouble()
    p = LaunchPanel(train_fn=train_fn_double, launcher=launcher, dashboard_kw={"telemetry": False})
    assert [v for _, v in p.resume_choice.options] == [None, "r-stopped"]  # stopped/failed only
    assert p.resume_button.disabled
    p.resume_choice.value = "r-stopped"
    assert p.config.lr == 0.01 and p.config.max_steps == 20  # the run's config, in the form
    p.fields["max_steps"].input.value = "40"  # may change on resume
    p.detach.value = True
    p.resume_button.click()
    (fn, args, kw), = launcher.calls
    assert args[0].max_steps == 40 and kw == {"detach": True, "resume": "r-stopped"}
    p.close()


def test_launchpanel_shows_launch_errors(gpu_lab_home):
    """The real gpu_lab.launch refuses a CUDA-poisoned kernel; the panel shows why and stays usable."""
    from gpu_lab.launch.testing import fake_cuda_state

    p = LaunchPanel(train_fn=train_fn_double, config=TrainConfig(max_steps=3, num_processes=2))
    with fake_cuda_state(initialized=True):
        p.launch_button.click()
    assert "launch failed: PreflightError:" in p.status.value and "CUDA" in p.status.value
    assert p.run is None and not p.launch_button.disabled and p.stop_button.disabled


# --- Dashboard ---------------------------------------------------------------------------------
def test_dashboard_of_a_finished_run_from_the_registry(gpu_lab_home):
    reg = Registry()
    reg.create_run("old-run", name="old", num_processes=2, status="running")
    reg.add_metrics([("old-run", r, s, 1000.0 + s, "loss", 2.0 - s / 100) for s in range(50)
                     for r in (0, 1)])
    reg.set_status("old-run", "failed", error="rank 1: ValueError: boom [user code]")
    d = Dashboard("old-run")
    assert d.gpupanel is None  # no live GPUs to show for a run that ended
    assert d.liveplot.trace_points("loss", 0) == 50 and d.liveplot.trace_points("loss", 1) == 50
    assert d.liveplot.trace_points("loss", MEAN) == 50
    # the points are in the widget's initial state, which a view rendered later starts from
    initial = {(t["meta"]["metric"], t["meta"]["rank"]): len(t["y"])
               for t in d.liveplot.fig._widget_data}
    assert initial[("loss", 0)] == initial[("loss", 1)] == initial[("loss", MEAN)] == 50
    assert "failed" in d.info.status_line.value and "boom" in d.info.error_box.value
    assert repr(d) == "Dashboard(run='old-run', status='failed', telemetry=False)"
    with pytest.raises(KeyError, match="no run with id or name 'nope'.*recent runs: old-run"):
        Dashboard("nope")
    with pytest.raises(TypeError, match="expected a Run"):
        Dashboard(42)


def test_dashboard_status_shows_the_accuracy_and_the_samples_it_covers(gpu_lab_home):
    reg = Registry()
    reg.create_run("eval-run", name="eval", num_processes=2, status="succeeded")
    reg.add_metrics([("eval-run", r, 10, 1000.0, name, value) for r in (0, 1)
                     for name, value in (("loss", 0.5), ("accuracy", 0.9125),
                                         ("eval_samples", 297))])
    d = Dashboard("eval-run")
    assert "accuracy 0.9125 on 297 samples" in d.info.status_line.value
    d.close()


def test_dashboard_of_a_live_run_stops_telemetry_at_the_end():
    from gpu_lab.telemetry import sampler as sampler_mod

    run = RunDouble()
    d = Dashboard(run)
    assert d.gpupanel is not None and d.gpupanel.listening
    shared = sampler_mod.get_sampler()
    assert d.gpupanel.on_sample in shared._subs
    run.emit([metric(r, s, loss=1.0) for s in range(5) for r in (0, 1)])
    run.finish()
    wait_for(lambda: not d.gpupanel.listening, what="telemetry to stop after the run")
    wait_for(lambda: "succeeded" in d.info.status_line.value, what="the final status line")
    assert d.gpupanel.on_sample not in shared._subs
    d.close()


def test_error_box_shows_each_failed_rank_and_the_triage():
    import html

    from gpu_lab.failures.triage import RunError, from_exception
    from gpu_lab.widgets import RunInfo

    try:
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
    except RuntimeError as e:
        failure = from_exception(1, e)
    run = RunDouble(status="failed")
    run.error = RunError([failure])
    info = RunInfo(run)
    box = info.error_box.value
    assert info.error_box.layout.display is None
    assert "rank 1: RuntimeError" in box and "[out of memory]" in box
    assert "What to try (out of memory)" in box
    assert all(html.escape(s) in box for s in failure.suggestions)
    assert "<details><summary>traceback</summary>" in box and "Tried to allocate" in box
    assert "log of rank 0" in info.rank_logs[0].value and "log of rank 1" in info.rank_logs[1].value
    assert repr(info) == "RunInfo(run='run-double', status='failed')"
