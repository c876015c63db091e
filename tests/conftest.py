"""Shared fixtures: an in-process IPython shell with gpuwidget loaded, leak checks, and which tests run alone.

``make test`` runs the suite in two passes: the tests not marked ``serial`` on every core
(pytest-xdist), then the ``serial`` ones one at a time. A test is ``serial`` when it judges
time or speed, or loads the machine itself (kernels, servers, browsers, process trees), so
that another test running beside it cannot change what it measures: marked so in its module
(``pytestmark = pytest.mark.serial``) or on itself, or because it carries one of
:data:`SERIAL_MARKERS` or uses one of :data:`SERIAL_FIXTURES` (see ``pytest_collection_modifyitems``).
A test with one of those that judges no time and shares nothing with another (its own kernel,
temporary folder and ports) says so with ``untimed``: it runs in the parallel pass, where nothing
beside it judges time either, so the load it makes changes no test's result.
"""

from __future__ import annotations

import faulthandler
import gc
import os
import signal
import threading
from collections.abc import Iterator

import pynvml
import pytest

from gpuwidget import WARM_UP_THREAD, session

from support import sampler_threads

# The fake NVML and amdsmi (fixtures ``fake_nvml``, ``fake_amdsmi``) for every test module.
# pytest-jupyter's server fixtures (jp_fetch, jp_ws_fetch, ...) for tests/test_server.py.
pytest_plugins = ["fakenvml", "fakeamdsmi", "pytest_jupyter.jupyter_server"]

# pynvml's own functions: a test that patches one must put it back (tests/fakenvml.py does).
PYNVML_FUNCTIONS = {name: getattr(pynvml, name) for name in dir(pynvml) if name.startswith("nvml")}
# Environment variables a test must leave as it found them: all it found (but pytest's own), and
# those gpuwidget or the fake driver set (libraries set some of their own on first import: theirs).
PYTEST_VARIABLE = "PYTEST_CURRENT_TEST"
OURS = ("GPUWIDGET", "CUDA_VISIBLE_DEVICES")


# Tests with these markers or fixtures run in the serial pass without saying so: real kernels,
# notebooks, browsers and long process trees load the machine; training loops timed on one
# torch thread, and watched cells in the in-process shell (a real sampler), measure time.
SERIAL_MARKERS = ("browser", "notebooks", "kernel", "slow")
SERIAL_FIXTURES = ("one_torch_thread", "ip")


# Kernels, notebooks or the in-process shell, but no judgement of time: the parallel pass takes them.
UNTIMED_MARKER = "untimed"


# A test still running this long after pytest-timeout's own limit is hung where that limit cannot
# act: its signal handler needs the GIL, and a deadlock that holds the GIL (CPython gh-106883, see
# gpuwidget.probes.stack) never gives it back, so the run went on to CI's limit. faulthandler's
# watchdog is a C thread that needs no GIL: it prints every thread's stack and ends the process,
# a failed run (xdist reports a worker lost) instead of a silent one.
HUNG_MARGIN_S = 120
_real_stderr: int | None = None  # pytest's capture replaces fd 2 during a test; the dump must be seen


def pytest_configure(config: pytest.Config) -> None:
    global _real_stderr
    _real_stderr = os.dup(2)  # capture is suspended while plugins configure: this is the terminal or CI log
    # Every Python the tests start (scripts, kernels, workers) prints its threads' stacks if it crashes:
    # a child that died of SIGSEGV in CI said nothing else (returncode -11, stderr empty).
    os.environ.setdefault("PYTHONFAULTHANDLER", "1")
    # A suite started in the background by a non-interactive shell (`make test &`, nohup, some CI
    # runners) inherits SIGINT ignored, and Python then leaves it ignored: Ctrl-C would reach no test.
    # The tests of Ctrl-C need it as a terminal gives it (Python's own handler, KeyboardInterrupt).
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def time_limit_s(item: pytest.Item) -> float:
    """pytest-timeout's limit for this test: its ``timeout`` marker's, else the configured one."""
    marker = item.get_closest_marker("timeout")
    if marker is not None and marker.args:
        return float(marker.args[0])
    return float(item.config.getini("timeout") or 0)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    limit = time_limit_s(item)
    if limit > 0 and _real_stderr is not None:
        faulthandler.dump_traceback_later(limit + HUNG_MARGIN_S, exit=True, file=_real_stderr)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        fixtures = getattr(item, "fixturenames", ())
        if item.get_closest_marker(UNTIMED_MARKER) and not item.get_closest_marker("serial"):
            continue
        if any(item.get_closest_marker(name) for name in SERIAL_MARKERS) or any(
                name in fixtures for name in SERIAL_FIXTURES):
            item.add_marker(pytest.mark.serial)


