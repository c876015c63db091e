/**
 * The cluster section's figures, from `GET /cluster`: per-GPU statistics over the window,
 * which GPUs were idle, and the heat strip's colour scale. Pure; clusterview.ts draws.
 */

import { formatPercent } from './format';
import { IClusterGpu, IClusterReply, Reading } from './protocol';

/**
 * A GPU whose utilisation never reached this over the window was idle: no job kept it
 * busy even for one Prometheus step (nvtop and Grafana's dcgm dashboard read a GPU under
 * a few percent as doing nothing).
 */
export const IDLE_MAX_UTIL = 0.05;

/**
 * Viridis at eleven stops (matplotlib's): perceptually even, readable by people with the
 * common colour-vision deficiencies, and light enough at the top to stand out on the
 * dark theme as on the light one.
 */
export const HEAT_STOPS: [number, number, number][] = [
  [68, 1, 84],
  [72, 36, 117],
  [65, 68, 135],
  [53, 95, 141],
  [42, 120, 142],
  [33, 145, 140],
  [34, 168, 132],
  [68, 191, 112],
  [122, 209, 81],
  [189, 223, 38],
  [253, 231, 37]
];

/** The colour of a utilisation 0..1 (clamped), interpolated between the stops. */
export function heatColor(util: number): [number, number, number] {
  const x = Math.max(0, Math.min(1, util)) * (HEAT_STOPS.length - 1);
  const low = Math.floor(x);
  const high = Math.min(HEAT_STOPS.length - 1, low + 1);
  const f = x - low;
  const a = HEAT_STOPS[low];
  const b = HEAT_STOPS[high];
  return [
    Math.round(a[0] + (b[0] - a[0]) * f),
    Math.round(a[1] + (b[1] - a[1]) * f),
    Math.round(a[2] + (b[2] - a[2]) * f)
  ];
}

/** The legend's CSS gradient, from the same stops. */
export function heatGradientCss(): string {
  const stops = HEAT_STOPS.map(
    ([r, g, b], i) =>
      `rgb(${r}, ${g}, ${b}) ${Math.round((100 * i) / (HEAT_STOPS.length - 1))}%`
  );
  return `linear-gradient(to right, ${stops.join(', ')})`;
}

export interface IGpuStats {
  /** Mean utilisation 0..1 over the readings, null without any. */
  mean: number | null;
  peak: number | null;
  readings: number;
}

export function gpuStats(util: Reading[]): IGpuStats {
  let sum = 0;
  let peak = -Infinity;
  let readings = 0;
  for (const value of util) {
    if (typeof value === 'number' && Number.isFinite(value)) {
      sum += value;
      peak = Math.max(peak, value);
      readings += 1;
    }
  }
  return readings
    ? { mean: sum / readings, peak, readings }
    : { mean: null, peak: null, readings: 0 };
}

/** "GPU 3" for dcgm-exporter's `gpu="3"`; other names as they are. */
export function clusterGpuLabel(gpu: string): string {
  return /^\d+$/.test(gpu) ? `GPU ${gpu}` : gpu;
}

/** "the last hour", "the last 15 min". */
export function windowText(seconds: number): string {
  if (Math.abs(seconds - 3600) < 60) {
    return 'the last hour';
  }
  if (seconds >= 5400) {
    return `the last ${Math.round(seconds / 3600)} h`;
  }
  return `the last ${Math.max(1, Math.round(seconds / 60))} min`;
}

export interface IClusterGpuRow {
  host: string;
  gpu: IClusterGpu;
  label: string;
  stats: IGpuStats;
  idle: boolean;
}

export interface IClusterSummary {
  rows: IClusterGpuRow[];
  hosts: number;
  idle: IClusterGpuRow[];
  noData: IClusterGpuRow[];
  window: string;
  /** "5 of 16 GPUs idle over the last hour: host-a GPU 3, ..." or "No GPU idle ...". */
  idleText: string;
}

/** At most this many idle GPUs are named in the sentence; the strip shows the rest. */
export const IDLE_NAMED_MAX = 12;

export function clusterSummary(reply: IClusterReply): IClusterSummary {
  const rows: IClusterGpuRow[] = [];
  for (const host of reply.hosts) {
    for (const gpu of host.gpus) {
      const stats = gpuStats(gpu.util);
      rows.push({
        host: host.host,
        gpu,
        label: clusterGpuLabel(gpu.gpu),
        stats,
        idle: stats.peak !== null && stats.peak < IDLE_MAX_UTIL
      });
    }
  }
  const idle = rows.filter(row => row.idle);
  const noData = rows.filter(row => row.stats.readings === 0);
  const window = windowText(reply.end - reply.start);
  let idleText: string;
  if (rows.length === 0) {
    idleText = 'No GPU matched in Prometheus.';
  } else if (idle.length === 0) {
    idleText = `No GPU idle over ${window} (of ${rows.length}).`;
  } else {
    const named = idle
      .slice(0, IDLE_NAMED_MAX)
      .map(row => `${row.host} ${row.label}`);
    const rest =
      idle.length > IDLE_NAMED_MAX
        ? `, and ${idle.length - IDLE_NAMED_MAX} more`
        : '';
    idleText =
      `${idle.length} of ${rows.length} GPUs idle over ${window}: ` +
      `${named.join(', ')}${rest}.`;
  }
  return {
    rows,
    hosts: reply.hosts.length,
    idle,
    noData,
    window,
    idleText
  };
}

/** The strip's text alternative for one GPU: "host-a GPU 3: mean 45%, peak 98%, idle". */
export function rowDescription(row: IClusterGpuRow, window: string): string {
  const { mean, peak } = row.stats;
  const name = `${row.host} ${row.label}`;
  if (mean === null || peak === null) {
    return `${name}: no utilisation readings over ${window}`;
  }
  const idle = row.idle ? ', idle' : '';
  const holder = row.gpu.holder ? `, held by ${row.gpu.holder}` : '';
  return (
    `${name} utilisation over ${window}: mean ${formatPercent(100 * mean)}, ` +
    `peak ${formatPercent(100 * peak)}${idle}${holder}`
  );
}
