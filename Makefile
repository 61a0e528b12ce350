# Two entry points for a fresh machine: `make demo` and `make test`.
# torch is pinned here (not in pyproject) because 2.13.0 is the CPU build on this disk;
# a bare `torch` requirement would pull a multi-GB CUDA build.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.ropekit-installed

.PHONY: demo test lint venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q triton==3.9.0
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m ropekit demo

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests examples benchmarks
	$(VENV)/bin/ruff format --check src tests examples benchmarks

test: lint
	$(PY) -m pytest -n 2 -q tests

clean:
	rm -rf $(VENV) build dist ropekit-report
