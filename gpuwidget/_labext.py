"""Where JupyterLab finds gpuwidget's prebuilt lab extension, and the names it is installed under.

JupyterLab calls ``gpuwidget._jupyter_labextension_paths()`` (re-exported by
``gpuwidget/__init__.py``); ``src`` is relative to the ``gpuwidget`` package folder,
where the build (``jlpm build``) writes ``gpuwidget/labextension``. A wheel also
copies that folder to ``share/jupyter/labextensions/jupyterlab-gpuwidget``, so an installed
package needs no ``jupyter labextension`` step.
"""

from __future__ import annotations

# The distribution (`pip install jupyterlab-gpuwidget`, pyproject's [project] name): "gpuwidget" on
# PyPI is another project. The import package, the magic and the server extension stay `gpuwidget`.
DISTRIBUTION_NAME = "jupyterlab-gpuwidget"
# The lab extension's npm name (package.json "name"): JupyterLab names its folder after it.
LABEXTENSION_NAME = "jupyterlab-gpuwidget"


def _jupyter_labextension_paths() -> list[dict[str, str]]:
    return [{"src": "labextension", "dest": LABEXTENSION_NAME}]
