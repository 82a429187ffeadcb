/**
 * The model: talks to gpu_lab's server extension and holds what the views show.
 *
 * One websocket per browser tab streams telemetry (the server fans its one shared sampler out to
 * every tab) and the runs that open run views follow (the server reads each run once for every
 * tab that follows it); the runs list is polled, because the registry is a SQLite file written by
 * other processes. Both survive a server that goes away: the socket reopens and follows each run
 * again from where its view stands, the poll backs off and resumes (retry.ts). The side panel and
 * status bar subscribe to the signals; run views keep their own model (runmodel.ts) over this one.
 */
import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';
import { Poll } from '@lumino/polling';
import { ISignal, Signal } from '@lumino/signaling';

import { ACTIVE_STATUSES, DEFAULT_POINTS, RunStatus } from './facts';
import { backoff, errorText, LiveState } from './retry';

/** Host stats, named as gpu_lab.telemetry names them. */
export interface IHostStats {
  cpu_pct?: number | null;
  cpu_count?: number | null;
  ram_used_mb?: number | null;
  ram_total_mb?: number | null;
  ram_pct?: number | null;
  load_1?: number | null;
}

/** One GPU, named as gpu_lab.telemetry names its NVML fields. */
export interface IGpuStats {
  index: number;
  name?: string | null;
  uuid?: string | null;
  util_gpu?: number | null;
  mem_used_mb?: number | null;
  mem_total_mb?: number | null;
  mem_used_pct?: number | null;
  temperature_c?: number | null;
  power_w?: number | null;
  /** device memory held by the processes of the runs the server watches: {pid: MiB} */
  process_mem_mb?: Record<string, number> | null;
}

export interface ISample {
  t?: number;
  host: IHostStats;
  gpus: IGpuStats[];
}

export type { RunStatus };
const ACTIVE: ReadonlyArray<RunStatus> = ACTIVE_STATUSES;

export interface IRun {
  id: string;
  name: string;
  status: RunStatus;
  num_processes: number | null;
  /** what the ranks train with, as they said: 'bf16', 'bf16, fsdp2' (or what the launch
   *  asked for, before they say) */
  precision?: string | null;
  started: number | null;
  ended: number | null;
  last_step: number | null;
  last_loss: number | null;
  error: string | null;
  notebook: string | null;
  reason?: string | null;
  /** What the record says of itself: its disk was full and it paused, its recorder was
   *  replaced; with what was not written. */
  note?: string | null;
  resumed_from?: { run: string | null; step: number; path: string } | null;
  detach?: number | null;
  output_dir?: string | null;
  run_dir?: string | null;
  /** While queued: its place in the host's queue, 1 = next to start. */
  queue_position?: number | null;
  /** a queued run: the users who hold the devices it waits for */
  held_by?: string[];
  priority?: number | null;
  devices?: { kind: string; devices: Array<{ index: number; uuid: string | null }> } | null;
  /** The sweep that ran it (gpu_lab.sweep), its trial there (and seed index when a trial has
   *  several), and the last value of the sweep's metric it reported. */
  sweep?: string | null;
  /** A run that is a scheduler's job (gpu_lab.submit): the job id and the scheduler's view. */
  job?: IJob | null;
  trial?: number | null;
  trial_seed?: number | null;
  sweep_value?: number | null;
}

export interface IJob {
  scheduler: string;
  id: string | null;
  state?: string | null;
  nodes?: string | null;
  attempt?: number | null;
}

/** How many runs the side panel lists at a time. */
export const RUNS_PAGE = 100;

/** The runs list's search: `text` (words of a name, id, notebook or config value, and
 *  `field:value` pairs for an exact config value), `status`, and the page (`offset`, `limit`). */
export interface IRunSearch {
  text: string;
  status: string;
  offset: number;
  limit: number;
}

/** The query string GET api/runs takes for a search: words go to q, field:value pairs to config. */
export function runsQuery(search: IRunSearch): string {
  const words: string[] = [];
  const pairs: string[] = [];
  for (const word of search.text.split(/\s+/).filter(Boolean)) {
    (/^[A-Za-z_]\w*:.+$/.test(word) ? pairs : words).push(word);
  }
  const params = new URLSearchParams({
    limit: String(search.limit),
    offset: String(search.offset)
  });
  if (words.length) {
    params.set('q', words.join(' '));
  }
  if (pairs.length) {
    params.set('config', pairs.join(','));
  }
  if (search.status) {
    params.set('status', search.status);
  }
  return params.toString();
}

