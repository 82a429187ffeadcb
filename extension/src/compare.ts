/**
 * Runs compared in the main area: each metric's mean over ranks, one curve per run, named by the
 * config fields in which the runs differ (computed by the server with gpu_lab.config.config_diff).
 * Kept live by its model (comparemodel.ts) while any of the runs is still going; the toolbar says
 * whether it is live or reconnecting.
 */
import { Message } from '@lumino/messaging';
import { Widget } from '@lumino/widgets';

import { IChartSeries, PALETTE, SeriesChart, ZoomGroup } from './charts';
import { CompareModel } from './comparemodel';
import { GpuLabModel } from './model';
import { METRIC_TITLES, metricOrder } from './runview';

export class CompareView extends Widget {
  /** `label`: the tab's title (a sweep's group names its sweep), "Compare N runs" by default. */
  constructor(lab: GpuLabModel, runIds: string[], label?: string) {
    super();
    this._model = new CompareModel(lab, runIds);
    this._model.changed.connect(this._onChange, this);
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
    this._live = document.createElement('span');
    this._live.className = 'jp-GpuLab-rv-live';
    toolbar.append(this._x, logLabel, this._live);
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
    if (this.isDisposed) {
      return;
    }
    this._model.dispose();
    this._rebuild(false);
    super.dispose();
  }

  protected onAfterAttach(msg: Message): void {
    super.onAfterAttach(msg);
    this._model.refresh();
  }

  protected onBeforeDetach(msg: Message): void {
    this._model.pause();
    super.onBeforeDetach(msg);
  }

  /** Fetch the comparison now (and keep it live while a run is active). */
  refresh(): void {
    this._model.refresh();
  }

  private _onChange(): void {
    const m = this._model;
    this.node.dataset.state = m.state;
    this._live.textContent = {
      connecting: 'loading…',
      live: 'live',
      reconnecting: 'reconnecting…',
      ended: '',
      refused: ''
    }[m.state];
    this._live.title = m.error ?? '';
    if (m.state === 'refused') {
      this._header.textContent = `Could not compare these runs: ${m.error}`;
    } else {
      this._render();
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
    const d = this._model.data;
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

  private _model: CompareModel;
  private _header: HTMLDivElement;
  private _table: HTMLTableElement;
  private _x: HTMLSelectElement;
  private _logY: HTMLInputElement;
  private _charts: HTMLDivElement;
  private _chartByMetric = new Map<string, SeriesChart>();
  private _zoom = new ZoomGroup();
  private _live: HTMLSpanElement;
}
