import { parseMessage } from '../src/protocol';
import { gpuDevices, history } from './fixtures';

describe('parseMessage', () => {
  it('reads each message type of the contract', () => {
    const frames = [
      { type: 'hello', devices: gpuDevices() },
      history(3),
      { type: 'sample', t: 1, values: { 'gpu0.util': 88, 'gpu0.power': null } },
      { type: 'processes', t: 1, gpus: { gpu0: [] } }
    ];
    for (const frame of frames) {
      expect(parseMessage(JSON.stringify(frame))).toEqual(frame);
    }
  });

  it('ignores unknown types and malformed frames', () => {
    const bad = [
      'not json',
      '[]',
      '{"type": "bye"}',
      '{"type": "hello", "devices": {"gpu_found": true}}',
      '{"type": "history", "t": [1, 2], "columns": {"cpu.util": [1]}}',
      '{"type": "sample", "t": "now", "values": {}}',
      '{"type": "processes", "t": 1, "gpus": {"gpu0": {}}}'
    ];
    for (const text of bad) {
      expect(parseMessage(text)).toBeNull();
    }
  });
});
