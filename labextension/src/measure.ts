/**
 * The Measure button under a watched cell's panel: an output of gpuwidget's own MIME type,
 * rendered here instead of as a widget, so a saved notebook holds nothing that breaks once
 * its kernel is gone.
 *
 * A click runs one call on the notebook's kernel (gpuwidget.ui.actions.measure with the
 * offer's token; `measureCode`) and shows what it displays in place (the tuner's progress);
 * the measured table then becomes the output itself, so it is saved with the notebook. When
 * the kernel that showed the button is gone (a reopened notebook, a restart) or no longer
 * knows the token, a note says how to measure instead.
 *
 * `MeasureView` takes its kernel through `IKernelLink`, so it is tested without JupyterLab;
 * `sessionLink` is the link to a notebook's session.
 */

import type { ISessionContext } from '@jupyterlab/apputils';
import type { IRenderMime } from '@jupyterlab/rendermime-interfaces';
import type { Kernel, KernelMessage } from '@jupyterlab/services';
import { ISignal, Signal } from '@lumino/signaling';
import { Panel, Widget } from '@lumino/widgets';

/** The output's MIME type (gpuwidget/ui/actions.py `MIME`). */
export const MEASURE_MIME = 'application/vnd.gpuwidget.measure+json';

/** Ahead of the widget manager's renderer (-10) and text/html (50): lower ranks win. */
export const MEASURE_RANK = -20;

export const GONE_NOTE =
  'Measure needs the kernel that ran this cell: run it again or use %%gpuwatch --tune.';

export const BUTTON_LABEL = 'Measure the suggested changes';

/** While the notebook's kernel cannot say who it is yet, it is asked again this often. */
const CHECK_RETRY_MS = 1000;
const CHECK_RETRIES = 60;

/** What the kernel put in the output. */
export interface IMeasureOffer {
  token: string;
  /** The display id the measured table is shown under. */
  displayId: string;
  /** The kernel's message session when it showed the button ('' if unknown). */
  kernel: string;
  label: string;
  /** Seconds the measuring will take, as the kernel planned it (null: it did not say). */
  budgetS: number | null;
}

/** "about 45 s", "about 2 min": how long a click takes, as the offer announced it. */
export function aboutDuration(seconds: number): string {
  return seconds < 90
    ? `about ${Math.max(1, Math.round(seconds))} s`
    : `about ${Math.round(seconds / 60)} min`;
}

/** What the button does, and for how long (the offer's `budget_s`). */
export function hintText(offer: IMeasureOffer): string {
  const howLong =
    offer.budgetS === null ? '' : ` (${aboutDuration(offer.budgetS)})`;
  return `Measures the suggested changes in the kernel that ran the cell${howLong}; the table replaces this button.`;
}

/** The offer in an output's data, or null when it is not one this version understands. */
export function parseOffer(value: unknown): IMeasureOffer | null {
  if (!value || typeof value !== 'object') {
    return null;
  }
  const offer = value as Record<string, unknown>;
  // The token goes into code run on the kernel: only the kernel's own format passes.
  if (
    offer.version !== 1 ||
    typeof offer.token !== 'string' ||
    !/^[0-9a-f]{32}$/.test(offer.token)
  ) {
    return null;
  }
  const text = (key: string) =>
    typeof offer[key] === 'string' ? (offer[key] as string) : '';
  const budget = offer.budget_s;
  return {
    token: offer.token,
    displayId: text('display_id'),
    kernel: text('kernel'),
    label: text('label'),
    budgetS:
      typeof budget === 'number' && Number.isFinite(budget) && budget > 0
        ? budget
        : null
  };
}

/** The line a click runs on the kernel (gpuwidget/ui/actions.py `CALL`). */
export function measureCode(token: string): string {
  return `__import__('gpuwidget.ui.actions', fromlist=['measure']).measure('${token}')`;
}

/** One output of the call, as the kernel sent it. */
export interface IOutputMsg {
  msgType: string;
  content: Record<string, unknown>;
}

/** How a call ended: its reply's status, or 'gone' when no kernel took it. */
export type CallEnd = 'ok' | 'error' | 'gone';

