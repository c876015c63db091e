/**
 * The dense overview above the GPU cards: one row per GPU (utilisation bar and percent,
 * memory, power, who holds it), as nvitop and nvtop show many GPUs at a glance.
 *
 * `overviewRows` is the data (pure); `OVERVIEW_COLUMNS` says what each column shows (its
 * heading, class, value and minimum width: one entry drives the header, the cells built and
 * their updates); `GpuOverview` keeps one table's DOM up to date. CSS and tests find a
 * column's cells by its class, never by position.
 */

import {
  NO_VALUE,
  baseName,
  formatBytes,
  formatBytesOf,
  formatPercent,
  formatWatts
} from './format';
import {
  IStaleNote,
  Latest,
  busyColumn,
  busyText,
  deviceLabel
} from './metrics';
import { IDeviceInfo, IProcessInfo } from './protocol';

/** From this many GPUs on, the sidebar shows the overview above the cards. */
export const OVERVIEW_MIN_GPUS = 3;

/**
 * Memory an idle GPU shows as used with no process on it: the driver's own reservation
 * (0.3-0.6 GiB on A100 and H100 with nothing running, as nvidia-smi shows it). More than
 * this, with no process listed, is someone's: a process the driver does not show here.
 */
export const IDLE_RESERVE_BYTES = 1024 ** 3;

/** Who holds a GPU, in a few words, and in full for the tooltip. */
export interface IHolder {
  /**
   * "train.ipynb", "python", "another user", "free", "in use, holder not visible from this
   * container", or "–" before the first scan; "+2" when more.
   */
  text: string;
  /** Every process, one per line: "train.ipynb (4242) · you · 2 GB"; or why none is named. */
  title: string;
  /** The notebook of the process holding the most memory, when it is one of ours. */
  notebook: string | null;
}

