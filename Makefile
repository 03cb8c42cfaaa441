# Two commands do all the set-up on a fresh machine:
#   make demo   builds a 70B-parameter Llama-shaped model deferred, inspects it,
#               materializes one block and checks it against eager PyTorch
#   make test   runs the test suite
# Each creates .venv if missing and installs torch (pinned, CPU build) before
# anything that depends on it.
#
# Another torch: `make test TORCH=2.14.1` builds .venv-torch2.14.1 with that
# release (a CUDA build from PyPI, which runs here without a GPU) and runs the
# suite on it. A release above the cap of a local pip configuration (these
# machines cap torch at 2.14.1) needs the cap lifted for that one command:
# `PIP_CONFIG_FILE=/dev/null make test TORCH=2.15.0`. docs/testing.md records
# the result of each version; .ci/run tests 2.13.0 and 2.14.1.

PYTHON ?= python3
TORCH ?= 2.13.0
DEFAULT_TORCH := 2.13.0
VENV ?= $(if $(filter $(DEFAULT_TORCH),$(TORCH)),.venv,.venv-torch$(TORCH))
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_PIN := torch==$(TORCH)
# pytest arguments: `make test PYTEST_ARGS='-m cuda_build'` runs a marked part.
PYTEST_ARGS ?=

.PHONY: demo test test-fast bench gpu-check clean

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
# (triton only where the torch build brings none: the CUDA builds pin their own.)
TITAN_PINS := torchtitan==0.3.0 spmd_types==0.2.3 tyro==1.0.17 docstring_parser typeguard
$(VENV)/.titan: | $(VENV)/.torch
	$(PIP) install --quiet --disable-pip-version-check --no-deps $(TITAN_PINS) \
		$$($(PY) -c "import importlib.util as u; print('' if u.find_spec('triton') else 'triton==3.9.0')") \
		|| echo "warning: torchtitan not installed; its tests will skip"
	touch $@

demo: $(VENV)/.base
	$(PY) -m deferinit demo

test: $(VENV)/.test
	$(PY) -m pytest -q $(PYTEST_ARGS)

# Everything but the slow real-model and multi-process tests.
test-fast: $(VENV)/.test
	$(PY) -m pytest -q -m "not slow"

bench: $(VENV)/.test
	$(PIP) install --quiet --disable-pip-version-check -e '.[test,bench]'
	$(PY) benchmarks/run_all.py

# What only a GPU can check (tests/gpu, benchmarks/gpu_replay.py), in its own
# environment with torch's CUDA build (TORCH_PIN from PyPI, with timm and the
# matching torchvision, which need CUDA torch). Without an NVIDIA GPU it says
# it skipped.
GPU_VENV ?= .venv-gpu
GPU_PY := $(GPU_VENV)/bin/python
GPU_PINS := torchvision==0.28.0 timm

gpu-check:
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		$(MAKE) --no-print-directory $(GPU_VENV)/.ready && $(GPU_PY) tools/gpu_check.py; \
	else \
		echo "gpu-check: skipped: no NVIDIA GPU on this machine (nvidia-smi finds none); make test exercises CUDA through fakes"; \
	fi

# A torch already on the machine is used when it is the pinned version with
# CUDA; otherwise the pinned CUDA build comes from PyPI (--isolated: not the
# CPU wheels a local pip configuration may point at).
$(GPU_VENV)/.ready: pyproject.toml
	$(PYTHON) -m venv --system-site-packages $(GPU_VENV)
	$(GPU_PY) -c "import sys, torch; sys.exit(not (torch.cuda.is_available() and torch.__version__.split('+')[0] == '$(patsubst torch==%,%,$(TORCH_PIN))'))" 2>/dev/null \
		|| $(GPU_PY) -m pip install --quiet --isolated "$(TORCH_PIN)"
	$(GPU_PY) -m pip install --quiet -e '.[test]' && $(GPU_PY) -m pip install --quiet --no-deps $(GPU_PINS)
	touch $@

clean:
	rm -rf .venv .venv-torch* $(GPU_VENV) *.egg-info .pytest_cache
