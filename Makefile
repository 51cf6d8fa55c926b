# The two commands of the README. Each one runs the idempotent set-up first.
VENV ?= $(or $(HVDMAGIC_VENV),.venv)
PY := $(VENV)/bin/python
export SPARK_LOCAL_IP ?= 127.0.0.1

.PHONY: setup demo test bench clean

# HVDMAGIC_TENSORFLOW=none skips TensorFlow (docs/frameworks.md lists the other settings).
setup:
	@HVDMAGIC_VENV="$(abspath $(VENV))" bash scripts/setup.sh

demo: setup
	$(PY) scripts/run_notebook.py notebooks/quickstart.ipynb

test: setup
	$(PY) -m ruff check .
	$(PY) -m pytest -p no:cacheprovider -ra --nbval-lax tests notebooks

# The benchmarks of docs/performance*.md: tables on stdout, every figure in artifacts/*.json.
bench: setup
	$(PY) -m pip install -q -e '.[dev,bench]'
	$(PY) benchmarks/bench_launch.py
	$(PY) benchmarks/bench_session.py
	$(PY) benchmarks/bench_report.py

clean:
	rm -rf $(VENV) artifacts