/** What else is known of a GPU the driver lists no process on: is its memory in use, and where are we. */
export interface IGpuUse {
  memoryUsed: number | null;
  /** The server runs in a PID namespace of its own (`foreign_pid_namespace`). */
  foreignPidNamespace: boolean;
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
 * Whom the driver lists no process on: "free" only when its memory is no more than the
 * driver's idle reserve; else it is in use by a process not shown here, and in a container
 * without the host's PID namespace, that is why.
 */
function unlisted(use: IGpuUse | undefined): IHolder {
  const used = use?.memoryUsed ?? null;
  if (used === null || used <= IDLE_RESERVE_BYTES) {
    return { text: 'free', title: 'No processes on this GPU.', notebook: null };
  }
  const memory = `${formatBytes(used)} of its memory is in use`;
  if (use?.foreignPidNamespace) {
    return {
      text: 'in use, holder not visible from this container',
      title:
        `The driver lists no process on this GPU, but ${memory}. This Jupyter server runs in a ` +
        "container without the host's PID namespace, where the driver shows no process of the host's.",
      notebook: null
    };
  }
  return {
    text: 'in use, holder not listed',
    title: `The driver lists no process on this GPU, but ${memory} (a process it does not report here).`,
    notebook: null
  };
}

/**
 * The holder of a GPU from its processes (null: not listed yet). Another user's process
 * is shown only as the server describes it ("another user"), never with details. With no
 * process listed, `use` tells "free" from "in use, holder not visible".
 */
export function holderOf(
  processes: IProcessInfo[] | null | undefined,
  use?: IGpuUse
): IHolder {
  if (!processes) {
    return {
      text: NO_VALUE,
      title: 'Processes not listed yet.',
      notebook: null
    };
  }
  if (processes.length === 0) {
    return unlisted(use);
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
  device: IDeviceInfo;
  /** The newest readings (a stale GPU's last ones): what a column's value reads. */
  latest: Latest;
  /** The busy figure, percent (SM active where GPM is read, else kernel running), or null with no reading. */
  util: number | null;
  utilText: string;
  /** Both figures in words: "SM active 6% · kernel running 92%". */
  utilTitle: string;
  memoryText: string;
  powerText: string;
  holder: IHolder;
  /** Set while the GPU's readings have stopped: its values are its last, greyed. */
  stale: IStaleNote | null;
}

/** One row per GPU from the newest readings and the processes (`stale`: notes by device id). */
export function overviewRows(
  devices: IDeviceInfo[],
  latest: Latest,
  processes: Record<string, IProcessInfo[]>,
  processesListed: boolean,
  stale: Record<string, IStaleNote> = {}
): IOverviewRow[] {
  return devices.map(device => {
    const id = device.id;
    const util = latest(busyColumn(device));
    const total = device.memory_total ?? latest(`${id}.mem_total`);
    const memoryUsed = latest(`${id}.mem_used`);
    return {
      id,
      label: deviceLabel(device),
      device,
      latest,
      util,
      utilText: formatPercent(util),
      utilTitle: busyText(device, latest),
      memoryText: formatBytesOf(memoryUsed, total),
      powerText: formatWatts(latest(`${id}.power`)),
      holder: holderOf(processesListed ? (processes[id] ?? []) : null, {
        memoryUsed,
        foreignPidNamespace: device.foreign_pid_namespace === true
      }),
      stale: stale[id] ?? null
    };
  });
}

/** What one cell shows: its text and tooltip; a meter's fill (percent); a holder's notebook. */
export interface IOverviewCell {
  text: string;
  title?: string;
  /** A meter's fill, 0-100 (null: empty). */
  fill?: number | null;
  /** A holder cell links to this notebook. */
  notebook?: string | null;
  /** Greyed (another user's, or the last value of a GPU that stopped answering). */
  muted?: boolean;
}

/** How a column's cells are drawn: text (right-aligned for numbers), the GPU's button, a meter, a holder. */
export type OverviewCellKind = 'text' | 'number' | 'name' | 'meter' | 'holder';

/** One overview column: everything the header, the cells built and their updates need. */
export interface IOverviewColumn {
  heading: string;
  /** The class of its header and cells (`jp-gpuwidget-overview-<name>`): what CSS and tests select. */
  className: string;
  kind: OverviewCellKind;
  /** Its narrowest width (CSS length); the last column takes what is left. */
  minWidth: string;
  /** What a row shows in it. */
  value: (row: IOverviewRow) => IOverviewCell;
  /** The heading's tooltip. */
  title?: string;
}

/** The overview's columns, in order. A new column is one entry here (and its test). */
export const OVERVIEW_COLUMNS: IOverviewColumn[] = [
  {
    heading: 'GPU',
    className: 'jp-gpuwidget-overview-gpu',
    kind: 'name',
    minWidth: '3.2em',
    value: row => ({ text: row.label, title: `Show ${row.label}'s charts` })
  },
  {
    heading: 'Busy',
    className: 'jp-gpuwidget-overview-util',
    kind: 'meter',
    minWidth: '4.2em',
    title:
      'SM active (GPM) where the GPU reports it, else kernel running (nvidia-smi): the share of time any kernel ran',
    value: row => ({ text: row.utilText, title: row.utilTitle, fill: row.util })
  },
  {
    heading: 'Memory',
    className: 'jp-gpuwidget-overview-memory',
    kind: 'number',
    minWidth: '5.8em',
    value: row => ({ text: row.memoryText })
  },
  {
    heading: 'Power',
    className: 'jp-gpuwidget-overview-power',
    kind: 'number',
    minWidth: '3.4em',
    value: row => ({ text: row.powerText })
  },
  {
    heading: 'Held by',
    className: 'jp-gpuwidget-overview-holder',
    kind: 'holder',
    minWidth: '4em',
    // A GPU that stopped answering is not listed: its holder is unknown, and how long it has been is news.
    value: row =>
      row.stale
        ? { text: row.stale.short, title: row.stale.full }
        : {
            text: row.holder.text,
            title: row.holder.title,
            notebook: row.holder.notebook,
            muted: row.holder.text.startsWith('another user')
          }
  }
];

interface IRowNodes {
  tr: HTMLTableRowElement;
  cells: HTMLTableCellElement[];
  /** Each cell's last drawn value (JSON), so unchanged cells are left alone. */
  keys: string[];
  stale: boolean;
}

/** The overview table; `update` rewrites only the cells whose value changed. */
export class GpuOverview {
  readonly node: HTMLElement;
  readonly columns: IOverviewColumn[];
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
    openNotebook: ((path: string) => void) | null,
    columns: IOverviewColumn[] = OVERVIEW_COLUMNS
  ) {
    this._onReveal = onReveal;
    this._openNotebook = openNotebook;
    this.columns = columns;
    this.node = document.createElement('section');
    this.node.className = 'jp-gpuwidget-overview';
    this.node.setAttribute('aria-label', 'GPU overview');
    const table = document.createElement('table');
    table.className = 'jp-gpuwidget-overview-table';
    const caption = table.createCaption();
    caption.className = 'jp-gpuwidget-visually-hidden';
    caption.textContent = 'Every GPU at a glance';
    const head = table.createTHead().insertRow();
    columns.forEach((column, index) => {
      const th = document.createElement('th');
      th.scope = 'col';
      th.className = cellClass(column);
      th.textContent = column.heading;
      if (column.title) {
        th.title = column.title;
      }
      // The table's layout is fixed: the header's widths are the columns'; the last takes the rest.
      if (index < columns.length - 1) {
        th.style.width = column.minWidth;
      } else {
        th.style.minWidth = column.minWidth;
      }
      head.appendChild(th);
    });
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
      const stale = row.stale !== null;
      if (stale !== nodes.stale) {
        nodes.stale = stale;
        nodes.tr.classList.toggle('jp-mod-stale', stale);
      }
      this.columns.forEach((column, index) => {
        const value = column.value(row);
        const key = JSON.stringify(value);
        if (key !== nodes.keys[index]) {
          nodes.keys[index] = key;
          this._fill(column, nodes.cells[index], value);
        }
      });
    }
  }

