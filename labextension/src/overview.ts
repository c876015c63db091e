/**
 * The dense overview above the GPU cards: one row per GPU (utilisation bar and percent,
 * memory, power, who holds it), as nvitop and nvtop show many GPUs at a glance.
 *
 * `overviewRows` is the data (pure); `GpuOverview` keeps one table's DOM up to date.
 */

import {
  NO_VALUE,
  baseName,
  formatBytes,
  formatBytesOf,
  formatPercent,
  formatWatts
} from './format';
import { Latest, busyColumn, busyText, deviceLabel } from './metrics';
import { IDeviceInfo, IProcessInfo } from './protocol';

/** From this many GPUs on, the sidebar shows the overview above the cards. */
export const OVERVIEW_MIN_GPUS = 3;

/** Who holds a GPU, in a few words, and in full for the tooltip. */
export interface IHolder {
  /** "train.ipynb", "python", "another user", "free", or "–" before the first scan; "+2" when more. */
  text: string;
  /** Every process, one per line: "train.ipynb (4242) · you · 2 GB". */
  title: string;
  /** The notebook of the process holding the most memory, when it is one of ours. */
  notebook: string | null;
}

function processName(process: IProcessInfo): string {
  if (process.notebook) {
    return baseName(process.notebook);
  }
  if (process.name) {
    return process.name;
  }
  // Another user's process: the server sends only its user ("another user") and memory.
  return process.user;
}

/**
 * The holder of a GPU from its processes (null: not listed yet). Another user's process
 * is shown only as the server describes it ("another user"), never with details.
 */
export function holderOf(
  processes: IProcessInfo[] | null | undefined
): IHolder {
  if (!processes) {
    return {
      text: NO_VALUE,
      title: 'Processes not listed yet.',
      notebook: null
    };
  }
  if (processes.length === 0) {
    return { text: 'free', title: 'No processes on this GPU.', notebook: null };
  }
  const sorted = [...processes].sort(
    (a, b) => (b.memory ?? 0) - (a.memory ?? 0)
  );
  const top = sorted[0];
  const more = sorted.length > 1 ? ` +${sorted.length - 1}` : '';
  const title = sorted
    .map(process => {
      const memory = formatBytes(process.memory);
      if (!process.notebook && !process.name) {
        return `${process.user} · ${memory}`;
      }
      const pid = process.pid !== null ? ` (${process.pid})` : '';
      return `${processName(process)}${pid} · ${process.user} · ${memory}`;
    })
    .join('\n');
  return {
    text: `${processName(top)}${more}`,
    title,
    notebook: top.notebook
  };
}

export interface IOverviewRow {
  id: string;
  label: string;
  /** The busy figure, percent (SM active where GPM is read, else kernel running), or null with no reading. */
  util: number | null;
  utilText: string;
  /** Both figures in words: "SM active 6% · kernel running 92%". */
  utilTitle: string;
  memoryText: string;
  powerText: string;
  holder: IHolder;
}

/** One row per GPU from the newest readings and the processes. */
export function overviewRows(
  devices: IDeviceInfo[],
  latest: Latest,
  processes: Record<string, IProcessInfo[]>,
  processesListed: boolean
): IOverviewRow[] {
  return devices.map(device => {
    const id = device.id;
    const util = latest(busyColumn(device));
    const total = device.memory_total ?? latest(`${id}.mem_total`);
    return {
      id,
      label: deviceLabel(device),
      util,
      utilText: formatPercent(util),
      utilTitle: busyText(device, latest),
      memoryText: formatBytesOf(latest(`${id}.mem_used`), total),
      powerText: formatWatts(latest(`${id}.power`)),
      holder: holderOf(processesListed ? (processes[id] ?? []) : null)
    };
  });
}

function cell(
  row: HTMLTableRowElement,
  className: string
): HTMLTableCellElement {
  const node = row.insertCell();
  node.className = className;
  return node;
}

interface IRowNodes {
  bar: HTMLElement;
  util: HTMLElement;
  memory: HTMLElement;
  power: HTMLElement;
  holder: HTMLElement;
  key: string;
}

/** The overview table; `update` rewrites only the cells whose text changed. */
export class GpuOverview {
  readonly node: HTMLElement;
  private _body: HTMLTableSectionElement;
  private _rows = new Map<string, IRowNodes>();
  private _layout = '';
  private _onReveal: (id: string) => void;
  private _openNotebook: ((path: string) => void) | null;

