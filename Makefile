# The two commands of the README: `make demo` (the main job) and `make test` (the tests).
# Each creates .venv and installs the package on first use, so a fresh clone needs nothing else.
PYTHON ?= python3
VENV ?= .venv
# A CPU machine takes torch 2.13's CPU wheel; on a GPU machine use e.g. `make test TORCH=torch`.
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
TYPECHECK := build/typecheck
# pipefail in `make lint` (mypy's exit status through sed).
SHELL := /bin/bash

# $(call install_target,PYTHON,DIR): a fresh non-editable install of this tree into DIR, without
# dependencies, built with PYTHON's own setuptools (no registry needed). build/lib goes first:
# setuptools builds there and would carry a module since deleted from the tree into DIR.
install_target = rm -rf $(2) build/lib build/bdist.* && \
	$(1) -m pip install --quiet --no-deps --no-build-isolation --target $(2) .

.PHONY: install demo test lint clean

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

clean:
	rm -rf $(VENV) build dist *.egg-info lightning_logs
