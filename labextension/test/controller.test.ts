import { ApiError, IGpuApi, ServerExtensionMissing } from '../src/api';
import {
  CLUSTER_REFRESH_MS,
  STATUS_POLL_MS,
  STOP_GRACE_MS,
  SidebarController
} from '../src/controller';
import { SidebarModel } from '../src/model';
import { IClusterReply, IDevicesReply, ISnapshotReply } from '../src/protocol';
import { FakeClock, FakeSocket, settle } from './fakes';
import {
  T0,
  clusterReply,
  gpuDevices,
  hello,
  history,
  noGpuDevices,
  sample
} from './fixtures';

/** A server the test switches between up, down and "no gpuwidget routes". */
class FakeServer implements IGpuApi {
  state: 'up' | 'down' | 'missing' = 'up';
  reply: IDevicesReply = gpuDevices();
  sockets: FakeSocket[] = [];
  requests = 0;
  intervals: number[] = [];
  snapshots = 0;
  clusterAsks: number[] = [];
  clusterState: 'up' | 'down' | 'prometheus-down' = 'up';
  /** The time of the next snapshot's latest row. */
  snapshotT = T0;

  async snapshot(): Promise<ISnapshotReply> {
    this.snapshots += 1;
    if (this.state === 'missing') {
      throw new ServerExtensionMissing('http://h/gpuwidget/api/snapshot');
    }
    if (this.state === 'down') {
      throw new ApiError(
        0,
        'http://h/gpuwidget/api/snapshot',
        'cannot reach the server'
      );
    }
    this.snapshotT += 5;
    return {
      devices: this.reply,
      latest: { t: this.snapshotT, values: { 'gpu0.util': 50 } },
      processes: null,
      stalled: [],
      stale: {}
    };
  }

  async cluster(windowS: number): Promise<IClusterReply> {
    this.clusterAsks.push(windowS);
    if (this.clusterState === 'down') {
      throw new ApiError(
        502,
        'http://h/gpuwidget/api/cluster',
        'cluster answered 502 Bad Gateway'
      );
    }
    if (this.clusterState === 'prometheus-down') {
      return {
        ...clusterReply(0, 0),
        error: 'Prometheus at http://prom:9090 cannot be reached: refused'
      };
    }
    return clusterReply();
  }

  async devices(): Promise<IDevicesReply> {
    this.requests += 1;
    if (this.state === 'missing') {
      throw new ServerExtensionMissing('http://h/gpuwidget/api/devices');
    }
    if (this.state === 'down') {
      throw new TypeError('Failed to fetch');
    }
    return this.reply;
  }

  openStream(interval: number): FakeSocket {
    this.intervals.push(interval);
    const socket = new FakeSocket();
    this.sockets.push(socket);
    return socket;
  }

  /** The newest socket opens and says hello and history, as the server does. */
  greet(points = 5): FakeSocket {
    const socket = this.sockets[this.sockets.length - 1];
    socket.open();
    socket.send(hello(this.reply));
    socket.send(history(points));
    return socket;
  }
}

function setup(interval = 1) {
  const server = new FakeServer();
  const clock = new FakeClock();
  const model = new SidebarModel(interval);
  const controller = new SidebarController(server, model, {
    timers: clock,
    now: () => clock.now,
    backoff: { initialMs: 500, maxMs: 8000, factor: 2, jitter: 0 }
  });
  return { server, clock, model, controller };
}

