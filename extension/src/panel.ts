/**
 * The "GPU Lab" side panel: live per-GPU charts, host stats and the runs list with View and Stop
 * buttons and checkboxes to compare runs. The runs of a sweep sit in one collapsible group (its
 * progress and best value in the title, a Compare of its best trials), placed where its newest
 * run would be.
 * A view only: everything it shows comes from GpuLabModel's signals.
 */
import { Message } from '@lumino/messaging';
import { Debouncer } from '@lumino/polling';
import { Widget } from '@lumino/widgets';

import { Sparkline } from './sparkline';
import { el } from './dom';
import { ACTIVE_STATUSES, FINAL_STATUSES, MAX_COMPARE } from './facts';
import {
  formatMiB,
  formatPct,
  GpuLabModel,
  IGpuStats,
  IRun,
  ISample,
  isActive,
  ISweep,
  statusText
} from './model';

export interface IPanelActions {
  stop(run: IRun): Promise<void>;
  openDashboard(run: IRun): void;
  /** `title`: what the comparison's tab says (default: "Compare N runs") */
  compare(runIds: string[], title?: string): void;
  openTutorials(): void;
}

/** A value of a sweep's metric, short. */
function formatValue(v: number | null | undefined): string {
  return v === null || v === undefined ? '–' : String(+v.toPrecision(4));
}

/** One labelled value with a sparkline of its recent history. */
class StatRow {
  constructor(label: string, key: string, max = 100) {
    this.node = el('div', 'jp-GpuLab-stat');
    this.node.dataset.stat = key;
    this._value = el('span', 'jp-GpuLab-stat-value', '–');
    this._spark = new Sparkline({ max });
    this.node.append(el('span', 'jp-GpuLab-stat-label', label), this._value, this._spark.node);
  }

  readonly node: HTMLDivElement;

  update(text: string, history: Array<number | null | undefined>, max?: number): void {
    this._value.textContent = text;
    if (max !== undefined) {
      this._spark.max = max;
    }
    this._spark.update(history);
  }

  private _value: HTMLSpanElement;
  private _spark: Sparkline;
}

class GpuCard {
  constructor(index: number) {
    this.node = el('div', 'jp-GpuLab-gpu');
    this.node.dataset.gpu = String(index);
    this._title = el('div', 'jp-GpuLab-gpu-title', `GPU ${index}`);
    this._util = new StatRow('Util', `gpu${index}-util`);
    this._mem = new StatRow('Memory', `gpu${index}-mem`);
    this._extra = el('div', 'jp-GpuLab-gpu-extra');
    this.node.append(this._title, this._util.node, this._mem.node, this._extra);
  }

  readonly node: HTMLDivElement;

  update(gpu: IGpuStats, history: ReadonlyArray<ISample>): void {
    const pick = (s: ISample) => s.gpus.find(g => g.index === gpu.index);
    this._title.textContent = `GPU ${gpu.index}${gpu.name ? ' · ' + gpu.name : ''}`;
    this._util.update(
      formatPct(gpu.util_gpu),
      history.map(s => pick(s)?.util_gpu)
    );
    this._mem.update(
      `${formatMiB(gpu.mem_used_mb)} / ${formatMiB(gpu.mem_total_mb)}`,
      history.map(s => pick(s)?.mem_used_mb),
      gpu.mem_total_mb || 1
    );
    const parts: string[] = [];
    if (gpu.temperature_c !== null && gpu.temperature_c !== undefined) {
      parts.push(`${gpu.temperature_c.toFixed(0)} °C`);
    }
    if (gpu.power_w !== null && gpu.power_w !== undefined) {
      parts.push(`${gpu.power_w.toFixed(0)} W`);
    }
    this._extra.textContent = parts.join(' · ');
  }

  private _title: HTMLDivElement;
  private _util: StatRow;
  private _mem: StatRow;
  private _extra: HTMLDivElement;
}

/** One run: a checkbox (to compare), name and status, step and last loss, then its buttons
 *  (narrow-panel friendly). */
