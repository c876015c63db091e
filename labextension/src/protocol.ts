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
}

export interface IHostInfo {
  cpu_count: number;
  mem_total: number;
}

/** The body of `GET /devices`, and the `devices` of the `hello` message. */
export interface IDevicesReply {
  gpu_found: boolean;
  /** Why no GPU is shown ("no NVIDIA GPU found (...)"), or null. */
  message: string | null;
  devices: IDeviceInfo[];
  host: IHostInfo;
  /** The shared sampler's period, seconds. */
  interval: number;
  /** How much history the server keeps, seconds (DEFAULT_HISTORY_S unless configured). */
  history_s: number;
}

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
}

export interface IHistoryMessage {
  type: 'history';
  t: number[];
  columns: Columns;
}

export interface ISampleMessage {
  type: 'sample';
  t: number;
  values: Record<string, Reading>;
}

export interface IProcessesMessage {
  type: 'processes';
  /** null before the first scan of the GPUs' processes. */
  t: number | null;
  gpus: Record<string, IProcessInfo[]>;
}

export type ServerMessage =
  IHelloMessage | IHistoryMessage | ISampleMessage | IProcessesMessage;

function isObject(value: unknown): value is Record<string, unknown> {
  return typeof value === 'object' && value !== null && !Array.isArray(value);
}

function isNumber(value: unknown): value is number {
  return typeof value === 'number' && Number.isFinite(value);
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
        ? (value as unknown as IHelloMessage)
        : null;
    case 'history':
      return Array.isArray(value.t) && isColumns(value.columns, value.t.length)
        ? (value as unknown as IHistoryMessage)
        : null;
    case 'sample':
      return isNumber(value.t) && isObject(value.values)
        ? (value as unknown as ISampleMessage)
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
