# Set-up, the main job, the tests. See README.md.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup run test test-fast lint bench

setup:
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0   # the CPU build; an unpinned torch pulls a CUDA build
	$(PY) -m pip install -q -e '.[test]'

run:
	$(VENV)/bin/ditfleet run jobs/examples/tiny.yaml

test:
	$(PY) -m pytest -q

test-fast:
	$(PY) -m pytest -q -m "not slow"

lint:
	$(VENV)/bin/ruff check model compile workers driver jobs tests bench
