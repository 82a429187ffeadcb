/**
 * Line charts for the run view and the comparison, drawn by uPlot.
 *
 * Why uPlot: a small library (tens of KB) made for fast live time series on a canvas, with axes,
 * ticks, drag-to-zoom, log scales and a cursor legend built in; plotly.js (what the notebook
 * widgets use) would add megabytes to this extension, since JupyterLab extensions do not share it.
 *
 * A chart takes a few named series, each with its own x values (ranks report at their own times),
 * and joins them on one x axis. Charts of one view with the same x share a cursor, so a drag zooms
 * all of them to the same x range; a double click (or the view's Reset zoom) shows everything
 * again. The tick labels each axis drew are kept on the chart's node (data-xticks, data-yticks),
 * and so are the steps each series holds (data-steps: "0-57,60-99"), so a test can read what a
 * person sees.
 */
import uPlot from 'uplot';

import { clockTicks, formatClock, formatTick, numberTicks } from './ticks';

export interface IChartSeries {
  label: string;
  x: ReadonlyArray<number>;
  y: ReadonlyArray<number>;
  color: string;
  /** line width in CSS pixels */
  width?: number;
  dash?: number[];
}

export interface IChartOptions {
  title: string;
  /** x values are Unix seconds (wall-clock ticks) rather than steps */
  time: boolean;
  logY?: boolean;
  /** the y axis' unit, shown after the title */
  unit?: string;
  height?: number;
  /** charts with the same key share the cursor (same x: same moment or step) */
  syncKey?: string;
  zoom?: ZoomGroup;
}

/** Charts that show everything again together (a drag zooms every chart that shares the
 *  dragged chart's syncKey: uPlot replays the drag on them). */
export class ZoomGroup {
  add(chart: SeriesChart): void {
    this._charts.add(chart);
  }

  remove(chart: SeriesChart): void {
    this._charts.delete(chart);
  }

  reset(): void {
    for (const c of this._charts) {
      c.resetZoom();
    }
  }

  private _charts = new Set<SeriesChart>();
}

/** Rank colours (tab10), the mean drawn thicker in the theme's text colour. */
export const PALETTE = [
  '#1f77b4',
  '#ff7f0e',
  '#2ca02c',
  '#d62728',
  '#9467bd',
  '#8c564b',
  '#e377c2',
  '#7f7f7f',
  '#bcbd22',
  '#17becf'
];

export function themeColor(name: string, fallback: string): string {
  const v = getComputedStyle(document.body).getPropertyValue(name).trim();
  return v || fallback;
}

const STEP_INCRS = Array.from({ length: 10 }, (_, e) => [1, 2, 5].map(m => m * 10 ** e)).flat();

export class SeriesChart {
  constructor(options: IChartOptions) {
    this._options = options;
    this.node = document.createElement('div');
    this.node.className = 'jp-GpuLab-chart';
    const title = document.createElement('div');
    title.className = 'jp-GpuLab-chart-title';
    title.textContent = options.title + (options.unit ? ` (${options.unit})` : '');
    this._plotNode = document.createElement('div');
    this._plotNode.className = 'jp-GpuLab-chart-plot';
    this._empty = document.createElement('div');
    this._empty.className = 'jp-GpuLab-chart-empty';
    this._empty.textContent = 'no points yet';
    this.node.append(title, this._plotNode, this._empty);
    options.zoom?.add(this);
    this._resize = new ResizeObserver(() => this._fit());
    this._resize.observe(this.node);
  }

  readonly node: HTMLDivElement;

  update(series: IChartSeries[]): void {
    this._series = series;
    const logY = !!this._options.logY;
    const withPoints = series.filter(s => s.x.length);
    this.node.dataset.series = JSON.stringify(
      Object.fromEntries(series.map(s => [s.label, s.x.length]))
    );
    if (!this._options.time) {
      this.node.dataset.steps = JSON.stringify(
        Object.fromEntries(series.map(s => [s.label, stepSpans(s.x)]))
      );
    }
    this._empty.style.display = withPoints.length ? 'none' : '';
    if (!withPoints.length) {
      return;
    }
    const tables = withPoints.map(s => sortedTable(s, logY));
    if (logY && tables.every(t => !t[0].length)) {
      this._destroyPlot();
      this._empty.textContent = 'nothing above 0 to draw on a log scale';
      this._empty.style.display = '';
      return;
    }
    this._empty.textContent = 'no points yet';
    const data = tables.length === 1 ? tables[0] : uPlot.join(tables);
    const key = withPoints.map(s => s.label).join('\u0000');
    if (!this._plot || key !== this._key) {
      this._destroyPlot();
      this._key = key;
      this._plot = new uPlot(this._plotOptions(withPoints), data, this._plotNode);
      this._plot.over.addEventListener('dblclick', () => this._options.zoom?.reset());
    } else {
      this._plot.setData(data, !this._zoomed);
    }
  }

  resetZoom(): void {
    this._zoomed = false;
    delete this.node.dataset.zoomed;
    if (this._plot && this._series) {
      this._plot.setData(this._plot.data, true);
    }
  }