class RunCard {
  constructor(run: IRun, actions: IPanelActions, onSelect: () => void) {
    this._run = run;
    this.node = el('div', 'jp-GpuLab-run');
    this.node.dataset.runId = run.id;
    const top = el('div', 'jp-GpuLab-run-top');
    this.select = el('input', 'jp-GpuLab-run-select');
    this.select.type = 'checkbox';
    this.select.title = 'Select to compare with other runs';
    this.select.onchange = onSelect;
    this._name = el('span', 'jp-GpuLab-run-name');
    this._status = el('span', 'jp-GpuLab-run-status');
    top.append(this.select, this._name, this._status);
    const stats = el('div', 'jp-GpuLab-run-stats');
    this._step = el('span', 'jp-GpuLab-run-step');
    this._loss = el('span', 'jp-GpuLab-run-loss');
    this._procs = el('span', 'jp-GpuLab-run-procs');
    this._value = el('span', 'jp-GpuLab-run-value');
    stats.append('step ', this._step, ' · loss ', this._loss, this._value, this._procs);
    const buttons = el('div', 'jp-GpuLab-run-actions');
    const dash = el('button', 'jp-GpuLab-button jp-GpuLab-open-dashboard', 'View');
    dash.title = "Open this run's view: live metrics per rank, GPU and host, logs, controls";
    dash.onclick = () => actions.openDashboard(this._run);
    this._stop = el('button', 'jp-GpuLab-button jp-GpuLab-stop', 'Stop');
    this._stop.title = 'Stop the run: SIGTERM to its process group, SIGKILL after a grace period';
    this._stop.onclick = async () => {
      this._stop.disabled = true;
      this._stop.textContent = 'Stopping…';
      try {
        await actions.stop(this._run);
      } finally {
        this._stop.disabled = false;
        this._stop.textContent = 'Stop';
      }
    };
    buttons.append(dash, this._stop);
    // what the record says of itself (a full disk paused it, its recorder was replaced)
    this._note = el('div', 'jp-GpuLab-run-note');
    this.node.append(top, stats, this._note, buttons);
  }

  readonly node: HTMLDivElement;
  readonly select: HTMLInputElement;

  /** `sweep`: the sweep whose group shows the card, which names it by its trial. */
  update(run: IRun, sweep?: ISweep): void {
    this._run = run;
    this.node.dataset.status = run.status;
    const seed =
      run.trial_seed === null || run.trial_seed === undefined ? '' : ` · seed ${run.trial_seed}`;
    this._name.textContent =
      sweep && run.trial !== null && run.trial !== undefined
        ? `trial ${run.trial}${seed}`
        : run.name || run.id;
    this._name.title =
      `${run.id}${run.num_processes ? ` · ${run.num_processes} processes` : ''}` +
      `${run.error ? `\n${run.error}` : ''}`;
    this._status.textContent = statusText(run);
    this._status.title = run.reason ?? ''; // why it waits (Slurm's reason), why it stopped
    this._status.className = `jp-GpuLab-run-status jp-GpuLab-status-${run.status}`;
    this._step.textContent = run.last_step === null ? '–' : String(run.last_step);
    this._loss.textContent = run.last_loss === null ? '–' : run.last_loss.toPrecision(4);
    this._procs.textContent = run.num_processes ? ` · ${run.num_processes} proc` : '';
    this._value.textContent = sweep?.metric
      ? ` · ${sweep.metric} ${formatValue(run.sweep_value)}`
      : '';
    this._stop.style.display = isActive(run.status) ? '' : 'none';
    this._note.textContent = run.note ?? '';
    this._note.title = run.note ?? '';
    this._note.style.display = run.note ? '' : 'none';
  }

  private _run: IRun;
  private _note: HTMLDivElement;
  private _name: HTMLSpanElement;
  private _status: HTMLSpanElement;
  private _step: HTMLSpanElement;
  private _loss: HTMLSpanElement;
  private _procs: HTMLSpanElement;
  private _value: HTMLSpanElement;
  private _stop: HTMLButtonElement;
}

