PY ?= python

.PHONY: test test-all test-neuron lint format bench e2e bench-pipeline bench-long-stream mutate

test:
	$(PY) -m pytest -q

test-all:
	$(PY) -m pytest -q -m "not neuron"

test-neuron:
	$(PY) -m pytest -q -m neuron

lint:
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy

format:
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

bench:
	$(PY) -m perf.bench_kernels

e2e:
	$(PY) -m perf.e2e

bench-pipeline:
	$(PY) -m perf.bench_pipeline

bench-long-stream:
	$(PY) -m perf.bench_long_stream

# Mutation check (not in CI): curated mutants in tools/mutants.py, each in a scratch copy of HEAD.
mutate:
	$(PY) -m tools.mutate
