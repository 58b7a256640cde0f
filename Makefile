VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: setup demo test durations bench lint ui clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev,ray]' torch==2.13.0
	touch $(STAMP)

demo: setup
	$(PY) -m flows.demo

# Two workers, each taking whole files (module fixtures such as the Ray session stay in one);
# tests/conftest.py makes the test_ray*.py files one unit, so that no worker waits on the other's Ray,
# and hands the longest files out first (as tests/durations.json recorded them).
test: setup
	$(PY) -m pytest -q -p no:cacheprovider -n 2 --dist loadfile

# The whole suite, as make test runs it, writing the seconds each test file took to
# tests/durations.json: the workers are handed the longest files first.
durations: setup
	$(PY) -m pytest -q -p no:cacheprovider -n 2 --dist loadfile --record-durations

bench: setup
	@for b in benchmarks/bench_*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

ui: setup
	$(PY) -m flows.cli ui

clean:
	rm -rf $(VENV) runs