/** A sweep's runs under one collapsible title: the sweep's name, trials done of the total
 *  (pruned ones counted), the best value; Compare opens the comparison of its best trials. */
class SweepGroup {
  constructor(sweepId: string, actions: IPanelActions) {
    this._id = sweepId;
    this.node = el('div', 'jp-GpuLab-sweep');
    this.node.dataset.sweepId = sweepId;
    const head = el('div', 'jp-GpuLab-sweep-head');
    this._toggle = el('button', 'jp-GpuLab-sweep-toggle');
    this._toggle.onclick = () => this.setExpanded(!this._expanded);
    this._title = el('span', 'jp-GpuLab-sweep-title');
    this._compare = el('button', 'jp-GpuLab-button jp-GpuLab-sweep-compare', 'Compare');
    this._compare.onclick = () =>
      actions.compare(this._compareIds, `Compare ${this._sweep?.name ?? this._id}`);
    head.append(this._toggle, this._title, this._compare);
    this._line = el('div', 'jp-GpuLab-sweep-line');
    this.trials = el('div', 'jp-GpuLab-sweep-trials');
    this.node.append(head, this._line, this.trials);
    this.setExpanded(true);
  }

  readonly node: HTMLDivElement;
  /** the trials' run cards go here */
  readonly trials: HTMLDivElement;

  setExpanded(expanded: boolean): void {
    this._expanded = expanded;
    this.node.dataset.expanded = String(expanded);
    this.trials.style.display = expanded ? '' : 'none';
    this._toggle.textContent = expanded ? '▾' : '▸';
    this._toggle.title = expanded ? 'Hide the trials' : 'Show the trials';
    this._toggle.setAttribute('aria-expanded', String(expanded));
  }

  /** `runs`: the sweep's runs in the list, newest first. */
  update(sweep: ISweep | undefined, runs: IRun[]): void {
    this._sweep = sweep;
    const s: ISweep = sweep ?? {
      id: this._id,
      name: this._id,
      metric: null,
      direction: null,
      trials: null,
      seeds: 1,
      started: runs.length,
      done: runs.filter(r => !isActive(r.status)).length,
      active: runs.filter(r => isActive(r.status)).length,
      pruned: 0,
      best: null,
      best_run: null
    };
    this._title.textContent = s.name;
    this._title.title = `sweep ${s.id}`;
    const parts = [`${s.done}/${s.trials ?? s.started} trials done`];
    if (s.active) {
      parts.push(`${s.active} running`);
    }
    if (s.pruned) {
      parts.push(`${s.pruned} pruned`);
    }
    if (s.metric) {
      parts.push(`best ${s.metric} ${formatValue(s.best)}`);
    }
    this._line.textContent = parts.join(' · ');
    this.node.dataset.done = String(s.done);
    this.node.dataset.best = s.best === null ? '' : String(s.best);
    this._compareIds = bestFirst(runs, s)
      .slice(0, MAX_COMPARE)
      .map(r => r.id);
    this._compare.disabled = this._compareIds.length < 2;
    this._compare.title =
      runs.length > MAX_COMPARE
        ? `Compare the curves of the best ${MAX_COMPARE} of these ${runs.length} runs`
        : 'Compare the curves of these runs, named by the parameters in which they differ';
  }

  private _id: string;
  private _sweep: ISweep | undefined;
  private _expanded = true;
  private _toggle: HTMLButtonElement;
  private _title: HTMLSpanElement;
  private _line: HTMLDivElement;
  private _compare: HTMLButtonElement;
  private _compareIds: string[] = [];
}

/** A sweep's runs, best value of its metric first (those without one last, newest first). */
function bestFirst(runs: IRun[], sweep: ISweep): IRun[] {
  const sign = sweep.direction === 'minimize' ? 1 : -1;
  const key = (r: IRun) =>
    r.sweep_value === null || r.sweep_value === undefined ? Infinity : sign * r.sweep_value;
  return runs
    .map((r, i) => ({ r, i }))
    .sort((a, b) => key(a.r) - key(b.r) || a.i - b.i)
    .map(x => x.r);
}

