# picrag: the two commands. Both install what they need on first use (idempotent).
VENV ?= .venv
PORT ?= 8000
ARGS ?=

.PHONY: setup serve test bench-serving

setup:
	bash scripts/setup.sh

serve: setup
	OMP_WAIT_POLICY=PASSIVE $(VENV)/bin/picrag serve --port $(PORT) $(ARGS)

# pytest-xdist workers; TEST_WORKERS=0 runs the suite in this process. Three workers on two cores,
# each process (tests and the servers they start) on one OpenMP thread: while one worker waits on
# a server or a start, the other two keep both cores busy, and no worker's torch threads contend
# with another's (a five-module slice: 268 s with two workers at torch's default threads, 257 s
# with one thread each, 240 s with three workers, 2026-12-07).
TEST_WORKERS ?= 3
TEST_THREADS ?= 1

test:
	bash scripts/setup.sh --test
	OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=$(TEST_THREADS) $(VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup $(ARGS)

bench-serving: setup
	OMP_WAIT_POLICY=PASSIVE $(VENV)/bin/python benchmarks/serving_speed.py $(ARGS)
