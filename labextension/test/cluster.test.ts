/**
 * @jest-environment jsdom
 */

// The cluster section: its figures (idle GPUs, colours) and its DOM in jsdom.

import {
  HEAT_STOPS,
  IDLE_MAX_UTIL,
  clusterSummary,
  heatColor,
  rowDescription
} from '../src/cluster';
import { ClusterView } from '../src/clusterview';
import { installFakeCanvas, paintedImages } from './fakes';
import { clusterReply } from './fixtures';

beforeAll(() => installFakeCanvas());

/** Two hosts x 8 GPUs; GPUs 3 and 5 of host-a and 7 of host-b never pass 4%. */
function mostlyBusy() {
  const idle = new Set(['0/3', '0/5', '1/7']);
  return clusterReply(2, 8, (h, g, k) =>
    idle.has(`${h}/${g}`) ? (k % 5) / 100 : 0.2 + ((k + g) % 8) / 10
  );
}

describe('clusterSummary', () => {
  it('names the GPUs that stayed under the idle threshold over the hour', () => {
    const summary = clusterSummary(mostlyBusy());
    expect(summary.rows).toHaveLength(16);
    expect(summary.idleText).toBe(
      '3 of 16 GPUs idle over the last hour: host-a GPU 3, host-a GPU 5, host-b GPU 7.'
    );
  });

  it('treats the threshold as a bound: a GPU that once reached it was not idle', () => {
    const at = (peak: number) =>
      clusterSummary(clusterReply(1, 1, (_h, _g, k) => (k === 100 ? peak : 0)))
        .rows[0].idle;
    expect(at(IDLE_MAX_UTIL - 0.001)).toBe(true);
    expect(at(IDLE_MAX_UTIL)).toBe(false);
  });

  it('does not call a GPU without readings idle', () => {
    const summary = clusterSummary(
      clusterReply(1, 2, (_h, g) => (g ? null : 0))
    );
    expect(summary.idle.map(r => r.label)).toEqual(['GPU 0']);
    expect(summary.noData.map(r => r.label)).toEqual(['GPU 1']);
    expect(rowDescription(summary.rows[1], summary.window)).toBe(
      'host-a GPU 1: no utilisation readings over the last hour'
    );
  });

  it('says so when no GPU was idle, or none matched', () => {
    expect(clusterSummary(clusterReply(1, 2, () => 0.5)).idleText).toBe(
      'No GPU idle over the last hour (of 2).'
    );
    expect(clusterSummary(clusterReply(0, 0)).idleText).toBe(
      'No GPU matched in Prometheus.'
    );
  });

  it('describes each GPU in words: mean, peak, idle, holder', () => {
    const summary = clusterSummary(
      clusterReply(1, 1, (_h, _g, k) => (k < 120 ? 0.2 : 0.6))
    );
    expect(rowDescription(summary.rows[0], summary.window)).toBe(
      'host-a GPU 0 utilisation over the last hour: mean 40%, peak 60%, held by user0'
    );
  });
});

describe('heatColor', () => {
  it('runs from the first stop to the last, clamped', () => {
    expect(heatColor(0)).toEqual(HEAT_STOPS[0]);
    expect(heatColor(-1)).toEqual(HEAT_STOPS[0]);
    expect(heatColor(1)).toEqual(HEAT_STOPS[HEAT_STOPS.length - 1]);
    expect(heatColor(7)).toEqual(HEAT_STOPS[HEAT_STOPS.length - 1]);
    expect(heatColor(0.5)).toEqual(HEAT_STOPS[5]);
  });

  it('gets lighter as utilisation rises (readable without hue)', () => {
    const luma = ([r, g, b]: number[]) => 0.2126 * r + 0.7152 * g + 0.0722 * b;
    for (let u = 0.1; u <= 1; u += 0.1) {
      expect(luma(heatColor(u))).toBeGreaterThan(luma(heatColor(u - 0.1)));
    }
  });
});