export class GpuLabPanel extends Widget {
  constructor(model: GpuLabModel, actions: IPanelActions) {
    super();
    this._model = model;
    this._actions = actions;
    this.id = 'gpu-lab-panel';
    this.addClass('jp-GpuLab-panel');
    this.title.caption = 'GPU Lab: GPUs, host and runs';

    const header = el('div', 'jp-GpuLab-header');
    header.append(el('h2', '', 'GPU Lab'));
    this._conn = el('span', 'jp-GpuLab-conn', 'connecting…');
    header.appendChild(this._conn);
    const tutorials = el('button', 'jp-GpuLab-link', 'Tutorials');
    tutorials.onclick = () => this._actions.openTutorials();
    header.appendChild(tutorials);

    this._gpus = el('div', 'jp-GpuLab-section jp-GpuLab-gpus');
    this._gpus.dataset.section = 'gpus';
    const host = el('div', 'jp-GpuLab-section jp-GpuLab-host');
    host.dataset.section = 'host';
    host.appendChild(el('h3', '', 'Host'));
    this._cpu = new StatRow('CPU', 'host-cpu');
    this._ram = new StatRow('RAM', 'host-ram');
    this._load = el('div', 'jp-GpuLab-stat-note');
    this._sampleTime = el('div', 'jp-GpuLab-stat-note jp-GpuLab-sample-time');
    host.append(this._cpu.node, this._ram.node, this._load, this._sampleTime);

    const runs = el('div', 'jp-GpuLab-section jp-GpuLab-runs');
    runs.dataset.section = 'runs';
    const runsHeader = el('div', 'jp-GpuLab-runs-header');
    this._compare = el('button', 'jp-GpuLab-button jp-GpuLab-compare', 'Compare');
    this._compare.title = 'Select two or more runs, then compare their curves in one view';
    this._compare.disabled = true;
    this._compare.onclick = () => this._actions.compare(this._selected());
    runsHeader.append(el('h3', '', 'Runs'), this._compare);
    runs.append(runsHeader, this._searchBar());
    this._runsList = el('div', 'jp-GpuLab-runs-list');
    this._runsEmpty = el('div', 'jp-GpuLab-empty', 'No runs yet: launch one from a notebook.');
    runs.append(this._runsList, this._runsEmpty, this._pager());

    this.node.append(header, this._gpus, host, runs);
  }

  protected onAfterAttach(msg: Message): void {
    super.onAfterAttach(msg);
    this._model.telemetryChanged.connect(this._onSample, this);
    this._model.runsChanged.connect(this._onRuns, this);
    this._model.stateChanged.connect(this._onState, this);
    this._onState();
    if (this._model.latest) {
      this._onSample(this._model, this._model.latest);
    }
    this._onRuns(this._model, [...this._model.runs]);
    void this._model.refreshRuns();
  }

  protected onAfterShow(msg: Message): void {
    super.onAfterShow(msg);
    if (this._model.latest) {
      this._onSample(this._model, this._model.latest);
    }
  }

  protected onBeforeDetach(msg: Message): void {
    this._model.telemetryChanged.disconnect(this._onSample, this);
    this._model.runsChanged.disconnect(this._onRuns, this);
    this._model.stateChanged.disconnect(this._onState, this);
    super.onBeforeDetach(msg);
  }

  /** live, or what it waits for (the socket, or the runs list: the last failure in the title) */
  private _onState(): void {
    const state = this._model.state;
    this._conn.textContent = state === 'live' ? 'live' : `${state}…`;
    this._conn.title = this._model.stateReason ?? '';
    this._conn.dataset.state = state;
    this._conn.classList.toggle('jp-mod-live', state === 'live');
  }

