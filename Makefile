# The two commands of the README. Each one runs the idempotent set-up first.
VENV ?= $(or $(HVDMAGIC_VENV),.venv)
PY := $(VENV)/bin/python
export SPARK_LOCAL_IP ?= 127.0.0.1

.PHONY: setup demo test test-fast bench clean

# HVDMAGIC_TENSORFLOW=none skips TensorFlow (docs/frameworks.md lists the other settings).
setup:
	@HVDMAGIC_VENV="$(abspath $(VENV))" bash scripts/setup.sh

demo: setup
	$(PY) scripts/run_notebook.py notebooks/quickstart.ipynb

# Two pytest-xdist workers, each taking whole files (a notebook's cells stay in order on one kernel): the
# suite waits more than it computes, so two fit this 2-core machine (docs/development.md, "CI's budget").
# TEST_WORKERS=0 runs one process.
TEST_WORKERS ?= 2
# DURATIONS=0: every test's setup, call and teardown time (docs/development.md's table of where the time goes).
DURATIONS ?= 20
test: setup
	$(PY) -m ruff check .
	$(PY) -m pytest -p no:cacheprovider -ra --durations=$(DURATIONS) -n $(TEST_WORKERS) --dist loadfile --nbval-lax \
		tests notebooks

# The unit tier only (tests/conftest.py's TIERS): no Spark, no rank process, no kernel; seconds.
test-fast: setup
	$(PY) -m ruff check .
	$(PY) -m pytest -p no:cacheprovider -ra -m unit tests

# The benchmarks of docs/performance*.md: tables on stdout, every figure in artifacts/*.json.
bench: setup
	$(PY) -m pip install -q -e '.[dev,bench]'
	$(PY) benchmarks/bench_launch.py
	$(PY) benchmarks/bench_session.py
	$(PY) benchmarks/bench_report.py

clean:
	rm -rf $(VENV) artifacts

# The lock (docs/dependencies.md). `make lock` writes requirements/lock.txt anew: the newest versions
# that pyproject.toml (core and dev) and requirements/lock.in allow, for x86_64 Linux and CPython
# LOCK_PYTHON (the project machines'; some pins need that 3.11 or a later one).
# LOCK_UPGRADE= keeps the current pins where they still fit; LOCK_UPGRADE="-P cloudpickle" moves one.
.PHONY: lock test-latest test-profile test-profiles
LOCK_PYTHON ?= 3.11.7
LOCK_UPGRADE ?= --upgrade
# uv does not read pip's configuration: it is told where pip finds torch's CPU wheel.
LOCK_FIND_LINKS ?= $(or $(PIP_FIND_LINKS),$(shell python3 -m pip config get global.find-links 2>/dev/null))
lock:
	@HVDMAGIC_VENV="$(abspath $(VENV))" HVDMAGIC_LOCK=$(if $(wildcard requirements/lock.txt),,none) \
		bash scripts/setup.sh tools
	$(VENV)/bin/uv pip compile pyproject.toml requirements/lock.in --extra dev --extra spark \
		--excludes requirements/excludes.txt $(foreach link,$(LOCK_FIND_LINKS),--find-links $(link)) \
		--python-version $(LOCK_PYTHON) --python-platform x86_64-manylinux_2_28 $(LOCK_UPGRADE) \
		--custom-compile-command "make lock" --quiet -o requirements/lock.txt

# `make test` in its own virtualenv with the newest versions pyproject.toml's ranges allow, not the
# lock's (torch and TensorFlow stay setup.sh's: horovod is built for them). SETUP_ONLY=1: the set-up only.
LATEST_VENV ?= .venv-latest
test-latest:
	@HVDMAGIC_LOCK=latest $(MAKE) --no-print-directory $(if $(SETUP_ONLY),setup,test) VENV="$(LATEST_VENV)"

# The runtime profiles (requirements/profiles/, docs/dependencies.md): hvdmagic installed into the
# package sets of Databricks' ML runtimes, Colab and a new virtualenv, each in .venv-<profile>, then
# the tests marked `profile` and two notebooks. On demand and before a release, not in CI.
# `make test-profile PROFILE=dbr-16.4` runs one; `make test-profiles` runs them all, prints the
# table and writes it into docs/runtimes.md's support table. The set-up first: Java, Open MPI, chromium and uv.
test-profile: setup
	@test -n "$(PROFILE)" || { echo "PROFILE= one of: $(basename $(notdir $(wildcard requirements/profiles/*.txt)))"; exit 2; }
	python3 scripts/profiles.py run $(PROFILE)

test-profiles: setup
	python3 scripts/profiles.py run; status=$$?; \
		python3 scripts/profiles.py table --docs >/dev/null; exit $$status
