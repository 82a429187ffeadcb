/**
 * The model of one run view: what the view draws, kept bounded, and kept live.
 *
 * It opens with the server's summary of the run (GET runs/<id>: bounded series of every rank and
 * their mean, notes, failure triage, log tails) and the server's recent telemetry, then follows the
 * run over the tab's websocket from where that summary stopped (the server pushes only what is
 * new). While the websocket is down it polls the REST endpoints instead, from where it stands;
 * every request backs off and tries again when it fails (retry.ts), and `feed` says which of
 * these is going on. No DOM here: the view (runview.ts) listens to `changed`.
 */
import { Poll } from '@lumino/polling';
import { ISignal, Signal } from '@lumino/signaling';

import { BoundedSeries } from './decimate';
import { DEFAULT_POINTS, MAX_TELEMETRY_HISTORY, MEAN } from './facts';
import {
  GpuLabModel,
  IFailure,
  ILogChunk,
  IRun,
  IRunDetail,
  IRunEvent,
  IRunFeedMessage,
  isActive,
  ISample,
  ISeriesPoints
} from './model';
import { backoff, errorText, IRetrying, retrying } from './retry';

/** Points kept per series in the browser: twice what the server sends to start with. */
const KEEP_POINTS = 2 * DEFAULT_POINTS;
/** Characters of each log kept in the view (its tail). */
export const LOG_KEEP = 200_000;
const NOTES_KEEP = 200;
/** Seconds of telemetry before a run's start and after its end that the view keeps. */
const TELEMETRY_MARGIN = 5;
const POLL_MS = 2000;
/** pages of events one poll reads at most (the server sends a page at a time) */
const POLL_PAGES = 20;

export type Change = 'row' | 'series' | 'logs' | 'notes' | 'telemetry' | 'error' | 'feed';

/** How the view gets the run: loading it, pushed over the websocket, polling the REST endpoints
 *  (websocket down), or retrying a request that failed. */
export type FeedState = 'connecting' | 'live' | 'polling' | 'reconnecting';

/** One metric: a series per rank ("0", "1", ...) and their mean ("mean"). */
export type MetricSeries = Map<string, BoundedSeries>;

export interface ILogBuffer {
  text: string;
  /** next byte to read */
  to: number;
  /** bytes received since the view opened, the tail it opened with included */
  bytes: number;
}

/** Host and GPU readings over time: "host.cpu_pct", "gpu0.util_gpu", ... -> series (x = time). */
export type TelemetrySeries = Map<string, BoundedSeries>;

export class RunViewModel {
  constructor(lab: GpuLabModel, runId: string) {
    this.lab = lab;
    this.runId = runId;
  }

  readonly lab: GpuLabModel;
  readonly runId: string;
  row: IRun | null = null;
  config: Record<string, unknown> = {};
  failure: IFailure | null = null;
  /** metric -> series */
  readonly metrics = new Map<string, MetricSeries>();
  readonly telemetry: TelemetrySeries = new Map();
  /** log/error/dropped events, newest last */
  notes: IRunEvent[] = [];
  readonly logs = new Map<string, ILogBuffer>();
  /** the ranks' pids (status events), to find the GPUs they hold memory on */
  readonly pids = new Set<string>();
  /** rank -> the host it runs on (its status events): a multi-node run's curves name it */
  readonly hosts = new Map<string, string>();
  /** indices of the GPUs the run's ranks hold memory on (empty: not known, e.g. no GPU) */
  readonly runGpus = new Set<number>();
  /** the newest event applied */
  seq = 0;
  /** messages received over the websocket (the tests read it) */
  feedMessages = 0;
  error: string | null = null;
  feed: FeedState = 'connecting';
  /** the last failure while `feed` is reconnecting */
  feedError: string | null = null;

  get changed(): ISignal<this, Change> {
    return this._changed;
  }

  /** the newest step any rank reported */
  get lastStep(): number | null {
    return this._lastStep;
  }

  get isActive(): boolean {
    return !!this.row && isActive(this.row.status);
  }

