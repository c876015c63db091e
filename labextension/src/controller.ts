/**
 * Connects the model to the server while (and only while) the panel is shown:
 * `GET /devices` first (a 404 means the server extension is missing, which no retry
 * fixes), then the stream, reconnecting with backoff when the server goes away.
 */

import { ApiError, IGpuApi, ServerExtensionMissing } from './api';
import { ConnectionState, SidebarModel } from './model';
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

/** A socket is presumed dead after this many intervals without a frame (and never sooner than the floor). */
const IDLE_INTERVALS = 5;
const IDLE_FLOOR_MS = 15_000;

export interface IControllerOptions {
  backoff?: IBackoffOptions;
  timers?: ITimers;
  random?: () => number;
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
      return { kind: 'stopped' };
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
        }
      },
      isFatal: error => error instanceof ServerExtensionMissing,
      idleTimeoutMs: () =>
        Math.max(IDLE_FLOOR_MS, IDLE_INTERVALS * model.interval * 1000),
      backoff: options.backoff,
      timers: options.timers,
      random: options.random
    });
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
    if (visible) {
      this._stream.start();
    } else if (this._stream.running) {
      this._stopTimer = this._timers.setTimeout(() => {
        this._stopTimer = null;
        this.stop();
      }, STOP_GRACE_MS);
    }
  }

  /** Start talking to the server. */
  start(): void {
    this._cancelStop();
    this._stream.start();
  }

  /** Stop all traffic now. The model keeps the last values. */
  stop(): void {
    this._cancelStop();
    this._stream.stop();
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
