# The two entry points of the README: `make serve` (the main job) and `make test`.
# Each creates .venv and installs what it needs on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
NPROC ?= 2
STAMP := $(VENV)/.installed

.PHONY: serve test install clean

$(STAMP): requirements/dev.txt setup.py pyproject.toml $(wildcard csrc/*.cpp csrc/*/*.cpp csrc/*/*.hpp csrc/include/moe_kernels/common/*.h)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements/dev.txt
	# CuTe/CUTLASS headers only; the wheel's Python dependencies are not needed.
	$(PY) -m pip install -q --no-deps nvidia-cutlass==4.2.0.0
	$(PY) -m pip install -q --no-build-isolation --no-deps -e .
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/torchrun --standalone --nproc-per-node $(NPROC) launch/serve_moe.py $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info kernels/_C*.so kernels/_include
