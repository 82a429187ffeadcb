"""RunInfo: a run's status line, the tail of each rank's log, and an error box with the triage.

Updated from the receiver's tick (once a second for the status line; log files are re-read every
`log_every` seconds while the run is active, and once more at the end). It only sets traits of
HTML widgets: nothing here writes to an Output widget, so it is safe from a background thread.
"""
from __future__ import annotations

import html
import time
from typing import Any, Callable

import ipywidgets as W

from ..record import events as ev
from ..record.events import FINAL_STATUSES
from .throttle import Flusher, FollowsRun

STATUS_COLORS = {"pending": "#555", "running": "#1a7f37", "stopping": "#9a6700",
                 "succeeded": "#0969da", "failed": "#b00", "stopped": "#9a6700", "lost": "#b00"}


def status_html(run: Any, started: float | None = None) -> str:
    status = getattr(run, "status", "?")
    color = STATUS_COLORS.get(status, "#555")
    parts = [f"<b>{html.escape(str(getattr(run, 'name', '') or ''))}</b> "
             f"<code>{html.escape(str(getattr(run, 'id', '') or ''))}</code>",
             f"<span style='color:{color};font-weight:bold'>{html.escape(status)}</span>"]
    n = getattr(run, "num_processes", None)
    if n:
        dev = "GPU" if getattr(run, "device", "cpu") == "cuda" else "CPU"
        parts.append(f"{n} {dev} rank{'s' if n != 1 else ''}")
    m = getattr(run, "metrics", None)
    if m is not None:
        steps, _ = m.series("loss", m.ranks()[0]) if m.ranks() else ([], [])
        if steps:
            parts.append(f"step {int(steps[-1])}")
        loss = m.last("loss")
        if loss is not None:
            parts.append(f"loss {loss:.4g}")
        sps = m.last("samples_per_s")  # gpu_lab's fit loop reports the global rate on every rank
        if sps is not None:
            parts.append(f"{sps:,.0f} samples/s")
        accuracy = m.last("accuracy")
        if accuracy is not None:  # with the number of eval samples it covers (all ranks together)
            n = m.last("eval_samples")
            parts.append(f"accuracy {accuracy:.4g}" + (f" on {int(n):,} samples" if n else ""))
    if started is not None and status not in FINAL_STATUSES:
        el = int(time.time() - started)
        parts.append(f"{el // 60}:{el % 60:02d} elapsed")
    dropped = getattr(run, "dropped", 0)
    if dropped:
        parts.append(f"<span style='color:#9a6700'>{dropped} events dropped</span>")
    src = getattr(run, "resumed_from", None)
    if isinstance(src, dict) and src.get("step") is not None:
        parts.append(f"resumed from step {src['step']} "
                     f"<code title='{html.escape(str(src.get('path')))}'>"
                     f"{html.escape(str(src.get('run') or src.get('path')))}</code>")
    reason = getattr(run, "reason", None)
    if reason and status in FINAL_STATUSES and status != "failed":
        parts.append(html.escape(reason))
    return " · ".join(parts)


def error_html(err: Any) -> str:
    """The error box: each failed rank, what to try, the traceback folded away."""
    if err is None:
        return ""
    failures = getattr(err, "failures", None)
    if failures is None:  # a plain string (a finished run from the registry)
        return (f"<div style='border:1px solid #b00;padding:6px;color:#b00'>"
                f"<pre style='margin:0;white-space:pre-wrap'>{html.escape(str(err))}</pre></div>")
    out = ["<div style='border:1px solid #b00;padding:6px'>"]
    for f in failures:
        out.append(f"<div style='color:#b00'><b>rank {f.rank}: {html.escape(f.type)}</b>: "
                   f"{html.escape(f.message)} <i>[{html.escape(f.category)}]</i></div>")
        if f.traceback:
            out.append("<details><summary>traceback</summary><pre style='font-size:11px;"
                       f"white-space:pre-wrap'>{html.escape(f.traceback)}</pre></details>")
    first = getattr(err, "first", None)
    if first is not None and getattr(first, "explanation", ""):  # the triage's exact numbers
        out.append(f"<div><b>{html.escape(first.explanation)}</b></div>")
    if first is not None and first.suggestions:
        out.append(f"<div><b>What to try ({html.escape(first.category)}):</b><ol style='margin:2px 0'>")
        out += [f"<li>{html.escape(s)}</li>" for s in first.suggestions]
        out.append("</ol></div>")
    sup = getattr(err, "supervisor", None)
    if sup:
        out.append(f"<div>supervisor: {html.escape(str(sup))}</div>")
    out.append("</div>")
    return "".join(out)


