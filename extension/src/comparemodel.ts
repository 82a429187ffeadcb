/**
 * The model of one comparison: the server's overlay of the runs (GET compare), fetched again
 * every few seconds while any of them is still going. A failed fetch backs off and tries again
 * (retry.ts), and the lab's websocket coming back fetches at once; `state` says which is going on.
 * No DOM here: the view (compare.ts) listens to `changed`.
 */
import { Poll } from '@lumino/polling';
import { ISignal, Signal } from '@lumino/signaling';

import { GpuLabModel, ICompare, isActive } from './model';
import { backoff, errorText, isRefusal, LiveState } from './retry';

const REFRESH_MS = 5000;

/** Live states, and two ends: every run has ended (nothing more to fetch), or the server
 *  refused the comparison (`error` says why). */
export type CompareState = LiveState | 'ended' | 'refused';

export class CompareModel {
  constructor(lab: GpuLabModel, runIds: string[]) {
    this.lab = lab;
    this.runIds = runIds;
    this._poll = new Poll({
      name: `gpu_lab:compare ${runIds.join(',')}`,
      auto: false,
      factory: () => this._fetch(),
      frequency: backoff(REFRESH_MS),
      // no requests while the view is hidden (it asks again when shown) or the tab is
      standby: () => (this._paused ? true : 'when-hidden')
    });
    lab.connectionChanged.connect(this._onConnection, this);
  }

  readonly lab: GpuLabModel;
  readonly runIds: string[];
  data: ICompare | null = null;
  state: CompareState = 'connecting';
  /** the last failure, while reconnecting or refused */
  error: string | null = null;

  /** Emitted after each fetch, and when `state` changes. */
  get changed(): ISignal<this, void> {
    return this._changed;
  }

  /** Fetch now, and keep fetching while a run is active (again after a refusal or an end:
   *  the user asked). */
  refresh(): void {
    this._paused = false;
    void this._poll.refresh();
  }

  /** No requests while the view is not shown; `refresh` resumes. */
  pause(): void {
    this._paused = true;
  }

  dispose(): void {
    if (this._poll.isDisposed) {
      return;
    }
    this._poll.dispose();
    this.lab.connectionChanged.disconnect(this._onConnection, this);
    Signal.clearData(this);
  }

  /** One fetch: throws on failure, so that the poll backs off. */
  private async _fetch(): Promise<void> {
    try {
      this.data = await this.lab.compare(this.runIds);
    } catch (error) {
      if (this._poll.isDisposed) {
        return;
      }
      this.error = errorText(error);
      if (isRefusal(error)) {
        this.state = 'refused'; // another try gets the same answer
        void this._poll.stop();
      } else {
        console.warn('gpu_lab: could not compare these runs; retrying', error);
        this.state = 'reconnecting';
      }
      this._changed.emit();
      throw error;
    }
    this.error = null;
    this.state = this.data.runs.some(r => isActive(r.status)) ? 'live' : 'ended';
    if (this.state === 'ended') {
      void this._poll.stop(); // ended runs do not change
    }
    this._changed.emit();
  }

  private _onConnection(_: GpuLabModel, connected: boolean): void {
    if (connected && this.state !== 'ended' && this.state !== 'refused' && !this._paused) {
      void this._poll.refresh(); // the server is back: now, not after the poll's backoff
    }
  }

  private _poll: Poll;
  private _paused = false;
  private _changed = new Signal<this, void>(this);
}