describe('ClusterView', () => {
  it('draws one strip per GPU grouped by host, with the idle GPUs called out in text', () => {
    const view = new ClusterView();
    document.body.appendChild(view.node);
    view.update({ kind: 'ready', reply: mostlyBusy(), atMs: Date.now() });
    expect(view.node.hidden).toBe(false);
    expect(
      view.node.querySelector('.jp-gpuwidget-cluster-idle')!.textContent
    ).toContain('3 of 16 GPUs idle');
    const hosts = Array.from(
      view.node.querySelectorAll('.jp-gpuwidget-cluster-host th')
    ).map(th => th.textContent);
    expect(hosts).toEqual(['host-a', 'host-b']);
    const rows = Array.from(
      view.node.querySelectorAll('.jp-gpuwidget-cluster-gpu')
    ) as HTMLElement[];
    expect(rows).toHaveLength(16);
    const a3 = rows[3];
    expect(a3.dataset.host).toBe('host-a');
    expect(a3.classList.contains('jp-mod-idle')).toBe(true);
    expect(a3.querySelector('.jp-gpuwidget-cluster-readout')!.textContent).toBe(
      'idle'
    );
    expect(
      (a3.querySelector('.jp-gpuwidget-cluster-readout') as HTMLElement).title
    ).toBe('Utilisation mean 2%, peak 4%\nNow: memory 20/80 GB, power 250 W');
    // Holder next to the GPU.
    expect(rows[0].querySelector('th')!.textContent).toBe('GPU 0user0');
    expect(
      rows[0].querySelector('.jp-gpuwidget-cluster-holder')!.textContent
    ).toBe('user0');
    // The strip: one pixel per step, its colour the utilisation's.
    const canvas = a3.querySelector('canvas') as HTMLCanvasElement;
    expect(canvas.getAttribute('role')).toBe('img');
    expect(canvas.getAttribute('aria-label')).toContain(
      'host-a GPU 3 utilisation over the last hour'
    );
    const image = paintedImages.get(canvas)!;
    expect(image.width).toBe(240);
    expect(Array.from(image.data.slice(0, 4))).toEqual([...heatColor(0), 255]);
    expect(
      view.node.querySelector('.jp-gpuwidget-cluster-meta')!.textContent
    ).toMatch(/^16 GPUs on 2 hosts · gpuwidget · updated /);
  });

  it('leaves steps without a reading transparent (the hatched background shows)', () => {
    const view = new ClusterView();
    view.update({
      kind: 'ready',
      reply: clusterReply(1, 1, (_h, _g, k) => (k % 2 ? null : 1)),
      atMs: 0
    });
    const image = paintedImages.get(view.node.querySelector('canvas')!)!;
    expect(Array.from(image.data.slice(0, 8))).toEqual([
      ...heatColor(1),
      255,
      0,
      0,
      0,
      0
    ]);
  });

  it("shows Prometheus's error, and the route's failure over the last good strip", () => {
    const view = new ClusterView();
    view.update({
      kind: 'ready',
      reply: {
        ...clusterReply(0, 0),
        error:
          'Prometheus at http://prom:9090 did not answer (connection refused)'
      },
      atMs: 0
    });
    const message = view.node.querySelector(
      '.jp-gpuwidget-cluster-message'
    ) as HTMLElement;
    expect(message.hidden).toBe(false);
    expect(message.textContent).toBe(
      'The cluster could not be read: Prometheus at http://prom:9090 did not answer (connection refused)'
    );
    expect(message.getAttribute('role')).toBe('status');

    const good = clusterReply();
    view.update({ kind: 'ready', reply: good, atMs: 0 });
    expect(message.hidden).toBe(true);
    view.update({
      kind: 'error',
      message: 'cannot reach the server',
      last: good
    });
    expect(message.textContent).toBe(
      'The cluster could not be read: cannot reach the server'
    );
    expect(
      view.node.querySelectorAll('.jp-gpuwidget-cluster-gpu')
    ).toHaveLength(4);
  });

  it('is hidden while the cluster is off', () => {
    const view = new ClusterView();
    view.update({ kind: 'off' });
    expect(view.node.hidden).toBe(true);
    view.update({ kind: 'loading' });
    expect(view.node.hidden).toBe(false);
    expect(view.node.textContent).toContain('Asking Prometheus');
  });

  it('draws 64 GPUs x 240 steps quickly (the sidebar frame with the strip)', () => {
    const reply = clusterReply(
      8,
      8,
      (h, g, k) => ((h * 8 + g + k) % 100) / 100
    );
    const view = new ClusterView();
    document.body.appendChild(view.node);
    const times: number[] = [];
    for (let i = 0; i < 5; i++) {
      const copy = { ...reply };
      const start = performance.now();
      view.update({ kind: 'ready', reply: copy, atMs: 0 });
      times.push(performance.now() - start);
    }
    expect(view.node.querySelectorAll('canvas')).toHaveLength(64);
    times.sort((a, b) => a - b);
    // jsdom is far slower than a browser; the browser figure is in BENCHMARKS.md.
    expect(times[2]).toBeLessThan(500);
  });
});
