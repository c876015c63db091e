import {
  MAX_POINTS,
  MIN_SPAN_S,
  ModelChange,
  SeriesBuffer,
  SidebarModel,
  effectiveInterval,
  historyCapacity,
  visibleRange
} from '../src/model';
import { HISTORY_POINTS } from '../src/protocol';
import { GiB, T0, gpuDevices, hello, history, sample } from './fixtures';

describe('SeriesBuffer', () => {
  it('keeps the newest rows in order once full', () => {
    const buffer = new SeriesBuffer(3);
    for (let i = 0; i < 5; i++) {
      buffer.push(T0 + i, { 'cpu.util': i * 10 });
    }
    expect(buffer.length).toBe(3);
    expect(buffer.aligned(['cpu.util'])).toEqual([
      [T0 + 2, T0 + 3, T0 + 4],
      [20, 30, 40]
    ]);
    expect(buffer.lastTime()).toBe(T0 + 4);
    expect(buffer.latest('cpu.util')).toBe(40);
  });

  it('reads a missing reading back as null, not 0', () => {
    const buffer = new SeriesBuffer(4);
    buffer.push(T0, { 'gpu0.util': 5 });
    buffer.push(T0 + 1, { 'gpu0.util': null, 'gpu0.power': 100 });
    buffer.push(T0 + 2, {});
    expect(buffer.aligned(['gpu0.util', 'gpu0.power', 'gpu0.pcie_tx'])).toEqual(
      [
        [T0, T0 + 1, T0 + 2],
        [5, null, null],
        [null, 100, null],
        [null, null, null]
      ]
    );
  });

  it('keeps showing the newest reading through a sample or two without it', () => {
    const buffer = new SeriesBuffer(10);
    buffer.push(T0, { 'gpu0.util': 5 });
    buffer.push(T0 + 1, { 'gpu0.util': null });
    buffer.push(T0 + 2, {});
    expect(buffer.latest('gpu0.util')).toBe(5);
    buffer.push(T0 + 3, {});
    expect(buffer.latest('gpu0.util')).toBeNull();
    expect(buffer.latest('never.seen')).toBeNull();
  });

  it('does not keep a stale value in a slot it reuses', () => {
    const buffer = new SeriesBuffer(2);
    buffer.push(T0, { a: 1 });
    buffer.push(T0 + 1, { a: 2 });
    buffer.push(T0 + 2, { b: 3 });
    expect(buffer.aligned(['a', 'b'])).toEqual([
      [T0 + 1, T0 + 2],
      [2, null],
      [null, 3]
    ]);
  });

  it('knows which metrics were ever reported', () => {
    const buffer = new SeriesBuffer(10);
    buffer.push(T0, { 'gpu0.util': 1, 'gpu0.power': null });
    expect(buffer.has('gpu0.util')).toBe(true);
    expect(buffer.has('gpu0.power')).toBe(false);
    expect(buffer.names()).toEqual(['gpu0.util']);
  });

  it('loads only the newest rows of a history longer than itself', () => {
    const buffer = new SeriesBuffer(3);
    buffer.load([1, 2, 3, 4], { x: [10, null, 30, 40] });
    expect(buffer.aligned(['x'])).toEqual([
      [2, 3, 4],
      [null, 30, 40]
    ]);
  });
});

describe('visibleRange', () => {
  it('spans the last hour once there is an hour of data', () => {
    expect(visibleRange(T0, T0 + 7200, 3600)).toEqual([T0 + 3600, T0 + 7200]);
  });

  it('spans only the data there is while the history is shorter', () => {
    expect(visibleRange(T0, T0 + 600, 3600)).toEqual([T0, T0 + 600]);
  });

  it('never stretches the first samples across the whole chart', () => {
    expect(visibleRange(T0, T0 + 3, 3600)).toEqual([
      T0 + 3 - MIN_SPAN_S,
      T0 + 3
    ]);
  });
});

