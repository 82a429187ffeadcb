/**
 * A run's view in the main area: status and controls (Stop, Checkpoint now, Resume), the failure
 * triage, every reported metric per rank and their mean, host and GPU readings on the same time
 * axis, the config, the run's notes and a live tail of each log. A view only: what it shows comes
 * from RunViewModel (runmodel.ts); it redraws at most four times a second, and not while hidden.
 */
import { Message } from '@lumino/messaging';
import { Widget } from '@lumino/widgets';

import { IChartSeries, PALETTE, SeriesChart, themeColor, ZoomGroup } from './charts';
import { BoundedSeries } from './decimate';
import { el } from './dom';
import { formatDuration, IRun, isActive, statusText } from './model';
import { MEAN } from './facts';
import { Change, FeedState, RunViewModel } from './runmodel';

const REDRAW_MS = 250;

/** Display names of the metrics gpu_lab.train.fit reports; others show as reported. */
export const METRIC_TITLES: Record<string, string> = {
  loss: 'loss',
  eval_loss: 'eval loss',
  accuracy: 'accuracy',
  samples_per_s: 'throughput (samples/s)',
  lr: 'learning rate',
  step_time: 'step time (s)',
  data_wait: 'data wait (s per step)',
  epoch: 'epoch'
};
const METRIC_ORDER = Object.keys(METRIC_TITLES);

/** Host and GPU charts: title, unit, the series keys' prefix and suffix (runmodel.ts names). */
const SYSTEM_CHARTS: Array<{ id: string; title: string; unit: string; match: RegExp }> = [
  { id: 'host-cpu', title: 'host CPU', unit: '%', match: /^host\.cpu_pct$/ },
  { id: 'host-ram', title: 'host RAM', unit: 'GiB', match: /^host\.ram_used_gib$/ },
  { id: 'gpu-util', title: 'GPU utilisation', unit: '%', match: /^gpu(\d+)\.util_gpu$/ },
  { id: 'gpu-mem', title: 'GPU memory', unit: 'GiB', match: /^gpu(\d+)\.mem_used_gib$/ },
  { id: 'gpu-power', title: 'GPU power', unit: 'W', match: /^gpu(\d+)\.power_w$/ }
];

export interface IRunViewActions {
  /** open another run's view (the run a Resume started) */
  openRun(runId: string): void;
}

export function metricOrder(names: string[]): string[] {
  const rank = (n: string) => {
    const i = METRIC_ORDER.indexOf(n);
    return i < 0 ? METRIC_ORDER.length - 1 : i; // unknown ones before epoch
  };
  return [...names].sort((a, b) => rank(a) - rank(b) || a.localeCompare(b));
}

function clock(t: number): string {
  return new Date(t * 1000).toLocaleTimeString();
}

/** Log files by rank (rank0.log, rank1.log, …, rank10.log), then the others by name. */
function logOrder(a: string, b: string): number {
  const rank = (f: string): number => {
    const m = /^rank(\d+)\.log$/.exec(f);
    return m ? Number(m[1]) : Number.POSITIVE_INFINITY;
  };
  return rank(a) - rank(b) || a.localeCompare(b);
}

