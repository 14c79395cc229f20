# llmtune: `make demo` runs the offline demo, `make test` runs every test CI runs (unit + multi-process integration).
PYTHON ?= python3
PYTEST = $(PYTHON) -m pytest
# Two pytest workers, each taking whole test files (a module's shared runs happen once): the multi-process tests
# leave a core idle while they start, wait on a rendezvous or a timeout, so two at a time finish the suite sooner.
WORKERS ?= 2
PARALLEL = -n $(WORKERS) --dist loadfile

.PHONY: install test test-unit test-all test-gpu gpu-proof lint format demo bench docs fixtures

install:
	$(PYTHON) -m pip install --quiet torch==2.13.0
	$(PYTHON) -m pip install --quiet -e '.[dev]'
	$(PYTHON) -m compileall -q llmtune  # every rank reads bytecode, even where PYTHONDONTWRITEBYTECODE is set

test: install
	$(PYTEST) tests -m "not slow and not gpu" -q $(PARALLEL) --durations=30

test-unit:
	$(PYTEST) tests -m "not integration and not slow and not gpu" -q

test-all: install
	$(PYTEST) tests -m "not gpu" -q $(PARALLEL) --durations=30

# On a machine with a CUDA device (tests/gpu/README: how to get the stack there); writes tests/gpu/last-run.md
test-gpu:
	$(PYTEST) tests/gpu -m gpu -v

# On the lent GPU machine: the GPU tier, the throughput benchmark and the memory calibration in parts that resume
# across calls (state in .gpu-proof/); a dated section goes into tests/gpu/RESULTS.md. GPU_PROOF_ARGS: e.g. --budget 500
gpu-proof:
	python3 scripts/gpu_proof.py $(GPU_PROOF_ARGS)

lint:
	$(PYTHON) -m ruff check llmtune tests benchmarks
	$(PYTHON) -m ruff format --check llmtune

format:
	$(PYTHON) -m ruff check --fix llmtune tests benchmarks
	$(PYTHON) -m ruff format llmtune

demo: install
	bash scripts/demo.sh

bench: install
	bash scripts/demo.sh --fetch-only
	cd benchmarks && $(PYTHON) startup.py
	cd benchmarks && $(PYTHON) preprocess.py
	cd benchmarks && $(PYTHON) throughput.py
	cd benchmarks && $(PYTHON) packing.py
	cd benchmarks && $(PYTHON) memory.py
	cd benchmarks && $(PYTHON) rehearse.py

docs:
	$(PYTHON) -m llmtune.recipe.reference > docs/recipe-reference.md

fixtures:
	$(PYTHON) tests/fixtures/make_fixtures.py
