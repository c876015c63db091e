/**
 * The server's messages as types, and the one place that checks their shape.
 *
 * Mirrors docs/server-api.md: times are Unix epoch seconds, metric names and units
 * are the Trace's (`gpu0.util` percent, `gpu0.mem_used` bytes, `cpu.util` percent...),
 * a metric a device cannot report is absent, and `null` means "no reading then".
 */

/**
 * Seconds of history the server keeps by default (`GpuWidget.history_s`,
 * docs/server-api.md). Each server says its own in the devices reply's `history_s`;
 * this is the length assumed until then.
 */
export const DEFAULT_HISTORY_S = 3600;

/**
 * The metrics of the stream's history (docs/server-api.md): a GPU's by the suffix of its
 * column (`gpu0.util`), the host's by name. These are what the sidebar's charts draw
 * (metrics.ts), and the server sends the hour of these only; samples carry every metric.
 * The server's list is `STREAM_HISTORY_METRICS` in gpuwidget/server/monitor.py (a test
 * holds the two equal).
 */
export const HISTORY_METRICS = [
  'util',
  'sm_active',
  'mem_used',
  'power',
  'temperature',
  'pcie_tx',
  'pcie_rx',
  'cpu.util',
  'mem.used'
];

/**
 * The most rows a stream history has (the server's `STREAM_HISTORY_POINTS`): the older
 * rows reduced to each bucket's minimum and maximum, the newest minute as sampled.
 */
export const HISTORY_POINTS = 800;

/** True when the stream's history carries column `name` (`gpu3.power`, `cpu.util`). */
export function inHistory(name: string): boolean {
  const suffix = name.slice(name.lastIndexOf('.') + 1);
  return (
    HISTORY_METRICS.includes(name) ||
    (name.startsWith('gpu') && HISTORY_METRICS.includes(suffix))
  );
}

/** One GPU (or MIG instance) as `GET /devices` describes it. */
export interface IDeviceInfo {
  /** Metric prefix: `gpu0` for `gpu0.util`. */
  id: string;
  index: number;
  uuid: string;
  name: string;
  memory_total?: number | null;
  power_limit?: number | null;
  is_mig?: boolean;
  parent_uuid?: string | null;
  pci_bus_id?: string | null;
  /** "nvidia" or "amd". */
  vendor?: string;
  /** The driver's (nvidia-smi's, amd-smi's) number of the GPU; a MIG instance's is its GPU's. */
  driver_index?: number | null;
  /** A GPU in MIG mode: its instances follow it in the list. */
  mig_mode?: boolean;
  /** A MIG instance's GPU instance id and profile (dcgm-exporter's GPU_I_ID, GPU_I_PROFILE). */
  gpu_instance_id?: number | null;
  mig_profile?: string | null;
  /** An AMD GPU's compute and memory partition modes ("SPX", "NPS1"), a partition's number on its GPU. */
  compute_partition?: string | null;
  memory_partition?: string | null;
  partition_id?: number | null;
  /** The board's serial number (AMD's device-metrics exporter labels series with it). */
  serial?: string | null;
  /** SM activity is read (GPM: Hopper and newer): the busy figure is `sm_active`, not `util`. */
  gpm?: boolean;
  /**
   * The server runs in a PID namespace of its own (a container without the host's): the driver
   * lists no process of the host's, so a GPU in use may show none.
   */
  foreign_pid_namespace?: boolean;
}

export interface IHostInfo {
  cpu_count: number;
  mem_total: number;
}

/** The body of `GET /devices`, and the `devices` of the `hello` message. */
export interface IDevicesReply {
  gpu_found: boolean;
  /** Why no GPU is shown ("no GPU found (...)"), or null. */
  message: string | null;
  devices: IDeviceInfo[];
  host: IHostInfo;
  /** The shared sampler's period, seconds. */
  interval: number;
  /** How much history the server keeps, seconds (DEFAULT_HISTORY_S unless configured). */
  history_s: number;
  /**
   * True when the server reads a cluster from Prometheus (`GpuWidget.prometheus_url`):
   * only then does the sidebar ask `GET /cluster`. Absent from older servers (false).
   */
  cluster?: boolean;
}

/** A source the sampler is waiting on: "GPU 1" stopped answering `since_s` seconds ago. */
export interface IStalledSource {
  source: string;
  since_s: number;
  /** When it stopped answering (absent from older servers). */
  at?: number;
  /** The devices whose readings stopped with it (absent from older servers). */
  devices?: string[];
}

/**
 * A device whose readings stopped (its source stopped answering): its last values, read at
 * `t` and `age_s` seconds old when the message was sent (both null when it never answered).
 * `hung`: this device stopped answering; false when it stopped with a source that read it too.
 */
export interface IStaleDevice {
  source: string;
  hung: boolean;
  t: number | null;
  age_s: number | null;
  values: Record<string, Reading>;
}

export type StaleDevices = Record<string, IStaleDevice>;

