import { Poller } from '../src/poller';
import { FakeClock, settle } from './fakes';

function setup(periodMs = 1000) {
  const clock = new FakeClock();
  const rounds: number[] = [];
  let release: (() => void) | null = null;
  let hold = false;
  const poller = new Poller({
    periodMs,
    timers: clock,
    now: () => clock.now,
    run: async () => {
      rounds.push(clock.now);
      if (hold) {
        await new Promise<void>(resolve => (release = resolve));
      }
    }
  });
  return {
    clock,
    rounds,
    poller,
    hold: (on: boolean) => (hold = on),
    release: () => release?.()
  };
}

describe('Poller', () => {
  it('runs at once, then a period after each round ends', async () => {
    const { clock, rounds, poller } = setup();
    poller.start();
    await settle();
    await clock.advance(3500);
    expect(rounds).toEqual([0, 1000, 2000, 3000]);
  });

  it('never runs two rounds at once: a slow round delays the next', async () => {
    const { clock, rounds, poller, hold, release } = setup();
    hold(true);
    poller.start();
    await settle();
    await clock.advance(5000);
    expect(rounds).toEqual([0]);
    hold(false);
    release();
    await settle();
    await clock.advance(1000);
    expect(rounds).toEqual([0, 6000]);
  });

  it('stops: no more rounds, no timer left', async () => {
    const { clock, rounds, poller } = setup();
    poller.start();
    await settle();
    await clock.advance(1500);
    poller.stop();
    await clock.advance(10_000);
    expect(rounds).toEqual([0, 1000]);
    expect(clock.pendingCount).toBe(0);
  });

  it('after a quick stop and start, waits out the period instead of asking again', async () => {
    const { clock, rounds, poller } = setup();
    poller.start();
    await settle();
    await clock.advance(300);
    poller.stop();
    poller.start();
    await settle();
    expect(rounds).toEqual([0]);
    await clock.advance(700);
    expect(rounds).toEqual([0, 1000]);
  });

  it('a stop and start during a slow round asks nothing more until that round ends', async () => {
    const { clock, rounds, poller, hold, release } = setup();
    hold(true);
    poller.start();
    await settle();
    await clock.advance(5000);
    poller.stop();
    poller.start();
    await settle();
    expect(rounds).toEqual([0]);
    hold(false);
    release();
    await settle();
    await clock.advance(1000);
    expect(rounds).toEqual([0, 6000]);
  });

  it('a stop during a slow round leaves nothing scheduled after it', async () => {
    const { clock, rounds, poller, hold, release } = setup();
    hold(true);
    poller.start();
    await settle();
    poller.stop();
    release();
    await settle();
    await clock.advance(10_000);
    expect(rounds).toEqual([0]);
    expect(clock.pendingCount).toBe(0);
  });

  it('keeps polling after a round fails', async () => {
    const clock = new FakeClock();
    let calls = 0;
    const poller = new Poller({
      periodMs: 1000,
      timers: clock,
      now: () => clock.now,
      run: async () => {
        calls += 1;
        throw new Error('down');
      }
    });
    poller.start();
    await settle();
    await clock.advance(2000);
    expect(calls).toBe(3);
  });
});