export class RunView extends Widget {
  constructor(model: RunViewModel, actions: IRunViewActions) {
    super();
    this.model = model;
    this._actions = actions;
    this.id = `gpu-lab-run-${model.runId}`;
    this.addClass('jp-GpuLab-runview');
    this.title.label = `Run ${model.runId}`;
    this.title.closable = true;

    // header: name, status, meta, controls
    const header = el('div', 'jp-GpuLab-rv-header');
    const titleRow = el('div', 'jp-GpuLab-rv-titlerow');
    this._name = el('h2', 'jp-GpuLab-rv-name', model.runId);
    this._status = el('span', 'jp-GpuLab-rv-status', '…');
    titleRow.append(this._name, this._status);
    this._meta = el('div', 'jp-GpuLab-rv-meta');
    this._why = el('div', 'jp-GpuLab-rv-meta');
    const controls = el('div', 'jp-GpuLab-rv-controls');
    this._stop = this._button(
      'Stop',
      'jp-GpuLab-rv-stop',
      'Stop the run: its ranks save a checkpoint, then end',
      () => this._onStop()
    );
    this._checkpoint = this._button(
      'Checkpoint now',
      'jp-GpuLab-rv-checkpoint',
      'Save a checkpoint at the next step boundary',
      () => this._onCheckpoint()
    );
    this._resume = this._button(
      'Resume',
      'jp-GpuLab-rv-resume',
      'Launch a new run that continues this one from its newest checkpoint',
      () => this._onResume()
    );
    this._message = el('div', 'jp-GpuLab-rv-message');
    controls.append(this._stop, this._checkpoint, this._resume);
    header.append(titleRow, this._meta, this._why, controls, this._message);

    this._failure = el('div', 'jp-GpuLab-rv-failure');

    // toolbar: x axis, log y, reset zoom
    const toolbar = el('div', 'jp-GpuLab-rv-toolbar');
    this._xStep = this._radio('x', 'step', true);
    this._xTime = this._radio('x', 'time', false);
    this._logY = el('input');
    this._logY.type = 'checkbox';
    this._logY.className = 'jp-GpuLab-rv-logy';
    this._logY.onchange = () => this._rebuildMetricCharts();
    const logLabel = el('label', 'jp-GpuLab-rv-toggle');
    logLabel.append(this._logY, ' log y');
    const reset = this._button(
      'Reset zoom',
      'jp-GpuLab-rv-reset',
      'Show every point again (or double-click a chart)',
      () => {
        this._zooms.step.reset();
        this._zooms.time.reset();
      }
    );
    this._live = el('span', 'jp-GpuLab-rv-live');
    toolbar.append(
      el('span', 'jp-GpuLab-rv-label', 'x:'),
      this._xStep.label,
      this._xTime.label,
      logLabel,
      reset,
      el('span', 'jp-GpuLab-rv-hint', 'drag to zoom, double-click to reset'),
      this._live
    );

    this._metrics = el('div', 'jp-GpuLab-rv-grid jp-GpuLab-rv-metrics');
    this._metrics.dataset.section = 'metrics';
    this._systemNote = el('div', 'jp-GpuLab-rv-note');
    this._system = el('div', 'jp-GpuLab-rv-grid jp-GpuLab-rv-system');
    this._system.dataset.section = 'system';

    const configBox = el('details', 'jp-GpuLab-rv-config');
    configBox.open = true;
    configBox.append(el('summary', '', 'Config'));
    this._config = el('div', 'jp-GpuLab-rv-config-grid');
    configBox.append(this._config);

    const lower = el('div', 'jp-GpuLab-rv-lower');
    const logsBox = el('div', 'jp-GpuLab-rv-logs');
    logsBox.append(el('h3', '', 'Logs'));
    this._logTabs = el('div', 'jp-GpuLab-rv-logtabs');
    this._logPanes = el('div', 'jp-GpuLab-rv-logpanes');
    logsBox.append(this._logTabs, this._logPanes);
    const notesBox = el('div', 'jp-GpuLab-rv-notes-box');
    notesBox.append(el('h3', '', 'Notes'));
    this._notes = el('div', 'jp-GpuLab-rv-notes');
    notesBox.append(this._notes);
    lower.append(logsBox, notesBox);

    this.node.append(
      header,
      this._failure,
      toolbar,
      el('h3', '', 'Training'),
      this._metrics,
      el('h3', '', 'Host and GPUs (time)'),
      this._systemNote,
      this._system,
      configBox,
      lower
    );
    this.model.changed.connect(this._onChange, this);
  }

  readonly model: RunViewModel;

  get runId(): string {
    return this.model.runId;
  }

