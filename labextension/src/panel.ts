/**
 * The GPU sidebar: with several GPUs a dense overview (one row each), then one card per
 * GPU (live charts, current values, the processes and their notebooks; collapsed from
 * CARDS_COLLAPSED_FROM GPUs on), the host's CPU and memory, and the cluster where the
 * server reads one from Prometheus. Thin DOM glue over the model.
 *
 * It tells its owner when it is shown or hidden, so the connection exists only while
 * someone can see it; it draws at most once per animation frame. Keyboard and screen
 * readers: the panel is a labelled region, each card and section is labelled by its
 * heading, every control is a native button (Tab, Enter, Space), and no state is told
 * by colour alone.
 */

import { Message } from '@lumino/messaging';
import { Widget } from '@lumino/widgets';

import { ChartData, ChartPalette, TimeChart } from './charts';
import { ClusterView } from './clusterview';
import {
  NO_VALUE,
  baseName,
  formatAge,
  formatBytes,
  formatClock,
  noGpuDetail
} from './format';
import {
  IChartDef,
  GPU_METRICS,
  GpuMetric,
  Latest,
  deviceLabel,
  gpuCharts,
  IStaleNote,
  gpuReadout,
  hostCharts,
  splitReported,
  staleNoteOf
} from './metrics';
import {
  IStalledState,
  ModelChange,
  SidebarModel,
  visibleRange
} from './model';
import {
  GpuOverview,
  OVERVIEW_MIN_GPUS,
  holderOf,
  overviewRows
} from './overview';
import { IDeviceInfo, IProcessInfo } from './protocol';
import { element } from './dom';

export const PANEL_ID = 'gpuwidget-sidebar';

/** From this many GPUs on, the GPU cards start collapsed (the overview shows them all). */
export const CARDS_COLLAPSED_FROM = 4;

/** "GPU 1 stopped answering 12 s ago" for each stalled source, as of `nowS`. */
export function stalledLines(stalled: IStalledState, nowS: number): string[] {
  const elapsed = Math.max(0, nowS - stalled.receivedS);
  // As a stale GPU's row counts it (metrics.ts staleNote): one figure, one rounding.
  return stalled.sources.map(
    ({ source, since_s }) =>
      `${source} stopped answering ${formatAge(since_s + elapsed)}`
  );
}

export interface IPanelOptions {
  model: SidebarModel;
  /** Called with true when the panel becomes visible, false when hidden or detached. */
  onVisibilityChange(visible: boolean): void;
  /** The user asked to try the server again. */
  onRetry(): void;
  /** Open a notebook by its server path; null where no document manager exists. */
  openNotebook: ((path: string) => void) | null;
  metrics?: GpuMetric[];
}

/** The live DOM and charts of one card (a GPU, or the host). */
interface ICard {
  id: string;
  node: HTMLElement;
  /** The header's button that folds the card; null for the host's card. */
  toggle: HTMLButtonElement | null;
  body: HTMLElement;
  /** The one-line values in the header (shown while folded). */
  readout: HTMLElement | null;
  device: IDeviceInfo | null;
  charts: { chart: TimeChart; value: HTMLElement; host: HTMLElement }[];
  processes: HTMLElement | null;
}

export class GpuPanel extends Widget {
  readonly model: SidebarModel;
  private _options: IPanelOptions;
  private _metrics: GpuMetric[];
  private _palette = new ChartPalette();
  private _status = element('div', 'jp-gpuwidget-status');
  private _notice = element('div', 'jp-gpuwidget-notice');
  private _stalled = element('div', 'jp-gpuwidget-notice jp-gpuwidget-stalled');
  private _stalledKey = '';
  private _overview: GpuOverview;
  private _cardsNode = element('div', 'jp-gpuwidget-cards');
  private _cluster = new ClusterView();
  /** Cards the user folded or unfolded, by device id (else the default for the count). */
  private _folded = new Map<string, boolean>();
  private _cards: ICard[] = [];
  private _layoutKey = '';
  private _frame: number | null = null;
  private _processesDirty = true;
  private _resizeObserver: ResizeObserver | null = null;

