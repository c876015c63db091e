"""Where JupyterLab finds gpuwidget's prebuilt lab extension.

JupyterLab calls ``gpuwidget._jupyter_labextension_paths()`` (re-exported by
``gpuwidget/__init__.py``); ``src`` is relative to the ``gpuwidget`` package folder,
where the build (``jlpm build``) writes ``gpuwidget/labextension``. A wheel also
copies that folder to ``share/jupyter/labextensions/gpuwidget``, so an installed
package needs no ``jupyter labextension`` step.
"""

from __future__ import annotations

LABEXTENSION_NAME = "gpuwidget"


def _jupyter_labextension_paths() -> list[dict[str, str]]:
    return [{"src": "labextension", "dest": LABEXTENSION_NAME}]