  /** Load the run (retrying while the server cannot be reached), then follow it live. Throws
   *  if the server refuses (no such run). */
  async open(): Promise<void> {
    this._loading = retrying(
      `gpu_lab:run ${this.runId}`,
      () => this.lab.getRun(this.runId, DEFAULT_POINTS),
      {
        onFailure: error => this._setFeed('reconnecting', error)
      }
    );
    const detail = await this._loading.promise;
    if (this._disposed) {
      return;
    }
    this._applyDetail(detail);
    try {
      const tel = await this.lab.telemetryHistory(MAX_TELEMETRY_HISTORY);
      tel.history.forEach(s => this._addSample(s));
      this._changed.emit('telemetry');
    } catch (error) {
      console.warn('gpu_lab: no telemetry history', error);
    }
    this.lab.telemetryChanged.connect(this._onSample, this);
    this.lab.connectionChanged.connect(this._onConnection, this);
    this._follow = this.lab.follow(
      this.runId,
      () => ({ after: this.seq, logs: this._logCursors() }),
      msg => this._onFeed(msg)
    );
    this._onConnection(this.lab, this.lab.connected);
  }

  dispose(): void {
    if (this._disposed) {
      return;
    }
    this._disposed = true;
    this._follow?.dispose();
    this._loading?.dispose();
    this._triage?.dispose();
    this._poll.dispose();
    this.lab.telemetryChanged.disconnect(this._onSample, this);
    this.lab.connectionChanged.disconnect(this._onConnection, this);
    Signal.clearData(this);
  }

  // --- controls -----------------------------------------------------------------------------
  async stop(): Promise<IRun> {
    const row = await this.lab.stopRun(this.runId);
    this._setRow(row);
    return row;
  }

  requestCheckpoint(): Promise<{ run: IRun; requested: string }> {
    return this.lab.requestCheckpoint(this.runId);
  }

  resume(): Promise<{ run: IRun; resumed: string }> {
    return this.lab.resumeRun(this.runId);
  }

  // --- applying what arrives ----------------------------------------------------------------
  private _applyDetail(d: IRunDetail): void {
    this._setRow(d, false);
    this.config = d.config;
    this.failure = d.failure;
    this.seq = d.seq;
    for (const [name, byKey] of Object.entries(d.series)) {
      for (const [key, pts] of Object.entries(byKey)) {
        const [steps, times, values] = finitePoints(pts);
        this._series(name, key).reset(steps, times, values);
      }
    }
    this.notes = d.notes.slice(-NOTES_KEEP);
    Object.values(d.pids ?? {}).forEach(pid => this.pids.add(String(pid)));
    Object.entries(d.hosts ?? {}).forEach(([rank, host]) => this.hosts.set(rank, host));
    for (const chunk of d.logs) {
      this._addLog(chunk);
    }
    for (const c of ['row', 'series', 'notes', 'logs'] as Change[]) {
      this._changed.emit(c);
    }
  }

  private _onFeed(msg: IRunFeedMessage): void {
    if (this._disposed) {
      return;
    }
    if (msg.type === 'error') {
      this.error = msg.error ?? 'the server refused to follow this run';
      this._changed.emit('error');
      return;
    }
    this.feedMessages += 1;
    if (msg.events?.length) {
      this._applyEvents(msg.events);
    }
    if (msg.mean) {
      this._applyMean(msg.mean);
    }
    if (msg.logs?.length) {
      msg.logs.forEach(c => this._addLog(c));
      this._changed.emit('logs');
    }
    if (msg.row) {
      this._setRow(msg.row);
    }
  }

  private _applyEvents(events: IRunEvent[]): void {
    let series = false;
    let notes = false;
    let config = false;
    for (const e of events) {
      if (e.seq <= this.seq) {
        continue; // already applied (a catch-up overlapping what we had)
      }
      this.seq = e.seq;
      if (e.kind === 'metric') {
        if (e.step !== null && (this._lastStep === null || e.step > this._lastStep)) {
          this._lastStep = e.step;
        }
        for (const [name, v] of Object.entries(e.data)) {
          if (typeof v === 'number' && Number.isFinite(v)) {
            const s = this._series(name, String(e.rank));
            s.append(e.step ?? s.count, e.t, v);
          }
        }
        series = true;
      } else if (e.kind === 'status' && e.rank >= 0 && typeof e.data.pid === 'number') {
        this.pids.add(String(e.data.pid));
        if (typeof e.data.host === 'string') {
          this.hosts.set(String(e.rank), e.data.host);
          series = true; // the curves' labels name the host
        }
      } else if (e.kind === 'log' || e.kind === 'error' || e.kind === 'dropped') {
        this.notes.push(e);
        notes = true;
      } else if (e.kind === 'config') {
        // the run's own code logged its hyperparameters (accelerate's init_trackers)
        this.config = { ...this.config, ...e.data };
        config = true;
      }
    }
    if (this.notes.length > NOTES_KEEP) {
      this.notes.splice(0, this.notes.length - NOTES_KEEP);
    }
    if (series) {
      this._changed.emit('series');
    }
    if (notes) {
      this._changed.emit('notes');
    }
    if (config) {
      this._changed.emit('row');
    }
  }

