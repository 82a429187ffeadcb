/**
 * Bounded series for live charts: a port of gpu_lab.readers.history (decimate_minmax and Series),
 * so that a million-step run costs the browser what a thousand-step run does, and a loss spike
 * stays visible however far the series was thinned. tests/test_browser.py checks that both
 * languages keep the same points.
 */

/**
 * Reduce (x, y) to at most n points, keeping each bucket's minimum and maximum in x order; the
 * first and the last point are always kept. n must be >= 4.
 */
export function decimateMinMax(
  x: ReadonlyArray<number>,
  y: ReadonlyArray<number>,
  n: number
): [number[], number[]] {
  if (n < 4) {
    throw new Error(`decimateMinMax: n must be >= 4, got ${n}`);
  }
  const m = x.length;
  if (m !== y.length) {
    throw new Error(`decimateMinMax: x has ${m} points but y has ${y.length}`);
  }
  if (m <= n) {
    return [x.slice(), y.slice()];
  }
  const buckets = Math.floor((n - 2) / 2);
  const ox = [x[0]];
  const oy = [y[0]];
  const inner = m - 2;
  for (let b = 0; b < buckets; b++) {
    const lo = 1 + Math.floor((b * inner) / buckets);
    const hi = 1 + Math.floor(((b + 1) * inner) / buckets);
    if (hi <= lo) {
      continue;
    }
    // the first index of the minimum and of the maximum, as Python's min()/max() pick them
    let imin = lo;
    let imax = lo;
    for (let i = lo + 1; i < hi; i++) {
      if (y[i] < y[imin]) {
        imin = i;
      }
      if (y[i] > y[imax]) {
        imax = i;
      }
    }
    for (const i of imin === imax ? [imin] : [Math.min(imin, imax), Math.max(imin, imax)]) {
      ox.push(x[i]);
      oy.push(y[i]);
    }
  }
  ox.push(x[m - 1]);
  oy.push(y[m - 1]);
  return [ox, oy];
}

/** How far back from its end BoundedSeries.put looks for a step to replace. */
const PUT_SEARCH = 64;

/**
 * One series of (step, time, value) points, bounded to `capacity`: when it outgrows it, it is
 * decimated to half (minima and maxima kept), as gpu_lab.readers.history.Series does.
 */
export class BoundedSeries {
  constructor(capacity = 2000) {
    if (capacity < 8) {
      throw new Error(`BoundedSeries capacity must be >= 8, got ${capacity}`);
    }
    this.capacity = capacity;
  }

  readonly capacity: number;
  steps: number[] = [];
  times: number[] = [];
  values: number[] = [];
  /** Points ever appended, before decimation. */
  count = 0;

  get length(): number {
    return this.values.length;
  }

  get last(): number | null {
    return this.values.length ? this.values[this.values.length - 1] : null;
  }

  append(step: number, t: number, value: number): void {
    this.steps.push(step);
    this.times.push(t);
    this.values.push(value);
    this.count += 1;
    if (this.values.length > this.capacity) {
      this._compress();
    }
  }

  /**
   * A point that may be new or may replace the one at its step (the server's mean over ranks
   * gives a step again when a late rank changes it): a step newer than the last is appended, one
   * already near the end is replaced, an older one that is not there (decimated away) is left.
   */
  put(step: number, t: number, value: number): void {
    const n = this.steps.length;
    if (!n || step > this.steps[n - 1]) {
      this.append(step, t, value);
      return;
    }
    for (let i = n - 1; i >= Math.max(0, n - PUT_SEARCH); i--) {
      if (this.steps[i] === step) {
        this.times[i] = t;
        this.values[i] = value;
        return;
      }
    }
  }

  /** Replace the contents (a history decimated by the server), keeping the bound. */
  reset(steps: number[], times: number[], values: number[]): void {
    this.steps = steps.slice();
    this.times = times.slice();
    this.values = values.slice();
    this.count = values.length;
    if (this.values.length > this.capacity) {
      this._compress();
    }
  }

  private _compress(): void {
    const idx = this.values.map((_, i) => i);
    const [keep] = decimateMinMax(idx, this.values, Math.floor(this.capacity / 2));
    this.steps = keep.map(i => this.steps[i]);
    this.times = keep.map(i => this.times[i]);
    this.values = keep.map(i => this.values[i]);
  }
}
