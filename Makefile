# Two commands for a newcomer: `make bench` (the main job) and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
STAMP   = $(VENV)/.fxrec-installed

.PHONY: venv test bench bench-quick bench-peers bench-pipeline bench-overlap lint clean

venv: $(STAMP)

$(STAMP): requirements-dev.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-dev.txt
	$(PY) -m pip install -q --no-deps torchrec==1.8.0
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

test: venv
	$(PY) -m ruff check fxrec tests
	$(PY) -m pytest

bench: venv
	$(PY) -m fxrec bench

bench-quick: venv
	$(PY) -m fxrec bench --quick

bench-peers: venv
	$(PY) -m fxrec bench --peers

bench-pipeline: venv
	$(PY) -m fxrec bench pipeline

bench-overlap: venv
	$(VENV)/bin/torchrun --nproc-per-node 2 -m fxrec.bench.overlap

lint: venv
	$(PY) -m ruff check fxrec tests

clean:
	rm -rf $(VENV) bench_results .pytest_cache .ruff_cache