  private _onSample(_: GpuLabModel, sample: ISample): void {
    if (!this.isVisible) {
      return; // hidden side panels cost nothing; the next sample after showing repaints
    }
    const history = this._model.history;
    const h = sample.host;
    this._cpu.update(
      `${formatPct(h.cpu_pct)}${h.cpu_count ? ` of ${h.cpu_count} cores` : ''}`,
      history.map(s => s.host.cpu_pct)
    );
    this._ram.update(
      `${formatMiB(h.ram_used_mb)} / ${formatMiB(h.ram_total_mb)}`,
      history.map(s => s.host.ram_used_mb),
      h.ram_total_mb || 1
    );
    this._load.textContent =
      h.load_1 !== null && h.load_1 !== undefined ? `load ${h.load_1.toFixed(2)}` : '';
    this._samples += 1;
    this._sampleTime.dataset.samples = String(this._samples);
    this._sampleTime.textContent = sample.t
      ? `updated ${new Date(sample.t * 1000).toLocaleTimeString()}`
      : '';
    this._renderGpus(sample.gpus, history);
  }

  private _renderGpus(gpus: IGpuStats[], history: ReadonlyArray<ISample>): void {
    if (!gpus.length) {
      if (!this._gpus.querySelector('.jp-GpuLab-nogpu')) {
        this._gpus.replaceChildren(
          el('h3', '', 'GPUs'),
          el('div', 'jp-GpuLab-empty jp-GpuLab-nogpu', 'No GPU visible to NVML on this host.')
        );
        this._cards.clear();
      }
      return;
    }
    if (this._cards.size !== gpus.length || this._gpus.querySelector('.jp-GpuLab-nogpu')) {
      this._cards.clear();
      this._gpus.replaceChildren(el('h3', '', `GPUs (${gpus.length})`));
      for (const g of gpus) {
        const card = new GpuCard(g.index);
        this._cards.set(g.index, card);
        this._gpus.appendChild(card.node);
      }
    }
    for (const g of gpus) {
      this._cards.get(g.index)?.update(g, history);
    }
  }

  /** Update the runs list in place: a card per run id and a group per sweep, reused across
   *  polls, so that a button under the pointer is never replaced while the user clicks it. */
  private _onRuns(_: GpuLabModel, runs: IRun[]): void {
    this._runsEmpty.style.display = runs.length ? 'none' : '';
    this._renderPager(runs.length);
    const wanted = new Set(runs.map(r => r.id));
    for (const [id, card] of this._runCards) {
      if (!wanted.has(id)) {
        card.node.remove();
        this._runCards.delete(id);
      }
    }
    const sweeps = this._model.sweeps;
    const top: HTMLElement[] = [];
    const grouped = new Map<string, IRun[]>();
    for (const run of runs) {
      let card = this._runCards.get(run.id);
      if (!card) {
        card = new RunCard(run, this._actions, () => this._onSelect());
        this._runCards.set(run.id, card);
      }
      const sweepId = run.sweep;
      card.update(run, sweepId ? sweeps[sweepId] : undefined);
      if (!sweepId) {
        top.push(card.node);
        continue;
      }
      let group = this._groups.get(sweepId);
      if (!group) {
        group = new SweepGroup(sweepId, this._actions);
        this._groups.set(sweepId, group);
      }
      if (!grouped.has(sweepId)) {
        grouped.set(sweepId, []);
        top.push(group.node);
      }
      grouped.get(sweepId)!.push(run);
    }
    for (const [id, group] of this._groups) {
      const mine = grouped.get(id);
      if (!mine) {
        group.node.remove();
        this._groups.delete(id);
        continue;
      }
      group.update(sweeps[id], mine);
      placeChildren(
        group.trials,
        mine.map(r => this._runCards.get(r.id)!.node)
      );
    }
    placeChildren(this._runsList, top);
    this._onSelect();
  }

