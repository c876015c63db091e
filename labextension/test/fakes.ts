/** A hand-driven clock and websocket for the connection tests. */

import { ISocketLike, ITimers } from '../src/stream';

interface IPending {
  at: number;
  callback: () => void;
}

/** Timers that fire only when the test advances time. */
export class FakeClock implements ITimers {
  now = 0;
  private _pending = new Map<number, IPending>();
  private _next = 1;

  setTimeout(callback: () => void, ms: number): unknown {
    const handle = this._next++;
    this._pending.set(handle, { at: this.now + ms, callback });
    return handle;
  }

  clearTimeout(handle: unknown): void {
    this._pending.delete(handle as number);
  }

  get pendingCount(): number {
    return this._pending.size;
  }

  /** Delays of the timers still pending, from now. */
  pendingDelays(): number[] {
    return [...this._pending.values()].map(p => p.at - this.now);
  }

  /** Move time forward, firing due timers in order; then let promises settle. */
  async advance(ms: number): Promise<void> {
    const end = this.now + ms;
    for (;;) {
      let due: [number, IPending] | null = null;
      for (const entry of this._pending) {
        if (entry[1].at <= end && (!due || entry[1].at < due[1].at)) {
          due = entry;
        }
      }
      if (!due) {
        break;
      }
      this._pending.delete(due[0]);
      this.now = due[1].at;
      due[1].callback();
      await settle();
    }
    this.now = end;
    await settle();
  }
}

/** Let pending promise callbacks run. */
export async function settle(): Promise<void> {
  for (let i = 0; i < 5; i++) {
    await Promise.resolve();
  }
}

export class FakeSocket implements ISocketLike {
  onopen: ((event: Event) => void) | null = null;
  onmessage: ((event: MessageEvent) => void) | null = null;
  onclose: ((event: CloseEvent) => void) | null = null;
  onerror: ((event: Event) => void) | null = null;
  closed = false;
  readonly url: string;

  constructor(url = 'ws://fake') {
    this.url = url;
  }

  open(): void {
    this.onopen?.({} as Event);
  }

  send(message: unknown): void {
    this.onmessage?.({ data: JSON.stringify(message) } as MessageEvent);
  }

  /** The server went away (a restart): the browser reports a close. */
  drop(): void {
    this.closed = true;
    this.onerror?.({} as Event);
    this.onclose?.({ code: 1006 } as CloseEvent);
  }

  close(): void {
    this.closed = true;
  }
}

/** What a fake 2D context received: the last image put on each canvas. */
export const paintedImages = new WeakMap<HTMLCanvasElement, ImageData>();

/**
 * jsdom has no canvas: give canvases a 2D context that keeps the image put on them, so a
 * test can read the pixels a view painted.
 */
export function installFakeCanvas(): void {
  HTMLCanvasElement.prototype.getContext = function (this: HTMLCanvasElement) {
    return {
      createImageData: (width: number, height: number) =>
        ({
          width,
          height,
          data: new Uint8ClampedArray(width * height * 4)
        }) as ImageData,
      putImageData: (image: ImageData) => paintedImages.set(this, image)
    } as unknown as CanvasRenderingContext2D;
  } as unknown as typeof HTMLCanvasElement.prototype.getContext;
}
