# The README's two commands are `make run` and `make test`. Each creates the
# virtualenv on first use and installs the project with exact pins.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: install run test test-fast clean gpu-pack gpu-check

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# DS_BUILD_OPS=0: DeepSpeed compiles its CUDA ops at first use on a GPU, not at install.
	# notebook: nbclient and a kernel, for the test that runs examples/loop_sdk.ipynb.
	DS_BUILD_OPS=0 $(BIN)/pip install --quiet -c constraints.txt -e '.[test,notebook]'
	touch $(STAMP)

## The main job on the embedded default (SQLite, local files, built-in benchmark).
run: install
	$(BIN)/envloop demo

## The test suite.
test: install
	$(BIN)/python -m pytest -n 2 --dist loadfile

## The GPU check (docs/gpu-check.md). Here: the packaged MiniLM, fp16 weights, into .gpu/ for a device call's carry.
gpu-pack: install
	$(BIN)/python bench/bench_gpu.py --pack .gpu

## On a lent GPU machine, with .gpu carried: the image's python3, nothing installed.
gpu-check:
	PYTHONPATH=.:.gpu PYTHONUNBUFFERED=1 $(PYTHON) bench/bench_gpu.py $(if $(OUT),--out $(OUT)/gpu-check.json)

clean:
	rm -rf $(VENV) .envloop .dagster_home