  /**
   * `onReveal(id)`: the user picked a GPU (its card is expanded and scrolled to);
   * `openNotebook`: opens a holder's notebook, or null where none can be opened.
   */
  constructor(
    onReveal: (id: string) => void,
    openNotebook: ((path: string) => void) | null
  ) {
    this._onReveal = onReveal;
    this._openNotebook = openNotebook;
    this.node = document.createElement('section');
    this.node.className = 'jp-gpuwidget-overview';
    this.node.setAttribute('aria-label', 'GPU overview');
    const table = document.createElement('table');
    table.className = 'jp-gpuwidget-overview-table';
    const caption = table.createCaption();
    caption.className = 'jp-gpuwidget-visually-hidden';
    caption.textContent = 'Every GPU at a glance';
    const head = table.createTHead().insertRow();
    for (const [heading, className] of [
      ['GPU', ''],
      ['Busy', 'jp-gpuwidget-number'],
      ['Memory', 'jp-gpuwidget-number'],
      ['Power', 'jp-gpuwidget-number'],
      ['Held by', '']
    ]) {
      const th = document.createElement('th');
      th.scope = 'col';
      th.className = className;
      th.textContent = heading;
      if (heading === 'Busy') {
        th.title =
          'SM active (GPM) where the GPU reports it, else kernel running (nvidia-smi): the share of time any kernel ran';
      }
      head.appendChild(th);
    }
    this._body = table.createTBody();
    this.node.appendChild(table);
  }

  update(rows: IOverviewRow[]): void {
    const layout = rows.map(row => `${row.id}:${row.label}`).join(',');
    if (layout !== this._layout) {
      this._layout = layout;
      this._build(rows);
    }
    for (const row of rows) {
      const nodes = this._rows.get(row.id);
      if (!nodes) {
        continue;
      }
      const width =
        row.util === null ? 0 : Math.max(0, Math.min(100, row.util));
      nodes.bar.style.width = `${width}%`;
      setText(nodes.util, row.utilText);
      if (nodes.util.title !== row.utilTitle) {
        nodes.util.title = row.utilTitle;
      }
      setText(nodes.memory, row.memoryText);
      setText(nodes.power, row.powerText);
      const key = `${row.holder.text}\n${row.holder.title}\n${row.holder.notebook}`;
      if (key !== nodes.key) {
        nodes.key = key;
        nodes.holder.replaceChildren(this._holder(row.holder));
        nodes.holder.title = row.holder.title;
      }
    }
  }

  private _build(rows: IOverviewRow[]): void {
    this._body.replaceChildren();
    this._rows.clear();
    for (const row of rows) {
      const tr = this._body.insertRow();
      tr.dataset.device = row.id;
      const name = document.createElement('th');
      name.scope = 'row';
      const reveal = document.createElement('button');
      reveal.className = 'jp-gpuwidget-link';
      reveal.textContent = row.label;
      reveal.title = `Show ${row.label}'s charts`;
      reveal.addEventListener('click', () => this._onReveal(row.id));
      name.appendChild(reveal);
      tr.appendChild(name);

      const meter = document.createElement('span');
      meter.className = 'jp-gpuwidget-meter';
      cell(tr, 'jp-gpuwidget-overview-util').appendChild(meter);
      const track = document.createElement('span');
      track.className = 'jp-gpuwidget-bar';
      track.setAttribute('aria-hidden', 'true');
      const bar = document.createElement('span');
      bar.className = 'jp-gpuwidget-bar-fill';
      track.appendChild(bar);
      const util = document.createElement('span');
      util.className = 'jp-gpuwidget-number';
      meter.append(track, util);

      const memory = cell(tr, 'jp-gpuwidget-number');
      const power = cell(tr, 'jp-gpuwidget-number');
      const holder = cell(tr, 'jp-gpuwidget-overview-holder');
      this._rows.set(row.id, { bar, util, memory, power, holder, key: '' });
    }
  }

  private _holder(holder: IHolder): HTMLElement {
    const open = this._openNotebook;
    const notebook = holder.notebook;
    if (notebook && open) {
      const link = document.createElement('button');
      link.className = 'jp-gpuwidget-link';
      link.textContent = holder.text;
      link.setAttribute('aria-label', `Open ${notebook}`);
      link.addEventListener('click', () => open(notebook));
      return link;
    }
    const span = document.createElement('span');
    span.textContent = holder.text;
    if (
      holder.text === 'another user' ||
      holder.text.startsWith('another user ')
    ) {
      span.className = 'jp-gpuwidget-other';
    }
    return span;
  }
}

function setText(node: HTMLElement, text: string): void {
  if (node.textContent !== text) {
    node.textContent = text;
  }
}