  constructor(options: IPanelOptions) {
    super();
    this.id = PANEL_ID;
    this.addClass('jp-gpuwidget-sidebar');
    this.node.setAttribute('role', 'region');
    this.node.setAttribute('aria-label', 'GPU sidebar');
    this.model = options.model;
    this._options = options;
    this._metrics = options.metrics ?? GPU_METRICS;
    const header = element('header', 'jp-gpuwidget-header');
    header.appendChild(element('h2', 'jp-gpuwidget-heading', 'GPUs'));
    header.appendChild(this._status);
    // Connection changes are announced, politely; values are not (they change every second).
    this._status.setAttribute('role', 'status');
    this._stalled.setAttribute('role', 'alert');
    this._overview = new GpuOverview(
      id => this.revealCard(id),
      options.openNotebook
    );
    this._overview.node.hidden = true;
    this._cluster.node.hidden = true;
    this._cardsNode.setAttribute('aria-label', 'GPU details');
    this.node.append(
      header,
      this._notice,
      this._stalled,
      this._overview.node,
      this._cardsNode,
      this._cluster.node
    );
    // With this widget as thisArg, Widget.dispose() disconnects it (Signal.clearData).
    this.model.changed.connect(this._changed, this);
  }

  /** The GPU charts to show (from the settings). */
  setMetrics(metrics: GpuMetric[]): void {
    this._metrics = metrics;
    this._schedule();
  }

  /** Unfold a GPU's card, scroll it into view and move the focus to its header. */
  revealCard(id: string): void {
    const card = this._cards.find(c => c.id === id);
    if (!card) {
      return;
    }
    this._setFolded(card, false);
    card.node.scrollIntoView?.({ block: 'nearest' });
    (card.toggle ?? card.node).focus();
  }

  /** The theme changed: read its colours again and redraw. */
  refreshTheme(): void {
    if (!this.isVisible) {
      return; // read on the next show
    }
    this._palette.refresh(this.node);
    for (const card of this._cards) {
      card.charts.forEach(({ chart }) => chart.redraw());
    }
  }

  /**
   * Bring the DOM up to date with the model now (normally called once per animation
   * frame after a change; public so a test can time it).
   */
  render(): void {
    if (this._frame !== null) {
      cancelAnimationFrame(this._frame);
      this._frame = null;
    }
    this._renderStatus();
    this._renderStalled();
    const key = this._layoutSignature();
    if (key !== this._layoutKey) {
      this._layoutKey = key;
      this._buildCards();
    }
    this._renderData();
    if (this._processesDirty) {
      this._processesDirty = false;
      this._renderProcesses();
    }
    this._renderOverview();
    this._cluster.update(this.model.cluster);
  }

  dispose(): void {
    if (this.isDisposed) {
      return;
    }
    this._resizeObserver?.disconnect();
    this._destroyCards();
    if (this._frame !== null) {
      cancelAnimationFrame(this._frame);
    }
    super.dispose();
  }

  protected onAfterAttach(msg: Message): void {
    super.onAfterAttach(msg);
    this._resizeObserver = new ResizeObserver(() => this._resize());
    // The cards' box, not the panel's: it narrows when a scrollbar appears.
    this._resizeObserver.observe(this._cardsNode);
    if (this.isVisible) {
      this._shown();
    }
  }

  protected onBeforeDetach(msg: Message): void {
    this._resizeObserver?.disconnect();
    this._resizeObserver = null;
    this._options.onVisibilityChange(false);
    super.onBeforeDetach(msg);
  }

  protected onAfterShow(msg: Message): void {
    super.onAfterShow(msg);
    this._shown();
  }

  protected onAfterHide(msg: Message): void {
    super.onAfterHide(msg);
    this._options.onVisibilityChange(false);
  }

  private _shown(): void {
    this._palette.refresh(this.node);
    this._options.onVisibilityChange(true);
    this._processesDirty = true;
    this._schedule();
  }

