# Two entry points for a fresh machine: `make demo` and `make test`; `make proofs` is the heavy tier
# (CONTRIBUTING.md says which to run when).
# torch is pinned here (not in pyproject) because 2.13.0 is the CPU build on this disk;
# a bare `torch` requirement would pull a multi-GB CUDA build.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.ropekit-installed

.PHONY: demo test proofs lint venv engines-venv clean

venv: $(STAMP)

# Every package the tests install is pinned in requirements/constraints.txt (its bump is a commit);
# `make proofs-latest` tests the newest transformers and kernels on purpose.
CONSTRAINTS := requirements/constraints.txt

$(STAMP): pyproject.toml Makefile $(CONSTRAINTS)
	python3 -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q triton==3.9.0
	$(PY) -m pip install -q -c $(CONSTRAINTS) -e ".[dev]"
	touch $(STAMP)

# The newest releases, on purpose: the HF parity tests against whatever transformers, kernels and
# huggingface_hub pip resolves today, in their own venv (everything else pinned as in .venv, so that only these
# three can turn the phase red), so a release that moves HF's RoPE functions fails CI on the day it is out
# rather than in a user's hands.
LATEST_VENV  := .venv-latest
LATEST_PY    := $(LATEST_VENV)/bin/python
LATEST_STAMP := $(LATEST_VENV)/.ropekit-installed
HF_TESTS     := tests/integrations/test_hf.py tests/integrations/test_hf_probe.py \
                tests/integrations/test_hf_tables.py tests/integrations/test_hf_kernels.py \
                tests/test_module_hf_parity.py tests/compat/test_hf.py tests/schedules/test_hf_parity.py \
                tests/tools/test_hf_coverage.py \
                tests/test_layer_rope.py::test_a_config_json_without_layer_types_is_planned_as_transformers_builds_it \
                tests/test_layer_rope.py::test_every_config_json_without_layer_types_is_planned_as_transformers_builds_it

latest-venv: $(LATEST_STAMP)

$(LATEST_STAMP): pyproject.toml Makefile $(CONSTRAINTS)
	python3 -m venv $(LATEST_VENV)
	$(LATEST_PY) -m pip install -q torch==2.13.0
	$(LATEST_PY) -m pip install -q $(PINNED)
	$(LATEST_PY) -m pip install -q -c $(CONSTRAINTS) -e ".[dev]"  # pinned, as .venv
	$(LATEST_PY) -m pip install -q $(PINNED) --upgrade transformers kernels huggingface_hub  # then the newest
	touch $(LATEST_STAMP)

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
	$(PY) -m pytest -n 2 --dist worksteal -q -m "not proof and not engine" --durations=15 tests

# The heavy tier: full grids, the Triton compile cover, full-size interpreter suites, then the engines in their own
# venv. .ci/run calls the parts one by one (to time each): proofs = proofs-core, engines-venv, proofs-engines.
.PHONY: proofs-core proofs-latest latest-venv proofs-engines
proofs: proofs-core proofs-latest proofs-engines

# Always the newest: the venv's stamp is rebuilt when older than a day, so CI tests today's releases.
proofs-latest:
	@if [ -f $(LATEST_STAMP) ] && [ -n "$$(find $(LATEST_STAMP) -mmin +1440)" ]; then rm -f $(LATEST_STAMP); fi
	$(MAKE) latest-venv
	$(LATEST_PY) -c "import transformers, kernels; print('newest releases: transformers', transformers.__version__, 'kernels', kernels.__version__)"
	$(LATEST_PY) -m pytest -n 2 -q -m "not engine" --durations=5 $(HF_TESTS)

proofs-core: $(STAMP)
	$(PY) -m pytest -n 2 -q -m proof --durations=15 tests

proofs-engines: $(ENGINES_STAMP)
	ROPEKIT_ENGINES=1 VLLM_TARGET_DEVICE=cpu $(ENGINES_PY) -m pytest -n 2 -q -m engine --durations=15 tests/engines

clean:
	rm -rf $(VENV) $(ENGINES_VENV) $(LATEST_VENV) build dist ropekit-report

# make proofs compiles a 3-wise cover of the Triton grid (and the whole grid of a kernel changed since the last
# full run); this runs the heavy tier with every specialization for every target, then records each kernel's
# hashes in src/ropekit/tools/triton_aot_manifest.json, which make proofs reads (CONTRIBUTING.md: when to run it).
.PHONY: proofs-full
proofs-full:
	$(MAKE) proofs ROPEKIT_TRITON_GRID=full
	$(PY) -c 'from ropekit.tools import triton_aot; print(*triton_aot.write_manifest(), sep="\n")'
