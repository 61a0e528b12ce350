# Two entry points for a fresh machine: `make demo` and `make test`; `make proofs` is the heavy tier
# (CONTRIBUTING.md says which to run when).
# torch is pinned here (not in pyproject) because 2.13.0 is the CPU build on this disk;
# a bare `torch` requirement would pull a multi-GB CUDA build.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.ropekit-installed
# The engines (vLLM, SGLang, torchtitan) get their own environment: vLLM's package requires transformers<5.21,
# the HF parity tests of the main one a newer transformers.
EVENV  := .venv-engines
EPY    := $(EVENV)/bin/python
ESTAMP := $(EVENV)/.ropekit-installed

.PHONY: demo test proofs lint venv engines-venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q triton==3.9.0
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

engines-venv: $(ESTAMP)

$(ESTAMP): pyproject.toml Makefile requirements/engines.txt requirements/engines-nodeps.txt
	python3 -m venv $(EVENV)
	$(EPY) -m pip install -q torch==2.13.0
	$(EPY) -m pip install -q triton==3.9.0
	$(EPY) -m pip install -q -e . -r requirements/engines.txt
	$(EPY) -m pip install -q --no-deps -r requirements/engines-nodeps.txt
	touch $(ESTAMP)

demo: $(STAMP)
	$(PY) -m ropekit demo

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests examples benchmarks
	$(VENV)/bin/ruff format --check src tests examples benchmarks

# The fast tier: every behaviour, representative cases; a test over the fast tier's bound fails the run.
test: lint
	$(PY) -m pytest -n 2 -q -m "not proof and not engine" --durations=15 tests

# The heavy tier: full grids, every Triton compile, full-size interpreter suites, then the engines.
proofs: $(STAMP) $(ESTAMP)
	$(PY) -m pytest -n 2 -q -m proof --durations=15 tests
	ROPEKIT_ENGINES=1 VLLM_TARGET_DEVICE=cpu $(EPY) -m pytest -n 2 -q -m engine --durations=15 tests/engines

clean:
	rm -rf $(VENV) $(EVENV) build dist ropekit-report
