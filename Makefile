# The two commands of the README: `make demo` (the main job) and `make test` (the tests).
# Each creates .venv and installs the package on first use, so a fresh clone needs nothing else.
PYTHON ?= python3
VENV ?= .venv
# A CPU machine takes torch 2.13's CPU wheel; on a GPU machine use e.g. `make test TORCH=torch`.
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: install demo test lint docs docs-serve clean

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

lint: $(STAMP)
	$(BIN)/python -m pip install --quiet ruff
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

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
	rm -rf $(VENV) build *.egg-info lightning_logs
