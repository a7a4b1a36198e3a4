# Two commands, each doing its own set-up:  make demo   |   make test
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.snnconv-installed
FMNIST := /usr/share/datasets/fashion-mnist

.PHONY: demo test setup data browser clean-venv

demo: $(STAMP)
	$(BIN)/snnconv demo --out runs/demo

test: $(STAMP) data browser
	$(BIN)/snnconv check --zoo --fold
	$(BIN)/python -m pytest -n 2 -q

setup: $(STAMP)

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