  private _changed(_model: SidebarModel, change: ModelChange): void {
    if (change === 'processes' || change === 'devices') {
      this._processesDirty = true;
    }
    this._schedule();
  }

  private _schedule(): void {
    if (this._frame === null && this.isVisible) {
      this._frame = requestAnimationFrame(() => {
        this._frame = null;
        this.render();
      });
    }
  }

  private _resize(): void {
    for (const card of this._cards) {
      if (this._isFolded(card)) {
        continue; // measured when unfolded
      }
      for (const { chart, host } of card.charts) {
        chart.setWidth(host.clientWidth);
      }
    }
  }

  /** What decides the cards' structure; when it changes, the cards are rebuilt. */
  private _layoutSignature(): string {
    const { devices, connection, series } = this.model;
    if (connection.kind === 'missing' || !devices) {
      return connection.kind;
    }
    const latest: Latest = column => this.model.latest(column);
    const charts = devices.devices.map(device =>
      splitReported(gpuCharts(device, this._metrics, latest), series).shown.map(
        c => c.key
      )
    );
    const host = splitReported(
      hostCharts(devices.host, latest),
      series
    ).shown.map(c => c.key);
    return JSON.stringify([
      devices.devices.map(d => [d.id, d.name]),
      charts,
      host,
      devices.gpu_found
    ]);
  }

  private _renderStatus(): void {
    const { connection, devices } = this.model;
    let text = '';
    switch (connection.kind) {
      case 'stopped':
      case 'polling':
        text = 'paused';
        break;
      case 'connecting':
        text = 'connecting…';
        break;
      case 'live':
        text = `live · every ${this.model.interval} s`;
        break;
      case 'retrying':
        text = `⚠ reconnecting in ${Math.max(1, Math.round(connection.delayMs / 1000))} s (${connection.reason})`;
        break;
      case 'missing':
        text = '⚠ server extension missing';
        break;
    }
    this._status.textContent = text;
    this._status.dataset.state = connection.kind;
    this.node.dataset.state = connection.kind;

    this._notice.replaceChildren();
    if (connection.kind === 'missing') {
      this._notice.className = 'jp-gpuwidget-notice jp-gpuwidget-notice-error';
      this._notice.append(
        element(
          'strong',
          '',
          'The gpuwidget server extension is not running on this Jupyter server.'
        ),
        element(
          'p',
          '',
          `${connection.url} answered 404. Install gpuwidget in the Python environment that runs ` +
            'Jupyter (pip install gpuwidget), then restart the server.'
        )
      );
      const retry = element(
        'button',
        'jp-Button jp-mod-styled jp-mod-accept',
        'Retry'
      );
      retry.addEventListener('click', () => this._options.onRetry());
      this._notice.appendChild(retry);
    } else if (
      devices &&
      (!devices.gpu_found || devices.devices.length === 0)
    ) {
      this._notice.className = 'jp-gpuwidget-notice jp-gpuwidget-notice-info';
      this._notice.appendChild(element('strong', '', 'No GPU found'));
      const detail = noGpuDetail(devices.message);
      if (detail) {
        this._notice.appendChild(element('p', 'jp-gpuwidget-reason', detail));
      }
      this._notice.appendChild(element('p', '', 'Showing the host only.'));
    } else {
      this._notice.className = 'jp-gpuwidget-notice';
    }
  }

