/**
 * The sidebar's state: the devices, the server's history of every metric in a ring
 * buffer, the processes, and the connection; fed by server messages, read by the views.
 *
 * Pure (no DOM, no JupyterLab): the views connect to its `changed` signal (Lumino's)
 * and redraw.
 */

import { ISignal, Signal } from '@lumino/signaling';

import {
  Columns,
  DEFAULT_HISTORY_S,
  HISTORY_POINTS,
  IClusterReply,
  IDevicesReply,
  IProcessInfo,
  ISnapshotReply,
  IStaleDevice,
  IStalledSource,
  Reading,
  ServerMessage,
  StaleDevices
} from './protocol';

/** More points than this per series buys nothing on a sidebar a few hundred pixels wide. */
export const MAX_POINTS = 7200;

/**
 * The interval the server will actually send at: the requested one rounded up to a
 * whole multiple of the server's sampling period (docs/server-api.md), never below it.
 */
export function effectiveInterval(
  requested: number,
  serverInterval: number
): number {
  if (!(serverInterval > 0)) {
    return requested > 0 ? requested : 1;
  }
  if (!(requested > serverInterval)) {
    return serverInterval;
  }
  // The small tolerance keeps 1.0 / 0.1 from becoming 11 multiples.
  return Math.ceil(requested / serverInterval - 1e-9) * serverInterval;
}

/**
 * Ring capacity: the server's history (at most HISTORY_POINTS rows, however long it
 * spans) and then `historyS` seconds of samples at `interval`, plus one for the boundary.
 * Samples push the history's rows out only once they span the charts' time themselves.
 */
export function historyCapacity(historyS: number, interval: number): number {
  const points = Math.ceil(historyS / interval) + 1;
  return HISTORY_POINTS + Math.max(2, Math.min(MAX_POINTS, points));
}

/** How many of the newest rows `latest()` looks through for a reading. */
export const LATEST_LOOKBACK = 3;

/** The charts never span less than this, so the first few samples are not stretched across them. */
export const MIN_SPAN_S = 60;

/**
 * The time span the charts show: the last `historyS` seconds, or less while the
 * history is shorter (never less than `MIN_SPAN_S`), ending at the newest row.
 */
export function visibleRange(
  first: number | null,
  last: number | null,
  historyS: number
): [number, number] {
  const end = last ?? Date.now() / 1000;
  const start = Math.max(first ?? end, end - historyS);
  return [Math.min(start, end - MIN_SPAN_S), end];
}

/** Time axis plus one column per requested metric, oldest first; `null` where there is no reading. */
export type AlignedSeries = [number[], ...Reading[][]];

/**
 * Timestamped readings of many metrics in fixed memory: the newest `capacity` rows.
 * Each metric's column is allocated when it first appears; a row without a reading
 * for it holds NaN internally and reads back as `null`.
 */
export class SeriesBuffer {
  readonly capacity: number;
  private _times: Float64Array;
  private _columns = new Map<string, Float64Array>();
  private _seen = new Set<string>();
  private _start = 0;
  private _length = 0;

  constructor(capacity: number) {
    this.capacity = Math.max(1, Math.floor(capacity));
    this._times = new Float64Array(this.capacity);
  }

  get length(): number {
    return this._length;
  }

  clear(): void {
    this._columns.clear();
    this._seen.clear();
    this._start = 0;
    this._length = 0;
  }

  /** Append one row; when full, the oldest row is dropped. */
  push(t: number, values: Record<string, Reading | undefined>): void {
    let slot: number;
    if (this._length < this.capacity) {
      slot = (this._start + this._length) % this.capacity;
      this._length += 1;
    } else {
      slot = this._start;
      this._start = (this._start + 1) % this.capacity;
    }
    this._times[slot] = t;
    for (const column of this._columns.values()) {
      column[slot] = NaN;
    }
    for (const name of Object.keys(values)) {
      const value = values[name];
      if (typeof value !== 'number' || !Number.isFinite(value)) {
        continue;
      }
      this._column(name)[slot] = value;
      this._seen.add(name);
    }
  }

  /** Replace the contents with a history reply (its newest `capacity` rows). */
  load(t: number[], columns: Columns): void {
    this.clear();
    const names = Object.keys(columns);
    const first = Math.max(0, t.length - this.capacity);
    const row: Record<string, Reading> = {};
    for (let i = first; i < t.length; i++) {
      for (const name of names) {
        row[name] = columns[name][i];
      }
      this.push(t[i], row);
    }
  }

  /** True once the metric has had at least one reading. */
  has(name: string): boolean {
    return this._seen.has(name);
  }