  /** Find any run: words of its name, id, notebook or a config value, `field:value` for an exact
   *  config value, a status; typed words are sent once the typing pauses. */
  private _searchBar(): HTMLDivElement {
    const bar = el('div', 'jp-GpuLab-search');
    this._searchText = el('input', 'jp-GpuLab-search-text');
    this._searchText.type = 'search';
    this._searchText.placeholder = 'Search: name, lr:0.01, …';
    this._searchText.title =
      "Words of a run's name, id, notebook or config values; field:value for an exact config " +
      'value (lr:0.001, model:resnet50)';
    const typed = new Debouncer(() => this._model.setSearch({ text: this._searchText.value }), 250);
    this._searchText.oninput = () => void typed.invoke();
    this._searchStatus = el('select', 'jp-GpuLab-search-status');
    for (const status of ['', ...ACTIVE_STATUSES, ...FINAL_STATUSES]) {
      const option = el('option', '', status || 'any status');
      option.value = status;
      this._searchStatus.appendChild(option);
    }
    this._searchStatus.onchange = () =>
      void this._model.setSearch({ status: this._searchStatus.value });
    bar.append(this._searchText, this._searchStatus);
    return bar;
  }

  /** Newer / older pages of the runs the search names, and where this page stands. */
  private _pager(): HTMLDivElement {
    const pager = el('div', 'jp-GpuLab-pager');
    this._newer = el('button', 'jp-GpuLab-link jp-GpuLab-newer', '‹ newer');
    this._older = el('button', 'jp-GpuLab-link jp-GpuLab-older', 'older ›');
    this._page = el('span', 'jp-GpuLab-page');
    const turn = (by: number) => {
      const s = this._model.search;
      void this._model.setSearch({ offset: Math.max(0, s.offset + by * s.limit) });
    };
    this._newer.onclick = () => turn(-1);
    this._older.onclick = () => turn(1);
    pager.append(this._newer, this._page, this._older);
    return pager;
  }

  private _renderPager(shown: number): void {
    const { offset, limit, text, status } = this._model.search;
    const total = this._model.total;
    this._newer.disabled = offset === 0;
    this._older.disabled = offset + limit >= total;
    this._page.textContent = shown
      ? `${offset + 1}–${offset + shown} of ${total.toLocaleString()}`
      : '';
    this._page.dataset.total = String(total);
    this._runsEmpty.textContent =
      text || status ? 'No run matches this search.' : 'No runs yet: launch one from a notebook.';
  }

  private _selected(): string[] {
    return [...this._runCards.entries()].filter(([, c]) => c.select.checked).map(([id]) => id);
  }

  private _onSelect(): void {
    const n = this._selected().length;
    this._compare.disabled = n < 2;
    this._compare.textContent = n ? `Compare (${n})` : 'Compare';
  }

  private _model: GpuLabModel;
  private _actions: IPanelActions;
  private _compare: HTMLButtonElement;
  private _conn: HTMLSpanElement;
  private _gpus: HTMLDivElement;
  private _cards = new Map<number, GpuCard>();
  private _cpu: StatRow;
  private _ram: StatRow;
  private _load: HTMLDivElement;
  private _sampleTime: HTMLDivElement;
  private _samples = 0;
  private _runsList: HTMLDivElement;
  private _runCards = new Map<string, RunCard>();
  private _groups = new Map<string, SweepGroup>();
  private _runsEmpty: HTMLDivElement;
  private _searchText!: HTMLInputElement;
  private _searchStatus!: HTMLSelectElement;
  private _newer!: HTMLButtonElement;
  private _older!: HTMLButtonElement;
  private _page!: HTMLSpanElement;
}

/** Make `nodes` the children of `parent`, in order, moving a node only when it is out of place
 *  (moving detaches it). */
function placeChildren(parent: HTMLElement, nodes: HTMLElement[]): void {
  nodes.forEach((node, i) => {
    if (parent.children[i] !== node) {
      parent.insertBefore(node, parent.children[i] ?? null);
    }
  });
  while (parent.children.length > nodes.length) {
    parent.lastElementChild!.remove();
  }
}
