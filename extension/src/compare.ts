/**
 * Runs compared in the main area: each metric's mean over ranks, one curve per run, named by the
 * config fields in which the runs differ (computed by the server with gpu_lab.config.config_diff).
 * Refreshed every few seconds while any of the runs is still going.
 */
import { Message } from '@lumino/messaging';
import { Widget } from '@lumino/widgets';

import { IChartSeries, PALETTE, SeriesChart, ZoomGroup } from './charts';
import { GpuLabModel, ICompare, isActive } from './model';
import { METRIC_TITLES, metricOrder } from './runview';

const REFRESH_MS = 5000;

export class CompareView extends Widget {
  /** `label`: the tab's title (a sweep's group names its sweep), "Compare N runs" by default. */
  constructor(lab: GpuLabModel, runIds: string[], label?: string) {
    super();
    this._lab = lab;
    this.runIds = runIds;
    this.id = CompareView.idFor(runIds);
    this.addClass('jp-GpuLab-compareview');
    this.title.label = label || `Compare ${runIds.length} runs`;
    this.title.closable = true;
    this._header = document.createElement('div');
    this._header.className = 'jp-GpuLab-cmp-header';
    const toolbar = document.createElement('div');
    toolbar.className = 'jp-GpuLab-rv-toolbar';
    this._x = document.createElement('select');
    this._x.className = 'jp-GpuLab-cmp-x';
    for (const [value, text] of [
      ['step', 'x: step'],
      ['time', 'x: seconds since start']
    ]) {
      const o = document.createElement('option');
      o.value = value;
      o.textContent = text;
      this._x.append(o);
    }
    this._logY = document.createElement('input');
    this._logY.type = 'checkbox';
    this._logY.className = 'jp-GpuLab-rv-logy';
    const logLabel = document.createElement('label');
    logLabel.append(this._logY, ' log y');
    this._x.onchange = this._logY.onchange = () => this._rebuild();
    toolbar.append(this._x, logLabel);
    this._table = document.createElement('table');
    this._table.className = 'jp-GpuLab-cmp-table';
    this._charts = document.createElement('div');
    this._charts.className = 'jp-GpuLab-rv-grid';
    this.node.append(this._header, this._table, toolbar, this._charts);
  }

  readonly runIds: string[];

  /** One view per set of runs: opening the same comparison again shows the open one. */
  static idFor(runIds: string[]): string {
    return `gpu-lab-compare-${[...runIds].sort().join('-')}`;
  }

  dispose(): void {
    window.clearTimeout(this._timer);
    this._rebuild(false);
    super.dispose();
  }

  protected onAfterAttach(msg: Message): void {
    super.onAfterAttach(msg);
    void this.refresh();
  }

  protected onBeforeDetach(msg: Message): void {
    window.clearTimeout(this._timer);
    super.onBeforeDetach(msg);
  }

  async refresh(): Promise<void> {
    window.clearTimeout(this._timer);
    try {
      this._data = await this._lab.compare(this.runIds);
    } catch (error) {
      this._header.textContent = `Could not compare these runs: ${(error as Error).message}`;
      return;
    }
    this._render();
    if (this._data.runs.some(r => isActive(r.status)) && this.isAttached) {
      this._timer = window.setTimeout(() => void this.refresh(), REFRESH_MS);
    }
  }

  private _rebuild(render = true): void {
    for (const c of this._chartByMetric.values()) {
      c.dispose();
    }
    this._chartByMetric.clear();
    this._charts.replaceChildren();
    if (render) {
      this._render();
    }
  }

  private _render(): void {
    const d = this._data;
    if (!d) {
      return;
    }
    this._header.replaceChildren();
    const h = document.createElement('h2');
    h.textContent = `${d.runs.length} runs`;
    const differ = document.createElement('div');
    differ.className = 'jp-GpuLab-cmp-differ';
    differ.textContent = d.differ.length
      ? `differ in: ${d.differ.join(', ')}`
      : 'same config: named by run name';
    this._header.append(h, differ);

    this._table.replaceChildren();
    const head = document.createElement('tr');
    for (const t of ['', 'run', 'id', 'status', ...d.differ, 'step', 'loss']) {
      const th = document.createElement('th');
      th.textContent = t;
      head.append(th);
    }
    this._table.append(head);
    d.runs.forEach((r, i) => {
      const tr = document.createElement('tr');
      tr.dataset.runId = r.id;
      const swatch = document.createElement('span');
      swatch.className = 'jp-GpuLab-cmp-swatch';
      swatch.style.background = PALETTE[i % PALETTE.length];
      const cells = [
        r.name,
        r.id,
        r.status,
        ...d.differ.map(k => String(r.differs[k] ?? '–')),
        r.last_step === null ? '–' : String(r.last_step),
        r.last_loss === null ? '–' : r.last_loss.toPrecision(4)
      ];
      const first = document.createElement('td');
      first.append(swatch);
      tr.append(first);
      for (const c of cells) {
        const td = document.createElement('td');
        td.textContent = c;
        tr.append(td);
      }
      this._table.append(tr);
    });

    const time = this._x.value === 'time';
    for (const name of metricOrder(Object.keys(d.metrics))) {
      let chart = this._chartByMetric.get(name);
      if (!chart) {
        chart = new SeriesChart({
          title: METRIC_TITLES[name] ?? name,
          time: false,
          logY: this._logY.checked,
          syncKey: `gpu-lab-cmp-${this.id}`,
          zoom: this._zoom
        });
        chart.node.dataset.metric = name;
        this._chartByMetric.set(name, chart);
        this._charts.append(chart.node);
      }
      const series: IChartSeries[] = [];
      d.runs.forEach((r, i) => {
        const s = d.metrics[name][r.id];
        if (s) {
          const keep = s.value.map((v, j) => j).filter(j => s.value[j] !== null);
          series.push({
            label: r.label,
            x: keep.map(j => (time ? s.t[j] : s.step[j])),
            y: keep.map(j => s.value[j] as number),
            color: PALETTE[i % PALETTE.length],
            width: 1.75
          });
        }
      });
      chart.update(series);
    }
  }

  private _lab: GpuLabModel;
  private _header: HTMLDivElement;
  private _table: HTMLTableElement;
  private _x: HTMLSelectElement;
  private _logY: HTMLInputElement;
  private _charts: HTMLDivElement;
  private _chartByMetric = new Map<string, SeriesChart>();
  private _zoom = new ZoomGroup();
  private _data: ICompare | null = null;
  private _timer = 0;
}
