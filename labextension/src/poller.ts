/**
 * A periodic request that runs only while someone wants it: the status bar's poll while
 * the sidebar is closed, the cluster's refresh while it is open.
 *
 * One request at a time (the next is timed from the end of the last, so a slow server is
 * never asked twice at once); a stop drops the answer of a request still in flight.
 */

import { BROWSER_TIMERS, ITimers } from './stream';

export interface IPollerOptions {
  /** One round; its rejections are the caller's business (the poller goes on). */
  run(): Promise<void>;
  /** Milliseconds between the end of one round and the start of the next. */
  periodMs: number;
  timers?: ITimers;
  /** The clock (ms) that decides whether a restart must run at once; Date.now by default. */
  now?: () => number;
}

export class Poller {
  private _periodMs: number;
  private _run: () => Promise<void>;
  private _timers: ITimers;
  private _now: () => number;
  private _timer: unknown = null;
  private _running = false;
  private _inFlight = false;
  /** Bumped on every start and stop, so a timer of an old run starts nothing. */
  private _generation = 0;
  private _lastEnd = -Infinity;

  constructor(options: IPollerOptions) {
    this._run = options.run;
    this._periodMs = options.periodMs;
    this._timers = options.timers ?? BROWSER_TIMERS;
    this._now = options.now ?? (() => Date.now());
  }

  get running(): boolean {
    return this._running;
  }

  get periodMs(): number {
    return this._periodMs;
  }

  /** A new period; a round already waiting is re-timed from the end of the last one. */
  setPeriod(ms: number): void {
    if (ms === this._periodMs) {
      return;
    }
    this._periodMs = ms;
    if (this._running && this._timer !== null) {
      this._schedule(Math.max(0, this._lastEnd + ms - this._now()));
    }
  }

  /**
   * Start polling: at once when the last round ended a period ago or more (or never ran),
   * otherwise when that period is up, so hiding and showing does not ask twice.
   */
  start(): void {
    if (this._running) {
      return;
    }
    this._running = true;
    this._generation += 1;
    if (this._inFlight) {
      return; // the round under way schedules the next when it ends
    }
    const wait = Math.max(0, this._lastEnd + this._periodMs - this._now());
    this._schedule(wait);
  }

  stop(): void {
    if (!this._running) {
      return;
    }
    this._running = false;
    this._generation += 1;
    this._clear();
  }

  private _schedule(ms: number): void {
    this._clear();
    const generation = this._generation;
    if (ms <= 0) {
      void this._round();
      return;
    }
    this._timer = this._timers.setTimeout(() => {
      this._timer = null;
      if (generation === this._generation) {
        void this._round();
      }
    }, ms);
  }

  private async _round(): Promise<void> {
    this._inFlight = true;
    try {
      await this._run();
    } catch {
      // The caller reports its own failures; polling goes on.
    } finally {
      this._inFlight = false;
      this._lastEnd = this._now();
    }
    if (this._running && this._timer === null) {
      this._schedule(this._periodMs);
    }
  }

  private _clear(): void {
    if (this._timer !== null) {
      this._timers.clearTimeout(this._timer);
      this._timer = null;
    }
  }
}
