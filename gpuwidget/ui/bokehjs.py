"""Where the page gets BokehJS from: does the Jupyter server that started this kernel serve it?

gpuwidget's server extension serves the installed BokehJS at
``{base_url}gpuwidget/static/bokeh-<version>.min.js`` (gpuwidget/server/static.py), only in
the exact version it has. A kernel started by that server can ask it directly: the server
writes its URL and token to ``jpserver-<pid>.json`` in Jupyter's runtime directory, and the
kernel's parent process is the server. Where the answer is yes, the live view sends the
page a loader of a few hundred bytes instead of BokehJS inline (1.3 MB); anywhere else (no
extension, another bokeh version, a kernel some other front-end started) it goes inline.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from pathlib import Path

# The answer cannot change while this kernel lives (same parent, same server).
_answers: dict[str, bool] = {}
TIMEOUT_S = 2.0


def parent_server_info() -> dict | None:
    """The runtime info of the Jupyter server that started this process, or None."""
    try:
        from jupyter_core.paths import jupyter_runtime_dir
    except ImportError:
        return None
    path = Path(jupyter_runtime_dir()) / f"jpserver-{os.getppid()}.json"
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def server_serves_bokehjs(version: str) -> bool:
    """True if this kernel's Jupyter server answers for BokehJS ``version`` (asked once per kernel)."""
    if version not in _answers:
        _answers[version] = _ask(version)
    return _answers[version]


def _ask(version: str) -> bool:
    info = parent_server_info()
    url = info.get("url") if info else None
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        return False
    request = urllib.request.Request(url.rstrip("/") + f"/gpuwidget/static/bokeh-{version}.min.js", method="HEAD")
    token = info.get("token") if info else None
    if token:
        request.add_header("Authorization", f"token {token}")
    try:
        # Only the local server is asked, never through a proxy from the environment.
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(request, timeout=TIMEOUT_S) as reply:
            return bool(reply.status == 200)
    except (urllib.error.URLError, OSError, ValueError):
        return False
