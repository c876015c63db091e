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

import { IDevicesReply, isDevicesReply } from './protocol';
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
    const url = apiUrl(this._settings, 'devices');
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
    const body: unknown = await reply.json();
    if (!isDevicesReply(body)) {
      throw new ApiError(
        reply.status,
        url,
        `${url} answered something other than the devices reply`
      );
    }
    return body;
  }

  openStream(intervalS: number): ISocketLike {
    return this._socket(streamUrl(this._settings, intervalS));
  }
}