  dispose(): void {
    if (this.isDisposed) {
      return;
    }
    window.clearTimeout(this._timer);
    for (const c of [...this._metricCharts.values(), ...this._systemCharts.values()]) {
      c.dispose();
    }
    this.model.dispose();
    super.dispose();
  }

  protected onAfterShow(msg: Message): void {
    super.onAfterShow(msg);
    this._schedule();
  }

  protected onAfterAttach(msg: Message): void {
    super.onAfterAttach(msg);
    this._schedule();
  }

  // --- rendering ----------------------------------------------------------------------------
  private _onChange(_: RunViewModel, change: Change): void {
    this._dirty.add(change);
    this._schedule();
  }

  private _schedule(): void {
    if (this._timer || this.isDisposed) {
      return;
    }
    const wait = Math.max(0, this._lastDraw + REDRAW_MS - Date.now());
    this._timer = window.setTimeout(() => {
      this._timer = 0;
      if (!this.isVisible) {
        return; // onAfterShow draws what changed meanwhile
      }
      this._lastDraw = Date.now();
      const dirty = this._dirty;
      this._dirty = new Set();
      this._render(dirty);
    }, wait);
  }

  private _render(dirty: Set<Change>): void {
    const m = this.model;
    this._renderMeta();
    if (dirty.has('row') || dirty.has('error')) {
      this._renderRow();
    }
    if (dirty.has('series') || dirty.has('row')) {
      this._renderMetrics();
    }
    if (dirty.has('telemetry')) {
      this._renderSystem();
    }
    if (dirty.has('notes')) {
      this._renderNotes();
    }
    if (dirty.has('logs')) {
      this._renderLogs();
    }
    this._live.textContent = feedText(m.feed, m.isActive);
    this._live.title = m.feedError ?? '';
    this.node.dataset.feed = m.feed;
    this.node.dataset.feedMessages = String(m.feedMessages);
  }

  private _renderRow(): void {
    const row = this.model.row;
    if (!row) {
      return;
    }
    this.title.label = `Run ${row.name || row.id}`;
    this._name.textContent = row.name || row.id;
    this._status.textContent = statusText(row);
    this._status.dataset.status = row.status;
    this.node.dataset.status = row.status;
    this._why.replaceChildren();
    if (row.resumed_from) {
      this._why.append(
        el(
          'div',
          'jp-GpuLab-rv-resumed',
          `continues run ${row.resumed_from.run ?? '?'} from step ${row.resumed_from.step}`
        )
      );
    }
    if (row.job?.id) {
      const where = row.job.nodes ? ` on ${row.job.nodes}` : '';
      const attempt = row.job.attempt ? ` · attempt ${row.job.attempt + 1}` : '';
      this._why.append(
        el(
          'div',
          'jp-GpuLab-rv-job',
          `${row.job.scheduler === 'slurm' ? 'Slurm' : row.job.scheduler} job ${row.job.id}` +
            `${row.job.state ? ` (${row.job.state})` : ''}${where}${attempt}`
        )
      );
    }
    // a queued job's reason is the scheduler's (why it waits); an ended run's, why it ended
    if (row.reason && (!isActive(row.status) || row.status === 'queued')) {
      this._why.append(el('div', 'jp-GpuLab-rv-reason', row.reason));
    }
    if (row.note) {
      this._why.append(el('div', 'jp-GpuLab-rv-record-note', row.note));
    }
    const active = isActive(row.status);
    this._stop.style.display = active ? '' : 'none';
    this._checkpoint.style.display = active ? '' : 'none';
    this._resume.style.display = !active && row.output_dir ? '' : 'none';
    this._renderFailure(row);
    if (this.model.error) {
      this._say(this.model.error, 'error');
    }
    this._renderConfig();
  }

