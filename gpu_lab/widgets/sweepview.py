"""SweepView: a sweep in the notebook — its trials table, parallel coordinates, top trials' curves.

    gpu_lab.SweepView(sweep)      # or SweepView("sweep-…") from any kernel

The table has one row per trial (status, parameters, value, best and last value of the metric),
sorted by the chosen column. The parallel-coordinates plot shows the finished and pruned trials
(a pruned trial at its best value so far), one axis per parameter and one for the metric. The
curves are the metric of the `top` best trials' runs overlaid (gpu_lab.widgets.compare). While the
sweep runs, a background thread refreshes the view every `every` seconds and stops when it ends.
"""
from __future__ import annotations

import html
import threading
from typing import Any

from .compare import compare

SORT_KEYS = ("trial", "value", "best", "last", "status")


class SweepView:
    def __init__(self, sweep: Any, top: int = 3, every: float = 2.0, live: bool = True) -> None:
        import ipywidgets as w

        if isinstance(sweep, str):
            from ..sweep import attach_sweep

            sweep = attach_sweep(sweep)
        self.sweep, self.top, self.every = sweep, int(top), float(every)
        self.sort = w.Dropdown(options=SORT_KEYS, value="value", description="sort by")
        self.table = w.HTML()
        self.parallel = w.VBox()
        self.curves = w.VBox()
        self.parallel_figure = self.curves_figure = None
        self._drawn: tuple | None = None  # what the figures show: rebuilt only when it changes
        self.title = w.HTML()
        self.widget = w.VBox([self.title, self.sort, self.table, self.parallel, self.curves])
        self.sort.observe(lambda _: self._show_table(self.sweep.trials), names="value")
        self._stop = threading.Event()
        self.refresh()
        if live and not sweep.done:
            threading.Thread(target=self._follow, daemon=True,
                             name=f"gpu_lab-sweepview-{sweep.id}").start()

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)

    def close(self) -> None:
        self._stop.set()
        self.widget.close()

    def _follow(self) -> None:
        while not self._stop.wait(self.every):
            self.refresh()
            if self.sweep.done:
                self.refresh()
                return

    def refresh(self) -> None:
        rows = self.sweep.trials
        self.title.value = (f"<b>{html.escape(self.sweep.id)}</b>: {self.sweep.state}, "
                            f"{len(rows)}/{self.sweep.spec['trials']} trials, "
                            f"{self.sweep.metric} ({self.sweep.direction})")
        self._show_table(rows)
        drawn = tuple((r["trial"], r["status"], r["step"]) for r in rows)
        if drawn == self._drawn:
            return
        import plotly.graph_objects as go

        self._drawn = drawn
        self.parallel_figure = parallel_coordinates(self.sweep, rows)
        self.curves_figure = top_curves(self.sweep, rows, self.top)
        for box, fig in ((self.parallel, self.parallel_figure), (self.curves, self.curves_figure)):
            box.children = () if fig is None else (go.FigureWidget(fig),)

    def _show_table(self, rows: list[dict]) -> None:
        self.table.value = trials_table(rows, self.sort.value, self.sweep.direction)


def _order(rows: list[dict], key: str, direction: str) -> list[dict]:
    if key in ("trial", "status"):
        return sorted(rows, key=lambda r: r[key])
    best_first = direction == "maximize"
    missing = [r for r in rows if r[key] is None]
    have = sorted((r for r in rows if r[key] is not None), key=lambda r: r[key],
                  reverse=best_first)
    return have + missing


def trials_table(rows: list[dict], sort: str = "value", direction: str = "maximize") -> str:
    """The trials as an HTML table, sorted by `sort` (the best first for a value column)."""
    params = sorted({k for r in rows for k in r["params"]})
    head = ["trial", "status", *params, "value", "best", "last", "step", "runs"]

    def cell(v: Any) -> str:
        text = f"{v:.4g}" if isinstance(v, float) else ("" if v is None else str(v))
        return f"<td>{html.escape(text)}</td>"

    body = ["<tr>" + "".join(cell(v) for v in (
        r["trial"], r["status"], *(r["params"].get(p) for p in params), r["value"], r["best"],
        r["last"], r["step"], " ".join(r["runs"]))) + "</tr>" for r in _order(rows, sort, direction)]
    return ("<table><thead><tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr></thead><tbody>"
            + "".join(body) + "</tbody></table>")


def parallel_coordinates(sweep: Any, rows: list[dict]):
    """A plotly Figure: one line per finished or pruned trial; None before there is one."""
    import plotly.graph_objects as go

    done = [r for r in rows if r["status"] in ("complete", "pruned")]
    if not done:
        return None
    dims = []
    for p in sorted({k for r in done for k in r["params"]}):
        values = [r["params"].get(p) for r in done]
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            dims.append({"label": p, "values": values})
        else:  # a choice: one tick per value
            labels = sorted({str(v) for v in values})
            dims.append({"label": p, "values": [labels.index(str(v)) for v in values],
                         "tickvals": list(range(len(labels))), "ticktext": labels})
    score = [r["value"] if r["value"] is not None else r["best"] for r in done]
    score = [s if s is not None else float("nan") for s in score]
    dims.append({"label": sweep.metric, "values": score})
    dims.append({"label": "pruned", "values": [int(r["status"] == "pruned") for r in done],
                 "tickvals": [0, 1], "ticktext": ["no", "yes"]})
    fig = go.Figure(go.Parcoords(line={"color": score, "colorscale": "Viridis",
                                       "showscale": True}, dimensions=dims))
    fig.update_layout(title=f"{len(done)} trials: finished and pruned", template="plotly_white")
    return fig


def top_curves(sweep: Any, rows: list[dict], top: int = 3):
    """The metric of the best `top` trials' runs overlaid; None before any has a value."""
    ranked = [r for r in _order(rows, "best", sweep.direction) if r["best"] is not None][:top]
    runs = [run for r in ranked for run in r["runs"]]
    if not runs:
        return None
    fig = compare(runs, metric=sweep.metric, x="step")
    fig.update_layout(title=f"{sweep.metric}: the {len(ranked)} best trials")
    return fig


__all__ = ["SweepView", "trials_table", "parallel_coordinates", "top_curves"]
