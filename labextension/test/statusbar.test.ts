/**
 * @jest-environment jsdom
 */

import { SidebarModel } from '../src/model';
import { GpuStatusItem } from '../src/statusbar';
import { GiB, gpuDevices, hello, sample } from './fixtures';

describe('GpuStatusItem', () => {
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
});
