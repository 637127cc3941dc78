PY ?= python
# `make bench`, `make e2e`, ... leave the tracked results (perf/results, perf/REPORT.md) untouched, as every
# `python -m perf.*` command does by default: the benchmarks print only, the end-to-end model writes under
# $(SCRATCH) (untracked). `make <target> UPDATE=1` passes --save: it regenerates the tracked files.
SCRATCH ?= build/perf
UPDATE ?=
SAVE := $(if $(UPDATE),--save,)

.PHONY: test test-all test-neuron lint format bench e2e bench-pipeline bench-long-stream bench-quality mutate trace-replay train-demo

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
	$(PY) -m perf.bench_kernels $(SAVE)

e2e:
	$(PY) -m perf.e2e $(if $(UPDATE),--save,--out-dir $(SCRATCH))

bench-pipeline:
	$(PY) -m perf.bench_pipeline $(SAVE)

bench-long-stream:
	$(PY) -m perf.bench_long_stream $(SAVE)

# video quality + numerics gate (docs/quality.md): a 3-minute stream among others; QUICK=1 for the < 1 min run
bench-quality:
	$(PY) -m perf.bench_quality $(SAVE) $(if $(QUICK),--quick,)

# Mutation check (not in CI): curated mutants in tools/mutants.py, each in a scratch copy of HEAD.
mutate:
	$(PY) -m tools.mutate

# the kernels' instruction streams against tests/data/trace_replay.json (diff, exit 1 on a change);
# `make trace-replay UPDATE=1` rewrites the file for an intended change (say why in the commit)
trace-replay:
	$(PY) -m tools.trace_replay $(if $(UPDATE),--update,)

# Retrain the demo model from scratch (autoencoder, then DiT + text encoder; ~60 min on 2 cores) into
# $(SCRATCH)/demo-weights; copy the .safetensors into rolling_forcing/demo/weights/ to ship them.
train-demo:
	$(PY) -m nki_ardiff train-demo --out $(SCRATCH)/demo-weights $(if $(SMOKE),--smoke,)
