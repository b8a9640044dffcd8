# Set-up, the main job, the tests. See README.md.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup browser run test test-fast lint bench

# Headless Chromium (Debian's package) renders the job report in one test,
# tests/integration/test_report.py::test_report_page_draws_plot_and_images (skipped without it).
# Not part of setup: about a hundred apt packages for one test. .ci/run installs it.
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || { \
	  SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$SUDO apt-get update && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y chromium; }

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
	$(VENV)/bin/ruff check ditfleet model compile workers driver jobs recipes tests bench
