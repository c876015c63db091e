/**
 * The sidebar's "Cluster" section: hosts x GPUs as a heat strip over the last hour (one
 * row per GPU, grouped by host, colour = utilisation), the idle GPUs named, each GPU's
 * holder, and what went wrong when Prometheus did not answer.
 *
 * Each strip is a canvas one pixel high and one pixel per Prometheus step, scaled by CSS
 * without smoothing: drawing is one putImageData per GPU whatever the panel's width.
 * The colour never carries meaning alone: every row says its mean and peak in text, idle
 * rows say "idle", and a step without data is hatched, not coloured.
 */

import {
  IClusterGpuRow,
  clusterSummary,
  heatColor,
  heatGradientCss,
  rowDescription
} from './cluster';
import {
  formatBytesOf,
  formatClock,
  formatPercent,
  formatWatts
} from './format';
import { ClusterState } from './model';
import { IClusterReply, Reading } from './protocol';
import { element } from './dom';

let nextId = 0;

/** The newest reading of a series, or null. */
function lastReading(values: Reading[]): number | null {
  for (let i = values.length - 1; i >= 0; i--) {
    const value = values[i];
    if (typeof value === 'number' && Number.isFinite(value)) {
      return value;
    }
  }
  return null;
}

/** Paint one strip: a pixel per step, transparent where there is no reading. */
export function paintStrip(canvas: HTMLCanvasElement, util: Reading[]): void {
  const width = Math.max(1, util.length);
  canvas.width = width;
  canvas.height = 1;
  const context = canvas.getContext('2d');
  if (!context) {
    return;
  }
  const image = context.createImageData(width, 1);
  const data = image.data;
  for (let i = 0; i < util.length; i++) {
    const value = util[i];
    if (typeof value !== 'number' || !Number.isFinite(value)) {
      continue; // alpha stays 0: the hatched background shows "no data"
    }
    const [r, g, b] = heatColor(value);
    data[4 * i] = r;
    data[4 * i + 1] = g;
    data[4 * i + 2] = b;
    data[4 * i + 3] = 255;
  }
  context.putImageData(image, 0, 0);
}

export class ClusterView {
  readonly node: HTMLElement;
  private _meta = element('span', 'jp-gpuwidget-cluster-meta');
  private _message = element('div', 'jp-gpuwidget-cluster-message');
  private _idle = element('p', 'jp-gpuwidget-cluster-idle');
  private _legend: HTMLElement;
  private _table = element('table', 'jp-gpuwidget-cluster-table');
  private _shown: IClusterReply | null = null;

  constructor() {
    const headingId = `jp-gpuwidget-cluster-heading-${nextId++}`;
    this.node = element('section', 'jp-gpuwidget-cluster');
    this.node.setAttribute('aria-labelledby', headingId);
    const header = element('div', 'jp-gpuwidget-section-header');
    const heading = element('h3', 'jp-gpuwidget-section-heading', 'Cluster');
    heading.id = headingId;
    header.append(heading, this._meta);
    this._message.setAttribute('role', 'status');
    this._idle.setAttribute('role', 'status');
    this._legend = this._buildLegend();
    this.node.append(
      header,
      this._message,
      this._idle,
      this._legend,
      this._table
    );
  }

  /** Show a state of the cluster feed; the table is rebuilt only for a new reply. */
  update(state: ClusterState): void {
    this.node.hidden = state.kind === 'off';
    let reply: IClusterReply | null = null;
    let message = '';
    let error = false;
    switch (state.kind) {
      case 'off':
        return;
      case 'loading':
        message = 'Asking Prometheus for the last hour…';
        break;
      case 'ready':
        reply = state.reply;
        if (!reply.configured) {
          message = 'No Prometheus is configured for this server.';
          error = true;
        } else if (reply.error) {
          message = `The cluster could not be read: ${reply.error}`;
          error = true;
        }
        this._meta.textContent = this._metaText(reply, state.atMs);
        break;
      case 'error':
        reply = state.last;
        message = `The cluster could not be read: ${state.message}`;
        error = true;
        break;
    }
    this._message.textContent = message;
    this._message.classList.toggle('jp-gpuwidget-notice-error', error);
    this._message.hidden = message === '';
    if (reply !== this._shown) {
      this._shown = reply;
      this._render(reply);
    }
  }

