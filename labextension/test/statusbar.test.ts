/**
 * @jest-environment jsdom
 */

import { SidebarModel } from '../src/model';
import { GpuStatusItem } from '../src/statusbar';
import { GiB, gpuDevices, hello, sample } from './fixtures';

describe('GpuStatusItem', () => {
  it('stays live with one GPU stopped: its last values in the tooltip with their age, and a warning sign', () => {
    const model = new SidebarModel(1);
    const item = new GpuStatusItem(model, () => undefined);
    model.handle(hello(gpuDevices(8)));
    const now = Date.now() / 1000;
    for (const [t, util] of [
      [now - 1, 87],
      [now, 90]
    ]) {
      model.handle({
        type: 'sample',
        t,
        values: { 'gpu0.util': util, 'gpu0.mem_used': 41 * GiB },
        stalled: [{ source: 'GPU 5', since_s: 12, devices: ['gpu5'] }],
        stale: {
          gpu5: {
            source: 'GPU 5',
            hung: true,
            t: t - 12,
            age_s: 12,
            values: { 'gpu5.util': 35, 'gpu5.mem_used': 40 * GiB }
          }
        }
      });
      expect(item.node.textContent).toBe(`GPU0 ${util}% · 41/80 GB +7 ⚠`);
    }
    expect(item.node.classList.contains('jp-mod-stale')).toBe(false);
    expect(item.node.title.split('\n')[5]).toBe(
      'GPU5 NVIDIA H200: kernel running (nvidia-smi) 35% · 40/80 GB (GPU5 stopped answering 12 s ago; its last values (read 12 s ago) are shown, greyed.)'
    );
    expect(item.node.getAttribute('aria-label')).toContain(
      'GPU5 stopped answering 12 s ago'
    );
    item.dispose();
  });

  it('follows the model, greys out when not live, and opens the panel on click', () => {
    const model = new SidebarModel(1);
    const clicks: number[] = [];
    const item = new GpuStatusItem(model, () => clicks.push(1));
    expect(item.node.textContent).toBe('GPU');
    expect(item.node.classList.contains('jp-mod-stale')).toBe(true);

    model.handle(hello(gpuDevices(1)));
    model.handle(
      sample(Date.now() / 1000, { 'gpu0.util': 87, 'gpu0.mem_used': 41 * GiB })
    );
    expect(item.node.textContent).toBe('GPU0 87% · 41/80 GB');
    expect(item.node.classList.contains('jp-mod-stale')).toBe(false);

    model.setConnection({ kind: 'stopped' });
    expect(item.node.textContent).toBe('GPU0 87% · 41/80 GB');
    expect(item.node.classList.contains('jp-mod-stale')).toBe(true);
    expect(item.node.title).toContain(
      'nothing is polled while the GPU panel is closed'
    );

    item.node.click();
    expect(clicks).toEqual([1]);
    item.dispose();
  });

  it('stops following the model once disposed', () => {
    const model = new SidebarModel(1);
    const item = new GpuStatusItem(model, () => undefined);
    model.handle(hello(gpuDevices(1)));
    model.handle(sample(Date.now() / 1000, { 'gpu0.util': 87 }));
    const shown = item.node.textContent;
    item.dispose();
    model.handle(sample(Date.now() / 1000, { 'gpu0.util': 12 }));
    expect(item.node.textContent).toBe(shown);
  });

  it('shows live values while the panel is closed and polled, and greys them out once they age', () => {
    const model = new SidebarModel(1);
    const item = new GpuStatusItem(model, () => undefined);
    model.setConnection({ kind: 'polling', everyS: 5, error: null });
    const now = Date.now() / 1000;
    model.applySnapshot({
      devices: gpuDevices(2),
      latest: { t: now - 1, values: { 'gpu0.util': 40, 'gpu0.mem_used': GiB } },
      processes: null,
      stalled: [],
      stale: {}
    });
    expect(item.node.textContent).toBe('GPU0 40% · 1/80 GB +1');
    expect(item.node.classList.contains('jp-mod-stale')).toBe(false);
    expect(item.node.title).toContain(
      'Updated every 5 s while the GPU panel is closed'
    );
    expect(item.node.getAttribute('aria-label')).toBe(
      'GPU status: GPU0 40% · 1/80 GB +1. Opens the GPU panel.'
    );

    // Three polls without news: the values are old.
    model.applySnapshot({
      devices: gpuDevices(2),
      latest: { t: now - 16, values: {} },
      processes: null,
      stalled: [],
      stale: {}
    });
    model.series.clear();
    model.series.push(now - 16, { 'gpu0.util': 40 });
    model.setConnection({ kind: 'polling', everyS: 5, error: null });
    expect(item.node.classList.contains('jp-mod-stale')).toBe(true);
    expect(item.node.getAttribute('aria-label')).toContain('(not current)');

    model.setConnection({
      kind: 'polling',
      everyS: 5,
      error: 'cannot reach the server'
    });
    expect(item.node.title).toContain(
      'the server did not answer (cannot reach the server)'
    );
    item.dispose();
  });
});
