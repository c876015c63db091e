/**
 * @jest-environment jsdom
 */

// The panel's DOM in jsdom, with the canvas charts replaced (jsdom has no canvas).

import { Widget } from '@lumino/widgets';

import { GpuPanel } from '../src/panel';
import { SidebarModel } from '../src/model';
import {
  GiB,
  T0,
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

  it('says "No NVIDIA GPU found" with the reason, and charts only the host', () => {
    const { model, panel } = mount();
    model.handle(hello(noGpuDevices()));
    model.handle(sample(T0, { 'cpu.util': 12, 'mem.used': 2 * GiB }));
    panel.render();
    expect(text(panel, '.jp-gpuwidget-notice strong')).toEqual([
      'No NVIDIA GPU found'
    ]);
    expect(text(panel, '.jp-gpuwidget-reason')).toEqual([
      'NVML Shared Library Not Found'
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
