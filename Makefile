# Two commands, each doing its own set-up:  make demo   |   make test
# CI adds two environments at the ends of pyproject.toml's ranges:  make test-floor  |  make test-newest
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.snnconv-installed
FMNIST := /usr/share/datasets/fashion-mnist

.PHONY: demo test test-floor test-newest lint setup data browser clean-venv lava-env

demo: $(STAMP)
	$(BIN)/snnconv demo --out runs/demo

test: $(STAMP) data browser
	-@$(MAKE) --no-print-directory lava-env
	$(BIN)/snnconv check --zoo --fold
	$(BIN)/python -m pytest -n 2 -q

setup: $(STAMP)

# ruff (pycodestyle, pyflakes, isort, bugbear) over the repository and mypy over the package, as
# pyproject.toml configures them; the versions are the lock's
lint: $(STAMP)
	$(BIN)/pip install --quiet --disable-pip-version-check -c constraints.txt -e ".[lint]"
	$(BIN)/ruff check .
	$(BIN)/mypy

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check -c constraints.txt -e ".[test]"
	$(BIN)/python -c "import torch, torchvision, spikingjelly, nir; \
	  assert torch.__version__.split('+')[0] == '2.14.1', torch.__version__; \
	  print('snnconv environment: torch', torch.__version__, 'torchvision', torchvision.__version__)"
	touch $(STAMP)

# Real Fashion-MNIST for the tests and benchmarks: Debian's dataset-fashion-mnist (IDX files).
data:
	@if [ ! -e $(FMNIST)/t10k-labels-idx1-ubyte.gz ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq dataset-fashion-mnist >/dev/null) \
	      || echo "warning: could not install dataset-fashion-mnist; Fashion-MNIST tests will be skipped"; \
	  else echo "note: run 'sudo apt-get install dataset-fashion-mnist' for the Fashion-MNIST tests"; fi; \
	fi

# Headless Chromium for the report test (tests/test_cli_pipeline.py screenshots report.html).
browser:
	@if ! command -v chromium >/dev/null && ! command -v chromium-browser >/dev/null; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
	      || echo "warning: could not install chromium; the report screenshot test will be skipped"; \
	  else echo "note: run 'sudo apt-get install chromium' for the report screenshot test"; fi; \
	fi

clean-venv:
	rm -rf $(VENV)

# Intel's Lava (lava-nc 0.10.0, Python 3.10 only) in a side environment for the `lava` backend and
# the Loihi 2 cross-check tests. Optional: without a Python 3.10 interpreter it says so and stops;
# `make test` runs it with errors ignored (the tests then skip with the reason).
LAVA_VENV  := .venv-lava
LAVA_STAMP := $(LAVA_VENV)/.lava-nc-0.10.0
lava-env: $(LAVA_STAMP)

$(LAVA_STAMP):
	@py=$$(.ci/find-python 3.10) || { echo "lava-env: the lava backend stays unavailable"; exit 1; }; \
	echo "lava-env: building $(LAVA_VENV) with $$py"; \
	test -x $(LAVA_VENV)/bin/python || "$$py" -m venv $(LAVA_VENV); \
	$(LAVA_VENV)/bin/pip install --quiet --disable-pip-version-check lava-nc==0.10.0 && \
	$(LAVA_VENV)/bin/python -c "import lava.magma, lava.proc.lif.models, lava.proc.dense.models; print('lava-env: lava-nc 0.10.0 ready')" && \
	touch $(LAVA_STAMP)

# The tests marked `portable` at the floor of every dependency range (.ci/floor.txt, Python 3.11)
# and at the newest releases within them (.ci/newest.txt, Python 3.13), each in its own
# environment (.venv-floor, .venv-newest) built by .ci/portable-env from the lock's wheels, kept
# in ~/.cache/snnconv/wheels. Needs those interpreters (python3.X on PATH or under pyenv).
PORTABLE_PY_floor  := 3.11
PORTABLE_PY_newest := 3.13

test-floor test-newest: test-%: .venv-%/.snnconv-installed data
	.venv-$*/bin/python -m pytest -n 2 -q -m portable

.PRECIOUS: .venv-%/.snnconv-installed
.venv-%/.snnconv-installed: pyproject.toml .ci/%.txt .ci/portable-env
	.ci/portable-env .venv-$* $(PORTABLE_PY_$*) .ci/$*.txt
	touch $@