  private _renderStalled(): void {
    const { sources, receivedS } = this.model.stalled;
    const key = sources.map(source => source.source).join('\n');
    if (key !== this._stalledKey) {
      // Rebuilt only when the set of stalled sources changes: the region is a live one, and
      // a screen reader should hear "GPU 1 stopped answering at 14:02:31" once, not a
      // count every second (the visible count is hidden from it).
      this._stalledKey = key;
      this._stalled.replaceChildren();
      if (sources.length) {
        const names = sources.map(
          ({ source, since_s }) =>
            `${source} stopped answering at ${formatClock(receivedS - since_s, true)}`
        );
        const its = sources.length > 1 ? 'Their' : 'Its';
        const spoken = element(
          'span',
          'jp-gpuwidget-visually-hidden',
          `${names.join('; ')}. ${its} figures stop until the Jupyter server restarts.`
        );
        const shown = element('strong', 'jp-gpuwidget-stalled-text');
        shown.setAttribute('aria-hidden', 'true');
        const detail = element(
          'p',
          '',
          `${its} figures stop until the Jupyter server restarts (the server does not ask ${sources.length > 1 ? 'them' : 'it'} again).`
        );
        detail.setAttribute('aria-hidden', 'true');
        this._stalled.append(spoken, shown, detail);
      }
    }
    const shown = this._stalled.querySelector('.jp-gpuwidget-stalled-text');
    if (shown) {
      const text = `⚠ ${stalledLines(this.model.stalled, Date.now() / 1000).join('; ')}.`;
      if (shown.textContent !== text) {
        shown.textContent = text;
      }
    }
    this._stalled.classList.toggle(
      'jp-gpuwidget-notice-warn',
      sources.length > 0
    );
  }

  private _renderOverview(): void {
    const { devices, connection, processes, processesTime } = this.model;
    const gpus =
      devices && connection.kind !== 'missing' ? devices.devices : [];
    const show = gpus.length >= OVERVIEW_MIN_GPUS;
    this._overview.node.hidden = !show;
    if (!show) {
      return;
    }
    const latest: Latest = column => this.model.latest(column);
    // Before the first scan (t null, nothing listed) the holders read "–", not "free".
    const listed = processesTime !== null || Object.keys(processes).length > 0;
    this._overview.update(
      overviewRows(gpus, latest, processes, listed, this._staleNotes())
    );
  }

  /** The notes of the GPUs whose readings stopped, by device id, as of now. */
  private _staleNotes(): Record<string, IStaleNote> {
    const notes: Record<string, IStaleNote> = {};
    const nowS = Date.now() / 1000;
    for (const device of this.model.devices?.devices ?? []) {
      const note = staleNoteOf(device, this.model.stalled, nowS);
      if (note) {
        notes[device.id] = note;
      }
    }
    return notes;
  }

  private _isFolded(card: ICard): boolean {
    if (!card.toggle) {
      return false;
    }
    const chosen = this._folded.get(card.id);
    if (chosen !== undefined) {
      return chosen;
    }
    const gpus = this.model.devices?.devices.length ?? 0;
    return gpus >= CARDS_COLLAPSED_FROM;
  }

  private _setFolded(card: ICard, folded: boolean): void {
    if (!card.toggle) {
      return;
    }
    this._folded.set(card.id, folded);
    this._applyFolded(card);
    if (!folded) {
      for (const { chart, host } of card.charts) {
        chart.setWidth(host.clientWidth);
      }
      this._schedule();
    }
  }

  private _applyFolded(card: ICard): void {
    const folded = this._isFolded(card);
    card.body.hidden = folded;
    card.node.classList.toggle('jp-mod-folded', folded);
    card.toggle?.setAttribute('aria-expanded', String(!folded));
  }

  private _destroyCards(): void {
    for (const card of this._cards) {
      card.charts.forEach(({ chart }) => chart.dispose());
    }
    this._cards = [];
    this._cardsNode.replaceChildren();
  }

  private _buildCards(): void {
    this._destroyCards();
    const { devices, connection, series } = this.model;
    if (!devices || connection.kind === 'missing') {
      return;
    }
    const latest: Latest = column => this.model.latest(column);
    for (const device of devices.devices) {
      const { shown, unreported } = splitReported(
        gpuCharts(device, this._metrics, latest),
        series
      );
      this._cards.push(
        this._buildCard(
          device.id,
          this._gpuTitle(device),
          shown,
          unreported,
          device
        )
      );
    }
    const host = devices.host;
    const hostTitle = host?.cpu_count
      ? `Host · ${host.cpu_count} CPUs`
      : 'Host';
    const { shown } = splitReported(hostCharts(host, latest), series);
    this._cards.push(this._buildCard('host', hostTitle, shown, [], null));
    this._processesDirty = true;
    // Charts built before the cards overflowed were measured without the scrollbar.
    this._resize();
  }