/** The notebook's kernel as the button needs it. */
export interface IKernelLink {
  /**
   * The message session of the kernel the notebook talks to (null: none, and none coming).
   * Undefined while the notebook is still connecting.
   */
  session(): Promise<string | null | undefined>;
  /** Run `code` silently, passing each output message on; resolves when the call is done. */
  execute(code: string, onOutput: (msg: IOutputMsg) => void): Promise<CallEnd>;
  /** Emitted when the notebook's kernel changes or stops ('gone': it can be told at once). */
  readonly changed: ISignal<IKernelLink, 'changed' | 'gone'>;
}

export type MeasureState = 'ready' | 'busy' | 'gone';

export interface IMeasureViewOptions {
  offer: IMeasureOffer;
  link: IKernelLink | null;
  /** Renders one bundle the kernel displayed (the notebook's rendermime). */
  render: (data: Record<string, unknown>) => Widget;
  /** The measured table: becomes the output's data (saved with the notebook). */
  onMeasured: (data: Record<string, unknown>) => void;
}

function ending(msg: IOutputMsg): string | null {
  const metadata = msg.content.metadata as
    Record<string, { measure?: unknown }> | undefined;
  const status = metadata?.gpuwidget?.measure;
  return typeof status === 'string' ? status : null;
}

function textOf(data: Record<string, unknown>): string {
  return typeof data['text/plain'] === 'string' ? data['text/plain'] : '';
}

/** The button, its status line, and the outputs of a call in progress. */
export class MeasureView extends Panel {
  constructor(options: IMeasureViewOptions) {
    super();
    this._options = options;
    this.addClass('gpuwidget-measure');
    this.node.setAttribute('role', 'group');
    this.node.setAttribute('aria-label', BUTTON_LABEL);

    const head = new Widget();
    head.addClass('gpuwidget-measure-head');
    this.button = document.createElement('button');
    this.button.type = 'button';
    this.button.className = 'gpuwidget-measure-button';
    this.button.textContent = BUTTON_LABEL;
    const hintId = `gpuwidget-measure-hint-${options.offer.token}`;
    const hint = document.createElement('span');
    hint.id = hintId;
    hint.className = 'gpuwidget-measure-hint';
    hint.textContent = hintText(options.offer);
    this.button.title = hint.textContent;
    this.button.setAttribute('aria-describedby', hintId);
    this.button.addEventListener('click', () => void this.measure());
    this.status = document.createElement('div');
    this.status.className = 'gpuwidget-measure-status';
    this.status.setAttribute('role', 'status');
    this.status.setAttribute('aria-live', 'polite');
    head.node.append(this.button, hint, this.status);
    this.addWidget(head);

    if (options.link) {
      options.link.changed.connect(this._onKernelChanged, this);
    }
    this._setState('ready');
    void this.check();
  }

  readonly button: HTMLButtonElement;
  readonly status: HTMLElement;

  get state(): MeasureState {
    return this._state;
  }

  /** Emitted whenever the state changes. */
  get stateChanged(): ISignal<this, MeasureState> {
    return this._stateChanged;
  }

  /** The note in place of the button when its kernel is gone; the button stays otherwise. */
  async check(): Promise<void> {
    const { link, offer } = this._options;
    if (!link) {
      this._setGone(GONE_NOTE);
      return;
    }
    const session = await link.session();
    if (this.isDisposed || this._state !== 'ready') {
      return;
    }
    if (session === undefined) {
      // Still connecting (a reopened notebook starts its kernel): ask again shortly.
      if (this._retry === null && this._retries < CHECK_RETRIES) {
        this._retries += 1;
        this._retry = setTimeout(() => {
          this._retry = null;
          void this.check();
        }, CHECK_RETRY_MS);
      }
      return;
    }
    if (session === null || (offer.kernel && session !== offer.kernel)) {
      this._setGone(GONE_NOTE);
    }
  }

  /** Serve a click: run the call, show its outputs, end with the table or a note. */
  async measure(): Promise<void> {
    const { link, offer } = this._options;
    if (this._state !== 'ready') {
      return;
    }
    await this.check();
    if (this._state !== 'ready' || !link) {
      return;
    }
    this._setState('busy');
    this.status.textContent =
      'Measuring… (the kernel is busy until it is done)';
    let outcome: string | null = null;
    let end: CallEnd;
    try {
      end = await link.execute(measureCode(offer.token), msg => {
        if (!this.isDisposed && outcome === null) {
          outcome = this._onOutput(msg);
        }
      });
    } catch {
      end = 'gone';
    }
    if (this.isDisposed) {
      return; // the table already replaced this output
    }
    this._clearOutputs();
    if (outcome === 'measured') {
      return;
    }
    if (outcome === 'failed') {
      this._setState('ready');
      return;
    }
    if (outcome === null && end === 'ok') {
      outcome = 'gone';
    }
    this._setGone(
      outcome === 'gone' && this._lastNote ? this._lastNote : GONE_NOTE
    );
  }

