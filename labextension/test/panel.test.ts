/**
 * @jest-environment jsdom
 */

// The panel's DOM in jsdom, with the canvas charts replaced (jsdom has no canvas).

import { Widget } from '@lumino/widgets';

import { formatCelsius } from '../src/format';
import { GpuPanel, stalledLines } from '../src/panel';
import { SidebarModel } from '../src/model';
import {
  GpuOverview,
  IDLE_RESERVE_BYTES,
  OVERVIEW_COLUMNS,
  holderOf,
  overviewRows
} from '../src/overview';
import { IProcessInfo, ISampleMessage } from '../src/protocol';
import { installFakeCanvas } from './fakes';
import {
  GiB,
  T0,
  clusterReply,
  gpuDevices,
  hello,
  history,
  noGpuDevices,
  sample
} from './fixtures';

jest.mock('../src/charts', () => ({
  ChartPalette: class {
    refresh(): void {}
  },
  TimeChart: class {
    node = document.createElement('canvas');
    constructor(readonly def: unknown) {}
    setData(): void {}
    setWidth(): void {}
    redraw(): void {}
    dispose(): void {
      this.node.remove();
    }
  }
}));

function mount(openNotebook: ((path: string) => void) | null = null) {
  const model = new SidebarModel(1);
  const visibility: boolean[] = [];
  const retries: number[] = [];
  const panel = new GpuPanel({
    model,
    onVisibilityChange: visible => visibility.push(visible),
    onRetry: () => retries.push(1),
    openNotebook
  });
  Widget.attach(panel, document.body);
  return { model, panel, visibility, retries };
}

beforeAll(() => installFakeCanvas());

afterEach(() => {
  document.body.replaceChildren();
});

const text = (panel: GpuPanel, selector: string) =>
  Array.from(panel.node.querySelectorAll(selector)).map(
    node => node.textContent
  );

describe('GpuPanel', () => {
  it('asks to connect once shown and to disconnect once hidden', () => {
    const { panel, visibility } = mount();
    expect(visibility).toEqual([true]);
    panel.hide();
    expect(visibility).toEqual([true, false]);
    panel.dispose();
  });

  it('says "No GPU found" with the reason, and charts only the host', () => {
    const { model, panel } = mount();
    model.handle(hello(noGpuDevices()));
    model.handle(sample(T0, { 'cpu.util': 12, 'mem.used': 2 * GiB }));
    panel.render();
    expect(text(panel, '.jp-gpuwidget-notice strong')).toEqual([
      'No GPU found'
    ]);
    expect(text(panel, '.jp-gpuwidget-reason')).toEqual([
      'no NVIDIA or AMD GPU driver'
    ]);
    expect(text(panel, '.jp-gpuwidget-card-title')).toEqual(['Host · 2 CPUs']);
    expect(text(panel, '.jp-gpuwidget-chart-value')).toEqual(['12%', '2/8 GB']);
    panel.dispose();
  });

  it('shows a clear message and a retry button, not charts, when the server extension is missing', () => {
    const { model, panel, retries } = mount();
    model.setConnection({
      kind: 'missing',
      url: '/base/gpuwidget/api/devices'
    });
    panel.render();
    expect(panel.node.querySelectorAll('.jp-gpuwidget-card')).toHaveLength(0);
    const notice = panel.node.querySelector('.jp-gpuwidget-notice')!;
    expect(notice.textContent).toContain('server extension is not running');
    expect(notice.textContent).toContain(
      '/base/gpuwidget/api/devices answered 404'
    );
    notice.querySelector('button')!.click();
    expect(retries).toEqual([1]);
    panel.dispose();
  });

  it('gives each GPU a card, and names the metrics it never reported', () => {
    const { model, panel } = mount();
    model.handle(hello(gpuDevices(2)));
    model.handle(history(5));
    panel.render();
    expect(text(panel, '.jp-gpuwidget-card-title')).toEqual([
      'GPU0 · NVIDIA H200',
      'GPU1 · NVIDIA H200',
      'Host · 16 CPUs'
    ]);
    const gpu0 = panel.node.querySelector("[data-device='gpu0']")!;
    expect(
      Array.from(gpu0.querySelectorAll('.jp-gpuwidget-chart-title')).map(
        n => n.textContent
      )
    ).toEqual(['Utilization', 'Memory']);
    expect(gpu0.querySelector('.jp-gpuwidget-unreported')!.textContent).toBe(
      'Not reported by this GPU: Power, Temperature, PCIe.'
    );
    panel.dispose();
  });

  it('lists processes by memory, links ours to its notebook, hides the details of others', () => {
    const opened: string[] = [];
    const { model, panel } = mount(path => opened.push(path));
    model.handle(hello(gpuDevices(1)));
    model.handle({
      type: 'processes',
      t: T0,
      gpus: {
        gpu0: [
          {
            pid: 99,
            memory: GiB,
            user: 'another user',
            name: null,
            kernel_id: null,
            notebook: null
          },
          {
            pid: 4242,
            memory: 2 * GiB,
            user: 'you',
            name: 'python',
            kernel_id: 'k',
            notebook: 'exp/train.ipynb'
          }
        ]
      }
    });
    panel.render();
    const rows = Array.from(
      panel.node.querySelectorAll("[data-device='gpu0'] tbody tr")
    );
    expect(
      rows.map(row => Array.from(row.children).map(cell => cell.textContent))
    ).toEqual([
      ['train.ipynb', 'you', '2 GB'],
      ['–', 'another user', '1 GB']
    ]);
    (rows[0].querySelector('button') as HTMLButtonElement).click();
    expect(opened).toEqual(['exp/train.ipynb']);
    panel.dispose();
  });
});