  private _gpuTitle(device: IDeviceInfo): string {
    // A MIG instance's name ends with its profile ("... MIG 3g.40gb"); a GPU in MIG mode says so.
    const mig =
      device.is_mig && !device.name.includes(' MIG ')
        ? ' (MIG)'
        : device.mig_mode
          ? ' (MIG mode)'
          : '';
    return `${deviceLabel(device)} · ${device.name}${mig}`;
  }

  private _buildCard(
    id: string,
    title: string,
    charts: IChartDef[],
    unreported: IChartDef[],
    device: IDeviceInfo | null
  ): ICard {
    const node = element('section', 'jp-gpuwidget-card');
    node.dataset.device = id;
    const titleId = `${PANEL_ID}-${id}-title`;
    const bodyId = `${PANEL_ID}-${id}-body`;
    node.setAttribute('aria-labelledby', titleId);
    const header = element('div', 'jp-gpuwidget-card-header');
    const titleNode = element('span', 'jp-gpuwidget-card-title', title);
    titleNode.id = titleId;
    const body = element('div', 'jp-gpuwidget-card-body');
    body.id = bodyId;
    let toggle: HTMLButtonElement | null = null;
    let readout: HTMLElement | null = null;
    if (device) {
      // The whole header is the fold button: a big target, reached by Tab, Enter/Space.
      toggle = element('button', 'jp-gpuwidget-card-toggle');
      toggle.setAttribute('aria-controls', bodyId);
      const chevron = element('span', 'jp-gpuwidget-chevron');
      chevron.setAttribute('aria-hidden', 'true');
      readout = element('span', 'jp-gpuwidget-card-readout');
      // The whole title shows (no ellipsis), so its tooltip is for a title longer than the panel.
      toggle.title = title;
      toggle.append(chevron, titleNode, readout);
      header.appendChild(toggle);
    } else {
      header.appendChild(titleNode);
    }
    node.append(header, body);
    this._cardsNode.appendChild(node);

    const card: ICard = {
      id,
      node,
      toggle,
      body,
      readout,
      device,
      charts: [],
      processes: null
    };
    if (toggle) {
      toggle.addEventListener('click', () =>
        this._setFolded(card, !this._isFolded(card))
      );
    }
    charts.forEach((def, index) => {
      const box = element('div', 'jp-gpuwidget-chart');
      box.dataset.chart = def.key;
      const label = element('div', 'jp-gpuwidget-chart-label');
      const value = element('span', 'jp-gpuwidget-chart-value');
      label.append(
        element('span', 'jp-gpuwidget-chart-title', def.title),
        value
      );
      const host = element('div', 'jp-gpuwidget-chart-host');
      box.append(label, host);
      body.appendChild(box);
      const chart = new TimeChart(def, this._palette, {
        width: host.clientWidth,
        showTimeAxis: index === charts.length - 1
      });
      host.appendChild(chart.node);
      card.charts.push({ chart, value, host });
    });
    if (unreported.length) {
      body.appendChild(
        element(
          'p',
          'jp-gpuwidget-unreported',
          `Not reported by this GPU: ${unreported.map(c => c.title).join(', ')}.`
        )
      );
    }
    if (device) {
      card.processes = element('div', 'jp-gpuwidget-processes');
      body.appendChild(card.processes);
    }
    this._applyFolded(card);
    return card;
  }

