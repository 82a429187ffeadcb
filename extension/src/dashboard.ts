/**
 * A run's dashboard in the main area: its status and a chart per metric (rank 0, decimated by the
 * server), refreshed while the run is active. Opened from the runs list or the command palette.
 */
import { Message } from '@lumino/messaging';
import { Widget } from '@lumino/widgets';

import { LineChart } from './chart';
import { GpuLabModel, IRunDetail, isActive } from './model';

const REFRESH_MS = 2000;

export class RunDashboard extends Widget {
  constructor(model: GpuLabModel, runId: string) {
    super();
    this._model = model;
    this.runId = runId;
    this.addClass('jp-GpuLab-dashboard');
    this.id = `gpu-lab-run-${runId}`;
    this.title.label = `Run ${runId}`;
    this.title.closable = true;
    this._header = document.createElement('div');
    this._header.className = 'jp-GpuLab-dashboard-header';
    this._charts = document.createElement('div');
    this._charts.className = 'jp-GpuLab-dashboard-charts';
    this.node.append(this._header, this._charts);
  }

  readonly runId: string;

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
    let run: IRunDetail;
    try {
      run = await this._model.getRun(this.runId);
    } catch (error) {
      this._header.textContent = `Run ${this.runId}: ${(error as Error).message}`;
      return;
    }
    this.title.label = `Run ${run.name || run.id}`;
    const started = run.started ? new Date(run.started * 1000).toLocaleString() : '–';
    this._header.replaceChildren();
    const h = document.createElement('h2');
    h.textContent = `${run.name || run.id}`;
    const meta = document.createElement('div');
    meta.className = 'jp-GpuLab-dashboard-meta';
    meta.dataset.status = run.status;
    meta.textContent =
      `${run.status} · ${run.num_processes ?? '?'} processes · started ${started}` +
      (run.last_step !== null ? ` · step ${run.last_step}` : '');
    this._header.append(h, meta);
    if (run.error) {
      const err = document.createElement('pre');
      err.className = 'jp-GpuLab-dashboard-error';
      err.textContent = run.error;
      this._header.appendChild(err);
    }
    for (const [name, series] of Object.entries(run.metrics)) {
      let chart = this._chartsByName.get(name);
      if (!chart) {
        chart = new LineChart(name);
        chart.node.dataset.metric = name;
        this._chartsByName.set(name, chart);
        this._charts.appendChild(chart.node);
      }
      chart.update(series.step, series.value);
    }
    if (!Object.keys(run.metrics).length) {
      this._charts.textContent = 'No metrics reported yet.';
    }
    if (isActive(run.status) && this.isAttached) {
      this._timer = window.setTimeout(() => void this.refresh(), REFRESH_MS);
    }
  }

  private _model: GpuLabModel;
  private _header: HTMLDivElement;
  private _charts: HTMLDivElement;
  private _chartsByName = new Map<string, LineChart>();
  private _timer = 0;
}
