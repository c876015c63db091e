import { GPU_METRICS, gpuCharts, hostCharts } from '../src/metrics';
import {
  HISTORY_METRICS,
  inHistory,
  parseClusterReply,
  parseMessage,
  parseSnapshot,
  parseStale,
  parseStalled
} from '../src/protocol';
import { clusterReply, gpuDevices, history } from './fixtures';

describe('parseMessage', () => {
  it('reads each message type of the contract', () => {
    const frames = [
      { type: 'hello', devices: gpuDevices() },
      history(3),
      { type: 'sample', t: 1, values: { 'gpu0.util': 88, 'gpu0.power': null } },
      { type: 'processes', t: 1, gpus: { gpu0: [] } }
    ];
    for (const frame of frames) {
      const parsed = parseMessage(JSON.stringify(frame));
      // hello and sample gain the (empty) stalled sources and stale devices an older server leaves out.
      const stalled = ['hello', 'sample'].includes(frame.type)
        ? { stalled: [], stale: {} }
        : {};
      expect(parsed).toEqual({ ...frame, ...stalled });
    }
  });

  it('reads the stalled sources of samples and hellos, defensively', () => {
    const stalled = [{ source: 'GPU 1', since_s: 12.4, devices: ['gpu1'] }];
    expect(
      parseMessage(
        JSON.stringify({ type: 'sample', t: 1, values: {}, stalled })
      )
    ).toMatchObject({ stalled });
    expect(
      parseMessage(
        JSON.stringify({ type: 'hello', devices: gpuDevices(), stalled })
      )
    ).toMatchObject({ stalled });
    expect(parseStalled(undefined)).toEqual([]);
    expect(parseStalled('GPU 1')).toEqual([]);
    expect(
      parseStalled([
        { source: 'GPU 1', since_s: 3 },
        { source: 'GPU 2' },
        { since_s: 4 },
        null,
        { source: 'host', since_s: -1 }
      ])
    ).toEqual([
      { source: 'GPU 1', since_s: 3, devices: [] },
      { source: 'host', since_s: 0, devices: [] }
    ]);
  });

  it('reads the stale devices of samples and hellos, their last values and age, defensively', () => {
    const stale = {
      gpu5: {
        source: 'GPU 5',
        hung: true,
        t: 1764490110.6,
        age_s: 13.4,
        values: { 'gpu5.util': 35, 'gpu5.mem_used': 40 * 2 ** 30 }
      }
    };
    expect(
      parseMessage(JSON.stringify({ type: 'sample', t: 1, values: {}, stale }))
    ).toMatchObject({ stale });
    expect(
      parseMessage(
        JSON.stringify({ type: 'hello', devices: gpuDevices(), stale })
      )
    ).toMatchObject({ stale });
    expect(parseStale(undefined)).toEqual({});
    expect(parseStale([stale])).toEqual({});
    expect(
      parseStale({
        gpu0: { source: 'GPU 0', t: null, age_s: null, values: null },
        gpu1: { source: 'gpus', hung: false, age_s: -2, values: { x: 'y' } },
        gpu2: { hung: true },
        gpu3: 'GPU 3'
      })
    ).toEqual({
      gpu0: { source: 'GPU 0', hung: true, t: null, age_s: null, values: {} },
      gpu1: {
        source: 'gpus',
        hung: false,
        t: null,
        age_s: 0,
        values: { x: null }
      }
    });
  });

  it('ignores unknown types and malformed frames', () => {
    const bad = [
      'not json',
      '[]',
      '{"type": "bye"}',
      '{"type": "hello", "devices": {"gpu_found": true}}',
      '{"type": "history", "t": [1, 2], "columns": {"cpu.util": [1]}}',
      '{"type": "history", "t": [2, 1], "columns": {"cpu.util": [1, 2]}}',
      '{"type": "history", "t": [1, "2"], "columns": {"cpu.util": [1, 2]}}',
      '{"type": "sample", "t": "now", "values": {}}',
      '{"type": "processes", "t": 1, "gpus": {"gpu0": {}}}'
    ];
    for (const text of bad) {
      expect(parseMessage(text)).toBeNull();
    }
  });
});

describe('the stream history', () => {
  it('reads large values written as digits and an exponent', () => {
    const text =
      '{"type":"history","t":[1764490000.0,1764490009.5],' +
      '"columns":{"gpu0.mem_used":[812e8,null],"gpu0.util":[37.3,0]}}';
    expect(parseMessage(text)).toEqual({
      type: 'history',
      t: [1764490000, 1764490009.5],
      columns: {
        'gpu0.mem_used': [81_200_000_000, null],
        'gpu0.util': [37.3, 0]
      }
    });
  });

  it('carries every column the charts draw, and no other', () => {
    const device = gpuDevices(1).devices[0];
    const none = () => null;
    const drawn: string[] = [];
    for (const chart of [
      ...gpuCharts(device, GPU_METRICS, none),
      ...gpuCharts({ ...device, gpm: true }, GPU_METRICS, none),
      ...hostCharts(null, none)
    ]) {
      drawn.push(...chart.lines.map(line => line.column));
    }
    expect(drawn.every(inHistory)).toBe(true);
    expect(
      HISTORY_METRICS.map(metric =>
        metric.includes('.') ? metric : `gpu0.${metric}`
      ).sort()
    ).toEqual([...new Set(drawn)].sort());
    expect(inHistory('gpu0.sm_clock')).toBe(false);
    expect(inHistory('gpu12.power')).toBe(true);
    expect(inHistory('mem.total')).toBe(false);
  });
});

describe('parseSnapshot', () => {
  it('takes the devices, the latest row, the processes and the stalled sources', () => {
    const snapshot = parseSnapshot({
      devices: gpuDevices(1),
      history: { t: [], columns: {} },
      latest: { t: 5, values: { 'gpu0.util': 40 } },
      processes: { type: 'processes', t: 5, gpus: { gpu0: [] } },
      stalled: [{ source: 'GPU 0', since_s: 2 }]
    });
    expect(snapshot).toEqual({
      devices: gpuDevices(1),
      latest: { t: 5, values: { 'gpu0.util': 40 } },
      processes: { type: 'processes', t: 5, gpus: { gpu0: [] } },
      stalled: [{ source: 'GPU 0', since_s: 2, devices: [] }],
      stale: {}
    });
  });

  it('refuses a reply without devices, and reads a missing latest row as none', () => {
    expect(parseSnapshot({ latest: {} })).toBeNull();
    expect(parseSnapshot({ devices: gpuDevices(1) })).toMatchObject({
      latest: { t: null, values: {} },
      processes: null,
      stalled: [],
      stale: {}
    });
  });
});

describe('parseClusterReply', () => {
  it('reads the contract as it is', () => {
    const reply = clusterReply(2, 3);
    expect(parseClusterReply(JSON.parse(JSON.stringify(reply)))).toEqual(reply);
  });

  it('drops entries of the wrong shape and keeps the rest', () => {
    const parsed = parseClusterReply({
      configured: true,
      source: 'prometheus?',
      error: null,
      step_s: 'x',
      hosts: [
        {
          host: 'a',
          gpus: [{ gpu: '0', util: [0.5, 'x', null] }, { util: [] }]
        },
        { gpus: [] },
        'b'
      ]
    });
    expect(parsed).toMatchObject({
      source: null,
      step_s: 15,
      hosts: [
        {
          host: 'a',
          gpus: [
            {
              gpu: '0',
              uuid: null,
              holder: null,
              util: [0.5, null, null],
              power_w: []
            }
          ]
        }
      ]
    });
    expect(parseClusterReply({ hosts: [] })).toBeNull();
  });
});