  private _renderData(): void {
    const series = this.model.series;
    const latest: Latest = column => this.model.latest(column);
    const notes = this._staleNotes();
    const times = series.times();
    const [xMin, xMax] = visibleRange(
      series.firstTime(),
      series.lastTime(),
      this.model.historyS
    );
    const columns = new Map<string, ChartData[1]>();
    const column = (name: string) => {
      let values = columns.get(name);
      if (!values) {
        values = series.values(name);
        columns.set(name, values);
      }
      return values;
    };
    for (const card of this._cards) {
      const note = card.device ? (notes[card.device.id] ?? null) : null;
      this._renderStale(card, note);
      if (card.readout && card.device) {
        const text = `${gpuReadout(card.device, latest)}${note ? ` · ${note.short}` : ''}`;
        if (card.readout.textContent !== text) {
          card.readout.textContent = text;
        }
      }
      if (this._isFolded(card)) {
        continue; // a folded card's charts are brought up to date when it unfolds
      }
      for (const { chart, value } of card.charts) {
        const data: ChartData = [
          times,
          ...chart.def.lines.map(line => column(line.column))
        ];
        chart.setData(data, xMin, xMax);
        value.textContent = chart.def.readout(latest);
      }
    }
  }

  /**
   * A GPU whose readings stopped: its card greyed, its last values kept, and a line saying
   * since when (`note`); null clears it.
   */
  private _renderStale(card: ICard, note: IStaleNote | null): void {
    card.node.classList.toggle('jp-mod-stale', note !== null);
    let line = card.node.querySelector<HTMLElement>('.jp-gpuwidget-card-stale');
    if (!note) {
      line?.remove();
      return;
    }
    if (!line) {
      line = element('p', 'jp-gpuwidget-card-stale');
      card.body.prepend(line);
    }
    const text = `⚠ ${note.full}`;
    if (line.textContent !== text) {
      line.textContent = text;
    }
  }

  private _renderProcesses(): void {
    for (const card of this._cards) {
      if (card.processes && card.device) {
        card.processes.replaceChildren(
          this._processTable(this.model.processes[card.id] ?? null, card.device)
        );
      }
    }
  }

  private _processTable(
    processes: IProcessInfo[] | null,
    device: IDeviceInfo
  ): HTMLElement {
    if (processes === null) {
      return element('p', 'jp-gpuwidget-processes-empty', '');
    }
    if (processes.length === 0) {
      // "No processes on this GPU.", or why a GPU in use names none.
      const holder = holderOf([], {
        memoryUsed: this.model.latest(`${device.id}.mem_used`),
        foreignPidNamespace: device.foreign_pid_namespace === true
      });
      return element('p', 'jp-gpuwidget-processes-empty', holder.title);
    }
    const table = element('table', 'jp-gpuwidget-process-table');
    const head = table.createTHead().insertRow();
    for (const heading of ['Process', 'User', 'Memory']) {
      const th = element('th', '', heading);
      th.scope = 'col';
      head.appendChild(th);
    }
    const body = table.createTBody();
    const sorted = [...processes].sort(
      (a, b) => (b.memory ?? 0) - (a.memory ?? 0)
    );
    for (const process of sorted) {
      const row = body.insertRow();
      row.insertCell().appendChild(this._processLabel(process));
      row.insertCell().textContent = process.user;
      const memory = row.insertCell();
      memory.className = 'jp-gpuwidget-number';
      memory.textContent = formatBytes(process.memory);
    }
    return table;
  }

  private _processLabel(process: IProcessInfo): HTMLElement {
    const pid = process.pid !== null ? ` (${process.pid})` : '';
    const notebook = process.notebook;
    const open = this._options.openNotebook;
    if (notebook && open) {
      const link = element(
        'button',
        'jp-gpuwidget-notebook-link',
        baseName(notebook)
      );
      link.title = `Open ${notebook}${pid}`;
      link.addEventListener('click', () => open(notebook));
      return link;
    }
    if (notebook) {
      return element('span', '', `${baseName(notebook)}${pid}`);
    }
    if (process.name) {
      return element('span', '', `${process.name}${pid}`);
    }
    // Another user's process: the server shows only its memory.
    return element('span', 'jp-gpuwidget-other', NO_VALUE);
  }
}