describe('intervals and capacity', () => {
  it('rounds the requested interval up to a multiple of the server period', () => {
    expect(effectiveInterval(1, 1)).toBe(1);
    expect(effectiveInterval(0.5, 1)).toBe(1);
    expect(effectiveInterval(2.5, 1)).toBe(3);
    expect(effectiveInterval(1, 0.1)).toBeCloseTo(1);
    expect(effectiveInterval(1, 0.3)).toBeCloseTo(1.2);
  });

  it('holds the server history and then one hour at the chosen interval, within a bound', () => {
    expect(historyCapacity(3600, 1)).toBe(HISTORY_POINTS + 3601);
    expect(historyCapacity(3600, 5)).toBe(HISTORY_POINTS + 721);
    expect(historyCapacity(3600, 0.1)).toBe(HISTORY_POINTS + MAX_POINTS);
  });
});

describe('SidebarModel', () => {
  function recorded(model: SidebarModel): ModelChange[] {
    const changes: ModelChange[] = [];
    model.changed.connect((_, change) => {
      changes.push(change);
    });
    return changes;
  }

  it('takes hello, history, samples and processes in order', () => {
    const model = new SidebarModel(1);
    const changes = recorded(model);
    model.handle(hello(gpuDevices(2)));
    model.handle(history(10));
    model.handle(
      sample(T0 + 10, { 'gpu0.util': 88, 'gpu0.mem_used': 42 * GiB })
    );
    model.handle({
      type: 'processes',
      t: T0 + 10,
      gpus: {
        gpu0: [
          {
            pid: 4242,
            memory: 2 * GiB,
            user: 'you',
            name: 'python',
            kernel_id: 'k1',
            notebook: 'experiments/train.ipynb'
          }
        ]
      }
    });
    expect(model.devices?.devices).toHaveLength(2);
    expect(model.series.length).toBe(11);
    expect(model.series.latest('gpu0.util')).toBe(88);
    expect(model.processes.gpu0[0].notebook).toBe('experiments/train.ipynb');
    expect(model.connection.kind).toBe('live');
    expect(changes).toEqual([
      'devices',
      'connection',
      'data',
      'data',
      'processes'
    ]);
  });

  it('sizes the buffer for an hour at the interval the server will send', () => {
    const model = new SidebarModel(5);
    model.setDevices(gpuDevices(1, 1));
    expect(model.interval).toBe(5);
    expect(model.series.capacity).toBe(HISTORY_POINTS + 721);
    model.setRequestedInterval(1);
    expect(model.series.capacity).toBe(HISTORY_POINTS + 3601);
  });

  it('keeps the whole hour of a compact history at the slowest interval, then follows it with samples', () => {
    // The server's hour: HISTORY_POINTS rows 9 s apart; a sidebar asking for a sample a minute.
    const model = new SidebarModel(60);
    model.handle(hello(gpuDevices(1, 1)));
    const t = Array.from(
      { length: HISTORY_POINTS },
      (_, i) => T0 + (i * 3600) / HISTORY_POINTS
    );
    model.handle({
      type: 'history',
      t,
      columns: { 'gpu0.util': t.map((_, i) => (i === 3 ? 100 : 10)) }
    });
    const last = t[t.length - 1];
    for (let i = 1; i <= 60; i++) {
      model.handle(sample(last + 60 * i, { 'gpu0.util': 20 }));
    }
    const [times, util] = model.series.aligned(['gpu0.util']);
    // Nothing of the hour was pushed out by the capacity (61 rows at 60 s), spike included.
    expect(times[0]).toBe(T0);
    expect(util[3]).toBe(100);
    expect(times).toHaveLength(HISTORY_POINTS + 60);
    expect(times[times.length - 1]).toBe(last + 3600);
  });

  it('starts again from the server history after a reconnection', () => {
    const model = new SidebarModel(1);
    model.handle(hello());
    model.handle(history(100));
    model.handle(hello());
    model.handle(history(3, T0 + 500));
    expect(model.series.aligned([])[0]).toEqual([T0 + 500, T0 + 501, T0 + 502]);
  });

  it('stops telling a listener once it unsubscribed', () => {
    const model = new SidebarModel(1);
    const changes: ModelChange[] = [];
    const listener = (_: SidebarModel, change: ModelChange) => {
      changes.push(change);
    };
    model.changed.connect(listener);
    model.changed.disconnect(listener);
    model.handle(hello());
    expect(changes).toEqual([]);
  });
});