  dispose(): void {
    this._options.zoom?.remove(this);
    this._resize.disconnect();
    this._destroyPlot();
  }

  private _plotOptions(series: IChartSeries[]): uPlot.Options {
    const o = this._options;
    const axisColor = themeColor('--jp-ui-font-color2', '#616161');
    const gridColor = themeColor('--jp-border-color2', '#e0e0e0');
    const axis = (idx: 0 | 1): uPlot.Axis => ({
      stroke: axisColor,
      grid: { stroke: gridColor, width: 1 },
      ticks: { stroke: gridColor, width: 1 },
      // the y axis as wide as its longest label (0.002999 needs more room than 0.5)
      size:
        idx === 1
          ? (u: uPlot, values: string[] | null) =>
              Math.max(40, 16 + 7 * Math.max(0, ...(values ?? []).map(v => (v ?? '').length)))
          : 36,
      // steps are whole numbers: no tick at step 2.5
      incrs: idx === 0 && !o.time ? STEP_INCRS : undefined,
      // labels told apart with as many digits (or the date) as uPlot's tick spacing needs
      values: (u, splits, axisIdx, space, incr) => {
        const labels = idx === 0 && o.time ? clockTicks(splits, incr) : numberTicks(splits, incr);
        this._ticks[idx] = labels.filter(l => l !== '');
        return labels;
      }
    });
    return {
      width: this._width(),
      height: o.height ?? 200,
      series: [
        {
          label: o.time ? 'time' : 'step',
          value: (u, v) => (v === null ? '–' : o.time ? formatClock(v) : String(v))
        },
        ...series.map(s => ({
          label: s.label,
          stroke: s.color,
          width: s.width ?? 1.25,
          dash: s.dash,
          spanGaps: true,
          points: { show: false },
          value: (u: uPlot, v: number | null) => (v === null ? '–' : formatTick(v))
        }))
      ],
      scales: {
        x: { time: o.time },
        y: o.logY ? { distr: 3 } : {}
      },
      axes: [axis(0), axis(1)],
      cursor: {
        drag: { x: true, y: false, setScale: true },
        sync: o.syncKey ? { key: o.syncKey } : undefined
      },
      legend: { live: true },
      hooks: {
        setSelect: [
          u => {
            if (u.select.width > 0) {
              this._zoomed = true; // live updates keep this x range until a reset
              this.node.dataset.zoomed = 'true';
            }
          }
        ],
        draw: [
          () => {
            this.node.dataset.xticks = this._ticks[0].join('|');
            this.node.dataset.yticks = this._ticks[1].join('|');
          }
        ]
      }
    };
  }

  private _width(): number {
    return Math.max(240, (this.node.clientWidth || 480) - 8);
  }

  private _fit(): void {
    if (this._plot && this.node.clientWidth > 0) {
      const width = this._width();
      if (Math.abs(width - this._plot.width) > 2) {
        this._plot.setSize({ width, height: this._options.height ?? 200 });
      }
    }
  }

  private _destroyPlot(): void {
    this._plot?.destroy();
    this._plot = null;
    this._key = '';
    this._plotNode.replaceChildren();
  }

  private readonly _options: IChartOptions;
  private _plotNode: HTMLDivElement;
  private _empty: HTMLDivElement;
  private _plot: uPlot | null = null;
  private _key = '';
  private _series: IChartSeries[] | null = null;
  private _zoomed = false;
  private _ticks: [string[], string[]] = [[], []];
  private _resize: ResizeObserver;
}

/** One series as a uPlot table [x, y], x ascending; non-positive y dropped on a log scale. */
function sortedTable(s: IChartSeries, logY: boolean): uPlot.AlignedData {
  let idx = s.x.map((_, i) => i);
  if (logY) {
    idx = idx.filter(i => s.y[i] > 0);
  }
  let sorted = true;
  for (let i = 1; i < idx.length; i++) {
    if (s.x[idx[i]] < s.x[idx[i - 1]]) {
      sorted = false;
      break;
    }
  }
  if (!sorted) {
    idx.sort((a, b) => s.x[a] - s.x[b]);
  }
  return [idx.map(i => s.x[i]), idx.map(i => s.y[i])];
}

/** Whole-number x values as runs: [0, 1, 2, 5, 6] → "0-2,5-6", [1, 1, 2] → "1,1-2" (a step
 *  held twice shows twice); "" where x is not whole numbers (time). */
function stepSpans(x: ReadonlyArray<number>): string {
  const sorted = [...x].sort((a, b) => a - b);
  const out: string[] = [];
  let start = 0;
  for (let i = 0; i < sorted.length; i++) {
    if (!Number.isInteger(sorted[i])) {
      return '';
    }
    if (i + 1 === sorted.length || sorted[i + 1] !== sorted[i] + 1) {
      out.push(start === i ? `${sorted[i]}` : `${sorted[start]}-${sorted[i]}`);
      start = i + 1;
    }
  }
  return out.join(',');
}
