import {
  NO_VALUE,
  baseName,
  formatAge,
  formatBytes,
  formatBytesOf,
  formatBytesTick,
  formatCelsius,
  formatClock,
  formatPercent,
  formatRate,
  formatWattsOf,
  noGpuDetail
} from '../src/format';

const GiB = 1024 ** 3;

describe('format', () => {
  it('shows memory used of total in the unit of the total, as the status bar reads it', () => {
    expect(formatBytesOf(41 * GiB, 80 * GiB)).toBe('41/80 GB');
    expect(formatBytesOf(0.5 * GiB, 80 * GiB)).toBe('0.5/80 GB');
    expect(formatBytesOf(null, 80 * GiB)).toBe(`${NO_VALUE}/80 GB`);
    expect(formatBytesOf(3 * GiB, null)).toBe('3 GB');
  });

  it('uses one decimal only below ten', () => {
    expect(formatBytes(7.25 * GiB)).toBe('7.3 GB');
    expect(formatBytes(512 * 1024 ** 2)).toBe('512 MB');
    expect(formatBytes(1536)).toBe('1.5 KB');
    expect(formatBytes(0)).toBe('0 B');
    expect(formatBytesTick(80 * GiB)).toBe('80G');
  });

  it('shows a dash, never NaN or 0, for a missing reading', () => {
    for (const missing of [null, undefined, NaN, Infinity]) {
      expect(formatPercent(missing)).toBe(NO_VALUE);
      expect(formatBytes(missing)).toBe(NO_VALUE);
      expect(formatRate(missing)).toBe(NO_VALUE);
      expect(formatCelsius(missing)).toBe(NO_VALUE);
    }
  });

  it('rounds percent, watts and degrees to whole numbers', () => {
    expect(formatPercent(87.4)).toBe('87%');
    expect(formatWattsOf(250.6, 700)).toBe('251/700 W');
    expect(formatWattsOf(250.6, null)).toBe('251 W');
    expect(formatCelsius(64.5)).toBe('65 °C');
    expect(formatRate(1.2 * GiB)).toBe('1.2 GB/s');
  });

  it('says how old a value is, coarsely', () => {
    expect(formatAge(0.5)).toBe('just now');
    expect(formatAge(40)).toBe('40 s ago');
    expect(formatAge(300)).toBe('5 min ago');
    expect(formatAge(7200)).toBe('2 h ago');
  });

  it('labels the time axis with a clock time, no date', () => {
    expect(formatClock(1764490000)).toMatch(
      /^\d{1,2}:\d{2}( ?[AaPp]\.? ?[Mm]\.?)?$/
    );
  });

  it('names a notebook by its file name', () => {
    expect(baseName('experiments/train.ipynb')).toBe('train.ipynb');
    expect(baseName('train.ipynb')).toBe('train.ipynb');
  });

  it("keeps the server's reason for no GPU without repeating the headline", () => {
    expect(
      noGpuDetail('no NVIDIA GPU found (NVML Shared Library Not Found)')
    ).toBe('NVML Shared Library Not Found');
    expect(noGpuDetail('No NVIDIA GPU found: driver not loaded')).toBe(
      'driver not loaded'
    );
    expect(noGpuDetail('no NVIDIA GPU found')).toBe('');
    expect(
      noGpuDetail('no GPU found (the NVIDIA driver is not loaded; no AMD GPU driver)')
    ).toBe('the NVIDIA driver is not loaded; no AMD GPU driver');
    expect(noGpuDetail('no GPU found')).toBe('');
    expect(noGpuDetail('NVML failed to start')).toBe('NVML failed to start');
    expect(noGpuDetail(null)).toBe('');
  });
});