/** A sweep among the listed runs, summed up from the registry (gpu_lab.server.sweeps). */
export interface ISweep {
  id: string;
  name: string;
  metric: string | null;
  direction: 'maximize' | 'minimize' | null;
  /** trials asked for (null: the sweep's settings are not on this host) */
  trials: number | null;
  seeds: number;
  /** trials with runs, ended, still running or queued, and pruned */
  started: number;
  done: number;
  active: number;
  pruned: number;
  /** the best finished trial's value (mean over its seeds) and its run */
  best: number | null;
  best_run: string | null;
}

/** A run's status in words: a queued run says its place and who holds what it waits for
 *  ("queued · 2nd · held by alice"); a cluster job its scheduler and id while it is active
 *  ("queued · Slurm job 42"). */
export function statusText(
  run: Pick<IRun, 'status' | 'queue_position' | 'job' | 'held_by'>
): string {
  const n = run.queue_position;
  if (run.job?.id && isActive(run.status)) {
    const scheduler = run.job.scheduler === 'slurm' ? 'Slurm' : run.job.scheduler;
    return `${run.status} · ${scheduler} job ${run.job.id}`;
  }
  if (run.status !== 'queued' || !n) {
    return run.status;
  }
  const suffix = n % 100 >= 11 && n % 100 <= 13 ? 'th' : ['th', 'st', 'nd', 'rd'][n % 10] || 'th';
  const held = run.held_by?.length ? ` · held by ${run.held_by.join(', ')}` : '';
  return `queued · ${n}${suffix}${held}`;
}

/** A series as the server sends it: bounded, each bucket's minimum and maximum kept. */
export interface ISeriesPoints {
  step: number[];
  t: number[];
  value: Array<number | null>;
}

/** One event of a run's record (gpu_lab.record.events), numbered by `seq`. */
export interface IRunEvent {
  seq: number;
  rank: number;
  kind: 'metric' | 'status' | 'error' | 'log' | 'dropped' | 'config';
  t: number;
  step: number | null;
  data: Record<string, unknown>;
}

/** Whole lines of a run's log file, bytes [from, to). */
export interface ILogChunk {
  file: string;
  from: number;
  to: number;
  size?: number;
  text: string;
}

export interface IRankFailure {
  rank: number;
  type: string;
  message: string;
  category: string;
  explanation?: string;
  suggestions?: string[];
  traceback?: string;
}

/** The triage of a failed run: root cause first, and what to try. */
export interface IFailure {
  text: string;
  /** the root cause in one line (what end notices say) */
  headline?: string;
  category: string | null;
  ranks: IRankFailure[];
}

/** What a run view opens with: it follows the run from `seq` and each log's `to`. */
export interface IRunDetail extends IRun {
  config: Record<string, unknown>;
  seq: number;
  /** metric -> "0" | "1" | ... | "mean" -> points */
  series: Record<string, Record<string, ISeriesPoints>>;
  notes: IRunEvent[];
  failure: IFailure | null;
  logs: ILogChunk[];
  /** rank -> pid: what NVML lists on the GPUs a rank uses */
  pids?: Record<string, number>;
  /** rank -> the host it runs on */
  hosts?: Record<string, string>;
}

/** What the server pushes to a view that follows a run (each part only when new). */
export interface IRunFeedMessage {
  type: 'run' | 'error';
  run: string;
  from?: number;
  events?: IRunEvent[];
  /** the mean over ranks these events make due (each point replaces any at its step) */
  mean?: Record<string, ISeriesPoints>;
  logs?: ILogChunk[];
  row?: IRun;
  error?: string;
}

/** What the lab websocket sends (gpu_lab/server/handlers.py LiveWebSocket; feeds.py). */
export type ServerMessage =
  | { type: 'snapshot'; latest?: ISample | null; history?: ISample[] }
  | { type: 'sample'; sample: ISample }
  | (IRunFeedMessage & { type: 'run' })
  | { type: 'error'; error?: string; run?: string };