  /** ranks, start, duration and the newest step: changes with every report */
  private _renderMeta(): void {
    const row = this.model.row;
    if (!row) {
      return;
    }
    const step = this.model.lastStep ?? row.last_step;
    this._meta.textContent = [
      row.id,
      `${row.num_processes ?? '?'} rank${row.num_processes === 1 ? '' : 's'}`,
      row.precision ?? '',
      row.started ? `started ${new Date(row.started * 1000).toLocaleString()}` : '',
      row.started ? `ran ${formatDuration((row.ended ?? Date.now() / 1000) - row.started)}` : '',
      step !== null && step !== undefined ? `step ${step}` : ''
    ]
      .filter(Boolean)
      .join(' · ');
  }

  private _renderFailure(row: IRun): void {
    const f = this.model.failure;
    this._failure.replaceChildren();
    this._failure.style.display = row.status === 'failed' ? '' : 'none';
    if (row.status !== 'failed') {
      return;
    }
    this._failure.append(el('h3', '', `Failed${f?.category ? ` · ${f.category}` : ''}`));
    this._failure.append(
      el('pre', 'jp-GpuLab-rv-triage', f?.text || row.error || 'the run failed')
    );
    for (const r of f?.ranks ?? []) {
      if (r.traceback) {
        const d = el('details', 'jp-GpuLab-rv-traceback');
        d.append(el('summary', '', `rank ${r.rank}: traceback`), el('pre', '', r.traceback));
        this._failure.append(d);
      }
    }
  }

  private _renderConfig(): void {
    const entries = Object.entries(this.model.config);
    const shown = JSON.stringify(entries);
    if (entries.length && shown === this._configShown) {
      return;
    }
    this._configShown = shown;
    this._config.replaceChildren();
    if (!entries.length) {
      this._config.append(el('div', 'jp-GpuLab-empty', 'launched without a TrainConfig'));
    }
    for (const [k, v] of entries) {
      const item = el('div', 'jp-GpuLab-rv-config-item');
      item.dataset.field = k;
      const value = el('span', 'jp-GpuLab-rv-config-value', v === null ? '–' : String(v));
      value.title = String(v);
      item.append(el('span', 'jp-GpuLab-rv-config-key', k), value);
      this._config.append(item);
    }
  }

  private _xMode(): 'step' | 'time' {
    return this._xTime.input.checked ? 'time' : 'step';
  }

  private _rebuildMetricCharts(): void {
    for (const c of this._metricCharts.values()) {
      c.dispose();
      c.node.remove();
    }
    this._metricCharts.clear();
    this._renderMetrics();
  }

  private _renderMetrics(): void {
    const m = this.model;
    const x = this._xMode();
    const ranks = m.row?.num_processes ?? 1;
    const names = metricOrder([...m.metrics.keys()]);
    if (!names.length) {
      this._metrics.textContent = m.isActive
        ? 'Waiting for the first report…'
        : 'No metrics reported.';
      return;
    }
    if (!this._metricCharts.size) {
      this._metrics.textContent = '';
    }
    for (const name of names) {
      let chart = this._metricCharts.get(name);
      if (!chart) {
        chart = new SeriesChart({
          title: METRIC_TITLES[name] ?? name,
          time: x === 'time',
          logY: this._logY.checked,
          syncKey: `gpu-lab-${x}-${m.runId}`,
          zoom: this._zooms[x]
        });
        chart.node.dataset.metric = name;
        this._metricCharts.set(name, chart);
        // charts keep their place: insert in metric order
        const next = names
          .slice(names.indexOf(name) + 1)
          .map(n => this._metricCharts.get(n))
          .find(c => c);
        this._metrics.insertBefore(chart.node, next?.node ?? null);
      }
      chart.update(this._metricSeries(m.metrics.get(name)!, x, ranks));
    }
  }

