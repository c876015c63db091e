/** Server messages as docs/server-api.md shows them, for the tests. */

import {
  DEFAULT_HISTORY_S,
  IClusterReply,
  IDevicesReply,
  Reading,
  ServerMessage
} from '../src/protocol';

export const GiB = 1024 ** 3;

export function gpuDevices(count = 1, interval = 1): IDevicesReply {
  return {
    gpu_found: true,
    message: null,
    devices: Array.from({ length: count }, (_, index) => ({
      id: `gpu${index}`,
      index,
      uuid: `GPU-${index}`,
      name: 'NVIDIA H200',
      memory_total: 80 * GiB,
      power_limit: 700,
      is_mig: false,
      parent_uuid: null,
      pci_bus_id: `00000000:1${index}:00.0`
    })),
    host: { cpu_count: 16, mem_total: 128 * GiB },
    interval,
    history_s: DEFAULT_HISTORY_S
  };
}

export function noGpuDevices(): IDevicesReply {
  return {
    gpu_found: false,
    message: 'no GPU found (no NVIDIA or AMD GPU driver)',
    devices: [],
    host: { cpu_count: 2, mem_total: 8 * GiB },
    interval: 1,
    history_s: DEFAULT_HISTORY_S
  };
}

export const T0 = 1764490000;

export function hello(devices: IDevicesReply = gpuDevices()): ServerMessage {
  return { type: 'hello', devices };
}

export function history(points: number, start = T0): ServerMessage {
  const t = Array.from({ length: points }, (_, i) => start + i);
  return {
    type: 'history',
    t,
    columns: {
      'gpu0.util': t.map((_, i) => i % 100),
      'gpu0.mem_used': t.map(() => 41 * GiB),
      'cpu.util': t.map((_, i) => (i % 2 ? null : 40))
    }
  };
}

export function sample(
  t: number,
  values: Record<string, number | null>
): ServerMessage {
  return { type: 'sample', t, values };
}

/**
 * A cluster reply as the server's contract gives it: `hosts` x `gpus` GPUs over an hour
 * at 15 s steps (240 points); `util(host, gpu, step)` gives each value.
 */
export function clusterReply(
  hosts = 2,
  gpus = 2,
  util: (host: number, gpu: number, step: number) => Reading = (h, g, k) =>
    ((h + g + k) % 10) / 10,
  points = 240
): IClusterReply {
  const step = 15;
  return {
    configured: true,
    source: 'gpuwidget',
    error: null,
    step_s: step,
    start: T0 - points * step,
    end: T0,
    selector: null,
    hosts: Array.from({ length: hosts }, (_, h) => ({
      host: `host-${String.fromCharCode(97 + h)}`,
      gpus: Array.from({ length: gpus }, (_, g) => ({
        gpu: String(g),
        uuid: `GPU-${h}-${g}`,
        model: 'NVIDIA H100 80GB HBM3',
        holder: g === 0 ? `user${h}` : null,
        util: Array.from({ length: points }, (_, k) => util(h, g, k)),
        memory_used_bytes: Array.from({ length: points }, () => 20 * GiB),
        memory_total_bytes: 80 * GiB,
        power_w: Array.from({ length: points }, () => 250)
      }))
    }))
  };
}
