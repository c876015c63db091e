/**
 * @jest-environment jsdom
 */

// The Measure button's renderer in jsdom, with a fake kernel link: a click runs the call,
// shows its outputs in place and ends with the table written into the output, or a note.

import { Signal } from '@lumino/signaling';
import { Widget } from '@lumino/widgets';

import {
  BUTTON_LABEL,
  CallEnd,
  GONE_NOTE,
  IKernelLink,
  aboutDuration,
  hintText,
  IMeasureOffer,
  IOutputMsg,
  MEASURE_MIME,
  MEASURE_RANK,
  MeasureRenderer,
  MeasureView,
  measureCode,
  measureFactory,
  parseOffer
} from '../src/measure';

const TOKEN = '0123456789abcdef0123456789abcdef';
const OFFER = {
  version: 1,
  token: TOKEN,
  display_id: `gpuwidget-measure-${TOKEN}`,
  kernel: 'kernel-session-1',
  label: 'cell 3',
  budget_s: 45
};
const TABLE = {
  'text/html': "<div class='gpuwidget-tune'>table</div>",
  'text/plain': 'num_workers=4'
};

function ended(status: string, data: Record<string, unknown>): IOutputMsg {
  return {
    msgType: 'display_data',
    content: { data, metadata: { gpuwidget: { measure: status } } }
  };
}

function progress(text: string, update = false): IOutputMsg {
  return {
    msgType: update ? 'update_display_data' : 'display_data',
    content: {
      data: { 'text/plain': text },
      metadata: {},
      transient: { display_id: 'gpuwidget-tuning-1' }
    }
  };
}

/** A kernel whose session and call the test drives. */
class FakeLink implements IKernelLink {
  constructor(public current: string | null | undefined = 'kernel-session-1') {}
  readonly changed = new Signal<this, 'changed' | 'gone'>(this);
  calls: string[] = [];
  onOutput: ((msg: IOutputMsg) => void) | null = null;
  private _finish: ((end: CallEnd) => void) | null = null;

  async session() {
    return this.current;
  }

  execute(code: string, onOutput: (msg: IOutputMsg) => void) {
    this.calls.push(code);
    this.onOutput = onOutput;
    return new Promise<CallEnd>(resolve => (this._finish = resolve));
  }

  finish(end: CallEnd = 'ok') {
    this._finish?.(end);
  }
}

/** A link whose kernel cannot say who it is yet (a notebook still connecting). */
function connectingLink(): FakeLink {
  const link = new FakeLink();
  link.current = undefined;
  return link;
}

const flush = () => new Promise(resolve => setTimeout(resolve, 0));

function renderText(data: Record<string, unknown>): Widget {
  const widget = new Widget();
  widget.node.textContent = String(data['text/plain'] ?? '');
  return widget;
}

function mount(link: IKernelLink | null, offer: Partial<IMeasureOffer> = {}) {
  const measured: Record<string, unknown>[] = [];
  const view = new MeasureView({
    offer: { ...parseOffer(OFFER)!, ...offer },
    link,
    render: renderText,
    onMeasured: data => measured.push(data)
  });
  Widget.attach(view, document.body);
  return { view, measured };
}

afterEach(() => {
  document.body.replaceChildren();
});