  dispose(): void {
    if (this.isDisposed) {
      return;
    }
    if (this._retry !== null) {
      clearTimeout(this._retry);
    }
    Signal.clearData(this);
    super.dispose();
  }

  /** Handles one output of the call; the outcome once it has ended. */
  private _onOutput(msg: IOutputMsg): string | null {
    const data = (msg.content.data ?? {}) as Record<string, unknown>;
    const transient = msg.content.transient as
      Record<string, unknown> | undefined;
    const displayId =
      typeof transient?.display_id === 'string' ? transient.display_id : '';
    const status = msg.msgType === 'display_data' ? ending(msg) : null;
    if (status === 'measured') {
      this._options.onMeasured(data);
      return status;
    }
    if (status !== null) {
      this._lastNote = textOf(data);
      this.status.textContent = this._lastNote;
      return status;
    }
    if (msg.msgType === 'display_data') {
      this._addOutput(data, displayId);
    } else if (msg.msgType === 'update_display_data' && displayId) {
      this._addOutput(data, displayId);
    } else if (msg.msgType === 'stream') {
      const text = typeof msg.content.text === 'string' ? msg.content.text : '';
      this.status.textContent = text.trim();
    } else if (msg.msgType === 'error') {
      this._lastNote = '';
    } else if (msg.msgType === 'clear_output') {
      this._clearOutputs();
    }
    return null;
  }

  private _addOutput(data: Record<string, unknown>, displayId: string): void {
    const old = displayId ? this._outputs.get(displayId) : undefined;
    const widget = this._options.render(data);
    widget.addClass('gpuwidget-measure-output');
    if (old) {
      this.insertWidget(this.widgets.indexOf(old), widget);
      old.dispose();
    } else {
      this.addWidget(widget);
    }
    this._outputs.set(displayId || `#${this._outputs.size}`, widget);
  }

  private _clearOutputs(): void {
    for (const widget of this._outputs.values()) {
      widget.dispose();
    }
    this._outputs.clear();
  }

  private _onKernelChanged(_: IKernelLink, change: 'changed' | 'gone'): void {
    if (this._state !== 'ready') {
      return; // a call in progress ends by itself
    }
    if (change === 'gone') {
      this._setGone(GONE_NOTE);
    } else {
      void this.check();
    }
  }

  private _setGone(note: string): void {
    this.button.remove();
    this.node.querySelector('.gpuwidget-measure-hint')?.remove();
    this.status.textContent = note;
    this.node.setAttribute('aria-label', 'Measure not available');
    this._setState('gone');
  }

  private _setState(state: MeasureState): void {
    this._state = state;
    this.node.dataset.state = state;
    this.button.disabled = state !== 'ready';
    this.node.setAttribute('aria-busy', state === 'busy' ? 'true' : 'false');
    if (state === 'busy') {
      this.button.textContent = 'Measuring…';
    } else if (state === 'ready') {
      this.button.textContent = BUTTON_LABEL;
    }
    this._stateChanged.emit(state);
  }

  private _options: IMeasureViewOptions;
  private _state: MeasureState = 'ready';
  private _stateChanged = new Signal<this, MeasureState>(this);
  private _outputs = new Map<string, Widget>();
  private _lastNote = '';
  private _retry: ReturnType<typeof setTimeout> | null = null;
  private _retries = 0;
}

/** The renderer JupyterLab makes for each Measure output. */
export class MeasureRenderer extends Panel implements IRenderMime.IRenderer {
  constructor(
    private _link: IKernelLink | null,
    private _render: (data: Record<string, unknown>, trusted: boolean) => Widget
  ) {
    super();
    this.addClass('gpuwidget-measure-output-area');
  }

  async renderModel(model: IRenderMime.IMimeModel): Promise<void> {
    const offer = parseOffer(model.data[MEASURE_MIME]);
    for (const child of [...this.widgets]) {
      child.dispose();
    }
    this._view = null;
    if (!offer) {
      const fallback = new Widget();
      const text = model.data['text/plain'];
      fallback.node.textContent = typeof text === 'string' ? text : '';
      this.addWidget(fallback);
      return;
    }
    this._view = new MeasureView({
      offer,
      link: this._link,
      render: data => this._render(data, model.trusted),
      onMeasured: data => model.setData({ data: data as never, metadata: {} })
    });
    this.addWidget(this._view);
  }

