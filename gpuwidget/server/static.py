"""Serves BokehJS from the server's own bokeh package, so live plots load with no CDN.

The page asks for ``{base_url}gpuwidget/static/bokeh-<version>.min.js`` when a live plot
needs BokehJS of that version and the page has none; a kernel started by this server first
asks (HEAD) whether it is served (gpuwidget/ui/bokehjs.py), so that it sends the page a
small loader instead of BokehJS inline. The file is served only when the server's bokeh is
that exact version, because BokehJS refuses documents from another version; otherwise the
kernel's inline copy is the fallback.
"""

from __future__ import annotations

from pathlib import Path

from jupyter_server.auth.decorator import authorized
from jupyter_server.base.handlers import APIHandler
from tornado import web

AUTH_RESOURCE = "gpuwidget"
BOKEHJS_ROUTE = r"/gpuwidget/static/bokeh-(?P<version>[0-9A-Za-z.+-]+)\.min\.js"


def bokehjs_file() -> tuple[str, Path]:
    """The installed bokeh's version and the path of its core bundle."""
    import bokeh
    from bokeh.util.paths import bokehjs_path

    return bokeh.__version__, Path(bokehjs_path()) / "js" / "bokeh.min.js"


class BokehJSHandler(APIHandler):
    """GET the BokehJS core bundle of one exact version (404 if this server has another)."""

    auth_resource = AUTH_RESOURCE

    @web.authenticated
    @authorized
    async def get(self, version: str) -> None:
        path = self._bundle(version)
        self.set_header("Cache-Control", "private, max-age=31536000, immutable")
        await self.finish(path.read_bytes(), set_content_type="application/javascript; charset=utf-8")

    @web.authenticated
    @authorized
    async def head(self, version: str) -> None:
        """Is this version served? (asked by kernels before they choose a loader)"""
        path = self._bundle(version)
        self.set_header("Content-Type", "application/javascript; charset=utf-8")
        self.set_header("Content-Length", str(path.stat().st_size))
        await self.finish()

    def _bundle(self, version: str) -> Path:
        installed, path = bokehjs_file()
        if version != installed:
            raise web.HTTPError(404, f"this server has BokehJS {installed}, not {version}")
        return path
