# Two entry points for a fresh machine: `make demo` and `make test`; `make proofs` is the heavy tier
# (CONTRIBUTING.md says which to run when).
# torch is pinned here (not in pyproject) because 2.13.0 is the CPU build on this disk;
# a bare `torch` requirement would pull a multi-GB CUDA build.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.ropekit-installed

.PHONY: demo test proofs lint venv engines-venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q triton==3.9.0
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

# The engines' environment (vLLM, SGLang, torchtitan) for tests/engines: vLLM needs transformers < 5.21,
# which the main .venv does not hold. The engines go in with --no-deps (their wheels pin torch 2.14 and CUDA);
# torch and triton are named again in each install so that no requirement can replace them.
ENGINES_VENV  := .venv-engines
ENGINES_PY    := $(ENGINES_VENV)/bin/python
ENGINES_STAMP := $(ENGINES_VENV)/.ropekit-installed
PINNED        := torch==2.13.0 triton==3.9.0

engines-venv: $(ENGINES_STAMP)

$(ENGINES_STAMP): pyproject.toml Makefile requirements/engines.txt requirements/engines-nodeps.txt
	python3 -m venv $(ENGINES_VENV)
	$(ENGINES_PY) -m pip install -q torch==2.13.0
	$(ENGINES_PY) -m pip install -q $(PINNED)
	$(ENGINES_PY) -m pip install -q $(PINNED) -r requirements/engines.txt -e .
	$(ENGINES_PY) -m pip install -q --no-deps -r requirements/engines-nodeps.txt
	touch $(ENGINES_STAMP)

demo: $(STAMP)
	$(PY) -m ropekit demo

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests examples benchmarks
	$(VENV)/bin/ruff format --check src tests examples benchmarks

# The fast tier: every behaviour, representative cases; a test over the fast tier's bound fails the run.
test: lint
	$(PY) -m pytest -n 2 -q -m "not proof and not engine" --durations=15 tests

# The heavy tier: full grids, every Triton compile, full-size interpreter suites, then the engines.
proofs: $(STAMP) $(ENGINES_STAMP)
	$(PY) -m pytest -n 2 -q -m proof --durations=15 tests
	ROPEKIT_ENGINES=1 VLLM_TARGET_DEVICE=cpu $(ENGINES_PY) -m pytest -n 2 -q -m engine --durations=15 tests/engines

clean:
	rm -rf $(VENV) $(ENGINES_VENV) build dist ropekit-report

# make proofs compiles a 3-wise cover of the Triton grid (and the whole grid of a kernel changed since the last
# full run); this runs the heavy tier with every specialization for every target, then records each kernel's
# hashes in src/ropekit/tools/triton_aot_manifest.json, which make proofs reads (CONTRIBUTING.md: when to run it).
.PHONY: proofs-full
proofs-full:
	$(MAKE) proofs ROPEKIT_TRITON_GRID=full
	$(PY) -c 'from ropekit.tools import triton_aot; print(*triton_aot.write_manifest(), sep="\n")'