function processes(gpus: Record<string, IProcessInfo[]>) {
  return { type: 'processes' as const, t: T0, gpus };
}

const ours = (notebook: string, memory: number): IProcessInfo => ({
  pid: 4242,
  memory,
  user: 'you',
  name: 'python',
  kernel_id: 'k',
  notebook
});

const theirs = (memory: number): IProcessInfo => ({
  pid: 99,
  memory,
  user: 'another user',
  name: null,
  kernel_id: null,
  notebook: null
});

function eightGpus(model: SidebarModel) {
  model.handle(hello(gpuDevices(8)));
  const values: Record<string, number> = {};
  for (let i = 0; i < 8; i++) {
    values[`gpu${i}.util`] = 10 * i;
    values[`gpu${i}.mem_used`] = (i + 1) * GiB;
    values[`gpu${i}.power`] = 100 + i;
  }
  model.handle(sample(T0, values));
}

/** The overview's rows, each cell's text by its column's class (never by position). */
const COLUMN_CLASSES = ['gpu', 'util', 'memory', 'power', 'holder'];
const overviewCells = (panel: GpuPanel) =>
  Array.from(
    panel.node.querySelectorAll('.jp-gpuwidget-overview tbody tr')
  ).map(row =>
    COLUMN_CLASSES.map(name =>
      row.querySelector(`.jp-gpuwidget-overview-${name}`)?.textContent?.trim()
    )
  );

