import {
  IBackoffOptions,
  ReconnectingStream,
  StreamStatus,
  backoffDelay
} from '../src/stream';
import { FakeClock, FakeSocket, settle } from './fakes';

const NO_JITTER: IBackoffOptions = {
  initialMs: 500,
  maxMs: 8000,
  factor: 2,
  jitter: 0
};

describe('backoffDelay', () => {
  it('doubles from the initial delay up to the cap', () => {
    const delays = [0, 1, 2, 3, 4, 5, 6].map(a => backoffDelay(a, NO_JITTER));
    expect(delays).toEqual([500, 1000, 2000, 4000, 8000, 8000, 8000]);
  });

  it('spreads retries by the jitter fraction, never past the cap', () => {
    const options = { ...NO_JITTER, jitter: 0.2 };
    expect(backoffDelay(1, options, () => 0)).toBe(800);
    expect(backoffDelay(1, options, () => 1)).toBe(1200);
    expect(backoffDelay(10, options, () => 1)).toBe(8000);
  });
});

/** A stream whose connect() hands out fake sockets (or failures) the test controls. */
function harness(options: { idleTimeoutMs?: number } = {}) {
  const clock = new FakeClock();
  const sockets: FakeSocket[] = [];
  const statuses: StreamStatus[] = [];
  const messages: string[] = [];
  const failures: unknown[] = [];
  const stream = new ReconnectingStream({
    connect: async () => {
      const failure = failures.shift();
      if (failure !== undefined) {
        throw failure;
      }
      const socket = new FakeSocket();
      sockets.push(socket);
      return socket;
    },
    onMessage: text => messages.push(text),
    onStatus: status => statuses.push(status),
    isFatal: error => error === 'fatal',
    idleTimeoutMs: options.idleTimeoutMs
      ? () => options.idleTimeoutMs!
      : undefined,
    backoff: NO_JITTER,
    timers: clock
  });
  const kinds = () => statuses.map(s => s.kind);
  return { clock, sockets, statuses, messages, failures, stream, kinds };
}

describe('ReconnectingStream', () => {
  it('passes text frames on once connected', async () => {
    const h = harness();
    h.stream.start();
    await settle();
    h.sockets[0].open();
    h.sockets[0].send({ type: 'hello' });
    expect(h.messages).toEqual(['{"type":"hello"}']);
    expect(h.kinds()).toEqual(['connecting', 'open']);
  });

  it('reconnects with growing delays while the server is down, then resets', async () => {
    const h = harness();
    h.stream.start();
    await settle();
    h.sockets[0].open();
    h.sockets[0].send({ type: 'hello' });
    h.sockets[0].drop(); // server restart
    expect(h.clock.pendingDelays()).toEqual([500]);

    // While it restarts, every try fails, and the wait doubles.
    h.failures.push(new Error('network'), new Error('network'));
    await h.clock.advance(500);
    expect(h.clock.pendingDelays()).toEqual([1000]);
    await h.clock.advance(1000);
    expect(h.clock.pendingDelays()).toEqual([2000]);
    await h.clock.advance(2000);
    expect(h.sockets).toHaveLength(2);

    // Back: once it talks, the next failure starts from the initial delay again.
    h.sockets[1].open();
    h.sockets[1].send({ type: 'hello' });
    h.sockets[1].drop();
    expect(h.clock.pendingDelays()).toEqual([500]);
    const retrying = h.statuses.filter(s => s.kind === 'retrying');
    expect(retrying.map(s => (s.kind === 'retrying' ? s.delayMs : 0))).toEqual([
      500, 1000, 2000, 500
    ]);
  });

  it('keeps backing off from a server that accepts and drops without a word', async () => {
    const h = harness();
    h.stream.start();
    await settle();
    h.sockets[0].open();
    h.sockets[0].drop();
    await h.clock.advance(500);
    h.sockets[1].open();
    h.sockets[1].drop();
    expect(h.clock.pendingDelays()).toEqual([1000]);
  });

  it('sends nothing and schedules nothing once stopped', async () => {
    const h = harness();
    h.stream.start();
    await settle();
    h.sockets[0].open();
    h.stream.stop();
    expect(h.sockets[0].closed).toBe(true);
    expect(h.clock.pendingCount).toBe(0);
    h.sockets[0].drop(); // a late close from the old socket changes nothing
    await h.clock.advance(60_000);
    expect(h.sockets).toHaveLength(1);
    expect(h.kinds().slice(-1)).toEqual(['stopped']);
  });

  it('cancels a pending retry on stop', async () => {
    const h = harness();
    h.failures.push(new Error('network'));
    h.stream.start();
    await settle();
    expect(h.clock.pendingCount).toBe(1);
    h.stream.stop();
    expect(h.clock.pendingCount).toBe(0);
    await h.clock.advance(60_000);
    expect(h.sockets).toHaveLength(0);
  });

  it('closes a socket that arrives after stop', async () => {
    const h = harness();
    h.stream.start();
    h.stream.stop(); // before connect() resolved
    await settle();
    expect(h.sockets[0].closed).toBe(true);
    expect(h.sockets[0].onmessage).toBeNull();
  });

  it('gives up on a fatal error and says so', async () => {
    const h = harness();
    h.failures.push('fatal');
    h.stream.start();
    await settle();
    expect(h.kinds()).toEqual(['connecting', 'fatal']);
    expect(h.stream.running).toBe(false);
    expect(h.clock.pendingCount).toBe(0);
  });

  it('replaces a socket that went silent', async () => {
    const h = harness({ idleTimeoutMs: 15_000 });
    h.stream.start();
    await settle();
    h.sockets[0].open();
    h.sockets[0].send({ type: 'hello' });
    await h.clock.advance(14_000);
    h.sockets[0].send({ type: 'sample' });
    await h.clock.advance(14_000);
    expect(h.sockets[0].closed).toBe(false);
    await h.clock.advance(1_000);
    expect(h.sockets[0].closed).toBe(true);
    const last = h.statuses[h.statuses.length - 1];
    expect(last).toEqual({
      kind: 'retrying',
      delayMs: 500,
      attempt: 0,
      reason: 'no data for 15 s'
    });
    await h.clock.advance(500);
    expect(h.sockets).toHaveLength(2);
  });

  it('restarts at once with a fresh backoff', async () => {
    const h = harness();
    h.failures.push(new Error('a'), new Error('b'));
    h.stream.start();
    await settle();
    await h.clock.advance(500);
    h.stream.restart();
    await settle();
    expect(h.sockets).toHaveLength(1);
    expect(h.clock.pendingCount).toBe(0);
  });
});
