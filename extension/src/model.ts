/**
 * The model: talks to gpu_lab's server extension and holds what the views show.
 *
 * One websocket per browser tab streams telemetry (the server fans its one shared sampler out to
 * every tab); the runs list is polled, because the registry is a SQLite file written by other
 * processes and has nothing to push. Views subscribe to the signals and never fetch anything.
 */
import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';
import { ISignal, Signal } from '@lumino/signaling';

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
}

export interface ISample {
  t?: number;
  host: IHostStats;
  gpus: IGpuStats[];
}

export type RunStatus =
  | 'pending'
  | 'running'
  | 'stopping'
  | 'succeeded'
  | 'failed'
  | 'stopped'
  | 'lost';

export const ACTIVE_STATUSES: ReadonlyArray<RunStatus> = ['pending', 'running', 'stopping'];

export interface IRun {
  id: string;
  name: string;
  status: RunStatus;
  num_processes: number | null;
  started: number | null;
  ended: number | null;
  last_step: number | null;
  last_loss: number | null;
  error: string | null;
  notebook: string | null;
}

export interface IRunDetail extends IRun {
  config: Record<string, unknown>;
  metrics: Record<string, { step: number[]; value: number[] }>;
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
const RECONNECT_MAX_MS = 30000;

/** GET/POST a gpu_lab endpoint; throws an Error carrying the server's message on failure. */
export async function requestAPI<T>(path: string, init: RequestInit = {}): Promise<T> {
  const settings = ServerConnection.makeSettings();
  const url = URLExt.join(settings.baseUrl, 'gpu-lab', path);
  let response: Response;
  try {
    response = await ServerConnection.makeRequest(url, init, settings);
  } catch (error) {
    throw new ServerConnection.NetworkError(error as TypeError);
  }
  const text = await response.text();
  let data: any = text;
  try {
    data = text ? JSON.parse(text) : {};
  } catch {
    // not JSON (e.g. the Prometheus endpoint): return the text as is
  }
  if (!response.ok) {
    throw new ServerConnection.ResponseError(response, data?.message || text);
  }
  return data as T;
}

export class GpuLabModel {
  constructor(options: { interval?: number } = {}) {
    this._interval = options.interval ?? 1;
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

  get latest(): ISample | null {
    return this._history.length ? this._history[this._history.length - 1] : null;
  }

  get history(): ReadonlyArray<ISample> {
    return this._history;
  }

  get runs(): ReadonlyArray<IRun> {
    return this._runs;
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
    this._connect();
    void this.refreshRuns();
    this._runsTimer = window.setInterval(() => void this.refreshRuns(), RUNS_POLL_MS);
  }

  async refreshRuns(): Promise<IRun[]> {
    if (this._runsInFlight) {
      return this._runs;
    }
    this._runsInFlight = true;
    try {
      const reply = await requestAPI<{ runs: IRun[] }>('api/runs');
      this._runs = reply.runs;
      this._runsChanged.emit(this._runs);
    } catch (error) {
      console.warn('gpu_lab: could not list runs', error);
    } finally {
      this._runsInFlight = false;
    }
    return this._runs;
  }

  async stopRun(id: string): Promise<IRun> {
    const run = await requestAPI<IRun>(`api/runs/${encodeURIComponent(id)}/stop`, {
      method: 'POST'
    });
    await this.refreshRuns();
    return run;
  }

  getRun(id: string): Promise<IRunDetail> {
    return requestAPI<IRunDetail>(`api/runs/${encodeURIComponent(id)}`);
  }

  info(): Promise<IInfo> {
    return requestAPI<IInfo>('api/info');
  }

  dispose(): void {
    if (this._disposed) {
      return;
    }
    this._disposed = true;
    window.clearInterval(this._runsTimer);
    window.clearTimeout(this._reconnectTimer);
    this._socket?.close();
    Signal.clearData(this);
  }

  private _connect(): void {
    const settings = ServerConnection.makeSettings();
    let url = URLExt.join(settings.wsUrl, 'gpu-lab', 'api', 'telemetry', 'ws');
    url += `?interval=${this._interval}`;
    // Like JupyterLab's own kernel websockets: the login cookie authenticates the upgrade; a
    // token is appended only where the page was opened with one and the cookie is not available.
    if (settings.token && settings.appendToken) {
      url += `&token=${encodeURIComponent(settings.token)}`;
    }
    const socket = new WebSocket(url);
    this._socket = socket;
    socket.onopen = () => {
      this._backoff = 1000;
      this._setConnected(true);
    };
    socket.onmessage = event => this._onMessage(event.data);
    socket.onclose = () => {
      this._setConnected(false);
      if (this._disposed) {
        return;
      }
      this._reconnectTimer = window.setTimeout(() => this._connect(), this._backoff);
      this._backoff = Math.min(RECONNECT_MAX_MS, this._backoff * 2);
    };
  }

  private _onMessage(data: string): void {
    let msg: any;
    try {
      msg = JSON.parse(data);
    } catch {
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
    } else if (msg.type === 'sample' && msg.sample) {
      this._history.push(msg.sample);
      if (this._history.length > HISTORY_LENGTH) {
        this._history.splice(0, this._history.length - HISTORY_LENGTH);
      }
      this._telemetryChanged.emit(msg.sample);
    } else if (msg.type === 'error') {
      console.warn('gpu_lab telemetry:', msg.error);
    }
  }

  private _setConnected(value: boolean): void {
    if (value !== this._connected) {
      this._connected = value;
      this._connectionChanged.emit(value);
    }
  }

  private _interval: number;
  private _history: ISample[] = [];
  private _runs: IRun[] = [];
  private _started = false;
  private _disposed = false;
  private _connected = false;
  private _socket: WebSocket | null = null;
  private _backoff = 1000;
  private _reconnectTimer = 0;
  private _runsTimer = 0;
  private _runsInFlight = false;
  private _telemetryChanged = new Signal<this, ISample>(this);
  private _runsChanged = new Signal<this, IRun[]>(this);
  private _connectionChanged = new Signal<this, boolean>(this);
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
  return ACTIVE_STATUSES.includes(status);
}