/** What this client sends over the lab websocket (LiveWebSocket's docstring lists the same). */
export type ClientMessage =
  { interval: number } | ({ follow: string } & IFeedCursor) | { unfollow: string };

/** A websocket message checked for its shape, or null (not JSON, or nothing this client knows):
 * the server's side is Python, so the type is a promise checked here, not by the compiler. */
export function parseServerMessage(text: string): ServerMessage | null {
  let msg: unknown;
  try {
    msg = JSON.parse(text);
  } catch {
    return null;
  }
  if (typeof msg !== 'object' || msg === null) {
    return null;
  }
  const m = msg as Record<string, unknown>;
  const isObject = (v: unknown) => typeof v === 'object' && v !== null;
  switch (m.type) {
    case 'snapshot':
      return (m.history === undefined || Array.isArray(m.history)) &&
        (m.latest === undefined || m.latest === null || isObject(m.latest))
        ? (m as ServerMessage)
        : null;
    case 'sample':
      return isObject(m.sample) ? (m as ServerMessage) : null;
    case 'run':
      return typeof m.run === 'string' &&
        (m.events === undefined || Array.isArray(m.events)) &&
        (m.mean === undefined || isObject(m.mean)) &&
        (m.logs === undefined || Array.isArray(m.logs))
        ? (m as ServerMessage)
        : null;
    case 'error':
      return m.run === undefined || typeof m.run === 'string' ? (m as ServerMessage) : null;
    default:
      return null;
  }
}

export interface IRunEvents {
  run: IRun;
  events: IRunEvent[];
  /** as IRunFeedMessage's */
  mean?: Record<string, ISeriesPoints>;
  seq: number;
  more: boolean;
}

export interface ICompareRun extends IRun {
  label: string;
  differs: Record<string, unknown>;
}

/** Runs overlaid: each metric's mean per run (t: seconds since that run started). */
export interface ICompare {
  runs: ICompareRun[];
  differ: string[];
  metrics: Record<string, Record<string, ISeriesPoints>>;
}

/** Where a view stands in a run's record: the server sends what comes after. */
export interface IFeedCursor {
  after: number;
  logs: Record<string, number>;
}

export interface IInfo {
  version: string;
  gpu_count: number;
  tutorials_index: string | null;
  registry: string;
}

/** Samples kept for the sparklines: two minutes at the default 1 s interval. */
export const HISTORY_LENGTH = 120;
const RUNS_POLL_MS = 2000;
/** the socket's first retry; then ×2 per failure, at most SOCKET_RETRY_MAX_MS apart */
const SOCKET_RETRY_MS = 1000;
const SOCKET_RETRY_MAX_MS = 10000;

/** GET/POST a gpu_lab endpoint; throws an Error carrying the server's message on failure (a
 * NetworkError when the connection failed, the body's reading included). */
export async function requestAPI<T>(path: string, init: RequestInit = {}): Promise<T> {
  const settings = ServerConnection.makeSettings();
  const url = URLExt.join(settings.baseUrl, 'gpu-lab', path);
  let response: Response;
  let text: string;
  try {
    response = await ServerConnection.makeRequest(url, init, settings);
    // the body can fail after the headers came: a server stopped mid-reply
    text = await response.text();
  } catch (error) {
    throw error instanceof ServerConnection.NetworkError
      ? error
      : new ServerConnection.NetworkError(error as TypeError);
  }
  let data: unknown = text;
  try {
    data = text ? JSON.parse(text) : {};
  } catch {
    // not JSON (e.g. the Prometheus endpoint): return the text as is
  }
  if (!response.ok) {
    const said = (data as { message?: unknown } | null)?.message;
    throw new ServerConnection.ResponseError(response, typeof said === 'string' ? said : text);
  }
  return data as T;
}