describe('SidebarController', () => {
  it('fills the model from /devices, hello, history and samples', async () => {
    const { server, model, controller } = setup();
    controller.start();
    await settle();
    server.greet(5);
    server.sockets[0].send(sample(T0 + 5, { 'gpu0.util': 87 }));
    expect(model.connection.kind).toBe('live');
    expect(model.series.length).toBe(6);
    expect(model.series.latest('gpu0.util')).toBe(87);
  });

  it('ignores frames it cannot read', async () => {
    const { server, model, controller } = setup();
    controller.start();
    await settle();
    const socket = server.greet(5);
    socket.onmessage?.({ data: 'not json' } as MessageEvent);
    socket.send({ type: 'future-message', x: 1 });
    expect(model.series.length).toBe(5);
  });

  it('says the server extension is missing on 404 and does not retry', async () => {
    const { server, clock, model, controller } = setup();
    server.state = 'missing';
    controller.start();
    await settle();
    expect(model.connection).toEqual({
      kind: 'missing',
      url: 'http://h/gpuwidget/api/devices'
    });
    await clock.advance(120_000);
    expect(server.requests).toBe(1);
    expect(server.sockets).toHaveLength(0);
  });

  it('comes back after a server restart, with the new server history', async () => {
    const { server, clock, model, controller } = setup();
    controller.start();
    await settle();
    server.greet(100);
    server.state = 'down';
    server.sockets[0].drop();
    expect(model.connection).toMatchObject({ kind: 'retrying', delayMs: 500 });
    await clock.advance(500);
    expect(model.connection).toMatchObject({ kind: 'retrying', delayMs: 1000 });
    server.state = 'up';
    await clock.advance(1000);
    server.greet(3);
    expect(model.connection.kind).toBe('live');
    expect(model.series.length).toBe(3);
    expect(server.sockets).toHaveLength(2);
  });

  it('is silent while stopped: no request, no socket, no timer', async () => {
    const { server, clock, model, controller } = setup();
    controller.start();
    await settle();
    server.greet();
    controller.stop();
    expect(server.sockets[0].closed).toBe(true);
    expect(model.connection.kind).toBe('stopped');
    const requests = server.requests;
    await clock.advance(600_000);
    expect(server.requests).toBe(requests);
    expect(clock.pendingCount).toBe(0);
    // The last values stay for the status bar.
    expect(model.series.length).toBe(5);
  });

  it('keeps the connection through a hide and show within the grace period', async () => {
    const { server, clock, controller } = setup();
    controller.setVisible(true);
    await settle();
    server.greet();
    controller.setVisible(false);
    await clock.advance(STOP_GRACE_MS / 2);
    controller.setVisible(true);
    await clock.advance(STOP_GRACE_MS * 2);
    expect(server.sockets).toHaveLength(1);
    expect(server.sockets[0].closed).toBe(false);
    expect(server.requests).toBe(1);
  });

  it('disconnects once hidden for the grace period', async () => {
    const { server, clock, model, controller } = setup();
    controller.setVisible(true);
    await settle();
    server.greet();
    controller.setVisible(false);
    expect(server.sockets[0].closed).toBe(false);
    await clock.advance(STOP_GRACE_MS);
    expect(server.sockets[0].closed).toBe(true);
    expect(model.connection.kind).toBe('stopped');
  });

  it('does not connect when hidden before it was ever shown', async () => {
    const { server, clock, controller } = setup();
    controller.setVisible(false);
    await clock.advance(STOP_GRACE_MS * 2);
    expect(server.requests).toBe(0);
  });

  it('asks for a new interval by reconnecting, only while running', async () => {
    const { server, controller } = setup(1);
    controller.setInterval(2);
    expect(server.requests).toBe(0);
    controller.start();
    await settle();
    server.greet();
    controller.setInterval(5);
    await settle();
    expect(server.intervals).toEqual([2, 5]);
    expect(server.sockets[0].closed).toBe(true);
  });

  it('shows host metrics and the reason when the machine has no GPU', async () => {
    const { server, model, controller } = setup();
    server.reply = noGpuDevices();
    controller.start();
    await settle();
    server.greet();
    expect(model.devices?.gpu_found).toBe(false);
    expect(model.devices?.message).toContain('no GPU found');
    expect(model.series.has('cpu.util')).toBe(true);
  });
});

describe('SidebarController while the panel is closed (the status bar)', () => {
  it('asks for the latest values every STATUS_POLL_MS from the start, without a socket', async () => {
    const { server, clock, model, controller } = setup();
    controller.pollWhileClosed(STATUS_POLL_MS / 1000);
    await settle();
    expect(server.snapshots).toBe(1);
    expect(model.connection).toEqual({
      kind: 'polling',
      everyS: 5,
      error: null
    });
    expect(model.series.latest('gpu0.util')).toBe(50);
    await clock.advance(STATUS_POLL_MS * 3);
    expect(server.snapshots).toBe(4);
    expect(model.series.length).toBe(4);
    expect(server.sockets).toHaveLength(0);
    expect(server.requests).toBe(0); // no /devices either: the snapshot carries them
  });

  it('stops asking while the panel is open or the browser tab is hidden, and resumes after', async () => {
    const { server, clock, model, controller } = setup();
    controller.pollWhileClosed(STATUS_POLL_MS / 1000);
    await settle();
    controller.setVisible(true);
    await settle();
    server.greet();
    const asked = server.snapshots;
    await clock.advance(STATUS_POLL_MS * 4);
    expect(server.snapshots).toBe(asked);

    controller.setVisible(false);
    await clock.advance(STOP_GRACE_MS);
    expect(server.sockets[0].closed).toBe(true);
    expect(model.connection.kind).toBe('polling');
    await clock.advance(STATUS_POLL_MS);
    expect(server.snapshots).toBeGreaterThan(asked);

    controller.setPageVisible(false);
    const hidden = server.snapshots;
    await clock.advance(STATUS_POLL_MS * 10);
    expect(server.snapshots).toBe(hidden);
    expect(clock.pendingCount).toBe(0);
    controller.setPageVisible(true);
    await clock.advance(STATUS_POLL_MS);
    expect(server.snapshots).toBeGreaterThan(hidden);
  });

  it('says why when the server does not answer, and recovers', async () => {
    const { server, clock, model, controller } = setup();
    server.state = 'down';
    controller.pollWhileClosed(STATUS_POLL_MS / 1000);
    await settle();
    expect(model.connection).toEqual({
      kind: 'polling',
      everyS: 5,
      error: 'cannot reach the server'
    });
    server.state = 'up';
    await clock.advance(STATUS_POLL_MS);
    expect(model.connection).toMatchObject({ kind: 'polling', error: null });
  });

  it('follows the setting: another period, or no poll at all', async () => {
    const { server, clock, model, controller } = setup();
    controller.pollWhileClosed(5);
    await settle();
    controller.pollWhileClosed(30);
    expect(model.connection).toMatchObject({ kind: 'polling', everyS: 30 });
    await clock.advance(29_000);
    expect(server.snapshots).toBe(1);
    await clock.advance(1000);
    expect(server.snapshots).toBe(2);
    controller.pollWhileClosed(0);
    expect(model.connection.kind).toBe('stopped');
    await clock.advance(600_000);
    expect(server.snapshots).toBe(2);
    expect(clock.pendingCount).toBe(0);
  });

  it('gives up on a missing server extension', async () => {
    const { server, clock, model, controller } = setup();
    server.state = 'missing';
    controller.pollWhileClosed(STATUS_POLL_MS / 1000);
    await settle();
    expect(model.connection.kind).toBe('missing');
    await clock.advance(STATUS_POLL_MS * 10);
    expect(server.snapshots).toBe(1);
  });
});