describe('parseOffer and measureCode', () => {
  it('reads the kernel offer and refuses tokens that are not the kernel format', () => {
    expect(parseOffer(OFFER)).toEqual({
      token: TOKEN,
      displayId: OFFER.display_id,
      kernel: 'kernel-session-1',
      label: 'cell 3',
      budgetS: 45
    });
    for (const token of [
      "x'); import os; os.system('id'); ('",
      TOKEN.toUpperCase(),
      TOKEN.slice(1),
      42
    ]) {
      expect(parseOffer({ ...OFFER, token })).toBeNull();
    }
    expect(parseOffer({ ...OFFER, version: 2 })).toBeNull();
    expect(parseOffer('text')).toBeNull();
  });

  it('takes the time the kernel announced, and no time where it said none', () => {
    for (const budget of [undefined, null, 0, -5, NaN, Infinity, '45']) {
      expect(parseOffer({ ...OFFER, budget_s: budget })?.budgetS).toBeNull();
    }
    const offer = parseOffer({ ...OFFER, budget_s: 150 })!;
    expect(hintText(offer)).toBe(
      'Measures the suggested changes in the kernel that ran the cell (about 3 min); the table replaces this button.'
    );
    expect(hintText({ ...offer, budgetS: null })).toBe(
      'Measures the suggested changes in the kernel that ran the cell; the table replaces this button.'
    );
    expect([0.2, 20, 89, 90, 120].map(aboutDuration)).toEqual([
      'about 1 s',
      'about 20 s',
      'about 89 s',
      'about 2 min',
      'about 2 min'
    ]);
  });

  it('runs the same line as gpuwidget.ui.actions.CALL', () => {
    expect(measureCode(TOKEN)).toBe(
      `__import__('gpuwidget.ui.actions', fromlist=['measure']).measure('${TOKEN}')`
    );
  });
});

describe('MeasureView', () => {
  it('is a labelled, keyboard-operable button while its kernel runs', async () => {
    const { view } = mount(new FakeLink());
    await flush();
    expect(view.state).toBe('ready');
    const button = view.node.querySelector('button')!;
    expect(button.type).toBe('button');
    expect(button.textContent).toBe(BUTTON_LABEL);
    expect(button.disabled).toBe(false);
    const hint = document.getElementById(
      button.getAttribute('aria-describedby')!
    );
    expect(hint?.textContent).toBe(
      'Measures the suggested changes in the kernel that ran the cell (about 45 s); the table replaces this button.'
    );
    expect(button.title).toBe(hint?.textContent);
    expect(view.status.getAttribute('role')).toBe('status');
    button.focus();
    expect(document.activeElement).toBe(button);
  });

  it('busy while the call runs, shows its progress in place, then hands the table on', async () => {
    const link = new FakeLink();
    const { view, measured } = mount(link);
    await flush();
    view.button.click();
    await flush();
    expect(link.calls).toEqual([measureCode(TOKEN)]);
    expect(view.state).toBe('busy');
    expect(view.button.disabled).toBe(true);
    expect(view.button.textContent).toBe('Measuring…');
    expect(view.node.getAttribute('aria-busy')).toBe('true');
    // A second click while busy runs nothing more.
    view.button.click();
    await flush();
    expect(link.calls).toHaveLength(1);

    link.onOutput!(progress('tuning 0/20 s: starting'));
    link.onOutput!(progress('tuning 5/20 s: num_workers=2', true));
    const outputs = () =>
      Array.from(view.node.querySelectorAll('.gpuwidget-measure-output')).map(
        node => node.textContent
      );
    expect(outputs()).toEqual(['tuning 5/20 s: num_workers=2']);

    link.onOutput!(ended('measured', TABLE));
    expect(measured).toEqual([TABLE]);
    link.finish('ok');
    await flush();
    expect(outputs()).toEqual([]);
  });

  it('shows the note instead of the button when another kernel runs the notebook', async () => {
    const { view } = mount(new FakeLink('kernel-session-2'));
    await flush();
    expect(view.state).toBe('gone');
    expect(view.node.querySelector('button')).toBeNull();
    expect(view.status.textContent).toBe(GONE_NOTE);
    expect(GONE_NOTE).toContain('%%gpuwatch --tune');
  });

  it('shows the note with no kernel at all, and waits while one connects', async () => {
    expect((await mountFlushed(new FakeLink(null))).state).toBe('gone');
    expect((await mountFlushed(null)).state).toBe('gone');
    const connecting = connectingLink();
    const view = await mountFlushed(connecting);
    expect(view.state).toBe('ready');
    connecting.current = 'kernel-session-9';
    connecting.changed.emit('changed');
    await flush();
    expect(view.state).toBe('gone');
    view.dispose();
  });

  it('asks again while the kernel cannot say who it is yet', async () => {
    const starting = connectingLink();
    const view = await mountFlushed(starting);
    starting.current = 'kernel-session-2'; // a reopened notebook's new kernel, no signal
    await new Promise(resolve => setTimeout(resolve, 1100));
    expect(view.state).toBe('gone');
    view.dispose();
  });

  it('shows the note once the kernel stops or restarts', async () => {
    const link = new FakeLink();
    const view = await mountFlushed(link);
    link.changed.emit('gone');
    expect(view.state).toBe('gone');
    expect(view.status.textContent).toBe(GONE_NOTE);
  });

  it('says what the kernel says when it does not know the button, and on a failed call', async () => {
    const link = new FakeLink();
    const view = await mountFlushed(link);
    view.button.click();
    await flush();
    link.onOutput!(
      ended('gone', { 'text/plain': 'The loader no longer exists.' })
    );
    link.finish('ok');
    await flush();
    expect(view.state).toBe('gone');
    expect(view.status.textContent).toBe('The loader no longer exists.');

    const broken = new FakeLink();
    const other = await mountFlushed(broken);
    other.button.click();
    await flush();
    broken.finish('error'); // gpuwidget not importable in that kernel, say
    await flush();
    expect(other.state).toBe('gone');
    expect(other.status.textContent).toBe(GONE_NOTE);
  });

  it('lets the user try again after a failed measurement', async () => {
    const link = new FakeLink();
    const view = await mountFlushed(link);
    view.button.click();
    await flush();
    link.onOutput!(
      ended('failed', { 'text/plain': 'Could not measure: boom' })
    );
    link.finish('ok');
    await flush();
    expect(view.state).toBe('ready');
    expect(view.button.disabled).toBe(false);
    expect(view.status.textContent).toBe('Could not measure: boom');
  });
});

