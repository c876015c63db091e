"""gpuwidget's Jupyter server extension.

jupyter_server finds the extension by the top-level module name ``gpuwidget``
(``jupyter-config/server-config/gpuwidget.json`` enables it, and a wheel installs
that file into ``etc/jupyter/jupyter_server_config.d``). ``gpuwidget`` re-exports
``_jupyter_server_extension_points`` from here, which points the server at this
module, where ``_load_jupyter_server_extension`` is called once at start-up.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jupyter_server.serverapp import ServerApp

EXTENSION_NAME = "gpuwidget"


def _jupyter_server_extension_points() -> list[dict[str, str]]:
    return [{"module": "gpuwidget.server"}]


def _load_jupyter_server_extension(serverapp: ServerApp) -> None:
    """Called by jupyter_server once, after its web application exists: add the routes."""
    from jupyter_server.utils import url_path_join

    from gpuwidget.server.static import BOKEHJS_ROUTE, BokehJSHandler

    web_app = serverapp.web_app
    base_url = web_app.settings["base_url"]
    web_app.add_handlers(".*$", [(url_path_join(base_url, BOKEHJS_ROUTE), BokehJSHandler)])
    serverapp.log.info("gpuwidget server extension loaded")
