/**
 * The server's routes (docs/server-api.md) as URLs and calls, built from the app's
 * server settings so a non-root base URL, a token and a remote wsUrl all work.
 *
 * Only types come from @jupyterlab/services here: index.ts passes in
 * `ServerConnection.makeRequest` (which adds the token and XSRF headers), so this
 * module runs in jest as it is. URLs are joined by JupyterLab's own `URLExt.join`.
 */

import { URLExt } from '@jupyterlab/coreutils';
import type { ServerConnection } from '@jupyterlab/services';

import {
  IClusterReply,
  IDevicesReply,
  ISnapshotReply,
  isDevicesReply,
  parseClusterReply,
  parseSnapshot
} from './protocol';
import { ISocketLike } from './stream';

/** Where the routes live, under the server's base URL. */
export const API_PATH = 'gpuwidget/api';

export type ServerSettingsLike = Pick<
  ServerConnection.ISettings,
  'baseUrl' | 'wsUrl' | 'token' | 'appendToken'
>;

export type Fetcher = (url: string, init: RequestInit) => Promise<Response>;
export type SocketFactory = (url: string) => ISocketLike;

/** A reply other than 2xx. */
export class ApiError extends Error {
  readonly status: number;
  readonly url: string;

  constructor(status: number, url: string, message: string) {
    super(message);
    this.name = 'ApiError';
    this.status = status;
    this.url = url;
  }
}

/** 404 on a gpuwidget route: the server extension is not installed or not enabled. */
export class ServerExtensionMissing extends ApiError {
  constructor(url: string) {
    super(
      404,
      url,
      `the gpuwidget server extension is not running (404 from ${url})`
    );
    this.name = 'ServerExtensionMissing';
  }
}

/** `{baseUrl}gpuwidget/api/{route}` */
export function apiUrl(settings: ServerSettingsLike, route: string): string {
  return URLExt.join(settings.baseUrl, API_PATH, route);
}

/**
 * `{wsUrl}gpuwidget/api/stream?interval=S`. The token goes in the query only where the
 * app's own kernel sockets put it (`appendToken`: a wsUrl on another host); otherwise
 * the browser's login cookie authenticates, as it does for kernels.
 */
export function streamUrl(
  settings: ServerSettingsLike,
  intervalS: number
): string {
  const query = new URLSearchParams({ interval: String(intervalS) });
  if (settings.appendToken && settings.token) {
    query.set('token', settings.token);
  }
  return `${URLExt.join(settings.wsUrl, API_PATH, 'stream')}?${query.toString()}`;
}

/** The browser's own WebSocket. */
export const browserSocket: SocketFactory = url => new WebSocket(url);

/** The routes the sidebar uses. */
export interface IGpuApi {
  devices(): Promise<IDevicesReply>;
  openStream(intervalS: number): ISocketLike;
  /** The latest values without history (`window=0`): the status bar's poll. */
  snapshot(): Promise<ISnapshotReply>;
  /** The cluster's GPUs over the last `windowS` seconds, from Prometheus through the server. */
  cluster(windowS: number): Promise<IClusterReply>;
}

export class ServerApi implements IGpuApi {
  private _settings: ServerSettingsLike;
  private _fetch: Fetcher;
  private _socket: SocketFactory;

  constructor(
    settings: ServerSettingsLike,
    fetcher: Fetcher,
    socket: SocketFactory = browserSocket
  ) {
    this._settings = settings;
    this._fetch = fetcher;
    this._socket = socket;
  }

  /**
   * `GET /devices`; rejects with ServerExtensionMissing on 404, ApiError on other
   * failures (status 0: no answer at all, e.g. the server is restarting).
   */
  async devices(): Promise<IDevicesReply> {
    return this._get('devices', 'the devices reply', body =>
      isDevicesReply(body) ? body : null
    );
  }

  async snapshot(): Promise<ISnapshotReply> {
    return this._get('snapshot?window=0', 'a snapshot', parseSnapshot);
  }

  async cluster(windowS: number): Promise<IClusterReply> {
    const query = new URLSearchParams({ window_s: String(windowS) });
    return this._get(
      `cluster?${query.toString()}`,
      'the cluster reply',
      parseClusterReply
    );
  }

  /**
   * `GET {route}`, its JSON body checked by `parse`; rejects with ServerExtensionMissing
   * on 404, ApiError on other failures (status 0: no answer at all, e.g. the server is
   * restarting).
   */
  private async _get<T>(
    route: string,
    what: string,
    parse: (body: unknown) => T | null
  ): Promise<T> {
    const url = apiUrl(this._settings, route);
    let reply: Response;
    try {
      reply = await this._fetch(url, { method: 'GET' });
    } catch {
      throw new ApiError(0, url, 'cannot reach the server');
    }
    if (reply.status === 404) {
      throw new ServerExtensionMissing(url);
    }
    if (!reply.ok) {
      throw new ApiError(
        reply.status,
        url,
        `${url} answered ${reply.status} ${reply.statusText}`.trim()
      );
    }
    let parsed: T | null = null;
    try {
      parsed = parse(await reply.json());
    } catch {
      parsed = null;
    }
    if (parsed === null) {
      throw new ApiError(
        reply.status,
        url,
        `${url} answered something other than ${what}`
      );
    }
    return parsed;
  }

  openStream(intervalS: number): ISocketLike {
    return this._socket(streamUrl(this._settings, intervalS));
  }
}