describe('GpuPanel with many GPUs', () => {
  it('shows one overview row per GPU above the cards: utilisation, memory, power, holder', () => {
    const opened: string[] = [];
    const { model, panel } = mount(path => opened.push(path));
    eightGpus(model);
    model.handle(
      processes({
        gpu0: [theirs(GiB), ours('exp/train.ipynb', 2 * GiB)],
        gpu1: [theirs(3 * GiB)],
        gpu2: []
      })
    );
    panel.render();
    const overview = panel.node.querySelector(
      '.jp-gpuwidget-overview'
    ) as HTMLElement;
    expect(overview.hidden).toBe(false);
    expect(overview.getAttribute('aria-label')).toBe('GPU overview');
    // Above the cards.
    expect(
      overview.compareDocumentPosition(
        panel.node.querySelector('.jp-gpuwidget-cards')!
      ) & Node.DOCUMENT_POSITION_FOLLOWING
    ).toBeTruthy();
    const rows = overviewCells(panel);
    expect(rows).toHaveLength(8);
    expect(rows[0]).toEqual([
      'GPU0',
      '0%',
      '1/80 GB',
      '100 W',
      'train.ipynb +1'
    ]);
    expect(rows[1]).toEqual([
      'GPU1',
      '10%',
      '2/80 GB',
      '101 W',
      'another user'
    ]);
    // No process listed and 3 GB in use (above the driver's idle reserve): not "free".
    expect(rows[2][4]).toBe('in use, holder not listed');
    expect(rows[7]).toEqual([
      'GPU7',
      '70%',
      '8/80 GB',
      '107 W',
      'in use, holder not listed'
    ]);
    const bar = panel.node.querySelector(
      "[data-device='gpu7'] .jp-gpuwidget-bar-fill"
    ) as HTMLElement;
    expect(bar.style.width).toBe('70%');
    // Another user's process: no name, no pid, not in the tooltip either.
    const holder1 = panel.node.querySelector(
      ".jp-gpuwidget-overview [data-device='gpu1'] .jp-gpuwidget-overview-holder"
    ) as HTMLElement;
    expect(holder1.title).toBe('another user · 3 GB');
    const holder0 = panel.node.querySelector(
      ".jp-gpuwidget-overview [data-device='gpu0'] .jp-gpuwidget-overview-holder"
    ) as HTMLElement;
    expect(holder0.title).toBe(
      'train.ipynb (4242) · you · 2 GB\nanother user · 1 GB'
    );
    (holder0.querySelector('button') as HTMLButtonElement).click();
    expect(opened).toEqual(['exp/train.ipynb']);
    panel.dispose();
  });

  it('says "–" for the holders before the first process scan, not "free"', () => {
    const { model, panel } = mount();
    eightGpus(model);
    panel.render();
    expect(overviewCells(panel).map(row => row[4])).toEqual(Array(8).fill('–'));
    panel.dispose();
  });

  it('updates the rows in place as samples arrive', () => {
    const { model, panel } = mount();
    eightGpus(model);
    panel.render();
    const cell = panel.node.querySelector(
      ".jp-gpuwidget-overview [data-device='gpu3']"
    );
    model.handle(sample(T0 + 1, { 'gpu3.util': 99 }));
    panel.render();
    expect(
      panel.node.querySelector(".jp-gpuwidget-overview [data-device='gpu3']")
    ).toBe(cell);
    expect(overviewCells(panel)[3][1]).toBe('99%');
    panel.dispose();
  });

  it('folds the cards from four GPUs on; a header button or the overview unfolds one', () => {
    const { model, panel } = mount();
    eightGpus(model);
    panel.render();
    const toggles = Array.from(
      panel.node.querySelectorAll('.jp-gpuwidget-card-toggle')
    ) as HTMLButtonElement[];
    expect(toggles).toHaveLength(8);
    expect(toggles.map(t => t.getAttribute('aria-expanded'))).toEqual(
      Array(8).fill('false')
    );
    const card3 = panel.node.querySelector(
      ".jp-gpuwidget-card[data-device='gpu3']"
    ) as HTMLElement;
    const body3 = card3.querySelector('.jp-gpuwidget-card-body') as HTMLElement;
    expect(body3.hidden).toBe(true);
    expect(toggles[3].getAttribute('aria-controls')).toBe(body3.id);
    // A folded card still says its values in its header.
    expect(card3.querySelector('.jp-gpuwidget-card-readout')!.textContent).toBe(
      '30% · 4/80 GB'
    );

    const reveal = panel.node.querySelector(
      ".jp-gpuwidget-overview [data-device='gpu3'] th button"
    ) as HTMLButtonElement;
    expect(reveal.textContent).toBe('GPU3');
    reveal.click();
    expect(body3.hidden).toBe(false);
    expect(toggles[3].getAttribute('aria-expanded')).toBe('true');
    expect(document.activeElement).toBe(toggles[3]);

    toggles[3].click();
    expect(body3.hidden).toBe(true);
    toggles[5].click();
    expect(toggles[5].getAttribute('aria-expanded')).toBe('true');
    // The choice survives a rebuild of the cards (e.g. a new metric reported).
    model.handle(sample(T0 + 1, { 'gpu5.temperature': 60 }));
    panel.render();
    const again = panel.node.querySelector(
      ".jp-gpuwidget-card[data-device='gpu5'] .jp-gpuwidget-card-toggle"
    )!;
    expect(again.getAttribute('aria-expanded')).toBe('true');
    panel.dispose();
  });

  it('shows neither the overview nor folded cards for two GPUs', () => {
    const { model, panel } = mount();
    model.handle(hello(gpuDevices(2)));
    model.handle(history(5));
    panel.render();
    expect(
      (panel.node.querySelector('.jp-gpuwidget-overview') as HTMLElement).hidden
    ).toBe(true);
    expect(
      Array.from(panel.node.querySelectorAll('.jp-gpuwidget-card-toggle')).map(
        t => t.getAttribute('aria-expanded')
      )
    ).toEqual(['true', 'true']);
    panel.dispose();
  });
});

