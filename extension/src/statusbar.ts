/**
 * Status-bar item: GPU utilisation and memory (the busiest GPU when there are several), or host
 * CPU and RAM on a host without a GPU. Clicking it opens the GPU Lab panel.
 */
import { Message } from '@lumino/messaging';
import { Widget } from '@lumino/widgets';

import { formatMiB, formatPct, GpuLabModel, ISample } from './model';

export function statusText(sample: ISample | null): string {
  if (!sample) {
    return 'GPU Lab: …';
  }
  const gpus = sample.gpus;
  if (gpus.length) {
    const busiest = gpus.reduce((a, b) => ((b.util_gpu ?? -1) > (a.util_gpu ?? -1) ? b : a));
    const label = gpus.length > 1 ? `GPU×${gpus.length} max` : `GPU${busiest.index}`;
    return `${label} ${formatPct(busiest.util_gpu)} · ${formatMiB(busiest.mem_used_mb)}/${formatMiB(busiest.mem_total_mb)}`;
  }
  const h = sample.host;
  return `CPU ${formatPct(h.cpu_pct)} · RAM ${formatMiB(h.ram_used_mb)}/${formatMiB(h.ram_total_mb)}`;
}

export class GpuLabStatus extends Widget {
  constructor(model: GpuLabModel, onClick: () => void) {
    super();
    this._model = model;
    this.addClass('jp-GpuLab-status');
    this.node.title = 'GPU Lab: click to open the panel';
    this.node.textContent = statusText(null);
    this.node.onclick = onClick;
  }

  protected onAfterAttach(msg: Message): void {
    super.onAfterAttach(msg);
    this._model.telemetryChanged.connect(this._update, this);
    this._update(this._model, this._model.latest);
  }

  protected onBeforeDetach(msg: Message): void {
    this._model.telemetryChanged.disconnect(this._update, this);
    super.onBeforeDetach(msg);
  }

  private _update(_: GpuLabModel, sample: ISample | null): void {
    this.node.textContent = statusText(sample);
  }

  private _model: GpuLabModel;
}
