# Two commands on a fresh machine: `make run` (the daemon on the default model) and `make test`.
# Each bootstraps the virtual environment and the default model first.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.bootstrapped
MACE_ARGS ?=

.PHONY: run test test-fast bench lint model clean-venv

$(STAMP): pyproject.toml tools/bootstrap.sh
	bash tools/bootstrap.sh $(VENV)
	touch $(STAMP)

model: $(STAMP)
	$(PY) -m edge_runtime.model.fetch

run: model
	$(VENV)/bin/maced $(MACE_ARGS)

test: model
	$(PY) -m pytest -q

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

bench: model
	$(PY) tools/bench_engine.py

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean-venv:
	rm -rf $(VENV)
