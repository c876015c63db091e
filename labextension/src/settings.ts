/** The user's settings (schema/plugin.json), read defensively. */

import { GPU_METRICS, GpuMetric } from './metrics';

export interface ISidebarSettings {
  /** Seconds between samples while the sidebar is open. */
  interval: number;
  /** GPU charts, in order. */
  metrics: GpuMetric[];
}

export const DEFAULT_SETTINGS: ISidebarSettings = {
  interval: 1,
  metrics: GPU_METRICS
};

/** The schema's bounds, again: a hand-edited settings file can hold anything. */
const MIN_INTERVAL = 0.5;
const MAX_INTERVAL = 60;

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
  return { interval, metrics };
}
