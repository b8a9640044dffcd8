# Set-up, the main job, the tests. See README.md.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup browser run docs test test-fast coverage check lint format-check deadcode typecheck bench selftest-rehearsal

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
	# setuptools warns on every editable install of a package whose folders are named otherwise
	# (setup.py maps model/ to ditfleet.model, ...): that is this layout's point, so not shown.
	PYTHONWARNINGS="ignore:Editable installation" $(PY) -m pip install -q -e '.[test]'

run:
	$(VENV)/bin/ditfleet run jobs/examples/tiny.yaml

# Pages written from the code (a test fails when one is stale): the job file's reference.
docs:
	$(PY) -m ditfleet.jobs.spec.reference > docs/job-file.md

# Two workers (pytest-xdist): much of the suite waits (Ray start-up, child processes, leases), and
# the other worker uses that time. Each worker has its own session fixtures (Ray cluster, S3
# endpoint) and its share of the cores for torch (tests/conftest.py: one thread each on 2 cores);
# no test depends on wall-clock timing, so a busy machine is slower, not red. Work stealing: a
# worker that runs out takes queued tests from the other, so the run does not end on one worker's
# long tail (the tests take 0.01 s to 40 s).
test:
	$(PY) -m pytest -q -n 2 --dist worksteal --durations=30

# The unit tests that take under about a second each: the loop while changing code.
test-fast:
	$(PY) -m pytest -q -n 2 --dist worksteal tests/unit -m "not slow"

# Line coverage of the five layers over the whole suite, Ray actors and other Python children
# included ([tool.coverage.*] in pyproject.toml); the report lists each file, the total last.
coverage:
	rm -rf build/coverage && mkdir -p build/coverage
	$(PY) -m coverage run -m pytest -q
	$(PY) -m coverage combine -q
	$(PY) -m coverage report

# The static checks CI runs before the tests (.ci/run); each fails the run.
PY_TREES := ditfleet model compile workers driver jobs recipes tests bench
LAYERS := model compile workers driver jobs

check: lint format-check deadcode typecheck

lint:
	$(VENV)/bin/ruff check $(PY_TREES)

format-check:
	$(VENV)/bin/ruff format --check $(PY_TREES)

# Vulture at confidence 80 (unused imports, variables, unreachable code) over the layers and
# ditfleet/; .ci/vulture_whitelist.py lists, with why, the names it reports that are used.
deadcode:
	$(VENV)/bin/vulture --min-confidence 80 $(LAYERS) ditfleet .ci/vulture_whitelist.py

# mypy over ditfleet.<layer> as users import it ([tool.mypy] in pyproject.toml): setup.py maps the
# top-level folders to ditfleet.<layer>, which mypy cannot follow, so it reads a tree of symlinks
# laid out as the installed package (build/typecheck/ditfleet/<layer> -> <layer>/).
typecheck:
	rm -rf build/typecheck && mkdir -p build/typecheck/ditfleet
	for f in ditfleet/*; do ln -s "$(CURDIR)/$$f" build/typecheck/ditfleet/; done
	for l in $(LAYERS); do ln -s "$(CURDIR)/$$l" build/typecheck/ditfleet/$$l; done
	$(VENV)/bin/mypy $(foreach l,$(LAYERS),-p ditfleet.$(l))

# The node self-test rehearsed on this CPU under the GPU image's torch (2.11.0, the CUDA 13 build
# PyPI serves: ~3 GB of wheels, 4.6 GB installed; it imports and runs on a CPU) in a side
# environment, ditfleet installed there from a wheel of this checkout with its dependencies (torch
# stays as installed), with diffusers and transformers for the side-by-side checks. The --tiny run
# with Inductor; run from outside the checkout so that the installed package is the one imported.
# Heavy (minutes on 2 cores), so not in CI; docs/real-model.md gives its output.
REHEARSAL_TORCH ?= 2.11.0
REHEARSAL_VENV ?= /tmp/venv211
REHEARSAL_OUT ?= /tmp/st211
REHEARSAL_WHEEL_DIR ?= /tmp/ditfleet-rehearsal-wheel
REHEARSAL_PY := $(REHEARSAL_VENV)/bin/python

selftest-rehearsal:
	test -x $(REHEARSAL_PY) || python3 -m venv $(REHEARSAL_VENV)
	$(REHEARSAL_PY) -m pip install -q torch==$(REHEARSAL_TORCH)
	rm -rf $(REHEARSAL_WHEEL_DIR)
	$(REHEARSAL_PY) -m pip wheel -q --no-deps -w $(REHEARSAL_WHEEL_DIR) .
	$(REHEARSAL_PY) -m pip install -q --force-reinstall --no-deps $(REHEARSAL_WHEEL_DIR)/ditfleet-*.whl
	$(REHEARSAL_PY) -m pip install -q $(REHEARSAL_WHEEL_DIR)/ditfleet-*.whl numpy diffusers transformers
	$(REHEARSAL_PY) -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$(REHEARSAL_TORCH)')"
	cd /tmp && $(REHEARSAL_PY) -m ditfleet.workers.selftest --tiny --out $(REHEARSAL_OUT) \
	  --compile-backend inductor --budget-s 900 --limit-scale 3