/** A process holding memory on a GPU; other users' processes carry only `user` and `memory`. */
export interface IProcessInfo {
  pid: number | null;
  memory: number | null;
  user: string;
  name: string | null;
  kernel_id: string | null;
  /** Server-relative path of the notebook whose kernel owns the process. */
  notebook: string | null;
}

export type Reading = number | null;
export type Columns = Record<string, Reading[]>;

export interface IHelloMessage {
  type: 'hello';
  devices: IDevicesReply;
  /** Sources not answering now; absent from older servers (none). */
  stalled?: IStalledSource[];
  /** Devices whose readings stopped, by id; absent from older servers (none). */
  stale?: StaleDevices;
}

/**
 * What the charts draw of the server's history: the HISTORY_METRICS columns, at most
 * HISTORY_POINTS rows (times ascending, ending at the newest sample), 3 significant
 * digits of each column's largest value. The samples that follow continue it.
 */
export interface IHistoryMessage {
  type: 'history';
  t: number[];
  columns: Columns;
}

export interface ISampleMessage {
  type: 'sample';
  t: number;
  values: Record<string, Reading>;
  /** Sources not answering now; absent from older servers (none). */
  stalled?: IStalledSource[];
  /** Devices whose readings stopped, by id; absent from older servers (none). */
  stale?: StaleDevices;
}

export interface IProcessesMessage {
  type: 'processes';
  /** null before the first scan of the GPUs' processes. */
  t: number | null;
  gpus: Record<string, IProcessInfo[]>;
}

export type ServerMessage =
  IHelloMessage | IHistoryMessage | ISampleMessage | IProcessesMessage;

/** The newest row of the server's readings (`t` null before the first one). */
export interface ILatest {
  t: number | null;
  values: Record<string, Reading>;
}

/** Every column over the snapshot's window, reduced for plotting (the status bar does not read it). */
export interface IHistory {
  t: number[];
  columns: Columns;
}

/** The body of `GET /snapshot?window=S`: what the status bar polls while the sidebar is closed. */
export interface ISnapshotReply {
  devices: IDevicesReply;
  latest: ILatest;
  processes: IProcessesMessage | null;
  stalled: IStalledSource[];
  stale: StaleDevices;
  history?: IHistory;
}

/** One GPU of the cluster as `GET /cluster` describes it (values aligned with the reply's times). */
export interface IClusterGpu {
  gpu: string;
  uuid: string | null;
  model: string | null;
  /** Who holds it (a user, notebook or job), where the server knows. */
  holder: string | null;
  /** Utilisation 0..1 per step; null where Prometheus has no sample. */
  util: Reading[];
  memory_used_bytes: Reading[];
  memory_total_bytes: number | null;
  power_w: Reading[];
}

export interface IClusterHost {
  host: string;
  gpus: IClusterGpu[];
}

/** The body of `GET /cluster?window_s=S`. */
export interface IClusterReply {
  configured: boolean;
  /** Whose series were read: gpuwidget's own, or dcgm-exporter's. */
  source: 'gpuwidget' | 'dcgm' | null;
  /** Why there is no data (e.g. Prometheus did not answer), or null. */
  error: string | null;
  step_s: number;
  start: number;
  end: number;
  selector: string | null;
  hosts: IClusterHost[];
}

function isObject(value: unknown): value is Record<string, unknown> {
  return typeof value === 'object' && value !== null && !Array.isArray(value);
}

function isNumber(value: unknown): value is number {
  return typeof value === 'number' && Number.isFinite(value);
}

function numberOrNull(value: unknown): number | null {
  return isNumber(value) ? value : null;
}

function stringOrNull(value: unknown): string | null {
  return typeof value === 'string' ? value : null;
}

/**
 * The `stalled` field of a message, read defensively: anything but a list of
 * `{source, since_s}` entries (or no field at all) means nothing is stalled.
 */
export function parseStalled(value: unknown): IStalledSource[] {
  if (!Array.isArray(value)) {
    return [];
  }
  return value
    .filter(
      (entry): entry is Record<string, unknown> =>
        isObject(entry) &&
        typeof entry.source === 'string' &&
        isNumber(entry.since_s)
    )
    .map(entry => ({
      source: entry.source as string,
      since_s: Math.max(0, entry.since_s as number),
      devices: Array.isArray(entry.devices)
        ? entry.devices.filter(
            (device): device is string => typeof device === 'string'
          )
        : []
    }));
}

/**
 * The `stale` field of a message, read defensively: entries of the wrong shape are left
 * out, and no field at all means no device is stale.
 */
export function parseStale(value: unknown): StaleDevices {
  const stale: StaleDevices = {};
  if (!isObject(value)) {
    return stale;
  }
  for (const [device, entry] of Object.entries(value)) {
    if (!isObject(entry) || typeof entry.source !== 'string') {
      continue;
    }
    const values: Record<string, Reading> = {};
    if (isObject(entry.values)) {
      for (const [name, reading] of Object.entries(entry.values)) {
        values[name] = numberOrNull(reading);
      }
    }
    const age = numberOrNull(entry.age_s);
    stale[device] = {
      source: entry.source,
      hung: entry.hung !== false,
      t: numberOrNull(entry.t),
      age_s: age === null ? null : Math.max(0, age),
      values
    };
  }
  return stale;
}

