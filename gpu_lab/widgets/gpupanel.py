"""GPUPanel: per-GPU utilisation, memory, temperature and power over time, host CPU / RAM / IO,
and a compact table of current values.

It listens to the process-wide telemetry sampler (one thread for every panel and the server
extension) and redraws on that thread, at most `max_hz` times a second, one batch_update per figure.
It highlights the two usual warnings: memory at or above 95% (the next
allocation may OOM) and utilisation below 70% (the GPU waits, usually for data).
Host metrics are always shown, so the panel says something useful on a machine without a GPU.
"""
from __future__ import annotations

import collections
import html
import time
from typing import Any, Callable

import ipywidgets as W

from ..telemetry import Sampler, get_sampler
from .liveplot import COLORS, as_dates
from .throttle import Flusher, Flushes, MAX_HZ

MEM_HIGH_PCT = 95.0
UTIL_LOW_PCT = 70.0

GPU_PANELS = (("util_gpu", "GPU utilisation %"), ("mem_used_pct", "memory used %"),
              ("temperature_c", "temperature °C"), ("power_w", "power W"))
HOST_PANELS = (("cpu_pct", "host CPU %"), ("ram_pct", "host RAM %"), ("io", "disk / net MB/s"))
IO_SERIES = (("disk_read_mbps", "disk read"), ("disk_write_mbps", "disk write"),
             ("net_recv_mbps", "net recv"), ("net_sent_mbps", "net sent"))


def _column(values: list) -> Any:
    """A float array for plotly (binary on the wire, no per-element validation); None -> NaN gap."""
    import numpy as np

    return np.array([np.nan if v is None else v for v in values], dtype=float)


def _fmt(v: Any, spec: str = ".0f", unit: str = "") -> str:
    if v is None:
        return "–"
    return f"{v:{spec}}{unit}"


