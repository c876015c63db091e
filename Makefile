# gpuwidget developer entry points. Everything sets itself up on a fresh machine:
#   make lab     JupyterLab on 127.0.0.1 with gpuwidget installed (editable), notebooks/ as root
#   make test    the whole test suite: jest, then pytest's parallel and serial passes (installs
#                Debian's chromium and prometheus first when root and missing)
#   make bench   every benchmarks/*.py, one after the other
#   make lint    ruff, mypy and the TypeScript lint (`jlpm lint`: prettier, eslint, tsc)
#   make clean   build outputs (keeps .venv and node_modules); `make distclean` removes those too

SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
VBIN := $(CURDIR)/$(VENV)/bin
# Exact pin: here it is a CPU build on local disk; an unpinned torch pulls a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed
PYC_STAMP := $(VENV)/.compiled
LABEXT := gpuwidget/labextension/package.json
# The lab extension's folder is named after its npm package (package.json "name").
LABEXT_LINK := $(VENV)/share/jupyter/labextensions/jupyterlab-gpuwidget
# What an install from before the rename left: the distribution "gpuwidget" and its link.
OLD_DIST := gpuwidget
OLD_LABEXT_LINK := $(VENV)/share/jupyter/labextensions/gpuwidget
TS_SOURCES := $(wildcard labextension/src/*.ts labextension/src/*.tsx labextension/style/* labextension/schema/*)
ROOT_FLAG := $(if $(filter 0,$(shell id -u)),--allow-root,)
NOTEBOOK_DIR := $(if $(wildcard notebooks),notebooks/,.)

.PHONY: install lab test bench lint clean distclean chromium prometheus demo

install: $(STAMP) $(PYC_STAMP) $(LABEXT)

# The venv, torch, gpuwidget (editable, with test extras) and the lab extension.
# `pip install -e` runs the hatch build hook, which runs `jlpm install` and `jlpm build`;
# the wheel's shared-data installs a *copy* of the built extension and the server-extension
# config into .venv, then `jupyter-builder develop` swaps that copy for a link to
# gpuwidget/labextension, so later `jlpm build`s are seen without reinstalling.
# (`jupyter labextension develop` does the same but is deprecated in JupyterLab 4.6.)
# (the child processes' start-up hook is copied into site-packages by the install: a change reinstalls)
$(STAMP): pyproject.toml package.json yarn.lock gpuwidget/children/_boot.py gpuwidget/children/gpuwidget_children.pth
	test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install --upgrade pip
	@# --no-compile: pip byte-compiles one file at a time; $(PYC_STAMP) does it on every core
	$(VPY) -m pip install --no-compile "$(TORCH_SPEC)"
	@# a link left by `jupyter-builder develop` would make pip write through it into the source tree
	for link in $(LABEXT_LINK) $(OLD_LABEXT_LINK); do if [ -L $$link ]; then rm $$link; fi; done
	@# the distribution was called "gpuwidget" before (a name PyPI gives another project): an old
	@# install's files would stay beside the new one's, its lab extension loaded twice
	if $(VPY) -m pip show -q $(OLD_DIST) 2>/dev/null; then $(VPY) -m pip uninstall -y $(OLD_DIST); fi
	PATH="$(VBIN):$$PATH" $(VPY) -m pip install --no-compile -e ".[test,dev]" "$(TORCH_SPEC)"
	PATH="$(VBIN):$$PATH" $(VENV)/bin/jupyter-builder develop --overwrite . || { \
	  echo "make: linking the lab extension failed; gpuwidget/__init__.py must re-export" >&2; \
	  echo "      _jupyter_labextension_paths (from gpuwidget._labext)." >&2; exit 1; }
	touch $@

# Every module of the venv byte-compiled once, on every core (about 17 s here). Python caches what it
# compiles on import only where it may write: with PYTHONDONTWRITEBYTECODE set (as on this project's
# machines and many CI images) nothing is ever cached, and every process compiled torch, sympy and the
# rest from source again: `import torch, torch._dynamo` 6.6 s of CPU, 2.9 s compiled (BENCHMARKS.md
# section 18). Some packages ship files for a newer Python (torch's py312_intrinsics.py), which
# cannot compile here and are never imported on it: compileall's failures are not the install's.
$(PYC_STAMP): $(STAMP)
	$(VPY) -c 'import compileall, sysconfig; compileall.compile_dir(sysconfig.get_paths()["purelib"], quiet=2, workers=0)'
	touch $@

# TypeScript, CSS or JS dependencies changed since the last build (or `make clean` removed it).
# (The editable install alone rebuilds only when labextension/ is newer than the build.)
# (order-only on the stamp: the editable install has just built it.)
$(LABEXT): $(TS_SOURCES) tsconfig.json package.json yarn.lock | $(STAMP)
	PATH="$(VBIN):$$PATH" jlpm install
	PATH="$(VBIN):$$PATH" jlpm build
	touch $@

lab: install
	$(VENV)/bin/jupyter lab --ip=127.0.0.1 --no-browser $(ROOT_FLAG) $(NOTEBOOK_DIR)

# The Python suite in two passes (tests/conftest.py says which tests are `serial`): first the tests
# that neither judge time nor load the machine, on every core (pytest-xdist); then the serial ones
# one at a time, so nothing running beside a timed test changes what it measures. Each pass ends with
# its slowest tests (BENCHMARKS.md section 18 keeps the time per layer); every test's time is in
# test-results/pytest-*.xml (JUnit XML).
PYTEST_WORKERS ?= auto
test: install chromium prometheus
	PATH="$(VBIN):$$PATH" jlpm test
	@# the project's own modules compiled once for every process the tests start (the venv's: $(PYC_STAMP))
	$(VPY) -m compileall -q -j 0 gpuwidget tests benchmarks
	$(VPY) -m pytest -m "not serial" -n $(PYTEST_WORKERS) --durations=10 --junitxml=test-results/pytest-parallel.xml
	$(VPY) -m pytest -m serial --durations=40 --junitxml=test-results/pytest-serial.xml

# Browser tests use Debian's chromium (Playwright's own browser download cannot work here).
chromium:
	@if [ ! -x /usr/bin/chromium ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y chromium; \
	  else \
	    echo "make: /usr/bin/chromium is missing, so browser tests will be skipped." >&2; \
	    echo "      Install it as root: apt-get update && apt-get install -y chromium" >&2; \
	  fi; \
	fi

# Tests of the cluster view run a real Prometheus (Debian's package, which brings promtool too).
prometheus:
	@if [ ! -x /usr/bin/prometheus ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus; \
	  else \
	    echo "make: /usr/bin/prometheus is missing, so the real-Prometheus tests will be skipped." >&2; \
	    echo "      Install it as root: apt-get update && apt-get install -y prometheus" >&2; \
	  fi; \
	fi

# The first two tutorials, executed headless: HTML copies in build/demo/, and the panel under
# the starved training loop printed here, so the product can be seen working without a browser.
demo: install
	$(VPY) scripts/demo.py

bench: install
	PATH="$(VBIN):$$PATH" $(VPY) -m pip install -e ".[bench]" "$(TORCH_SPEC)"
	@set -e; ran=0; \
	for f in benchmarks/*.py; do \
	  [ -e "$$f" ] || continue; \
	  case "$$(basename "$$f")" in __init__.py|_*) continue;; esac; \
	  echo "== $$f"; $(VPY) "$$f"; ran=$$((ran + 1)); \
	done; \
	echo "bench: ran $$ran benchmark file(s)"

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	PATH="$(VBIN):$$PATH" jlpm lint

clean:
	rm -rf lib tsconfig.tsbuildinfo gpuwidget/labextension gpuwidget/_version.py \
	  build dist *.egg-info .pytest_cache .mypy_cache .ruff_cache test-results
	find . -name __pycache__ -type d -not -path './.venv/*' -not -path './node_modules/*' -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV) node_modules