  /** Names of every metric that has had a reading. */
  names(): string[] {
    return [...this._seen];
  }

  /** Time of the newest row, or null when empty. */
  lastTime(): number | null {
    return this._length ? this._times[this._slot(this._length - 1)] : null;
  }

  /** Time of the oldest row, or null when empty. */
  firstTime(): number | null {
    return this._length ? this._times[this._slot(0)] : null;
  }

  /**
   * The newest reading of `name` among the last LATEST_LOOKBACK rows, so one sample
   * without it does not blank the number; null when none of them has one.
   */
  latest(name: string): Reading {
    const column = this._columns.get(name);
    if (!column) {
      return null;
    }
    const oldest = Math.max(0, this._length - LATEST_LOOKBACK);
    for (let i = this._length - 1; i >= oldest; i--) {
      const value = column[this._slot(i)];
      if (!Number.isNaN(value)) {
        return value;
      }
    }
    return null;
  }

  /** The times of all rows, oldest first. */
  times(): number[] {
    const times = new Array<number>(this._length);
    for (let i = 0; i < this._length; i++) {
      times[i] = this._times[this._slot(i)];
    }
    return times;
  }

  /** One metric's readings aligned with `times()`; null where there is none. */
  values(name: string): Reading[] {
    const column = this._columns.get(name);
    const values = new Array<Reading>(this._length);
    for (let i = 0; i < this._length; i++) {
      const value = column ? column[this._slot(i)] : NaN;
      values[i] = Number.isNaN(value) ? null : value;
    }
    return values;
  }

  /** The time axis and the named columns, oldest first, in the shape charts take. */
  aligned(names: string[]): AlignedSeries {
    return [this.times(), ...names.map(name => this.values(name))];
  }

  private _slot(index: number): number {
    return (this._start + index) % this.capacity;
  }

  private _column(name: string): Float64Array {
    let column = this._columns.get(name);
    if (!column) {
      column = new Float64Array(this.capacity).fill(NaN);
      this._columns.set(name, column);
    }
    return column;
  }
}

/** Where the sidebar's connection to the server stands. */
export type ConnectionState =
  /** Panel hidden: nothing on the wire. */
  | { kind: 'stopped' }
  /**
   * Panel hidden; the status bar asks for the latest values every `everyS` seconds
   * (`error`: why the last ask failed, or null).
   */
  | { kind: 'polling'; everyS: number; error: string | null }
  | { kind: 'connecting' }
  /** Samples are arriving. */
  | { kind: 'live' }
  /** Lost or refused; the next try is in `delayMs`. */
  | { kind: 'retrying'; delayMs: number; reason: string }
  /** `GET /devices` answered 404: the server extension is not installed or not enabled. */
  | { kind: 'missing'; url: string };

/** What changed, so a view can skip work that is not needed. */
export type ModelChange =
  'devices' | 'data' | 'processes' | 'connection' | 'cluster';

/** The cluster section's state (only ever other than `off` when the server has a cluster). */
export type ClusterState =
  | { kind: 'off' }
  | { kind: 'loading' }
  /** `reply` arrived at `atMs` (client clock); `reply.error` may still say Prometheus failed. */
  | { kind: 'ready'; reply: IClusterReply; atMs: number }
  /** The route itself failed; `last` is the previous good reply, kept on screen. */
  | { kind: 'error'; message: string; last: IClusterReply | null };

/**
 * The sources that stopped answering and the devices whose readings stopped with them,
 * as of `receivedS` (client clock, epoch seconds).
 */
export interface IStalledState {
  sources: IStalledSource[];
  devices: StaleDevices;
  receivedS: number;
}

export const NOTHING_STALLED: IStalledState = {
  sources: [],
  devices: {},
  receivedS: 0
};

/** The device a metric belongs to: `gpu3` for `gpu3.util` (the host's `cpu` for `cpu.util`). */
export function deviceOf(column: string): string {
  const dot = column.indexOf('.');
  return dot < 0 ? column : column.slice(0, dot);
}

/**
 * The newest reading of `column`: a stale device's last value (greyed by the views), else
 * the newest in `series`.
 */
export function latestReading(
  series: SeriesBuffer,
  stalled: IStalledState,
  column: string
): Reading {
  const stale: IStaleDevice | undefined = stalled.devices[deviceOf(column)];
  return stale ? (stale.values[column] ?? null) : series.latest(column);
}

