# picrag: the two commands. Both install what they need on first use (idempotent).
VENV ?= .venv
PORT ?= 8000
ARGS ?=

.PHONY: setup serve test bench-serving

setup:
	bash scripts/setup.sh

serve: setup
	OMP_WAIT_POLICY=PASSIVE $(VENV)/bin/picrag serve --port $(PORT) $(ARGS)

test:
	bash scripts/setup.sh --test
	OMP_WAIT_POLICY=PASSIVE $(VENV)/bin/python -m pytest -q $(ARGS)

bench-serving: setup
	OMP_WAIT_POLICY=PASSIVE $(VENV)/bin/python benchmarks/serving_speed.py $(ARGS)
