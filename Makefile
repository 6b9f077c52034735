# `make run` and `make test` each set up .venv on their own, from nothing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.shoal-installed

.PHONY: run test bench bench-recovery lint format clean gpu-check gpu-wheels

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
	$(BIN)/python bench/control_plane.py --repeats 5
	$(BIN)/python bench/levers.py --repeats 3
	$(BIN)/python bench/ray_idle.py --repeats 3
	$(BIN)/python bench/run.py --repeats 3

bench-recovery: $(STAMP)
	$(BIN)/python bench/recovery.py --repeats 2

# One CUDA GPU, at most 8 minutes, no Ray or MLflow (bench/gpu_check.sh; without a GPU: one line,
# exit 0). No .venv step: the GPU machine may have no network; what it lacks comes from bench/wheels.
gpu-check:
	bash bench/gpu_check.sh

# The wheels bench/gpu_check.sh installs where they are missing, for CPython 3.12 on x86-64 Linux:
# pydantic and pytest with their dependencies at constraints.txt's pins, and torchao (fp8).
GPU_WHEELS := ^(pydantic|pydantic_core|annotated-types|typing-inspection|typing_extensions|pytest|pluggy|iniconfig|packaging|Pygments)==
TORCHAO := torchao==0.17.0

gpu-wheels:
	rm -rf bench/wheels
	$(PYTHON) -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_24_x86_64 \
		--platform manylinux_2_28_x86_64 -d bench/wheels $$(grep -i -E '$(GPU_WHEELS)' constraints.txt) $(TORCHAO)
	du -sh bench/wheels