  private _metricSeries(
    byKey: Map<string, BoundedSeries>,
    x: 'step' | 'time',
    ranks: number
  ): IChartSeries[] {
    const keys = [...byKey.keys()].filter(k => k !== MEAN).sort((a, b) => +a - +b);
    // ranks on more than one host: each curve names its node
    const hosts = this.model.hosts;
    const nodes = new Set(keys.map(k => hosts.get(k)).filter(Boolean)).size > 1;
    const out: IChartSeries[] = keys.map(k => {
      const s = byKey.get(k)!;
      return {
        label: nodes && hosts.get(k) ? `rank ${k} · ${hosts.get(k)}` : `rank ${k}`,
        x: x === 'step' ? s.steps : s.times,
        y: s.values,
        color: PALETTE[+k % PALETTE.length]
      };
    });
    const mean = byKey.get(MEAN);
    if (mean && (ranks > 1 || keys.length > 1)) {
      out.push({
        label: 'mean',
        x: x === 'step' ? mean.steps : mean.times,
        y: mean.values,
        color: themeColor('--jp-ui-font-color0', '#111'),
        width: 2.25
      });
    }
    return out;
  }

  private _renderSystem(): void {
    const tel = this.model.telemetry;
    const mine = this.model.runGpus;
    const gpus = new Set(
      [...tel.keys()].filter(k => k.startsWith('gpu')).map(k => k.split('.')[0])
    );
    this._systemNote.textContent = !gpus.size
      ? 'No GPU visible to NVML on this host: host readings only.'
      : mine.size
        ? `GPU ${[...mine].sort((a, b) => a - b).join(', ')}: this run's (claimed, or where its ranks hold memory).`
        : 'Every GPU of this host (which ones this run uses shows once its ranks hold memory).';
    for (const spec of SYSTEM_CHARTS) {
      const series: IChartSeries[] = [];
      for (const [key, s] of tel) {
        const hit = spec.match.exec(key);
        if (hit) {
          const i = hit[1] === undefined ? 0 : +hit[1];
          if (hit[1] !== undefined && mine.size && !mine.has(i)) {
            continue; // another run's GPU
          }
          series.push({
            label: hit[1] === undefined ? spec.title : `GPU ${i}`,
            x: s.times,
            y: s.values,
            color: PALETTE[i % PALETTE.length]
          });
        }
      }
      if (!series.length) {
        continue;
      }
      series.sort((a, b) => a.label.localeCompare(b.label, undefined, { numeric: true }));
      let chart = this._systemCharts.get(spec.id);
      if (!chart) {
        chart = new SeriesChart({
          title: spec.title,
          unit: spec.unit,
          time: true,
          height: 150,
          syncKey: `gpu-lab-time-${this.model.runId}`,
          zoom: this._zooms.time
        });
        chart.node.dataset.system = spec.id;
        this._systemCharts.set(spec.id, chart);
        this._system.append(chart.node);
      }
      chart.update(series);
    }
  }

  private _renderNotes(): void {
    const notes = this.model.notes;
    this._notes.replaceChildren();
    if (!notes.length) {
      this._notes.append(
        el(
          'div',
          'jp-GpuLab-empty',
          'Nothing noted yet (checkpoints, warnings and dropped reports show here).'
        )
      );
    }
    for (const e of notes.slice().reverse()) {
      const text =
        e.kind === 'dropped'
          ? droppedText(e.data)
          : String(e.data.text ?? e.data.message ?? JSON.stringify(e.data));
      const row = el('div', `jp-GpuLab-rv-notes-item jp-mod-${e.kind}`);
      row.append(
        el('span', 'jp-GpuLab-rv-notes-time', clock(e.t)),
        el('span', 'jp-GpuLab-rv-notes-rank', e.rank >= 0 ? `rank ${e.rank}` : 'run'),
        el('span', 'jp-GpuLab-rv-notes-text', text)
      );
      this._notes.append(row);
    }
    // say when the checkpoint asked for from here is in
    const saved = notes.filter(n => /^checkpoint step \d+/.test(String(n.data.text ?? '')));
    const last = saved[saved.length - 1];
    if (this._checkpointAskedAt && last && last.seq > this._checkpointAskedAt) {
      this._say(String(last.data.text), 'info');
      this._checkpointAskedAt = 0;
    }
  }

