"""A real JupyterLab on a free loopback port, for the browser tests, the wheel test and
``benchmarks/browser_cost.py``: started in its own session, awaited until its API answers, and
stopped with its whole process group (``prom.stop_process``: SIGKILL after 10 s, as JupyterLab
sometimes hangs on SIGTERM after a browser session)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from prom import free_port, stop_process, wait_ready

JUPYTERLAB = (sys.executable, "-m", "jupyterlab")


@dataclass
class Lab:
    url: str
    token: str
    root: Path
    log: Path

    def page_url(self, path: str) -> str:
        return f"{self.url}{path}?token={self.token}"


def quiet_settings(user_settings: Path) -> None:
    """No "would you like news?" toast over a screenshot, and no update check (offline)."""
    folder = user_settings / "@jupyterlab" / "apputils-extension"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "notification.jupyterlab-settings").write_text(json.dumps({"fetchNews": "false",
                                                                         "checkForUpdates": False}))


def project_options(root: Path) -> list[str]:
    """The options of a lab serving this checkout's gpuwidget: settings and workspaces kept under
    ``root``, the app exposed for the tests' ``window.jupyterapp``, the server extension enabled."""
    return ["--LabApp.expose_app_in_browser=True", f"--LabApp.user_settings_dir={root / '.settings'}",
            f"--LabApp.workspaces_dir={root / '.workspaces'}", "--ServerApp.jpserver_extensions={'gpuwidget': True}"]


@contextlib.contextmanager
def running_lab(root: Path, token: str, options: Sequence[str] = (), program: Sequence[str] = JUPYTERLAB,
                env: Mapping[str, str] | None = None, log: Path | None = None,
                timeout: float = 90) -> Iterator[Lab]:
    """``program`` (JupyterLab by default) serving ``root`` with ``options``, until the block ends."""
    port = free_port()
    lab = Lab(url=f"http://127.0.0.1:{port}/", token=token, root=root, log=log or root / "lab.log")
    command = [*program, "--no-browser", f"--port={port}", "--ip=127.0.0.1",
               f"--ServerApp.token={token}", f"--ServerApp.root_dir={root}", *options]
    if os.geteuid() == 0:
        command.append("--allow-root")
    with open(lab.log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=root, start_new_session=True,
                                   env=None if env is None else dict(env))
    try:
        wait_ready(f"{lab.url}api/status?token={token}", process, lab.log, timeout)
        yield lab
    finally:
        stop_process(process)
