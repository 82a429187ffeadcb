/**
 * A JupyterLab notification when a run ends, with a View action that opens its run view.
 *
 * Contract: the ends are read from the runs list the model polls. A run is announced once per
 * end: when the lab sees it succeeded, failed (with its triage's first line), stopped (with the
 * reason) or lost, after having seen it active, or not at all but ended since the lab first
 * listed the runs (it started and ended between two polls); runs that had already ended, and
 * runs a search or an older page brings into view, are not announced. A run that becomes active
 * again (a requeued job revives its row) is announced again at its next end. Failures and lost runs stay until dismissed; the others
 * close by themselves (all stay in JupyterLab's notification center).
 */
import { Notification } from '@jupyterlab/apputils';

import { formatDuration, GpuLabModel, IRun, RunStatus } from './model';

/** The ends announced, and how (JupyterLab's notification types). */
const ENDS: Partial<Record<RunStatus, Notification.TypeOptions>> = {
  succeeded: 'success',
  failed: 'error',
  stopped: 'info',
  pruned: 'info',
  lost: 'warning'
};
const AUTO_CLOSE_MS = 10000;
const CLOCK_SLACK_S = 60;
const MAX_MESSAGE = 140; // JupyterLab truncates longer notification messages

export class RunEndNotices {
  constructor(
    private readonly model: GpuLabModel,
    private readonly openRun: (runId: string) => void
  ) {
    model.runsChanged.connect(this._onRuns, this);
  }

  dispose(): void {
    this.model.runsChanged.disconnect(this._onRuns, this);
  }

  private _onRuns(_: GpuLabModel, runs: IRun[]): void {
    const first = this._since === null;
    if (first) {
      this._since = Date.now() / 1000 - CLOCK_SLACK_S; // the server's clock may differ a little
    }
    for (const run of runs) {
      if (!(run.status in ENDS)) {
        this._ended.delete(run.id);
        this._seenActive.add(run.id);
      } else if (!this._ended.has(run.id)) {
        this._ended.add(run.id);
        const endedSince = (run.ended ?? 0) >= (this._since ?? Infinity);
        if (!first && (this._seenActive.delete(run.id) || endedSince)) {
          void this._announce(run);
        }
      }
    }
  }

  private async _announce(run: IRun): Promise<void> {
    const name = run.name || run.id;
    const took =
      run.started && run.ended ? ` after ${formatDuration(run.ended - run.started)}` : '';
    let detail =
      run.status === 'stopped' || run.status === 'pruned' || run.status === 'lost'
        ? (run.reason ?? '')
        : '';
    if (run.status === 'failed') {
      detail = await this._headline(run);
    }
    if (!detail && run.note) {
      detail = run.note; // a record that paused on a full disk, a recorder replaced
    }
    let message = `Run ${name} ${run.status}${took}`;
    if (detail) {
      const room = MAX_MESSAGE - message.length - 1;
      message += `\n${detail.length > room ? `${detail.slice(0, room - 1)}…` : detail}`;
    }
    const stays = run.status === 'failed' || run.status === 'lost';
    Notification.emit(message, ENDS[run.status] ?? 'info', {
      autoClose: stays ? false : AUTO_CLOSE_MS,
      actions: [
        {
          label: 'View',
          caption: `Open the run view of ${name}`,
          displayType: 'accent',
          callback: () => this.openRun(run.id)
        }
      ]
    });
  }

  /** The triage's first line, as the run view's triage box and the external notice start. */
  private async _headline(run: IRun): Promise<string> {
    try {
      const detail = await this.model.getRun(run.id, 4);
      return detail.failure?.headline || detail.failure?.text.split('\n')[0] || '';
    } catch {
      return run.error?.trim().split('\n').pop() ?? '';
    }
  }

  private _ended = new Set<string>();
  private _seenActive = new Set<string>();
  private _since: number | null = null; // when the lab first listed the runs (its clock)
}
