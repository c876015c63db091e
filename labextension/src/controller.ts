/**
 * Connects the model to the server: while the panel is shown, `GET /devices` first (a
 * 404 means the server extension is missing, which no retry fixes), then the stream,
 * reconnecting with backoff when the server goes away, and the cluster (where the server
 * has one) every CLUSTER_REFRESH_MS. While the panel is closed and the page visible, the
 * status bar's latest values come from a small `GET /snapshot?window=0` every
 * STATUS_POLL_MS by default (as jupyter-resource-usage polls its status item): no socket, no
 * history, and the server keeps no sampler running for it (it reads once per ask).
 */

import { ApiError, IGpuApi, ServerExtensionMissing } from './api';
import { ConnectionState, ModelChange, SidebarModel } from './model';
import { Poller } from './poller';
import { parseMessage } from './protocol';
import {
  BROWSER_TIMERS,
  IBackoffOptions,
  ReconnectingStream,
  StreamStatus,
  ITimers
} from './stream';

/**
 * How long a hidden panel keeps its connection. JupyterLab sometimes hides and shows
 * the side panels within a frame (opening a notebook does); a reconnection would
 * fetch the server's whole history again.
 */
export const STOP_GRACE_MS = 2000;

/** How often the status bar asks for the latest values while the panel is closed (by default). */
export const STATUS_POLL_MS = 5000;

/** How often the cluster section asks again (Prometheus's usual scrape interval). */
export const CLUSTER_REFRESH_MS = 15_000;

/** The span of the cluster's heat strip. */
export const CLUSTER_WINDOW_S = 3600;

/** A socket is presumed dead after this many intervals without a frame (and never sooner than the floor). */
const IDLE_INTERVALS = 5;
const IDLE_FLOOR_MS = 15_000;

export interface IControllerOptions {
  backoff?: IBackoffOptions;
  timers?: ITimers;
  random?: () => number;
  /** The clock of the pollers (ms); Date.now by default. */
  now?: () => number;
}

function describeError(error: unknown): string {
  return error instanceof Error && error.message
    ? error.message
    : String(error);
}

/** The panel's connection state for a stream status; null where the model decides. */
export function connectionFor(status: StreamStatus): ConnectionState | null {
  switch (status.kind) {
    case 'connecting':
      return { kind: 'connecting' };
    case 'open':
      // "live" once data arrives (the model says so); an open socket alone proves little.
      return null;
    case 'retrying':
      return {
        kind: 'retrying',
        delayMs: status.delayMs,
        reason: status.reason
      };
    case 'stopped':
      return null; // stopped: the controller says whether the status bar polls
    case 'fatal':
      // Only a missing server extension is fatal (isFatal below).
      return {
        kind: 'missing',
        url: status.error instanceof ApiError ? status.error.url : ''
      };
  }
}

export class SidebarController {
  readonly model: SidebarModel;
  private _api: IGpuApi;
  private _stream: ReconnectingStream;
  private _timers: ITimers;
  private _stopTimer: unknown = null;
  private _statusPoller: Poller;
  private _clusterPoller: Poller;
  private _pollStatus = false;
  private _statusPollMs = STATUS_POLL_MS;
  private _panelVisible = false;
  private _pageVisible = true;

  constructor(
    api: IGpuApi,
    model: SidebarModel,
    options: IControllerOptions = {}
  ) {
    this._api = api;
    this.model = model;
    this._timers = options.timers ?? BROWSER_TIMERS;
    this._stream = new ReconnectingStream({
      connect: () => this._connect(),
      onMessage: text => {
        const message = parseMessage(text);
        if (message) {
          model.handle(message);
        }
      },
      onStatus: status => {
        const connection = connectionFor(status);
        if (connection) {
          model.setConnection(connection);
        } else if (status.kind === 'stopped') {
          model.setConnection({ kind: 'stopped' });
          this._updatePolling();
        }
      },
      isFatal: error => error instanceof ServerExtensionMissing,
      idleTimeoutMs: () =>
        Math.max(IDLE_FLOOR_MS, IDLE_INTERVALS * model.interval * 1000),
      backoff: options.backoff,
      timers: options.timers,
      random: options.random
    });
    this._statusPoller = new Poller({
      run: () => this._pollStatusOnce(),
      periodMs: STATUS_POLL_MS,
      timers: this._timers,
      now: options.now
    });
    this._clusterPoller = new Poller({
      run: () => this._fetchCluster(),
      periodMs: CLUSTER_REFRESH_MS,
      timers: this._timers,
      now: options.now
    });
    model.changed.connect(this._modelChanged, this);
  }

  /** True while the status bar's poll is on (panel closed, page visible). */
  get polling(): boolean {
    return this._statusPoller.running;
  }

  /** True while the cluster section refreshes. */
  get clusterRunning(): boolean {
    return this._clusterPoller.running;
  }

  /**
   * Keep the status bar current while the panel is closed, asking every `seconds` (index.ts
   * turns this on, from the settings; 0 or off, a closed panel means no traffic at all).
   */
  pollWhileClosed(seconds: number): void {
    this._pollStatus = seconds > 0;
    if (this._pollStatus) {
      this._statusPollMs = seconds * 1000;
      this._statusPoller.setPeriod(this._statusPollMs);
      if (this.model.connection.kind === 'polling') {
        this.model.setConnection({
          ...this.model.connection,
          everyS: seconds
        });
      }
    }
    this._updatePolling();
  }