class RunInfo(FollowsRun, W.VBox):
    """Status line + per-rank log tails + error box of one run."""

    def __init__(self, run: Any, *, log_lines: int = 15, log_every: float = 2.0,
                 max_hz: float = 1.0, clock: Callable[[], float] = time.monotonic,
                 attach: bool = True) -> None:
        self.run = run
        self.log_lines = log_lines
        self.log_every = log_every
        self._clock = clock
        self._started = time.time()
        self._last_logs = float("-inf")
        self._final_drawn = False
        self._attached = False
        self._flusher = Flusher(self._redraw, max_hz, clock)
        self._on_final: list[Callable[[Any], None]] = []
        self.status_line = W.HTML(status_html(run, self._started))
        n = int(getattr(run, "num_processes", 0) or 0)
        self.rank_logs = [W.HTML("") for _ in range(n)]
        self.supervisor_log = W.HTML("")
        tabs = self.rank_logs + [self.supervisor_log]
        self.logs = W.Tab(children=tabs, titles=[f"rank {r}" for r in range(n)] + ["supervisor"])
        self.logs_box = W.Accordion(children=[self.logs], titles=["logs (tail)"])
        self.error_box = W.HTML("", layout=W.Layout(display="none"))
        super().__init__([self.status_line, self.error_box, self.logs_box])
        self._redraw()
        if getattr(run, "status", None) in FINAL_STATUSES:
            self._final_drawn = True  # nothing will change: on_final callbacks run at once
        elif attach:
            self.attach()

    def on_final(self, fn: Callable[[Any], None]) -> None:
        """Call fn(run) once, on the receiver thread, after the run's final state is drawn."""
        self._on_final.append(fn)
        if self._final_drawn:
            fn(self.run)

    # --- following the run -------------------------------------------------------------------------
    def on_events(self, events: list) -> None:
        for e in events:
            if e.get("kind") in (ev.STATUS, ev.ERROR, ev.METRIC, ev.LOG, ev.DROPPED):
                self._flusher.mark()
                return

    def tick(self) -> None:
        final = getattr(self.run, "status", None) in FINAL_STATUSES
        if final:
            if self._final_drawn:
                return
            self._flusher.flush_now()  # the last word, whatever the throttle says
            self.detach()
            self._final_drawn = True
            for fn in self._on_final:
                try:
                    fn(self.run)
                except Exception:  # a broken callback must not break the view
                    import logging

                    logging.getLogger(__name__).exception("RunInfo on_final callback failed")
            return
        self._flusher.mark()  # elapsed time moves on
        self._flusher.maybe_flush()

    def _redraw(self) -> None:
        run = self.run
        line = status_html(run, self._started)
        if self.status_line.value != line:
            self.status_line.value = line
        final = getattr(run, "status", None) in FINAL_STATUSES
        now = self._clock()
        if final or now - self._last_logs >= self.log_every:
            self._last_logs = now
            self._read_logs()
        if final or getattr(run, "status", None) == "failed":
            err = getattr(run, "error", None)
            self.error_box.value = error_html(err)
            self.error_box.layout.display = None if err else "none"

    def _read_logs(self) -> None:
        logs = getattr(self.run, "logs", None)
        if logs is None:
            return
        for rank, w in enumerate(self.rank_logs):
            _set_pre(w, logs(rank, tail=self.log_lines))
        _set_pre(self.supervisor_log, logs(None, tail=self.log_lines))

    def close(self) -> None:
        if getattr(self, "_attached", False):
            self.detach()
        for w in getattr(self, "rank_logs", []) + [getattr(self, n, None) for n in (
                "supervisor_log", "logs", "logs_box", "status_line", "error_box")]:
            if w is not None:
                w.close()
        super().close()

    def __repr__(self) -> str:
        return f"RunInfo(run={getattr(self.run, 'id', None)!r}, status={getattr(self.run, 'status', None)!r})"


def _set_pre(w: W.HTML, text: str) -> None:
    value = (f"<pre style='font-size:11px;max-height:18em;overflow:auto;margin:0'>"
             f"{html.escape(text or '(empty)')}</pre>")
    if w.value != value:
        w.value = value