  private _metaText(reply: IClusterReply, atMs: number): string {
    const gpus = reply.hosts.reduce((n, host) => n + host.gpus.length, 0);
    const source = reply.source === 'dcgm' ? 'dcgm-exporter' : reply.source;
    const parts = [
      `${gpus} GPU${gpus === 1 ? '' : 's'} on ${reply.hosts.length} host${reply.hosts.length === 1 ? '' : 's'}`
    ];
    if (source) {
      parts.push(source);
    }
    parts.push(`updated ${formatClock(atMs / 1000, true)}`);
    return parts.join(' · ');
  }

  private _buildLegend(): HTMLElement {
    const legend = element('div', 'jp-gpuwidget-cluster-legend');
    legend.setAttribute('aria-hidden', 'true'); // each row says its figures in text
    const ramp = element('span', 'jp-gpuwidget-cluster-ramp');
    ramp.style.background = heatGradientCss();
    const none = element('span', 'jp-gpuwidget-cluster-swatch jp-mod-nodata');
    legend.append(
      element('span', '', 'Utilisation 0%'),
      ramp,
      element('span', '', '100%'),
      none,
      element('span', '', 'no data')
    );
    return legend;
  }

  private _render(reply: IClusterReply | null): void {
    this._table.replaceChildren();
    if (!reply || !reply.configured) {
      this._idle.textContent = '';
      this._idle.hidden = true;
      this._legend.hidden = true;
      return;
    }
    const summary = clusterSummary(reply);
    this._idle.hidden = false;
    this._idle.textContent = summary.idleText;
    this._legend.hidden = summary.rows.length === 0;
    const caption = this._table.createCaption();
    caption.className = 'jp-gpuwidget-visually-hidden';
    caption.textContent = `GPU utilisation per host over ${summary.window}`;
    let body: HTMLTableSectionElement | null = null;
    let host: string | null = null;
    for (const row of summary.rows) {
      if (row.host !== host || !body) {
        host = row.host;
        body = this._table.createTBody();
        const heading = body.insertRow();
        heading.className = 'jp-gpuwidget-cluster-host';
        const th = element('th', '', row.host);
        th.scope = 'rowgroup';
        th.colSpan = 3;
        heading.appendChild(th);
      }
      this._row(body, row, summary.window);
    }
    if (summary.rows.length) {
      const axis = this._table.createTFoot().insertRow();
      axis.className = 'jp-gpuwidget-cluster-axis';
      axis.setAttribute('aria-hidden', 'true');
      axis.insertCell();
      const span = axis.insertCell();
      const minutes = Math.round((reply.end - reply.start) / 60);
      span.append(
        element('span', '', `−${minutes} min`),
        element('span', '', 'now')
      );
      axis.insertCell();
    }
  }

  private _row(
    body: HTMLTableSectionElement,
    row: IClusterGpuRow,
    window: string
  ): void {
    const tr = body.insertRow();
    tr.className = 'jp-gpuwidget-cluster-gpu';
    tr.dataset.host = row.host;
    tr.dataset.gpu = row.gpu.gpu;
    if (row.idle) {
      tr.classList.add('jp-mod-idle');
    }
    const name = element('th', 'jp-gpuwidget-cluster-name');
    name.scope = 'row';
    name.appendChild(element('span', '', row.label));
    if (row.gpu.holder) {
      name.appendChild(
        element('span', 'jp-gpuwidget-cluster-holder', row.gpu.holder)
      );
    }
    name.title = [row.gpu.model, row.gpu.uuid, row.gpu.holder]
      .filter(Boolean)
      .join('\n');
    tr.appendChild(name);

    const stripCell = tr.insertCell();
    stripCell.className = 'jp-gpuwidget-cluster-stripcell';
    const canvas = element('canvas', 'jp-gpuwidget-cluster-strip');
    canvas.setAttribute('role', 'img');
    canvas.setAttribute('aria-label', rowDescription(row, window));
    paintStrip(canvas, row.gpu.util);
    stripCell.appendChild(canvas);

    const readout = tr.insertCell();
    readout.className = 'jp-gpuwidget-number jp-gpuwidget-cluster-readout';
    const mean = row.stats.mean;
    readout.textContent =
      mean === null ? 'no data' : row.idle ? 'idle' : formatPercent(100 * mean);
    const now = [
      `memory ${formatBytesOf(lastReading(row.gpu.memory_used_bytes), row.gpu.memory_total_bytes)}`,
      `power ${formatWatts(lastReading(row.gpu.power_w))}`
    ];
    readout.title = [
      mean === null
        ? 'No utilisation readings'
        : `Utilisation mean ${formatPercent(100 * mean)}, peak ${formatPercent(100 * (row.stats.peak ?? 0))}`,
      `Now: ${now.join(', ')}`
    ].join('\n');
  }
}