describe('GpuPanel accessibility', () => {
  it('is a labelled region whose sections, cards and controls all have names', () => {
    const { model, panel } = mount(() => undefined);
    eightGpus(model);
    model.handle(processes({ gpu0: [ours('a.ipynb', GiB)] }));
    model.setCluster({
      kind: 'ready',
      reply: clusterReply(),
      atMs: Date.now()
    });
    panel.render();
    expect(panel.node.getAttribute('role')).toBe('region');
    expect(panel.node.getAttribute('aria-label')).toBe('GPU sidebar');
    expect(
      panel.node.querySelector('.jp-gpuwidget-status')!.getAttribute('role')
    ).toBe('status');
    for (const section of Array.from(panel.node.querySelectorAll('section'))) {
      const labelledBy = section.getAttribute('aria-labelledby');
      const name = labelledBy
        ? document.getElementById(labelledBy)?.textContent
        : section.getAttribute('aria-label');
      expect(name).toBeTruthy();
    }
    const buttons = Array.from(panel.node.querySelectorAll('button'));
    expect(buttons.length).toBeGreaterThan(8);
    for (const button of buttons) {
      const name =
        button.getAttribute('aria-label') ?? button.textContent?.trim();
      expect(name).toBeTruthy();
      // Native buttons: in the tab order, Enter and Space work.
      expect(button.tabIndex).toBe(0);
    }
    panel.dispose();
  });
});

describe('GpuPanel stalled sources', () => {
  it('says which source stopped answering and since when, and clears once it answers', () => {
    const { model, panel } = mount();
    model.handle(hello(gpuDevices(2)));
    model.handle({
      type: 'sample',
      t: T0,
      values: { 'gpu0.util': 5 },
      stalled: [{ source: 'GPU 1', since_s: 12.4 }]
    });
    panel.render();
    const notice = panel.node.querySelector(
      '.jp-gpuwidget-stalled'
    ) as HTMLElement;
    const shown = () =>
      notice.querySelector('.jp-gpuwidget-stalled-text')?.textContent;
    expect(shown()).toBe('⚠ GPU 1 stopped answering 12 s ago.');
    expect(notice.textContent).toContain(
      'Its figures stop until the Jupyter server restarts'
    );
    expect(notice.getAttribute('role')).toBe('alert');
    // A screen reader hears the time it stopped, once; the counting text is hidden from it.
    const spoken = notice.querySelector(
      '.jp-gpuwidget-visually-hidden'
    ) as HTMLElement;
    expect(spoken.textContent).toMatch(
      /^GPU 1 stopped answering at .+\. Its figures stop until the Jupyter server restarts\.$/
    );
    expect(
      notice
        .querySelector('.jp-gpuwidget-stalled-text')!
        .getAttribute('aria-hidden')
    ).toBe('true');
    model.handle({
      type: 'sample',
      t: T0 + 1,
      values: { 'gpu0.util': 5 },
      stalled: [{ source: 'GPU 1', since_s: 13.4 }]
    });
    panel.render();
    expect(notice.querySelector('.jp-gpuwidget-visually-hidden')).toBe(spoken);
    expect(shown()).toBe('⚠ GPU 1 stopped answering 13 s ago.');
    model.handle(sample(T0 + 2, { 'gpu0.util': 6 }));
    panel.render();
    expect(notice.textContent).toBe('');
  });

  it('counts the time since the message arrived', () => {
    const now = 1_000_000;
    expect(
      stalledLines(
        {
          sources: [
            { source: 'GPU 1', since_s: 12.4 },
            { source: 'host', since_s: 3 }
          ],
          devices: {},
          receivedS: now - 5
        },
        now
      )
    ).toEqual([
      'GPU 1 stopped answering 17 s ago',
      'host stopped answering 8 s ago'
    ]);
  });
});

/** Eight GPUs, GPU 5 stale: stopped answering `ageS - 1` seconds ago, its last values read `ageS` ago. */
function gpuFiveStopped(
  t: number,
  ageS: number,
  values: Record<string, number>
): ISampleMessage {
  const live: Record<string, number> = {};
  for (const i of [0, 1, 2, 3, 4, 6, 7]) {
    live[`gpu${i}.util`] = 10 * i + (t - T0);
    live[`gpu${i}.mem_used`] = (i + 1) * GiB;
  }
  return {
    type: 'sample',
    t,
    values: live,
    stalled: [{ source: 'GPU 5', since_s: ageS - 1, devices: ['gpu5'] }],
    stale: {
      gpu5: {
        source: 'GPU 5',
        hung: true,
        t: t - ageS,
        age_s: ageS,
        values: {
          'gpu5.util': values.util,
          'gpu5.mem_used': values.mem_used
        }
      }
    }
  };
}

