# The README's two commands are `make run` and `make test`. Each creates the
# virtualenv on first use and installs the project with exact pins.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: install run test test-fast clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# DS_BUILD_OPS=0: DeepSpeed compiles its CUDA ops at first use on a GPU, not at install.
	DS_BUILD_OPS=0 $(BIN)/pip install --quiet -c constraints.txt -e '.[test]'
	touch $(STAMP)

## The main job on the embedded default (SQLite, local files, built-in benchmark).
run: install
	$(BIN)/envloop demo

## The test suite.
test: install
	$(BIN)/python -m pytest -n 2 --dist loadfile

clean:
	rm -rf $(VENV) .envloop .dagster_home