export class GpuLabModel {
  constructor(options: { interval?: number } = {}) {
    this._interval = options.interval ?? 1;
    this._runsPoll = new Poll({
      name: 'gpu_lab:runs',
      auto: false,
      factory: () => this._fetchRuns(),
      frequency: backoff(RUNS_POLL_MS),
      standby: 'when-hidden'
    });
    // the socket: opened again a second after it closes, backing off while that fails; a tick
    // while it is open or opening does nothing
    this._socketPoll = new Poll({
      name: 'gpu_lab:socket',
      auto: false,
      factory: () => this._openSocket(),
      standby: () => (this._socket ? true : 'when-hidden')
    });
    // set after construction: Poll's constructor raises any max below its own 30 s default
    this._socketPoll.frequency = {
      interval: SOCKET_RETRY_MS,
      backoff: 2,
      max: SOCKET_RETRY_MAX_MS
    };
  }

  /** Emitted for every telemetry sample. */
  get telemetryChanged(): ISignal<this, ISample> {
    return this._telemetryChanged;
  }

  /** Emitted whenever a runs poll completes. */
  get runsChanged(): ISignal<this, IRun[]> {
    return this._runsChanged;
  }

  /** Emitted when the telemetry connection state changes (true: streaming). */
  get connectionChanged(): ISignal<this, boolean> {
    return this._connectionChanged;
  }

  /** Emitted when `state` changes. */
  get stateChanged(): ISignal<this, LiveState> {
    return this._stateChanged;
  }

  /** What the lab's live parts are doing: live once the socket is open and the runs poll
   *  succeeds, reconnecting while either fails. */
  get state(): LiveState {
    if (!this._connected || this._runsError !== null) {
      return this._everConnected ? 'reconnecting' : 'connecting';
    }
    return 'live';
  }

  /** Why the lab is reconnecting (the last failure), or null. */
  get stateReason(): string | null {
    return this._runsError ?? (this._connected ? null : this._socketError);
  }

  get latest(): ISample | null {
    return this._history.length ? this._history[this._history.length - 1] : null;
  }

  get history(): ReadonlyArray<ISample> {
    return this._history;
  }

  get runs(): ReadonlyArray<IRun> {
    return this._runs;
  }

  /** The sweeps among the runs, by id (as of the last runs poll). */
  get sweeps(): Readonly<Record<string, ISweep>> {
    return this._sweeps;
  }

  /** What the runs list shows: a search (words, status, config field:value pairs) and a page. */
  get search(): Readonly<IRunSearch> {
    return this._search;
  }

  /** How many runs the search names in all (the list holds a page of them). */
  get total(): number {
    return this._total;
  }

  /** Show the runs `search` names (a new search starts at its first page); lists them now. */
  async setSearch(search: Partial<IRunSearch>): Promise<IRun[]> {
    const paging = Object.keys(search).every(k => k === 'offset');
    this._search = { ...this._search, ...(paging ? {} : { offset: 0 }), ...search };
    return this.refreshRuns();
  }

  get connected(): boolean {
    return this._connected;
  }

  get isDisposed(): boolean {
    return this._disposed;
  }

  /** Open the telemetry stream and start polling runs. Idempotent. */
  start(): void {
    if (this._started || this._disposed) {
      return;
    }
    this._started = true;
    void this._socketPoll.start();
    void this._runsPoll.start();
  }

  /** The runs list now (the poll's next tick, moved up); the last one known if that fails. */
  async refreshRuns(): Promise<IRun[]> {
    try {
      await this._runsPoll.refresh();
      await this._runsPoll.tick;
    } catch {
      // disposed: the last list known
    }
    return this._runs;
  }

  /** One poll of the runs list: throws on failure, so that the poll backs off. */
  private async _fetchRuns(): Promise<void> {
    const asked = ++this._runsAsked;
    try {
      const reply = await requestAPI<{
        runs: IRun[];
        sweeps?: Record<string, ISweep>;
        total?: number;
      }>(`api/runs?${runsQuery(this._search)}`);
      if (asked < this._runsApplied || this._disposed) {
        return; // a newer reply is in (a refresh overtook this poll)
      }
      this._runsApplied = asked;
      this._runs = reply.runs;
      this._sweeps = reply.sweeps ?? {};
      this._total = reply.total ?? reply.runs.length;
      this._setRunsError(null);
      this._runsChanged.emit(this._runs);
    } catch (error) {
      if (!this._disposed && asked > this._runsApplied) {
        console.warn('gpu_lab: could not list runs; retrying', error);
        this._setRunsError(errorText(error));
      }
      throw error;
    }
  }