describe('GpuPanel with one GPU that stopped answering', () => {
  it('greys its row and card with its last values and their age; the other rows go on', () => {
    const { model, panel } = mount();
    eightGpus(model);
    model.handle(processes({ gpu0: [ours('train.ipynb', 2 * GiB)] }));
    model.handle(
      gpuFiveStopped(T0 + 1, 12.2, { util: 35, mem_used: 40 * GiB })
    );
    panel.render();
    const row = (id: string) =>
      panel.node.querySelector(
        `.jp-gpuwidget-overview [data-device='${id}']`
      ) as HTMLElement;
    const cell = (id: string, name: string) =>
      row(id).querySelector(`.jp-gpuwidget-overview-${name}`) as HTMLElement;
    expect(row('gpu5').classList.contains('jp-mod-stale')).toBe(true);
    expect(cell('gpu5', 'util').textContent).toBe('35%');
    expect(cell('gpu5', 'memory').textContent).toBe('40/80 GB');
    // "stopped" counts as the notice above does; the tooltip gives the values' own age.
    expect(cell('gpu5', 'holder').textContent).toBe('stopped 11 s ago');
    expect(cell('gpu5', 'holder').title).toBe(
      'GPU5 stopped answering 11 s ago; its last values (read 12 s ago) are shown, greyed.'
    );
    expect(
      panel.node.querySelector('.jp-gpuwidget-stalled-text')!.textContent
    ).toBe('⚠ GPU 5 stopped answering 11 s ago.');
    expect(row('gpu4').classList.contains('jp-mod-stale')).toBe(false);
    expect(cell('gpu0', 'holder').textContent).toBe('train.ipynb');
    // The card: greyed, its header gives the last values and the age, its body says why.
    const card = panel.node.querySelector(
      ".jp-gpuwidget-card[data-device='gpu5']"
    ) as HTMLElement;
    expect(card.classList.contains('jp-mod-stale')).toBe(true);
    expect(card.querySelector('.jp-gpuwidget-card-readout')!.textContent).toBe(
      '35% · 40/80 GB · stopped 11 s ago'
    );
    expect(card.querySelector('.jp-gpuwidget-card-stale')!.textContent).toBe(
      '⚠ GPU5 stopped answering 11 s ago; its last values (read 12 s ago) are shown, greyed.'
    );

    // The next samples: the live rows move, GPU 5 keeps its values and only ages.
    model.handle(
      gpuFiveStopped(T0 + 3, 14.2, { util: 35, mem_used: 40 * GiB })
    );
    panel.render();
    expect(cell('gpu4', 'util').textContent).toBe('43%');
    expect(cell('gpu7', 'util').textContent).toBe('73%');
    expect(cell('gpu5', 'util').textContent).toBe('35%');
    expect(cell('gpu5', 'holder').textContent).toBe('stopped 13 s ago');
    expect(card.querySelector('.jp-gpuwidget-card-readout')!.textContent).toBe(
      '35% · 40/80 GB · stopped 13 s ago'
    );
    expect(panel.node.querySelectorAll('.jp-mod-stale').length).toBe(2); // its row and its card, no other
    panel.dispose();
  });

  it('names a GPU that stopped with another source as not read, and one that never answered', () => {
    const { model, panel } = mount();
    eightGpus(model);
    model.handle({
      type: 'sample',
      t: T0 + 1,
      values: {},
      stalled: [{ source: 'GPU 1', since_s: 5, devices: ['gpu0', 'gpu1'] }],
      stale: {
        gpu0: { source: 'GPU 1', hung: false, t: T0, age_s: 5, values: {} },
        gpu1: { source: 'GPU 1', hung: true, t: null, age_s: null, values: {} }
      }
    });
    panel.render();
    const holder = (id: string) =>
      panel.node.querySelector(
        `[data-device='${id}'] .jp-gpuwidget-overview-holder`
      ) as HTMLElement;
    expect(holder('gpu0').title).toBe(
      'GPU0 is no longer read: GPU 1, read by the same source, stopped answering 5 s ago; its last values (read 5 s ago) are shown, greyed.'
    );
    expect(holder('gpu1').textContent).toBe('stopped 5 s ago');
    expect(holder('gpu1').title).toBe(
      'GPU1 stopped answering 5 s ago; it gave no values before.'
    );
    panel.dispose();
  });
});