async function mountFlushed(link: IKernelLink | null): Promise<MeasureView> {
  const { view } = mount(link);
  await flush();
  return view;
}

describe('MeasureRenderer', () => {
  it('writes the measured table into the output model (saved with the notebook)', async () => {
    const link = new FakeLink();
    const rendermime = {
      preferredMimeType: () => 'text/plain',
      createRenderer: () => {
        const widget = new Widget() as Widget & {
          renderModel: (model: {
            data: Record<string, unknown>;
          }) => Promise<void>;
        };
        widget.renderModel = async model => {
          widget.node.textContent = String(model.data['text/plain']);
        };
        return widget;
      },
      addFactory: () => undefined
    };
    const factory = measureFactory(link, rendermime);
    expect(factory.safe).toBe(false); // untrusted output shows the text/html fallback
    expect(factory.mimeTypes).toEqual([MEASURE_MIME]);
    expect(factory.defaultRank).toBe(MEASURE_RANK);
    expect(MEASURE_RANK).toBeLessThan(-10); // ahead of the widget manager's renderer

    const renderer = factory.createRenderer({
      mimeType: MEASURE_MIME
    } as never) as MeasureRenderer;
    const updates: unknown[] = [];
    const model = {
      trusted: true,
      data: { [MEASURE_MIME]: OFFER, 'text/plain': 'fallback' },
      metadata: {},
      setData: (options: unknown) => updates.push(options)
    };
    Widget.attach(renderer, document.body);
    await renderer.renderModel(model as never);
    await flush();
    renderer.view!.button.click();
    await flush();
    link.onOutput!(progress('tuning 1/20 s'));
    expect(renderer.node.textContent).toContain('tuning 1/20 s');
    link.onOutput!(ended('measured', TABLE));
    expect(updates).toEqual([{ data: TABLE, metadata: {} }]);

    // An offer it cannot read shows the text fallback, not a button.
    await renderer.renderModel({
      ...model,
      data: {
        [MEASURE_MIME]: { ...OFFER, token: 'bad' },
        'text/plain': 'fallback'
      }
    } as never);
    expect(renderer.node.querySelector('button')).toBeNull();
    expect(renderer.node.textContent).toBe('fallback');
    renderer.dispose();
  });
});