  /** The server's mean over ranks (gpu_lab.record.mean): drawn, never computed here. */
  private _applyMean(mean: Record<string, ISeriesPoints>): void {
    for (const [name, pts] of Object.entries(mean)) {
      const series = this._series(name, MEAN);
      const [steps, times, values] = finitePoints(pts);
      steps.forEach((step, i) => series.put(step, times[i], values[i]));
    }
    this._changed.emit('series');
  }

  private _setRow(row: IRun, emit = true): void {
    const wasActive = this.isActive;
    this.row = { ...(this.row ?? {}), ...row };
    if (row.devices?.kind === 'gpu') {
      // the GPUs the run claimed (gpu_lab.supervise.claims): its own from its first step
      for (const d of row.devices.devices ?? []) {
        this.runGpus.add(d.index);
      }
    }
    if (emit) {
      this._changed.emit('row');
    }
    if (wasActive && !this.isActive && this.row.status === 'failed' && !this.failure) {
      // the triage is read from the run folder once the run has failed
      this._triage?.dispose();
      this._triage = retrying(`gpu_lab:triage ${this.runId}`, () => this.lab.getRun(this.runId, 4));
      this._triage.promise.then(
        d => {
          this.failure = d.failure;
          this._changed.emit('row');
        },
        error => console.warn('gpu_lab: no triage for this run', error)
      );
    }
  }

  private _addLog(chunk: ILogChunk): void {
    let buf = this.logs.get(chunk.file);
    if (!buf) {
      buf = { text: '', to: chunk.from, bytes: 0 };
      this.logs.set(chunk.file, buf);
    }
    if (chunk.to <= buf.to && buf.bytes > 0) {
      return; // already have it
    }
    if (chunk.from > buf.to && buf.bytes > 0) {
      buf.text += `[… ${chunk.from - buf.to} bytes not shown …]\n`;
    }
    buf.text += chunk.text;
    if (buf.text.length > LOG_KEEP) {
      const cut = buf.text.indexOf('\n', buf.text.length - LOG_KEEP);
      buf.text = buf.text.slice(cut >= 0 ? cut + 1 : buf.text.length - LOG_KEEP);
    }
    buf.to = chunk.to;
    buf.bytes += chunk.to - chunk.from;
  }

  private _logCursors(): Record<string, number> {
    const out: Record<string, number> = {};
    for (const [file, buf] of this.logs) {
      out[file] = buf.to;
    }
    return out;
  }

  private _series(name: string, key: string): BoundedSeries {
    let byKey = this.metrics.get(name);
    if (!byKey) {
      byKey = new Map();
      this.metrics.set(name, byKey);
    }
    let s = byKey.get(key);
    if (!s) {
      s = new BoundedSeries(KEEP_POINTS);
      byKey.set(key, s);
    }
    return s;
  }

  // --- telemetry ----------------------------------------------------------------------------
  private _onSample(_: GpuLabModel, sample: ISample): void {
    if (this._addSample(sample)) {
      this._changed.emit('telemetry');
    }
  }