/** Seconds since a stale device's last values, as of `nowS`; null when not stale or never read. */
export function staleAgeS(
  stalled: IStalledState,
  id: string,
  nowS: number
): number | null {
  const stale = stalled.devices[id];
  if (!stale || stale.age_s === null) {
    return null;
  }
  return stale.age_s + Math.max(0, nowS - stalled.receivedS);
}

/**
 * The sidebar's state. `handle()` takes each server message; `changed` says what changed.
 */
export class SidebarModel {
  devices: IDevicesReply | null = null;
  series: SeriesBuffer;
  processes: Record<string, IProcessInfo[]> = {};
  processesTime: number | null = null;
  connection: ConnectionState = { kind: 'stopped' };
  stalled: IStalledState = NOTHING_STALLED;
  cluster: ClusterState = { kind: 'off' };
  /** The sampling interval this client asks for, seconds. */
  requestedInterval: number;
  private _changed = new Signal<this, ModelChange>(this);

  constructor(requestedInterval = 1) {
    this.requestedInterval = requestedInterval;
    this.series = new SeriesBuffer(
      historyCapacity(this.historyS, requestedInterval)
    );
  }

  /** Seconds between samples as the server sends them to this client. */
  get interval(): number {
    return effectiveInterval(
      this.requestedInterval,
      this.devices ? this.devices.interval : this.requestedInterval
    );
  }

  /** Seconds of history the charts span: as long as the server keeps. */
  get historyS(): number {
    return this.devices ? this.devices.history_s : DEFAULT_HISTORY_S;
  }

  /** The newest reading of `column`; a stale device's last one (see `latestReading`). */
  latest(column: string): Reading {
    return latestReading(this.series, this.stalled, column);
  }

  /** Emitted after every change, with what changed. */
  get changed(): ISignal<this, ModelChange> {
    return this._changed;
  }

  /** New static facts (from `GET /devices` or `hello`); sizes the ring buffer for them. */
  setDevices(devices: IDevicesReply): void {
    if (devices.cluster === undefined && this.devices?.cluster !== undefined) {
      // Only `GET /devices` says whether the server has a cluster (the stream's hello and
      // the snapshot carry the same facts without it): keep what it said.
      devices = { ...devices, cluster: this.devices.cluster };
    }
    this.devices = devices;
    const capacity = historyCapacity(devices.history_s, this.interval);
    if (capacity !== this.series.capacity) {
      this.series = new SeriesBuffer(capacity);
    }
    this._emit('devices');
  }

  setRequestedInterval(seconds: number): void {
    this.requestedInterval = seconds;
    if (this.devices) {
      this.setDevices(this.devices);
    }
  }

  setConnection(connection: ConnectionState): void {
    this.connection = connection;
    this._emit('connection');
  }

  setCluster(cluster: ClusterState): void {
    this.cluster = cluster;
    this._emit('cluster');
  }

  /**
   * The latest values of a snapshot (the status bar's poll while the sidebar is closed):
   * appended as one row when newer than the newest held.
   */
  applySnapshot(snapshot: ISnapshotReply): void {
    if (JSON.stringify(snapshot.devices) !== JSON.stringify(this.devices)) {
      this.setDevices(snapshot.devices);
    }
    const { t, values } = snapshot.latest;
    const last = this.series.lastTime();
    if (t !== null && (last === null || t > last)) {
      this.series.push(t, values);
    }
    this._setStalled(snapshot.stalled, snapshot.stale);
    if (snapshot.processes) {
      this.handle(snapshot.processes);
    }
    this._emit('data');
  }

  handle(message: ServerMessage): void {
    switch (message.type) {
      case 'hello':
        this._setStalled(message.stalled, message.stale);
        this.setDevices(message.devices);
        break;
      case 'history':
        // A (re)connection starts from the server's history: what the client held
        // before may predate a server restart.
        this.series.load(message.t, message.columns);
        this._markLive();
        this._emit('data');
        break;
      case 'sample':
        this._setStalled(message.stalled, message.stale);
        this.series.push(message.t, message.values);
        this._markLive();
        this._emit('data');
        break;
      case 'processes':
        this.processes = message.gpus;
        this.processesTime = message.t;
        this._emit('processes');
        break;
    }
  }

  private _setStalled(
    sources: IStalledSource[] | undefined,
    devices: StaleDevices | undefined
  ): void {
    this.stalled = {
      sources: sources ?? [],
      devices: devices ?? {},
      receivedS: Date.now() / 1000
    };
  }

  private _markLive(): void {
    if (this.connection.kind !== 'live') {
      this.setConnection({ kind: 'live' });
    }
  }

  private _emit(change: ModelChange): void {
    this._changed.emit(change);
  }
}
