# Two commands set everything up on a fresh clone:
#   make demo   create .venv, install, train the demo run
#   make test   create .venv, install, run the test suite
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO_CONFIG ?= configs/mnist_downpour.toml
PYTEST_ARGS ?=
# the docs plugins' notices about MkDocs' own future, printed on every build
export NO_MKDOCS_2_WARNING := 1
export DISABLE_MKDOCS_2_WARNING := true
# data sets the repository does not ship (Fashion-MNIST): the workplace's shared copy
ifneq ($(wildcard ../shared/data),)
export SCALEOUT_DATA ?= $(abspath ../shared/data)
endif

.PHONY: demo test test-slow test-all lint docs docs-serve bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch first and pinned: a CPU wheel of this version is on these machines; an open
	# range would pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/scaleout train $(DEMO_CONFIG) --overwrite

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports --no-cache
	$(BIN)/mkdocs build --strict --quiet
	$(BIN)/pytest -m "not slow" $(PYTEST_ARGS)

test-slow: $(STAMP)
	$(BIN)/pytest -m slow $(PYTEST_ARGS)

test-all: $(STAMP)
	$(BIN)/pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports --no-cache

docs: $(STAMP)
	$(BIN)/mkdocs build --strict

docs-serve: $(STAMP)
	$(BIN)/mkdocs serve

# make bench SUITE=async [OUT=results/async_lm]: one benchmark suite (benchmarks/)
bench: $(STAMP)
	$(BIN)/python -m benchmarks $(SUITE) $(if $(OUT),--out $(OUT))

clean:
	rm -rf $(VENV) runs build site src/*.egg-info .pytest_cache .ruff_cache
