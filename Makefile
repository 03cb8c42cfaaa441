# Two commands do all the set-up on a fresh machine:
#   make demo   builds a 70B-parameter Llama-shaped model deferred, inspects it,
#               materializes one block and checks it against eager PyTorch
#   make test   runs the test suite
# Each creates .venv if missing and installs torch (pinned, CPU build) before
# anything that depends on it.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_PIN := torch==2.13.0

.PHONY: demo test test-fast bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(VENV)/.torch: | $(PY)
	$(PIP) install --quiet --disable-pip-version-check $(TORCH_PIN)
	touch $@

$(VENV)/.base: pyproject.toml $(VENV)/.torch
	$(PIP) install --quiet --disable-pip-version-check -e .
	touch $@

$(VENV)/.test: pyproject.toml $(VENV)/.torch
	$(PIP) install --quiet --disable-pip-version-check -e '.[test]'
	$(MAKE) --no-print-directory $(VENV)/.titan
	touch $@ $(VENV)/.base

# torchtitan requires a torch of its own choosing (and datasets, wandb, ...):
# its model code needs only these, installed without dependencies so that
# the pinned CPU torch stays. Optional: its tests skip with a reason if
# this step fails (an offline mirror without these wheels).
TITAN_PINS := torchtitan==0.3.0 spmd_types==0.2.3 tyro==1.0.17 docstring_parser typeguard triton==3.9.0
$(VENV)/.titan: | $(VENV)/.torch
	$(PIP) install --quiet --disable-pip-version-check --no-deps $(TITAN_PINS) \
		|| echo "warning: torchtitan not installed; its tests will skip"
	touch $@

demo: $(VENV)/.base
	$(PY) -m deferinit demo

test: $(VENV)/.test
	$(PY) -m pytest -q

# Everything but the slow real-model and multi-process tests.
test-fast: $(VENV)/.test
	$(PY) -m pytest -q -m "not slow"

bench: $(VENV)/.test
	$(PIP) install --quiet --disable-pip-version-check -e '.[test,bench]'
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
