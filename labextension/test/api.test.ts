import {
  ApiError,
  ServerApi,
  ServerExtensionMissing,
  ServerSettingsLike,
  apiUrl,
  streamUrl
} from '../src/api';
import { FakeSocket } from './fakes';
import { clusterReply, gpuDevices } from './fixtures';

const SETTINGS: ServerSettingsLike = {
  baseUrl: 'http://127.0.0.1:8888/user/ada/',
  wsUrl: 'ws://127.0.0.1:8888/user/ada/',
  token: 'secret',
  appendToken: false
};

function reply(status: number, body: unknown): Response {
  return {
    status,
    ok: status >= 200 && status < 300,
    statusText: status === 404 ? 'Not Found' : '',
    json: async () => body
  } as Response;
}

describe('URLs', () => {
  it('joins the base URL and the route with one slash, whatever the base ends with', () => {
    const at = (baseUrl: string) => apiUrl({ ...SETTINGS, baseUrl }, 'devices');
    expect(at('http://h/base/')).toBe('http://h/base/gpuwidget/api/devices');
    expect(at('http://h/base')).toBe('http://h/base/gpuwidget/api/devices');
    expect(at('http://h')).toBe('http://h/gpuwidget/api/devices');
  });

  it('puts the routes under a non-root base URL', () => {
    expect(apiUrl(SETTINGS, 'devices')).toBe(
      'http://127.0.0.1:8888/user/ada/gpuwidget/api/devices'
    );
  });

  it('asks the stream for the interval, and leaves the token to the cookie on the same host', () => {
    expect(streamUrl(SETTINGS, 2)).toBe(
      'ws://127.0.0.1:8888/user/ada/gpuwidget/api/stream?interval=2'
    );
  });

  it('adds the token where the app adds it to its own sockets', () => {
    const remote = {
      ...SETTINGS,
      wsUrl: 'wss://other/base/',
      appendToken: true
    };
    expect(streamUrl(remote, 0.5)).toBe(
      'wss://other/base/gpuwidget/api/stream?interval=0.5&token=secret'
    );
  });
});

describe('ServerApi', () => {
  it('returns the devices reply', async () => {
    const urls: string[] = [];
    const api = new ServerApi(SETTINGS, async url => {
      urls.push(url);
      return reply(200, gpuDevices(2));
    });
    const devices = await api.devices();
    expect(devices.devices.map(d => d.id)).toEqual(['gpu0', 'gpu1']);
    expect(urls).toEqual([
      'http://127.0.0.1:8888/user/ada/gpuwidget/api/devices'
    ]);
  });

  it('turns a 404 into "the server extension is missing"', async () => {
    const api = new ServerApi(SETTINGS, async () =>
      reply(404, { message: 'Not Found' })
    );
    const error = await api.devices().catch(e => e);
    expect(error).toBeInstanceOf(ServerExtensionMissing);
    expect(error.url).toBe(
      'http://127.0.0.1:8888/user/ada/gpuwidget/api/devices'
    );
  });

  it('reports other failures with their status', async () => {
    const api = new ServerApi(SETTINGS, async () => reply(403, {}));
    const error = await api.devices().catch(e => e);
    expect(error).toBeInstanceOf(ApiError);
    expect(error).not.toBeInstanceOf(ServerExtensionMissing);
    expect(error.status).toBe(403);
  });

  it('says plainly when the server does not answer at all', async () => {
    const api = new ServerApi(SETTINGS, async () => {
      throw new TypeError('Failed to fetch');
    });
    const error = await api.devices().catch(e => e);
    expect(error).toBeInstanceOf(ApiError);
    expect(error.status).toBe(0);
    expect(error.message).toBe('cannot reach the server');
  });

  it('refuses a reply that is not the devices contract', async () => {
    const api = new ServerApi(SETTINGS, async () =>
      reply(200, { devices: 'none' })
    );
    await expect(api.devices()).rejects.toBeInstanceOf(ApiError);
  });

  it('opens the stream socket at the stream URL', () => {
    const api = new ServerApi(
      SETTINGS,
      async () => reply(200, {}),
      url => new FakeSocket(url)
    );
    const socket = api.openStream(1) as FakeSocket;
    expect(socket.url).toBe(
      'ws://127.0.0.1:8888/user/ada/gpuwidget/api/stream?interval=1'
    );
  });

  it('asks for a snapshot without history, and the cluster for its window', async () => {
    const urls: string[] = [];
    const api = new ServerApi(SETTINGS, async url => {
      urls.push(url);
      return url.includes('/cluster')
        ? reply(200, clusterReply(1, 1))
        : reply(200, {
            devices: gpuDevices(1),
            latest: { t: 1, values: { 'gpu0.util': 3 } }
          });
    });
    expect((await api.snapshot()).latest.values).toEqual({ 'gpu0.util': 3 });
    expect((await api.cluster(3600)).hosts[0].host).toBe('host-a');
    expect(urls).toEqual([
      'http://127.0.0.1:8888/user/ada/gpuwidget/api/snapshot?window=0',
      'http://127.0.0.1:8888/user/ada/gpuwidget/api/cluster?window_s=3600'
    ]);
  });

  it('reports a cluster route that answers something else, or fails', async () => {
    const odd = new ServerApi(SETTINGS, async () => reply(200, { hosts: 3 }));
    await expect(odd.cluster(3600)).rejects.toThrow(
      'answered something other than the cluster reply'
    );
    const failing = new ServerApi(SETTINGS, async () => reply(500, {}));
    await expect(failing.cluster(3600)).rejects.toMatchObject({ status: 500 });
  });
});
