"""Serves BokehJS from the server's own bokeh package, so live plots load with no CDN.

The kernel's live view asks for ``{base_url}gpuwidget/static/bokeh-<version>.min.js``
whenever the page has no BokehJS of its version (after a page reload, say). The file
is served only when the server's bokeh is that exact version, because BokehJS refuses
documents from another version; otherwise the kernel's inline copy is the fallback.
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
        installed, path = bokehjs_file()
        if version != installed:
            raise web.HTTPError(404, f"this server has BokehJS {installed}, not {version}")
        self.set_header("Cache-Control", "private, max-age=31536000, immutable")
        await self.finish(path.read_bytes(), set_content_type="application/javascript; charset=utf-8")
