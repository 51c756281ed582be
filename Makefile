# The two commands of the README. Each installs what it needs first (scripts/ensure-deps).
PYTHON ?= python3
export PYTHON

.PHONY: demo test bench deps

deps:
	@./scripts/ensure-deps

demo: deps
	$(PYTHON) -m gradhealth demo

test: deps
	$(PYTHON) -m pytest -q -n 2 --dist loadfile --durations=30

bench: deps
	$(PYTHON) -m gradhealth bench