def environ_now() -> dict[str, str]:
    """The environment as it is, copied at once: iterating os.environ itself raises if another thread
    (a library's, in the same worker) sets a variable meanwhile; its underlying dict copies atomically."""
    data = os.environ._data.copy()  # type: ignore[attr-defined]
    return {os.environ.decodekey(key): os.environ.decodevalue(value)  # type: ignore[attr-defined]
            for key, value in data.items()}


@pytest.fixture(autouse=True)
def nothing_left_behind() -> Iterator[None]:
    """Every test starts with no run in the session's history and must end with no sampler thread,
    no active watch, no garbage collector callback of gpuwidget's, pynvml's own functions and the
    environment it started with (autouse, so set up before and torn down after every other fixture
    of the test: what is left here was leaked)."""
    session._last_run = None
    session._runs_by_source.clear()
    environ = {key: value for key, value in environ_now().items() if key != PYTEST_VARIABLE}
    yield
    collecting = [callback for callback in gc.callbacks if getattr(callback, "__module__", "").startswith("gpuwidget")]
    for callback in collecting:  # taken out, so one leak fails one test, not every test after it
        gc.callbacks.remove(callback)
    leftover = sampler_threads()
    for thread in leftover:
        thread.join(2.0)
    patched = sorted(name for name, function in PYNVML_FUNCTIONS.items() if getattr(pynvml, name) is not function)
    for name in patched:  # put back, so one leak fails one test, not every GPU test after it
        setattr(pynvml, name, PYNVML_FUNCTIONS[name])
    now = environ_now()
    changed = sorted(key for key in {*environ, *(key for key in now if key.startswith(OURS))}
                     if environ.get(key) != now.get(key))
    for key in changed:
        if key in environ:
            os.environ[key] = environ[key]
        else:
            del os.environ[key]
    assert not [t for t in leftover if t.is_alive()], "a sampler thread outlived its watch"
    assert session._active is None, "a watch is still marked active"
    assert not patched, f"pynvml functions left patched: {patched}"
    assert not collecting, f"garbage collector callbacks left installed: {collecting}"
    assert not changed, f"environment variables left changed: {changed}"


@pytest.fixture(scope="module", autouse=True)
def heap_frozen() -> None:
    """The heap as each module starts, out of the garbage collector's full collections (``gc.freeze``).

    This process holds torch, Lightning, transformers, IPython and Bokeh: a full collection walked it
    for 0.2-0.3 s (measured between the tests of the serial pass, with nothing beside it), and one that
    fell in a watched loop's ``next()`` read as a starved loader: a fake MI300X's 32 in-memory batches
    waited 22% of their 1.3 s (fresh-check run 79). A test owns the heap it makes, not every earlier
    module's. The collection first lets go of what those left as garbage."""
    gc.collect()
    gc.freeze()


@pytest.fixture(scope="session")
def _ipython_session():
    from IPython.testing.globalipapp import start_ipython

    shell = start_ipython()
    shell.run_line_magic("load_ext", "gpuwidget")
    # The extension imports the live view's libraries on a thread (gpuwidget._warm_up), done by the time
    # a user runs the next cell. Here the next test would start meanwhile, and pytest's log capture
    # iterates the loggers while bokeh's imports add theirs ("dictionary changed size during iteration").
    for thread in threading.enumerate():
        if thread.name == WARM_UP_THREAD:
            thread.join(60)
    gc.collect()
    gc.freeze()  # the shell and the live view's libraries, which the module's heap_frozen came before
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
