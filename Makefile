# The two commands a new user runs: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# CPU requirements unless a GPU driver is present.
REQS := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo requirements.txt || echo requirements-cpu.txt)

.PHONY: demo test lint venv clean

$(VENV)/.installed: $(REQS)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r $(REQS)
	$(PY) -m pip install -q --no-deps -e .
	@touch $@

venv: $(VENV)/.installed

test: $(VENV)/.installed
	OMP_NUM_THREADS=1 $(PY) -m pytest -q tests $(PYTEST_ARGS)

lint: $(VENV)/.installed
	$(PY) -m ruff check .

demo: $(VENV)/.installed
	bash examples/run_embedded_demo.sh

clean:
	rm -rf runs outputs .pytest_cache