class GPUPanel(Flushes, W.VBox):
    """Live telemetry. GPUPanel() follows get_sampler(); pass `sampler=` to use another (tests).

    `window`: how many samples the plots keep (300 at the default 1 s interval = 5 minutes).
    `pid`: a process (a run's supervisor) whose tree's GPU memory the table lists.
    """

    def __init__(self, sampler: Sampler | None = None, *, window: int = 300, pid: int | None = None,
                 max_hz: float = MAX_HZ, clock: Callable[[], float] = time.monotonic,
                 height: int = 420, width: int | None = 1000, start: bool = True) -> None:
        import plotly.graph_objects as go
        from plotly.subplots import make_subplots

        if isinstance(window, bool) or not isinstance(window, int) or window < 2:
            raise ValueError(f"GPUPanel window: got {window!r}; expected an int >= 2")
        self.sampler = sampler if sampler is not None else get_sampler()
        self.pid = pid
        self.samples: collections.deque = collections.deque(maxlen=window)
        self._flusher = Flusher(self._redraw, max_hz, clock)
        self._gpu_traces: dict[tuple[str, int], int] = {}
        self._listening = False
        self.stopped_reason: str | None = None

        self.notice = W.HTML("", layout=W.Layout(display="none"))
        self.table = W.HTML("<i>waiting for the first telemetry sample…</i>")
        self._height, self._width = height, width
        self._built = False  # the figures became widgets (they start as plain figures)
        # The GPU figure exists only once a sample has GPUs: a host without any (CPU-only, no
        # driver) gets no hidden plotly widget (each one ships plotly.js, ~5 MB, to the browser).
        self.gpu_fig: Any = None
        # As in LivePlot: layout, traces and the first draw go into the figures before they
        # become widgets, so a view rendered later (or before plotly's module loaded) has them.
        self.host_fig = make_subplots(rows=1, cols=3, subplot_titles=[t for _, t in HOST_PANELS],
                                      horizontal_spacing=0.07)
        self.host_fig.update_layout(height=230, width=width, margin=dict(l=45, r=15, t=40, b=30),
                                    template="plotly_white", uirevision="gpu_lab", showlegend=False)
        self.host_fig.update_xaxes(type="date")
        self.host_fig.update_yaxes(range=[0, 105], col=1)
        self.host_fig.update_yaxes(range=[0, 105], col=2)
        self.host_fig.add_scatter(x=[], y=[], name="CPU", mode="lines", meta={"metric": "cpu_pct"},
                                  line=dict(color=COLORS[0]), row=1, col=1)
        self.host_fig.add_scatter(x=[], y=[], name="RAM", mode="lines", meta={"metric": "ram_pct"},
                                  line=dict(color=COLORS[1]), row=1, col=2)
        for i, (key, label) in enumerate(IO_SERIES):
            self.host_fig.add_scatter(x=[], y=[], name=label, mode="lines", meta={"metric": key},
                                      line=dict(color=COLORS[2 + i], width=1.2), row=1, col=3)
        self.gpu_box = W.Box([], layout=W.Layout(display="none"))
        for smp in self.sampler.history():
            self.samples.append(smp)
        if not self.samples:  # one sample now, so the panel (and its GPU traces) exist at once
            self.samples.append(self.sampler.sample_once())
        self._flusher.flush_now()
        if self.gpu_fig is not None:
            self.gpu_fig = go.FigureWidget(self.gpu_fig)
            self.gpu_box.children = (self.gpu_fig,)
        self.host_fig = go.FigureWidget(self.host_fig)
        self._built = True
        super().__init__([self.notice, self.table, self.gpu_box, self.host_fig])
        if start:
            self.start()

    # --- listening -------------------------------------------------------------------------------
    def start(self) -> None:
        """Follow the sampler (its thread starts if this is the first listener)."""
        if not self._listening:
            self.stopped_reason = None
            if self.pid is not None:
                self.sampler.watch(self.pid)
            self.sampler.subscribe(self.on_sample)
            self._listening = True

    def stop(self, reason: str | None = None) -> None:
        """Stop following; the plots keep what they show. The sampler thread ends if we were its
        last listener."""
        if self._listening:
            self.sampler.unsubscribe(self.on_sample)
            self._listening = False
            self.stopped_reason = reason
            if self.pid is not None:
                self.sampler.unwatch(self.pid)
            if not self.samples:  # stopped before the first sample arrived: show one anyway
                latest = self.sampler.latest()
                self.samples.append(latest if latest is not None else self.sampler.sample_once())
            if reason or self._flusher.dirty:
                self._flusher.flush_now()  # show the last sample and why the plots stopped

    @property
    def listening(self) -> bool:
        return self._listening

    def on_sample(self, sample: dict) -> None:
        """The sampler thread's callback: keep the sample and redraw. The sampler's interval is
        clamped to >= 0.25 s, so this is already at most 4 redraws a second; the throttle only
        guards against a sampler shared with a faster, injected clock."""
        self.samples.append(sample)
        self._flusher.mark()
        if self._flusher.throttle.min_interval <= self.sampler.interval:
            self._flusher.flush_now()
        else:
            self._flusher.maybe_flush()

    # --- drawing ---------------------------------------------------------------------------------
    def _redraw(self) -> None:

        samples = list(self.samples)
        if not samples:
            return
        latest = samples[-1]
        xs = as_dates([s["t"] for s in samples])
        gpus = latest.get("gpus") or []
        notice = self.sampler.notice if not gpus else None
        if self.stopped_reason:
            notice = (notice + " · " if notice else "") + f"telemetry stopped: {self.stopped_reason}"
        self.notice.value = f"<span style='color:#666'>{html.escape(notice)}</span>" if notice else ""
        self.notice.layout.display = None if notice else "none"
        self.table.value = self._table_html(latest)
        if gpus:
            self.gpu_box.layout.display = None
            self._redraw_gpus(samples, xs, gpus)
        with self.host_fig.batch_update():
            for i, key in enumerate(["cpu_pct", "ram_pct"] + [k for k, _ in IO_SERIES]):
                self.host_fig.data[i].x = xs
                self.host_fig.data[i].y = _column([s["host"].get(key) for s in samples])

    def _new_gpu_figure(self) -> Any:
        from plotly.subplots import make_subplots

        fig = make_subplots(rows=2, cols=2, subplot_titles=[t for _, t in GPU_PANELS],
                            vertical_spacing=0.16, horizontal_spacing=0.08)
        fig.update_layout(height=self._height, width=self._width,
                          margin=dict(l=45, r=15, t=40, b=30), template="plotly_white",
                          uirevision="gpu_lab", legend=dict(orientation="h", y=1.1, x=1, xanchor="right"))
        fig.update_xaxes(type="date")
        fig.update_yaxes(range=[0, 105], row=1)
        # the thresholds the table highlights
        fig.add_hline(y=UTIL_LOW_PCT, line=dict(dash="dot", color="#b58900", width=1), row=1, col=1)
        fig.add_hline(y=MEM_HIGH_PCT, line=dict(dash="dot", color="#b00", width=1), row=1, col=2)
        return fig

    def _redraw_gpus(self, samples: list[dict], xs: list[float], gpus: list[dict]) -> None:
        if self.gpu_fig is None:
            self.gpu_fig = self._new_gpu_figure()
            if self._built:
                # GPUs showed up after construction (rare): draw into the plain figure first, so
                # the widget's initial state has the traces and points, then show it
                self._draw_gpus(samples, xs, gpus)
                import plotly.graph_objects as go

                self.gpu_fig = go.FigureWidget(self.gpu_fig)
                self.gpu_box.children = (self.gpu_fig,)
                return
        self._draw_gpus(samples, xs, gpus)

    def _draw_gpus(self, samples: list[dict], xs: list[float], gpus: list[dict]) -> None:
        for g in gpus:
            for col, (key, _title) in enumerate(GPU_PANELS):
                k = (key, g["index"])
                if k not in self._gpu_traces:
                    row, c = divmod(col, 2)
                    self.gpu_fig.add_scatter(x=[], y=[], mode="lines", name=f"GPU {g['index']}",
                                             legendgroup=f"GPU {g['index']}", showlegend=col == 0,
                                             line=dict(color=COLORS[g["index"] % len(COLORS)]),
                                             meta={"metric": key, "gpu": g["index"]},
                                             row=row + 1, col=c + 1)
                    self._gpu_traces[k] = len(self.gpu_fig.data) - 1
        with self.gpu_fig.batch_update():
            for (key, gpu), idx in self._gpu_traces.items():
                ys = []
                for s in samples:
                    gs = s.get("gpus") or []
                    ys.append(gs[gpu].get(key) if gpu < len(gs) else None)
                self.gpu_fig.data[idx].x = xs
                self.gpu_fig.data[idx].y = _column(ys)

    def _table_html(self, s: dict) -> str:
        cell = "padding:2px 8px;text-align:right"
        warn = "background:#fff3cd"   # utilisation below 70%
        bad = "background:#f8d7da"    # memory at or above 95%
        head = ("<tr style='font-weight:bold'>" + "".join(
            f"<td style='{cell}'>{h}</td>" for h in
            ("GPU", "util", "memory", "temp", "power", "SM clock", "PCIe tx/rx MB/s", "P", "throttle",
             "run's memory")) + "</tr>")
        rows = []
        for g in s.get("gpus") or []:
            util, memp = g.get("util_gpu"), g.get("mem_used_pct")
            u_style = f"{cell};{warn}" if util is not None and util < UTIL_LOW_PCT else cell
            m_style = f"{cell};{bad}" if memp is not None and memp >= MEM_HIGH_PCT else cell
            procs = g.get("process_mem_mb") or {}
            mine = f"{sum(procs.values()) / 1024:.1f} GiB ({len(procs)} proc)" if procs else "–"
            rows.append(
                "<tr>"
                f"<td style='{cell};text-align:left' title='{html.escape(g.get('uuid') or '')}'>"
                f"{g['index']} · {html.escape(g.get('name') or '')}</td>"
                f"<td style='{u_style}'>{_fmt(util, '.0f', '%')}</td>"
                f"<td style='{m_style}'>{_fmt(g.get('mem_used_mb'), '.0f')}/"
                f"{_fmt(g.get('mem_total_mb'), '.0f')} MiB ({_fmt(memp, '.0f', '%')})</td>"
                f"<td style='{cell}'>{_fmt(g.get('temperature_c'), '.0f', '°C')}</td>"
                f"<td style='{cell}'>{_fmt(g.get('power_w'), '.0f')}/{_fmt(g.get('power_limit_w'), '.0f')} W</td>"
                f"<td style='{cell}'>{_fmt(g.get('clock_sm_mhz'), '.0f')}/{_fmt(g.get('clock_sm_max_mhz'), '.0f')} MHz</td>"
                f"<td style='{cell}'>{_fmt(g.get('pcie_tx_mbps'), '.0f')}/{_fmt(g.get('pcie_rx_mbps'), '.0f')}</td>"
                f"<td style='{cell}'>{_fmt(g.get('pstate'), 'd')}</td>"
                f"<td style='{cell}'>{html.escape(', '.join(g.get('throttle') or []) or '–')}</td>"
                f"<td style='{cell}'>{mine}</td></tr>")
        h = s.get("host") or {}
        cores = h.get("cpu_per_core") or []
        core_txt = " ".join(f"{c:.0f}" for c in cores[:64])
        host = (
            "<div style='margin-top:4px'><b>host</b> · "
            f"CPU {_fmt(h.get('cpu_pct'), '.0f', '%')} of {h.get('cpu_count', '?')} cores "
            f"<span style='color:#888' title='per core %'>[{core_txt}]</span> · "
            f"RAM {_fmt(h.get('ram_used_mb', None) and h['ram_used_mb'] / 1024, '.1f')}/"
            f"{_fmt(h.get('ram_total_mb', None) and h['ram_total_mb'] / 1024, '.1f')} GiB "
            f"({_fmt(h.get('ram_pct'), '.0f', '%')}) · swap {_fmt(h.get('swap_pct'), '.0f', '%')} · "
            f"disk r/w {_fmt(h.get('disk_read_mbps'), '.1f')}/{_fmt(h.get('disk_write_mbps'), '.1f')} MB/s · "
            f"net rx/tx {_fmt(h.get('net_recv_mbps'), '.1f')}/{_fmt(h.get('net_sent_mbps'), '.1f')} MB/s · "
            f"load {_fmt(h.get('load_1'), '.2f')} {_fmt(h.get('load_5'), '.2f')} "
            f"{_fmt(h.get('load_15'), '.2f')}</div>")
        table = (f"<table style='border-collapse:collapse;font-size:12px'>{head}{''.join(rows)}</table>"
                 if rows else "")
        legend = ("<div style='font-size:11px;color:#666'>highlighted: "
                  f"<span style='{warn}'>utilisation &lt; {UTIL_LOW_PCT:.0f}%</span> "
                  f"<span style='{bad}'>memory ≥ {MEM_HIGH_PCT:.0f}%</span></div>" if rows else "")
        return f"<div style='font-size:12px'>{table}{legend}{host}</div>"

    # --- housekeeping ----------------------------------------------------------------------------
    def close(self) -> None:
        if getattr(self, "_listening", False):
            self.stop()
        for name in ("notice", "table", "gpu_fig", "gpu_box", "host_fig"):
            w = getattr(self, name, None)
            if w is not None and hasattr(w, "close"):
                w.close()
        super().close()

    def __repr__(self) -> str:
        latest = self.samples[-1] if self.samples else {}
        return (f"GPUPanel(gpus={len(latest.get('gpus') or [])}, samples={len(self.samples)}, "
                f"listening={self._listening})")