  private _renderLogs(): void {
    for (const [file, buf] of this.model.logs) {
      let pane = this._logPaneByFile.get(file);
      if (!pane) {
        const tab = this._button(file, 'jp-GpuLab-rv-logtab', `Show ${file}`, () => {
          this._logChosen = true;
          this._showLog(file);
        });
        tab.dataset.file = file;
        // a stable order, whichever file arrived first: rank0.log, rank1.log, …, then the others
        const next = Array.from(this._logTabs.children).find(
          t => logOrder(file, (t as HTMLElement).dataset.file ?? '') < 0
        );
        this._logTabs.insertBefore(tab, next ?? null);
        pane = el('pre', 'jp-GpuLab-rv-log');
        pane.dataset.file = file;
        this._logPanes.append(pane);
        this._logPaneByFile.set(file, pane);
        // rank 0's log first, whichever file arrived first, until the user picks a tab
        if (!this._shownLog || (!this._logChosen && file === 'rank0.log')) {
          this._showLog(file);
        } else {
          pane.style.display = 'none';
        }
      }
      if (pane.dataset.bytes === String(buf.bytes)) {
        continue;
      }
      const atBottom = pane.scrollTop + pane.clientHeight >= pane.scrollHeight - 4;
      pane.textContent = buf.text || '(empty)';
      pane.dataset.bytes = String(buf.bytes);
      if (atBottom) {
        pane.scrollTop = pane.scrollHeight;
      }
    }
  }

  private _logChosen = false;

  private _showLog(file: string): void {
    this._shownLog = file;
    for (const [f, pane] of this._logPaneByFile) {
      pane.style.display = f === file ? '' : 'none';
      if (f === file) {
        pane.scrollTop = pane.scrollHeight;
      }
    }
    for (const tab of this._logTabs.querySelectorAll<HTMLButtonElement>('button')) {
      tab.classList.toggle('jp-mod-active', tab.dataset.file === file);
    }
  }

  // --- controls -----------------------------------------------------------------------------
  private async _onStop(): Promise<void> {
    this._busy(this._stop, 'Stopping…');
    try {
      const row = await this.model.stop();
      this._say(`Run ${row.status}${row.reason ? `: ${row.reason}` : ''}.`, 'info');
    } catch (error) {
      this._say(`Could not stop the run: ${(error as Error).message}`, 'error');
    } finally {
      this._idle(this._stop, 'Stop');
    }
  }

  private async _onCheckpoint(): Promise<void> {
    this._busy(this._checkpoint, 'Requesting…');
    try {
      const seq = this.model.seq; // the save's note comes after what was recorded so far
      await this.model.requestCheckpoint();
      this._checkpointAskedAt = Math.max(seq, 1);
      this._say('Checkpoint requested: the run saves one at its next step boundary.', 'info');
    } catch (error) {
      this._say(`Could not request a checkpoint: ${(error as Error).message}`, 'error');
    } finally {
      this._idle(this._checkpoint, 'Checkpoint now');
    }
  }

  private async _onResume(): Promise<void> {
    this._busy(this._resume, 'Resuming…');
    try {
      const out = await this.model.resume();
      const from = out.run.resumed_from;
      this._say(
        `Resumed as run ${out.run.id}` + (from ? ` from step ${from.step}` : '') + '.',
        'info'
      );
      const open = this._button('Open it', 'jp-GpuLab-rv-open-resumed', 'Open the new run', () =>
        this._actions.openRun(out.run.id)
      );
      this._message.append(' ', open);
    } catch (error) {
      this._say(`Could not resume: ${(error as Error).message}`, 'error');
    } finally {
      this._idle(this._resume, 'Resume');
    }
  }

  private _say(text: string, kind: 'info' | 'error'): void {
    this._message.textContent = text;
    this._message.dataset.kind = kind;
  }

