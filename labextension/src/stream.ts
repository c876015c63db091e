/**
 * A websocket that comes back: reconnects with exponential backoff after the server
 * goes away (a restart, a network blip), stops for good on a fatal error, and is
 * silent while stopped.
 *
 * Pure logic over injected sockets and timers, so jest drives it without a server.
 */

export interface IBackoffOptions {
  /** Delay before the first retry, ms. */
  initialMs: number;
  /** Longest delay between tries, ms. */
  maxMs: number;
  /** Each failed try multiplies the delay by this. */
  factor: number;
  /** Random spread, as a fraction of the delay (0.2: +-20%), so many tabs don't retry in step. */
  jitter: number;
}

export const DEFAULT_BACKOFF: IBackoffOptions = {
  initialMs: 500,
  maxMs: 30_000,
  factor: 2,
  jitter: 0.2
};

/** Delay before retry number `attempt` (0 for the first retry). */
export function backoffDelay(
  attempt: number,
  options: IBackoffOptions = DEFAULT_BACKOFF,
  random: () => number = Math.random
): number {
  const base = Math.min(
    options.maxMs,
    options.initialMs * options.factor ** Math.max(0, attempt)
  );
  const spread = base * options.jitter * (2 * random() - 1);
  return Math.max(0, Math.round(Math.min(options.maxMs, base + spread)));
}

/** The part of the browser's WebSocket this module uses. */
export interface ISocketLike {
  onopen: ((event: Event) => void) | null;
  onmessage: ((event: MessageEvent) => void) | null;
  onclose: ((event: CloseEvent) => void) | null;
  onerror: ((event: Event) => void) | null;
  close(code?: number, reason?: string): void;
}

export interface ITimers {
  setTimeout(callback: () => void, ms: number): unknown;
  clearTimeout(handle: unknown): void;
}

/** The window's timers. */
export const BROWSER_TIMERS: ITimers = {
  setTimeout: (callback, ms) => setTimeout(callback, ms),
  clearTimeout: handle => clearTimeout(handle as ReturnType<typeof setTimeout>)
};

export type StreamStatus =
  | { kind: 'connecting' }
  | { kind: 'open' }
  | { kind: 'retrying'; delayMs: number; attempt: number; reason: string }
  | { kind: 'stopped' }
  | { kind: 'fatal'; error: unknown };

export interface IStreamOptions {
  /** Open a socket (may first ask the server something); a rejection is retried unless fatal. */
  connect(): Promise<ISocketLike>;
  /** Every text frame, as it comes. */
  onMessage(text: string): void;
  onStatus(status: StreamStatus): void;
  /** An error after which retrying cannot help (e.g. the route does not exist). */
  isFatal?(error: unknown): boolean;
  /**
   * With no frame for this long the socket is presumed dead (a server that vanished
   * without closing it) and replaced; 0 turns the watchdog off.
   */
  idleTimeoutMs?: () => number;
  backoff?: IBackoffOptions;
  timers?: ITimers;
  random?: () => number;
}

/** Why a socket ended, in words for the panel. */
function describe(error: unknown): string {
  if (error instanceof Error && error.message) {
    return error.message;
  }
  return String(error);
}

export class ReconnectingStream {
  private _options: IStreamOptions;
  private _timers: ITimers;
  private _running = false;
  /** Bumped on every start and stop, so late callbacks of an old connection do nothing. */
  private _generation = 0;
  private _attempt = 0;
  private _socket: ISocketLike | null = null;
  private _retryTimer: unknown = null;
  private _idleTimer: unknown = null;

  constructor(options: IStreamOptions) {
    this._options = options;
    this._timers = options.timers ?? BROWSER_TIMERS;
  }

  get running(): boolean {
    return this._running;
  }

  /** Connect (no-op when already running). */
  start(): void {
    if (this._running) {
      return;
    }
    this._running = true;
    this._attempt = 0;
    this._generation += 1;
    void this._connect(this._generation);
  }

  /** Close the socket and cancel any retry; nothing more goes over the wire. */
  stop(): void {
    const wasRunning = this._running;
    this._running = false;
    this._generation += 1;
    this._clearTimers();
    this._dropSocket();
    if (wasRunning) {
      this._options.onStatus({ kind: 'stopped' });
    }
  }

  /** Reconnect now (new settings, or a user's "retry"), with a fresh backoff. */
  restart(): void {
    this.stop();
    this.start();
  }

  private async _connect(generation: number): Promise<void> {
    this._options.onStatus({ kind: 'connecting' });
    let socket: ISocketLike;
    try {
      socket = await this._options.connect();
    } catch (error) {
      if (generation !== this._generation) {
        return;
      }
      if (this._options.isFatal?.(error)) {
        this._running = false;
        this._generation += 1;
        this._options.onStatus({ kind: 'fatal', error });
      } else {
        this._scheduleRetry(describe(error));
      }
      return;
    }
    if (generation !== this._generation) {
      socket.close(1000, 'stopped');
      return;
    }
    this._socket = socket;
    let heard = false;
    socket.onopen = () => {
      if (generation === this._generation) {
        this._options.onStatus({ kind: 'open' });
        this._armWatchdog(socket, generation);
      }
    };
    socket.onmessage = event => {
      if (generation !== this._generation) {
        return;
      }
      if (!heard) {
        // Only a server that talks counts as back: one that accepts and drops the
        // connection keeps backing off.
        heard = true;
        this._attempt = 0;
      }
      this._armWatchdog(socket, generation);
      if (typeof event.data === 'string') {
        this._options.onMessage(event.data);
      }
    };
    socket.onerror = () => {
      // A close event always follows; the retry is scheduled there.
    };
    socket.onclose = () => {
      if (generation !== this._generation || this._socket !== socket) {
        return;
      }
      this._socket = null;
      this._clearTimers();
      this._scheduleRetry(
        heard
          ? 'the server closed the connection'
          : 'the server refused the connection'
      );
    };
  }

  private _scheduleRetry(reason: string): void {
    if (!this._running) {
      return;
    }
    const delayMs = backoffDelay(
      this._attempt,
      this._options.backoff ?? DEFAULT_BACKOFF,
      this._options.random
    );
    const attempt = this._attempt;
    this._attempt += 1;
    const generation = this._generation;
    this._retryTimer = this._timers.setTimeout(() => {
      this._retryTimer = null;
      if (generation === this._generation) {
        void this._connect(generation);
      }
    }, delayMs);
    this._options.onStatus({ kind: 'retrying', delayMs, attempt, reason });
  }

  private _armWatchdog(socket: ISocketLike, generation: number): void {
    const timeout = this._options.idleTimeoutMs?.() ?? 0;
    if (timeout <= 0) {
      return;
    }
    if (this._idleTimer !== null) {
      this._timers.clearTimeout(this._idleTimer);
    }
    this._idleTimer = this._timers.setTimeout(() => {
      this._idleTimer = null;
      if (generation !== this._generation || this._socket !== socket) {
        return;
      }
      this._dropSocket();
      this._scheduleRetry(`no data for ${Math.round(timeout / 1000)} s`);
    }, timeout);
  }

  private _dropSocket(): void {
    const socket = this._socket;
    this._socket = null;
    if (socket) {
      socket.onopen = socket.onmessage = socket.onclose = socket.onerror = null;
      socket.close(1000, 'stopped');
    }
  }

  private _clearTimers(): void {
    if (this._retryTimer !== null) {
      this._timers.clearTimeout(this._retryTimer);
      this._retryTimer = null;
    }
    if (this._idleTimer !== null) {
      this._timers.clearTimeout(this._idleTimer);
      this._idleTimer = null;
    }
  }
}
