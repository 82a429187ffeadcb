/**
 * Tick labels that tell the ticks apart. uPlot places the ticks; these name them as short as
 * they can be while no two are the same: a nearly flat series (host RAM at 1.3388…1.3392 GiB)
 * gets the digits its tick spacing needs, a few seconds of samples get tenths or milliseconds,
 * ticks days apart get their date. No imports and no DOM: tests/test_chart_ticks.py runs it in
 * Node.
 */

/** Short labels: 0.00123 → 1.23e-3, 12345 → 12.3k, 0.5 → 0.5 (4 significant digits at most). */
export function formatTick(v: number | null): string {
  return formatNumber(v, null);
}

/** The labels of numeric ticks `incr` apart (uPlot's spacing; the splits' own if not given):
 *  the short ones where they tell the ticks apart and name each exactly enough (123.3 does
 *  not name 123.25); else every digit down to the spacing's last one, and more if need be. */
export function numberTicks(splits: ReadonlyArray<number | null>, incr?: number): string[] {
  const step = incr && incr > 0 ? incr : spacing(splits);
  const short = splits.map(v => formatNumber(v, null));
  const exact = splits.every(
    v => v === null || !Number.isFinite(v) || Math.abs(shortValue(v) - v) <= step * 1e-6
  );
  if (exact && distinct(short)) {
    return short;
  }
  for (let extra = 0; extra <= 17; extra++) {
    const labels = splits.map(v => formatNumber(v, lastDigit(step) - extra));
    if (distinct(labels)) {
      return labels;
    }
  }
  return splits.map(v => (v === null ? '' : String(v)));
}

/** The labels of time ticks (Unix seconds, local time) `incr` s apart: HH:MM:SS, with tenths
 *  to milliseconds under a second apart, with the date when the ticks span days. */
export function clockTicks(splits: ReadonlyArray<number | null>, incr?: number): string[] {
  const step = incr && incr > 0 ? incr : spacing(splits);
  const fraction = Math.min(3, Math.max(0, -lastDigit(step)));
  const shown = splits.filter((v): v is number => v !== null && Number.isFinite(v));
  const days = new Set(shown.map(v => new Date(Math.round(v * 1000)).toDateString())).size;
  for (const date of days > 1 ? [true] : [false, true]) {
    for (let digits = fraction; digits <= 3; digits++) {
      const labels = splits.map(v => formatClock(v, digits, date));
      if (distinct(labels)) {
        return labels;
      }
    }
  }
  return splits.map(v => formatClock(v, 3, true));
}

/** HH:MM:SS with `digits` of the second's fraction, after MM-DD with `date`. */
export function formatClock(v: number | null, digits = 0, date = false): string {
  if (v === null || !Number.isFinite(v)) {
    return '';
  }
  // whole milliseconds first: 1700000000.2 * 1000 is 1700000000199.9998
  const d = new Date(Math.round(v * 1000));
  const two = (n: number) => String(n).padStart(2, '0');
  let text = `${two(d.getHours())}:${two(d.getMinutes())}:${two(d.getSeconds())}`;
  if (digits > 0) {
    text += `.${String(d.getMilliseconds()).padStart(3, '0').slice(0, digits)}`;
  }
  return date ? `${two(d.getMonth() + 1)}-${two(d.getDate())} ${text}` : text;
}

/**
 * One number: with `last` null, short (4 significant digits, 3 in k and M, 2 in exponents); else
 * down to the digit worth 10^last (−4: 1.3388), written out in full (1000000.001, not
 * 1.000000001M), trailing zeros kept so that the ticks line up.
 */
function formatNumber(v: number | null, last: number | null): string {
  if (v === null || !Number.isFinite(v)) {
    return '';
  }
  const a = Math.abs(v);
  if (a === 0) {
    return '0';
  }
  if (a < 1e-3) {
    const exp = Math.floor(Math.log10(a));
    return last === null
      ? v.toExponential(1).replace(/\.0e/, 'e')
      : v.toExponential(Math.min(20, Math.max(1, exp - last)));
  }
  if (last !== null) {
    return v.toFixed(Math.min(20, Math.max(0, -last)));
  }
  return a >= 1e6
    ? `${+(v / 1e6).toPrecision(3)}M`
    : a >= 1e4
      ? `${+(v / 1e3).toPrecision(3)}k`
      : String(+v.toPrecision(4));
}

/** The value a short label names (formatNumber with `last` null). */
function shortValue(v: number): number {
  const a = Math.abs(v);
  if (a === 0) {
    return 0;
  }
  if (a < 1e-3) {
    return +v.toExponential(1);
  }
  return a >= 1e6
    ? +(v / 1e6).toPrecision(3) * 1e6
    : a >= 1e4
      ? +(v / 1e3).toPrecision(3) * 1e3
      : +v.toPrecision(4);
}

/** The power of ten of a spacing's last digit: 0.00025 → −5, 0.2 → −1, 5 → 0, 2000 → 3. */
function lastDigit(step: number): number {
  if (!(step > 0) || !Number.isFinite(step)) {
    return 0;
  }
  for (let p = Math.floor(Math.log10(step)); p > -20; p--) {
    const scaled = step / 10 ** p;
    if (Math.abs(scaled - Math.round(scaled)) < 1e-6 * scaled) {
      return p;
    }
  }
  return -20;
}

/** The smallest gap between consecutive ticks (0 for fewer than two). */
function spacing(splits: ReadonlyArray<number | null>): number {
  const v = splits.filter((x): x is number => x !== null && Number.isFinite(x));
  let gap = Infinity;
  for (let i = 1; i < v.length; i++) {
    const d = Math.abs(v[i] - v[i - 1]);
    if (d > 0) {
      gap = Math.min(gap, d);
    }
  }
  return Number.isFinite(gap) ? gap : 0;
}

/** No label twice (blank labels, of ticks that are not drawn, aside). */
function distinct(labels: string[]): boolean {
  const seen = labels.filter(l => l !== '');
  return new Set(seen).size === seen.length;
}