describe('the holder of a GPU the driver lists no process on', () => {
  const gpu = { memoryUsed: 71 * GiB, foreignPidNamespace: true };
  it('is "in use, holder not visible from this container" in a container, with its memory in use', () => {
    expect(holderOf([], gpu)).toEqual({
      text: 'in use, holder not visible from this container',
      title:
        "The driver lists no process on this GPU, but 71 GB of its memory is in use. This Jupyter server runs in a container without the host's PID namespace, where the driver shows no process of the host's.",
      notebook: null
    });
    expect(holderOf([], { ...gpu, foreignPidNamespace: false }).text).toBe(
      'in use, holder not listed'
    );
  });

  it('is "free" up to the idle reserve of the driver, and in use above it', () => {
    expect(holderOf([], { ...gpu, memoryUsed: IDLE_RESERVE_BYTES }).text).toBe(
      'free'
    );
    expect(
      holderOf([], { ...gpu, memoryUsed: IDLE_RESERVE_BYTES + 1 }).text
    ).toBe('in use, holder not visible from this container');
    expect(holderOf([], { ...gpu, memoryUsed: null }).text).toBe('free');
    expect(holderOf([]).text).toBe('free');
  });

  it('says so in the overview and the card of a GPU in a container', () => {
    const { model, panel } = mount();
    const devices = gpuDevices(8);
    devices.devices = devices.devices.map(device => ({
      ...device,
      foreign_pid_namespace: true
    }));
    model.handle(hello(devices));
    model.handle(
      sample(T0, {
        'gpu4.util': 100,
        'gpu4.mem_used': 71 * GiB,
        'gpu2.mem_used': GiB / 2
      })
    );
    model.handle(processes({ gpu2: [], gpu4: [] }));
    panel.render();
    const holder = (id: string) =>
      panel.node.querySelector(
        `[data-device='${id}'] .jp-gpuwidget-overview-holder`
      )!.textContent;
    expect(holder('gpu4')).toBe(
      'in use, holder not visible from this container'
    );
    expect(holder('gpu2')).toBe('free');
    expect(
      panel.node.querySelector(
        "[data-device='gpu4'] .jp-gpuwidget-processes-empty"
      )!.textContent
    ).toMatch(
      /^The driver lists no process on this GPU, but 71 GB of its memory is in use\. This Jupyter server runs in a container/
    );
    panel.dispose();
  });
});

describe('the overview columns as data', () => {
  it('draws a column added as one entry: its heading, width, cells and updates, found by its class', () => {
    const temperature = {
      heading: 'Temp',
      className: 'jp-gpuwidget-overview-temp',
      kind: 'number' as const,
      minWidth: '3.6em',
      value: (row: { id: string; latest: (c: string) => number | null }) => ({
        text: formatCelsius(row.latest(`${row.id}.temperature`))
      })
    };
    const overview = new GpuOverview(() => undefined, null, [
      ...OVERVIEW_COLUMNS,
      temperature
    ]);
    document.body.appendChild(overview.node);
    const devices = gpuDevices(3).devices;
    let readings: Record<string, number> = { 'gpu1.temperature': 61 };
    const rows = () =>
      overviewRows(devices, column => readings[column] ?? null, {}, true);
    overview.update(rows());
    const headings = Array.from(overview.node.querySelectorAll('thead th'));
    expect(headings.map(th => th.textContent)).toEqual([
      'GPU',
      'Busy',
      'Memory',
      'Power',
      'Held by',
      'Temp'
    ]);
    const head = overview.node.querySelector(
      'thead .jp-gpuwidget-overview-temp'
    ) as HTMLElement;
    expect(head.style.minWidth).toBe('3.6em');
    expect(head.classList.contains('jp-gpuwidget-number')).toBe(true);
    const cell = () =>
      overview.node.querySelector(
        "[data-device='gpu1'] .jp-gpuwidget-overview-temp"
      ) as HTMLElement;
    expect(cell().textContent).toBe('61 °C');
    const built = cell();
    readings = { 'gpu1.temperature': 63 };
    overview.update(rows());
    expect(cell()).toBe(built); // updated in place
    expect(cell().textContent).toBe('63 °C');
    // The columns before it still read as they did, by class.
    expect(
      overview.node.querySelector(
        "[data-device='gpu1'] .jp-gpuwidget-overview-gpu"
      )!.textContent
    ).toBe('GPU1');
    // Its header's width: the last column takes what is left; the one before it now has a width.
    const holderHead = overview.node.querySelector(
      'thead .jp-gpuwidget-overview-holder'
    ) as HTMLElement;
    expect(holderHead.style.width).toBe('4em');
    overview.node.remove();
  });
});
