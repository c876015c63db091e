/** The user's settings (schema/plugin.json), read defensively. */

import { GPU_METRICS, GpuMetric } from './metrics';

export interface ISidebarSettings {
  /** Seconds between samples while the sidebar is open. */
  interval: number;
  /** GPU charts, in order. */
  metrics: GpuMetric[];
  /** Seconds between the status bar's asks while the sidebar is closed; 0: never. */
  statusInterval: number;
}

export const DEFAULT_SETTINGS: ISidebarSettings = {
  interval: 1,
  metrics: GPU_METRICS,
  statusInterval: 5
};

/** The schema's bounds, again: a hand-edited settings file can hold anything. */
const MIN_INTERVAL = 0.5;
const MAX_INTERVAL = 60;
const MIN_STATUS_INTERVAL = 1;
const MAX_STATUS_INTERVAL = 300;

export function readSettings(
  composite: Record<string, unknown>
): ISidebarSettings {
  const interval =
    typeof composite.interval === 'number' &&
    Number.isFinite(composite.interval)
      ? Math.min(MAX_INTERVAL, Math.max(MIN_INTERVAL, composite.interval))
      : DEFAULT_SETTINGS.interval;
  const metrics = Array.isArray(composite.metrics)
    ? composite.metrics.filter(
        (metric, index, all): metric is GpuMetric =>
          (GPU_METRICS as unknown[]).includes(metric) &&
          all.indexOf(metric) === index
      )
    : DEFAULT_SETTINGS.metrics;
  const status = composite.statusInterval;
  const statusInterval =
    typeof status === 'number' && Number.isFinite(status)
      ? status <= 0
        ? 0
        : Math.min(MAX_STATUS_INTERVAL, Math.max(MIN_STATUS_INTERVAL, status))
      : DEFAULT_SETTINGS.statusInterval;
  return { interval, metrics, statusInterval };
}