  async stopRun(id: string): Promise<IRun> {
    const run = await requestAPI<IRun>(`api/runs/${encodeURIComponent(id)}/stop`, {
      method: 'POST'
    });
    await this.refreshRuns();
    return run;
  }

  /** Ask a running run for a checkpoint at its next step boundary. */
  requestCheckpoint(id: string): Promise<{ run: IRun; requested: string }> {
    return requestAPI(`api/runs/${encodeURIComponent(id)}/checkpoint`, { method: 'POST' });
  }

  /** A new run that continues this one from its newest checkpoint. */
  async resumeRun(id: string): Promise<{ run: IRun; resumed: string }> {
    const out = await requestAPI<{ run: IRun; resumed: string }>(
      `api/runs/${encodeURIComponent(id)}/resume`,
      { method: 'POST' }
    );
    await this.refreshRuns();
    return out;
  }

  getRun(id: string, points = DEFAULT_POINTS): Promise<IRunDetail> {
    return requestAPI<IRunDetail>(`api/runs/${encodeURIComponent(id)}?points=${points}`);
  }

  runEvents(id: string, after: number): Promise<IRunEvents> {
    return requestAPI<IRunEvents>(`api/runs/${encodeURIComponent(id)}/events?after=${after}`);
  }

  readLog(id: string, file: string, offset: number): Promise<ILogChunk> {
    return requestAPI<ILogChunk>(
      `api/runs/${encodeURIComponent(id)}/logs/${encodeURIComponent(file)}?offset=${offset}`
    );
  }

  compare(ids: string[], points = DEFAULT_POINTS): Promise<ICompare> {
    const runs = ids.map(encodeURIComponent).join(',');
    return requestAPI<ICompare>(`api/compare?runs=${runs}&points=${points}`);
  }

  telemetryHistory(n: number): Promise<{ latest: ISample | null; history: ISample[] }> {
    return requestAPI(`api/telemetry?n=${n}`);
  }

  /**
   * Follow a run over this tab's websocket: the server pushes its new events, log lines and row
   * changes to `handler`. `cursor()` says where the view stands; it is asked again whenever the
   * socket reconnects, so nothing is missed. One follower per run per tab.
   */
  follow(
    runId: string,
    cursor: () => IFeedCursor,
    handler: (msg: IRunFeedMessage) => void
  ): { dispose: () => void } {
    this._follows.set(runId, { cursor, handler });
    this._sendFollow(runId);
    return {
      dispose: () => {
        if (this._follows.get(runId)?.handler === handler) {
          this._follows.delete(runId);
          this._sendJSON({ unfollow: runId });
        }
      }
    };
  }

  info(): Promise<IInfo> {
    return requestAPI<IInfo>('api/info');
  }

  dispose(): void {
    if (this._disposed) {
      return;
    }
    this._disposed = true;
    this._runsPoll.dispose();
    this._socketPoll.dispose();
    this._socket?.close();
    Signal.clearData(this);
  }

  /** Open the socket: resolves once it is open, rejects if it closes before (the poll backs
   *  off). Opened again, it follows each run from where its view stands now. */
  private _openSocket(): Promise<void> {
    const settings = ServerConnection.makeSettings();
    let url = URLExt.join(settings.wsUrl, 'gpu-lab', 'api', 'telemetry', 'ws');
    url += `?interval=${this._interval}`;
    // Like JupyterLab's own kernel websockets: the login cookie authenticates the upgrade; a
    // token is appended only where the page was opened with one and the cookie is not available.
    if (settings.token && settings.appendToken) {
      url += `&token=${encodeURIComponent(settings.token)}`;
    }
    return new Promise<void>((resolve, reject) => {
      const socket = new WebSocket(url);
      this._socket = socket;
      socket.onopen = () => {
        const again = this._everConnected;
        this._everConnected = true;
        this._socketError = null;
        for (const runId of this._follows.keys()) {
          this._sendFollow(runId);
        }
        this._setConnected(true);
        if (again) {
          void this._runsPoll.refresh(); // back: the list at once, not after the poll's backoff
        }
        resolve();
      };
      socket.onmessage = event => this._onMessage(event.data);
      socket.onclose = event => {
        if (this._socket === socket) {
          this._socket = null;
        }
        this._socketError = `websocket closed (code ${event.code})`;
        this._setConnected(false);
        reject(new Error(this._socketError)); // nothing if it had opened
      };
    });
  }

