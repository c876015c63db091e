import {
  GPU_METRICS,
  gpuCharts,
  hostCharts,
  splitReported,
  statusSummary,
  tickLabel
} from '../src/metrics';
import { SeriesBuffer } from '../src/model';
import { GiB, T0, gpuDevices, noGpuDevices } from './fixtures';

function bufferWith(
  values: Record<string, number | null>,
  t = T0
): SeriesBuffer {
  const buffer = new SeriesBuffer(10);
  buffer.push(t, values);
  return buffer;
}

describe('charts', () => {
  it('gives a GPU the charts chosen in the settings, in that order', () => {
    const device = gpuDevices().devices[0];
    const none = () => null;
    expect(gpuCharts(device, GPU_METRICS, none).map(c => c.title)).toEqual([
      'Utilization',
      'Memory',
      'Power',
      'Temperature',
      'PCIe'
    ]);
    expect(
      gpuCharts(device, ['power', 'utilization'], none).map(c => c.key)
    ).toEqual(['gpu0/power', 'gpu0/utilization']);
  });

  it('scales memory and power to the device limits', () => {
    const [utilization, memory, power] = gpuCharts(
      gpuDevices().devices[0],
      GPU_METRICS,
      () => null
    );
    expect(utilization.yMax).toBe(100);
    expect(memory.yMax).toBe(80 * GiB);
    expect(power.yMax).toBe(700);
  });

  it('reads current values for the chart titles', () => {
    const series = bufferWith({
      'gpu0.util': 87,
      'gpu0.mem_used': 41 * GiB,
      'gpu0.power': 250,
      'gpu0.temperature': 64,
      'gpu0.pcie_rx': GiB,
      'gpu0.pcie_tx': 0
    });
    const at = (c: string) => series.latest(c);
    const readouts = gpuCharts(gpuDevices().devices[0], GPU_METRICS, at).map(
      c => c.readout(at)
    );
    expect(readouts).toEqual([
      '87%',
      '41/80 GB',
      '250/700 W',
      '64 °C',
      '↓ 1 GB/s ↑ 0 B/s'
    ]);
  });

  it('lists a metric the GPU never reported instead of drawing it empty', () => {
    const series = bufferWith({ 'gpu0.util': 5, 'gpu0.mem_used': GiB });
    const charts = gpuCharts(gpuDevices().devices[0], GPU_METRICS, () => null);
    const { shown, unreported } = splitReported(charts, series);
    expect(shown.map(c => c.title)).toEqual(['Utilization', 'Memory']);
    expect(unreported.map(c => c.title)).toEqual([
      'Power',
      'Temperature',
      'PCIe'
    ]);
  });

  it('keeps every chart until the first data arrives', () => {
    const charts = hostCharts(noGpuDevices().host, () => null);
    expect(splitReported(charts, new SeriesBuffer(4)).shown).toHaveLength(2);
  });

  it('labels axis ticks shortly', () => {
    expect(tickLabel('percent', 50)).toBe('50%');
    expect(tickLabel('bytes', 40 * GiB)).toBe('40G');
    expect(tickLabel('rate', 512 * 1024 ** 2)).toBe('512M/s');
    expect(tickLabel('watts', 350)).toBe('350W');
  });
});

describe('statusSummary', () => {
  it('shows the first GPU as "GPU0 87% · 41/80 GB" and counts the others', () => {
    const series = bufferWith({ 'gpu0.util': 87.2, 'gpu0.mem_used': 41 * GiB });
    const live = statusSummary(gpuDevices(1), series, { kind: 'live' }, T0);
    expect(live).toEqual({
      text: 'GPU0 87% · 41/80 GB',
      title: 'GPU0 NVIDIA H200: 87% · 41/80 GB',
      stale: false
    });
    expect(
      statusSummary(gpuDevices(4), series, { kind: 'live' }, T0).text
    ).toBe('GPU0 87% · 41/80 GB +3');
  });

  it('keeps the last values while the panel is closed, and says how old they are', () => {
    const series = bufferWith({ 'gpu0.util': 87, 'gpu0.mem_used': 41 * GiB });
    const summary = statusSummary(
      gpuDevices(1),
      series,
      { kind: 'stopped' },
      T0 + 300
    );
    expect(summary.text).toBe('GPU0 87% · 41/80 GB');
    expect(summary.stale).toBe(true);
    expect(summary.title).toContain('Values from 5 min ago');
    expect(summary.title).toContain('GPU panel is closed');
  });

  it('says there is no GPU and shows the CPU instead', () => {
    const series = bufferWith({ 'cpu.util': 12 });
    const summary = statusSummary(noGpuDevices(), series, { kind: 'live' }, T0);
    expect(summary.text).toBe('No GPU · CPU 12%');
    expect(summary.title).toContain('no NVIDIA GPU found');
  });

  it('invites a click before anything was read', () => {
    const summary = statusSummary(
      null,
      new SeriesBuffer(2),
      { kind: 'stopped' },
      T0
    );
    expect(summary.text).toBe('GPU');
    expect(summary.stale).toBe(true);
    expect(summary.title).toContain('open the GPU panel');
  });
});
