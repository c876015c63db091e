"""Shared fixtures: an in-process IPython shell with gpuwidget loaded, and leak checks."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from gpuwidget import session

from support import sampler_threads

# The fake NVML and amdsmi (fixtures ``fake_nvml``, ``fake_amdsmi``) for every test module.
# pytest-jupyter's server fixtures (jp_fetch, jp_ws_fetch, ...) for tests/test_server.py.
pytest_plugins = ["fakenvml", "fakeamdsmi", "pytest_jupyter.jupyter_server"]


@pytest.fixture(autouse=True)
def nothing_left_behind() -> Iterator[None]:
    """Every test must end with no sampler thread and no active watch."""
    yield
    leftover = sampler_threads()
    for thread in leftover:
        thread.join(2.0)
    assert not [t for t in leftover if t.is_alive()], "a sampler thread outlived its watch"
    assert session._active is None, "a watch is still marked active"


@pytest.fixture(scope="session")
def _ipython_session():
    from IPython.testing.globalipapp import start_ipython

    shell = start_ipython()
    shell.run_line_magic("load_ext", "gpuwidget")
    return shell


@pytest.fixture
def ip(_ipython_session):
    """The in-process IPython shell with ``%%gpuwatch`` registered, output captured."""
    yield _ipython_session
    _ipython_session.user_ns.pop("_gpuwidget_test", None)


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """The training loop's math on one core, as timing on a 2-core machine needs."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
