"""LivePlot: loss per rank and their mean, plus throughput, learning rate and data-wait panels.

Data path: the training ranks call gpu_lab.report(step, loss=..., lr=..., samples_per_s=...);
the kernel's receiver thread puts the events into the run's bounded MetricHistory and calls our
`on_events`, which only marks the plot dirty. The receiver's tick (~4 Hz) calls `tick`, which
redraws at most `max_hz` times a second with exactly one `fig.batch_update()`. Every trace is
reduced to at most `max_points` by min/max decimation, so a loss spike stays visible and a
million-step run sends the browser what a two-thousand-step run does.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Iterable, Sequence

import ipywidgets as W

from ..record import events as ev
from ..record import mean
from ..record.events import FINAL_STATUSES
from ..readers.history import MetricHistory
from ..record.decimate import minmax_indices
from .throttle import MAX_HZ, Flusher, FollowsRun

LOSS = "loss"
MEAN = -1  # the "rank" of the mean-of-ranks trace

#: The small panels under the loss plot: key, title, the metric names that feed it (first found
#: wins), and whether one trace per rank is drawn (False: the lowest rank only, e.g. the lr).
#: "data_wait/step_time" is a ratio of two reported metrics: gpu_lab's fit loop reports the mean
#: seconds per step spent waiting for the DataLoader (data_wait) and the mean step time.
PANELS: tuple[tuple[str, str, tuple[str, ...], bool], ...] = (
    ("throughput", "samples/s", ("samples_per_s", "samples_per_sec", "throughput"), True),
    ("lr", "learning rate", ("lr", "learning_rate"), False),
    ("data_wait", "data-wait fraction", ("data_wait_frac", "data_wait_fraction",
                                         "data_wait/step_time"), True),
)

COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
          "#bcbd22", "#17becf")


def ema(values: Sequence[float], weight: float) -> list[float]:
    """TensorBoard's debiased exponential moving average (weight 0: no smoothing)."""
    out, last = [], 0.0
    for i, v in enumerate(values, 1):
        last = last * weight + (1.0 - weight) * v
        out.append(last / (1.0 - weight**i) if weight < 1.0 else v)
    return out


def as_dates(seconds: Any) -> Any:
    """Wall-clock seconds -> datetime64[ms] for a plotly date axis. (The widget's plotly.js draws
    nothing for plain epoch-millisecond numbers on a date axis; datetimes travel as ISO text.)"""
    import numpy as np

    return (np.asarray(seconds, dtype=float) * 1000.0).astype("int64").astype("datetime64[ms]")


def decimate(x: Any, y: Any, n: int) -> tuple[Any, Any]:
    """x, y (numpy arrays) reduced to at most n points (gpu_lab.record.decimate.minmax_indices)."""
    import numpy as np

    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    idx = minmax_indices(y, n)
    return x[idx], y[idx]


