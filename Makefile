# `make run` and `make test` each set up .venv on their own, from nothing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.shoal-installed

.PHONY: run test bench bench-recovery lint format clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev,hf]'
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/shoal data prepare digits
	$(BIN)/shoal run workloads/quickstart.yaml

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest -q -rs --durations=12 tests/unit tests/integration
	$(BIN)/python -m pytest -q -rs --durations=5 tests/system

lint: $(STAMP)
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff format . && $(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) shoal_runs mlflow.db mlruns .pytest_cache

bench: $(STAMP)
	$(BIN)/python bench/data_plane.py --repeats 3
	$(BIN)/python bench/val_parity.py --seeds 3
	$(BIN)/python bench/telemetry.py --repeats 3
	$(BIN)/python bench/run.py --repeats 3

bench-recovery: $(STAMP)
	$(BIN)/python bench/recovery.py --repeats 2