  /** The browser tab was hidden or shown (document.visibilityState): no polling while hidden. */
  setPageVisible(visible: boolean): void {
    this._pageVisible = visible;
    this._updatePolling();
    this._updateCluster();
  }

  get running(): boolean {
    return this._stream.running;
  }

  /**
   * The panel was shown (connect now) or hidden (disconnect after STOP_GRACE_MS,
   * unless it is shown again first).
   */
  setVisible(visible: boolean): void {
    this._cancelStop();
    this._panelVisible = visible;
    this._updateCluster();
    if (visible) {
      this._updatePolling();
      this._stream.start();
    } else if (this._stream.running) {
      this._stopTimer = this._timers.setTimeout(() => {
        this._stopTimer = null;
        this.stop();
      }, STOP_GRACE_MS);
    } else {
      this._updatePolling();
    }
  }

  /** Start talking to the server. */
  start(): void {
    this._cancelStop();
    this._panelVisible = true;
    this._updatePolling();
    this._stream.start();
    this._updateCluster();
  }

  /** Stop the stream and the cluster now (the status bar's poll takes over where enabled). The model keeps the last values. */
  stop(): void {
    this._cancelStop();
    this._panelVisible = false;
    this._stream.stop();
    this._updateCluster();
    this._updatePolling();
  }

  /** Stop everything, the status bar's poll too. */
  dispose(): void {
    this._pollStatus = false;
    this.stop();
    this._statusPoller.stop();
    this.model.changed.disconnect(this._modelChanged, this);
  }

  /** Reconnect now, e.g. after the user asked to retry. */
  retry(): void {
    this._stream.restart();
  }

  /** A new sampling interval from the settings: reconnect at that rate if running. */
  setInterval(seconds: number): void {
    if (seconds === this.model.requestedInterval) {
      return;
    }
    this.model.setRequestedInterval(seconds);
    if (this._stream.running) {
      this._stream.restart();
    }
  }

  private _modelChanged(_model: SidebarModel, change: ModelChange): void {
    if (change === 'devices') {
      this._updateCluster();
    }
  }

  /** The status bar polls while it is enabled, the stream is off and the page is visible. */
  private _updatePolling(): void {
    const want =
      this._pollStatus &&
      !this._panelVisible &&
      !this._stream.running &&
      this._pageVisible &&
      this.model.connection.kind !== 'missing';
    if (want && !this._statusPoller.running) {
      this.model.setConnection({
        kind: 'polling',
        everyS: this._statusPollMs / 1000,
        error: null
      });
      this._statusPoller.start();
    } else if (!want && this._statusPoller.running) {
      this._statusPoller.stop();
      if (this.model.connection.kind === 'polling') {
        this.model.setConnection({ kind: 'stopped' });
      }
    }
  }

  private async _pollStatusOnce(): Promise<void> {
    const everyS = this._statusPollMs / 1000;
    try {
      const snapshot = await this._api.snapshot();
      if (this._statusPoller.running) {
        this.model.applySnapshot(snapshot);
        this.model.setConnection({ kind: 'polling', everyS, error: null });
      }
    } catch (error) {
      if (!this._statusPoller.running) {
        return;
      }
      if (error instanceof ServerExtensionMissing) {
        this._statusPoller.stop();
        this.model.setConnection({ kind: 'missing', url: error.url });
      } else {
        this.model.setConnection({
          kind: 'polling',
          everyS,
          error: describeError(error)
        });
      }
    }
  }

  /** The cluster refreshes while the panel and the page are visible and the server has a cluster. */
  private _updateCluster(): void {
    const enabled = this.model.devices?.cluster === true;
    const want = enabled && this._panelVisible && this._pageVisible;
    if (!enabled && this.model.cluster.kind !== 'off') {
      this.model.setCluster({ kind: 'off' });
    }
    if (want && !this._clusterPoller.running) {
      if (this.model.cluster.kind === 'off') {
        this.model.setCluster({ kind: 'loading' });
      }
      this._clusterPoller.start();
    } else if (!want && this._clusterPoller.running) {
      this._clusterPoller.stop();
    }
  }

  private async _fetchCluster(): Promise<void> {
    let message: string;
    try {
      const reply = await this._api.cluster(CLUSTER_WINDOW_S);
      if (!this._clusterPoller.running) {
        return;
      }
      if (!reply.error) {
        this.model.setCluster({ kind: 'ready', reply, atMs: Date.now() });
        return;
      }
      // The route answered, Prometheus did not (down, slow, refusing): say so, keep the last strip.
      message = reply.error;
    } catch (error) {
      if (!this._clusterPoller.running) {
        return;
      }
      message = describeError(error);
    }
    const previous = this.model.cluster;
    this.model.setCluster({
      kind: 'error',
      message,
      last:
        previous.kind === 'ready'
          ? previous.reply
          : previous.kind === 'error'
            ? previous.last
            : null
    });
  }

  private _cancelStop(): void {
    if (this._stopTimer !== null) {
      this._timers.clearTimeout(this._stopTimer);
      this._stopTimer = null;
    }
  }

  private async _connect() {
    const devices = await this._api.devices();
    this.model.setDevices(devices);
    return this._api.openStream(this.model.requestedInterval);
  }
}