  private _build(rows: IOverviewRow[]): void {
    this._body.replaceChildren();
    this._rows.clear();
    for (const row of rows) {
      const tr = this._body.insertRow();
      tr.dataset.device = row.id;
      const cells = this.columns.map(column => {
        const cell = document.createElement(
          column.kind === 'name' ? 'th' : 'td'
        );
        cell.className = cellClass(column);
        if (column.kind === 'name') {
          cell.scope = 'row';
          const reveal = document.createElement('button');
          reveal.className = 'jp-gpuwidget-link';
          reveal.addEventListener('click', () => this._onReveal(row.id));
          cell.appendChild(reveal);
        } else if (column.kind === 'meter') {
          const meter = document.createElement('span');
          meter.className = 'jp-gpuwidget-meter';
          const track = document.createElement('span');
          track.className = 'jp-gpuwidget-bar';
          track.setAttribute('aria-hidden', 'true');
          const bar = document.createElement('span');
          bar.className = 'jp-gpuwidget-bar-fill';
          track.appendChild(bar);
          const number = document.createElement('span');
          number.className = 'jp-gpuwidget-number';
          meter.append(track, number);
          cell.appendChild(meter);
        }
        tr.appendChild(cell);
        return cell;
      });
      this._rows.set(row.id, {
        tr,
        cells,
        keys: cells.map(() => ''),
        stale: false
      });
    }
  }

  /** Draw `value` into a cell of `column` (built by `_build` for its kind). */
  private _fill(
    column: IOverviewColumn,
    cell: HTMLTableCellElement,
    value: IOverviewCell
  ): void {
    switch (column.kind) {
      case 'name': {
        const button = cell.firstElementChild as HTMLButtonElement;
        button.textContent = value.text;
        button.title = value.title ?? '';
        return;
      }
      case 'meter': {
        const bar = cell.querySelector('.jp-gpuwidget-bar-fill') as HTMLElement;
        const fill = value.fill ?? null;
        bar.style.width = `${fill === null ? 0 : Math.max(0, Math.min(100, fill))}%`;
        const number = cell.querySelector(
          '.jp-gpuwidget-number'
        ) as HTMLElement;
        number.textContent = value.text;
        number.title = value.title ?? '';
        return;
      }
      case 'holder':
        cell.replaceChildren(this._holder(value));
        cell.title = value.title ?? '';
        return;
      default:
        cell.textContent = value.text;
        cell.title = value.title ?? '';
    }
  }

  private _holder(value: IOverviewCell): HTMLElement {
    const open = this._openNotebook;
    const notebook = value.notebook;
    if (notebook && open) {
      const link = document.createElement('button');
      link.className = 'jp-gpuwidget-link';
      link.textContent = value.text;
      link.setAttribute('aria-label', `Open ${notebook}`);
      link.addEventListener('click', () => open(notebook));
      return link;
    }
    const span = document.createElement('span');
    span.textContent = value.text;
    if (value.muted) {
      span.className = 'jp-gpuwidget-other';
    }
    return span;
  }
}

/** A column's cells' classes: its own, and the right alignment of numbers. */
function cellClass(column: IOverviewColumn): string {
  return column.kind === 'number'
    ? `${column.className} jp-gpuwidget-number`
    : column.className;
}