describe('SidebarController and the cluster', () => {
  it('makes no cluster request when the server has no cluster', async () => {
    const { server, clock, model, controller } = setup();
    controller.setVisible(true);
    await settle();
    server.greet();
    await clock.advance(CLUSTER_REFRESH_MS * 3);
    expect(server.clusterAsks).toEqual([]);
    expect(model.cluster.kind).toBe('off');
  });

  it('asks for the last hour at once and every 15 s while shown, never while hidden', async () => {
    const { server, clock, model, controller } = setup();
    server.reply = { ...gpuDevices(), cluster: true };
    controller.setVisible(true);
    await settle();
    expect(server.clusterAsks).toEqual([3600]);
    expect(model.cluster.kind).toBe('ready');
    await clock.advance(CLUSTER_REFRESH_MS * 2);
    expect(server.clusterAsks).toHaveLength(3);

    controller.setVisible(false);
    await clock.advance(CLUSTER_REFRESH_MS * 4);
    expect(server.clusterAsks).toHaveLength(3);

    // Shown again long after the last answer: asks at once.
    controller.setVisible(true);
    await settle();
    expect(server.clusterAsks).toHaveLength(4);
    // Hidden and shown within a period (JupyterLab does that when a notebook opens): no extra ask.
    controller.setVisible(false);
    await clock.advance(1000);
    controller.setVisible(true);
    await settle();
    expect(server.clusterAsks).toHaveLength(4);
    await clock.advance(CLUSTER_REFRESH_MS);
    expect(server.clusterAsks).toHaveLength(5);
    controller.setPageVisible(false);
    await clock.advance(CLUSTER_REFRESH_MS * 4);
    expect(server.clusterAsks).toHaveLength(5);
  });

  it("keeps asking after the stream's hello, which does not repeat the cluster flag", async () => {
    const { server, clock, model, controller } = setup();
    server.reply = { ...gpuDevices(), cluster: true };
    controller.setVisible(true);
    await settle();
    const socket = server.sockets[0];
    socket.open();
    socket.send(hello(gpuDevices())); // as the server sends it: no `cluster`
    expect(model.devices?.cluster).toBe(true);
    await clock.advance(CLUSTER_REFRESH_MS);
    expect(server.clusterAsks).toHaveLength(2);
    expect(model.cluster.kind).toBe('ready');
  });

  it('keeps the last cluster on screen and says what failed', async () => {
    const { server, clock, model, controller } = setup();
    server.reply = { ...gpuDevices(), cluster: true };
    controller.setVisible(true);
    await settle();
    server.clusterState = 'down';
    await clock.advance(CLUSTER_REFRESH_MS);
    expect(model.cluster).toMatchObject({
      kind: 'error',
      message: 'cluster answered 502 Bad Gateway'
    });
    expect(model.cluster.kind === 'error' && model.cluster.last).not.toBeNull();
    server.clusterState = 'up';
    await clock.advance(CLUSTER_REFRESH_MS);
    expect(model.cluster.kind).toBe('ready');

    // The route answers, but Prometheus did not: the same, with the route's words.
    server.clusterState = 'prometheus-down';
    await clock.advance(CLUSTER_REFRESH_MS);
    expect(model.cluster).toMatchObject({
      kind: 'error',
      message: 'Prometheus at http://prom:9090 cannot be reached: refused',
      last: clusterReply()
    });
  });
});
