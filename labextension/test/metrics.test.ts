import {
  GPU_METRICS,
  deviceLabel,
  gpuCharts,
  hostCharts,
  splitReported,
  statusSummary,
  tickIncrements,
  tickLabel
} from '../src/metrics';
import { SeriesBuffer } from '../src/model';
import { overviewRows } from '../src/overview';
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

  /** The ticks uPlot draws on [0, max]: the first step at least `space` px apart (its rule). */
  function ticks(max: number, heightPx: number, space = 20): string[] {
    const steps = tickIncrements('bytes')!;
    const step = steps.find(s => (s / max) * heightPx >= space)!;
    const labels: string[] = [];
    for (let value = 0; value <= max; value += step) {
      labels.push(tickLabel('bytes', value));
    }
    return labels;
  }

  it('ticks a memory axis at round values of the unit the readouts use (1 GB = 2^30 bytes)', () => {
    // An 80 GB GPU (80 GiB, "35/80 GB" in its readout) on a 56 px plot: not 0, 47G, 93G.
    expect(ticks(80 * GiB, 56)).toEqual(['0', '40G', '80G']);
    expect(ticks(80 * GiB, 120)).toEqual(['0', '20G', '40G', '60G', '80G']);
    expect(ticks(141 * GiB, 56)).toEqual(['0', '100G']);
    expect(ticks(24 * GiB, 56)).toEqual(['0', '10G', '20G']);
    expect(ticks(1.5 * GiB, 56)).toEqual(['0', '1G']);
    expect(ticks(512 * 1024 ** 2, 56)).toEqual(['0', '200M', '400M']);
    // Every step reads exactly as what it is, in the unit of its label.
    for (const step of tickIncrements('bytes')!) {
      const [, number, prefix] = /^([\d.]+)([KMGTP]?)$/.exec(
        tickLabel('bytes', step)
      )!;
      expect(Number(number) * 1024 ** ' KMGTP'.indexOf(prefix || ' ')).toBe(
        step
      );
    }
    expect(tickIncrements('rate')).toBe(tickIncrements('bytes'));
    expect(tickIncrements('percent')).toBeUndefined();
  });
});

describe('statusSummary', () => {
  it('shows the first GPU as "GPU0 87% · 41/80 GB" and counts the others', () => {
    const series = bufferWith({ 'gpu0.util': 87.2, 'gpu0.mem_used': 41 * GiB });
    const live = statusSummary(gpuDevices(1), series, { kind: 'live' }, T0);
    expect(live).toEqual({
      text: 'GPU0 87% · 41/80 GB',
      title: 'GPU0 NVIDIA H200: kernel running (nvidia-smi) 87% · 41/80 GB',
      stale: false,
      warning: null
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
    expect(summary.title).toContain('no GPU found');
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

describe('SM activity and MIG', () => {
  const hopper = { ...gpuDevices().devices[0], gpm: true };
  const instance = {
    ...hopper,
    id: 'gpu2',
    index: 2,
    driver_index: 0,
    uuid: 'MIG-2',
    name: 'NVIDIA H100 80GB HBM3 MIG 2g.20gb',
    memory_total: 20 * GiB,
    is_mig: true,
    gpu_instance_id: 5,
    mig_profile: '2g.20gb'
  };

  it('draws SM active as the busy line with kernel running beside it where GPM is read', () => {
    const [activity] = gpuCharts(hopper, ['utilization'], () => null);
    expect(activity.title).toBe('SM active');
    expect(activity.lines.map(line => [line.column, line.label])).toEqual([
      ['gpu0.sm_active', 'SM active'],
      ['gpu0.util', 'kernel running']
    ]);
    const series = bufferWith({ 'gpu0.sm_active': 6, 'gpu0.util': 92 });
    expect(activity.readout(c => series.latest(c))).toBe('6% · kernel 92%');
  });

  it('labels NVML utilisation "kernel running" without GPM', () => {
    const [utilization] = gpuCharts(
      gpuDevices().devices[0],
      ['utilization'],
      () => null
    );
    expect(utilization.lines.map(line => line.label)).toEqual([
      'kernel running'
    ]);
  });

  it('names a MIG instance by its GPU and instance id and draws no utilisation line for it', () => {
    expect(deviceLabel(instance)).toBe('GPU0/GI5');
    expect(deviceLabel({ ...hopper, driver_index: 1, index: 3 })).toBe('GPU1');
    const [activity] = gpuCharts(instance, ['utilization'], () => null);
    expect(activity.lines.map(line => line.column)).toEqual(['gpu2.sm_active']);
    const series = bufferWith({
      'gpu2.sm_active': 20,
      'gpu2.mem_used': 2 * GiB
    });
    expect(activity.readout(c => series.latest(c))).toBe('20%');
  });

  it('shows SM activity in the status bar and both figures in its tooltip', () => {
    const devices = { ...gpuDevices(), devices: [hopper, instance] };
    const series = bufferWith({
      'gpu0.sm_active': 6,
      'gpu0.util': 92,
      'gpu0.mem_used': 41 * GiB,
      'gpu2.sm_active': 20,
      'gpu2.mem_used': 2 * GiB
    });
    const summary = statusSummary(devices, series, { kind: 'live' }, T0);
    expect(summary.text).toBe('GPU0 SM 6% · 41/80 GB +1');
    expect(summary.title.split('\n')).toEqual([
      'GPU0 NVIDIA H200: SM active 6% · kernel running 92% · 41/80 GB',
      'GPU0/GI5 NVIDIA H100 80GB HBM3 MIG 2g.20gb: SM active 20% · 2/20 GB'
    ]);
  });
});

describe('overview rows', () => {
  it('bar the busy figure: SM active where GPM is read, both figures in words', () => {
    const hopper = { ...gpuDevices().devices[0], gpm: true };
    const plain = { ...gpuDevices(2).devices[1] };
    const series = bufferWith({
      'gpu0.sm_active': 6,
      'gpu0.util': 92,
      'gpu1.util': 40
    });
    const rows = overviewRows([hopper, plain], c => series.latest(c), {}, true);
    expect(rows.map(row => [row.label, row.util, row.utilTitle])).toEqual([
      ['GPU0', 6, 'SM active 6% · kernel running 92%'],
      ['GPU1', 40, 'kernel running (nvidia-smi) 40%']
    ]);
  });
});
