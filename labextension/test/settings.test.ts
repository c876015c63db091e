import schema from '../schema/plugin.json';
import { GPU_METRICS } from '../src/metrics';
import { DEFAULT_SETTINGS, readSettings } from '../src/settings';

describe('readSettings', () => {
  it('takes the schema defaults from an empty composite', () => {
    expect(readSettings({})).toEqual(DEFAULT_SETTINGS);
  });

  it('keeps the chosen charts in order, dropping unknown and repeated ones', () => {
    expect(
      readSettings({ metrics: ['power', 'fan', 'utilization', 'power'] })
        .metrics
    ).toEqual(['power', 'utilization']);
    expect(readSettings({ metrics: [] }).metrics).toEqual([]);
  });

  it('clamps the interval to what the schema allows', () => {
    expect(readSettings({ interval: 0.01 }).interval).toBe(0.5);
    expect(readSettings({ interval: 600 }).interval).toBe(60);
    expect(readSettings({ interval: '2' }).interval).toBe(1);
  });

  it('reads the status bar interval: 0 turns the poll off, others are clamped', () => {
    expect(readSettings({}).statusInterval).toBe(5);
    expect(readSettings({ statusInterval: 0 }).statusInterval).toBe(0);
    expect(readSettings({ statusInterval: -3 }).statusInterval).toBe(0);
    expect(readSettings({ statusInterval: 0.2 }).statusInterval).toBe(1);
    expect(readSettings({ statusInterval: 9999 }).statusInterval).toBe(300);
    expect(readSettings({ statusInterval: 'x' }).statusInterval).toBe(5);
  });
});

describe('the settings schema', () => {
  it('lists the GPU charts as titled rows, every one shown by default (not a multi-select)', () => {
    const metrics = schema.properties.metrics;
    expect(metrics.title).toBe('GPU charts');
    expect(metrics.description).toMatch(/Remove a row to hide its chart/);
    // uniqueItems with an enum of items is what JupyterLab's form draws as a bare multi-select box
    // (four lines high: PCIe scrolled out of sight); without it, one titled row per chart.
    expect('uniqueItems' in metrics).toBe(false);
    expect(metrics.items.title).toBe('Chart');
    expect(metrics.items.oneOf.map(option => option.const)).toEqual(
      GPU_METRICS
    );
    expect(metrics.items.oneOf.every(option => option.title)).toBe(true);
    expect(metrics.default).toEqual(GPU_METRICS);
    expect(metrics.maxItems).toBe(GPU_METRICS.length);
  });
});