/** True when `value` has the fields the sidebar relies on in a devices reply. */
export function isDevicesReply(value: unknown): value is IDevicesReply {
  return (
    isObject(value) &&
    typeof value.gpu_found === 'boolean' &&
    Array.isArray(value.devices) &&
    value.devices.every(
      device => isObject(device) && typeof device.id === 'string'
    ) &&
    isObject(value.host) &&
    isNumber(value.interval) &&
    isNumber(value.history_s)
  );
}

/** Finite times in ascending order: rows a ring buffer can take as they come. */
function isTimes(value: unknown): value is number[] {
  return (
    Array.isArray(value) &&
    value.every(
      (time, index) =>
        isNumber(time) && (index === 0 || time > (value[index - 1] as number))
    )
  );
}

function isColumns(value: unknown, length: number): value is Columns {
  return (
    isObject(value) &&
    Object.values(value).every(
      column => Array.isArray(column) && column.length === length
    )
  );
}

/**
 * Parse one websocket text frame; null for anything malformed or of an unknown type
 * (a newer server may add types: they are ignored, not fatal).
 */
export function parseMessage(text: string): ServerMessage | null {
  let value: unknown;
  try {
    value = JSON.parse(text);
  } catch {
    return null;
  }
  if (!isObject(value)) {
    return null;
  }
  switch (value.type) {
    case 'hello':
      return isDevicesReply(value.devices)
        ? ({
            ...value,
            stalled: parseStalled(value.stalled),
            stale: parseStale(value.stale)
          } as unknown as IHelloMessage)
        : null;
    case 'history':
      return isTimes(value.t) && isColumns(value.columns, value.t.length)
        ? (value as unknown as IHistoryMessage)
        : null;
    case 'sample':
      return isNumber(value.t) && isObject(value.values)
        ? ({
            ...value,
            stalled: parseStalled(value.stalled),
            stale: parseStale(value.stale)
          } as unknown as ISampleMessage)
        : null;
    case 'processes':
      return isObject(value.gpus) &&
        Object.values(value.gpus).every(list => Array.isArray(list))
        ? (value as unknown as IProcessesMessage)
        : null;
    default:
      return null;
  }
}

function readingList(value: unknown): Reading[] {
  return Array.isArray(value) ? value.map(numberOrNull) : [];
}

/** A snapshot reply, or null when it lacks what the status bar needs. */
export function parseSnapshot(value: unknown): ISnapshotReply | null {
  if (!isObject(value) || !isDevicesReply(value.devices)) {
    return null;
  }
  const latest = isObject(value.latest) ? value.latest : {};
  const values = isObject(latest.values)
    ? (latest.values as Record<string, Reading>)
    : {};
  const processes = isObject(value.processes)
    ? parseMessage(JSON.stringify({ ...value.processes, type: 'processes' }))
    : null;
  return {
    devices: value.devices,
    latest: { t: numberOrNull(latest.t), values },
    processes: processes?.type === 'processes' ? processes : null,
    stalled: parseStalled(value.stalled),
    stale: parseStale(value.stale)
  };
}

/**
 * A cluster reply with every field checked; entries of the wrong shape are dropped, so
 * a partial answer still draws. Null when it is not a cluster reply at all.
 */
export function parseClusterReply(value: unknown): IClusterReply | null {
  if (!isObject(value) || typeof value.configured !== 'boolean') {
    return null;
  }
  const source =
    value.source === 'gpuwidget' || value.source === 'dcgm'
      ? value.source
      : null;
  const hosts: IClusterHost[] = [];
  for (const host of Array.isArray(value.hosts) ? value.hosts : []) {
    if (!isObject(host) || typeof host.host !== 'string') {
      continue;
    }
    const gpus: IClusterGpu[] = [];
    for (const gpu of Array.isArray(host.gpus) ? host.gpus : []) {
      if (!isObject(gpu) || typeof gpu.gpu !== 'string') {
        continue;
      }
      gpus.push({
        gpu: gpu.gpu,
        uuid: stringOrNull(gpu.uuid),
        model: stringOrNull(gpu.model),
        holder: stringOrNull(gpu.holder),
        util: readingList(gpu.util),
        memory_used_bytes: readingList(gpu.memory_used_bytes),
        memory_total_bytes: numberOrNull(gpu.memory_total_bytes),
        power_w: readingList(gpu.power_w)
      });
    }
    hosts.push({ host: host.host, gpus });
  }
  return {
    configured: value.configured,
    source,
    error: stringOrNull(value.error),
    step_s: isNumber(value.step_s) && value.step_s > 0 ? value.step_s : 15,
    start: numberOrNull(value.start) ?? 0,
    end: numberOrNull(value.end) ?? 0,
    selector: stringOrNull(value.selector),
    hosts
  };
}
