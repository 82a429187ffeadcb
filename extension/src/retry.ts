/**
 * Requests that survive a failed fetch. The extension's periodic requests are @lumino/polling
 * Polls (backoff on failure, standby while the tab is hidden); this module has what they share:
 * the backoff, which failures are worth retrying, and `retrying`, a one-off request (a run's
 * summary, its triage) retried on a Poll until it succeeds.
 */
import { ServerConnection } from '@jupyterlab/services';
import { IPoll, Poll } from '@lumino/polling';

/** A poll's frequency: `interval` while it succeeds, backing off ×2 per failure (with jitter). */
export function backoff(interval: number): IPoll.Frequency {
  return { interval, backoff: 2, max: RETRY_MAX_MS };
}

/** The longest wait between two tries (Poll's own cap). */
export const RETRY_MAX_MS = 30_000;

/** What a live view says it is doing. */
export type LiveState = 'connecting' | 'live' | 'reconnecting';

/** A refusal that another try will not change (an unknown run, a bad request); a lost
 *  connection, a timeout, a server error or a proxy's 502 while the server restarts are worth
 *  retrying. */
export function isRefusal(error: unknown): boolean {
  if (!(error instanceof ServerConnection.ResponseError)) {
    return false;
  }
  const status = error.response.status;
  return status >= 400 && status < 500 && status !== 408 && status !== 429;
}

/** The error's message, for a view's "reconnecting" tooltip. */
export function errorText(error: unknown): string {
  return error instanceof Error ? error.message : String(error);
}

export interface IRetrying<T> {
  /** the request's first success; rejects only with a refusal (isRefusal) */
  readonly promise: Promise<T>;
  /** stop trying (the view closed): the promise never settles */
  dispose(): void;
}

/**
 * `request()` until it succeeds, on a Poll: at once, then backing off from `interval` ms;
 * `onFailure` hears each failed try (a view says "reconnecting").
 */
export function retrying<T>(
  name: string,
  request: () => Promise<T>,
  options: { interval?: number; onFailure?: (error: unknown) => void } = {}
): IRetrying<T> {
  let poll: Poll | null = null;
  const promise = new Promise<T>((resolve, reject) => {
    poll = new Poll({
      name,
      frequency: backoff(options.interval ?? 1000),
      standby: 'never',
      factory: async () => {
        try {
          const value = await request();
          resolve(value);
          poll?.dispose();
        } catch (error) {
          if (isRefusal(error)) {
            reject(error);
            poll?.dispose();
          } else {
            options.onFailure?.(error);
          }
          throw error; // the poll backs off
        }
      }
    });
  });
  return { promise, dispose: () => poll?.dispose() };
}
