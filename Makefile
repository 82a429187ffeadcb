# gpu_lab — two commands for a fresh machine:
#   make lab    install into .venv and start JupyterLab on the tutorials, extension enabled
#   make test   install into .venv (and Debian's Chromium, Slurm and Prometheus, npm's JupyterHub
#               proxy, for the browser, export, metrics and hub tests) and run every test
# and two for the GPU machine (see bench/gpu_check.py):
#   make gpu-wheels   download what its image lacks into .whl/ (CPython 3.12, manylinux x86_64)
#   make gpu-check    on the GPU machine: install .whl/ and run the prepared GPU check
#   make gpu-notebooks on the GPU machine: the tutorials' smoke lane (quick mode on the GPU)
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.stamp-install
LAB_PORT ?= 8888
ROOT_FLAG := $(shell [ "$$(id -u)" = 0 ] && echo --allow-root)

.PHONY: lab check lint test install chromium slurm prometheus hub-proxy clean bench gpu-wheels gpu-check \
	gpu-notebooks

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip wheel

# The JupyterLab extension's sources: the install's build hook (hatch-jupyter-builder) runs
# `npm install` + `npm run build:prod` in extension/ when they are newer than gpu_lab/labextension.
EXT_SRC := extension/package.json extension/package-lock.json $(wildcard extension/src/*.ts extension/src/style/*)

# Editable install with the test extra; re-run when the project's metadata or the extension changes.
$(STAMP): $(PY) pyproject.toml $(EXT_SRC)
	@command -v npm >/dev/null || { echo "make: Node.js >= 20.19 with npm is needed to build the JupyterLab extension (extension/)"; exit 1; }
	@# new npm dependencies: force the hook to rebuild (it compares extension/src only)
	@if [ -n "$(filter extension/package%,$?)" ]; then rm -rf gpu_lab/labextension; fi
	$(PIP) install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

# Debian's Chromium for Playwright (Playwright never downloads a browser here).
chromium:
	@if [ ! -x /usr/bin/chromium ]; then \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	  else sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; fi; \
	fi

# Debian's Slurm (controller, node daemon, client, munge): the export test starts a private
# one-node cluster (and a two-node one on private hosts) in a temp dir for the Slurm tests.
SLURM_PKGS := slurmctld slurmd slurm-client munge
slurm:
	@if ! command -v sbatch >/dev/null || [ ! -x /usr/sbin/slurmctld ] || [ ! -x /usr/sbin/munged ]; then \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $(SLURM_PKGS) >/dev/null; \
	  else sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $(SLURM_PKGS) >/dev/null; fi; \
	fi

# Debian's Prometheus server: the metrics test runs a private one on loopback that scrapes a real
# Jupyter server's /gpu-lab/metrics with the server's token (tests/test_prometheus.py).
prometheus:
	@if ! command -v prometheus >/dev/null; then \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null; \
	  else sudo apt-get update -qq && sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null; fi; \
	fi

# JupyterHub's proxy (npm's configurable-http-proxy) for the JupyterHub test, in .hub/
CHP := .hub/node_modules/.bin/configurable-http-proxy
$(CHP):
	mkdir -p .hub && cd .hub && npm install --no-audit --no-fund --silent configurable-http-proxy@5 >/dev/null
hub-proxy: $(CHP)

lab: install
	$(VENV)/bin/jupyter lab --ip=127.0.0.1 --port=$(LAB_PORT) --notebook-dir=notebooks \
	  --ServerApp.default_url=/lab/tree/00_overview.ipynb $(ROOT_FLAG)

# The fast tier: every test that starts no process and takes under half a second (pyproject's
# markers name the others), about a minute. Run it after every change; `make test` before a merge.
FAST := not slow and not browser and not slurm and not notebooks and not packaging
check: install lint
	GPU_LAB_QUICK=1 $(PY) -m pytest -p no:cacheprovider -q -m "$(FAST)" tests

# ruff with the rules of pyproject's [tool.ruff], and eslint + prettier for extension/src (its
# eslint.config.mjs, .prettierrc.json; `npm run format` fixes the formatting): part of check and of
# test (so of CI)
lint: install
	$(VENV)/bin/ruff check gpu_lab tests bench notebooks/refresh.py notebooks/conftest.py conftest.py
	@[ -x extension/node_modules/.bin/eslint ] || (cd extension && npm install --no-audit --no-fund)
	cd extension && npm run --silent lint

# --durations=25: where the minutes go, in every run (CI's log included). Two xdist workers by
# default (a serial run leaves one core idle while it waits on kernels, servers and Slurm), a file
# per worker (--dist loadfile); WORKERS=1 runs serially (bench/RESULTS.md has both)
WORKERS ?= 2
test: install lint chromium slurm prometheus hub-proxy gpu-wheels
	GPU_LAB_QUICK=1 PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1 $(PY) -m pytest -p no:cacheprovider --durations=25 \
	  -n $(WORKERS) --dist loadfile --no-loadscope-reorder tests notebooks \
	  --nbval-lax --nbval-current-env --nbval-sanitize-with notebooks/sanitize.cfg

# The GPU machine has no network: the packages its image lacks (bench/gpu_wheels.txt) travel with
# the working tree as wheels (.whl/ is git-ignored; the device tool's `carry`). Fetched again only
# when the list changes; the dry run in `make test` checks them.
GPU_WHEELS := .whl/.complete
GPU_PLATFORMS := $(foreach p,manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 \
	manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64,--platform $(p))
$(GPU_WHEELS): bench/gpu_wheels.txt
	rm -rf .whl
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
	  --implementation cp $(GPU_PLATFORMS) -d .whl -r bench/gpu_wheels.txt
	$(PYTHON) bench/gpu_check.py --check-wheels .whl
	touch $@

gpu-wheels: $(GPU_WHEELS)

# On the GPU machine (its python3 holds torch; no .venv, no network): see bench/gpu_check.py.
gpu-check:
	PYTHONUNBUFFERED=1 python3 bench/gpu_check.py --wheels .whl --out "$${OUT:-gpu_check_out}"

# The tutorials on the GPU, in quick mode, one GPU then every GPU (bench/gpu_notebook_steps.py)
gpu-notebooks:
	PYTHONUNBUFFERED=1 python3 bench/gpu_check.py --lane notebooks --budget 240 --wheels .whl \
	  --out "$${OUT:-gpu_check_out}"

bench: install
	for b in bench/*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) .hub build dist *.egg-info gpu_lab/labextension extension/lib extension/node_modules \
	  extension/tsconfig.tsbuildinfo
