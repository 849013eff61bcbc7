# The two commands of the README: `make demo` (the main job) and `make test` (the tests).
# Each creates .venv and installs the package on first use, so a fresh clone needs nothing else.
PYTHON ?= python3
VENV ?= .venv
# A CPU machine takes torch 2.13's CPU wheel; on a GPU machine use e.g. `make test TORCH=torch`.
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
TYPECHECK := build/typecheck
# `make test-gpu` runs on the GPU machine's own Python, whose torch, Triton and Lightning it uses
# as they are (nothing is installed from a registry there).
GPU_PYTHON ?= python3
GPU_INSTALL := build/gpu-install
# Every test file with a test that needs CUDA (marked gpu, or skipped without CUDA).
GPU_TESTS := tests/*/*gpu*.py tests/unit/test_kernels_*.py tests/unit/test_weight_edits.py \
	tests/multiprocess/test_simulation.py tests/integration/test_compile.py benchmarks/tests/*gpu*.py \
	benchmarks/tests/test_benchmark_instruments.py benchmarks/tests/test_emulated_network.py
# pipefail in `make lint` (mypy's exit status through sed).
SHELL := /bin/bash

# $(call install_target,PYTHON,DIR): a fresh non-editable install of this tree into DIR, without
# dependencies, built with PYTHON's own setuptools (no registry needed). build/lib goes first:
# setuptools builds there and would carry a module since deleted from the tree into DIR.
install_target = rm -rf $(2) build/lib build/bdist.* && \
	$(1) -m pip install --quiet --no-deps --no-build-isolation --target $(2) .

define REQUIRE_CUDA
import sys
try:
    import torch
except ImportError:
    sys.exit(f"make test-gpu: {sys.executable} cannot import torch; set GPU_PYTHON to a Python with CUDA torch, Triton and Lightning")
if not torch.cuda.is_available():
    sys.exit(f"make test-gpu: no CUDA device for {sys.executable} (torch {torch.__version__}); it runs on a GPU machine only: on this one, run make test")
endef
export REQUIRE_CUDA

.PHONY: install demo test test-gpu lint wheel-check docs docs-serve clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet "$(TORCH)"
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/train_gpt.py trainer.accelerator=cpu trainer.devices=2 sdp4bit.ranks_per_node=1

test: $(STAMP)
	$(BIN)/python -m pytest

# The GPU suite against the package as a user installs it: a non-editable copy in build/gpu-install,
# first on PYTHONPATH. -P (Python 3.11+) keeps the repository root off pytest's sys.path, where the
# source tree's lightning_sdp4bit (without strategies/ and kernels/) would come first.
test-gpu:
	@$(GPU_PYTHON) -c "$$REQUIRE_CUDA"
	$(call install_target,$(GPU_PYTHON),$(GPU_INSTALL))
	PYTHONPATH=$(CURDIR)/$(GPU_INSTALL) $(GPU_PYTHON) -P -m pytest $(GPU_TESTS)

# Ruff over the tree, then mypy over the package as it installs (pyproject's [tool.mypy] says
# why): the --target copy maps strategies/ and kernels/ in as lightning_sdp4bit.strategies and
# .kernels, and sed turns its paths back into the source tree's. The tools are pinned in the
# `lint` extra, part of `dev`.
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(call install_target,$(BIN)/python,$(TYPECHECK))
	set -o pipefail; MYPYPATH=$(TYPECHECK) $(BIN)/mypy -p lightning_sdp4bit | sed \
		-e 's|^$(TYPECHECK)/lightning_sdp4bit/strategies/|strategies/|' \
		-e 's|^$(TYPECHECK)/lightning_sdp4bit/kernels/|kernels/|' \
		-e 's|^$(TYPECHECK)/||'

# The built wheel installed into a fresh virtual environment outside the repository, then a
# 2-process CPU fit there (.ci/wheel_smoke.sh; dist/ keeps the sdist and wheel).
wheel-check: $(STAMP)
	VENV=$(VENV) TORCH="$(TORCH)" PYTHON=$(PYTHON) bash .ci/wheel_smoke.sh

# The docs site (mkdocs.yml): pinned tools from docs/requirements.txt, built strict into build/site.
DOCS_STAMP := $(VENV)/.docs-stamp
$(DOCS_STAMP): $(STAMP) docs/requirements.txt
	$(BIN)/python -m pip install --quiet -r docs/requirements.txt
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	$(BIN)/mkdocs build --strict

docs-serve: $(DOCS_STAMP)
	$(BIN)/mkdocs serve

clean:
	rm -rf $(VENV) build dist *.egg-info lightning_logs