  /** Keep a sample taken during the run (with a margin either side); true if it was kept. */
  private _addSample(s: ISample): boolean {
    const t = s.t;
    const row = this.row;
    if (!t || !row?.started || t < row.started - TELEMETRY_MARGIN) {
      return false;
    }
    if (row.ended && t > row.ended + TELEMETRY_MARGIN) {
      return false;
    }
    const add = (key: string, v: number | null | undefined) => {
      if (typeof v !== 'number' || !Number.isFinite(v)) {
        return;
      }
      let series = this.telemetry.get(key);
      if (!series) {
        series = new BoundedSeries(KEEP_POINTS);
        this.telemetry.set(key, series);
      }
      if (series.length && t <= series.times[series.length - 1]) {
        return; // the REST history and the websocket overlap
      }
      series.append(t, t, v);
    };
    add('host.cpu_pct', s.host.cpu_pct);
    add(
      'host.ram_used_gib',
      s.host.ram_used_mb === null || s.host.ram_used_mb === undefined
        ? null
        : s.host.ram_used_mb / 1024
    );
    for (const g of s.gpus) {
      if (Object.keys(g.process_mem_mb ?? {}).some(pid => this.pids.has(pid))) {
        this.runGpus.add(g.index);
      }
      add(`gpu${g.index}.util_gpu`, g.util_gpu);
      add(
        `gpu${g.index}.mem_used_gib`,
        g.mem_used_mb === null || g.mem_used_mb === undefined ? null : g.mem_used_mb / 1024
      );
      add(`gpu${g.index}.power_w`, g.power_w);
    }
    return true;
  }

  // --- without the websocket: poll ------------------------------------------------------------
  private _onConnection(_: GpuLabModel, connected: boolean): void {
    if (this._disposed) {
      return;
    }
    if (connected) {
      // the socket follows the run again from this.seq (model.ts asks the cursor on reopening)
      void this._poll.stop();
      this._setFeed('live');
    } else {
      // before the lab's socket first opens, the view is loading, not reconnecting
      this._setFeed(this.lab.state === 'connecting' ? 'connecting' : 'reconnecting');
      void this._poll.start();
    }
  }

  /** One poll: the events after this.seq (page after page), the row, the logs' new lines.
   *  Throws on failure, so that the poll backs off. */
  private async _pollOnce(): Promise<void> {
    try {
      for (let pages = 0; pages < POLL_PAGES; pages++) {
        const page = await this.lab.runEvents(this.runId, this.seq);
        if (this.lab.connected || this._disposed) {
          return; // the socket is back and catches up from where the view stood when it opened
        }
        this._applyEvents(page.events);
        if (page.mean) {
          this._applyMean(page.mean);
        }
        this._setRow(page.run);
        if (!page.more) {
          break;
        }
      }
      for (const [file, buf] of this.logs) {
        const chunk = await this.lab.readLog(this.runId, file, buf.to);
        if (this.lab.connected || this._disposed) {
          return;
        }
        if (chunk.text) {
          this._addLog(chunk);
          this._changed.emit('logs');
        }
      }
      if (!this.lab.connected) {
        this._setFeed('polling');
      }
    } catch (error) {
      if (!this.lab.connected) {
        console.warn('gpu_lab: run view poll failed; retrying', error);
        this._setFeed('reconnecting', error);
      }
      throw error;
    }
  }

  private _setFeed(feed: FeedState, error?: unknown): void {
    const text = error === undefined ? null : errorText(error);
    if (this._disposed || (feed === this.feed && text === this.feedError)) {
      return;
    }
    this.feed = feed;
    this.feedError = text;
    this._changed.emit('feed');
  }

  private _changed = new Signal<this, Change>(this);
  private _lastStep: number | null = null;
  private _follow: { dispose: () => void } | null = null;
  private _poll = new Poll({
    name: 'gpu_lab:run view poll',
    auto: false,
    factory: () => this._pollOnce(),
    frequency: backoff(POLL_MS),
    standby: 'when-hidden'
  });
  private _loading: IRetrying<IRunDetail> | null = null;
  private _triage: IRetrying<IRunDetail> | null = null;
  private _disposed = false;
}

/** The finite points of a server series (NaN and infinities arrive as null). */
function finitePoints(p: ISeriesPoints): [number[], number[], number[]] {
  const steps: number[] = [];
  const times: number[] = [];
  const values: number[] = [];
  p.value.forEach((v, i) => {
    if (v !== null && Number.isFinite(v)) {
      steps.push(p.step[i]);
      times.push(p.t[i]);
      values.push(v);
    }
  });
  return [steps, times, values];
}