  private _onMessage(data: string): void {
    const msg = parseServerMessage(data);
    if (msg === null) {
      return;
    }
    if (msg.type === 'snapshot') {
      const history: ISample[] = (msg.history || []).slice(-HISTORY_LENGTH);
      if (msg.latest && !history.length) {
        history.push(msg.latest);
      }
      this._history = history;
      if (this.latest) {
        this._telemetryChanged.emit(this.latest);
      }
    } else if (msg.type === 'sample') {
      this._history.push(msg.sample);
      if (this._history.length > HISTORY_LENGTH) {
        this._history.splice(0, this._history.length - HISTORY_LENGTH);
      }
      this._telemetryChanged.emit(msg.sample);
    } else if (msg.type === 'run' || (msg.type === 'error' && msg.run)) {
      this._follows.get(msg.run as string)?.handler(msg as IRunFeedMessage);
    } else if (msg.type === 'error') {
      console.warn('gpu_lab telemetry:', msg.error);
    }
  }

  private _sendFollow(runId: string): void {
    const follow = this._follows.get(runId);
    if (follow) {
      const { after, logs } = follow.cursor();
      this._sendJSON({ follow: runId, after, logs });
    }
  }

  private _sendJSON(payload: ClientMessage): void {
    if (this._socket?.readyState === WebSocket.OPEN) {
      this._socket.send(JSON.stringify(payload));
    }
  }

  private _setConnected(value: boolean): void {
    if (value !== this._connected && !this._disposed) {
      const was = this.state;
      this._connected = value;
      this._connectionChanged.emit(value);
      this._emitState(was);
    }
  }

  private _setRunsError(error: string | null): void {
    const was = this.state;
    this._runsError = error;
    this._emitState(was);
  }

  private _emitState(was: LiveState): void {
    if (this.state !== was) {
      this._stateChanged.emit(this.state);
    }
  }

  private _interval: number;
  private _follows = new Map<
    string,
    { cursor: () => IFeedCursor; handler: (msg: IRunFeedMessage) => void }
  >();
  private _history: ISample[] = [];
  private _runs: IRun[] = [];
  private _sweeps: Record<string, ISweep> = {};
  private _search: IRunSearch = { text: '', status: '', offset: 0, limit: RUNS_PAGE };
  private _total = 0;
  private _started = false;
  private _disposed = false;
  private _connected = false;
  private _everConnected = false;
  private _socket: WebSocket | null = null;
  private _socketError: string | null = null;
  private _socketPoll: Poll;
  private _runsPoll: Poll;
  /** runs requests made, and the newest whose reply is shown */
  private _runsAsked = 0;
  private _runsApplied = 0;
  private _runsError: string | null = null;
  private _telemetryChanged = new Signal<this, ISample>(this);
  private _runsChanged = new Signal<this, IRun[]>(this);
  private _connectionChanged = new Signal<this, boolean>(this);
  private _stateChanged = new Signal<this, LiveState>(this);
}

/** "3.2 GiB" from MiB. */
export function formatMiB(mib: number | null | undefined): string {
  if (mib === null || mib === undefined) {
    return '–';
  }
  return mib >= 1024 ? `${(mib / 1024).toFixed(1)} GiB` : `${mib.toFixed(0)} MiB`;
}

export function formatPct(v: number | null | undefined): string {
  return v === null || v === undefined ? '–' : `${v.toFixed(0)}%`;
}

export function isActive(status: RunStatus): boolean {
  return ACTIVE.includes(status);
}

/** "2h05m", "3m07s", "12s". */
export function formatDuration(seconds: number): string {
  const s = Math.max(0, Math.floor(seconds));
  if (s >= 3600) {
    return `${Math.floor(s / 3600)}h${String(Math.floor((s % 3600) / 60)).padStart(2, '0')}m`;
  }
  return s >= 60 ? `${Math.floor(s / 60)}m${String(s % 60).padStart(2, '0')}s` : `${s}s`;
}