  /** The view inside (for tests). */
  get view(): MeasureView | null {
    return this._view;
  }

  private _view: MeasureView | null = null;
}

/** The notebook rendermime's part used here (its type lives in @jupyterlab/rendermime). */
export interface IRenderMimeLike {
  preferredMimeType(
    bundle: Record<string, unknown>,
    safe?: 'ensure' | 'prefer' | 'any'
  ): string | undefined;
  createRenderer(mimeType: string): IRenderMime.IRenderer;
  addFactory(factory: IRenderMime.IRendererFactory, rank?: number): void;
}

/** Renders one bundle with `rendermime` (what the kernel displayed during the call). */
export function bundleRenderer(
  rendermime: IRenderMimeLike
): (data: Record<string, unknown>, trusted: boolean) => Widget {
  return (data, trusted) => {
    const mimeType = rendermime.preferredMimeType(
      data,
      trusted ? 'any' : 'ensure'
    );
    if (!mimeType) {
      return new Widget();
    }
    const renderer = rendermime.createRenderer(mimeType);
    const model: IRenderMime.IMimeModel = {
      trusted,
      data: data as never,
      metadata: {},
      setData: () => undefined
    };
    void renderer.renderModel(model);
    return renderer;
  };
}

/** The factory for one notebook's rendermime. */
export function measureFactory(
  link: IKernelLink | null,
  rendermime: IRenderMimeLike
): IRenderMime.IRendererFactory {
  const render = bundleRenderer(rendermime);
  return {
    // Untrusted output never drives the kernel: there the text/html fallback shows.
    safe: false,
    mimeTypes: [MEASURE_MIME],
    defaultRank: MEASURE_RANK,
    createRenderer: () => new MeasureRenderer(link, render)
  };
}

const GONE_STATUSES = new Set(['dead', 'restarting', 'autorestarting']);

/** The link to the kernel of a notebook's session. */
export class SessionLink implements IKernelLink {
  constructor(private _context: ISessionContext) {
    _context.kernelChanged.connect(() => this._changed.emit('changed'));
    _context.statusChanged.connect((_, status) => {
      if (GONE_STATUSES.has(status)) {
        this._changed.emit('gone');
      }
    });
  }

  get changed(): ISignal<this, 'changed' | 'gone'> {
    return this._changed;
  }

  async session(): Promise<string | null | undefined> {
    if (this._context.isDisposed) {
      return null;
    }
    await this._context.ready;
    const kernel = this._context.session?.kernel;
    if (!kernel) {
      // A notebook with no kernel (none chosen, or shut down) never gets this one back.
      return this._context.isReady ? null : undefined;
    }
    if (GONE_STATUSES.has(kernel.status)) {
      return null;
    }
    // One kernel_info per kernel connection: its reply's header names the kernel's session.
    // No answer (a kernel still starting) is no verdict: asked again next time.
    let known = this._sessions.get(kernel);
    if (!known) {
      known = kernel
        .requestKernelInfo()
        .then(reply => reply?.header.session || undefined)
        .catch(() => undefined);
      this._sessions.set(kernel, known);
    }
    const session = await known;
    if (session === undefined) {
      this._sessions.delete(kernel);
    }
    return session;
  }

  async execute(
    code: string,
    onOutput: (msg: IOutputMsg) => void
  ): Promise<CallEnd> {
    const kernel = this._context.session?.kernel;
    if (!kernel || GONE_STATUSES.has(kernel.status)) {
      return 'gone';
    }
    const future = kernel.requestExecute({
      code,
      silent: true,
      store_history: false,
      allow_stdin: false,
      stop_on_error: false
    });
    future.onIOPub = (msg: KernelMessage.IIOPubMessage) =>
      onOutput({
        msgType: msg.header.msg_type,
        content: msg.content as Record<string, unknown>
      });
    const reply = await future.done;
    return reply.content.status === 'ok' ? 'ok' : 'error';
  }

  private _changed = new Signal<this, 'changed' | 'gone'>(this);
  private _sessions = new WeakMap<
    Kernel.IKernelConnection,
    Promise<string | undefined>
  >();
}