class LivePlot(FollowsRun, W.VBox):
    """Live training curves of one run.

    LivePlot(run) follows a launched Run (its `metrics` history and event stream). LivePlot()
    without a run owns a history: feed it with `on_events(events)` and redraw with `tick()`;
    LivePlot(history=h) draws a finished run's history once.

    Redraws happen at most `max_hz` times a second and take at most `max_share` of one core
    (a slow redraw makes the next one wait longer; None: no such cap). The default, 1%, keeps a
    CPU-bound run within 1-2% of its speed without a dashboard on a 2-core host (see
    bench/dashboard_overhead.py) and still redraws about 3 times a second at the largest history.
    """

    def __init__(self, run: Any = None, *, history: MetricHistory | None = None,
                 max_points: int = 2000, x: str = "step", log_y: bool = False,
                 smoothing: float = 0.0, max_hz: float = MAX_HZ, max_share: float | None = 0.01,
                 clock: Callable[[], float] = time.monotonic, height: int = 460,
                 width: int | None = 1000, attach: bool = True) -> None:
        import plotly.graph_objects as go
        from plotly.subplots import make_subplots

        if isinstance(max_points, bool) or not isinstance(max_points, int) or max_points < 4:
            raise ValueError(f"LivePlot max_points: got {max_points!r}; expected an int >= 4")
        if x not in ("step", "time"):
            raise ValueError(f"LivePlot x: got {x!r}; accepted: 'step', 'time'")
        if not 0.0 <= smoothing < 1.0:
            raise ValueError(f"LivePlot smoothing: got {smoothing!r}; expected 0 <= smoothing < 1")
        self.run = run
        self.max_points = max_points
        if history is not None:
            self.history, self._owns_history = history, False
        elif run is not None and isinstance(getattr(run, "metrics", None), MetricHistory):
            self.history, self._owns_history = run.metrics, False  # the Run fills it before us
        else:
            self.history, self._owns_history = MetricHistory(capacity=2 * max_points), True
        self._flusher = Flusher(self._redraw, max_hz, clock, max_share)
        self._traces: dict[tuple[str, int], int] = {}
        self._layout_set: dict[tuple, str] = {}  # layout values _redraw last set
        self.events = 0
        self._final = False
        self._attached = False

        # Everything known at construction goes into the figure *before* it becomes a widget:
        # the browser builds a view from the widget's initial state and applies later deltas, and
        # deltas sent before the frontend has loaded plotly's module are lost. So the layout, one
        # trace per expected rank and metric, and the first draw are all part of that state, and
        # every later redraw sends whole arrays (a view that missed one catches up at the next).
        self.fig = make_subplots(rows=2, cols=3, specs=[[{"colspan": 3}, None, None], [{}, {}, {}]],
                                 row_heights=[0.64, 0.36], vertical_spacing=0.14,
                                 horizontal_spacing=0.07,
                                 subplot_titles=["loss"] + [f"{p[1]} (not reported)" for p in PANELS])
        self.fig.update_layout(height=height, width=width, margin=dict(l=50, r=20, t=40, b=40),
                               legend=dict(orientation="h", yanchor="bottom", y=1.04, x=1,
                                           xanchor="right"),
                               template="plotly_white", uirevision="gpu_lab")
        self.fig.update_yaxes(rangemode="tozero", row=2)
        self.fig.update_xaxes(type="date" if x == "time" else "linear")
        self.fig.update_yaxes(type="log" if log_y else "linear", row=1, col=1)
        n = int(getattr(run, "num_processes", 0) or 0)
        for r in range(n):
            self._ensure_trace(LOSS, r, (1, 1))
        if n >= 2:
            self._ensure_trace(LOSS, MEAN, (1, 1))
        for col, (key, _title, _aliases, per_rank) in enumerate(PANELS, start=1):
            for r in range(n if per_rank else min(n, 1)):
                self._ensure_trace(key, r, (2, col))

        self.x_toggle = W.ToggleButtons(options=[("step", "step"), ("wall time", "time")], value=x,
                                        style={"button_width": "80px"},
                                        tooltips=["x: optimizer step", "x: wall-clock time"])
        self.ema_box = W.Checkbox(value=smoothing > 0, description="EMA smoothing", indent=False,
                                  layout=W.Layout(width="130px"))
        self.smoothing = W.FloatSlider(value=smoothing or 0.6, min=0.0, max=0.99, step=0.01,
                                       readout_format=".2f", layout=W.Layout(width="200px"),
                                       disabled=smoothing == 0)
        self.log_box = W.Checkbox(value=log_y, description="log y", indent=False,
                                  layout=W.Layout(width="80px"))
        self.flush()  # the first draw, into the plain figure
        self.fig = go.FigureWidget(self.fig)
        for w in (self.x_toggle, self.ema_box, self.smoothing, self.log_box):
            w.observe(self._on_control, names="value")
        controls = W.HBox([W.HTML("x axis&nbsp;"), self.x_toggle, self.ema_box, self.smoothing,
                           self.log_box],
                          layout=W.Layout(align_items="center", flex_flow="row wrap"))
        super().__init__([controls, self.fig])
        if attach and run is not None and hasattr(run, "subscribe"):
            self.attach()

    # --- data in -----------------------------------------------------------------------------------
    def attach(self) -> None:
        """Follow the run: its events mark the plot dirty, the receiver's tick redraws."""
        if self._attached or self.run is None:
            return
        super().attach()
        # Whatever arrived between the last draw and now (the run may even have ended meanwhile)
        # is in the run's history: draw it at the next tick; a run that has ended is then left.
        self._flusher.mark()
        if getattr(self.run, "status", None) in FINAL_STATUSES:
            self._final = True

    def on_events(self, events: Iterable[dict]) -> None:
        """Receive a batch of events (any thread). Cheap: no drawing happens here."""
        for e in events:
            self.events += 1
            kind = e.get("kind")
            if kind == ev.METRIC:
                if self._owns_history:
                    self.history.add(e["rank"], e.get("step"), e["t"], e["data"])
                self._flusher.mark()
            elif ev.ends_run(e):
                self._final = True
                self._flusher.mark()

    def tick(self) -> None:
        """Called by the receiver thread about every 0.25 s: redraw if due. After the run ended
        and the last points are drawn, stop following it."""
        if self._final:
            if getattr(self.run, "status", "succeeded") not in FINAL_STATUSES:
                return  # a status event ahead of Run._finish; wait for the handle to agree
            if self._flusher.dirty:
                self._flusher.flush_now()  # the last points, whatever the throttle says
            self.detach()
            return
        self._flusher.maybe_flush()

    # --- drawing -----------------------------------------------------------------------------------
    def _on_control(self, change: dict) -> None:
        self.smoothing.disabled = not self.ema_box.value
        self.flush()

    def _wanted(self) -> list[tuple[str, int, str, tuple[int, int]]]:
        """(trace key, rank, metric name, (row, col)) of every trace the data calls for."""
        names = set(self.history.names())
        ranks = self.history.ranks()
        out = []
        loss_ranks = [r for r in ranks if self.history.count(LOSS, r)] if LOSS in names else []
        for r in loss_ranks:
            out.append((LOSS, r, LOSS, (1, 1)))
        if len(loss_ranks) >= 2:
            out.append((LOSS, MEAN, LOSS, (1, 1)))
        for col, (key, _title, aliases, per_rank) in enumerate(PANELS, start=1):
            metric = next((a for a in aliases if all(part in names for part in a.split("/"))), None)
            if metric is None:
                continue
            have = [r for r in ranks if self.history.count(metric.split("/")[0], r)]
            for r in have if per_rank else have[:1]:
                out.append((key, r, metric, (2, col)))
        return out

    def _ensure_trace(self, key: str, rank: int, row_col: tuple[int, int]) -> int:
        idx = self._traces.get((key, rank))
        if idx is not None:
            return idx
        color = "#111111" if rank == MEAN else COLORS[rank % len(COLORS)]
        name = "mean" if rank == MEAN else f"rank {rank}"
        self.fig.add_scatter(x=[], y=[], mode="lines", name=name, legendgroup=name,
                             showlegend=key == LOSS,
                             line=dict(color=color, width=2.4 if rank == MEAN else 1.2),
                             meta={"metric": key, "rank": rank}, row=row_col[0], col=row_col[1])
        idx = self._traces[(key, rank)] = len(self.fig.data) - 1
        return idx

    def _points(self, metric: str, rank: int) -> tuple[Any, Any, Any]:
        """(steps, times, values) as float arrays, each list converted once per redraw."""
        import numpy as np

        if "/" in metric:  # a ratio of two metrics, on the numerator's steps
            num, den = metric.split("/")
            steps, times, values = self._points(num, rank)
            dsteps, _, dvalues = self._points(den, rank)
            if not len(steps) or not len(dsteps):
                empty = np.empty(0)
                return empty, empty, empty
            d = np.interp(steps, dsteps, dvalues)
            with np.errstate(divide="ignore", invalid="ignore"):
                ratio = np.where(d > 0, values / d, np.nan)
            return steps, times, ratio
        steps, values = self.history.series(metric, rank)
        times = self.history.times(metric, rank)
        n = min(len(steps), len(times), len(values))  # a write may land between the two reads
        return (np.asarray(steps[:n], dtype=float), np.asarray(times[:n], dtype=float),
                np.asarray(values[:n], dtype=float))

    def _redraw(self) -> None:
        import numpy as np

        use_time = self.x_toggle.value == "time"
        weight = self.smoothing.value if self.ema_box.value else 0.0
        wanted = self._wanted()
        for key, rank, _metric, rc in wanted:  # new traces can't be added inside batch_update
            self._ensure_trace(key, rank, rc)
        data: dict[int, tuple[Any, Any]] = {}
        loss_series, loss_raw = [], True
        for key, rank, metric, _rc in wanted:
            if rank == MEAN:
                # exact per step unless a rank's history was decimated (record.mean's rule)
                steps, times, values = mean.over_ranks(loss_series, exact=loss_raw)
            else:
                steps, times, values = self._points(metric, rank)
                if key == LOSS:
                    loss_series.append((steps, times, values))
                    loss_raw = loss_raw and self.history.count(metric, rank) == len(values)
            if key == LOSS and weight > 0:
                values = ema(values, weight)
            xs = np.asarray(times if use_time else steps, dtype=float)
            xs, ys = decimate(xs, values, self.max_points)
            data[self._traces[(key, rank)]] = (as_dates(xs) if use_time else xs, ys)
        reported = {k for k, *_ in wanted}
        # Layout changes are rare: compare with what was last set here rather than reading the
        # figure back (each plotly property read walks its validators: most of a redraw's cost).
        layout: dict[tuple, str] = {}
        for i, (key, title, _aliases, _per_rank) in enumerate(PANELS, start=1):
            layout[("annotations", i)] = title if key in reported else f"{title} (not reported)"
        for ax in ("xaxis", "xaxis2", "xaxis3", "xaxis4"):
            layout[(ax,)] = "date" if use_time else "linear"
        layout[("yaxis",)] = "log" if self.log_box.value else "linear"
        changed = {k: v for k, v in layout.items() if self._layout_set.get(k) != v}
        traces = self.fig.data
        with self.fig.batch_update():
            for idx, (xs, ys) in data.items():
                traces[idx].x = xs
                traces[idx].y = ys
            for k, v in changed.items():
                if k[0] == "annotations":
                    self.fig.layout.annotations[k[1]].text = v
                else:
                    self.fig.layout[k[0]].type = v
        self._layout_set.update(changed)

    # --- inspection --------------------------------------------------------------------------------
    def trace_points(self, metric: str = LOSS, rank: int = 0) -> int:
        """How many points the figure holds for one trace (rank=-1: the mean)."""
        idx = self._traces.get((metric, rank))
        if idx is None:
            return 0
        y = self.fig.data[idx].y
        return 0 if y is None else len(y)

    def close(self) -> None:
        if getattr(self, "_attached", False):
            self.detach()
        for name in ("fig", "x_toggle", "ema_box", "smoothing", "log_box"):
            w = getattr(self, name, None)
            if w is not None:
                w.close()
        super().close()

    def __repr__(self) -> str:
        run = getattr(self.run, "id", None)
        return (f"LivePlot(run={run!r}, ranks={self.history.ranks()}, "
                f"points={self.history.count(LOSS)}, x={self.x_toggle.value!r})")