  private _busy(b: HTMLButtonElement, text: string): void {
    b.disabled = true;
    b.textContent = text;
  }

  private _idle(b: HTMLButtonElement, text: string): void {
    b.disabled = false;
    b.textContent = text;
  }

  private _button(
    text: string,
    className: string,
    title: string,
    onclick: () => void
  ): HTMLButtonElement {
    const b = el('button', `jp-GpuLab-button ${className}`, text);
    b.title = title;
    b.onclick = onclick;
    return b;
  }

  private _radio(
    name: string,
    value: string,
    checked: boolean
  ): { input: HTMLInputElement; label: HTMLLabelElement } {
    const input = el('input');
    input.type = 'radio';
    input.name = `${name}-${this.model.runId}`;
    input.value = value;
    input.checked = checked;
    input.className = `jp-GpuLab-rv-x-${value}`;
    input.onchange = () => this._rebuildMetricCharts();
    const label = el('label', 'jp-GpuLab-rv-toggle');
    label.append(input, ` ${value}`);
    return { input, label };
  }

  private _actions: IRunViewActions;
  private _name: HTMLHeadingElement;
  private _status: HTMLSpanElement;
  private _meta: HTMLDivElement;
  /** why it stopped, what it continues */
  private _why: HTMLDivElement;
  private _stop: HTMLButtonElement;
  private _checkpoint: HTMLButtonElement;
  private _resume: HTMLButtonElement;
  private _message: HTMLDivElement;
  private _failure: HTMLDivElement;
  private _xStep: { input: HTMLInputElement; label: HTMLLabelElement };
  private _xTime: { input: HTMLInputElement; label: HTMLLabelElement };
  private _logY: HTMLInputElement;
  private _live: HTMLSpanElement;
  private _metrics: HTMLDivElement;
  private _system: HTMLDivElement;
  private _systemNote: HTMLDivElement;
  private _config: HTMLDivElement;
  private _configShown = '';
  private _notes: HTMLDivElement;
  private _logTabs: HTMLDivElement;
  private _logPanes: HTMLDivElement;
  private _logPaneByFile = new Map<string, HTMLPreElement>();
  private _shownLog = '';
  private _metricCharts = new Map<string, SeriesChart>();
  private _systemCharts = new Map<string, SeriesChart>();
  private _zooms = { step: new ZoomGroup(), time: new ZoomGroup() };
  private _dirty = new Set<Change>();
  private _timer = 0;
  private _lastDraw = 0;
  /** the record's seq when Checkpoint now was pressed (0: not waiting for a save) */
  private _checkpointAskedAt = 0;
}

/** What the view says of how it gets the run (an ended run that is live says nothing). */
function feedText(feed: FeedState, active: boolean): string {
  switch (feed) {
    case 'connecting':
      return 'loading…';
    case 'reconnecting':
      return 'reconnecting…';
    case 'polling':
      return active ? 'live · polling (websocket down)' : '';
    case 'live':
      return active ? 'live · pushed by the server' : '';
  }
}

/** A `dropped` note: reports lost on the way (the run reported faster than it could be recorded)
 * and reports refused because they could not be recorded, with the reasons. */
function droppedText(data: Record<string, unknown>): string {
  const parts: string[] = [];
  if (Number(data.count) > 0 && data.text) {
    parts.push(String(data.text)); // the recorder said why (a restart, not a flood)
  } else if (Number(data.count) > 0) {
    parts.push(
      `dropped ${data.count} report(s): the run reported faster than it could be recorded`
    );
  }
  if (Number(data.refused) > 0) {
    const why = Object.entries((data.why as Record<string, unknown> | undefined) ?? {})
      .map(([k, n]) => `${k}: ${n}`)
      .join('; ');
    parts.push(
      `refused ${data.refused} report(s) that could not be recorded` + (why ? ` (${why})` : '')
    );
  }
  return parts.join('; ') || String(data.text ?? 'reports dropped');
}
