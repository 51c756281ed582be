# The two commands of the README, and the manual. Each installs what it needs first, and only that
# (scripts/ensure-deps demo|test|docs).
PYTHON ?= python3
export PYTHON

.PHONY: demo test test-fast bench deps docs

deps:
	@./scripts/ensure-deps test

demo:
	@./scripts/ensure-deps demo
	$(PYTHON) -m gradhealth demo

test: deps
	$(PYTHON) -m pytest -q -n 2 --dist loadfile --durations=30

# The quick subset: no multi-process or long test (-m "not slow"), so no DeepSpeed op to build either.
test-fast:
	@./scripts/ensure-deps test-fast
	$(PYTHON) -m pytest -q -n 2 --dist loadfile -m "not slow" --durations=20

bench: deps
	$(PYTHON) -m gradhealth bench

# The manual (docs/, mkdocs.yml) built into site/; --strict: a broken link or a missing API reference fails.
docs:
	@./scripts/ensure-deps docs
	NO_MKDOCS_2_WARNING=1 $(PYTHON) -m mkdocs build --strict --site-dir site
	@echo "gradhealth: the manual is in site/index.html (or: $(PYTHON) -m mkdocs serve)"
