# picrag: the two commands. Both install what they need on first use (idempotent).
VENV ?= .venv
PORT ?= 8000
ARGS ?=

.PHONY: setup serve test bench-serving

setup:
	bash scripts/setup.sh

serve: setup
	OMP_WAIT_POLICY=PASSIVE $(VENV)/bin/picrag serve --port $(PORT) $(ARGS)

# pytest-xdist workers; TEST_WORKERS=0 runs the suite in this process.
TEST_WORKERS ?= 2

test:
	bash scripts/setup.sh --test
	OMP_WAIT_POLICY=PASSIVE $(VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup $(ARGS)

bench-serving: setup
	OMP_WAIT_POLICY=PASSIVE $(VENV)/bin/python benchmarks/serving_speed.py $(ARGS)
