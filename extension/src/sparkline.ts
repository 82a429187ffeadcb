/**
 * The side panel's sparklines: a polyline redrawn at most once per telemetry sample, which costs
 * the browser next to nothing (the run view's charts are uPlot's: charts.ts).
 */
const SVG_NS = 'http://www.w3.org/2000/svg';

function svgEl<K extends keyof SVGElementTagNameMap>(
  tag: K,
  attrs: Record<string, string | number>
): SVGElementTagNameMap[K] {
  const el = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs)) {
    el.setAttribute(k, String(v));
  }
  return el;
}

/** Map values to "x,y" polyline points inside width x height; null values break nothing. */
export function polylinePoints(
  xs: ReadonlyArray<number>,
  ys: ReadonlyArray<number | null | undefined>,
  width: number,
  height: number,
  yRange?: [number, number]
): string {
  const pts: Array<[number, number]> = [];
  for (let i = 0; i < ys.length; i++) {
    const y = ys[i];
    if (y !== null && y !== undefined && Number.isFinite(y)) {
      pts.push([xs[i], y]);
    }
  }
  if (!pts.length) {
    return '';
  }
  const x0 = pts[0][0];
  let x1 = pts[pts.length - 1][0];
  let [y0, y1] = yRange ?? [Math.min(...pts.map(p => p[1])), Math.max(...pts.map(p => p[1]))];
  if (x1 === x0) {
    x1 = x0 + 1;
  }
  if (y1 === y0) {
    y0 -= 1;
    y1 += 1;
  }
  const pad = 2;
  return pts
    .map(([x, y]) => {
      const px = pad + ((x - x0) / (x1 - x0)) * (width - 2 * pad);
      const py =
        height - pad - ((Math.min(y1, Math.max(y0, y)) - y0) / (y1 - y0)) * (height - 2 * pad);
      return `${px.toFixed(1)},${py.toFixed(1)}`;
    })
    .join(' ');
}

/** A fixed-size sparkline with a 0..max scale (percentages by default). */
export class Sparkline {
  constructor(options: { width?: number; height?: number; max?: number; className?: string } = {}) {
    this._width = options.width ?? 160;
    this._height = options.height ?? 28;
    this._max = options.max ?? 100;
    this.node = svgEl('svg', {
      width: this._width,
      height: this._height,
      viewBox: `0 0 ${this._width} ${this._height}`,
      // the panel stretches it to its width; keep the stroke even when stretched
      preserveAspectRatio: 'none',
      class: `jp-GpuLab-sparkline ${options.className ?? ''}`.trim()
    });
    this._line = svgEl('polyline', {
      fill: 'none',
      'stroke-width': 1.5,
      'vector-effect': 'non-scaling-stroke'
    });
    this.node.appendChild(this._line);
  }

  readonly node: SVGSVGElement;

  set max(value: number) {
    this._max = value > 0 ? value : 1;
  }

  update(values: ReadonlyArray<number | null | undefined>): void {
    const xs = values.map((_, i) => i);
    this._line.setAttribute(
      'points',
      polylinePoints(xs, values, this._width, this._height, [0, this._max])
    );
    this.node.dataset.points = String(values.filter(v => v !== null && v !== undefined).length);
  }

  private _width: number;
  private _height: number;
  private _max: number;
  private _line: SVGPolylineElement;
}
